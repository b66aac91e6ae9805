"""The asynchronous, disaggregated mode (`--parallel.rollout-ranks N`): rollout ranks sample while trainer
ranks update, with bounded staleness and an off-policy correction.

    trainer ranks [0, T)                                rollout ranks [T, world)
    push version 0 ------------------------------------> load weights
                                                        for batch b: wait for the weights after step
                                                          b - max_staleness - 1, then experience(b)
    for each batch received: <------------------------- (rollout, rewards, advantages; the same code as the
      staleness = version - batch.version                 synchronous loop), sent with its version
      too old: dropped, counted, logged
      else: update (stale: old log-probs
        recomputed, IS-weighted loss); version += 1
      push the new trainable tensors ------------------> (LoRA or full weights, versioned)

Versions count weight updates: version v is the policy after v updates. The rollout samples batch b with the
weights of version b - max_staleness (0 for the first batches), so the trainer, at version b when it trains
batch b, sees staleness exactly min(b, max_staleness); with max_staleness 0 the rollout waits for every update
and the run is the synchronous one, number for number. A batch that arrives older than max_staleness is
dropped by the trainer (rollout.buffer's drop rule), never trained on: the schedule above never produces one,
so a drop is a broken producer made visible. The run is deterministic: which weights sample which batch does
not depend on timing.

Off-policy correction (verl's rollout correction, core.correction; algorithms.off_policy_weights): for a stale batch the trainer recomputes
the old policy's log-probs of the stored transitions (its weights when the step starts), the PPO ratio is
pi_theta / pi_old, and each entry's loss is weighted by the truncated (TIS) or masked importance weight
pi_old / pi_behaviour, pi_behaviour being the rollout's recorded log-probs. Those are per-element means over
the latent; `--parallel.is-log-ratio sum` (the default) scales the log-ratio by the latent's element count,
making it the transitions' density ratio ('mean' keeps the per-element ratio, within ~1e-3 of 1 at staleness 1).

Validation (Trainer.validation, every run.val_every steps and after the last) runs on the trainer ranks, before
they receive the step's batch: they hold the current weights, version k before the update of step k, the one
the synchronous loop validates (its row says so: val/version), while the rollout's copy lags max_staleness
versions behind. Its images are scored and gathered within the trainer side (parallel.Split.group), so the
point-to-point protocol never waits on it; the rollout keeps sampling ahead meanwhile, up to its bound.

Checkpoints (Trainer.record, every rank joins) keep, besides the trainer's state, the max_staleness versions
before the current one (Lagging, rank 0's checkpoint tensors): the batches sampled ahead of a checkpoint are
not saved but sampled again after a resume, with those versions, so a resumed run is the uninterrupted one.

The wire is gloo point-to-point (parallel.isend_object; the weights' data unpickled, parallel.isend_tensors): a
trainer rank receives its rows of each batch from one rollout rank; rank 0 sends each rollout rank every update.
Samples and weights cross as CPU tensors (for full weights on GPUs an NCCL broadcast would be faster; not
measured yet).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fgrpo import logging as flog
from fgrpo import parallel
from fgrpo.config import TrainConfig
from fgrpo.models.base import FlowModel
from fgrpo.rollout.base import Trajectory
from fgrpo.rollout.buffer import RolloutBuffer

BATCH_TAG, WEIGHTS_TAG = 1, 2


@dataclass
class Batch:
    """One step's experience: what the rollout side makes and the trainer side consumes."""

    step: int  # the step whose prompts and seeds it holds (rollout.seeds are functions of (seed, step))
    traj: Trajectory  # the receiving rank's rows
    rewards: torch.Tensor  # [P*G] the whole step's rewards
    advantages: torch.Tensor  # [P*G] the whole step's group advantages
    reward_metrics: dict[str, float]
    version: int = 0  # the policy version that sampled it
    times: dict[str, float] = field(default_factory=dict)  # the rollout side's phase times

    def to(self, device: torch.device | str) -> Batch:
        """The batch with every tensor on `device` (the wire carries CPU tensors; a rank trains on its own GPU)."""
        return dataclasses.replace(
            self,
            traj=self.traj.to(device),
            rewards=self.rewards.to(device),
            advantages=self.advantages.to(device),
        )


