"""ImageReward (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image
Generation"): BLIP's image-grounded text encoder read by an MLP, trained on 137k expert comparisons.

    score = (head(T[CLS]) - 0.16717362830052426) / 1.0333394966054072

T = BLIP's BERT text encoder over the prompt (35 tokens, padded), cross-attending to every token of BLIP's
ViT-L/16 image encoder; head = the same five linear layers without activations as the LAION aesthetic predictor
(`fgrpo.rewards.aesthetic.AestheticHead`, on 768 wide features); the two constants are ImageReward's
standardisation of its training scores. Range: unbounded (an affine map of a layer-normed feature), about -2
to 2 in practice: 0 is the average generated image of the training set, 1 one of its standard deviations.

The architecture is transformers': BLIP's vision model (`BlipVisionModel`) and its text encoder with
cross-attention (`BlipTextModel`), the ports of BLIP's own ViT and BERT ("med") that BlipForImageTextRetrieval
uses. ImageReward's checkpoint is loaded into them by renaming its keys (`convert_state_dict`); its BLIP
projections (vision_proj, text_proj), which the score does not use, are dropped. Preprocessing is CLIP's
evaluation transform, as ImageReward's (`fgrpo.rewards.clip.pixel_values`, on `device`).

Weights: `checkpoint` = ImageReward.pt (THUDM/ImageReward on the hub; a local path, or "hub" for the local
Hugging Face cache's copy) and `tokenizer` = bert-base-uncased's (a directory or hub id), as BLIP tokenises.

Spec for `build_reward`: {"name": "imagereward", "checkpoint": "/ckpt/ImageReward.pt",
"tokenizer": "/ckpt/bert-base-uncased"}.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fgrpo.errors import ConfigError
from fgrpo.rewards.aesthetic import AestheticHead
from fgrpo.rewards.base import RewardOutput, weights_file
from fgrpo.rewards.clip import (
    check_images,
    check_name,
    clip_image_processor,
    first_line,
    from_pretrained,
    pixel_values,
    torch_dtype,
)

MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward's standardisation of the head's output
MAX_TOKENS = 35  # ImageReward pads and truncates every prompt to 35 tokens
HUB_REPO, HUB_FILE = "THUDM/ImageReward", "ImageReward.pt"
# BLIP ViT-L/16 at 224² (ImageReward's BLIP_Pretrain(vit="large")) and BERT-base with cross-attention to its
# 1024-wide tokens (BLIP's med_config.json: 30524 tokens = bert-base-uncased + [DEC] + [ENC]).
VISION = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    image_size=224,
    patch_size=16,
    layer_norm_eps=1e-6,
)
TEXT = dict(
    vocab_size=30524,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    encoder_hidden_size=1024,
    max_position_embeddings=512,
    layer_norm_eps=1e-12,
)
# the same networks at a CPU test's size
TINY_VISION = dict(
    VISION,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
TINY_TEXT = dict(
    TEXT,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    encoder_hidden_size=32,
)

# ImageReward's key -> transformers' key, as (pattern, replacement) on the whole name
_RENAMES = [
    (r"blip\.visual_encoder\.cls_token", "vision_model.embeddings.class_embedding"),
    (r"blip\.visual_encoder\.pos_embed", "vision_model.embeddings.position_embedding"),
    (r"blip\.visual_encoder\.patch_embed\.proj\.", "vision_model.embeddings.patch_embedding."),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.norm1\.", r"vision_model.encoder.layers.\1.layer_norm1."),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.norm2\.", r"vision_model.encoder.layers.\1.layer_norm2."),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.attn\.qkv\.", r"vision_model.encoder.layers.\1.self_attn.qkv."),
    (
        r"blip\.visual_encoder\.blocks\.(\d+)\.attn\.proj\.",
        r"vision_model.encoder.layers.\1.self_attn.projection.",
    ),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.mlp\.", r"vision_model.encoder.layers.\1.mlp."),
    (r"blip\.visual_encoder\.norm\.", "vision_model.post_layernorm."),
    (r"blip\.text_encoder\.", "text_encoder."),
    (r"mlp\.layers\.", "head.layers."),
]
# in the checkpoint, not in the score: BLIP's contrastive projections and a buffer transformers rebuilds
_UNUSED = re.compile(r"blip\.(vision_proj|text_proj)\.|blip\.text_encoder\.embeddings\.position_ids$")


class ImageRewardModel(nn.Module):
    """BLIP's image encoder and image-grounded text encoder (transformers' modules) and ImageReward's head."""

    def __init__(self, vision: Mapping[str, Any] = VISION, text: Mapping[str, Any] = TEXT):
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        super().__init__()
        self.vision_model = BlipVisionModel(BlipVisionConfig(**vision))
        # is_decoder gives every layer its cross-attention (BLIP's add_cross_attention); forward() still
        # attends both ways over the prompt, as BLIP's "multimodal" mode does
        text_config = BlipTextConfig(**text, is_decoder=True, bos_token_id=None, sep_token_id=None)
        self.text_encoder = BlipTextModel(text_config, add_pooling_layer=False)
        self.head = AestheticHead(text_config.hidden_size)

    def forward(
        self, pixels: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """pixels [B, 3, S, S], tokens [B, L] -> standardised scores [B] (fp32)."""
        image = self.vision_model(pixel_values=pixels).last_hidden_state  # [B, 1 + patches, 1024]
        text = self.text_encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image,
            encoder_attention_mask=torch.ones(image.shape[:2], dtype=torch.long, device=image.device),
        ).last_hidden_state
        return (self.head(text[:, 0].float()) - MEAN) / STD


