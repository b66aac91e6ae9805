"""AsyncRewardRunner: results equal the synchronous reward; scoring overlaps the caller's work; bad input
fails at submit; the process pool builds the reward from a spec inside the worker."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fgrpo.rewards import AsyncRewardRunner, build_reward

from .slow_reward import SlowMeanPixel, mean_pixel

IMAGES = np.random.default_rng(0).integers(0, 256, (4, 16, 16, 3), dtype=np.uint8)
PROMPTS = ["a", "b", "c", "d"]


def test_thread_runner_overlaps_and_matches_sync():
    with AsyncRewardRunner(SlowMeanPixel(sleep_s=0.5)) as runner:
        t0 = time.perf_counter()
        fut = runner.submit(IMAGES, PROMPTS)
        submitted = time.perf_counter() - t0
        time.sleep(0.5)  # "the next rollout"
        out = fut.result()
        total = time.perf_counter() - t0
    assert submitted < 0.2  # submit does not wait for the score
    assert total < 0.9  # 0.5 s scoring hidden behind 0.5 s of other work (serial would be >= 1.0 s)
    np.testing.assert_array_equal(out.scores, mean_pixel(IMAGES))
    assert out.metrics["reward/time_per_image_s"] >= 0.5 / len(IMAGES)


def test_runner_copies_images_at_submit():
    images = IMAGES.copy()
    with AsyncRewardRunner(SlowMeanPixel(sleep_s=0.2)) as runner:
        fut = runner.submit(images, PROMPTS)
        images[:] = 0  # caller reuses its buffer for the next rollout
        np.testing.assert_array_equal(fut.result().scores, mean_pixel(IMAGES))


def test_bad_input_fails_at_submit():
    with AsyncRewardRunner(SlowMeanPixel(sleep_s=0.0)) as runner:
        with pytest.raises(ValueError, match="3 prompts"):
            runner.submit(IMAGES, PROMPTS[:3])


def test_worker_exception_reaches_result():
    class Broken:
        def __call__(self, images, prompts, metadata=None):
            raise RuntimeError("OCR engine crashed")

    with AsyncRewardRunner(Broken()) as runner:
        with pytest.raises(RuntimeError, match="OCR engine crashed"):
            runner.submit(IMAGES, PROMPTS).result()


def test_process_runner_builds_reward_from_spec():
    spec = {"name": "jpeg_compressibility", "quality": 80}
    expected = build_reward(spec)(IMAGES, PROMPTS).scores
    with AsyncRewardRunner(spec, kind="process") as runner:
        futs = [runner.submit(IMAGES, PROMPTS), runner.submit(IMAGES[:2], PROMPTS[:2])]
        np.testing.assert_array_equal(futs[0].result(timeout=60).scores, expected)
        np.testing.assert_array_equal(futs[1].result(timeout=60).scores, expected[:2])


def test_runner_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        AsyncRewardRunner("jpeg_compressibility", kind="fiber")
