"""The README's figure of a finished run: the held-out and training reward over the steps, and the validation
grids of the first and the last validation side by side (the same held-out prompts, before and after).

    uv run python experiments/qwen_image_ocr.py tiny --seed 42
    uv run python benchmarks/main_job_figure.py runs/qwen_image_ocr --out benchmarks/figures/main_job_tiny_seed42.png

Reads only what a run writes: `metrics.jsonl` and `images/val_<step>.png`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from PIL import Image

from fgrpo.errors import MissingFileError, one_line_errors
from fgrpo.logging import read_metrics


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that carry `key` with a finite value."""
    pts = [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    pts = [(s, v) for s, v in pts if math.isfinite(v)]
    return [s for s, _ in pts], [v for _, v in pts]


def build(run_dir: Path, out: Path, *, dpi: int = 110) -> Path:
    """Write the figure of `run_dir` to `out` (PNG) and return `out`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_metrics(run_dir / "metrics.jsonl")
    val_steps, val = series(rows, "val/reward_mean")
    if not val_steps:
        raise MissingFileError(
            f"{run_dir / 'metrics.jsonl'} has no val/reward_mean row; pass a finished run directory"
        )
    first, last = val_steps[0], val_steps[-1]
    grids = [run_dir / "images" / f"val_{s:06d}.png" for s in (first, last)]
    for g in grids:
        if not g.is_file():
            raise MissingFileError(f"{g} is missing; pass a run directory that logged its validation images")

    fig = Figure(figsize=(13.0, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    curve, before, after = fig.subplots(1, 3, width_ratios=[1.0, 1.15, 1.15])
    train_steps, train = series(rows, "reward/mean")
    curve.plot(train_steps, train, color="0.6", linewidth=1.2, label="training reward (rollouts)")
    curve.plot(val_steps, val, marker="o", linewidth=2.0, label="held-out OCR (validation)")
    for s, v in zip(val_steps, val, strict=True):
        curve.annotate(f"{v:.3f}", (s, v), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    curve.margins(x=0.08)  # room for the last label
    curve.set_xlabel("step")
    curve.set_ylabel("OCR score")
    curve.grid(True, alpha=0.3)
    curve.legend(loc="lower right", fontsize=8, frameon=False)
    for ax, path, step, score in ((before, grids[0], first, val[0]), (after, grids[1], last, val[-1])):
        ax.imshow(np.asarray(Image.open(path).convert("RGB")))
        ax.set_title(f"held-out words, step {step} (OCR {score:.3f})", fontsize=10)
        ax.set_axis_off()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a finished run directory, e.g. runs/qwen_image_ocr")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/figures/main_job_tiny_seed42.png"))
    args = ap.parse_args(argv)
    with one_line_errors():
        print(build(args.run_dir, args.out))


if __name__ == "__main__":
    main()
