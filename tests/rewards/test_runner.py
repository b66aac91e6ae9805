"""AsyncRewardRunner: results equal the synchronous reward; scoring overlaps the caller's work; bad input
fails at submit; the process pool builds the reward from a spec inside the worker; a synchronous call splits
the batch over the workers."""

from __future__ import annotations

import concurrent.futures as cf
import time

import numpy as np
import pytest

from fgrpo.rewards import AsyncRewardRunner, RewardOutput, build_reward
from fgrpo.rewards.runner import ParallelReward

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
        AsyncRewardRunner("jpeg_compressibility", kind="fiber")  # pyright: ignore[reportArgumentType] - deliberately invalid


def test_parallel_reward_splits_the_batch_over_its_processes_in_order():
    """5 images over 2 processes: slices [0, 2) and [2, 5), two reward calls (the additive `_count` metric),
    scores in the input order; more workers than images: one call per image, none empty."""
    images = np.random.default_rng(1).integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
    prompts = list("abcde")
    with ParallelReward(SlowMeanPixel(sleep_s=0.0), workers=2) as reward:
        out = reward(images, prompts)
        np.testing.assert_array_equal(out.scores, mean_pixel(images))
        assert out.metrics["slow/calls_count"] == 2
    with AsyncRewardRunner(SlowMeanPixel(sleep_s=0.0), max_workers=8) as runner:
        out = runner(images, prompts)
        np.testing.assert_array_equal(out.scores, mean_pixel(images))
        assert out.metrics["slow/calls_count"] == 5

    def empty_ok(images, prompts, metadata=None):
        return RewardOutput(scores=np.zeros(len(images), np.float32))

    with AsyncRewardRunner(empty_ok, max_workers=2) as runner:
        assert runner(images[:0], []).scores.shape == (0,)  # an empty batch is one empty call, not an error


def test_reward_stream_scores_blocks_as_they_come_and_joins_them_in_row_order():
    """Blocks of a batch added in any order give the scores of one call on the whole batch; with a runner each
    add returns at once (the pool scores while the caller samples the next block), each block cut over the
    workers; rows that do not tile the batch are an error at result()."""
    from fgrpo.rewards.runner import RewardStream

    images = np.random.default_rng(2).integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
    prompts = list("abcdef")
    with AsyncRewardRunner(SlowMeanPixel(sleep_s=0.3), max_workers=2) as runner:
        stream = RewardStream(runner, prompts)
        t0 = time.perf_counter()
        stream.add(slice(4, 6), images[4:6])
        stream.add(slice(0, 4), images[0:4])
        assert time.perf_counter() - t0 < 0.2
        out = stream.result()
        np.testing.assert_array_equal(out.scores, mean_pixel(images))
        assert out.metrics["slow/calls_count"] == 4  # two blocks, each over the two workers
    calls = []

    def in_process(images, prompts, metadata=None):
        calls.append(len(images))
        return SlowMeanPixel(sleep_s=0.0)(images, prompts, metadata)

    plain = RewardStream(
        in_process, prompts
    )  # an in-process reward scores at result(), under the reward timer
    plain.add(slice(0, 3), images[:3])
    plain.add(slice(3, 6), images[3:])
    assert calls == []
    np.testing.assert_array_equal(plain.result().scores, mean_pixel(images))
    assert calls == [3, 3]
    gap = RewardStream(SlowMeanPixel(sleep_s=0.0), prompts)
    gap.add(slice(0, 3), images[:3])
    with pytest.raises(ValueError, match="do not tile"):
        gap.result()
    with pytest.raises(ValueError, match="2 rows for 3 images"):
        gap.add(slice(0, 2), images[:3])


def test_reward_stream_takes_blocks_of_any_rows():
    """A rollout micro-batch holds rows grouped by window, not consecutive ones: a block names its rows by index,
    in the order of its images; each image is scored with its own row's prompt and lands in its row."""
    from fgrpo.rewards.runner import RewardStream

    images = np.random.default_rng(3).integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
    prompts = list("abcdef")

    def by_prompt(images, prompts, metadata=None):  # the score names the prompt it was given, and the pixels
        return RewardOutput(
            scores=np.array([ord(p) * 1000 for p in prompts], np.float32) + mean_pixel(images),
            components={"pixel": mean_pixel(images)},
        )

    expected = by_prompt(images, prompts)
    with AsyncRewardRunner(by_prompt, max_workers=2) as runner:
        for reward in (runner, by_prompt):  # pool (scored at add) and in process (scored at result)
            stream = RewardStream(reward, prompts)
            stream.add(np.array([5, 0, 3]), images[[5, 0, 3]])
            stream.add([4, 1, 2], images[[4, 1, 2]])
            out = stream.result()
            np.testing.assert_array_equal(out.scores, expected.scores)
            np.testing.assert_array_equal(out.components["pixel"], expected.components["pixel"])
    twice = RewardStream(by_prompt, prompts)
    twice.add([0, 1, 2], images[:3])
    twice.add([2, 3, 4, 5], images[2:])
    with pytest.raises(ValueError, match="do not tile"):
        twice.result()
    with pytest.raises(ValueError, match="outside the batch"):
        twice.add([6], images[:1])


def test_reward_stream_raises_a_failed_block_at_the_next_add():
    """A block whose scoring failed (a served reward's server killed, say) stops the rollout at its next micro-batch
    with the reward's own error, instead of after the whole batch was sampled; a block still being scored does
    not."""
    from fgrpo.rewards.runner import RewardStream

    class FailsFirst:
        def __init__(self):
            self.calls = 0

        def __call__(self, images, prompts, metadata=None):
            self.calls += 1
            if self.calls == 1:
                raise ConnectionError("server gone")
            time.sleep(0.3)
            return SlowMeanPixel(sleep_s=0.0)(images, prompts, metadata)

    images = np.random.default_rng(4).integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
    prompts = list("abcdef")
    with AsyncRewardRunner(FailsFirst()) as runner:
        stream = RewardStream(runner, prompts)
        stream.add(slice(0, 2), images[:2])
        cf.wait([f for _, f in stream._parts if isinstance(f, cf.Future)])
        with pytest.raises(ConnectionError, match="server gone") as err:
            stream.add(slice(2, 4), images[2:4])
        assert any("still sampling" in n for n in err.value.__notes__)
    with AsyncRewardRunner(FailsFirst()) as runner:
        runner.submit(images[:1], prompts[:1]).exception()  # the one failing call, spent
        stream = RewardStream(runner, prompts)
        stream.add(slice(0, 3), images[:3])
        stream.add(slice(3, 6), images[3:])  # the first block is still being scored: no error
        np.testing.assert_array_equal(stream.result().scores, mean_pixel(images))
