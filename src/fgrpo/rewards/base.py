"""The reward interface: uint8 images [B, H, W, 3] + prompts (+ per-sample metadata) -> scores [B]."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass
class RewardOutput:
    scores: np.ndarray  # [B] float32, the value the advantages are computed from
    components: dict[str, np.ndarray] = field(default_factory=dict)  # per-member [B] scores (NaN = excluded)
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. failure counts, latency


class Reward(Protocol):
    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput: ...
