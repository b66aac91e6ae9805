"""Building the configured generator (real, tiny random, or the text renderer), and the transformer options the
trainer toggles (LoRA, a LoRA to start from, checkpointing, attention backend, regional compile, the compiled VAE
decoder)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from fgrpo.errors import ConfigError, MissingFileError
from fgrpo.models.base import FlowModel
from fgrpo.models.qwen_image import QWEN_IMAGE_LORA_TARGETS

if TYPE_CHECKING:
    from fgrpo.config import ModelConfig
    from fgrpo.models.base import Transformer

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
    transformer: Transformer,
    *,
    rank: int,
    alpha: int,
    target_modules: Sequence[str] = QWEN_IMAGE_LORA_TARGETS,
    init: bool | Literal["gaussian"] = "gaussian",
    adapter_name: str = "default",
) -> list[nn.Parameter]:
    """Attach a peft LoRA adapter in place (diffusers' add_adapter keeps the module's class); returns its params.

    Only the adapter is trainable afterwards. `init` is peft's init_lora_weights ("gaussian" and True make
    B = 0, so the model is unchanged until the first update; False makes A and B random).
    """
    from peft import LoraConfig

    if rank < 1:
        raise ConfigError(f"lora rank must be >= 1, got {rank}")
    if not target_modules:
        raise ConfigError("lora target_modules is empty; name at least one Linear inside the transformer")
    transformer.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=init)
    transformer.add_adapter(config, adapter_name=adapter_name)
    return [p for n, p in transformer.named_parameters() if "lora_" in n]


# Ops whose outputs selective checkpointing keeps: the matmuls and attention, which cost O(K) and O(sequence)
# flops per output element to redo, against O(1) for the pointwise ops between them.
_MATMULS = ("mm", "addmm", "bmm", "baddbmm")
_ATTENTION = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
# A matmul whose inner size K is at most 1/8 of its output width N is redone: that is LoRA's B (K = rank,
# 2K flops per element, as cheap as pointwise) whose output, as wide as the base layer's, would double the memory
# kept per block (Qwen-Image at 512², CFG, micro-batch 8: ~60 GB kept without LoRA's B outputs, ~114 GB with).
_LOW_RANK = 8


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs):
    """torch's selective-checkpoint policy (see `selective_checkpoint`)."""
    from torch.utils.checkpoint import CheckpointPolicy

    if getattr(op, "namespace", "") != "aten":
        return CheckpointPolicy.PREFER_RECOMPUTE
    name = op.__name__.split(".")[0]
    if name in _ATTENTION:
        return CheckpointPolicy.MUST_SAVE
    if name in _MATMULS:
        a, b = args[1:3] if name in ("addmm", "baddbmm") else args[:2]  # addmm(bias, a, b)
        k, n = a.shape[-1], b.shape[-1]
        if _LOW_RANK * k > n:
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint(module: nn.Module, *args):
    """Activation checkpointing of one block that keeps the outputs of its matmuls (all but low-rank ones) and
    of attention, and recomputes only the pointwise ops between them in backward (torch's selective
    checkpointing; diffusers' `gradient_checkpointing_func`). The same kernels on the same inputs as the
    forward, so gradients equal full checkpointing's (and no checkpointing's) bit for bit."""
    return _checkpoint_keeping_matmuls(module.__call__, *args)


def _checkpoint_keeping_matmuls(fn: Callable, *args, **kwargs):
    """torch's non-reentrant checkpoint of fn(*args, **kwargs) with `_keep_matmuls_and_attention` as its policy."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    return checkpoint(
        fn,
        *args,
        use_reentrant=False,
        context_fn=partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention),
        **kwargs,
    )


def _selective_forward(forward: Callable, *args, **kwargs):
    """A compiled block's forward under selective checkpointing: the checkpoint inside the block's compiled graph,
    with `selective_checkpoint`'s policy (TorchTitan's order: checkpoint, then compile, then FSDP2's hooks outside).
    Around a block compiled on its own, the policy would keep matmul outputs that inductor's generated code reuses
    as scratch buffers (torch refuses: "cached ... has been mutated"); traced in one graph, what is kept is chosen
    at compile time instead."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return _checkpoint_keeping_matmuls(forward, *args, **kwargs)


