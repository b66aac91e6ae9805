"""Flow-DPPO (arXiv 2606.11025): a divergence trust region in place of PPO's ratio clip. Pure torch, fp32.

Old and current policy share each step's transition std, so their per-step divergence is a closed form in the
two transition means; an update is dropped only where that divergence is past a threshold and the update would
push the ratio further from 1 in the direction the advantage wants.
"""

from __future__ import annotations

import torch

from fgrpo.core.grpo import clamp_log_ratio, gaussian_kl, weighted_mean


def dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: torch.Tensor,
    advantages: torch.Tensor,
    *,
    tau: float = 1e-5,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-DPPO's masked policy-gradient loss for one denoising step of B samples.

    rho = exp(log_prob - old_log_prob),
    D   = mean over latent elements of (mean - old_mean)^2 / (2 std^2)    (KL(pi_theta || pi_old) per element),
    m   = [D >= tau] and ((rho > 1 and A > 0) or (rho < 1 and A < 0)),
    loss = mean_b (1 - m_b) * (-A_b rho_b).
    No ratio clip and no advantage clamp: inside the trust region (D < tau) or when the update moves rho back
    towards 1, the gradient is -A rho grad(log_prob) / B; a masked entry contributes 0 to the mean (it still
    counts in B) and passes no gradient. The mask itself carries no gradient. The divergence and the masking
    rule are the paper's KL-masked objective as verl-omni's docs/algo/flowdppo.md and its FlowDPPOLoss state it.

    With a per-entry weight w (the rollout correction's importance weight between the behaviour and the old
    policy, as in grpo.clipped_policy_loss), loss = mean_b w_b (1 - m_b) (-A_b rho_b): no gradient flows into
    w, and an entry with w = 0 passes none but still counts in B.

    Args:
        log_prob: [B] log-prob of the stored x_next under the current policy (differentiable; sde.log_prob with
            reduce="mean", as the reference uses).
        old_log_prob: [B] the same under the rollout policy (no gradient flows into it).
        mean: [B, ...] current transition mean (from sde.step_mean_std).
        old_mean: [B, ...] the rollout policy's transition mean at the same x_t (no gradient).
        std: the step's full transition std (sde.step_mean_std's std, which includes sqrt(sigma - sigma_next)),
            [B] or broadcastable to mean; > 0 (not checked, to stay sync-free).
        advantages: [B].
        tau: divergence threshold, >= 0 (the reference recipe's kl_mask_threshold, 1e-5).
        weight: [B] per-entry weights >= 0, or None for the unweighted loss (exactly the formula without w).

    Returns:
        loss: scalar. metrics: detached scalars ratio_mean/min/max, masked_frac (share of dropped entries),
        div_mean/div_max (D over the batch) and approx_kl = mean(0.5 * (log rho)^2).

    Differs from the reference code (verl-omni FlowDPPOLoss, UniRL flowdppo): the log-ratio is clamped to +-20
    before exp (as in grpo.clipped_policy_loss; only an overflow regime changes: there the gradient is 0
    instead of inf/NaN). std is the full transition std, the reference's std_dev_t * sqrt_dt
    (add_kl_coefficient=True).
    """
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    if not (log_prob.shape == old_log_prob.shape == advantages.shape) or log_prob.ndim != 1:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and advantages "
            f"{tuple(advantages.shape)} must all be [B]"
        )
    if mean.shape != old_mean.shape or mean.shape[0] != log_prob.shape[0]:
        raise ValueError(
            f"mean {tuple(mean.shape)} and old_mean {tuple(old_mean.shape)} must be [B, ...] with "
            f"B = {log_prob.shape[0]}"
        )
    std = torch.as_tensor(std, device=mean.device).float()
    if std.ndim == 1 and mean.ndim > 1:
        std = std.reshape(std.shape + (1,) * (mean.ndim - 1))  # [B] -> [B, 1, ..., 1]
    log_ratio = log_prob.float() - old_log_prob.float().detach()
    ratio = torch.exp(clamp_log_ratio(log_ratio))
    adv = advantages.float().detach()
    with torch.no_grad():
        div = gaussian_kl(mean.detach(), old_mean.detach(), std, kind="exact", reduce="mean")  # [B]
        r = ratio.detach()
        masked = (div >= tau) & (((r > 1) & (adv > 0)) | ((r < 1) & (adv < 0)))  # [B]
    per_sample = torch.where(masked, torch.zeros_like(ratio), -adv * ratio)
    loss = weighted_mean(per_sample, weight)
    with torch.no_grad():
        metrics = {
            "ratio_mean": r.mean(),
            "ratio_min": r.min(),
            "ratio_max": r.max(),
            "masked_frac": masked.float().mean(),
            "div_mean": div.mean(),
            "div_max": div.max(),
            "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        }
    return loss, metrics
