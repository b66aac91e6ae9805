"""Classifier-free guidance: plain CFG (SD3), Qwen-Image's norm-preserving "true CFG", BAGEL's renormed CFG."""

from __future__ import annotations

import torch


def cfg(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain CFG: v = v_uncond + scale * (v_cond - v_uncond), fp32. Shapes [B, ...] -> [B, ...].

    scale = 1 gives v_cond; scale = 0 gives v_uncond.
    """
    if v_cond.shape != v_uncond.shape:
        raise ValueError(f"v_cond {tuple(v_cond.shape)} and v_uncond {tuple(v_uncond.shape)} must match")
    v_cond, v_uncond = v_cond.float(), v_uncond.float()
    return v_uncond + scale * (v_cond - v_uncond)


def true_cfg(
    v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float, *, token_dim: int = -1
) -> torch.Tensor:
    """Qwen-Image's true CFG: plain CFG, then each token rescaled to the conditional velocity's norm.

    v = cfg(v_cond, v_uncond, scale);  v <- v * ||v_cond|| / ||v||, norms over `token_dim` (one token's
    features), as QwenImagePipeline does on its packed latents [B, seq, 64]. Guidance then only turns
    each token's velocity, never lengthens it, which is what keeps large scales from over-saturating.

    Args:
        v_cond, v_uncond: [B, ..., D] velocities (packed: [B, seq, C * 4]).
        scale: guidance scale s.
        token_dim: the dim holding one token's features (the norm's axis); -1 for packed latents.

    Returns:
        [B, ..., D] fp32.

    Differs from diffusers: a token whose guided velocity is exactly 0 stays 0 (diffusers divides 0 by 0);
    elsewhere the result is bit-identical in fp32 (tests/core/test_guidance.py).
    """
    comb = cfg(v_cond, v_uncond, scale)
    cond_norm = torch.norm(v_cond.float(), dim=token_dim, keepdim=True)
    comb_norm = torch.norm(comb, dim=token_dim, keepdim=True)
    # A safe denominator rather than a where() on the quotient: the masked inf would still poison gradients.
    safe = torch.where(comb_norm > 0, comb_norm, torch.ones_like(comb_norm))
    return comb * (cond_norm / safe)


def renormed_cfg(
    v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float, *, min_ratio: float = 0.0
) -> torch.Tensor:
    """BAGEL's text guidance with its global renorm: plain CFG, then each sample shrunk back towards the
    conditional velocity's norm.

    v = cfg(v_cond, v_uncond, scale);  v <- v * clamp(||v_cond|| / (||v|| + 1e-8), min_ratio, 1), the norms over
    all of one sample's elements (BAGEL's cfg_renorm_type="global", cfg_renorm_min=min_ratio). Unlike true_cfg the
    ratio is capped at 1: guidance may shorten a sample's velocity, never lengthen it past v_cond's.

    Args:
        v_cond, v_uncond: [B, ...] velocities.
        scale: guidance scale s (BAGEL's cfg_text_scale).
        min_ratio: the lower clamp of the rescale factor (0: no lower bound).

    Returns:
        [B, ...] fp32.

    Differs from BAGEL: the norm is per sample; BAGEL's covers its whole packed batch (meant for one sample).
    """
    comb = cfg(v_cond, v_uncond, scale)
    cond_norm = v_cond.float().flatten(1).norm(dim=1)
    comb_norm = comb.flatten(1).norm(dim=1)
    ratio = (cond_norm / (comb_norm + 1e-8)).clamp(min=min_ratio, max=1.0)
    return comb * ratio.view(-1, *[1] * (comb.dim() - 1))
