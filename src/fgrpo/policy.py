"""The policy's transition kernel: the one function the rollout and the trainer both call.

A Flow-GRPO "action" is the transition x_t -> x_next between two sigmas. Its Gaussian (mean, std)
comes from the model's velocity and a core SDE step; rollout samples from it and records the
log-prob, training recomputes it with the current weights. Both go through `transition`, so a
change to CFG, the schedule or the step formula can never reach one side and not the other.
"""

from __future__ import annotations

import torch

from fgrpo.config import SamplingConfig
from fgrpo.core import sde
from fgrpo.models.base import Cond, VelocityModel


def transition(
    model: VelocityModel,
    x_t: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    cond: Cond,
    cfg: SamplingConfig,
    *,
    stochastic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of x_next given x_t. x_t: [B, *latent]; sigma, sigma_next: [B].

    stochastic=False gives the deterministic Euler (ODE) step used outside the SDE window.
    """
    v = model.velocity(x_t, sigma, cond, guidance_scale=cfg.guidance_scale)
    kind = cfg.sde_kind if stochastic else "ode"
    return sde.step_mean_std(
        x_t.float(), v.float(), sigma, sigma_next, noise_level=cfg.noise_level, kind=kind
    )


def transition_log_prob(
    model: VelocityModel,
    x_t: torch.Tensor,
    x_next: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    cond: Cond,
    cfg: SamplingConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_prob [B], mean, std) of a stored stochastic transition under the current weights."""
    mean, std = transition(model, x_t, sigma, sigma_next, cond, cfg, stochastic=True)
    return sde.log_prob(x_next.float(), mean, std), mean, std
