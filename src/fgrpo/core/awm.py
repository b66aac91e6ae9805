"""Advantage Weighted Matching (AWM, arXiv 2509.25050): a policy gradient on the flow-matching loss. Pure torch, fp32.

AWM keeps the pretraining objective: it re-noises each rollout's clean sample, scores the velocity error
against the true velocity noise - x0, turns that error into a per-sample "log-weight" (a surrogate
log-likelihood that grows as the error shrinks) and runs PPO's clipped surrogate on the ratio of log-weights
of the current and the old policy, weighted by the advantage.
"""

from __future__ import annotations

import torch

from fgrpo.core.grpo import clipped_policy_loss

# Offset inside the power: keeps the gradient of m^p finite at m = 0 (the reference's constant).
_EPS = 1e-10


def awm_log_weight(
    v: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    t: torch.Tensor,
    *,
    p: float = 0.25,
) -> torch.Tensor:
    """AWM's per-sample log-weight of a velocity prediction on the forward process (generalised Huber form).

    m = mean over latent elements of (v - (noise - x0))^2,
    log_weight = -((m + 1e-10)^p - (1e-10)^p) * t / p.
    p = 1 is the t-weighted flow-matching loss with a minus sign; p < 1 flattens large errors (p = 0.5 is a
    Huber-like sqrt). The reference recipes use p = 0.25 ('ghuber' weighting, ghuber_power 0.25).

    Args:
        v: [B, ...] predicted velocity at x_t = (1 - t) x0 + t noise (differentiable).
        x0: [B, ...] clean rollout sample.
        noise: [B, ...] the noise used to build x_t.
        t: [B] noise level sigma of x_t.
        p: > 0.

    Returns:
        [B] fp32.

    Differs from the reference code: fp32 instead of fp64.
    """
    if p <= 0:
        raise ValueError(f"p must be > 0, got {p}")
    if not (v.shape == x0.shape == noise.shape) or v.ndim < 2:
        raise ValueError(
            f"v {tuple(v.shape)}, x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must share one [B, ...] shape"
        )
    if t.shape != (v.shape[0],):
        raise ValueError(f"t {tuple(t.shape)} must be [B] with B = {v.shape[0]}")
    err = v.float() - (noise.float() - x0.float())
    m = (err**2).mean(dim=tuple(range(1, err.ndim)))  # [B]
    return -((m + _EPS) ** p - _EPS**p) * t.float() / p


def awm_loss(
    log_weight: torch.Tensor,
    old_log_weight: torch.Tensor,
    advantages: torch.Tensor,
    *,
    adv_clip: float = 5.0,
    clip_range: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AWM's clipped policy loss over N (timestep, sample) entries.

    A~ = clip(A, -adv_clip, adv_clip) / adv_clip in [-1, 1],   rho = exp(log_weight - old_log_weight),
    loss = mean_n max(-A~ rho, -A~ clip(rho, 1 - eps, 1 + eps)),   eps = clip_range.
    This is grpo.clipped_policy_loss on (log_weight, old_log_weight, A~) with adv_clip_max = 1 (a no-op on A~),
    so the surrogate exists once. Each entry is one (timestep, sample) pair (the reference's "exp_first":
    a ratio per entry, not per trajectory); repeat each sample's advantage over its timesteps.

    Args:
        log_weight: [N] awm_log_weight under the current policy (differentiable).
        old_log_weight: [N] the same under the old policy (no gradient flows into it).
        advantages: [N] group advantages (unclipped).
        adv_clip: > 0 (the reference's adv_clip_max, 5, with advantage_max = 1).
        clip_range: eps > 0 (the reference recipes use 1, so rho is clipped to [0, 2]).

    Returns:
        loss, metrics: as grpo.clipped_policy_loss (ratio_mean/min/max, clip_frac, approx_kl).

    Differs from the reference code: the log-ratio is clamped to +-20 before exp (grpo.clipped_policy_loss).
    """
    if adv_clip <= 0:
        raise ValueError(f"adv_clip must be > 0, got {adv_clip}")
    adv = advantages.float().clamp(-adv_clip, adv_clip) / adv_clip
    return clipped_policy_loss(log_weight, old_log_weight, adv, clip_range=clip_range, adv_clip_max=1.0)