def _call_block(module: nn.Module, *args):
    """The gradient-checkpointing function of compiled, selectively checkpointed blocks: a plain call, since the
    checkpoint is inside the block's forward (`_selective_forward`)."""
    return module(*args)


def configure_transformer(
    transformer: Transformer,
    *,
    gradient_checkpointing: bool = False,
    checkpoint_policy: Literal["full", "selective"] = "full",
    attention_backend: str = "",
    compile_blocks: bool = False,
    compile_backend: str = "inductor",
    compile_mode: str = "default",
) -> None:
    """Training/inference switches on a diffusers transformer, in place.

    checkpoint_policy: with gradient_checkpointing, what each block's backward recomputes: "full" its whole
    forward (diffusers' default), "selective" only what `selective_checkpoint` does not keep.
    attention_backend: a name of diffusers' attention dispatcher ("native", "flash", "_flash_3_hub",
    "sage", ...); "" keeps the default (torch SDPA); refused where no processor dispatches (diffusers' SD3).
    compile_blocks: regional torch.compile of the repeated transformer blocks (diffusers' compile_repeated_blocks): one compiled graph reused by all
    60 blocks, so compile time is that of one block. compile_backend: torch.compile's backend ("eager"
    traces and guards exactly like "inductor" without generating kernels: the tests use it). compile_mode:
    torch.compile's mode ("reduce-overhead": each block's kernels replayed as a CUDA graph).
    """
    if checkpoint_policy not in ("full", "selective"):
        raise ConfigError(f"model.checkpoint_policy={checkpoint_policy!r}: use 'full' or 'selective'")
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing(
            selective_checkpoint if checkpoint_policy == "selective" else None
        )
    if attention_backend:
        check_attention_backend(attention_backend, "model.attention_backend")
        if not dispatching_processors(transformer):
            raise ConfigError(
                f"model.attention_backend={attention_backend!r}: no attention processor of "
                f"{type(transformer).__name__} goes through diffusers' dispatcher (diffusers' SD3 calls torch SDPA "
                "itself), so no backend applies; drop the flag"
            )
        transformer.set_attention_backend(attention_backend)
    if compile_blocks:
        # One block's code is traced in several variants: no-grad rollout vs training forward, the first
        # block (input without grad) vs the rest, a padding mask or none, the checkpoint recompute, each
        # prompt length until dynamo marks the text length dynamic. That is more than dynamo's default
        # limit of 8, which fullgraph=True turns into a hard error; the variants are bounded, so we raise it.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
        if not getattr(transformer, "_repeated_blocks", None):
            # diffusers 0.40's SD3Transformer2DModel (SD3.5 and the SD3 text renderer) names no repeated block, so
            # compile_repeated_blocks would raise; its repeated block is the class of its layers.
            layers = getattr(transformer, "transformer_blocks", None)
            if layers:
                transformer._repeated_blocks = [type(layers[0]).__name__]
        # a family's inductor settings (qwen_image_edit's), as options of its blocks' compile only
        options = (
            getattr(transformer, "_fgrpo_compile_options", None) if compile_backend == "inductor" else None
        )
        # torch.compile takes a mode or options, not both: the default mode is left unnamed
        mode = {} if compile_mode == "default" else {"mode": compile_mode}
        transformer.compile_repeated_blocks(fullgraph=True, backend=compile_backend, options=options, **mode)
        transformer._fgrpo_compiled = True  # type: ignore[attr-defined]  # for the lines below
    # Selective checkpointing of compiled blocks moves into their forward (whichever of the two switches came first).
    if getattr(transformer, "_fgrpo_compiled", False):
        blocks = set(getattr(transformer, "_repeated_blocks", ()))
        for module in transformer.modules():
            if getattr(module, "_gradient_checkpointing_func", None) is not selective_checkpoint:
                continue
            module._gradient_checkpointing_func = _call_block  # type: ignore[assignment]  # a function attribute
            for block in module.modules():
                if type(block).__name__ in blocks and not isinstance(block.forward, partial):
                    block.forward = partial(_selective_forward, block.forward)


