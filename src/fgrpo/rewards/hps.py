"""HPSv2 / HPSv2.1 (Wu et al. 2023, "Human Preference Score v2"): an open_clip ViT-H-14 fine-tuned on human
choices between generated images (HPD v2).

    score = cos(E_image, E_text)

as HPSv2's own scorer computes it (the diagonal of image_features @ text_features.T of the unit-norm open_clip
features; no logit scale). Range [-1, 1]; generated images of their prompt score about 0.2-0.4, and 0.01 is a visible
preference.

The model is open_clip's own CLIP class at the ViT-H-14 configuration, with the HPS checkpoint's state dict
loaded strictly, and open_clip's tokenizer (its BPE vocabulary ships inside the package): the network and the
tokens are HPSv2's. Preprocessing is CLIP's evaluation transform (shortest side to 224, bicubic, centre crop,
CLIP mean/std) by `fgrpo.rewards.clip.pixel_values`, on `device`: for the square images the recipes sample it
is the same resize as HPSv2's, up to torchvision's tensor resampling against PIL's.

Weights: `checkpoint` = "v2.1" or "v2.0" (HPS_v2.1_compressed.pt / HPS_v2_compressed.pt of the hub repository
xswu/HPSv2, from the local Hugging Face cache first), or the path of such a file (a dict whose "state_dict"
holds the open_clip weights).

Spec for `build_reward`: {"name": "hps", "checkpoint": "/ckpt/HPS_v2.1_compressed.pt"}.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fgrpo.errors import ConfigError
from fgrpo.rewards.base import RewardOutput, weights_file
from fgrpo.rewards.clip import (
    check_images,
    clip_image_processor,
    first_line,
    pixel_values,
    torch_dtype,
    unique_prompts,
    unit,
)

HUB_REPO = "xswu/HPSv2"
VERSIONS = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


def open_clip_config(architecture: str | Mapping[str, Any]) -> dict[str, Any]:
    """The open_clip model configuration `architecture` names ("ViT-H-14") or is ({"embed_dim": ...,
    "vision_cfg": {...}, "text_cfg": {...}})."""
    import open_clip

    cfg = open_clip.get_model_config(architecture) if isinstance(architecture, str) else dict(architecture)
    if cfg is None:
        raise ConfigError(
            f"reward 'hps': architecture={architecture!r} is not an open_clip model name (ViT-H-14)"
        )
    return cfg


def build_open_clip(architecture: str | Mapping[str, Any]) -> Any:
    """An open_clip CLIP of `architecture` (see `open_clip_config`) with random weights."""
    from open_clip.model import CLIP

    return CLIP(**open_clip_config(architecture))


def _checkpoint_file(checkpoint: str) -> Path:
    """The local file of `checkpoint` (a version name fetched through the Hugging Face cache, or a path)."""
    hint = f"give the path of HPS_v2.1_compressed.pt (or HPS_v2_compressed.pt) or one of {sorted(VERSIONS)}"
    hub = (HUB_REPO, VERSIONS[checkpoint]) if checkpoint in VERSIONS else None
    return weights_file("hps", "checkpoint", checkpoint, hint, hub)


def load_hps(checkpoint: str, architecture: str | Mapping[str, Any] = "ViT-H-14") -> Any:
    """The open_clip model of `architecture` with the weights of an HPS checkpoint (strict), in eval mode."""
    open_clip_config(architecture)  # an unknown name fails before a checkpoint is looked for
    file = _checkpoint_file(checkpoint)
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(
            f"reward 'hps': checkpoint {str(file)!r} is not a torch checkpoint of tensors ({first_line(e)})"
        ) from None
    state = ckpt.get("state_dict", ckpt) if isinstance(ckpt, dict) else None
    if not isinstance(state, dict):
        raise ConfigError(f"reward 'hps': checkpoint {str(file)!r} holds no state dict")
    model = build_open_clip(architecture)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ConfigError(
            f"reward 'hps': checkpoint {str(file)!r} does not fit open_clip {architecture!r} ({first_line(e)}); HPSv2 "
            "checkpoints are ViT-H-14"
        ) from None
    return model.eval()


class HpsReward:
    """cos(image, prompt) of an open_clip model's unit-norm features (see the module docstring).

    Args:
        model: an open_clip CLIP (an HPS checkpoint's weights), on the device it runs on.
        batch_size: images (or distinct prompts) per forward.
    """

    def __init__(self, model: Any, *, batch_size: int = 32):
        from open_clip.tokenizer import SimpleTokenizer

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.batch_size = model.eval(), batch_size
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.image_processor = clip_image_processor(model.visual.image_size)
        self.tokenizer = SimpleTokenizer(context_length=model.context_length)

    @torch.inference_mode()
    def _embed(self, encode: Any, inputs: list[Any]) -> torch.Tensor:
        return unit(torch.cat([encode(x) for x in inputs]))

    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput:
        check_images(images, prompts, metadata, "hps")
        if len(images) == 0:
            return RewardOutput(scores=np.zeros(0, np.float32))
        b = self.batch_size
        pixels = [
            pixel_values(self.image_processor, images[i : i + b], self.device).to(self.dtype)
            for i in range(0, len(images), b)
        ]
        distinct, index = unique_prompts(prompts)
        tokens = [self.tokenizer(distinct[i : i + b]).to(self.device) for i in range(0, len(distinct), b)]
        image = self._embed(self.model.encode_image, pixels)
        text = self._embed(self.model.encode_text, tokens)[index.to(self.device)]
        return RewardOutput(scores=(image * text).sum(-1).cpu().numpy().astype(np.float32))


def hps(
    *,
    checkpoint: str = "v2.1",
    architecture: str | dict[str, Any] = "ViT-H-14",
    device: str = "cuda",
    dtype: str = "float32",
    batch_size: int = 32,
) -> HpsReward:
    """The HPSv2 reward from a version name ("v2.1", "v2.0") or a checkpoint file."""
    torch_type = torch_dtype(dtype, "hps")
    return HpsReward(load_hps(checkpoint, architecture).to(device, torch_type), batch_size=batch_size)
