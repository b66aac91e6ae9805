"""CLIP (and ImageReward's BLIP) models with random weights, built offline: the widths of the checkpoints the rewards load (for timing
them on a GPU: benchmarks/rewards.py) or tiny ones (for the CPU tests), with a small word-level tokenizer that
frames a text as CLIP's does (<|startoftext|> ... <|endoftext|>, padded with <|endoftext|>).

    model, processor = random_clip("h14", "cuda", dtype=torch.bfloat16)   # PickScore's architecture
    write_random_clip(tmp_path, "tiny")      # a directory that `fgrpo.rewards.clip.load_clip` reads
    model = random_open_clip("h14")          # open_clip ViT-H-14 (HPSv2's architecture)
    model, tokenizer = random_imagereward("large")   # BLIP ViT-L + BERT with ImageReward's head

A random model's scores mean nothing; its tokenizer knows only a few words (others are <unk>).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import CLIPConfig, CLIPModel, CLIPProcessor, PreTrainedTokenizerFast

from fgrpo.rewards.clip import clip_image_processor
from fgrpo.rewards.hps import build_open_clip
from fgrpo.rewards.imagereward import TEXT, TINY_TEXT, TINY_VISION, VISION, ImageRewardModel

# laion/CLIP-ViT-H-14-laion2B-s32B-b79K's config.json (PickScore_v1 is this architecture): GELU towers of 32 x 1280
# (vision, 14 px patches of 224²) and 24 x 1024 (text), projected to 1024.
CLIP_H14 = {
    "text": dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24),
    "vision": dict(
        hidden_size=1280, intermediate_size=5120, num_attention_heads=16, num_hidden_layers=32, patch_size=14
    ),
    "projection_dim": 1024,
    "hidden_act": "gelu",
}
# openai/clip-vit-large-patch14's config.json (the CLIP score's and the aesthetic predictor's model): QuickGELU
# towers of 24 x 1024 (vision) and 12 x 768 (text), projected to 768.
CLIP_L14 = {
    "text": dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12),
    "vision": dict(
        hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24, patch_size=14
    ),
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
}
TINY = {
    "text": dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2),
    "vision": dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2, patch_size=8
    ),
    "projection_dim": 16,
    "hidden_act": "gelu",
}
SIZES = {"h14": CLIP_H14, "l14": CLIP_L14, "tiny": TINY}
IMAGE_SIZE = {"h14": 224, "l14": 224, "tiny": 32}
VOCAB_SIZE = 49408  # CLIP's BPE vocabulary; the tiny model's is its tokenizer's
# open_clip's ViT-H-14 at a CPU test's size (the real vocabulary and context, so open_clip's own tokenizer fits)
TINY_OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": VOCAB_SIZE, "width": 32, "heads": 2, "layers": 2},
}
WORDS = "a an the of on in with and photo picture painting cat dog red blue green square circle sign says hello world"


def word_tokenizer(
    words: str = WORDS,
    max_length: int = 77,
    *,
    bos: str = "<|startoftext|>",
    eos: str = "<|endoftext|>",
    pad: str | None = None,
    unk: str = "<unk>",
) -> PreTrainedTokenizerFast:
    """A lower-casing word-level tokenizer of `words` framing a text as `bos text eos` (CLIP's tokens and
    padding with eos by default; BERT's with bos="[CLS]", eos="[SEP]", pad="[PAD]", unk="[UNK]")."""
    pad = pad or eos
    vocab = {t: i for i, t in enumerate(dict.fromkeys([pad, eos, bos, unk, *words.split()]))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=unk,
        model_max_length=max_length,
    )


def clip_config(size: str, tokenizer: Any, *, logit_scale: float = 2.6592) -> CLIPConfig:
    """CLIPConfig of `size` ("h14", "l14", "tiny") whose special-token ids are `tokenizer`'s."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    spec = SIZES[size]
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vocab = len(tokenizer) if size == "tiny" else VOCAB_SIZE
    text = dict(
        spec["text"], vocab_size=vocab, max_position_embeddings=77, hidden_act=spec["hidden_act"], **ids
    )
    vision = dict(spec["vision"], image_size=IMAGE_SIZE[size], hidden_act=spec["hidden_act"])
    return CLIPConfig(
        text_config=text,
        vision_config=vision,
        projection_dim=spec["projection_dim"],
        logit_scale_init_value=logit_scale,
    )


def random_clip(
    size: str = "h14",
    device: torch.device | str = "cuda",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    logit_scale: float = 2.6592,
) -> tuple[CLIPModel, CLIPProcessor]:
    """(CLIPModel, CLIPProcessor) of `size`: random weights (transformers' init, seeded) built on `device`;
    `logit_scale` is the log of the scale PickScore multiplies by."""
    tokenizer = word_tokenizer()
    image_processor = clip_image_processor(IMAGE_SIZE[size])
    config = clip_config(size, tokenizer, logit_scale=logit_scale)
    cuda = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        with torch.device(device):
            model = CLIPModel._from_config(config, dtype=dtype)
    return model.eval(), CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def write_random_clip(path: str | Path, size: str = "tiny", **kwargs: Any) -> Path:
    """Write a checkpoint directory (config, weights, tokenizer, preprocessor) of `random_clip(size, "cpu")`."""
    path = Path(path)
    model, processor = random_clip(size, "cpu", **kwargs)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def random_open_clip(size: str = "h14", device: torch.device | str = "cpu", *, seed: int = 0) -> Any:
    """open_clip's CLIP at ViT-H-14's configuration ("h14") or TINY_OPEN_CLIP ("tiny"), random weights (seeded)."""
    cuda = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        with torch.device(device):
            return build_open_clip("ViT-H-14" if size == "h14" else TINY_OPEN_CLIP).eval()


def random_imagereward(
    size: str = "large", device: torch.device | str = "cpu", *, seed: int = 0
) -> tuple[Any, Any]:
    """(ImageRewardModel, BERT-framed word tokenizer): ImageReward's BLIP at its real size ("large") or tiny."""
    vision, text = (VISION, TEXT) if size == "large" else (TINY_VISION, TINY_TEXT)
    # BlipVisionConfig's default init (std 1e-10) makes every image's tokens nearly equal; BERT's 0.02 does not
    vision = {**vision, "initializer_range": 0.02}
    tokenizer = word_tokenizer(max_length=512, bos="[CLS]", eos="[SEP]", pad="[PAD]", unk="[UNK]")
    cuda = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        with torch.device(device):
            return ImageRewardModel(vision, text).eval(), tokenizer
