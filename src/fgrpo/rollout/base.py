"""Rollout interface: the sampling config, the Trajectory a rollout returns, and the engine Protocol."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch

from fgrpo.core.sde import Kind
from fgrpo.models.base import Cond


@dataclass(frozen=True)
class SamplingConfig:
    """How images are sampled during rollout (and how training recomputes the trained transitions)."""

    height: int = 512
    """Image height in pixels (a multiple of the model's latent patch size)."""
    width: int = 512
    """Image width in pixels (a multiple of the model's latent patch size)."""
    num_steps: int = 10
    """Number of denoising steps of the rollout."""
    guidance_scale: float = 4.0
    """CFG scale (true-CFG for Qwen-Image, plain CFG for SD3). 1.0 turns CFG off (one forward per step)."""
    negative_prompt: str | None = " "
    """Negative prompt for CFG; ignored when guidance_scale is 1.0."""
    sde_kind: Kind = "flow_sde"
    """Stochastic step used inside the SDE window (see fgrpo.core.sde.step_mean_std)."""
    noise_level: float = 1.2
    """Noise level of the SDE step (its meaning depends on sde_kind)."""
    window_size: int = 2
    """Number of consecutive stochastic (and trained) steps per sample."""
    window_range: tuple[int, int] = (0, 5)
    """Steps [lo, hi) from which each sample's window is drawn (start uniform in [lo, hi - window_size])."""
    micro_batch: int = 8
    """Samples per transformer forward during rollout (and training recomputation)."""
    unit_block: int = 0
    """Rows are grouped into micro-batches (by window start, rollout.engine.forward_units) within each run of this
    many consecutive rows; 0: the whole batch. Set by the algorithm to a trainer's share of the rollout, which
    differs from the batch only in the asynchronous mode (a rollout rank serving several trainers)."""
    ode_tail: Literal["euler", "dpmpp_2m"] = "euler"
    """Solver after the SDE window: Euler on the full grid, or MixGRPO-Flash's DPM-Solver++(2M) on a compressed
    grid (needs one window for the whole batch; without a window every step stays Euler)."""
    tail_compress: float = 1.0
    """dpmpp_2m tail: fraction in (0, 1] of the steps after the window that it keeps (core.schedule.compressed_tail;
    MixGRPO-Flash 0.4, Flash* 0.2, 1.0 keeps the model's grid)."""


@dataclass
class Trajectory:
    """What one rollout returns. All latents and log-probs are fp32. B samples, W window steps."""

    prompts: list[str]  # [B], one per sample (the G samples of a prompt share the string)
    seeds: torch.Tensor  # [B] int64, the per-sample seed that drew the initial noise and SDE noise
    sigmas: torch.Tensor  # [T + 1] fp32, the schedule shared by all samples
    window: torch.Tensor  # [B, W] int64, step indices i of the trained transitions sigma_i -> sigma_{i+1}
    x_t: torch.Tensor  # [B, W, *latent] fp32, state before each trained transition
    x_next: torch.Tensor  # [B, W, *latent] fp32, state after it (the sampled action)
    log_prob: torch.Tensor  # [B, W] fp32, log-prob of x_next under the rollout policy
    cond: Cond  # per-sample conditioning ([B] rows) to recompute the velocity in training
    images: torch.Tensor  # [B, H, W, 3] uint8 (a video model's frames: [B, F, H, W, 3])
    mean: torch.Tensor | None = (
        None  # [B, W, *latent] fp32, the rollout policy's transition mean (Flow-DPPO's old mean)
    )
    x0: torch.Tensor | None = None  # [B, *latent] fp32, the final clean latents (what NFT and AWM train on)

    def __len__(self) -> int:
        return len(self.prompts)

    def to(self, device: torch.device | str) -> Trajectory:
        """The same trajectory with every tensor on `device` (engines in another process return CPU tensors)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            if isinstance(getattr(self, f.name), torch.Tensor)
            else getattr(self, f.name)
            for f in dataclasses.fields(self)
        }
        moved["cond"] = {k: v.to(device) for k, v in self.cond.items()}  # the others: tensors or None
        return Trajectory(**moved)


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[str], seeds: Sequence[int], cfg: SamplingConfig) -> Trajectory:
        """One sample per (prompt, seed) pair; the caller repeats each prompt G times with distinct seeds.

        Results depend only on (prompt, seed, cfg), never on batch layout or micro-batch size. The in-process
        engine also takes init_seeds= (one initial noise per group, --grpo.group-init-noise); the trainer passes
        it only when that flag is set.
        """
        ...


@runtime_checkable
class SleepingEngine(Protocol):
    """An engine that shares the GPU with training (vLLM-Omni): awake only for its rollouts."""

    def sleep(self) -> None:
        """Free the engine's GPU memory until wake()."""
        ...

    def wake(self) -> None: ...


@runtime_checkable
class LoraSyncedEngine(Protocol):
    """An engine with its own copy of the weights (vLLM-Omni): the trainer sends it each step's LoRA."""

    def update_lora(self, source: Path) -> object:
        """Sample with the PEFT adapter directory `source` (the trainer's export) from the next generate() on."""
        ...