@dataclass
class Weights:
    """A message from trainer rank 0 to a rollout rank: after batch `index`, the policy is `version`."""

    index: int  # the batch it answers (-1: the initial weights)
    version: int
    tensors: dict[str, torch.Tensor] | None  # the full trainable tensors; None when the batch was dropped
    trained_step: int | None  # the training step it finished (None: dropped), for the checkpoint collectives
    stop: bool = False


def select_rows(traj: Trajectory, rows: slice) -> Trajectory:
    """The trajectory of samples `rows` (the schedule `sigmas` is shared by all samples and stays whole)."""
    picked = {}
    for f in dataclasses.fields(traj):
        v = getattr(traj, f.name)
        if f.name == "sigmas" or v is None:
            picked[f.name] = v
        elif f.name == "cond":
            picked[f.name] = {k: c[rows] for k, c in v.items()}
        else:
            picked[f.name] = v[rows]
    return Trajectory(**picked)


def trainable_tensors(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full CPU copies of the trainable tensors (collective over the trainer ranks: FSDP2 shards gathered one
    tensor at a time), each copied once, straight into its slice of one CPU buffer per dtype."""
    params = [(name, p.detach()) for name, p in transformer.named_parameters() if p.requires_grad]
    _, out = parallel.end_to_end(
        [(name, tuple(p.shape), p.dtype) for name, p in params]
    )  # a DTensor's full shape
    for name, p in params:
        out[name].copy_(p.full_tensor() if parallel.is_dtensor(p) else p)
    return out


@torch.no_grad()
def load_trainable(transformer: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into the matching trainable parameters, each rank its own FSDP2 shard."""
    from torch.distributed.tensor import distribute_tensor

    params = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    if params.keys() != tensors.keys():
        raise ValueError(
            f"pushed weights name {sorted(set(tensors) ^ set(params))[:3]}... that the rollout model does not "
            "train (or the reverse): both sides must set up the same trainable tensors"
        )
    for name, p in params.items():
        full = tensors[name].to(device=p.device, dtype=p.dtype)
        if parallel.is_dtensor(p):
            # Each rank cuts its own shard from the full tensor (src_data_rank=None: no communication).
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)


class Lagging:
    """The last max_staleness weight versions trainer rank 0 pushed before the current one, oldest first
    (clamped at version 0): the weights the rollout still samples the next batches with.

    They are this rank's checkpoint tensors (`state`, beside the algorithm's), so a resumed run re-samples the
    batches that were sampled ahead of the checkpoint - a pure function of (seed, step, weights) - rather than
    saving the batches: the same numbers as the uninterrupted run, at max_staleness copies of the trainable
    tensors in rank 0's memory and checkpoint."""

    def __init__(self, versions: list[dict[str, torch.Tensor]]):
        self.versions = versions

    @classmethod
    def of(
        cls, rollout_weights: Callable[[], dict[str, torch.Tensor]], split: parallel.Split, size: int
    ) -> Lagging:
        """Version 0 `size` times on trainer rank 0 (collective over the trainer ranks), none elsewhere."""
        if not (split.is_async and split.trains) or size == 0:
            return cls([])
        start = rollout_weights()
        if parallel.rank() != split.trainer_ranks[0]:
            return cls([])
        return cls([{k: t.clone() for k, t in start.items()} for _ in range(size)])

    def advance(self, previous: dict[str, torch.Tensor]) -> None:
        """A new version was pushed: `previous`, the one before it, joins; the oldest leaves."""
        if self.versions:
            self.versions = self.versions[1:] + [previous]

    def state(self) -> dict[str, torch.Tensor]:
        """'async/behind{j}/{name}': the version j updates before the current one (filled in place on load)."""
        n = len(self.versions)
        return {f"async/behind{n - i}/{k}": t for i, ts in enumerate(self.versions) for k, t in ts.items()}


