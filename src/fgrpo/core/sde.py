"""One reverse step of a flow-matching sampler as a Gaussian transition, its sampling and log-density.

Convention (rectified flow, as in diffusers' FlowMatchEulerDiscreteScheduler):
    x_t = (1 - sigma) * x0 + sigma * noise,    v = noise - x0,
so sampling runs from sigma = 1 (pure noise) down to sigma = 0, and the Euler step is
x_next = x_t + v * (sigma_next - sigma). Every kind below turns that step into a Gaussian
N(mean, std^2) over x_next; the policy-gradient "action" of Flow-GRPO is a draw from it.

The functions are pure: tensors in, tensors out, fp32 math, noise passed in. The rollout and the
trainer both reach them through fgrpo.policy.transition, so the formula exists once.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

# The stochastic steps, the ones a policy gradient can train; "ode" is the Euler step outside the window.
SDEKind = Literal["flow_sde", "cps", "dance_sde"]
Kind = Literal[SDEKind, "ode"]
KINDS: tuple[Kind, ...] = get_args(Kind)

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _per_sample(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] (or a 0-dim scalar) -> [B, 1, ..., 1], fp32, broadcastable against `like`."""
    s = torch.as_tensor(s, device=like.device).float()
    if s.ndim > 1:
        raise ValueError(f"sigma must be a [B] tensor (one value per sample), got shape {tuple(s.shape)}")
    if s.ndim == 1 and s.shape[0] not in (1, like.shape[0]):
        raise ValueError(
            f"sigma has {s.shape[0]} entries but x_t has batch size {like.shape[0]}; pass one per sample"
        )
    return s.reshape(s.shape + (1,) * (like.ndim - s.ndim))


def step_mean_std(
    x_t: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    *,
    noise_level: float,
    kind: Kind,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of the Gaussian transition x_t -> x_next for one step sigma -> sigma_next < sigma.

    With dt = sigma_next - sigma < 0 and eta = noise_level:

    - "flow_sde" (Flow-GRPO): s_t = eta * sqrt(sigma / (1 - sigma)),
        mean = x_t + [v + s_t^2 / (2 sigma) * (x_t + (1 - sigma) v)] * dt,   std = s_t * sqrt(-dt).
      The drift is the reverse-time SDE whose marginals equal the flow's (Euler-Maruyama step).
    - "dance_sde" (DanceGRPO): the same SDE with a constant s_t = eta.
    - "cps" (coefficients-preserving sampling): with x0_hat = x_t - sigma v, x1_hat = x_t + (1 - sigma) v,
        mean = (1 - sigma_next) x0_hat + sigma_next cos(eta pi / 2) x1_hat,   std = sigma_next sin(eta pi / 2),
      i.e. the next state keeps total noise "energy" sigma_next^2 split between predicted and fresh noise.
    - "ode": the Euler step, std = 0 (log_prob is undefined for it; use it outside the SDE window).

    At sigma = 1, flow_sde's s_t = eta * sqrt(1 / 0) diverges. We replace the sigma in the denominator
    by sigma_next at that step only: s_t = eta * sqrt(1 / (1 - sigma_next)). For a schedule starting at 1
    this is exactly flow_grpo's rule (it uses sigmas[1], which is sigma_next of the first step); the drift's
    1 / (2 sigma) keeps sigma = 1. A schedule must not reach sigma_next = 1 (that step would be empty).
    cps's std is 0 on the last step (sigma_next = 0): that step is deterministic and cannot be trained.
    noise_level = 0 reduces every kind to the Euler step (bit-exactly for flow_sde, dance_sde and ode).

    Args:
        x_t: [B, ...] current state (any float dtype; math in fp32).
        v: [B, ...] predicted velocity (noise - x0) at (x_t, sigma).
        sigma, sigma_next: [B] noise levels of this sample's step, sigma_next < sigma (not checked, to
            stay sync-free and vmap-friendly).
        noise_level: eta >= 0; for cps at most 1 (eta = 1 makes the step all fresh noise).
        kind: "flow_sde" | "cps" | "dance_sde" | "ode".

    Returns:
        mean: [B, ...] fp32.
        std: [B, 1, ..., 1] fp32, the full std of x_next (it includes sqrt(sigma - sigma_next) for the
            SDE kinds); broadcasts against mean.

    Differs from flow_grpo: std is the full transition std; flow_grpo returns s_t and multiplies by
    sqrt(-dt) separately. For cps, flow_grpo's log-prob is -(x_next - mean)^2 (no 1 / (2 std^2), no
    constants), so its log-ratios are ours times 2 std^2: a clip range tuned there is not the same here.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if noise_level < 0 or (kind == "cps" and noise_level > 1):
        raise ValueError(f"noise_level must be >= 0 (and <= 1 for cps), got {noise_level}")
    if x_t.shape != v.shape:
        raise ValueError(f"x_t {tuple(x_t.shape)} and v {tuple(v.shape)} must have the same shape")
    x_t, v = x_t.float(), v.float()
    sigma, sigma_next = _per_sample(sigma, x_t), _per_sample(sigma_next, x_t)  # [B, 1, ...]
    dt = sigma_next - sigma  # < 0

    if kind == "ode":
        return x_t + v * dt, torch.zeros_like(dt)

    if kind == "cps":
        x0_hat = x0_prediction(x_t, v, sigma)
        x1_hat = x_t + (1 - sigma) * v
        angle = noise_level * math.pi / 2
        # sigma_next * cos(angle) is sqrt(sigma_next^2 - std^2) without the rounding that can make the radicand < 0.
        mean = (1 - sigma_next) * x0_hat + (sigma_next * math.cos(angle)) * x1_hat
        return mean, sigma_next * math.sin(angle)

    if kind == "flow_sde":
        denom = 1 - torch.where(sigma == 1, sigma_next, sigma)
        s_t = noise_level * torch.sqrt(sigma / denom)
    else:  # dance_sde
        s_t = torch.full_like(sigma, float(noise_level))
    drift = v + s_t**2 / (2 * sigma) * (x_t + (1 - sigma) * v)
    return x_t + drift * dt, s_t * torch.sqrt(-dt)


