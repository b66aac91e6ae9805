"""fgrpo.train's validation on a fake engine and reward (no model): what a validation row holds."""

import dataclasses

import numpy as np
import pytest
import torch

from fgrpo import parallel
from fgrpo.config import RewardConfig, TrainConfig
from fgrpo.logging import NullLogger
from fgrpo.rewards.base import RewardOutput
from fgrpo.train import validate

PROMPTS = ['A sign that says "A"', 'A sign that says "B"', 'A sign that says "C"', 'A sign that says "D"']


class GreyEngine:
    """Mid-grey 8x8 images for any prompts."""

    def generate(self, prompts, seeds, cfg, **kw):
        images = torch.full((len(prompts), 8, 8, 3), 128, dtype=torch.uint8)
        return type("Traj", (), {"images": images, "to": lambda self, device: self})()


def fixed_scores(images, prompts, metadata=None):
    return RewardOutput(scores=np.array([1.0, 0.5, 1.0, 0.0], dtype=np.float32))


@pytest.mark.parametrize("reward", ["ocr", "jpeg_compressibility"])
def test_the_exact_fraction_is_logged_for_an_ocr_reward_only(reward):
    """val/reward_exact_frac is the share of images an OCR reward scores 1 (text read exactly): here 2 of 4. Another
    reward's scores are no reading, and the row has no such key (a JPEG score of 1 would count as 'exact')."""
    cfg = dataclasses.replace(TrainConfig(), reward=RewardConfig(name=reward))
    val = validate(
        GreyEngine(),
        fixed_scores,
        reward,
        PROMPTS,
        cfg,
        NullLogger(),
        0,
        torch.device("cpu"),
        parallel.split(0),
    )
    assert val["val/reward_mean"] == pytest.approx(0.625)
    if reward == "ocr":
        assert val["val/reward_exact_frac"] == 0.5
    else:
        assert "val/reward_exact_frac" not in val