class Wire:
    """Who sends what to whom: rollout rank i feeds trainer ranks [i k, (i + 1) k), k = T / R, each the next
    n / T rows of its n / R samples; rank 0 sends every rollout rank the weights."""

    def __init__(self, split: parallel.Split):
        self.split = split
        T, R = len(split.trainer_ranks), len(split.rollout_ranks)
        self.per_rollout = T // R
        self.pending = parallel.Pending()

    # rollout side
    def send_batch(self, batch: Batch) -> None:
        i, k = self.split.side_rank(), self.per_rollout
        n = len(batch.traj) // k
        cpu = batch.to("cpu")
        for q in range(k):
            part = dataclasses.replace(cpu, traj=select_rows(cpu.traj, slice(q * n, (q + 1) * n)))
            dst = self.split.trainer_ranks[i * k + q]
            parallel.isend_object(part, dst, self.pending, group=self.split.wire, tag=BATCH_TAG)

    def recv_weights(self) -> Weights:
        src = self.split.trainer_ranks[0]
        msg = parallel.recv_object(src, group=self.split.wire, tag=WEIGHTS_TAG)
        assert isinstance(msg, Weights)
        if msg.tensors is not None:  # an empty placeholder: the tensors follow, unpickled
            msg.tensors = parallel.recv_tensors(src, group=self.split.wire, tag=WEIGHTS_TAG)
        return msg

    # trainer side
    def recv_batch(self, device: torch.device) -> Batch:
        src = self.split.rollout_ranks[self.split.side_rank() // self.per_rollout]
        batch = parallel.recv_object(src, group=self.split.wire, tag=BATCH_TAG)
        assert isinstance(batch, Batch)
        return batch.to(device)

    def send_weights(self, msg: Weights) -> None:
        """Rank 0 only. The previous pushes are waited for first, so at most one is in flight per rollout rank."""
        self.pending.wait()
        header = dataclasses.replace(msg, tensors=None if msg.tensors is None else {})
        for dst in self.split.rollout_ranks:
            parallel.isend_object(header, dst, self.pending, group=self.split.wire, tag=WEIGHTS_TAG)
            if msg.tensors is not None:
                parallel.isend_tensors(msg.tensors, dst, self.pending, group=self.split.wire, tag=WEIGHTS_TAG)


class Sides(Protocol):
    """What the two loops ask of the run (train.Trainer): its state and the step's phases."""

    cfg: TrainConfig
    split: parallel.Split
    device: torch.device
    start_step: int
    lagging: Lagging
    model: FlowModel
    trained: torch.nn.Module
    """The model's trained transformers as one module (models.base.trained_module)."""

    def rollout_weights(self) -> dict[str, torch.Tensor]: ...

    def validation(self, step: int, timer: flog.PhaseTimer) -> dict[str, float]: ...

    def experience(self, step: int, timer: flog.PhaseTimer) -> Batch: ...

    def update(
        self, step: int, batch: Batch, timer: flog.PhaseTimer, off_policy: bool = False
    ) -> dict[str, float]: ...

    def record(
        self,
        step: int,
        batch: Batch,
        train_metrics: dict[str, float],
        timer: flog.PhaseTimer,
        extra: dict[str, float],
    ) -> dict[str, float]: ...

    def save_if_due(self, step: int) -> None: ...


def run_trainer(run: Sides) -> dict[str, float]:
    """The trainer ranks' loop: validate (run.validation, when due), receive, check staleness, train
    (run.update), push run.rollout_weights() (collective over the trainer ranks: the tensors the rollout samples
    with, NFT's EMA), log and checkpoint (run.record). Returns the last step's metrics.

    From a checkpoint of step k (version k; run.lagging holds versions k - max_staleness .. k - 1), the rollout is
    first sent those versions, then the current one, so it re-samples batches k, k + 1, ... with the weights the
    uninterrupted run used. Batch indices are taken to equal steps there (a run with drops resumes on another
    schedule; the schedule never drops)."""
    cfg, split, device, start_step, lagging = run.cfg, run.split, run.device, run.start_step, run.lagging
    wire, s = Wire(split), cfg.parallel.max_staleness
    is_main = parallel.rank() == split.trainer_ranks[0]
    buffer: RolloutBuffer[Batch] = RolloutBuffer(max_size=1, max_staleness=s)
    last: dict[str, torch.Tensor] = {}  # rank 0: the weights of the last push, which `lagging` keeps next

    def push(index: int, version: int, trained_step: int | None, *, weights: bool = True, stop=False) -> None:
        nonlocal last
        tensors = run.rollout_weights() if weights else None
        if is_main:
            if trained_step is not None:  # a new version: the previous one is now one behind
                lagging.advance(last)
            if tensors is not None:
                last = tensors
            wire.send_weights(Weights(index, version, tensors, trained_step, stop))

    if start_step >= cfg.num_steps:  # a finished run resumed: the rollout side stops at once too
        return {}
    version, step, index, dropped_since = start_step, start_step, start_step, 0
    if is_main:
        for v in range(max(0, version - s), version):  # the versions the next batches were sampled with
            wire.send_weights(Weights(v - 1, v, lagging.versions[v - (version - s)], None))
    push(version - 1, version, None)  # version - 1: the batch whose update made it (-1: none)
    metrics: dict[str, float] = {}
    val_metrics: dict[str, float] | None = None
    while step < cfg.num_steps:
        timer = flog.PhaseTimer()
        if val_metrics is None:  # once a step, a dropped batch aside; the rollout samples meanwhile
            val_metrics = run.validation(step, timer)
            if val_metrics:
                val_metrics["val/version"] = float(version)
        with timer("wait"):
            batch = wire.recv_batch(device)
        fresh = accept(buffer, batch, version)
        if fresh is None:
            dropped_since += 1
            flog.print0(
                f"dropped batch {index}: version {batch.version}, trainer at {version}, max_staleness {s}"
            )
            push(index, version, None, weights=False)
            index += 1
            continue
        staleness = version - batch.version
        train_metrics = run.update(step, batch, timer, staleness > 0)
        version += 1
        with timer("push"):
            push(index, version, step, stop=step + 1 == cfg.num_steps)
        async_metrics = {
            "async/staleness": float(staleness),
            "async/version": float(batch.version),
            "async/dropped": float(dropped_since),
            "async/dropped_total": float(len(buffer.dropped)),
            **{f"rollout_{k}": v for k, v in batch.times.items()},  # the rollout side's phases
        }
        metrics = run.record(step, batch, train_metrics, timer, val_metrics | async_metrics)
        dropped_since, step, index, val_metrics = 0, step + 1, index + 1, None
    for _ in range(s):  # the batches the rollout sampled ahead of the last update: received, not trained
        wire.recv_batch(device)
    wire.pending.wait()
    return metrics


def accept(buffer: RolloutBuffer[Batch], batch: Batch, version: int) -> Batch | None:
    """The batch if version - batch.version <= max_staleness, else None (the buffer records the drop)."""
    buffer.put(batch, batch.version)
    try:
        entry = buffer.get(version, timeout=0)
    except TimeoutError:  # the only batch was too old and has been dropped
        return None
    return entry.batch if entry is not None else None


def run_rollout(run: Sides) -> None:
    """The rollout ranks' loop: sample batch b (run.experience) with the weights of version b - max_staleness,
    from b = run.start_step, send it, until the trainer's last update; after each update the trainer reports, join
    the collectives it runs then (run.save_if_due: the checkpoint)."""
    cfg, split, transformer, start_step = run.cfg, run.split, run.trained, run.start_step
    if start_step >= cfg.num_steps:
        return
    wire, s = Wire(split), cfg.parallel.max_staleness
    last = wire.recv_weights()
    assert last.tensors is not None
    load_trainable(transformer, last.tensors)
    version = last.version
    b = start_step
    while True:
        while last.index < b - s - 1:  # the weights after batch b - s - 1, i.e. of version b - s
            last = wire.recv_weights()
            if last.tensors is not None:
                load_trainable(transformer, last.tensors)
                version = last.version
            if last.trained_step is not None:
                run.save_if_due(last.trained_step)
            if last.stop:
                wire.pending.wait()  # the trainer receives the batches sampled ahead before it stops
                return
        timer = flog.PhaseTimer()
        batch = run.experience(b, timer)
        batch.version = version
        batch.times = timer.metrics()
        wire.send_batch(batch)
        b += 1
