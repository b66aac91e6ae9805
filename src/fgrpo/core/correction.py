"""Rollout correction for off-policy samples: importance weights between the behaviour policy (the one that
sampled, whose log-probs the rollout recorded) and the old policy (the trainer's weights when the step starts,
whose log-probs the trainer recomputes). Pure torch, fp32.

An "entry" is one trained denoising transition of a sample: tensors are [B, W], B samples and W window steps.
A "sequence" is a sample's window. The weights multiply the per-entry policy loss (the `weight` of
core.grpo.clipped_policy_loss); they change the measure the loss is averaged under, never the objective, so
they carry no gradient.

Variants, with the names verl's rollout-correction config gives them (rollout_is / rollout_is_threshold /
rollout_rs / rollout_rs_threshold):
    truncated IS (TIS)       is_weights(level="token" | "sequence", mode="truncate")   rollout_is=token|sequence
    masked IS (IcePop)       is_weights(level=..., mode="mask", lower=..., upper=...)  threshold "lower_upper"
    geometric-mean sequence  is_weights(level="geometric")                 (not a rollout_is level in verl)
    rejection (RS)           rejection_mask(estimator="k1"|"k2"|"k3",
                                            level="token"|"seq_sum"|"seq_mean"|"seq_max")  rollout_rs=token_k1, ...
    batch normalisation      normalize_weights                                      rollout_is_batch_normalize
"""

from __future__ import annotations

from typing import Literal

import torch

from fgrpo.core.grpo import clamp_log_ratio

Level = Literal["token", "sequence", "geometric"]
Mode = Literal["truncate", "mask"]
Estimator = Literal["k1", "k2", "k3"]
RejectLevel = Literal["token", "seq_sum", "seq_mean", "seq_max"]


def _check_entries(name: str, t: torch.Tensor) -> None:
    if t.ndim != 2:
        raise ValueError(f"{name} must be [B, W] (samples x window steps), got shape {tuple(t.shape)}")


def log_ratio(old_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor) -> torch.Tensor:
    """Per-entry log importance ratio between the old and the behaviour policy.

    log w_bj = old_log_prob_bj - behaviour_log_prob_bj.

    Args:
        old_log_prob: [B, W] log-prob of each stored transition under the old policy (recomputed by the trainer).
        behaviour_log_prob: [B, W] the same under the policy that sampled it (the rollout's Trajectory.log_prob).

    Returns:
        [B, W] fp32, detached.

    Differs from the reference code (verl rollout_corr_helper): no response mask, every window entry is a
    trained transition (as verl-omni's diffusion path assumes).
    """
    _check_entries("old_log_prob", old_log_prob)
    if old_log_prob.shape != behaviour_log_prob.shape:
        raise ValueError(
            f"old_log_prob {tuple(old_log_prob.shape)} and behaviour_log_prob "
            f"{tuple(behaviour_log_prob.shape)} must have the same [B, W] shape"
        )
    return (old_log_prob.detach().float() - behaviour_log_prob.detach().float()).contiguous()


def _level_log_weight(log_w: torch.Tensor, level: Level) -> torch.Tensor:
    """log of the raw weight each entry gets at `level`, clamped before any exp; [B, W]."""
    if level == "token":
        lw = log_w
    elif level == "sequence":
        lw = log_w.sum(dim=1, keepdim=True).expand_as(log_w)  # log prod_j w_j
    elif level == "geometric":
        lw = log_w.mean(dim=1, keepdim=True).expand_as(log_w)  # log (prod_j w_j)^(1/W)
    else:
        raise ValueError(f"level must be 'token', 'sequence' or 'geometric', got {level!r}")
    return clamp_log_ratio(lw)


def raw_weights(log_w: torch.Tensor, *, level: Level = "token") -> torch.Tensor:
    """The untruncated importance weight of each entry at `level` (exp of the clamped log-weight).

    token:     r_bj = w_bj = exp(log w_bj)
    sequence:  r_bj = prod_k w_bk = exp(sum_k log w_bk)          (the same for all j of sample b)
    geometric: r_bj = (prod_k w_bk)^(1/W) = exp(mean_k log w_bk)  (the same for all j of sample b)

    Args:
        log_w: [B, W] from log_ratio.
        level: "token" | "sequence" | "geometric".

    Returns:
        [B, W] fp32, detached, in [exp(-20), exp(20)].
    """
    _check_entries("log_w", log_w)
    return torch.exp(_level_log_weight(log_w.detach().float(), level))


