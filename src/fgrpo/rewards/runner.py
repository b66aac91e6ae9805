"""Score in a worker pool: in the background, so the next rollout overlaps the reward, or one batch split
over several processes. The one pool of fgrpo (trainer, renderer pretraining, benchmarks).

    runner = AsyncRewardRunner("ocr")              # or a Reward object; kind="process" for a process pool
    fut = runner.submit(images, prompts)           # returns at once
    traj = engine.generate(...)                    # next rollout runs meanwhile
    out = fut.result()                             # RewardOutput

    reward = ParallelReward({"name": "ocr", "num_threads": 1}, workers=12)   # a Reward scored by 12 processes
    out = reward(images, prompts)                  # 12 contiguous slices at once, joined in order

    stream = RewardStream(reward, prompts)         # a batch scored while it is still being sampled
    engine.generate(..., on_images=stream.add)     # each micro-batch's images go to the pool as they decode
    out = stream.result()                          # the same RewardOutput as reward(all images, prompts)

A thread is enough when the reward releases the GIL (onnxruntime, PIL's JPEG encoder, HTTP waits); a
process pool isolates a reward that holds the GIL or is not thread-safe, and spreads one that does not
scale with threads (rapidocr's per-image Python loop). Each worker builds its own reward once (from a spec
or a pickled Reward), so OCR weights are loaded once per worker, not per batch.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from fgrpo.rewards.base import Reward, RewardOutput, check_inputs, concat_outputs
from fgrpo.rewards.factory import build_reward

_worker_reward: Reward | None = None  # the reward of a process-pool worker, built once by _init_worker


def _init_worker(reward_or_spec: Reward | str | dict | list) -> None:
    global _worker_reward
    _worker_reward = build_reward(reward_or_spec) if not callable(reward_or_spec) else reward_or_spec


def _score_in_worker(images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
    assert _worker_reward is not None, "process-pool worker was not initialised"
    return _timed(_worker_reward, images, prompts, metadata)


def _timed(
    reward: Reward, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]
) -> RewardOutput:
    t0 = time.perf_counter()
    out = reward(images, prompts, metadata)
    out.metrics["reward/time_per_image_s"] = (time.perf_counter() - t0) / max(len(images), 1)
    return out


class AsyncRewardRunner:
    """Run a reward in a worker pool; `submit` returns a concurrent.futures.Future[RewardOutput].

    Args:
        reward: a Reward, or a spec for `build_reward` (a spec is what a process pool should get: it is built
            inside each worker, so nothing heavy is pickled).
        kind: "thread" or "process" (spawned, so the trainer's CUDA/threads state is not forked).
        max_workers: 1 keeps batches in submission order and one copy of the reward's weights; more threads
            call one reward concurrently, so only use them with a thread-safe reward.
    """

    def __init__(
        self,
        reward: Reward | str | dict | list,
        *,
        kind: Literal["thread", "process"] = "thread",
        max_workers: int = 1,
    ):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.kind, self.max_workers = kind, max_workers
        if kind == "thread":
            self._reward = reward if callable(reward) else build_reward(reward)
            self._pool: cf.Executor = cf.ThreadPoolExecutor(max_workers, thread_name_prefix="reward")
        elif kind == "process":
            self._reward = None
            self._pool = cf.ProcessPoolExecutor(
                max_workers, mp_context=mp.get_context("spawn"), initializer=_init_worker, initargs=(reward,)
            )
        else:
            raise ValueError(f"kind must be 'thread' or 'process', got {kind!r}")

    def submit(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> cf.Future[RewardOutput]:
        meta = check_inputs(images, prompts, metadata)  # bad input fails here, in the caller, not in a worker
        # Copy: the caller may reuse its image buffer for the next rollout while we still read this one.
        images, prompts = np.array(images, copy=True), list(prompts)
        if self._reward is not None:  # a thread pool: the reward lives in this process
            return self._pool.submit(_timed, self._reward, images, prompts, meta)
        return self._pool.submit(_score_in_worker, images, prompts, meta)

    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput:
        """Synchronous use (the runner is itself a Reward): the batch is cut into `max_workers` contiguous
        slices, scored at once and joined in order (`concat_outputs`)."""
        meta = check_inputs(images, prompts, metadata)
        bounds = np.linspace(0, len(prompts), self.max_workers + 1).astype(int)
        slices = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a] or [(0, 0)]
        futures = [self.submit(images[a:b], prompts[a:b], meta[a:b]) for a, b in slices]
        return futures[0].result() if len(futures) == 1 else concat_outputs([f.result() for f in futures])

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> AsyncRewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ParallelReward(AsyncRewardRunner):
    """A reward scored by `workers` spawned processes, each taking a contiguous slice of every batch
    (`AsyncRewardRunner(spec, kind="process", max_workers=workers)` called synchronously)."""

    def __init__(self, spec: Reward | str | dict | list, workers: int):
        super().__init__(spec, kind="process", max_workers=workers)


class RewardStream:
    """Score one batch that arrives in row blocks (a rollout's micro-batches), each block as it comes.

    With an AsyncRewardRunner the blocks are submitted at once (cut into up to `max_workers` slices), so the
    pool scores micro-batch k while the engine samples k + 1; any other Reward runs in this process, where
    nothing would overlap it, and scores the blocks in `result()` (so its time counts as reward time).
    `result()` joins the blocks in row order: the scores equal one call on the whole batch for any reward that
    scores each image on its own (all of fgrpo's); metrics are `concat_outputs`' merge.

    A block whose scoring has already failed (a served reward's server gone, say) raises its error at the next
    `add`, so the rollout stops there instead of sampling the rest of a batch that can never be scored.
    """

    def __init__(self, reward: Reward, prompts: Sequence[str]):
        self.reward, self.prompts = reward, list(prompts)
        self._parts: list[tuple[np.ndarray, cf.Future[RewardOutput] | RewardOutput]] = []
        self._pending: list[tuple[np.ndarray, np.ndarray, list[str], list[dict[str, Any]]]] = []

    def add(
        self,
        rows: slice | np.ndarray | Sequence[int],
        images: np.ndarray,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        """Batch rows `rows` (a slice or their indices, in the order of `images`), decoded: uint8 [n, H, W, 3]
        (with per-row metadata)."""
        idx = (
            np.arange(len(self.prompts))[rows]
            if isinstance(rows, slice)
            else np.asarray(rows, dtype=np.int64)
        )
        if idx.ndim != 1 or len(idx) != len(images):
            raise ValueError(f"RewardStream.add: {len(idx)} rows for {len(images)} images")
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self.prompts)):
            raise ValueError(f"RewardStream.add: rows outside the batch of {len(self.prompts)}")
        prompts = [self.prompts[i] for i in idx]
        meta = check_inputs(images, prompts, metadata)
        self._raise_failed()
        if not isinstance(self.reward, AsyncRewardRunner):  # scored in result(): nothing would overlap it
            self._pending.append((idx, np.array(images, copy=True), prompts, meta))
            return
        bounds = np.linspace(0, len(prompts), min(self.reward.max_workers, len(prompts)) + 1).astype(int)
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                self._parts.append((idx[a:b], self.reward.submit(images[a:b], prompts[a:b], meta[a:b])))

    def _raise_failed(self) -> None:
        """Raise the error of the first block already scored without success (its future done, with an error)."""
        for rows, part in self._parts:
            if isinstance(part, cf.Future) and part.done() and (e := part.exception()) is not None:
                e.add_note(
                    f"(the reward of {len(rows)} row(s) failed while the rollout was still sampling; it stopped "
                    "at its next micro-batch)"
                )
                raise e

    def result(self) -> RewardOutput:
        """The whole batch's RewardOutput, rows in order; every row must have been added exactly once."""
        self._parts += [(idx, self.reward(im, pr, me)) for idx, im, pr, me in self._pending]
        self._pending = []
        parts = self._parts
        outs = [p.result() if isinstance(p, cf.Future) else p for _, p in parts]
        idx = np.concatenate([rows for rows, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
        if sorted(idx.tolist()) != list(range(len(self.prompts))) or any(
            len(o.scores) != len(rows) for (rows, _), o in zip(parts, outs)
        ):
            raise ValueError(f"RewardStream: rows added do not tile the batch of {len(self.prompts)}")
        out = concat_outputs(outs)
        order = np.argsort(idx, kind="stable")  # the joined rows, back in batch order
        return RewardOutput(
            scores=out.scores[order],
            components={k: v[order] for k, v in out.components.items()},
            metrics=out.metrics,
        )
