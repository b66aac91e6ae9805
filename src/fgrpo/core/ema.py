"""The slowly moving "old" policy (DiffusionNFT's; AWM's reference keeps one for a KL term, not implemented
here): its decay schedule and the in-place EMA update.

old <- d * old + (1 - d) * theta after each refresh; d = 0 copies theta. Pure torch on lists of tensors
(LoRA weights, local shards or DTensors alike); no module state.
"""

from __future__ import annotations

import torch


def ema_decay(step: int, *, rate: float, max_decay: float, delay: int = 0) -> float:
    """The decay d of the old policy's EMA at training step `step`: 0 before `delay`, then a linear ramp.

    d = 0 if step < delay, else min(rate * (step - delay), max_decay).
    The references' schedules, with `step` their count of optimizer steps taken so far:
      - copy (d = 0 always):                        rate = 0,      max_decay = 0
      - DiffusionNFT decay_type 1 (its default):    rate = 0.001,  max_decay = 0.5
      - DiffusionNFT decay_type 2 (OCR recipe):     rate = 0.0075, max_decay = 0.999, delay = 75
      - AWM kl_ema_decay_type 'linear' (recipes):   rate = 0.001,  max_decay = 0.3

    Args:
        step: >= 0.
        rate: ramp per step, >= 0.
        max_decay: ceiling in [0, 1].
        delay: steps with d = 0 (plain copies) before the ramp starts, >= 0.

    Returns:
        d in [0, max_decay].
    """
    if step < 0 or delay < 0 or rate < 0 or not 0 <= max_decay <= 1:
        raise ValueError(
            f"ema_decay needs step >= 0, delay >= 0, rate >= 0 and 0 <= max_decay <= 1; got step={step}, "
            f"delay={delay}, rate={rate}, max_decay={max_decay}"
        )
    if step < delay:
        return 0.0
    return min(rate * (step - delay), max_decay)


@torch.no_grad()
def ema_update_(old: list[torch.Tensor], new: list[torch.Tensor], decay: float) -> None:
    """In place: old_i <- decay * old_i + (1 - decay) * new_i for every pair (torch.lerp with weight 1 - decay).

    lerp is exact at both ends: decay = 0 copies new bit for bit, decay = 1 leaves old unchanged.

    Args:
        old: tensors updated in place (the old policy's trainable weights).
        new: tensors of the same shapes (the trained policy's weights, in the same order).
        decay: d in [0, 1] (ema_decay).
    """
    if not 0 <= decay <= 1:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    if len(old) != len(new):
        raise ValueError(f"old has {len(old)} tensors but new has {len(new)}; pass matching parameter lists")
    for i, (a, b) in enumerate(zip(old, new)):
        if a.shape != b.shape:
            raise ValueError(f"tensor {i}: old {tuple(a.shape)} and new {tuple(b.shape)} differ in shape")
    if old:
        # torch's fused multi-tensor ops are documented but underscore-named (not in torch's __all__).
        torch._foreach_lerp_(old, new, 1.0 - decay)  # pyright: ignore[reportPrivateImportUsage]
