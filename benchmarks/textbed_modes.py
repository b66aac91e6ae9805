"""What the text renderer draws, and how OCR scores it by text size: two tables.

Samples N seeds for each of the first W held-out words with the validation sampler (ODE, CFG 3 by default, as in
RESULTS.md's CFG-3 records; `--cfg 1` samples as `tiny-gpu` does), scores
every image with the OCR reward and measures the ink (pixels darker than the image's median by 80): how
much of the width the text covers, whether it touches the left/right border. Prints

1. the score by width-cover bin (does bigger text read better? where does the support end?);
2. the summary: mean, best of N per word, within- and between-word std, and the correlations of the
   score with the text's size, over all images and within words.

Why: with CFG 3, Flow-GRPO on the first committed renderer stopped near 0.87 held-out whatever the optimiser
settings (RESULTS.md, 'With CFG 3 from the first renderer'), while the policy made the text larger run after run. This shows how much of the start -> end gain the size
alone explains, for the pretrained checkpoint and (with --lora) for a trained adapter.

CPU:  uv run python benchmarks/textbed_modes.py                 (64 words x 8 seeds, ~7 min on 2 cores)
      uv run python benchmarks/textbed_modes.py --lora runs/<exp>/lora --words 32
GPU:  python benchmarks/textbed_modes.py --device cuda --words 256
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from _textbed import load_renderer, preset_rollout

from fgrpo.data import load_prompts
from fgrpo.rewards import build_reward
from fgrpo.rewards.ocr import is_exact
from fgrpo.rollout.engine import DiffusersEngine, validation_sampling

INK_CONTRAST = 80  # gray levels below the image's median (its background) that count as ink


def ink_extent(gray: np.ndarray) -> tuple[float, bool]:
    """(fraction of the columns holding ink, whether ink touches the 2 leftmost or rightmost columns)."""
    ink = gray.astype(np.int16) < np.median(gray) - INK_CONTRAST
    return float(ink.any(0).mean()), bool(ink[:, :2].any() or ink[:, -2:].any())


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="textbed checkpoint dir (default: the bundled one)")
    ap.add_argument("--lora", default=None, help="an adapter dir written by the trainer (runs/<exp>/lora)")
    ap.add_argument("--words", type=int, default=64, help="first W held-out words")
    ap.add_argument("--seeds", type=int, default=8, help="samples per word")
    ap.add_argument("--steps", type=int, default=10, help="ODE steps")
    ap.add_argument("--cfg", type=float, default=3.0, help="guidance scale")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    device = torch.device(args.device)
    model = load_renderer(args.checkpoint, device, args.lora)
    engine = DiffusersEngine(model)
    words = load_prompts("textbed:heldout", require_quoted=True)[: args.words]
    prompts = [w for w in words for _ in range(args.seeds)]
    seeds = [20_000 + i for i in range(len(prompts))]  # not the trainer's validation seeds (10_000 + i)
    # the tiny-gpu preset's rollout, made deterministic the way the trainer's validation does it
    rollout_cfg = preset_rollout(guidance_scale=args.cfg, micro_batch=args.batch)
    s = validation_sampling(rollout_cfg, args.steps)
    t0 = time.perf_counter()
    with torch.no_grad():
        images = np.concatenate(
            [
                engine.generate(prompts[a : a + args.batch], seeds[a : a + args.batch], s)
                .images.cpu()
                .numpy()
                for a in range(0, len(prompts), args.batch)
            ]
        )
    t_gen = time.perf_counter() - t0
    scores = build_reward("ocr")(images, prompts).scores
    cover, edge = map(np.array, zip(*(ink_extent(im[..., 0]) for im in images)))

    print(
        f"checkpoint {args.checkpoint or 'bundled'}, lora {args.lora}, {args.words} held-out words x {args.seeds} "
        f"seeds, {args.steps} ODE steps, CFG {args.cfg}, {args.device} (sampling {t_gen:.0f} s)\n"
    )
    print("| width cover | images | OCR score | exact | touching L/R border |\n|---|---|---|---|---|")
    for lo, hi in [(0, 0.5), (0.5, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.01)]:
        m = (cover >= lo) & (cover < hi)
        if m.any():
            print(
                f"| [{lo:.1f}, {min(hi, 1):.1f}) | {m.sum()} | {scores[m].mean():.3f} | {is_exact(scores[m]).mean():.2f} "
                f"| {edge[m].mean():.2f} |"
            )
    S, C = scores.reshape(-1, args.seeds), cover.reshape(-1, args.seeds)
    within = [np.corrcoef(S[i], C[i])[0, 1] for i in range(len(S)) if S[i].std() > 0 and C[i].std() > 0]
    print(
        "\n| mean | exact | best of N | within-word std | between-word std | corr(score, cover) | "
        "same, within words | mean cover |\n|---|---|---|---|---|---|---|---|"
    )
    print(
        f"| {scores.mean():.3f} | {is_exact(scores).mean():.2f} | {S.max(1).mean():.3f} | {S.std(1).mean():.3f} "
        f"| {S.mean(1).std():.3f} | {np.corrcoef(scores, cover)[0, 1]:.2f} | "
        f"{f'{np.mean(within):.2f} ({len(within)} words)' if within else '-'} | {cover.mean():.2f} |"
    )


if __name__ == "__main__":
    main()