def sample(mean: torch.Tensor, std: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """x_next = mean + std * noise, with noise ~ N(0, I) drawn by the caller (shape of mean). fp32."""
    if noise.shape != mean.shape:
        raise ValueError(f"noise {tuple(noise.shape)} must have the shape of mean {tuple(mean.shape)}")
    return mean + std * noise.float()


def log_prob(
    x_next: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    *,
    reduce: Literal["mean", "sum"] = "mean",
) -> torch.Tensor:
    """Gaussian log-density of x_next under N(mean, std^2), reduced over all non-batch dims.

    log N(x; mean, std) = -(x - mean)^2 / (2 std^2) - log std - log sqrt(2 pi), per element.

    Args:
        x_next: [B, ...] the sampled next state.
        mean: [B, ...] transition mean.
        std: broadcastable to mean (e.g. [B, 1, ...]), must be > 0.
        reduce: "mean" (flow_grpo's choice: a per-element average, so the ratio does not scale with the
            latent size) or "sum" (the true log-density of the whole latent).

    Returns:
        [B] fp32.
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    x_next, mean, std = x_next.float(), mean.float(), std.float()
    lp = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - _HALF_LOG_2PI
    if lp.ndim == 1:  # [B] scalars per sample; reducing over dim=() would reduce over everything
        return lp
    dims = tuple(range(1, lp.ndim))
    return lp.mean(dim=dims) if reduce == "mean" else lp.sum(dim=dims)


def x0_prediction(x_t: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The clean sample a velocity points to: x0_hat = x_t - sigma * v (exact when v = noise - x0), fp32.

    Args:
        x_t: [B, ...] state at noise level sigma.
        v: [B, ...] velocity at (x_t, sigma).
        sigma: [B] (or 0-dim) noise level of each sample, or already broadcastable ([B, 1, ..., 1]).

    Returns:
        [B, ...] fp32.
    """
    x_t, v = x_t.float(), v.float()
    sigma = torch.as_tensor(sigma, device=x_t.device)
    sigma = _per_sample(sigma, x_t) if sigma.ndim <= 1 else sigma.float()
    return x_t - sigma * v


def forward_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A point of the forward (noising) process: x_t = (1 - sigma) x0 + sigma noise, fp32.

    What NFT and AWM train on: the rollout's clean sample x0 noised afresh to a grid time; v = noise - x0 is the
    velocity target there.

    Args:
        x0: [B, ...] clean sample.
        noise: [B, ...] standard normal draw.
        sigma: [B] (or 0-dim) noise level of each sample.

    Returns:
        [B, ...] fp32.
    """
    x0, noise = x0.float(), noise.float()
    sigma = _per_sample(torch.as_tensor(sigma, device=x0.device), x0)
    return (1 - sigma) * x0 + sigma * noise


def _half_log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """lambda = log(alpha / sigma) with alpha = 1 - sigma: -inf at sigma = 1, +inf at sigma = 0."""
    return torch.log(1 - sigma) - torch.log(sigma)


def dpmpp_2m_step(
    x_t: torch.Tensor,
    x0_pred: torch.Tensor,
    x0_pred_prev: torch.Tensor | None,
    sigma_prev: torch.Tensor | None,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
) -> torch.Tensor:
    """One deterministic DPM-Solver++(2M) step sigma -> sigma_next for a flow-matching model (data prediction).

    With alpha = 1 - sigma and the half log-SNR lambda(sigma) = log(alpha) - log(sigma),
    h = lambda(sigma_next) - lambda(sigma), r = (lambda(sigma) - lambda(sigma_prev)) / h:
        first order (DDIM):  x_next = (sigma_next / sigma) x_t + alpha_next (1 - e^-h) x0_pred
        second order (2M):   the same with x0_pred replaced by D = x0_pred + (x0_pred - x0_pred_prev) / (2 r),
    i.e. Algorithm 2 of DPM-Solver++ (Lu et al., arXiv 2211.01095) with the "midpoint" correction, which is
    diffusers' DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2, use_flow_sigmas=True,
    prediction_type="flow_prediction"). x0_pred = x0_prediction(x_t, v, sigma).

    The step is first order where there is no previous prediction (x0_pred_prev and sigma_prev None: the first
    step of a run) and where sigma_next = 0: there h = inf, the first-order step returns x0_pred exactly and the
    2M correction diverges (diffusers makes the same choice for a final zero sigma). At sigma = 1 (alpha = 0)
    the first-order step is the Euler step. MixGRPO-Flash runs these steps on a compressed grid after the SDE
    window, seeding x0_pred_prev with the window's last prediction.

    Args:
        x_t: [B, ...] current state.
        x0_pred: [B, ...] data prediction at (x_t, sigma).
        x0_pred_prev: [B, ...] data prediction of the previous step (at sigma_prev), or None.
        sigma_prev: [B] previous noise level (> sigma), or None together with x0_pred_prev.
        sigma, sigma_next: [B] this step's noise levels, 1 >= sigma > sigma_next >= 0 (not checked, to stay
            sync-free).

    Returns:
        x_next: [B, ...] fp32.

    Differs from the reference code: MixGRPO's tail grid and order bookkeeping live in the caller; this is one
    step of the solver with its inputs passed in.
    """
    if (x0_pred_prev is None) != (sigma_prev is None):
        raise ValueError("pass x0_pred_prev and sigma_prev together (both None for a first-order step)")
    if x_t.shape != x0_pred.shape or (x0_pred_prev is not None and x0_pred_prev.shape != x0_pred.shape):
        raise ValueError(
            f"x_t {tuple(x_t.shape)}, x0_pred {tuple(x0_pred.shape)} and x0_pred_prev must have the same shape"
        )
    x_t, x0_pred = x_t.float(), x0_pred.float()
    sigma, sigma_next = _per_sample(sigma, x_t), _per_sample(sigma_next, x_t)  # [B, 1, ...]

    h = _half_log_snr(sigma_next) - _half_log_snr(sigma)  # inf when sigma_next = 0 or sigma = 1
    alpha_next = 1 - sigma_next
    d = x0_pred
    if x0_pred_prev is not None and sigma_prev is not None:  # both or neither (checked above)
        sigma_prev = _per_sample(sigma_prev, x_t)
        r = (_half_log_snr(sigma) - _half_log_snr(sigma_prev)) / h
        second = sigma_next > 0
        # 1 where the first-order step is taken keeps 1 / (2 r) finite there (r = 0 when sigma_next = 0).
        r = torch.where(second, r, torch.ones_like(r))
        d = torch.where(second, x0_pred + (x0_pred - x0_pred_prev.float()) / (2 * r), x0_pred)
    return (sigma_next / sigma) * x_t - (alpha_next * (torch.exp(-h) - 1)) * d
