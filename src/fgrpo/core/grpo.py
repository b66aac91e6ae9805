"""GRPO for flow models: group advantages, the clipped per-step policy loss (with its clamped log-ratio and the
optionally weighted mean), and the KL terms to a reference policy: the Gaussian KL of an SDE transition
(Flow-GRPO's window algorithms) and the velocity KL of the forward-process algorithms (DiffusionNFT, AWM).
Pure torch, fp32."""

from __future__ import annotations

from typing import Literal

import torch


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    std: Literal["group", "global", "none"] = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Group-relative advantages A = (r - mean of r's group) / (s + eps).

    The G samples of one prompt are adjacent: rewards.view(-1, G) is one group per row. s is the
    population std (ddof 0) of the group ("group"), of the whole batch ("global"), or 1 without eps ("none").
    A group whose rewards are all equal gets exactly 0 (not a rounding residue of r - mean).

    Args:
        rewards: [B] rewards, B = num_groups * G.
        group_size: G >= 1.
        std: the normaliser, see above. "global" (group mean, batch std) is what flow_grpo's per-prompt
            tracker computes with global_std=True when each prompt's samples form one group.
        eps: added to s.

    Returns:
        [B] fp32.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"batch of {rewards.shape[0]} rewards is not a whole number of groups of {group_size}"
        )
    if std not in ("group", "global", "none"):
        raise ValueError(f"std must be 'group', 'global' or 'none', got {std!r}")
    r = rewards.float().view(-1, group_size)  # [num_groups, G]
    centred = r - r.mean(dim=1, keepdim=True)
    if std == "group":
        scale = r.std(dim=1, correction=0, keepdim=True) + eps
    elif std == "global":
        scale = r.std(correction=0) + eps
    else:
        scale = torch.ones((), device=r.device)
    adv = centred / scale
    constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)  # [num_groups, 1]
    return torch.where(constant, torch.zeros_like(adv), adv).view(-1)


# exp() of a log-ratio beyond this is far outside any clip range; the clamp only prevents inf/NaN.
MAX_LOG_RATIO = 20.0