def convert_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ImageReward's checkpoint keys -> ImageRewardModel's; ValueError naming a key it does not know."""
    out = {}
    for key, value in state.items():
        if _UNUSED.match(key):
            continue
        for pattern, replacement in _RENAMES:
            new, n = re.subn(f"^{pattern}", replacement, key)
            if n:
                out[new] = value
                break
        else:
            raise ValueError(f"unknown key {key!r}")
    return out


def _checkpoint_file(checkpoint: str) -> Path:
    """The local file of `checkpoint` ('hub': THUDM's file through the Hugging Face cache, or a path)."""
    hint = f"give the path of {HUB_FILE} ({HUB_REPO}) or 'hub'"
    return weights_file(
        "imagereward", "checkpoint", checkpoint, hint, (HUB_REPO, HUB_FILE) if checkpoint == "hub" else None
    )


def load_imagereward(
    checkpoint: str, vision: Mapping[str, Any] = VISION, text: Mapping[str, Any] = TEXT
) -> ImageRewardModel:
    """ImageRewardModel with a checkpoint's weights (every weight of the score present), in eval mode."""
    file = _checkpoint_file(checkpoint)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(
            f"reward 'imagereward': {str(file)!r} is not a torch state dict ({first_line(e)})"
        ) from None
    model = ImageRewardModel(vision, text)
    try:
        model.load_state_dict(convert_state_dict(state))
    except (ValueError, RuntimeError, AttributeError) as e:
        raise ConfigError(
            f"reward 'imagereward': {str(file)!r} is not an ImageReward checkpoint of this size ({first_line(e)})"
        ) from None
    return model.eval()


class ImageReward:
    """ImageReward's score per image and prompt (see the module docstring).

    Args:
        model: an ImageRewardModel, on the device it runs on.
        tokenizer: BERT's uncased tokenizer (bert-base-uncased).
        batch_size: images per forward.
    """

    def __init__(self, model: ImageRewardModel, tokenizer: Any, *, batch_size: int = 32):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        model.head.float()  # reads the fp32 [CLS] feature, as ImageReward's does, whatever the towers' dtype
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.image_processor = clip_image_processor(model.vision_model.config.image_size)

    @torch.inference_mode()
    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput:
        check_images(images, prompts, metadata, "imagereward")
        scores = []
        for i in range(0, len(images), self.batch_size):
            pixels = pixel_values(self.image_processor, images[i : i + self.batch_size], self.device)
            tokens = self.tokenizer(
                list(prompts[i : i + self.batch_size]),
                padding="max_length",
                truncation=True,
                max_length=MAX_TOKENS,
                return_tensors="pt",
            ).to(self.device)
            scores.append(self.model(pixels.to(self.dtype), tokens["input_ids"], tokens["attention_mask"]))
        out = torch.cat(scores) if scores else torch.zeros(0)
        return RewardOutput(scores=out.cpu().numpy().astype(np.float32))


def imagereward(
    *,
    checkpoint: str,
    tokenizer: str = "google-bert/bert-base-uncased",
    device: str = "cuda",
    dtype: str = "float32",
    batch_size: int = 32,
    vision: dict[str, Any] | None = None,
    text: dict[str, Any] | None = None,
) -> ImageReward:
    """The ImageReward reward from a checkpoint file (or "hub") and a BERT tokenizer directory or hub id;
    `vision` / `text` override entries of the BLIP configurations (VISION, TEXT) for a checkpoint of another
    size."""
    from transformers import AutoTokenizer

    torch_type = torch_dtype(dtype, "imagereward")
    check_name(tokenizer, reward="imagereward", field="tokenizer")
    _checkpoint_file(checkpoint)  # before the tokenizer's lookup
    tok = from_pretrained(AutoTokenizer, tokenizer, reward="imagereward", field="tokenizer")
    model = load_imagereward(checkpoint, {**VISION, **(vision or {})}, {**TEXT, **(text or {})})
    return ImageReward(model.to(device, torch_type), tok, batch_size=batch_size)
