"""CLIP score, and what the CLIP-based rewards share (PickScore, HPSv2, the aesthetic predictor): loading a
checkpoint offline-first, batched preprocessing on the model's device, unit-norm embeddings.

CLIP score (Hessel et al. 2021, "CLIPScore: A Reference-free Evaluation Metric for Image Captioning", eq. 1):

    score = w * max(cos(E_image, E_text), 0),  w = 2.5

Range [0, w] = [0, 2.5]; real image/caption pairs of a ViT-L/14 land around 0.5-0.9. The paper's w = 2.5
stretches the cosines of real pairs (~0.2-0.35) over a wider part of [0, 1]. `weight=100` gives the
"CLIP score" of torchmetrics and of most text-to-image papers (a number around 25-35); advantages are
normalised per group, so the choice only changes the logged scale. Default model: openai/clip-vit-large-patch14
(torchmetrics' default); any transformers CLIPModel checkpoint works.

Images are preprocessed as CLIP's evaluation transform does (shortest side to the model's size, bicubic;
centre crop; CLIP mean/std), by the checkpoint's image processor with its torchvision backend: on `device`, a
batch at a time, so a GPU reward has no per-image Python loop. Its resampling is torchvision's antialiased
bicubic on tensors, not PIL's (the references resize PIL images), so scores are close to the references' but
not bit-equal; the size of that difference on the real checkpoints has not been measured here (no weights). Repeated prompts (a group of
images per prompt) are encoded once.

Spec for `build_reward`: {"name": "clip_score", "model": "openai/clip-vit-large-patch14", "device": "cuda"}.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fgrpo.errors import ConfigError
from fgrpo.rewards.base import RewardOutput, check_inputs

CLIP_SCORE_WEIGHT = 2.5  # Hessel et al. 2021, eq. 1


def torch_dtype(dtype: str, reward: str) -> torch.dtype:
    """The torch dtype named `dtype` ("float32", "bfloat16", "float16"); ConfigError otherwise."""
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"reward {reward!r}: dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return getattr(torch, dtype)


def first_line(e: BaseException) -> str:
    """An exception's first line of text (its type's name when it has none), for a one-line error."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _hub_offline() -> bool:
    import huggingface_hub.constants

    return bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def check_name(name: str, *, reward: str, field: str) -> None:
    """A local directory or something shaped like a hub id ("name", "owner/name"); else a one-line ConfigError
    naming `field` (before anything is loaded, so a typo costs no download attempt)."""
    if Path(name).expanduser().is_dir():
        return
    if not name or name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ConfigError(
            f"reward {reward!r}: {field}={name!r} is not a directory; give a local checkpoint directory or a hub id"
        )


def from_pretrained(cls: Any, name: str, *, reward: str, field: str, **kwargs: Any) -> Any:
    """`cls.from_pretrained(name)` for a local directory, or a hub id: from the local cache first, then
    (unless HF_HUB_OFFLINE) the hub. A name that is neither raises a one-line ConfigError naming `field`."""
    check_name(name, reward=reward, field=field)
    path = Path(name).expanduser()
    if path.is_dir():
        return cls.from_pretrained(path, **kwargs)
    try:
        return cls.from_pretrained(name, local_files_only=True, **kwargs)
    except OSError:
        if _hub_offline():
            raise ConfigError(
                f"reward {reward!r}: {field}={name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                f"set; download it on a connected machine (hf download {name}) or give its local directory"
            ) from None
    try:
        return cls.from_pretrained(name, **kwargs)
    except OSError as e:
        raise ConfigError(
            f"reward {reward!r}: cannot load {field}={name!r} ({first_line(e)}); download it (hf download {name}) or "
            "give its local directory"
        ) from None


def load_clip(model: str, processor: str | None, *, reward: str, device: str, dtype: str) -> tuple[Any, Any]:
    """(CLIPModel in eval mode on `device` in `dtype`, CLIPProcessor) from a directory or hub id each;
    `processor` None: the model's own."""
    from transformers import CLIPModel, CLIPProcessor

    torch_type = torch_dtype(dtype, reward)
    processor = processor if processor is not None else model
    check_name(model, reward=reward, field="model")
    check_name(processor, reward=reward, field="processor")
    clip = from_pretrained(CLIPModel, model, reward=reward, field="model", dtype=torch_type)
    proc = from_pretrained(CLIPProcessor, processor, reward=reward, field="processor")
    return clip.eval().to(device), proc


def check_images(images: np.ndarray, prompts: Sequence[str], metadata: Any, reward: str) -> None:
    """`check_inputs`, and images rather than videos."""
    check_inputs(images, prompts, metadata)
    if images.ndim != 4:
        raise ValueError(f"the {reward} reward scores images [B, H, W, 3], got videos {list(images.shape)}")