def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """log_ratio clamped to +-MAX_LOG_RATIO before any exp: no effect inside a useful trust region, and an overflow
    becomes a finite ratio (a zero or bounded gradient) instead of inf / NaN."""
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def weighted_mean(per_entry: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """mean_b w_b * l_b over the B entries of a per-entry loss, the weights held constant (no gradient into w);
    weight None is the plain mean, bit for bit. The rollout correction's importance weight enters every policy
    loss through this one place.

    Args:
        per_entry: [B] loss of each entry.
        weight: [B] weights >= 0, or None.
    """
    if weight is None:
        return per_entry.mean()
    if weight.shape != per_entry.shape:
        raise ValueError(f"weight {tuple(weight.shape)} must be [B] like the loss {tuple(per_entry.shape)}")
    return (weight.detach().float() * per_entry).mean()


def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float = 5.0,
    ratio_norm: bool = False,
    mean: torch.Tensor | None = None,
    old_mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate for one denoising step of B samples.

    rho = exp(log_prob - old_log_prob),  A <- clamp(A, -adv_clip_max, adv_clip_max),
    loss = mean_b max(-A rho, -A clip(rho, 1 - eps, 1 + eps)).
    Its gradient is -A rho grad(log_prob) / B where the unclipped term is active and exactly 0 where the
    clip binds (A > 0 and rho > 1 + eps, or A < 0 and rho < 1 - eps).

    With a per-entry weight w (the rollout correction's truncated or masked importance weight between the
    behaviour and the old policy, core.correction.is_weights), loss = mean_b w_b max(-A rho, -A clip(rho)):
    w changes the measure the loss averages under, so no gradient flows into it, and an entry with w = 0
    passes no gradient but still counts in the mean (verl-omni's convention: rejection is a zero weight).

    ratio_norm=True is GRPO-Guard's RatioNorm (arXiv 2510.22319, as verl-omni implements it). For a Gaussian
    step the log-ratio is -||mu - mu_old||^2 / (2 std^2) - <mu - mu_old, noise> / std (mean-reduced): its
    mean sits below 0 and its spread scales with 1/std, so the clip acts differently at every step. RatioNorm
    removes the bias and rescales by the step's std:
        log rho <- (log_prob - old_log_prob + mean((mean - old_mean)^2) / (2 std^2)) * std.
    It needs mean, old_mean ([B, ...]) and std (broadcastable, constant over non-batch dims, as every kind of
    sde.step_mean_std returns). It assumes log_prob used reduce="mean".

    Args:
        log_prob: [B] log-prob of the stored x_next under the current policy (differentiable).
        old_log_prob: [B] the same under the rollout policy (no gradient flows into it).
        advantages: [B].
        clip_range: eps > 0.
        adv_clip_max: bound on |A|.
        ratio_norm, mean, old_mean, std: GRPO-Guard's ratio normalisation, see above.
        weight: [B] per-entry weights >= 0, or None for the unweighted loss (exactly the formula without w).

    Returns:
        loss: scalar. metrics: detached scalars ratio_mean/min/max, clip_frac (share of samples whose rho is
        outside [1 - eps, 1 + eps]) and approx_kl = mean(0.5 * (log rho)^2) (flow_grpo's estimator).

    Differs from flow_grpo: the log-ratio is clamped to +-20 before exp (no effect inside any useful clip
    range; it turns an overflow into a zero gradient instead of NaN).
    """
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    if not (log_prob.shape == old_log_prob.shape == advantages.shape) or log_prob.ndim != 1:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and advantages "
            f"{tuple(advantages.shape)} must all be [B]"
        )
    log_ratio = log_prob.float() - old_log_prob.float().detach()
    if ratio_norm:
        if mean is None or old_mean is None or std is None:
            raise ValueError("ratio_norm=True needs mean, old_mean and std (from sde.step_mean_std)")
        std = std.float()
        d2 = (mean.float() - old_mean.float().detach()) ** 2 / (2 * std**2)
        bias = d2.mean(dim=tuple(range(1, d2.ndim))) if d2.ndim > 1 else d2  # [B]
        step_std = std.expand(mean.shape).reshape(mean.shape[0], -1)[:, 0]  # [B], std is constant per sample
        log_ratio = (log_ratio + bias) * step_std
    ratio = torch.exp(clamp_log_ratio(log_ratio))
    adv = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_range, 1 + clip_range)
    per_entry = torch.maximum(unclipped, clipped)  # [B]
    loss = weighted_mean(per_entry, weight)
    with torch.no_grad():
        r = ratio.detach()
        metrics = {
            "ratio_mean": r.mean(),
            "ratio_min": r.min(),
            "ratio_max": r.max(),
            "clip_frac": ((r - 1).abs() > clip_range).float().mean(),
            "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        }
    return loss, metrics


def gaussian_kl(
    mean: torch.Tensor,
    ref_mean: torch.Tensor,
    std: torch.Tensor,
    *,
    kind: Literal["exact", "flow_grpo"] = "exact",
    step_size: torch.Tensor | None = None,
    reduce: Literal["mean", "sum"] = "mean",
) -> torch.Tensor:
    """KL(N(mean, std^2) || N(ref_mean, std^2)) of the policy's and the reference's transitions.

    "exact": (mean - ref_mean)^2 / (2 std^2) per element, reduced like sde.log_prob ("mean" = per-element
    average, flow_grpo's convention; "sum" = the KL of the whole latent).
    "flow_grpo": flow_grpo divides by s_t^2 instead of std^2 = s_t^2 (sigma - sigma_next) (it omits the
    sqrt(-dt) factor), i.e. the exact KL times step_size = sigma - sigma_next. Pass step_size [B]. For cps,
    flow_grpo's s_t is the full std, so use "exact" there.

    Args:
        mean, ref_mean: [B, ...] transition means (ref_mean carries no gradient in training).
        std: broadcastable to mean, > 0.
        kind: "exact" | "flow_grpo".
        step_size: [B] sigma - sigma_next, needed by "flow_grpo".
        reduce: "mean" | "sum" over non-batch dims.

    Returns:
        [B] fp32, >= 0.
    """
    if kind not in ("exact", "flow_grpo"):
        raise ValueError(f"kind must be 'exact' or 'flow_grpo', got {kind!r}")
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    kl = (mean.float() - ref_mean.float()) ** 2 / (2 * std.float() ** 2)
    if kl.ndim > 1:
        dims = tuple(range(1, kl.ndim))
        kl = kl.mean(dim=dims) if reduce == "mean" else kl.sum(dim=dims)
    if kind == "flow_grpo":
        if step_size is None:
            raise ValueError("kind='flow_grpo' needs step_size=sigma - sigma_next ([B])")
        kl = kl * step_size.float()
    return kl


def velocity_kl(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """The forward-process algorithms' KL surrogate between two velocity fields at the same point x_t.

    kl = mean over latent elements of (v - v_ref)^2.
    DiffusionNFT's and AWM's references use it both for the KL to the frozen model (their train.beta) and
    AWM's KL to its EMA policy (ema_beta, 'Uniform' weighting): the one-step Euler transitions of two
    policies from x_t differ in mean by dt (v - v_ref), so their Gaussian KL is this times a per-t factor
    dt^2 / (2 std^2), which the 'Uniform' weighting drops.

    Args:
        v: [B, ...] velocity of the trained policy (differentiable).
        v_ref: [B, ...] the other policy's velocity at the same x_t and t (no gradient flows into it).

    Returns:
        [B] fp32, >= 0.
    """
    if v.shape != v_ref.shape or v.ndim < 2:
        raise ValueError(f"v {tuple(v.shape)} and v_ref {tuple(v_ref.shape)} must share one [B, ...] shape")
    diff = v.float() - v_ref.float().detach()
    return (diff**2).mean(dim=tuple(range(1, diff.ndim)))
