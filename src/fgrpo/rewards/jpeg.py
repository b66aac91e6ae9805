"""JPEG (in)compressibility rewards (DDPO): the size of the image saved as JPEG at quality 95.

compressibility = -kB / 500, incompressibility = +kB / 500, with kB = bytes / 1000.

Differs from DDPO/flow_grpo: DDPO returns -kB and +kB unscaled; flow_grpo divides only compressibility by
500. We divide both so the pair has the same scale (a 512² photo is ~50-150 kB -> |score| ~0.1-0.3);
`scale=1.0` gives DDPO's raw kB.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from fgrpo.rewards.base import RewardOutput, check_inputs


def jpeg_kb(images: np.ndarray, *, quality: int = 95) -> np.ndarray:
    """Size in kB (1000 bytes) of each uint8 RGB image [B, H, W, 3] saved as JPEG -> float64 [B]."""
    sizes = []
    for image in images:
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000)
    return np.array(sizes, dtype=np.float64)


class JpegReward:
    """sign * JPEG kB * scale; sign -1 rewards compressible images, +1 incompressible ones."""

    def __init__(self, *, compressible: bool, scale: float = 1 / 500, quality: int = 95):
        if not 1 <= quality <= 100:
            raise ValueError(f"jpeg quality must be in [1, 100], got {quality}")
        self.sign = -1.0 if compressible else 1.0
        self.scale = float(scale)
        self.quality = int(quality)

    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput:
        check_inputs(images, prompts, metadata)
        kb = jpeg_kb(images, quality=self.quality)
        scores = (self.sign * self.scale * kb).astype(np.float32)
        return RewardOutput(scores=scores, metrics={"jpeg/kb": float(kb.mean()) if len(kb) else 0.0})


def jpeg_compressibility(*, scale: float = 1 / 500, quality: int = 95) -> JpegReward:
    return JpegReward(compressible=True, scale=scale, quality=quality)


def jpeg_incompressibility(*, scale: float = 1 / 500, quality: int = 95) -> JpegReward:
    return JpegReward(compressible=False, scale=scale, quality=quality)
