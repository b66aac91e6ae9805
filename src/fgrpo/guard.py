"""The collapse guard: the best validation so far, its adapter kept in `lora_best/`, a stop when the score stays
far below it, and the "gold" image statistics logged beside the proxy reward.

A run whose policy collapses (or hacks its reward) still exits 0 and exports its last weights unless something
watches the held-out score. `BestTracker` follows `val/reward_mean`; the loop exports the adapter of every new best
to `runs/<exp_name>/lora_best/` and stops with `RunCollapsed` (exit code 3) once `collapse_patience` validations in
a row score more than `collapse_drop` below the best. The gold statistics (brightness, near-black and near-white
pixel shares, the OCR reader's share of images without any text) do not depend on the reward: a reward that rises
while they move far is how reward hacking shows in the curves (dark images that an OCR model still reads).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BEST_DIR = "lora_best"
BEST_RECORD = "best.json"
# Pixels at most this far from pure black / white (in [0, 1] luma) count as near-black / near-white.
_NEAR = 0.05
GOLD_KEYS = ("brightness_mean", "brightness_std", "black_frac", "white_frac")


def image_stats(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Per-image gold statistics of uint8 RGB images [B, H, W, 3] (or videos [B, F, H, W, 3]).

    luma = (0.299 R + 0.587 G + 0.114 B) / 255 per pixel (ITU-R BT.601), then per image:
    [mean luma, std of luma, share of pixels with luma <= 0.05, share with luma >= 0.95].

    Returns:
        [B, 4] fp32, in GOLD_KEYS' order.
    """
    x = torch.as_tensor(images)
    if x.dtype != torch.uint8 or x.ndim < 4 or x.shape[-1] != 3:
        raise ValueError(f"image_stats needs uint8 [B, ..., 3] images, got {x.dtype} {list(x.shape)}")
    weights = torch.tensor([0.299, 0.587, 0.114])
    luma = (x.reshape(x.shape[0], -1, 3).float() @ weights) / 255.0  # [B, pixels]
    return torch.stack(
        [
            luma.mean(dim=1),
            luma.std(dim=1, unbiased=False),
            (luma <= _NEAR).float().mean(dim=1),
            (luma >= 1 - _NEAR).float().mean(dim=1),
        ],
        dim=1,
    )


def no_text_flags(components: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    """[n] 1.0 where an OCR reward read no text at all (its `no_text` component; nested in a multi-reward as
    `<member>/no_text`), NaN for every image when the reward has no OCR reader."""
    for key, value in components.items():
        if key == "no_text" or key.endswith("/no_text"):
            return np.asarray(value, dtype=np.float32)
    return np.full(n, np.nan, dtype=np.float32)


@dataclass
class BestTracker:
    """The best validation score so far and the count of validations in a row far below it.

    collapsed() once `patience` validations in a row score below best - drop; drop <= 0 never collapses."""

    drop: float
    patience: int
    best: float = -math.inf
    best_step: int = -1
    below: int = 0

    def observe(self, step: int, score: float) -> bool:
        """Take validation `score` at `step`; True when it is a new best (strictly higher)."""
        if score > self.best:
            self.best, self.best_step, self.below = score, step, 0
            return True
        self.below = self.below + 1 if score < self.best - self.drop else 0
        return False

    def collapsed(self) -> bool:
        return self.drop > 0 and self.below >= self.patience

    def metrics(self) -> dict[str, float]:
        return {"val/best": self.best, "val/best_step": float(self.best_step)}

    @classmethod
    def replay(cls, rows: Iterable[Mapping], *, drop: float, patience: int) -> BestTracker:
        """The tracker as the run left it: every validation row of metrics.jsonl observed in step order."""
        tracker = cls(drop=drop, patience=patience)
        vals = [r for r in rows if isinstance(r.get("val/reward_mean"), int | float)]
        for r in sorted(vals, key=lambda r: r["step"]):
            tracker.observe(int(r["step"]), float(r["val/reward_mean"]))
        return tracker


def best_record(step: int, score: float) -> dict[str, dict]:
    """lora_best/'s `best.json` (which validation the adapter beside it belongs to), as export_lora's extra_json:
    written inside the adapter's directory before it is renamed into place, so the two never disagree."""
    return {BEST_RECORD: {"step": step, "val/reward_mean": score}}


def read_best_record(run_dir: Path) -> dict | None:
    path = run_dir / BEST_DIR / BEST_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def collapse_message(tracker: BestTracker, step: int, score: float, run_dir: Path, *, lora: bool) -> str:
    """The one line a collapsed run ends with."""
    where = f"its adapter is in {run_dir / BEST_DIR}/" if lora else "the checkpoints keep the weights"
    return (
        f"run stopped: held-out score {score:.4f} at step {step} is more than run.collapse_drop={tracker.drop} "
        f"below the best {tracker.best:.4f} (step {tracker.best_step}) for {tracker.below} validations in a row; "
        f"{where} (--run.collapse-drop 0 turns this check off)"
    )
