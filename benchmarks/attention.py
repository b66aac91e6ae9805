"""The attention backend and CUDA graphs on one real-size transformer forward: one table.

Each cell times `model.velocity` (one batched transformer forward, as the rollout and the trainer call it) on a
fixed input under no_grad: one warm-up call (it compiles), then `--iters` timed calls between CUDA events; the
mean ms per row (a row: one sample's conditional or unconditional half) and the largest |v - v_ref| against the
first backend of the same model, mode and mask. A backend that refuses the input prints its error in the cell.

Models (real size, random bf16 weights, 512²: benchmarks/rollout.py's builders):
    qwen_image  its attention goes through diffusers' dispatcher, so a backend is a dispatcher name, set as
                `model.attention_backend` sets it (`set_attention_backend`). Three inputs of equal rows: "joint" is
                true CFG as one forward (the default: the 24-token prompts and the 6-token negative prompt
                padded to one length, a key-padding mask on 18 of 1,048 keys), "split" the same CFG as two
                forwards of half the rows each, each trimmed to its own prompts (`split_cfg`: no mask), "none" a
                CFG-free forward of equal-length prompts (velocity passes no mask when nothing is padding).
                At 1328² (`--size 1328`, its native size) a row holds 6,889 image tokens against 1,024 at 512².
    sd3         SD3.5-Medium; diffusers 0.40's SD3 processor calls torch's SDPA itself (no dispatcher), so a
                backend is one of torch's SDPA kernels (torch.nn.attention.sdpa_kernel); it has no mask. Compiled,
                the kernel is chosen when a block is traced, so each backend's cells start from a reset
                (torch._dynamo.reset()) and are traced under its context.
Modes: eager; compile (regional, `configure_transformer(compile_blocks=True)`); cudagraphs (the same blocks
compiled with mode="reduce-overhead": each block's kernels replayed as a CUDA graph; three untimed calls, since
CUDA graph trees run a new input once, record it on the second call and replay from the third).

Backend names: qwen_image: native (SDPA's own choice), _native_cudnn, _native_efficient, _native_flash, flex
(torch's FlexAttention, the mask as a block mask), _flash_3 (FlashAttention-3; diffusers imports it as
`flash_attn_interface` of the `flash_attn_3` package, so a forward-only build serves this no-grad forward), ...;
sd3: default, flash, cudnn, efficient, math.

GPU:  PYTHONPATH=src python3 benchmarks/attention.py --model qwen_image --modes eager,compile,cudagraphs
GPU:  PYTHONPATH=src python3 benchmarks/attention.py --model sd3 --backends default,flash,cudnn,efficient
CPU:  uv run python benchmarks/attention.py --tiny --backends native,_native_math --modes eager
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import diffusers
import torch
from rollout import build_real, build_real_sd3, prompts_for, sync  # benchmarks/rollout.py

from fgrpo.models.base import Cond, FlowModel
from fgrpo.models.loading import check_attention_backend, configure_transformer
from fgrpo.models.qwen_image import QwenImage
from fgrpo.models.registry import build_tiny

SDPA_KERNELS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def backend_context(model: FlowModel, backend: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A context that runs the model's attention on `backend` (a dispatcher name for a model whose processors
    dispatch, set for the cell; a torch SDPA kernel for SD3's, which call SDPA directly)."""
    if isinstance(model, QwenImage):
        check_attention_backend(backend, "--backends")
        return lambda: dispatcher_backend(model.transformer, backend)
    if backend == "default":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend not in SDPA_KERNELS:
        raise SystemExit(f"--backends {backend!r}: SD3 takes default or one of {sorted(SDPA_KERNELS)}")
    kernel = getattr(SDPBackend, SDPA_KERNELS[backend])
    return lambda: sdpa_kernel([kernel])


@contextlib.contextmanager
def dispatcher_backend(transformer: Any, backend: str) -> Iterator[None]:
    transformer.set_attention_backend(backend)
    try:
        yield
    finally:
        transformer.reset_attention_backend()


def inputs(model: FlowModel, rows: int, cfg: bool, size: int, device: torch.device) -> tuple[Any, ...]:
    """(x_t, sigma, cond, guidance scale) of `rows` rows: with CFG, rows / 2 samples and the negative prompt " "
    (Qwen-Image's recipe; SD3's ""), else rows samples of equal-length prompts."""
    samples = rows // 2 if cfg else rows
    prompts = prompts_for(samples, 1, 0)
    negative = (" " if isinstance(model, QwenImage) else "") if cfg else None
    cond: Cond = model.encode(prompts, negative_prompt=negative)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, *model.latent_shape(size, size), generator=gen).to(device)
    sigma = torch.full((samples,), 0.6, device=device)
    return x, sigma, cond, 4.0 if cfg else 1.0