def compile_decoder(model: object, *, backend: str = "inductor") -> bool:
    """torch.compile of the model's VAE decoder, in place (`nn.Module.compile`: the module and its parameter names
    stay), for model.compile. The decoder runs once per rollout micro-batch without grad, so one graph per batch
    shape (benchmarks/RESULTS.md times the decode per family). The decoded pixels differ from the eager decoder's
    by rounding, so rewards may by a little; no log-prob depends on them. Returns False for a model without one
    (the text renderer paints pixels directly) or whose class sets `compile_vae_decoder = False` (LTX-2: no
    faster compiled)."""
    decoder = getattr(getattr(model, "vae", None), "decoder", None)
    if not isinstance(decoder, nn.Module) or not getattr(model, "compile_vae_decoder", True):
        return False
    decoder.compile(backend=backend)
    return True


def load_model(mcfg: ModelConfig, *, device: torch.device | str, dtype: torch.dtype) -> FlowModel:
    """The real model named by `mcfg.kind` from `mcfg.path` (local diffusers directory or hub id), frozen.

    LoRA and gradient checkpointing are the trainer's to add (they make parameters trainable); the
    attention backend and regional compile are applied here since they do not change the numbers' meaning.
    """
    if mcfg.kind == "qwen_image":
        from fgrpo.models.qwen_image import QwenImage

        model = QwenImage.from_pretrained(mcfg.path, dtype=dtype, device=device)
    elif mcfg.kind == "qwen_image_edit":
        from fgrpo.models.qwen_image_edit import QwenImageEdit

        model = QwenImageEdit.from_pretrained(mcfg.path, dtype=dtype, device=device)
    elif mcfg.kind == "sd3":
        from fgrpo.models.sd3 import SD3

        model = SD3.from_pretrained(mcfg.path, dtype=dtype, device=device)
    elif mcfg.kind == "ltx2":
        from fgrpo.models.ltx2 import LTX2, clip_kwargs

        model = LTX2.from_pretrained(mcfg.path, dtype=dtype, device=device, **clip_kwargs(mcfg))
    else:
        raise ConfigError(
            f"model.kind={mcfg.kind!r} is not loadable from a path; use 'qwen_image', 'qwen_image_edit', 'sd3' or "
            "'ltx2'"
        )
    configure_transformer(
        model.transformer,
        attention_backend=mcfg.attention_backend,
        compile_blocks=getattr(mcfg, "compile", False),
    )
    if getattr(mcfg, "compile", False):
        compile_decoder(model)
    return model


def build_model(mcfg: ModelConfig, device: torch.device, seed: int) -> FlowModel:
    """The generator named by model.kind, on `device`, frozen; `setup_trainable` makes parameters trainable."""
    dtype = torch.bfloat16 if mcfg.dtype == "bf16" else torch.float32
    if mcfg.kind == "textbed":
        from fgrpo.models.textbed import load_textbed

        model = load_textbed(mcfg.path or None, device=device, dtype=dtype)
    elif mcfg.kind in ("tiny_qwen_image", "tiny_qwen_image_edit", "tiny_sd3", "tiny_ltx2"):
        from fgrpo.models import tiny

        build = {
            "tiny_qwen_image": tiny.tiny_qwen_image,
            "tiny_qwen_image_edit": tiny.tiny_qwen_image_edit,
            "tiny_sd3": tiny.tiny_sd3,
            "tiny_ltx2": tiny.tiny_ltx2,
        }[mcfg.kind]
        extra = {}
        if mcfg.kind == "tiny_ltx2":
            from fgrpo.models.ltx2 import clip_kwargs

            extra = clip_kwargs(mcfg)
        model = build(seed=seed, device=device, dtype=dtype, **extra)
    else:
        return load_model(mcfg, device=device, dtype=dtype)  # configured as it loads
    configure_transformer(
        model.transformer, attention_backend=mcfg.attention_backend, compile_blocks=mcfg.compile
    )
    if mcfg.compile:
        compile_decoder(model)
    return model


def setup_trainable(transformer: Transformer, mcfg: ModelConfig) -> list[nn.Parameter]:
    """Attach LoRA (from model.init_lora if given) or unfreeze everything. Trainable parameters become fp32
    masters whatever the base dtype: FSDP2 casts them to the compute dtype, AdamW updates them in fp32."""
    if mcfg.lora:
        params = add_lora(
            transformer, rank=mcfg.lora_rank, alpha=mcfg.lora_alpha, target_modules=mcfg.lora_target_list
        )
        if mcfg.init_lora:
            load_lora_weights(transformer, mcfg.init_lora, rank=mcfg.lora_rank, alpha=mcfg.lora_alpha)
    else:
        params = list(transformer.requires_grad_(True).parameters())
    for p in params:
        p.data = p.data.float()
    configure_transformer(
        transformer,
        gradient_checkpointing=mcfg.gradient_checkpointing,
        checkpoint_policy=mcfg.checkpoint_policy,
    )
    return params


