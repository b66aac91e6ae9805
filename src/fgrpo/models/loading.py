"""The transformer options the trainer and the builders toggle on a diffusers model: gradient checkpointing (full or
selective), the attention backend, regional compile, and the compiled VAE decoder."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from fgrpo.errors import ConfigError

if TYPE_CHECKING:
    from fgrpo.models.base import Transformer


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