def time_cell(
    model: FlowModel,
    args: tuple[Any, ...],
    enter: Callable[[], Any],
    iters: int,
    warmup: int,
    device: torch.device,
) -> tuple[float, torch.Tensor]:
    """(mean seconds per forward, the last velocity)."""
    x, sigma, cond, scale = args

    def call() -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()  # a new iteration for CUDA graph trees (a no-op otherwise)
        return model.velocity(x, sigma, cond, guidance_scale=scale).clone()

    with enter():
        v = call()
        for _ in range(warmup - 1):
            call()
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                v = call()
            end.record()
            sync(device)
            return start.elapsed_time(end) / 1e3 / iters, v
        t0 = time.perf_counter()
        for _ in range(iters):
            v = call()
        return (time.perf_counter() - t0) / iters, v


def compile_for(model: FlowModel, mode: str) -> None:
    """The blocks compiled as `mode` asks (eager: left as they are)."""
    if mode != "eager":
        mode_name = "reduce-overhead" if mode == "cudagraphs" else "default"
        configure_transformer(model.transformer, compile_blocks=True, compile_mode=mode_name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen_image", choices=("qwen_image", "sd3"))
    ap.add_argument("--tiny", action="store_true", help="tiny random model on the CPU (script check)")
    ap.add_argument("--rows", default="16", help="comma-separated rows per forward (the recipe's: 16)")
    ap.add_argument("--backends", default="", help="comma-separated; the first is the reference of the diffs")
    ap.add_argument(
        "--modes", default="eager,compile", help="eager, compile and/or cudagraphs, in this order"
    )
    ap.add_argument(
        "--inputs", default="joint,split,none", help="qwen_image inputs: joint, split and/or none"
    )
    ap.add_argument("--iters", type=int, default=5, help="timed forwards per cell")
    ap.add_argument("--size", type=int, default=512, help="pixels per side (Qwen-Image's native: 1328)")
    ap.add_argument("--device", default="", help="default: cuda (tiny: cpu)")
    args = ap.parse_args()

    start = time.perf_counter()
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    qwen = args.model == "qwen_image"
    # FlashAttention-3 (_flash_3) only where it is installed: ask for it by name
    default_backends = "native,_native_cudnn,_native_efficient,flex" if qwen else "default,flash,cudnn"
    backends = [b.strip() for b in (args.backends or default_backends).split(",") if b.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(modes) - {"eager", "compile", "cudagraphs"}:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; use eager, compile and/or cudagraphs")
    kinds = [k.strip() for k in args.inputs.split(",") if k.strip()] if qwen else ["CFG"]  # SD3: no mask
    if unknown := set(kinds) - {"joint", "split", "none", "CFG"}:
        raise SystemExit(f"--inputs: unknown {sorted(unknown)}; use joint, split and/or none")
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = True
    diffusers.utils.logging.set_verbosity_error()  # set_attention_backend warns at every call that it is new
    if args.tiny:
        model = build_tiny(args.model)
    elif qwen:
        model = build_real(device, text_encoder=False)
    else:
        model = build_real_sd3(device)
    contexts = {b: backend_context(model, b) for b in backends}  # every name checked before any forward
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"# {args.model}{' (tiny)' if args.tiny else ''}, {args.size}x{args.size}, {name}, torch {torch.__version__}, "
        f"diffusers {diffusers.__version__}; built in {time.perf_counter() - start:.0f}s",
        flush=True,
    )
    print("| mode | input | rows | backend | ms per forward | ms per row | vs first | max abs diff |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for mode in modes:
        compile_for(model, mode)
        with torch.no_grad():
            for rows in rows_list:
                for kind in kinds:
                    x = inputs(model, rows, kind != "none", args.size, device)
                    if isinstance(model, QwenImage):
                        model.split_cfg = kind == "split"
                    ref: tuple[float, torch.Tensor] | None = None
                    for backend in backends:
                        cell = f"| {mode} | {kind} | {rows} | {backend} |"
                        if mode != "eager" and not qwen:
                            torch._dynamo.reset()  # trace again under this backend's context
                        warmup = 3 if mode == "cudagraphs" else 1
                        try:
                            seconds, v = time_cell(model, x, contexts[backend], args.iters, warmup, device)
                        except Exception as e:  # a backend that refuses this input: its one-line reason
                            print(
                                f"{cell} {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |",
                                flush=True,
                            )
                            continue
                        ref = ref or (seconds, v)
                        diff = (v - ref[1]).abs().max().item()
                        print(
                            f"{cell} {seconds * 1e3:.1f} | {seconds * 1e3 / rows:.2f} | {ref[0] / seconds:.3f}x | "
                            f"{diff:.2e} |",
                            flush=True,
                        )
    print(f"# {args.iters} timed forwards per cell; vs first = the first backend's time / this one's; wall "
          f"{time.perf_counter() - start:.0f}s")  # fmt: skip


if __name__ == "__main__":
    main()