def _lora_file(path: str | Path) -> Path:
    p = Path(path)
    f = p / "adapter_model.safetensors" if p.is_dir() else p
    if not f.is_file():
        raise MissingFileError(
            f"model.init_lora: no LoRA at '{path}' (want a directory with adapter_model.safetensors, as fgrpo "
            "exports to runs/<exp_name>/lora, or a .safetensors file)"
        )
    return f


def _lora_header(f: Path) -> dict[str, Any]:
    """The LoraConfig that fgrpo's and diffusers' exports keep in the safetensors header ({} when absent)."""
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt") as fh:
            return json.loads((fh.metadata() or {}).get("lora_adapter_metadata", "{}"))
    except Exception as e:  # safetensors' own errors do not say which file
        raise ConfigError(f"model.init_lora: cannot read '{f}' as safetensors ({e})") from e


def _check_rank(f: Path, header: dict[str, Any], rank: int, alpha: int) -> None:
    saved_r, saved_alpha = header.get("transformer.r"), header.get("transformer.lora_alpha")
    if saved_r is not None and (saved_r != rank or saved_alpha != alpha):
        raise ConfigError(
            f"model.init_lora: '{f}' has rank {saved_r} / alpha {saved_alpha}, the model lora_rank {rank} / "
            f"lora_alpha {alpha}; pass --model.lora-rank {saved_r} --model.lora-alpha {saved_alpha}"
        )


def check_lora_file(path: str | Path, *, rank: int, alpha: int) -> Path:
    """What `load_lora_weights` can check without a model, from the file's header alone (validation runs it
    before the model is built): the adapter file is there, reads as safetensors, and has this rank and alpha.
    Returns the file."""
    f = _lora_file(path)
    _check_rank(f, _lora_header(f), rank, alpha)
    return f


def load_lora_weights(
    transformer: Transformer, path: str | Path, *, rank: int, alpha: int, adapter_name: str = "default"
) -> None:
    """Copy a diffusers-layout LoRA (keys `transformer.<module>.lora_A.weight`, the LoraConfig in the
    `lora_adapter_metadata` header) into the transformer's existing adapter, checking rank, alpha, targets,
    every shape and that every value is finite first (a NaN would make every update non-finite: each
    optimizer step skipped, the NaN adapter exported again). peft's `set_peft_model_state_dict` does the key
    mapping."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    f = check_lora_file(path, rank=rank, alpha=alpha)
    try:
        sd = {k.removeprefix("transformer."): v for k, v in load_file(str(f)).items()}
    except Exception as e:  # safetensors' own errors do not say which file
        raise ConfigError(f"model.init_lora: cannot read '{f}' as safetensors ({e})") from e
    own = {n: p for n, p in transformer.named_parameters() if f".{adapter_name}." in n and "lora_" in n}
    want = {n.replace(f".{adapter_name}.", "."): p for n, p in own.items()}
    missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or unexpected:
        raise ConfigError(
            f"model.init_lora: '{f}' does not fit the adapter (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "set model.lora_targets as for the run that wrote it"
        )
    for k, v in sd.items():
        if tuple(v.shape) != tuple(want[k].shape):
            raise ConfigError(
                f"model.init_lora: '{f}' {k} has shape {tuple(v.shape)}, the adapter {tuple(want[k].shape)}"
            )
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad = int((~torch.isfinite(v)).sum())
            raise ConfigError(
                f"model.init_lora: '{f}' tensor {k} holds {bad} non-finite value(s) (NaN or inf) of {v.numel()}; "
                "start from an adapter whose weights are finite (e.g. an earlier checkpoint's export)"
            )
    result = set_peft_model_state_dict(transformer, sd, adapter_name=adapter_name)
    if getattr(result, "unexpected_keys", None):
        raise ConfigError(f"model.init_lora: peft did not place {result.unexpected_keys[:3]} from '{f}'")


@contextlib.contextmanager
def adapters_disabled(transformer: Transformer) -> Iterator[None]:
    """The reference policy for the KL: the same transformer with its LoRA adapters switched off."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def dispatching_processors(transformer: nn.Module) -> list[Any]:
    """The attention processors that call diffusers' dispatcher, reading their backend at each call
    (`_attention_backend`, None: the dispatcher's default): those `set_attention_backend` reaches."""
    return [
        proc
        for module in transformer.modules()
        if hasattr(proc := getattr(module, "processor", None), "_attention_backend")
    ]