def is_weights(
    log_w: torch.Tensor,
    *,
    level: Level = "token",
    mode: Mode = "truncate",
    upper: float = 2.0,
    lower: float | None = None,
) -> torch.Tensor:
    """Truncated (TIS) or masked (IcePop) importance weights, r = raw_weights(log_w, level=level).

    truncate: w_bj = min(r_bj, upper)                                   (no lower truncation)
    mask:     w_bj = r_bj if lower <= r_bj <= upper else 0              (both bounds inclusive)
    At level "sequence" / "geometric" r is constant over a sample's window, so a masked sample loses its whole
    window. Identical policies (log_w = 0) give w = 1 exactly.

    Args:
        log_w: [B, W] from log_ratio.
        level: "token" | "sequence" | "geometric" (see raw_weights).
        mode: "truncate" | "mask".
        upper: C > 0, the truncation (or upper mask) bound; verl's default rollout_is_threshold is 2.0.
        lower: the lower mask bound, 0 < lower <= upper; None means 1 / upper. Only used by "mask".

    Returns:
        [B, W] fp32 weights >= 0, detached.

    Differs from the reference code (verl compute_rollout_correction_weights): the geometric level is added (the
    same statistic as verl's seq_mean_k1 rejection, used here as a weight); "mask" without a lower bound takes
    1 / upper instead of raising.
    """
    if upper <= 0:
        raise ValueError(f"upper must be > 0, got {upper}")
    raw = raw_weights(log_w, level=level)
    if mode == "truncate":
        return raw.clamp(max=upper)
    if mode != "mask":
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    lo = 1.0 / upper if lower is None else lower
    if not 0 < lo <= upper:
        raise ValueError(f"mask bounds need 0 < lower <= upper, got lower={lo}, upper={upper}")
    return torch.where((raw >= lo) & (raw <= upper), raw, torch.zeros_like(raw))


def divergence(log_w: torch.Tensor, *, estimator: Estimator) -> torch.Tensor:
    """Per-entry estimate of KL(behaviour || old) from samples of the behaviour policy (Schulman's k1/k2/k3).

    k1 = -log w,   k2 = (log w)^2 / 2,   k3 = w - 1 - log w       (log w clamped to +-20 first)
    k2 and k3 are >= 0 and 0 exactly where log w = 0; k1 is signed.

    Args:
        log_w: [B, W] from log_ratio.
        estimator: "k1" | "k2" | "k3".

    Returns:
        [B, W] fp32, detached.

    Differs from the reference code: k3 is expm1(log w) - log w (exact near 0, where exp(log w) - 1 rounds).
    """
    _check_entries("log_w", log_w)
    lw = clamp_log_ratio(log_w.detach().float())
    if estimator == "k1":
        return -lw
    if estimator == "k2":
        return 0.5 * lw**2
    if estimator == "k3":
        return torch.expm1(lw) - lw
    raise ValueError(f"estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def rejection_mask(
    log_w: torch.Tensor,
    *,
    estimator: Estimator,
    level: RejectLevel = "token",
    upper: float,
    lower: float | None = None,
) -> torch.Tensor:
    """Hard trust region: 0 where the divergence statistic leaves [lower, upper], else 1.

    d = divergence(log_w, estimator), then the statistic s per entry
        token: s_bj = d_bj,   seq_sum: s_bj = sum_k d_bk,   seq_mean: s_bj = mean_k d_bk,   seq_max: max_k d_bk
    mask_bj = [s_bj <= upper] and [s_bj >= lower] (the lower test only when lower is given).
    A sequence-level statistic keeps or rejects a sample's whole window. seq_mean with k1 is the geometric-mean
    ratio test: lower <= log(prod_k (behaviour/old)_k)^(1/W) <= upper.

    Args:
        log_w: [B, W] from log_ratio.
        estimator: "k1" | "k2" | "k3" (seq_max needs k2 or k3: a max of signed k1 values bounds nothing).
        level: "token" | "seq_sum" | "seq_mean" | "seq_max".
        upper: the upper bound on s.
        lower: optional lower bound on s (meaningful for the signed k1).

    Returns:
        [B, W] fp32 of 0.0 / 1.0, detached.

    Differs from the reference code (verl compute_rollout_rejection_mask): the bounds are in the statistic's own
    units for every estimator (verl takes ratio bounds for k1 and logs them: its token_k1 "0.5_2.0" is
    lower=log 0.5, upper=log 2 here); one criterion per call (multiply masks to combine them, as verl's
    comma-separated options do); the binary_kl option (Bernoulli KL of token probabilities) has no meaning for
    Gaussian transition densities and is left out.
    """
    d = divergence(log_w, estimator=estimator)
    if level == "token":
        s = d
    elif level == "seq_sum":
        s = d.sum(dim=1, keepdim=True)
    elif level == "seq_mean":
        s = d.mean(dim=1, keepdim=True)
    elif level == "seq_max":
        if estimator == "k1":
            raise ValueError("level='seq_max' needs estimator 'k2' or 'k3' (k1 is signed)")
        s = d.amax(dim=1, keepdim=True)
    else:
        raise ValueError(f"level must be 'token', 'seq_sum', 'seq_mean' or 'seq_max', got {level!r}")
    keep = s <= upper
    if lower is not None:
        if lower > upper:
            raise ValueError(f"rejection bounds need lower <= upper, got lower={lower}, upper={upper}")
        keep = keep & (s >= lower)
    return keep.float().expand_as(log_w).contiguous()


