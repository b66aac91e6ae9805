"""Weighted sum of several rewards, with required and optional members.

score_b = sum over members m present for sample b of w_m * s_m,b

A required member that raises (or returns a non-finite score) raises. An optional member that raises is
absent for the whole batch; one that returns NaN/inf for a sample is absent for that sample. Absent
members are left out of the sum (not counted as 0), their component is NaN, and the failure is logged and
counted in `metrics["<name>/fail_count"]`. A sample with no member present raises: it has no score.

Differs from flow_grpo: its multi_score is the same plain weighted sum but has no optional members; a
failure there either crashes or (inside the OCR scorer) silently becomes the worst score.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fgrpo.rewards.base import Reward, RewardOutput, check_inputs

log = logging.getLogger(__name__)


@dataclass
class Member:
    name: str
    """Key of this member in `components` and metrics."""
    reward: Reward
    weight: float = 1.0
    required: bool = True
    """True: a failure raises. False: a failure is logged, counted and the member left out of the sum."""


class MultiReward:
    def __init__(self, members: Sequence[Member]):
        if not members:
            raise ValueError("MultiReward needs at least one member")
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            raise ValueError(
                f"MultiReward member names must be unique, got {names}; set a distinct name per member"
            )
        for m in members:
            if not np.isfinite(m.weight):
                raise ValueError(f"MultiReward member {m.name!r} has non-finite weight {m.weight}")
        self.members = list(members)

    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput:
        metadata = check_inputs(images, prompts, metadata)
        n = len(images)
        total = np.zeros(n, dtype=np.float64)
        present = np.zeros(n, dtype=bool)
        components: dict[str, np.ndarray] = {}
        metrics: dict[str, float] = {}
        for m in self.members:
            try:
                out = m.reward(images, prompts, metadata)
                s = np.asarray(out.scores, dtype=np.float64)
                if s.shape != (n,):
                    raise ValueError(f"returned scores of shape {list(s.shape)} for {n} images")
            except Exception as e:
                if m.required:
                    raise RuntimeError(f"required reward member {m.name!r} failed: {e}") from e
                log.warning("optional reward member %r failed on the whole batch of %d: %r", m.name, n, e)
                s = np.full(n, np.nan)
                out = RewardOutput(scores=s)
            ok = np.isfinite(s)
            if m.required and not ok.all():
                raise RuntimeError(
                    f"required reward member {m.name!r} returned non-finite scores at samples {np.flatnonzero(~ok).tolist()}"
                )
            if not ok.all() and ok.any():
                log.warning(
                    "optional reward member %r failed on %d of %d samples", m.name, int((~ok).sum()), n
                )
            total[ok] += m.weight * s[ok]
            present |= ok
            components[m.name] = np.where(ok, s, np.nan).astype(np.float32)
            metrics[f"{m.name}/mean"] = float(s[ok].mean()) if ok.any() else float("nan")
            metrics[f"{m.name}/fail_count"] = float((~ok).sum())
            for k, v in out.metrics.items():
                metrics[f"{m.name}/{k}"] = v
            for k, v in out.components.items():  # a nested MultiReward keeps its members visible
                components[f"{m.name}/{k}"] = np.asarray(v, dtype=np.float32)
        if not present.all():
            raise RuntimeError(
                f"no reward member could score samples {np.flatnonzero(~present).tolist()}: every member failed"
            )
        return RewardOutput(scores=total.astype(np.float32), components=components, metrics=metrics)
