"""The LAION aesthetic predictor ("improved aesthetic predictor" v2, C. Schuhmann): an MLP on the unit-norm
CLIP ViT-L/14 image embedding, regressed on AVA and LAION-Logos ratings (1-10). The prompt is not used.

    score = head(E_image / |E_image|),  head = Linear(768, 1024) -> Linear(1024, 128) -> Linear(128, 64)
                                               -> Linear(64, 16) -> Linear(16, 1)

The published head has dropout between its first four layers (0.2, 0.2, 0.1; inactive at inference) and no
activation, so it is one affine map a . e + c of the unit embedding e: the score lies in
[c - |a|, c + |a|]. The ratings it was fit on are 1-10; images score about 4-7 (DDPO's aesthetic reward
starts near 5.5). Not bounded by construction: an image far from the training data can leave 1-10.

Weights: `model` = openai/clip-vit-large-patch14 (a transformers CLIPModel; directory or hub id) and `head` =
the predictor's state dict, a local file (sac+logos+ava1-l14-linearMSE.pth, keys layers.{0,2,4,6,7}.weight
and .bias, or the same keys in a .safetensors file). Preprocessing and batching: `fgrpo.rewards.clip`.

Spec for `build_reward`: {"name": "aesthetic", "head": "/ckpt/sac+logos+ava1-l14-linearMSE.pth"}.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fgrpo.errors import ConfigError
from fgrpo.rewards.base import RewardOutput, weights_file
from fgrpo.rewards.clip import ClipEmbedder, check_images, first_line, load_clip

HIDDEN = (1024, 128, 64, 16)  # the published head's widths
DROPOUT = (0.2, 0.2, 0.1)  # after its first three linear layers (train time only)


class AestheticHead(nn.Module):
    """The predictor's MLP; its `layers` indices match the published state dict (dropouts included)."""

    def __init__(self, embed_dim: int = 768):
        super().__init__()
        widths = (embed_dim, *HIDDEN)
        mods: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            mods.append(nn.Linear(a, b))
            if i < len(DROPOUT):
                mods.append(nn.Dropout(DROPOUT[i]))
        mods.append(nn.Linear(HIDDEN[-1], 1))
        self.layers = nn.Sequential(*mods)

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        """Unit-norm embeddings [B, D] -> scores [B]."""
        return self.layers(embeds).squeeze(-1)


def _head_file(path: str) -> Path:
    hint = (
        "give the local path of the predictor's weights (sac+logos+ava1-l14-linearMSE.pth from LAION's "
        "improved-aesthetic-predictor)"
    )
    return weights_file("aesthetic", "head", path, hint)


def load_head(path: str, embed_dim: int) -> AestheticHead:
    """An AestheticHead with the weights of a local .pth / .safetensors state dict; one-line ConfigError when
    the file is missing or holds another network."""
    file = _head_file(path)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(file)
    else:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ConfigError(
                f"reward 'aesthetic': head={path!r} is not a torch state dict of tensors ({first_line(e)})"
            ) from None
    head = AestheticHead(embed_dim)
    try:
        head.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"reward 'aesthetic': head={path!r} does not fit a predictor on {embed_dim}-wide CLIP embeddings "
            f"({first_line(e)}); it must be the ViT-L/14 predictor for a ViT-L/14 model"
        ) from None
    return head


class AestheticReward:
    """head(unit CLIP image embedding) per image (see the module docstring); prompts are ignored."""

    def __init__(self, embedder: ClipEmbedder, head: AestheticHead):
        self.embedder = embedder
        self.head = head.eval().to(embedder.device, torch.float32)

    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput:
        check_images(images, prompts, metadata, "aesthetic")
        with torch.inference_mode():
            scores = self.head(self.embedder.images(images))
        return RewardOutput(scores=scores.cpu().numpy().astype(np.float32))


def aesthetic(
    *,
    head: str,
    model: str = "openai/clip-vit-large-patch14",
    device: str = "cuda",
    dtype: str = "float32",
    batch_size: int = 32,
) -> AestheticReward:
    """The aesthetic reward from a head file and a CLIP checkpoint directory or hub id."""
    _head_file(head)  # before the CLIP model's seconds of loading
    clip, proc = load_clip(model, None, reward="aesthetic", device=device, dtype=dtype)
    embedder = ClipEmbedder(clip, proc, batch_size=batch_size)
    return AestheticReward(embedder, load_head(head, clip.config.projection_dim))
