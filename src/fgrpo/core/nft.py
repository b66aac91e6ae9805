"""DiffusionNFT (arXiv 2509.16117): reinforcement on the forward (noising) process. Pure torch, fp32.

The rollout (any solver, any sampler) only supplies clean samples x0 and rewards. Training re-noises x0 to
x_t = (1 - t) x0 + t noise and fits two implicit policies built from the trained velocity v and the frozen
"old" velocity v_old: a positive one pulled towards well-rewarded samples and a negative one towards badly
rewarded ones. The old policy is an EMA of the trained one (fgrpo.core.ema).
"""

from __future__ import annotations

import torch

from fgrpo.core.sde import x0_prediction

# Floor of the adaptive weight mean|x0_hat - x0|: keeps a near-perfect prediction from dividing by ~0.
_MIN_ADAPTIVE_WEIGHT = 1e-5


def optimality_prob(advantages: torch.Tensor, *, adv_clip: float = 5.0) -> torch.Tensor:
    """The optimality probability r = 0.5 + 0.5 * clip(A / adv_clip, -1, 1) in [0, 1].

    A is the group-normalised reward (grpo.group_advantages); r = 1/2 for an average
    sample, 1 (0) for one adv_clip standard deviations above (below) its group's mean. This is DiffusionNFT's
    r = 1/2 + 1/2 clip((r_raw - E r_raw) / Z, -1, 1) with Z = adv_clip * std (Algorithm 1 of the paper, as
    the reference code computes it).

    Args:
        advantages: [B].
        adv_clip: > 0 (the reference's adv_clip_max, 5).

    Returns:
        [B] fp32.
    """
    if adv_clip <= 0:
        raise ValueError(f"adv_clip must be > 0, got {adv_clip}")
    return 0.5 + 0.5 * (advantages.float() / adv_clip).clamp(-1.0, 1.0)


def nft_loss(
    v: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    r: torch.Tensor,
    *,
    beta: float,
    scale: float = 5.0,
    weighting: str = "adaptive",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's policy loss at one noise level t per sample, as the reference code computes it.

    v+ = beta v + (1 - beta) v_old,    v- = (1 + beta) v_old - beta v         (implicit positive / negative policy)
    e+- = x0_hat(v+-) - x0 = (x_t - t v+-) - x0                             (error in data space)
    l+- = mean(e+-^2) / stopgrad(max(mean|e+-|, 1e-5))                     (per sample, adaptive weight)
    or, with weighting="uniform", l+- = mean(e+-^2) (the same squared error, one weight for every sample)
    loss = mean_b scale * [r_b l+_b + (1 - r_b) l-_b] / beta.
    The paper's loss is E[r ||v+ - v_target||^2 + (1 - r) ||v- - v_target||^2]; since x0_hat - x0 = -t (v - v_target),
    the reference trains it in x0 space with a per-sample adaptive weight instead of t^2. The gradient w.r.t. v
    is (2 scale t_b / (B n)) * [(1 - r_b) e- / w- - r_b e+ / w+] elementwise (n latent elements per sample, w the
    detached weights): the 1 / beta cancels the beta inside v+-, so it does not vanish as beta -> 0. The
    reference-model term (the reference's train.beta * mean((v - v_ref)^2)) is not part of this function.

    Args:
        v: [B, ...] velocity of the trained policy at (x_t, t) (differentiable).
        v_old: [B, ...] velocity of the old (EMA) policy at the same input (no gradient flows into it).
        x_t: [B, ...] the noised sample (1 - t) x0 + t noise.
        x0: [B, ...] the clean rollout sample.
        t: [B] noise level sigma of x_t (the reference uses the rollout scheduler's sigmas).
        r: [B] optimality probability in [0, 1] (optimality_prob).
        beta: > 0, the guidance strength of the implicit policies (the reference's config.beta: 1.0 by default,
            0.1 for the OCR recipe).
        scale: overall factor (the reference multiplies by its adv_clip_max, 5).
        weighting: "adaptive" (the reference's 1 / mean|e| per sample, which gives a sample the policy already
            fits as large a gradient as a badly fitted one) or "uniform" (no per-sample normalisation: the gradient
            of a sample shrinks with its error, as in plain flow matching).

    Returns:
        loss: scalar. metrics: detached scalars positive_loss/negative_loss (batch means of l+ and l-),
        old_deviate = mean((v - v_old)^2) and r_mean.

    Differs from the reference code: the adaptive weight mean|e| is computed in fp32 (the reference uses fp64)
    and all the arithmetic runs in fp32 whatever the input dtype.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if weighting not in ("adaptive", "uniform"):
        raise ValueError(f"weighting must be 'adaptive' or 'uniform', got {weighting!r}")
    if not (v.shape == v_old.shape == x_t.shape == x0.shape) or v.ndim < 2:
        raise ValueError(
            f"v {tuple(v.shape)}, v_old {tuple(v_old.shape)}, x_t {tuple(x_t.shape)} and x0 {tuple(x0.shape)} "
            "must share one [B, ...] shape"
        )
    if t.shape != (v.shape[0],) or r.shape != (v.shape[0],):
        raise ValueError(f"t {tuple(t.shape)} and r {tuple(r.shape)} must be [B] with B = {v.shape[0]}")
    v, v_old, x0, r = v.float(), v_old.float().detach(), x0.float(), r.float()
    dims = tuple(range(1, v.ndim))
    v_pos = beta * v + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v

    def weighted_sq_error(v_implicit: torch.Tensor) -> torch.Tensor:
        err = x0_prediction(x_t, v_implicit, t) - x0
        if weighting == "uniform":
            return (err**2).mean(dim=dims)  # [B]
        weight = err.detach().abs().mean(dim=dims).clamp_min(_MIN_ADAPTIVE_WEIGHT)  # [B]
        return (err**2).mean(dim=dims) / weight  # [B]

    l_pos, l_neg = weighted_sq_error(v_pos), weighted_sq_error(v_neg)
    loss = (scale * (r * l_pos + (1 - r) * l_neg) / beta).mean()
    with torch.no_grad():
        metrics = {
            "positive_loss": l_pos.detach().mean(),
            "negative_loss": l_neg.detach().mean(),
            "old_deviate": ((v.detach() - v_old) ** 2).mean(),
            "r_mean": r.mean(),
        }
    return loss, metrics