def normalize_weights(weight: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Rescale weights to mean 1: w / mean(w).

    Args:
        weight: [B, W] from is_weights (times any rejection mask).
        mean: the mean weight to divide by; None uses weight.mean(). Under data parallelism pass the mean over
            all ranks (each rank's mean all-reduced), so every rank divides by the same number.

    Returns:
        [B, W] fp32, detached; unchanged where the mean is <= 1e-8 (all weights masked).

    Differs from the reference code: the all-reduce is the caller's (the core holds no process group).
    """
    w = weight.detach().float()
    m = w.mean() if mean is None else mean.detach().float()
    return torch.where(m > 1e-8, w / m.clamp_min(1e-8), w)


def correction_metrics(
    log_w: torch.Tensor,
    weight: torch.Tensor,
    *,
    level: Level = "token",
    upper: float = 2.0,
    lower: float | None = None,
) -> dict[str, torch.Tensor]:
    """Detached scalars that describe the behaviour/old gap and the weights applied to it.

    With r = raw_weights(log_w, level=level) and w = the applied weight:
        is_mean, is_max, is_min        of w
        is_frac_high, is_frac_low      share of entries with r > upper, r < lower (lower None: 1 / upper)
        is_frac_zero                   share of entries with w = 0 (masked or rejected)
        is_ess                         (mean w)^2 / mean(w^2), the effective sample size over N, in (0, 1];
                                       0 when every weight is 0
        gap_abs_mean, gap_abs_max      mean and max of |log w| (the behaviour/old gap per entry)
        kl, k3_kl                      mean of k1 = -log w and of k3 = w - 1 - log w (KL(behaviour || old))
        chi2_token, chi2_seq           mean_bj w_bj^2 - 1 and mean_b (prod_j w_bj)^2 - 1

    Args:
        log_w: [B, W] from log_ratio.
        weight: [B, W] the weights the loss uses.
        level, upper, lower: the thresholds the weights were built with (for the high/low fractions).

    Returns:
        dict of 0-dim fp32 tensors.

    Differs from the reference code (verl compute_is_metrics / compute_offpolicy_metrics): the ESS uses the
    applied weights without re-truncating them; perplexities are left out (a transition density is not a
    probability, so exp(-log-prob) has no perplexity meaning).
    """
    _check_entries("weight", weight)
    with torch.no_grad():
        lw = log_w.detach().float()
        w = weight.detach().float()
        r = raw_weights(lw, level=level)
        lo = 1.0 / upper if lower is None else lower
        lw_c = clamp_log_ratio(lw)
        m1, m2 = w.mean(), (w**2).mean()
        seq_lw = clamp_log_ratio(lw.sum(dim=1))  # [B]
        return {
            "is_mean": m1,
            "is_max": w.max(),
            "is_min": w.min(),
            "is_frac_high": (r > upper).float().mean(),
            "is_frac_low": (r < lo).float().mean(),
            "is_frac_zero": (w == 0).float().mean(),
            "is_ess": torch.where(m2 > 0, m1**2 / m2.clamp_min(torch.finfo(torch.float32).tiny), 0.0),
            "gap_abs_mean": lw.abs().mean(),
            "gap_abs_max": lw.abs().max(),
            "kl": divergence(lw, estimator="k1").mean(),
            "k3_kl": divergence(lw, estimator="k3").mean(),
            "chi2_token": torch.exp(2 * lw_c).mean() - 1,
            "chi2_seq": torch.exp(2 * seq_lw).mean() - 1,
        }
