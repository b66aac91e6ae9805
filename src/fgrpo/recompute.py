"""The trainer's passes over a rollout: its transitions' log-probs recomputed under the current weights (bit for bit
the rollout's in the rollout's own micro-batches while the weights are unchanged), the importance weights of stale
ones (asynchronous mode), and the rows of each mini-batch and micro-batch of an update."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from fgrpo.config import ParallelConfig, SamplingConfig
from fgrpo.core import correction
from fgrpo.models.base import Cond, FlowModel, cond_index
from fgrpo.policy import transition_log_prob
from fgrpo.rollout.base import Trajectory
from fgrpo.rollout.engine import forward_units


def recompute_log_prob(
    model: FlowModel, traj: Trajectory, cfg: SamplingConfig, rows: slice | torch.Tensor, j: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_prob [m], mean, std) of window position j of `rows` under the current weights (with grad if on).

    Pass the rollout's own micro-batches (`forward_units(traj.window, cfg.micro_batch)`) for bit-exact
    agreement with the rollout's log-probs while the weights are unchanged.
    """
    steps = traj.window[rows, j]
    cond: Cond = cond_index(traj.cond, rows)
    return transition_log_prob(
        model, traj.x_t[rows, j], traj.x_next[rows, j], traj.sigmas[steps], traj.sigmas[steps + 1], cond, cfg
    )


@torch.no_grad()
def recompute_log_probs_and_means(
    model: FlowModel, traj: Trajectory, cfg: SamplingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, W] log-probs, [B, W, *latent] means) of the stored transitions under the current weights, in the
    rollout's micro-batches (window position-major)."""
    log_probs = torch.empty_like(traj.log_prob)
    means = torch.empty_like(traj.x_next)
    for j in range(traj.window.shape[1]):
        for rows in forward_units(traj.window, cfg.micro_batch, cfg.unit_block):
            rows = rows.to(traj.log_prob.device)
            log_probs[rows, j], means[rows, j], _ = recompute_log_prob(model, traj, cfg, rows, j)
    return log_probs, means


def recompute_log_probs(model: FlowModel, traj: Trajectory, cfg: SamplingConfig) -> torch.Tensor:
    """[B, W] log-probs of the stored transitions (`recompute_log_probs_and_means` without the means)."""
    return recompute_log_probs_and_means(model, traj, cfg)[0]


def exact_micro_batch(n: int, micro_batch: int, num_minibatches: int) -> int:
    """Rows per forward when n samples are trained in `num_minibatches` mini-batches: at most micro_batch, and
    no more than a mini-batch holds, so that the trainer can train every rollout micro-batch whole.

    A mini-batch of m = n / num_minibatches samples takes c = ceil(m / micro_batch) forwards of ceil(m / c) rows:
    micro_batch itself when it divides m, otherwise the same number of forwards made as equal as they can be.
    """
    m = max(1, n // num_minibatches)
    forwards = math.ceil(m / micro_batch)
    return math.ceil(m / forwards)


def minibatch_rows(
    window: torch.Tensor,
    micro_batch: int,
    rollout_micro_batch: int,
    num_minibatches: int,
    generator: torch.Generator,
) -> list[list[torch.Tensor]]:
    """Split the n = len(window) samples of a rollout ([B, W] Trajectory.window) into `num_minibatches`
    mini-batches, each a list of micro-batch row index tensors.

    With micro_batch == rollout_micro_batch the units shuffled are the rollout's own micro-batches,
    `forward_units(window, exact_micro_batch(n, rollout_micro_batch, num_minibatches))` (what the algorithms roll
    out with), dealt to the mini-batches in equal counts where the count of units allows (else the first ones
    get one more), so each training forward sees exactly the rows (and prompt padding) of a rollout forward;
    otherwise single samples are shuffled and cut into micro-batches.
    """
    n = len(window)
    if micro_batch == rollout_micro_batch:
        units = forward_units(window, exact_micro_batch(n, rollout_micro_batch, num_minibatches))
        order = torch.randperm(len(units), generator=generator)
        return [[units[u] for u in part.tolist()] for part in order.tensor_split(num_minibatches)]
    perm = torch.randperm(n, generator=generator)
    return [list(chunk.split(micro_batch)) for chunk in perm.chunk(num_minibatches)]


def off_policy_weights(
    old_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor, p: ParallelConfig, *, elements: int
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The configured correction's [B, W] weights (None for 'none') and their statistics ('offpolicy/...').

    old_log_prob, behaviour_log_prob: [B, W] per-element mean log-probs of the transitions, whose latents have
    `elements` elements (D) each. With p.is_log_ratio 'sum' the log-ratio is D (old - behaviour), that of the
    transition's densities; with 'mean' it is old - behaviour. The statistics (behaviour/old gap, IS weight
    mean/min/max, ESS, truncated and masked shares) are of that log-ratio, and are logged with every
    correction, 'none' included (with weight 1), so the gap is visible before one turns it on.
    """
    log_w = correction.log_ratio(old_log_prob, behaviour_log_prob)
    if p.is_log_ratio == "sum":
        log_w = log_w * elements
    lower = p.is_threshold_low or None
    if p.correction == "none":
        weight = None
    else:
        mode = "truncate" if p.correction == "tis" else "mask"
        weight = correction.is_weights(log_w, level=p.is_level, mode=mode, upper=p.is_threshold, lower=lower)
    stats = correction.correction_metrics(
        log_w,
        torch.ones_like(log_w) if weight is None else weight,
        level=p.is_level,
        upper=p.is_threshold,
        lower=lower,
    )
    return weight, {f"offpolicy/{k}": float(v) for k, v in stats.items()}


def micro_batches(n: int, size: int) -> Iterator[slice]:
    """The row slices [0, size), [size, 2 size), ... of n samples: the grouping of passes without SDE windows
    (the forward-process algorithms' training points); windowed rollouts group by `forward_units`."""
    if size < 1:
        raise ValueError(f"micro_batch must be >= 1, got {size}")
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))
