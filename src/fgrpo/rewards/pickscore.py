"""PickScore (Kirstain et al. 2023, "Pick-a-Pic: An Open Dataset of User Preferences for Text-to-Image
Generation"): a CLIP-H/14 fine-tuned on human preferences between images of one prompt.

    score = exp(logit_scale) * cos(E_image, E_text)

as its model card computes it (`model.logit_scale.exp() * text_embs @ image_embs.T`), with the checkpoint's own
learned logit_scale (exp = 100 in PickScore_v1). Range [-exp(logit_scale), exp(logit_scale)] = [-100, 100];
generated images of their prompt score about 18-24, and a difference of 1 is a large preference. flow_grpo
trains on score / 26: give the member a weight of 1/26 in a multi-reward for its scale.

Weights: `model` = yuvalkirstain/PickScore_v1 (a transformers CLIPModel) and `processor` =
laion/CLIP-ViT-H-14-laion2B-s32B-b79K's, where PickScore's model card takes it from, each a local directory or a
hub id in the local cache. Preprocessing and batching: `fgrpo.rewards.clip` (CLIP's evaluation transform on `device`).

Spec for `build_reward`: {"name": "pickscore", "model": "/ckpt/PickScore_v1", "processor": "/ckpt/CLIP-H"}.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fgrpo.rewards.base import RewardOutput
from fgrpo.rewards.clip import ClipEmbedder, check_images, load_clip


class PickScore:
    """exp(logit_scale) * cos(image, prompt) of a CLIP model's embeddings (see the module docstring)."""

    def __init__(self, embedder: ClipEmbedder):
        self.embedder = embedder

    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput:
        check_images(images, prompts, metadata, "pickscore")
        scale = self.embedder.model.logit_scale.detach().float().exp()
        scores = scale * self.embedder.cosine(images, prompts)
        return RewardOutput(scores=scores.cpu().numpy().astype(np.float32))


def pickscore(
    *,
    model: str = "yuvalkirstain/PickScore_v1",
    processor: str | None = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
    device: str = "cuda",
    dtype: str = "float32",
    batch_size: int = 32,
) -> PickScore:
    """The PickScore reward from checkpoint directories or hub ids (`processor`: None = the model's own)."""
    clip, proc = load_clip(model, processor, reward="pickscore", device=device, dtype=dtype)
    return PickScore(ClipEmbedder(clip, proc, batch_size=batch_size))
