"""Matmul rates at the shapes of Qwen-Image's image-stream linear layers, bf16 against float8: one table.

The FLOP ceilings of the step (benchmarks/train_step.py) divide its FLOPs by a matmul rate. This measures the
rates at the shapes the step runs: one micro-batch of 8 samples with true CFG at 512² is 16 sequences of 1,024
image tokens, so M = 16,384 rows into the block's six image-stream linear layers (q, k, v and out: 3,072 ->
3,072; the MLP: 3,072 -> 12,288 -> 3,072), the layers the merged rollout and model.fp8_train run in float8.

Columns per shape (each the mean of --iters calls after one warm-up, between CUDA events on a GPU):
- bf16: `F.linear` in bf16;
- float8 matmul: `torch._scaled_mm` on operands already quantized rowwise (e4m3, one scale per row of each): the
  float8 matmul alone, the rate a float8 ceiling divides by;
- float8 linear: `F.linear` with the weight as torchao's float8 tensor (`models.lora.float8_weight`, rowwise), so
  the activation is quantized in the call, as the merged rollout's float8 forwards run;
- float8 linear, tensorwise: the same with one scale per tensor (model.fp8_scaling tensorwise).
With --compile each call is torch.compile'd first (the step's forwards are: the activation's cast then fuses into
the kernels before it). The last row weighs the shapes by their FLOPs in one block: the block's rates.

GPU:  PYTHONPATH=src python3 benchmarks/matmul.py [--compile]     (needs torchao, the fp8 extra)
CPU:  uv run --extra fp8 python benchmarks/matmul.py --tiny       (tiny shapes: checks the script end to end)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fgrpo.models.lora import float8_weight

# (K, N, layers of this shape in one block): Qwen-Image's image stream, hidden 3,072, MLP 12,288
QWEN_IMAGE_SHAPES = ((3072, 3072, 4), (3072, 12288, 1), (12288, 3072, 1))
TINY_SHAPES = ((32, 32, 4), (32, 128, 1), (128, 32, 1))


def rate(flop: float, seconds: float) -> str:
    """TFLOP/s for a table cell: whole numbers at a GPU's rates, three digits at a CPU's."""
    r = flop / seconds / 1e12
    return f"{r:.0f}" if r >= 10 else f"{r:.3g}"


def rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` [rows, cols] as torchao quantizes a weight rowwise (`float8_weight`): e4m3 data and one fp32 scale per
    row [rows, 1]."""
    q: Any = float8_weight(t, "rowwise", "benchmark operand")  # torchao's Float8Tensor: qdata, scale
    return q.qdata, q.scale.float()


def mean_seconds(fn: Callable[[], torch.Tensor], iters: int, device: torch.device) -> float:
    """The mean wall time of fn() over `iters` calls after one warm-up call."""
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


KINDS = ("bf16", "float8 matmul", "float8 linear", "float8 linear, tensorwise")


def measure(
    m: int, k: int, n: int, iters: int, device: torch.device, compile: bool = False
) -> dict[str, float]:
    """Seconds per call of the four matmuls of one shape (each torch.compile'd first with `compile`), and the float8
    matmul's largest error relative to the bf16 output's largest magnitude (a check that it computes the same
    product)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) / k**0.5
    x8, sx = rowwise(x)
    w8, sw = rowwise(w)
    w_row = float8_weight(w, "rowwise", "benchmark weight")
    w_tensor = float8_weight(w, "tensorwise", "benchmark weight")

    def scaled(x8: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(  # pyright: ignore[reportPrivateImportUsage] - torch's float8 matmul
            x8, w8.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16, use_fast_accum=True
        )

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    mm, lin = (torch.compile(scaled), torch.compile(linear)) if compile else (scaled, linear)
    with torch.no_grad():
        ref = F.linear(x, w)
        err = float((mm(x8, sx).float() - ref.float()).abs().max() / ref.float().abs().max())
        calls = {
            "bf16": lambda: lin(x, w),
            "float8 matmul": lambda: mm(x8, sx),
            "float8 linear": lambda: lin(x, w_row),
            "float8 linear, tensorwise": lambda: lin(x, w_tensor),
        }
        return {kind: mean_seconds(calls[kind], iters, device) for kind in KINDS} | {"error": err}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (script check)")
    ap.add_argument("--rows", type=int, default=0, help="M, the rows of a call (0: 16,384; tiny: 32)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per cell")
    ap.add_argument(
        "--compile", action="store_true", help="torch.compile each call first, as the step runs them"
    )
    args = ap.parse_args(argv)
    if args.compile:
        torch._dynamo.config.recompile_limit = 64  # one graph per (shape, weight kind)
    device = torch.device("cpu" if args.tiny else "cuda")
    m = args.rows or (32 if args.tiny else 16 * 1024)
    shapes = TINY_SHAPES if args.tiny else QWEN_IMAGE_SHAPES
    print(
        f"# {'CPU' if args.tiny else torch.cuda.get_device_name()}, torch {torch.__version__}, M = {m} rows, "
        + ("compiled" if args.compile else "eager")
    )
    print("| K -> N (layers a block) | " + " | ".join(f"{k} TFLOP/s" for k in KINDS) + " | float8 / bf16 |")
    print("|---|" + "---:|" * (len(KINDS) + 1))
    block_s = dict.fromkeys(KINDS, 0.0)
    block_flop = 0.0
    for k, n, count in shapes:
        s = measure(m, k, n, args.iters, device, args.compile)
        if s["error"] > 0.1:
            raise SystemExit(f"float8 matmul of {k} -> {n}: error {s['error']:.3f} of the output's range")
        for kind in KINDS:
            block_s[kind] += count * s[kind]
        block_flop += count * 2 * m * k * n
        cells = " | ".join(rate(2 * m * k * n, s[kind]) for kind in KINDS)
        print(f"| {k} -> {n} ({count}) | {cells} | {s['bf16'] / s['float8 matmul']:.2f}x |")
    cells = " | ".join(rate(block_flop, block_s[kind]) for kind in KINDS)
    print(f"| **one block** | {cells} | {block_s['bf16'] / block_s['float8 matmul']:.2f}x |")


if __name__ == "__main__":
    main()
