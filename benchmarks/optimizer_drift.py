"""How far a run's LoRA has moved and how steadily Adam's gradient pointed one way, read from its checkpoints.

    python benchmarks/optimizer_drift.py runs/a/checkpoints/step_000050 runs/b/checkpoints   # a step or all steps

Per checkpoint:
- ||B A||_F: the size of the LoRA update summed over its layers (unscaled by alpha / r: compare runs of one
  rank and alpha);
- the direction consistency of the gradient, the mean over parameters of |m_hat| / sqrt(v_hat), Adam's
  bias-corrected first and second moments. A gradient that never changes gives 1; one of random sign gives
  sqrt((1 - b1) / (1 + b1)) * sqrt(2 / pi), 0.18 at b1 = 0.9 (for b2 near 1). Adam moves each parameter by about
  lr times this ratio a step, and a steady direction adds up linearly where a random one adds up as the square
  root of the steps: a run whose gradient keeps one direction drifts further at the same lr;
- the gradient's scale per entry, sqrt(v_hat): its 10 / 50 / 90 % quantiles over every entry, against Adam's eps
  and the share of entries below it. Adam's step is lr m_hat / (sqrt(v_hat) + eps): the entries below eps move at
  a fraction sqrt(v_hat) / eps of a full step, as plain SGD would. AWM's `*-tiny-gpu` preset sets eps at ~3x the
  median of its step-40 checkpoint (RESULTS.md, stability-12); another model or batch has its own scale.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch

from fgrpo import checkpoint


def lora_update_norm(params: dict[str, torch.Tensor]) -> float:
    """sqrt(sum over LoRA layers of ||B A||_F^2), the layers found by their `lora_A` / `lora_B` names."""
    total = 0.0
    for name, a in params.items():
        if ".lora_A." in name:
            b = params[name.replace(".lora_A.", ".lora_B.")]
            total += float((b.double() @ a.double()).pow(2).sum())
    return math.sqrt(total)


def v_hat(s: dict[str, torch.Tensor], beta2: float) -> torch.Tensor:
    """Adam's bias-corrected second moment of one parameter's state, in float64: v / (1 - beta2^t)."""
    return s["exp_avg_sq"].double() / (1 - beta2 ** float(s["step"]))


def direction_consistency(state: dict[str, dict[str, torch.Tensor]], betas: tuple[float, float]) -> float:
    """Mean over every parameter entry of |m_hat| / sqrt(v_hat) (Adam's bias-corrected moments; 0 where v is 0)."""
    b1, b2 = betas
    total, count = 0.0, 0
    for s in state.values():
        t = float(s["step"])
        m_hat = s["exp_avg"].double() / (1 - b1**t)
        v = v_hat(s, b2)
        r = torch.where(v > 0, m_hat.abs() / v.sqrt(), torch.zeros_like(v))
        total += float(r.sum())
        count += r.numel()
    return total / count


QUANTILES = (0.1, 0.5, 0.9)


def gradient_scale(
    state: dict[str, dict[str, torch.Tensor]], beta2: float, eps: float
) -> tuple[tuple[float, ...], float]:
    """The QUANTILES of sqrt(v_hat) over every parameter entry (linear interpolation between order statistics, as
    numpy.quantile), and the share of entries with sqrt(v_hat) below eps."""
    scale = np.concatenate([v_hat(s, beta2).flatten().sqrt().float().numpy() for s in state.values()])
    return tuple(float(q) for q in np.quantile(scale, QUANTILES)), float((scale < eps).mean())


Row = tuple[str, int, float, float, tuple[float, ...], float, float]


def rows(paths: list[Path]) -> list[Row]:
    """(run, optimizer steps, ||B A||_F, direction consistency, sqrt(v_hat) quantiles, Adam's eps, the share of
    entries below it) per checkpoint; a path is a step directory or a run's checkpoint directory (all of its
    steps)."""
    out = []
    for p in paths:
        steps = [d for _, d in checkpoint.list_checkpoints(p)] or [p]
        for d in steps:
            params, osd = checkpoint.read_state(d)
            if not osd["state"]:
                raise SystemExit(f"{d}: no optimizer state to read (saved before the first step?)")
            group = osd["param_groups"][0]
            betas, eps = tuple(group["betas"]), float(group["eps"])
            step = int(max(float(s["step"]) for s in osd["state"].values()))
            run = d.parent.parent.name if d.parent.name == "checkpoints" else d.parent.name
            quantiles, below = gradient_scale(osd["state"], betas[1], eps)
            out.append(
                (
                    f"{run}/{d.name}",
                    step,
                    lora_update_norm(params),
                    direction_consistency(osd["state"], betas),
                    quantiles,
                    eps,
                    below,
                )
            )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="How far a run's LoRA moved, how steadily its gradient pointed one way, and its scale."
    )
    ap.add_argument("paths", nargs="+", type=Path, help="step directories or runs' checkpoint directories")
    args = ap.parse_args(argv)
    print(
        "| checkpoint | optimizer steps | LoRA update ‖B A‖_F | direction consistency "
        "| sqrt(v̂) 10 / 50 / 90 % | Adam eps (entries below it) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, step, norm, cons, quantiles, eps, below in rows(args.paths):
        scale = " / ".join(f"{q:.2e}" for q in quantiles)
        print(f"| {name} | {step} | {norm:.3f} | {cons:.3f} | {scale} | {eps:.1e} ({below:.0%}) |")


if __name__ == "__main__":
    main()
