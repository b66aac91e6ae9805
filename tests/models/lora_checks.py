"""The families' shared check: with a trained-looking LoRA, the log-prob recompute is bit-exact and backpropagates."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from fgrpo.config import SamplingConfig
from fgrpo.models.base import FlowModel
from fgrpo.models.lora import add_lora
from fgrpo.recompute import recompute_log_prob, recompute_log_probs
from fgrpo.rollout.engine import DiffusersEngine, forward_units


def lora_recompute_grads(
    m: FlowModel, targets: Sequence[str], base: SamplingConfig, prompts: list[str], seeds: list[int]
) -> dict[str, torch.Tensor | None]:
    """Add a rank-2 LoRA on `targets` with B != 0 (so it really changes the velocity), roll out 4 steps with the SDE
    window on steps 1-2, assert the recomputed log-probs equal the rollout's bit for bit (all, and one forward unit
    with grad), backpropagate that unit's log-prob and return every LoRA parameter's gradient by name."""
    add_lora(m.transformer, rank=2, alpha=4, target_modules=targets)
    with torch.no_grad():
        for n, p in m.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    cfg = dataclasses.replace(base, num_steps=4, window_range=(1, 3))
    traj = DiffusersEngine(m).generate(prompts, seeds, cfg)
    assert torch.equal(recompute_log_probs(m, traj, cfg), traj.log_prob)
    rows = forward_units(traj.window, cfg.micro_batch)[0]
    log_prob, _, _ = recompute_log_prob(m, traj, cfg, rows, 1)
    assert torch.equal(log_prob.detach(), traj.log_prob[rows, 1])
    log_prob.sum().backward()
    return {n: p.grad for n, p in m.transformer.named_parameters() if "lora_" in n}