def check_attention_backend(name: str, field: str) -> None:
    """A one-line ConfigError naming `field` when `name` is not one of diffusers' attention backends or the package
    it needs is missing ("" passes: the default backend)."""
    if not name:
        return
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _check_attention_backend_requirements,
    )

    names = sorted(b.value for b in AttentionBackendName)
    if name not in names:
        raise ConfigError(f"{field}={name!r} is not a diffusers attention backend; use one of {names}")
    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except RuntimeError as e:
        raise ConfigError(f"{field}={name!r} cannot run here ({e}); install it or drop the flag") from None


class MergedLora:
    """bf16 copies of every LoRA layer's merged weight W + (alpha / r) B A, swapped in on demand.

    Inside `active()` each adapted Linear runs one matmul with its merged copy and its adapter is off, instead of
    the base matmul plus the adapter's two (whose output, as wide as the base layer's, is written and added
    once more). The copies are made once, from the weights as they are at construction (a rollout's weights do
    not change while it samples); on leaving, the original weight tensors and the adapters come back untouched,
    so forwards outside `active()` keep their bits. The merged forward differs from the unmerged one by rounding.

    targets: merge only the LoRA layers whose module name is one of these or ends in "." + one of them (a model's
    `merge_targets`: those whose inputs hold many tokens); empty: all of them.

    Needs the frozen base as ordinary tensors (unsharded, or FSDP2 with `parallel.shard='adapters'`); sharded
    adapters are gathered for the merge (a collective: every rank of the mesh must build it). Plain LoRA only
    (no DoRA or other variant, no bias on B, no fan_in_fan_out). Memory: one bf16 copy of each adapted weight.
    """

    def __init__(self, transformer: nn.Module, targets: Sequence[str] = ()):
        from peft.tuners.lora import Linear as LoraLinear
        from torch.distributed.tensor import DTensor

        def full(t: Any) -> torch.Tensor:
            return (t.full_tensor() if isinstance(t, DTensor) else t).detach()

        # (peft layer, its base weight's tensor, the merged copy); peft declares no attribute types, hence Any
        self.layers: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        for name, module in transformer.named_modules():
            if not isinstance(module, LoraLinear) or module.disable_adapters:
                continue
            if targets and not any(name == s or name.endswith("." + s) for s in targets):
                continue
            layer: Any = module
            weight = layer.get_base_layer().weight
            if isinstance(weight, DTensor):
                raise ConfigError(
                    f"model.merged_rollout: the base weight of '{name}' is sharded; add --parallel.shard adapters "
                    "(the frozen base whole on every rank) or drop --model.merged-rollout"
                )
            (adapter,) = layer.active_adapters
            if (
                adapter in layer.lora_variant
                or layer.fan_in_fan_out
                or layer.lora_B[adapter].bias is not None
            ):
                raise ConfigError(
                    f"model.merged_rollout merges plain LoRA; '{name}' has a variant, a bias or fan_in_fan_out"
                )
            a, b = full(layer.lora_A[adapter].weight), full(layer.lora_B[adapter].weight)
            merged = torch.addmm(full(weight).float(), b.float(), a.float(), alpha=layer.scaling[adapter])
            self.layers.append((layer, weight.data, merged.to(weight.dtype)))
        if not self.layers:
            raise ConfigError(
                f"model.merged_rollout found no LoRA layer to merge (targets {list(targets) or 'all'}); add LoRA "
                "or drop it"
            )

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Forwards inside run the merged copies with the adapters off (peft's switch, which also freezes the
        adapter; each parameter's requires_grad is restored as it was)."""
        trainable = [[p.requires_grad for p in layer.parameters()] for layer, _, _ in self.layers]
        for layer, _, merged in self.layers:
            layer.get_base_layer().weight.data = merged
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for (layer, original, _), flags in zip(self.layers, trainable, strict=True):
                layer.get_base_layer().weight.data = original
                layer.enable_adapters(True)
                for p, flag in zip(layer.parameters(), flags, strict=True):
                    p.requires_grad_(flag)
