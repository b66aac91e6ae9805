"""The algorithms, as what differs between them; the loop in train.py asks, it never branches on a name.

| algo    | rollout (what it samples)                      | trained points                            | loss (core)            |
|---------|------------------------------------------------|-------------------------------------------|------------------------|
| grpo    | SDE in a window drawn per sample, from theta   | the window's transitions (log-probs)      | grpo.clipped_policy_loss |
| dppo    | as grpo; the rollout's transition means kept   | as grpo                                   | dppo.dppo_loss         |
| mixgrpo | SDE in one window for the batch that slides    | as grpo                                   | grpo.clipped_policy_loss |
|         | with the training step, ODE elsewhere          |                                           |                        |
| nft     | ODE, from the EMA "old" weights (or SDE on     | x0 noised afresh at K grid times a sample | nft.nft_loss           |
|         | algo.sde_steps)                                |                                           |                        |
| awm     | ODE, from theta (or SDE on algo.sde_steps)     | x0 noised afresh at K grid times (shared) | awm.awm_loss           |

Two update functions serve them: `window_update` (the Flow-GRPO family: recompute the log-prob of stored
transitions) and `forward_process_update` (NFT, AWM: velocity at fresh forward-process points); both give
`minibatch_updates`, the one mini-batch -> micro-batch -> backward -> optimizer step skeleton, the loss of one
trained point. A new algorithm is a core loss, an `Algorithm` subclass that says what to sample, which update to
run and which settings it refuses (`Algorithm.check`), and a preset in an experiment file.

Deviations from the reference code, each for a reason:
- NFT and AWM roll out with the Euler ODE step on the model's own schedule (NVlabs' NFT uses a 2nd-order DPM
  solver, AWM an SA-solver): one sampler for every algorithm keeps the comparison about the update rule. AWM's
  SA-solver is stochastic on t in [0.3, 0.9]; `algo.sde_steps` puts the SDE step of the other algorithms on
  those grid steps instead (the same noise, not the same solver).
- NFT's old policy is an EMA of theta kept as a copy of the trainable tensors (swapped into the module to
  sample and to evaluate v_old) rather than a second adapter: it works the same for LoRA and full weights and
  is saved with the checkpoint, so a resume is exact.
- AWM's old log-weights come from a no-grad pass with the pre-update weights over the same points (the
  reference keeps the pre-epoch model); its KL to an EMA of the policy (algo.ema_kl_coef) is the reference's,
  with the EMA kept like NFT's old policy (a copy of the trainable tensors).
- In the asynchronous mode (fgrpo/async_mode.py) the rollout ranks are sent `sampling_weights()`'s tensors
  (NFT: the EMA) and sample with them as they are; DPPO's loss takes the stale batches' IS weight, and NFT and
  AWM train stale batches uncorrected (their losses read no sampling likelihood).
- MixGRPO's window slides from sampling.window_range's start to the last step that keeps it whole, then
  restarts there (core.schedule.sliding_window); MixGRPO-Flash's DPM-Solver++ tail after the window is the rollout's
  `sampling.ode_tail="dpmpp_2m"` (the `mixgrpo-flash` presets).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np
import torch

from fgrpo.config import SamplingConfig, TrainConfig, validate_config
from fgrpo.core import awm, dppo, ema, grpo, nft, schedule, sde
from fgrpo.errors import ConfigError
from fgrpo.models import registry
from fgrpo.models.base import FlowModel, cond_index, trained_transformers
from fgrpo.models.lora import adapters_disabled
from fgrpo.parallel import is_dtensor, world_size
from fgrpo.policy import transition
from fgrpo.recompute import (
    exact_micro_batch,
    micro_batches,
    minibatch_rows,
    off_policy_weights,
    recompute_log_prob,
    recompute_log_probs_and_means,
)
from fgrpo.rollout.base import Trajectory
from fgrpo.rollout.engine import validation_sampling
from fgrpo.rollout.seeds import TRAIN_POINTS, sample_generator, sample_seed

Stats = dict[str, list[float]]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of an FSDP2 (DTensor) parameter, or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


class EmaWeights:
    """An exponential moving average of the trainable tensors (this rank's shards), swapped in to sample or
    evaluate the "old" policy. decay(k) = core.ema.ema_decay(k optimizer steps done, rate, max_decay, delay)."""

    def __init__(self, params: list[torch.nn.Parameter], *, rate: float, max_decay: float, delay: int):
        self.params = params
        self.tensors = [_local(p).detach().clone() for p in params]
        self.decay = partial(ema.ema_decay, rate=rate, max_decay=max_decay, delay=delay)

    def update(self, optimizer_steps_done: int) -> float:
        d = self.decay(optimizer_steps_done)
        ema.ema_update_(self.tensors, [_local(p).detach() for p in self.params], d)
        return d

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The module computes with the EMA weights inside the block, with its own weights again after it."""
        own = [_local(p).detach().clone() for p in self.params]
        # torch's fused multi-tensor ops are documented but underscore-named (not in torch's __all__).
        with torch.no_grad():
            torch._foreach_copy_([_local(p) for p in self.params], self.tensors)  # pyright: ignore[reportPrivateImportUsage]
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([_local(p) for p in self.params], own)  # pyright: ignore[reportPrivateImportUsage]

    def state(self) -> dict[str, torch.Tensor]:
        return {f"ema/{i}": t for i, t in enumerate(self.tensors)}


class Algorithm:
    """Flow-GRPO: PPO's clipped surrogate on the log-probs of the SDE window's transitions."""

    needs_old_mean = False  # the loss reads the rollout's transition means (ratio norm, DPPO)
    # Samples with the ODE and trains the velocity at fresh forward-process points (no SDE window, no log-probs).
    forward_process = False

    def __init__(self, cfg: TrainConfig, params: list[torch.nn.Parameter]):
        self.cfg = cfg

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        """Raise ConfigError (one line: the field and the fix) for a setting this algorithm cannot train with.
        The window algorithms' check: the SDE window exists and lies inside the schedule."""
        s = cfg.sampling
        if s.sde_kind == "ode" or s.window_size < 1:
            raise ConfigError(
                "sampling.sde_kind='ode' / window_size<1 leaves nothing to train; use flow_sde, cps or dance_sde"
            )
        lo, hi = s.window_range
        if not (0 <= lo and lo + s.window_size <= hi <= s.num_steps):
            raise ConfigError(
                f"sampling.window_range={s.window_range} with window_size={s.window_size} must satisfy "
                f"0 <= lo, lo + window_size <= hi <= num_steps={s.num_steps}"
            )
        if cfg.rollout_engine == "vllm_omni" and cfg.grpo.old_log_prob != "recompute":
            raise ConfigError(
                "rollout_engine='vllm_omni' needs --grpo.old-log-prob recompute (its kernels differ)"
            )

    def rollout_fields(self) -> tuple[str, ...]:
        """The Trajectory's optional fields (`mean`, `x0`) that `update` reads, which an engine in another process
        then sends back (the in-process engine fills them all). The window algorithms read the rollout's
        transition means only when their loss does and they keep the rollout's log-probs: a recompute pass
        recomputes the means with them."""
        g = self.cfg.grpo
        reads_mean = self.needs_old_mean or g.ratio_norm
        return ("mean",) if reads_mean and g.old_log_prob == "rollout" else ()

    def sampling(self, step: int) -> SamplingConfig:
        """How this step's rollout samples: sampling.micro_batch capped so that no forward holds rows of two of
        this rank's mini-batches (`forward_rows`), which the trainer then trains whole."""
        s = self.cfg.sampling
        n = self.cfg.samples_per_step // self.cfg.parallel.trainer_ranks(world_size())
        return dataclasses.replace(s, micro_batch=forward_rows(n, self.cfg), unit_block=n)

    def sampling_weights(self) -> contextlib.AbstractContextManager:
        """The weights the rollout samples with (theta unless an algorithm samples an old policy)."""
        return contextlib.nullcontext()

    def loss(self, log_prob, old_log_prob, mean, old_mean, std, advantages, weight=None):
        g = self.cfg.grpo
        return grpo.clipped_policy_loss(
            log_prob,
            old_log_prob,
            advantages,
            clip_range=g.clip_range,
            adv_clip_max=g.adv_clip_max,
            ratio_norm=g.ratio_norm,
            mean=mean,
            std=std,
            old_mean=old_mean,
            weight=weight,
        )

    def update(
        self, model, params, optimizer, lr_scheduler, traj, advantages, generator, off_policy=False
    ) -> dict[str, float]:
        return window_update(
            model, params, optimizer, lr_scheduler, traj, advantages, self.cfg, generator, self, off_policy
        )

    def after_update(self, step: int) -> dict[str, float]:
        """Bookkeeping after the step's optimizer steps (the EMA of the old policy)."""
        return {}

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors the checkpoint must keep beside the model and optimizer (NFT: this rank's EMA shards)."""
        return {}


class FlowDPPO(Algorithm):
    """Flow-DPPO: the policy-gradient term of a transition is dropped once its KL to the rollout policy passes
    tau and the update would push it further; no ratio clip."""

    needs_old_mean = True

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        if cfg.algo.dppo_tau < 0:
            raise ConfigError(f"algo.dppo_tau={cfg.algo.dppo_tau}: must be >= 0")
        super().check(cfg)

    def loss(self, log_prob, old_log_prob, mean, old_mean, std, advantages, weight=None):
        return dppo.dppo_loss(
            log_prob, old_log_prob, mean, old_mean, std, advantages, tau=self.cfg.algo.dppo_tau, weight=weight
        )


class MixGRPO(Algorithm):
    """MixGRPO: one SDE window for the whole batch that slides from sampling.window_range's start over every
    step but the last (or to the range's end: algo.window_in_range) as training proceeds, and restarts at that
    start after the end (algo.window_roll_back, the reference scripts' setting)."""

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        a, s = cfg.algo, cfg.sampling
        if a.window_iters < 1 or a.window_stride < 0:
            raise ConfigError(
                f"algo.window_iters={a.window_iters} must be >= 1 and algo.window_stride={a.window_stride} >= 0"
            )
        super().check(cfg)
        if s.window_range[0] + s.window_size > s.num_steps - 1:
            raise ValueError(
                f"algo.name='mixgrpo' slides its window before the last step: sampling.window_range="
                f"{s.window_range} with window_size={s.window_size} needs lo + window_size <= num_steps - 1 = "
                f"{s.num_steps - 1}"
            )

    def sampling(self, step: int) -> SamplingConfig:
        s, a = super().sampling(step), self.cfg.algo
        w = schedule.sliding_window(
            step,
            num_steps=s.num_steps,
            window_size=s.window_size,
            iters_per_window=a.window_iters,
            stride=a.window_stride,
            lo=s.window_range[0],
            hi=s.window_range[1] if a.window_in_range else None,
            roll_back=a.window_roll_back,
        )
        return dataclasses.replace(
            s, window_range=(w[0], w[-1] + 1)
        )  # a range of exactly W steps: no draw left


class ForwardProcessAlgorithm(Algorithm):
    """Algorithms that sample with the ODE and train the velocity at fresh forward-process points."""

    forward_process = True
    shared_steps = False  # one set of grid steps for the whole batch (AWM) or one per sample (NFT)
    ema: EmaWeights | None = (
        None  # an EMA of theta (NFT's old policy, AWM's KL anchor), updated after each step
    )

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        """The training points lie on the schedule's grid; no setting that reads transition log-probs."""
        a, s, g = cfg.algo, cfg.sampling, cfg.grpo
        hi = a.train_steps_hi or s.num_steps
        if not 0 <= a.train_steps_lo < hi <= s.num_steps or not 1 <= a.train_steps <= hi - a.train_steps_lo:
            raise ConfigError(
                f"algo.train_steps={a.train_steps} in grid steps [algo.train_steps_lo={a.train_steps_lo}, "
                f"algo.train_steps_hi={hi}) must satisfy 0 <= lo < hi <= sampling.num_steps={s.num_steps} and "
                "1 <= train_steps <= hi - lo"
            )
        _check_ranges(cls.ranges(cfg))
        lo, hi = a.sde_steps
        if not 0 <= lo <= hi <= s.num_steps:
            raise ConfigError(
                f"algo.sde_steps={a.sde_steps} must satisfy 0 <= lo <= hi <= sampling.num_steps={s.num_steps} "
                "((0, 0): the ODE throughout)"
            )
        if hi > lo and (s.sde_kind == "ode" or s.noise_level <= 0):
            raise ConfigError(
                f"algo.sde_steps={a.sde_steps} needs a stochastic step: set --sampling.sde-kind (flow_sde, cps, "
                f"dance_sde) and --sampling.noise-level > 0 (now {s.sde_kind!r}, {s.noise_level})"
            )
        if g.old_log_prob != "rollout" or g.ratio_norm or g.group_init_noise:
            raise ConfigError(
                f"algo.name={a.name!r} has no transition log-probs: drop --grpo.old-log-prob, "
                "--grpo.ratio-norm and --grpo.group-init-noise"
            )

    @classmethod
    def ranges(cls, cfg: TrainConfig) -> list[tuple[bool, str, float]]:
        """(holds, field, value) of the algorithm's own numeric fields."""
        return []

    def rollout_fields(self) -> tuple[str, ...]:
        return ("x0",)  # the final clean latents, noised afresh at the training points

    def sampling(self, step: int) -> SamplingConfig:
        """The ODE, or the SDE step on the grid steps algo.sde_steps names (one window, the same for every
        sample) and the ODE elsewhere. Only the clean latents are kept either way."""
        s = super().sampling(step)
        lo, hi = self.cfg.algo.sde_steps
        if hi > lo:
            return dataclasses.replace(s, window_size=hi - lo, window_range=(lo, hi))
        return validation_sampling(s, self.cfg.sampling.num_steps)

    def update(
        self, model, params, optimizer, lr_scheduler, traj, advantages, generator, off_policy=False
    ) -> dict[str, float]:
        """off_policy (a stale batch of the asynchronous mode) changes nothing: the loss reads the rollout's
        clean latents and the old policy at fresh points, never the sampling policy's likelihood, so there is
        no behaviour/old ratio to correct (DiffusionNFT trains on any sampler's data by design)."""
        return forward_process_update(
            model, params, optimizer, lr_scheduler, traj, advantages, self.cfg, generator, self
        )

    def old_pass(self, model: FlowModel, traj: Trajectory, points: TrainingPoints) -> dict[str, torch.Tensor]:
        """The fixed numbers the loss compares against at every training point, each [B, K, ...], computed
        before any update of the step (the old policy's; AWM's EMA anchor)."""
        raise NotImplementedError

    def point_loss(self, v, x_t, x0, noise, sigma, old, advantages):
        """(loss, metrics) at one training point of `rows`; `old` holds old_pass's tensors at [rows, k]."""
        raise NotImplementedError

    def after_update(self, step: int) -> dict[str, float]:
        """The EMA's update with the decay of the optimizer steps done so far (core.ema.ema_decay)."""
        if self.ema is None:
            return {}
        g = self.cfg.grpo
        return {"ema_decay": self.ema.update((step + 1) * g.inner_epochs * g.optimizer_steps_per_step)}

    def state(self) -> dict[str, torch.Tensor]:
        return self.ema.state() if self.ema is not None else {}


class DiffusionNFT(ForwardProcessAlgorithm):
    """DiffusionNFT: fit implicit positive and negative policies around an EMA old policy, weighted by the
    optimality probability of each sample's reward."""

    @classmethod
    def ranges(cls, cfg: TrainConfig) -> list[tuple[bool, str, float]]:
        a = cfg.algo
        return [
            (a.nft_beta > 0, "algo.nft_beta", a.nft_beta),
            (0 <= a.ema_max_decay <= 1, "algo.ema_max_decay", a.ema_max_decay),
            (a.ema_rate >= 0, "algo.ema_rate", a.ema_rate),
            (a.ema_delay >= 0, "algo.ema_delay", a.ema_delay),
        ]

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        super().check(cfg)
        if cfg.rollout_engine == "vllm_omni" and cfg.algo.sample_from_ema:
            # The engine holds one adapter, the trained LoRA that validation also samples with.
            raise ConfigError(
                "algo.sample_from_ema rolls out the EMA policy, which rollout_engine='vllm_omni' is never sent; "
                "pass --algo.no-sample-from-ema or use rollout_engine='diffusers'"
            )

    def __init__(self, cfg: TrainConfig, params: list[torch.nn.Parameter]):
        super().__init__(cfg, params)
        a = cfg.algo
        self.old_policy = EmaWeights(params, rate=a.ema_rate, max_decay=a.ema_max_decay, delay=a.ema_delay)
        self.ema = self.old_policy

    def sampling_weights(self) -> contextlib.AbstractContextManager:
        return self.old_policy.swapped_in() if self.cfg.algo.sample_from_ema else contextlib.nullcontext()

    @torch.no_grad()
    def old_pass(self, model, traj, points):
        """v_old [B, K, *latent]: the EMA policy's velocity at every training point."""
        with self.old_policy.swapped_in():
            return {"v_old": _velocities(model, traj, points, forward_rows(len(traj), self.cfg))}

    def point_loss(self, v, x_t, x0, noise, sigma, old, advantages):
        g = self.cfg.grpo
        r = nft.optimality_prob(advantages, adv_clip=g.adv_clip_max)
        return nft.nft_loss(
            v,
            old["v_old"],
            x_t,
            x0,
            sigma,
            r,
            beta=self.cfg.algo.nft_beta,
            scale=g.adv_clip_max,
            weighting=self.cfg.algo.nft_weighting,
        )


class AWM(ForwardProcessAlgorithm):
    """Advantage Weighted Matching: PPO's clipped surrogate on a flow-matching log-weight of fresh
    forward-process points, one set of grid times for the batch, plus the KL to an EMA of the policy.

    The surrogate alone lets a sample with a negative advantage raise its flow-matching error without bound (the
    ratio is clipped only above 1 + eps = 2). The EMA term (the reference's ema_beta; decay at most 0.3, refreshed
    every optimizer step) trails the policy by less than a step: it damps step-to-step jitter and moves with a slow
    drift. What anchors is the KL to the frozen model (grpo.kl_coef, the reference's train.beta, without which the
    reference code does not run); the tiny presets leave it off. The renderer's images darkened with it at 3e-3 as
    without it (RESULTS.md, stability-changed and stability-partial). Its update fits the flow to the policy's own
    samples: on a model whose samples lie far from its training data that fit moves the model with no reward in it,
    and the centred advantages cancel it only where it is alike across a group (RESULTS.md, cpu-awm-selffit). With
    the reward taken out (each group's advantages permuted), its noise alone still moves the images' brightness
    (about 4x) and contrast (about 2.4x) farther than Flow-GRPO's does (RESULTS.md, cpu-awm-noise). What held the
    renderer to 300 steps is Adam's epsilon raised above most coordinates' gradient scale: the coordinates with
    small gradients, where such noise likely weighs most against the reward's signal, then move at SGD-like steps
    (RESULTS.md, stability-12)."""

    shared_steps = True

    @classmethod
    def ranges(cls, cfg: TrainConfig) -> list[tuple[bool, str, float]]:
        a = cfg.algo
        return [
            (a.awm_p > 0, "algo.awm_p", a.awm_p),
            (a.ema_kl_coef >= 0, "algo.ema_kl_coef", a.ema_kl_coef),
            (0 <= a.kl_ema_max_decay <= 1, "algo.kl_ema_max_decay", a.kl_ema_max_decay),
            (a.kl_ema_rate >= 0, "algo.kl_ema_rate", a.kl_ema_rate),
        ]

    def __init__(self, cfg: TrainConfig, params: list[torch.nn.Parameter]):
        super().__init__(cfg, params)
        a = cfg.algo
        self.ema = (
            EmaWeights(params, rate=a.kl_ema_rate, max_decay=a.kl_ema_max_decay, delay=0)
            if a.ema_kl_coef > 0
            else None
        )

    @torch.no_grad()
    def old_pass(self, model, traj, points):
        """Old log-weights [B, K] under the pre-update weights, in the rollout's micro-batches (the training
        forwards' rows): the first mini-batch's ratio is exactly 1; and the EMA policy's velocities
        [B, K, *latent] at the same points when its KL is on."""
        out = torch.empty(len(traj), points.k, device=points.x0.device)
        rows_per_forward = forward_rows(len(traj), self.cfg)
        for k in range(points.k):
            for rows in micro_batches(len(traj), rows_per_forward):
                x_t, x0, noise, sigma = points.at(rows, k)
                v = model.velocity(x_t, sigma, cond_index(traj.cond, rows), guidance_scale=1.0)
                out[rows, k] = awm.awm_log_weight(v, x0, noise, sigma, p=self.cfg.algo.awm_p)
        if self.ema is None:
            return {"log_weight": out}
        with self.ema.swapped_in():
            return {"log_weight": out, "v_ema": _velocities(model, traj, points, rows_per_forward)}

    def point_loss(self, v, x_t, x0, noise, sigma, old, advantages):
        g = self.cfg.grpo
        log_weight = awm.awm_log_weight(v, x0, noise, sigma, p=self.cfg.algo.awm_p)
        loss, metrics = awm.awm_loss(
            log_weight, old["log_weight"], advantages, adv_clip=g.adv_clip_max, clip_range=g.clip_range
        )
        if self.ema is not None:
            ema_kl = grpo.velocity_kl(v, old["v_ema"]).mean()
            loss = loss + self.cfg.algo.ema_kl_coef * ema_kl
            metrics["ema_kl"] = ema_kl.detach()
        return loss, metrics


ALGORITHMS: dict[str, type[Algorithm]] = {
    "grpo": Algorithm,
    "dppo": FlowDPPO,
    "mixgrpo": MixGRPO,
    "nft": DiffusionNFT,
    "awm": AWM,
}


def forward_rows(n: int, cfg: TrainConfig) -> int:
    """Samples per forward of the rollout and of every pass over its n samples on this rank (recompute, old
    policy, training): sampling.micro_batch, or fewer where a mini-batch holds fewer (exact_micro_batch)."""
    return exact_micro_batch(n, cfg.sampling.micro_batch, cfg.grpo.optimizer_steps_per_step)


def _check_ranges(ranges: list[tuple[bool, str, float]]) -> None:
    for ok, name, value in ranges:
        if not ok:
            raise ConfigError(f"{name}={value} is out of range; see --help for its meaning")


def check_config(cfg: TrainConfig, world_size: int) -> None:
    """Every check of a run's configuration before anything is built: config.validate_config's, the model
    family's (models.registry.check_config), then the configured algorithm's own (`Algorithm.check`). Raises
    ConfigError naming the field and the fix."""
    validate_config(cfg, world_size)
    registry.check_config(cfg)
    ALGORITHMS[cfg.algo.name].check(cfg)


def build(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> Algorithm:
    return ALGORITHMS[cfg.algo.name](cfg, params)


# ----------------------------------------------------------------------------------------------------------
# The two update functions


def optimizer_step(params, optimizer, lr_scheduler, grad_clip: float, stats: Stats) -> None:
    """Clip, step (unless the gradient is not finite: one bad batch must not poison AdamW's moments), zero."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    grad_norm = float(grad_norm.full_tensor() if is_dtensor(grad_norm) else grad_norm)
    stats["grad_norm"].append(grad_norm)
    finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    stats["skipped_steps"].append(0.0 if finite else 1.0)
    optimizer.zero_grad(set_to_none=True)
    lr_scheduler.step()


def summarize(stats: Stats) -> dict[str, float]:
    """Per-step metrics: means, except the ratio extremes, and counts of (skipped) optimizer steps."""
    out = {
        k: float(np.mean(v)) for k, v in stats.items() if k not in ("skipped_steps", "ratio_min", "ratio_max")
    }
    if "ratio_min" in stats:
        out["ratio_min"] = float(np.min(stats["ratio_min"]))
        out["ratio_max"] = float(np.max(stats["ratio_max"]))
    out["skipped_steps"] = float(np.sum(stats["skipped_steps"]))
    out["optimizer_steps"] = float(len(stats["skipped_steps"]))
    return out


def minibatch_updates(
    window: torch.Tensor,
    points: int,
    micro_loss: Callable[[torch.Tensor, int], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    cfg: TrainConfig,
    generator: torch.Generator,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    device: torch.device,
    after_minibatch: Callable[[], None] | None = None,
) -> Stats:
    """The update skeleton every algorithm shares: inner epochs x mini-batches (rollout.engine.minibatch_rows over
    this rank's samples, whose [B, W] SDE window fixes the rollout's micro-batches), each the sum over `points`
    trained points (window entries, forward-process points) x micro-batches of micro_loss(rows, point) -> (loss,
    detached metrics), then one optimizer step (`optimizer_step`: clipped, skipped when not finite). Returns every
    micro-batch's metrics and loss and every optimizer step's gradient norm (`summarize` makes the step's metrics).

    Gradients are scaled so that the update equals that of one big batch: each micro-batch adds (its rows x points
    / the mini-batch's rows x points on this rank) of its mean loss, and FSDP averages equal-sized rank shards.
    """
    g = cfg.grpo
    mb = g.train_micro_batch or cfg.sampling.micro_batch
    stats: Stats = defaultdict(list)
    for _epoch in range(g.inner_epochs):
        for chunk in minibatch_rows(
            window, mb, cfg.sampling.micro_batch, g.optimizer_steps_per_step, generator
        ):
            n = sum(len(rows) for rows in chunk) * points
            for j in range(points):
                for rows in chunk:
                    rows = rows.to(device)
                    loss, metrics = micro_loss(rows, j)
                    (loss * (len(rows) * 1.0 / n)).backward()
                    for k, v in metrics.items():
                        stats[k].append(float(v))
                    stats["loss"].append(loss.item())
            if after_minibatch is not None:
                after_minibatch()
            optimizer_step(params, optimizer, lr_scheduler, cfg.optim.grad_clip, stats)
    return stats


def window_update(
    model: FlowModel,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    traj: Trajectory,
    advantages: torch.Tensor,
    cfg: TrainConfig,
    generator: torch.Generator,
    algo: Algorithm,
    off_policy: bool = False,
) -> dict[str, float]:
    """Inner epochs x mini-batches of `algo.loss` on the log-probs of this rank's stored window transitions.

    off_policy: the rollout sampled with older weights than these (the asynchronous mode's stale batches).
    The old log-probs are then recomputed with these weights and the rollout's own become the behaviour
    policy's: each entry's loss is weighted by the configured correction (cfg.parallel, async_mode).

    The mini-batching, gradient scaling and optimizer steps are `minibatch_updates`'.

    Deviation from flow_grpo, which shuffles single samples: when the training micro-batch equals the
    rollout's, we shuffle whole rollout micro-batches (`Algorithm.sampling` caps them at a mini-batch, so
    there are enough to deal out). Each training forward then sees exactly the rows (and prompt padding) of a
    rollout forward, so at unchanged weights its log-probs are bit-identical to the rollout's and the first
    update's ratio is exactly 1 (a forward of other rows has other matmul shapes, which a GPU may round
    differently, eager or compiled).
    """
    g, s = cfg.grpo, cfg.sampling
    B, W = traj.window.shape
    gap_per_step: dict[int, list[float]] = defaultdict(list)
    old_log_prob, old_mean = traj.log_prob, traj.mean
    first_update = [True]  # until the first optimizer step the weights are the rollout's
    needs_mean = algo.needs_old_mean or g.ratio_norm
    weight, offpolicy_stats = None, {}
    if g.old_log_prob == "recompute" or off_policy or (needs_mean and old_mean is None):
        recomputed, old_mean = recompute_log_probs_and_means(
            model, traj, dataclasses.replace(s, micro_batch=forward_rows(B, cfg))
        )
        if g.old_log_prob == "recompute":
            old_log_prob = recomputed
            _record_gap(gap_per_step, traj.window, recomputed, traj.log_prob)
            first_update[0] = False  # the gap is measured; training starts from the trainer's own numbers
        if off_policy:
            old_log_prob, first_update[0] = recomputed, False  # the gap is the staleness, not the numerics
            weight, offpolicy_stats = off_policy_weights(
                recomputed, traj.log_prob, cfg.parallel, elements=traj.x_t[0, 0].numel()
            )
    if not needs_mean:
        old_mean = None  # the loss gets the rollout's means only when it reads them

    def micro_loss(rows: torch.Tensor, j: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of window entry j of `rows` (the transition the rollout took at step traj.window[rows, j])."""
        log_prob, mean, std = recompute_log_prob(model, traj, s, rows, j)
        old = old_log_prob[rows, j]
        if first_update[0]:  # weights still equal the rollout's: the gap is the numerics alone
            _record_gap(
                gap_per_step,
                traj.window[rows, j : j + 1],
                log_prob.detach()[:, None],
                old[:, None],
            )
        loss, metrics = algo.loss(
            log_prob,
            old,
            mean,
            old_mean[rows, j] if old_mean is not None else None,
            std,
            advantages[rows],
            weight[rows, j] if weight is not None else None,
        )
        if g.kl_coef > 0:
            steps = traj.window[rows, j]
            sigma, sigma_next = traj.sigmas[steps], traj.sigmas[steps + 1]
            with torch.no_grad(), adapters_disabled(*trained_transformers(model).values()):
                ref_mean, _ = transition(
                    model, traj.x_t[rows, j], sigma, sigma_next, cond_index(traj.cond, rows), s
                )
            kl = grpo.gaussian_kl(mean, ref_mean, std, kind=g.kl_kind, step_size=sigma - sigma_next)
            loss = loss + g.kl_coef * kl.mean()
            metrics = metrics | {"kl": kl.detach().mean()}
        return loss, metrics

    def after_minibatch() -> None:
        first_update[0] = False

    stats = minibatch_updates(
        traj.window,
        W,
        micro_loss,
        cfg,
        generator,
        params,
        optimizer,
        lr_scheduler,
        traj.x_t.device,
        after_minibatch,
    )

    out = summarize(stats) | offpolicy_stats
    for i, gaps in sorted(gap_per_step.items()):
        out[f"logprob_gap/step{i}"] = float(np.max(gaps))
    if gap_per_step:
        out["logprob_gap/max"] = max(out[f"logprob_gap/step{i}"] for i in gap_per_step)
    return out


def _record_gap(
    gaps: dict[int, list[float]], window: torch.Tensor, new: torch.Tensor, old: torch.Tensor
) -> None:
    """Append |new - old| log-prob per denoising-step index (window: [m, W'] step ids of the [m, W'] values)."""
    for i, gap in zip(window.flatten().tolist(), (new - old).abs().flatten().tolist()):
        gaps[i].append(gap)


@dataclasses.dataclass
class TrainingPoints:
    """The K forward-process points per sample of one step: x_t = (1 - sigma) x0 + sigma noise."""

    x0: torch.Tensor  # [B, *latent] the rollout's clean latents
    noise: torch.Tensor  # [B, K, *latent]
    sigma: torch.Tensor  # [B, K] the schedule's sigma at the drawn grid steps

    @property
    def k(self) -> int:
        return self.sigma.shape[1]

    def at(self, rows, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_t, x0, noise, sigma) of point k of `rows`."""
        x0, noise, sigma = self.x0[rows], self.noise[rows, k], self.sigma[rows, k]
        return sde.forward_noise(x0, noise, sigma), x0, noise, sigma


def draw_points(
    traj: Trajectory, k: int, steps_range: tuple[int, int], generator: torch.Generator, *, shared: bool
) -> TrainingPoints:
    """K forward-process points per sample. A sample's noise (and, unless `shared`, its grid steps) come from a
    generator of its own rollout seed, so its points do not depend on the batch or the rank it lands on; shared
    steps (one set for the global batch) come from `generator`, the step's stream every rank draws alike."""
    assert traj.x0 is not None
    lo, hi = steps_range
    gens = [sample_generator(sample_seed(int(seed), TRAIN_POINTS)) for seed in traj.seeds.tolist()]
    if shared:
        steps = schedule.stratified_steps(len(gens), k, lo, hi, generator, shared=True)
    else:
        steps = torch.cat([schedule.stratified_steps(1, k, lo, hi, g, shared=False) for g in gens])
    noise = torch.stack([torch.randn(k, *traj.x0.shape[1:], generator=g) for g in gens])
    device = traj.x0.device
    return TrainingPoints(traj.x0, noise.to(device), traj.sigmas[steps.to(device)])


def _velocities(model: FlowModel, traj: Trajectory, points: TrainingPoints, micro_batch: int) -> torch.Tensor:
    """[B, K, *latent] velocities (no CFG) at every training point, in the rollout's micro-batches."""
    B = len(traj)
    out = torch.empty(B, points.k, *points.x0.shape[1:], device=points.x0.device)
    for k in range(points.k):
        for rows in micro_batches(B, micro_batch):
            x_t, _, _, sigma = points.at(rows, k)
            out[rows, k] = model.velocity(x_t, sigma, cond_index(traj.cond, rows), guidance_scale=1.0).float()
    return out


def forward_process_update(
    model: FlowModel,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    traj: Trajectory,
    advantages: torch.Tensor,
    cfg: TrainConfig,
    generator: torch.Generator,
    algo: ForwardProcessAlgorithm,
) -> dict[str, float]:
    """Inner epochs x mini-batches of `algo.point_loss` at K forward-process points x_t = (1 - t) x0 + t noise
    per sample, t = the schedule's sigma at grid steps drawn by core.schedule.stratified_steps.

    The points are drawn once per step (`draw_points`); `algo.old_pass` evaluates the old
    policy on all of them before any update; the training velocity has no CFG (NFT's and AWM's recipes).
    The mini-batching, gradient scaling and optimizer steps are `minibatch_updates`'.
    """
    g, s, a = cfg.grpo, cfg.sampling, cfg.algo
    if traj.x0 is None:
        raise ValueError(
            f"algo.name={a.name!r} trains on the rollout's clean latents; this engine returns none"
        )
    K = a.train_steps
    points = draw_points(
        traj, K, (a.train_steps_lo, a.train_steps_hi or s.num_steps), generator, shared=algo.shared_steps
    )
    old = algo.old_pass(model, traj, points)  # each [B, K, ...]

    def micro_loss(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of training point k of `rows`."""
        x_t, x0, eps, sigma = points.at(rows, k)
        cond = cond_index(traj.cond, rows)
        v = model.velocity(x_t, sigma, cond, guidance_scale=1.0).float()
        at = {name: t[rows, k] for name, t in old.items()}
        loss, metrics = algo.point_loss(v, x_t, x0, eps, sigma, at, advantages[rows])
        if g.kl_coef > 0:  # the references' KL to the frozen model
            with torch.no_grad(), adapters_disabled(*trained_transformers(model).values()):
                v_ref = model.velocity(x_t, sigma, cond, guidance_scale=1.0).float()
            kl = grpo.velocity_kl(v, v_ref).mean()
            loss = loss + g.kl_coef * kl
            metrics = metrics | {"kl": kl.detach()}
        return loss, metrics

    stats = minibatch_updates(
        traj.window, K, micro_loss, cfg, generator, params, optimizer, lr_scheduler, traj.x0.device
    )
    return summarize(stats)
