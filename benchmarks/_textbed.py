"""What the two textbed benchmarks share: the renderer as a script's flags ask for it, and the `tiny-gpu`
preset's rollout taken from the experiment file itself (so a preset change reaches them; flags override)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from fgrpo.config import SamplingConfig
from fgrpo.models.textbed import TextbedModel, load_textbed
from fgrpo.scripts import load_script

EXPERIMENT = Path(__file__).resolve().parents[1] / "experiments" / "qwen_image_ocr.py"


def preset_rollout(**overrides) -> SamplingConfig:
    """`experiments/qwen_image_ocr.py tiny-gpu`'s SamplingConfig with `overrides` replaced."""
    return dataclasses.replace(load_script(EXPERIMENT).tiny_gpu().sampling, **overrides)


def load_renderer(checkpoint: str | None, device: torch.device, lora: str | None = None) -> TextbedModel:
    """The textbed renderer (bundled or `checkpoint`), bf16 on GPU and fp32 on CPU, with an optional adapter."""
    model = load_textbed(
        checkpoint, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    if lora:
        model.transformer.load_lora_adapter(lora, use_safetensors=True)
    return model
