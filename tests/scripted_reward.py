"""A validation reward for the collapse-guard tests: call k scores every image scores[k] (the last value after the
list ends). Loaded as '{"name": "scripted_reward:make", "scores": [...]}' (tests/ is on the path), or with
"env": NAME to read the list (JSON) from that environment variable when built, so that a resumed run with the same
config can score differently."""

from __future__ import annotations

import json
import os

import numpy as np

from fgrpo.rewards.base import RewardOutput, check_inputs


class Scripted:
    def __init__(self, scores: list[float]):
        self.scores, self.calls = scores, 0

    def __call__(self, images, prompts, metadata=None):
        check_inputs(images, prompts, metadata)
        score = self.scores[min(self.calls, len(self.scores) - 1)]
        self.calls += 1
        return RewardOutput(scores=np.full(len(images), score, dtype=np.float32))


def make(scores: list[float] | None = None, env: str = "") -> Scripted:
    return Scripted(json.loads(os.environ[env]) if env else scores or [0.0])
