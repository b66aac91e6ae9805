"""Where a group's OCR spread comes from on the text renderer: the SDE window, the initial noise, the word.

For W held-out words, J initial noises x_1 per word and K samples per (word, x_1) that share x_1 and differ
only in their own window position and SDE draws (the engine's `init_seeds`), the OCR scores s[w, j, k]
split exactly (balanced design, law of total variance) into

    Var(s) = E_wj Var_k(s)          the SDE window: what Flow-GRPO's transitions can be credited with
           + E_w Var_j(E_k s)       the initial noise, which no trained transition caused
           + Var_w(E_jk s)          the word (the group advantage removes it)

one row per window range. Sampling = the `tiny-gpu` rollout (10 steps, flow_sde 0.8, window of 2 steps drawn
per sample within the range) with CFG 3 by default, as in the CFG-3 records (`--cfg 1` samples as the preset does).

Why: a group-shared x_1 (`--grpo.group-init-noise`) only helps if x_1 makes much of a group's spread; the
JPEG reward suggested so, this measures it for the OCR reward and each window.

CPU:  uv run python benchmarks/textbed_variance.py                 (16 words x 4 x 8, ~6 min per range)
      uv run python benchmarks/textbed_variance.py --ranges 0,5 4,9 0,8
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from _textbed import load_renderer, preset_rollout

from fgrpo.data import load_prompts
from fgrpo.rewards import build_reward
from fgrpo.rollout.engine import DiffusersEngine


def variance_split(scores: np.ndarray) -> tuple[float, float, float]:
    """scores [W, J, K] -> (within (word, x_1), between x_1 given the word, between words); they sum to
    scores.var() because every cell has the same J and K."""
    return float(scores.var(2).mean()), float(scores.mean(2).var(1).mean()), float(scores.mean((1, 2)).var())


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="textbed checkpoint dir (default: the bundled one)")
    ap.add_argument("--words", type=int, default=16, help="first W held-out words")
    ap.add_argument("--noises", type=int, default=4, help="initial noises x_1 per word (J)")
    ap.add_argument(
        "--draws", type=int, default=8, help="samples per (word, x_1): own window and SDE draws (K)"
    )
    ap.add_argument("--ranges", nargs="+", default=["0,5", "4,9"], help="window ranges 'a,b' (steps [a, b))")
    ap.add_argument(
        "--cfg", type=float, default=3.0, help="guidance scale (1 = no CFG, as the tiny-gpu preset samples)"
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    device = torch.device(args.device)
    model = load_renderer(args.checkpoint, device)
    engine, reward = DiffusersEngine(model), build_reward("ocr")
    W, J, K = args.words, args.noises, args.draws
    words = load_prompts("textbed:heldout", require_quoted=True)[:W]
    prompts = [w for w in words for _ in range(J * K)]
    init_seeds = [30_000 + i // K for i in range(len(prompts))]
    seeds = [40_000 + i for i in range(len(prompts))]
    print(
        f"checkpoint {args.checkpoint or 'bundled'}, {W} held-out words x {J} x_1 x {K} draws, {args.device}\n"
    )
    print(
        "| window 2 in | mean OCR | variance | SDE window | x_1 | word | (word, x_1) groups with zero spread | s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in args.ranges:
        lo, hi = map(int, r.split(","))
        s = preset_rollout(guidance_scale=args.cfg, window_range=(lo, hi), micro_batch=args.batch)
        t0 = time.perf_counter()
        with torch.no_grad():
            images = np.concatenate(
                [
                    engine.generate(
                        prompts[a : a + args.batch],
                        seeds[a : a + args.batch],
                        s,
                        init_seeds=init_seeds[a : a + args.batch],
                    )
                    .images.cpu()
                    .numpy()
                    for a in range(0, len(prompts), args.batch)
                ]
            )
        sc = reward(images, prompts).scores.reshape(W, J, K)
        parts = variance_split(sc)
        tot = sum(parts)
        assert abs(tot - sc.var()) < 1e-6, (tot, sc.var())  # the split is exact for a balanced design
        print(
            f"| [{lo}, {hi}) | {sc.mean():.3f} | {tot:.4f} | "
            + " | ".join(f"{p:.4f} ({p / tot:.0%})" for p in parts)
            + f" | {(sc.std(2) == 0).mean():.0%} | {time.perf_counter() - t0:.0f} |"
        )


if __name__ == "__main__":
    main()
