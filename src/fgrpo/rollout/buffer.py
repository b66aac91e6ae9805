"""The hand-off between an asynchronous rollout producer and the trainer: a bounded, versioned buffer of
rollout batches and a versioned weight slot.

Versions count the trainer's weight updates: version v is the policy after v updates (0 = the initial
weights). A batch carries the version of the weights that sampled it; the trainer, holding version v, trains
on a batch of version u only if v - u <= max_staleness and drops older ones with a record. The producer reads
weights from the WeightStore; `WeightStore.wait_for(k - max_staleness)` before sampling batch k keeps it
from producing batches it already knows will be dropped (with max_staleness = 0 that is the synchronous loop).

threading.Condition rather than queue.Queue: the consumer must drop and count stale entries under the same
lock that the producer's blocking put waits on, and Queue has no shutdown before Python 3.13.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
S = TypeVar("S")


@dataclass(frozen=True)
class Dropped:
    """One batch the trainer refused because it was too old."""

    version: int  # the policy version that sampled it
    current_version: int  # the trainer's version when it was refused

    @property
    def staleness(self) -> int:
        return self.current_version - self.version


@dataclass(frozen=True)
class Entry(Generic[T]):
    """A batch as the trainer receives it."""

    batch: T
    version: int  # the policy version that sampled it
    staleness: int  # the trainer's version minus `version`, in [0, max_staleness]
    dropped: tuple[Dropped, ...] = field(default=())  # the stale batches skipped to reach this one


class RolloutBuffer(Generic[T]):
    """Bounded FIFO of (batch, version) from a rollout producer to a trainer, thread-safe.

    put blocks while max_size batches wait. get(current_version) returns the oldest batch with
    current_version - version <= max_staleness, dropping (and recording) every older one it meets first; it
    never returns a batch that is too old. close() wakes every waiter: put then refuses, get drains what is
    left and then returns None.
    """

    def __init__(self, max_size: int, max_staleness: int):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1 (batches the rollout may run ahead), got {max_size}")
        if max_staleness < 0:
            raise ValueError(
                f"max_staleness must be >= 0 (0 = train only on the current policy's samples), got {max_staleness}"
            )
        self.max_size = max_size
        self.max_staleness = max_staleness
        self._items: collections.deque[tuple[T, int]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._dropped: list[Dropped] = []
        self._last_put_version = -1

    def put(self, batch: T, version: int, timeout: float | None = None) -> bool:
        """Append a batch sampled by policy `version`; block while the buffer is full.

        Returns False (and drops the batch) once the buffer is closed. Raises TimeoutError after `timeout`
        seconds without room, and ValueError if versions go backwards (the producer reads a monotone store).
        """
        with self._cond:
            if version < self._last_put_version:
                raise ValueError(
                    f"batch version {version} is older than the previous batch's {self._last_put_version}: "
                    "the producer must sample with the latest published weights"
                )
            if not self._cond.wait_for(lambda: self._closed or len(self._items) < self.max_size, timeout):
                raise TimeoutError(f"rollout buffer full ({self.max_size} batches) for {timeout} s")
            if self._closed:
                return False
            self._items.append((batch, version))
            self._last_put_version = version
            self._cond.notify_all()
            return True

    def get(self, current_version: int, timeout: float | None = None) -> Entry[T] | None:
        """The oldest batch fresh enough for a trainer at `current_version`, or None once closed and empty.

        Batches with current_version - version > max_staleness are removed and recorded on the way (in the
        returned Entry's `dropped` and in `dropped_total`). Raises TimeoutError after `timeout` seconds without
        a fresh batch, and ValueError for a batch newer than the trainer (weights it has not published).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        dropped: list[Dropped] = []
        with self._cond:
            while True:
                while self._items:
                    batch, version = self._items.popleft()
                    self._cond.notify_all()  # room for the producer
                    if version > current_version:
                        raise ValueError(
                            f"batch of version {version} reached a trainer at version {current_version}: "
                            "pass get() the version of the weights being trained"
                        )
                    if current_version - version <= self.max_staleness:
                        return Entry(batch, version, current_version - version, tuple(dropped))
                    d = Dropped(version, current_version)
                    dropped.append(d)
                    self._dropped.append(d)
                if self._closed:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"no batch fresh enough for version {current_version} within {timeout} s"
                    )
                self._cond.wait(left)

    def close(self) -> None:
        """Stop the hand-off: blocked and later puts return False, gets drain then return None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def dropped(self) -> list[Dropped]:
        """Every batch refused so far, oldest first."""
        with self._cond:
            return list(self._dropped)

    def metrics(self) -> dict[str, float]:
        """Log-able counters: batches waiting and batches dropped so far."""
        with self._cond:
            return {"buffer/size": float(len(self._items)), "buffer/dropped_total": float(len(self._dropped))}


class WeightStore(Generic[S]):
    """A versioned weight slot: the trainer publishes (state, version) after each update, the rollout reads
    the latest. Versions strictly increase; a reader never sees an older version after a newer one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._state: S | None = None
        self._version = -1
        self._closed = False

    def publish(self, state: S, version: int) -> None:
        """Make `state` the latest weights. The state is shared, not copied: publish a snapshot the trainer
        will not modify in place (e.g. a dict of cloned tensors, or the LoRA state dict's copy)."""
        with self._cond:
            if version <= self._version:
                raise ValueError(
                    f"published version {version} is not newer than the current {self._version}: versions "
                    "count weight updates and only increase"
                )
            self._state, self._version = state, version
            self._cond.notify_all()

    def latest(self) -> tuple[S, int]:
        """(state, version) of the newest publication; raises if nothing was published yet."""
        with self._cond:
            if self._state is None:
                raise RuntimeError("no weights published yet: publish version 0 before starting the rollout")
            return self._state, self._version

    @property
    def version(self) -> int:
        """The newest published version, -1 before the first."""
        with self._cond:
            return self._version

    def wait_for(self, min_version: int, timeout: float | None = None) -> tuple[S, int] | None:
        """Block until a version >= min_version is published, then return latest(); None if closed first.

        Raises TimeoutError after `timeout` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or self._version >= min_version, timeout):
                raise TimeoutError(f"weights of version {min_version} not published within {timeout} s")
            if self._version < min_version:
                return None
            assert self._state is not None
            return self._state, self._version

    def close(self) -> None:
        """Wake every waiter (they return None)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
