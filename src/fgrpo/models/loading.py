"""Loading a real model by name, and the transformer options the trainer toggles (LoRA, checkpointing,
attention backend, regional compile). The tiny random models live in fgrpo.models.tiny."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from fgrpo.models.base import FlowModel
from fgrpo.models.qwen_image import QWEN_IMAGE_LORA_TARGETS

if TYPE_CHECKING:
    from fgrpo.config import ModelConfig

SD3_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


def add_lora(
    transformer: nn.Module,
    *,
    rank: int,
    alpha: float,
    target_modules: Sequence[str] = QWEN_IMAGE_LORA_TARGETS,
    init: str | bool = "gaussian",
    adapter_name: str = "default",
) -> list[nn.Parameter]:
    """Attach a peft LoRA adapter in place (diffusers' add_adapter keeps the module's class); returns its params.

    Only the adapter is trainable afterwards. `init` is peft's init_lora_weights ("gaussian" and True make
    B = 0, so the model is unchanged until the first update; False makes A and B random).
    """
    from peft import LoraConfig

    if rank < 1:
        raise ValueError(f"lora rank must be >= 1, got {rank}")
    if not target_modules:
        raise ValueError("lora target_modules is empty; name at least one Linear inside the transformer")
    transformer.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=init)
    transformer.add_adapter(config, adapter_name=adapter_name)
    return [p for n, p in transformer.named_parameters() if "lora_" in n]


def configure_transformer(
    transformer: nn.Module,
    *,
    gradient_checkpointing: bool = False,
    attention_backend: str = "",
    compile_blocks: bool = False,
    compile_backend: str = "inductor",
) -> None:
    """Training/inference switches on a diffusers transformer, in place.

    attention_backend: a name of diffusers' attention dispatcher ("native", "flash", "_flash_3_hub",
    "sage", ...); "" keeps the default (torch SDPA). compile_blocks: regional torch.compile of the
    repeated transformer blocks (diffusers' compile_repeated_blocks): one compiled graph reused by all
    60 blocks, so compile time is that of one block. compile_backend: torch.compile's backend ("eager"
    traces and guards exactly like "inductor" without generating kernels: the tests use it).
    """
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if attention_backend:
        transformer.set_attention_backend(attention_backend)
    if compile_blocks:
        # One block's code is traced in several variants: no-grad rollout vs training forward, the first
        # block (input without grad) vs the rest, a padding mask or none, the checkpoint recompute, each
        # prompt length until dynamo marks the text length dynamic. That is more than dynamo's default
        # limit of 8, which fullgraph=True turns into a hard error; the variants are bounded, so we raise it.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
        transformer.compile_repeated_blocks(fullgraph=True, backend=compile_backend)


def load_model(mcfg: ModelConfig, *, device: torch.device | str, dtype: torch.dtype) -> FlowModel:
    """The real model named by `mcfg.kind` from `mcfg.path` (local diffusers directory or hub id), frozen.

    LoRA and gradient checkpointing are the trainer's to add (they make parameters trainable); the
    attention backend and regional compile are applied here since they do not change the numbers' meaning.
    """
    if mcfg.kind == "qwen_image":
        from fgrpo.models.qwen_image import QwenImage

        model = QwenImage.from_pretrained(mcfg.path, dtype=dtype, device=device)
    elif mcfg.kind == "sd3":
        from fgrpo.models.sd3 import SD3

        model = SD3.from_pretrained(mcfg.path, dtype=dtype, device=device)
    else:
        raise ValueError(f"model.kind={mcfg.kind!r} is not loadable from a path; use 'qwen_image' or 'sd3'")
    configure_transformer(
        model.transformer,
        attention_backend=mcfg.attention_backend,
        compile_blocks=getattr(mcfg, "compile", False),
    )
    return model
