"""A reward for service tests: mean pixel value / 255 (a closed form), after sleeping `sleep_s` per call.
Loaded by `python -m fgrpo.rewards.serve --reward '{"name": "slow_reward:make", ...}'` in a subprocess."""

from __future__ import annotations

import time

import numpy as np

from fgrpo.rewards.base import RewardOutput, check_inputs


def mean_pixel(images: np.ndarray) -> np.ndarray:
    return (images.reshape(len(images), -1).mean(axis=1) / 255).astype(np.float32)


class SlowMeanPixel:
    def __init__(self, sleep_s: float):
        self.sleep_s = sleep_s

    def __call__(self, images, prompts, metadata=None):
        check_inputs(images, prompts, metadata)
        time.sleep(self.sleep_s)
        return RewardOutput(scores=mean_pixel(images), metrics={"slow/calls_count": 1.0})


def make(sleep_s: float = 0.0) -> SlowMeanPixel:
    return SlowMeanPixel(sleep_s)
