"""Rollout interface: the Trajectory a rollout returns, and the engine Protocol."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from fgrpo.config import SamplingConfig
from fgrpo.models.base import Cond


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
class ClosingEngine(Protocol):
    """An engine with processes of its own (vLLM-Omni's workers): the trainer closes it when the run ends."""

    def close(self) -> None: ...


@runtime_checkable
class LoraSyncedEngine(Protocol):
    """An engine with its own copy of the weights (vLLM-Omni): the trainer sends it each step's LoRA."""

    def update_lora(self, source: Mapping[str, torch.Tensor], config: Any) -> object:
        """Sample with this adapter from the next generate() on: its tensors and peft `config`, held in memory
        (`models.lora.lora_file_tensors`)."""
        ...
