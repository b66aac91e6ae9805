"""The one small interface every generator implements (Qwen-Image, SD3.5, FLUX.1, Z-Image, LTX-2, Wan 2.2, the tiny textbed).

The rollout and the trainer talk to a model only through this Protocol, so both call the *same*
`velocity` (each formula exists once).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
    from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformer3DModel
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
    from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel

    from fgrpo.models.bagel_mot import BagelTransformer

    # Every model's transformer is a diffusers model (BAGEL's: fgrpo's own ModelMixin): an nn.Module with diffusers'
    # switches (gradient checkpointing, attention backend, regional compile) and peft's adapter methods.
    Transformer: TypeAlias = (
        QwenImageTransformer2DModel
        | SD3Transformer2DModel
        | LTX2VideoTransformer3DModel
        | FluxTransformer2DModel
        | Flux2Transformer2DModel
        | ZImageTransformer2DModel
        | WanTransformer3DModel
        | BagelTransformer
    )

# Conditioning is a flat dict of batch-first tensors (model-specific keys, e.g. prompt embeddings,
# masks, pooled embeddings, and `neg_*` for the negative prompt when CFG is on). Keeping it a plain
# dict of tensors makes it trivially indexable, concatenable and storable in a Trajectory.
Cond = dict[str, torch.Tensor]


class ImagePrompt(str):
    """A prompt that names its condition image: the text itself (what rewards, logs and text-only models read)
    carrying `image`, the path of the image file an image-conditioned model (Qwen-Image-Edit) edits."""

    image: str

    def __new__(cls, text: str, image: str | os.PathLike) -> ImagePrompt:
        self = super().__new__(cls, text)
        self.image = str(image)
        return self

    # Pickling (reward worker processes) rebuilds the prompt through __new__: pass the image too. str's own
    # returns (text,) only, so the wider tuple is a deliberate override.
    def __getnewargs__(self) -> tuple[str, str]:  # pyright: ignore[reportIncompatibleMethodOverride]
        return str(self), self.image


def cond_index(cond: Cond, idx: torch.Tensor | slice) -> Cond:
    """Select samples (batch rows) from every tensor of a conditioning dict."""
    return {k: v[idx] for k, v in cond.items()}


class VelocityModel(Protocol):
    """What a transition step needs of a model: its velocity (fgrpo.policy.transition)."""

    def velocity(
        self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Cond, *, guidance_scale: float
    ) -> torch.Tensor:
        """Predicted velocity, fp32, shape of x_t. sigma: [B]. CFG (true-CFG or plain) happens here."""
        ...


@runtime_checkable
class FlowModel(VelocityModel, Protocol):
    """A text-to-image rectified-flow model: x_t = (1 - sigma) * x0 + sigma * noise, v = noise - x0."""

    @property
    def transformer(self) -> Transformer:
        """The module that LoRA wraps, FSDP shards and the optimizer trains (read-only here, so a model may
        declare it as its own diffusers class). A model with several (Wan 2.2 T2V-A14B's experts) also has a
        `trained_transformers` mapping of them all, this one first: see `trained_transformers` below."""
        ...

    def encode(self, prompts: Sequence[str], *, negative_prompt: str | None = None) -> Cond:
        """Text conditioning for `prompts` ([B] rows); with `negative_prompt`, also the `neg_*` rows."""
        ...

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Per-sample shape of x_t (what the transformer sees, e.g. packed [seq, ch])."""
        ...

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The sampling schedule, [num_steps + 1] fp32, from 1 (or shifted near 1) down to 0."""
        ...

    def sigmas_at(self, num_steps: int, height: int, width: int, positions: torch.Tensor) -> torch.Tensor:
        """The same schedule at fractional step positions u in [0, num_steps - 1] ([P] -> [P] fp32, equal to
        `sigmas` at integer u): the compressed grid of MixGRPO-Flash's ODE tail (core.schedule.compressed_tail)."""
        ...

    def decode(self, x0: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Clean latents [B, *latent_shape] -> images uint8 [B, height, width, 3] (a video model: its frames,
        uint8 [B, F, height, width, 3])."""
        ...


def trained_transformers(model: FlowModel) -> dict[str, Transformer]:
    """The transformers that LoRA adapts, FSDP shards and the optimizer trains, by attribute name: the model's
    `trained_transformers` where it has several (Wan 2.2 T2V-A14B's two experts), else {"transformer": ...}."""
    several = getattr(model, "trained_transformers", None)
    return dict(several) if several is not None else {"transformer": model.transformer}


def trained_module(model: FlowModel) -> nn.Module:
    """All of `trained_transformers` as one module, the one that checkpoints, weight pushes and merged rollouts
    walk: the transformer itself when there is one (its own parameter names: one-transformer checkpoints are
    unchanged), else an nn.ModuleDict keyed by attribute name (`transformer.<name>`, `transformer_2.<name>`)."""
    named = trained_transformers(model)
    if len(named) == 1:
        return next(iter(named.values()))
    return nn.ModuleDict(named)  # pyright: ignore[reportArgumentType] - every Transformer is an nn.Module