def unique_prompts(prompts: Sequence[str]) -> tuple[list[str], torch.Tensor]:
    """(distinct prompts in first-seen order, index [B] of each prompt among them)."""
    first: dict[str, int] = {}
    index = [first.setdefault(p, len(first)) for p in prompts]
    return list(first), torch.tensor(index, dtype=torch.long)


def clip_image_processor(size: int | Sequence[int]) -> Any:
    """CLIP's evaluation transform at `size` (shortest side to `size`, bicubic; centre crop; CLIP mean/std, which
    are the processor's defaults) as a transformers image processor with the torchvision backend; a (height,
    width) size is a square tower's input, its first entry."""
    from transformers import CLIPImageProcessor

    size = int(size if isinstance(size, int) else size[0])
    return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def pixel_values(image_processor: Any, images: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> the processor's float32 pixels [B, 3, S, S], computed on `device`."""
    x = torch.from_numpy(np.ascontiguousarray(images)).to(device).permute(0, 3, 1, 2)  # [B, 3, H, W]
    return image_processor(images=x, return_tensors="pt", device=device)["pixel_values"].to(device)


def unit(x: torch.Tensor) -> torch.Tensor:
    """x / |x| along the last axis, in fp32."""
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True)


class ClipEmbedder:
    """Unit-norm image and text embeddings of a transformers CLIPModel, `batch_size` images a forward, fp32.

    Args:
        model: a CLIPModel (any projection width), on the device it runs on.
        processor: its CLIPProcessor (image processor + tokenizer).
        batch_size: images (or distinct prompts) per forward; bounds the activations.
    """

    def __init__(self, model: Any, processor: Any, *, batch_size: int = 32):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.processor, self.batch_size = model.eval(), processor, batch_size
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def images(self, images: np.ndarray) -> torch.Tensor:
        """uint8 [B, H, W, 3] -> unit-norm float32 [B, D]."""
        out = []
        for start in range(0, len(images), self.batch_size):
            x = pixel_values(
                self.processor.image_processor, images[start : start + self.batch_size], self.device
            )
            out.append(unit(self.model.get_image_features(pixel_values=x.to(self.dtype)).pooler_output))
        return torch.cat(out) if out else torch.zeros(0, self.model.config.projection_dim, device=self.device)

    @torch.inference_mode()
    def texts(self, prompts: Sequence[str]) -> torch.Tensor:
        """B prompts -> unit-norm float32 [B, D]; each distinct prompt encoded once, truncated to the text
        model's 77 positions as CLIP was trained."""
        distinct, index = unique_prompts(prompts)
        max_length = self.model.config.text_config.max_position_embeddings
        out = []
        for start in range(0, len(distinct), self.batch_size):
            tokens = self.processor.tokenizer(
                distinct[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            ).to(self.device)
            out.append(unit(self.model.get_text_features(**tokens).pooler_output))
        if not out:
            return torch.zeros(0, self.model.config.projection_dim, device=self.device)
        return torch.cat(out)[index.to(self.device)]

    def cosine(self, images: np.ndarray, prompts: Sequence[str]) -> torch.Tensor:
        """cos(image b, prompt b) -> float32 [B]."""
        return (self.images(images) * self.texts(prompts)).sum(-1)


def _positive_weight(weight: float) -> float:
    if not weight > 0 or not np.isfinite(weight):
        raise ConfigError(f"reward 'clip_score': weight must be a positive number (2.5 or 100), got {weight}")
    return float(weight)


class ClipScore:
    """score = weight * max(cos(image, prompt), 0) (CLIPScore, Hessel et al. 2021); range [0, weight]."""

    def __init__(self, embedder: ClipEmbedder, *, weight: float = CLIP_SCORE_WEIGHT):
        self.embedder, self.weight = embedder, _positive_weight(weight)

    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput:
        check_images(images, prompts, metadata, "clip_score")
        cos = self.embedder.cosine(images, prompts)
        return RewardOutput(scores=(self.weight * cos.clamp(min=0)).cpu().numpy().astype(np.float32))


def clip_score(
    *,
    model: str = "openai/clip-vit-large-patch14",
    processor: str | None = None,
    weight: float = CLIP_SCORE_WEIGHT,
    device: str = "cuda",
    dtype: str = "float32",
    batch_size: int = 32,
) -> ClipScore:
    """The CLIP score reward from a checkpoint directory or hub id (`processor`: None = the model's own)."""
    _positive_weight(weight)  # before loading seconds of weights
    clip, proc = load_clip(model, processor, reward="clip_score", device=device, dtype=dtype)
    return ClipScore(ClipEmbedder(clip, proc, batch_size=batch_size), weight=weight)
