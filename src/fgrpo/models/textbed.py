"""textbed: a tiny pretrained pixel-space text renderer behind the FlowModel interface.

The testbed for Flow-GRPO on a laptop: it draws one upper-case English word, dark on light, on a
32x128 grayscale canvas, from the prompt `"WORD"` (with the double quotes, so an OCR reward that reads
the target between the first pair of quotes finds it). Its denoiser is diffusers'
`QwenImageTransformer2DModel` with a tiny config, so rollout, LoRA and FSDP exercise the same class and
forward signature as Qwen-Image (`arch="sd3"`: diffusers' `SD3Transformer2DModel` with SD3.5-Medium's
structure — joint attention with qk RMS-norm, dual attention in the first half of the blocks, a pooled text
vector — over the same tokens, so the same renderer task trains and tests the SD3.5 family):

- "latents" are pixels in [-1, 1], patchified into 4x4 patches: x_t is [B, 8 * 32, 16], exactly like
  Qwen-Image's packed [B, seq, 64] latents (the transformer's own patch_size is 1 because we pack here);
- the text encoder is a 2-layer BERT over UTF-8 bytes (no tokenizer file to ship), pretrained jointly;
- rectified flow x_t = (1 - sigma) * x0 + sigma * noise, v = noise - x0; plain CFG with the empty
  prompt as the unconditional branch (10 % prompt dropout in pretraining).

Differs from Qwen-Image: pixel space (no VAE; decode is un-patchify + [-1, 1] -> uint8), plain CFG
instead of true-CFG (the model was trained for it), an unshifted linear schedule (pretraining drew
sigma from a logit-normal, not a resolution-shifted one), whitespace-stripped prompts (so the default
negative prompt " " is the unconditional prompt the model was trained with).

The checkpoint, its config and the word lists live in src/fgrpo/assets/textbed/ (see its README.md).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
from einops import rearrange
from torch import nn
from transformers import BertConfig, BertModel

from fgrpo.core import guidance, schedule
from fgrpo.models.base import Cond
from fgrpo.models.common import OnTransformer

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "textbed"
# The bundled renderers by the name `model.path` gives them ('' = the Qwen-Image architecture's, the default).
BUNDLED = {"": ASSET_DIR, "sd3": ASSET_DIR.parent / "textbed_sd3"}

# Byte vocabulary: 0 = pad, 1 = begin (always present, so the empty prompt is one token), b + 2 = byte b.
PAD_ID, BOS_ID, BYTE_OFFSET = 0, 1, 2
VOCAB_SIZE = 256 + BYTE_OFFSET


@dataclass(frozen=True)
class TextbedConfig:
    """Architecture of the textbed model (stored as config.json next to the weights)."""

    arch: Literal["qwen_image", "sd3"] = "qwen_image"
    """Denoiser class: diffusers' QwenImageTransformer2DModel or SD3Transformer2DModel (SD3.5-M's structure)."""
    height: int = 32
    """Image height in pixels (the only trained size)."""
    width: int = 128
    """Image width in pixels (the only trained size)."""
    patch: int = 4
    """Pixels per patch side; one transformer token per patch (Qwen-Image: 2x2 latent patches of 16 ch)."""
    num_layers: int = 5
    """Number of transformer blocks (double-stream joint attention)."""
    num_heads: int = 6
    """Attention heads; width = num_heads * head_dim."""
    head_dim: int = 32
    """Per-head width; the 3-axis RoPE splits it as axes_dims_rope."""
    axes_dims_rope: tuple[int, int, int] = (8, 12, 12)
    """qwen_image: RoPE dims for (frame, row, column); must sum to head_dim (sd3 uses fixed sin-cos positions instead)."""
    text_dim: int = 128
    """Width of the byte-level BERT text encoder (= the transformer's joint_attention_dim)."""
    text_layers: int = 2
    """Layers of the text encoder."""
    text_heads: int = 4
    """Attention heads of the text encoder."""
    max_text_len: int = 16
    """Text tokens per prompt including the begin token; prompts are padded to it (fixed-shape Cond)."""

    def __post_init__(self):
        if self.height % self.patch or self.width % self.patch:
            raise ValueError(
                f"height/width ({self.height}x{self.width}) must be multiples of patch={self.patch}"
            )
        if self.arch not in ("qwen_image", "sd3"):
            raise ValueError(f"arch={self.arch!r}: use 'qwen_image' or 'sd3'")
        if self.arch == "qwen_image" and sum(self.axes_dims_rope) != self.head_dim:
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must sum to head_dim={self.head_dim}")

    @property
    def grid(self) -> tuple[int, int]:
        return self.height // self.patch, self.width // self.patch

    @classmethod
    def from_dict(cls, d: dict) -> TextbedConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(
                f"unknown textbed config keys {sorted(unknown)}; expected a subset of {sorted(names)}"
            )
        d = dict(d)
        if "axes_dims_rope" in d:
            d["axes_dims_rope"] = tuple(d["axes_dims_rope"])
        return cls(**d)


def build_transformer(cfg: TextbedConfig) -> QwenImageTransformer2DModel | SD3Transformer2DModel:
    """Randomly initialised denoiser over 4x4 pixel patches: Qwen-Image's transformer, or SD3's."""
    channels = cfg.patch * cfg.patch
    shared: dict[str, Any] = dict(
        # one token per pixel patch: Qwen-Image's gets them packed by `patchify` (as its pipeline packs 2x2
        # latent patches), SD3's as a p*p-channel image of the patch grid
        patch_size=1,
        in_channels=channels,
        out_channels=channels,
        num_layers=cfg.num_layers,
        attention_head_dim=cfg.head_dim,
        num_attention_heads=cfg.num_heads,
        joint_attention_dim=cfg.text_dim,
    )
    if cfg.arch == "sd3":
        grid = max(cfg.grid)
        return SD3Transformer2DModel(
            **shared,
            sample_size=grid,
            caption_projection_dim=cfg.num_heads * cfg.head_dim,
            pooled_projection_dim=cfg.text_dim,
            pos_embed_max_size=grid,  # fixed sin-cos positions of a 32 x 32 grid, cropped to the 8 x 32 one
            qk_norm="rms_norm",  # SD3.5's
            dual_attention_layers=tuple(range(cfg.num_layers // 2)),  # SD3.5-Medium: the first half
        )
    return QwenImageTransformer2DModel(**shared, axes_dims_rope=cfg.axes_dims_rope)


def build_text_encoder(cfg: TextbedConfig) -> BertModel:
    """Randomly initialised byte-level BERT (bidirectional, no pooler, no dropout)."""
    bert = BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=cfg.text_dim,
        num_hidden_layers=cfg.text_layers,
        num_attention_heads=cfg.text_heads,
        intermediate_size=4 * cfg.text_dim,
        max_position_embeddings=cfg.max_text_len,
        type_vocab_size=1,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=PAD_ID,
    )
    return BertModel(bert, add_pooling_layer=False)


def tokenize(prompts: Sequence[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> (ids [B, max_len] int64, mask [B, max_len] bool). Whitespace is stripped first."""
    ids = torch.full((len(prompts), max_len), PAD_ID, dtype=torch.long)
    for i, p in enumerate(prompts):
        b = p.strip().encode("utf-8")
        if len(b) > max_len - 1:
            raise ValueError(
                f"prompt {p!r} is {len(b)} bytes; textbed takes at most {max_len - 1} (use a shorter word)"
            )
        ids[i, 0] = BOS_ID
        ids[i, 1 : 1 + len(b)] = torch.tensor(list(b), dtype=torch.long) + BYTE_OFFSET
    return ids, ids != PAD_ID


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, H, W] pixels -> [B, (H/p)(W/p), p*p] tokens, row-major over the patch grid."""
    return rearrange(images, "b (h p) (w q) -> b (h w) (p q)", p=patch, q=patch)


def unpatchify(tokens: torch.Tensor, height: int, width: int, patch: int) -> torch.Tensor:
    """Inverse of `patchify`: [B, seq, p*p] -> [B, H, W]."""
    return rearrange(
        tokens, "b (h w) (p q) -> b (h p) (w q)", h=height // patch, w=width // patch, p=patch, q=patch
    )


def prompt_for(word: str) -> str:
    """The prompt that asks for `word`: the word in double quotes (what the OCR reward reads back)."""
    return f'"{word}"'


def extract_words(text: str, min_len: int = 3, max_len: int = 8) -> list[str]:
    """Sorted unique upper-case letter-only words of `text` outside double quotes, min_len..max_len long."""
    unquoted = re.sub(r'"[^"\n]*"', " ", text)
    return sorted({w.upper() for w in re.findall(r"[A-Za-z]+", unquoted) if min_len <= len(w) <= max_len})


def is_heldout(word: str, modulus: int = 8) -> bool:
    """Deterministic held-out split (1 / modulus of the words) by a hash of the word, stable across runs."""
    return int.from_bytes(hashlib.sha256(word.encode()).digest()[:8], "big") % modulus == 0


def read_words(name: str, asset_dir: str | Path = ASSET_DIR) -> list[str]:
    """Word list `name` ("train" or "heldout") from the asset folder, one word per line."""
    return (Path(asset_dir) / f"words_{name}.txt").read_text().split()


def upscale(images: torch.Tensor, factor: int = 2) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> [B, factor*H, factor*W, 3], bilinear (the OCR input size of the reported scores).

    With RapidOcrEngine(det_limit_side_len=64) the native 32x128 reads as well (0.815 native vs 0.804 x2
    on 16 held-out words, CPU), so this is for comparability with the recorded numbers, not a necessity.
    """
    x = images.permute(0, 3, 1, 2).float()
    x = nn.functional.interpolate(x, scale_factor=factor, mode="bilinear", align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class TextbedModel(OnTransformer, nn.Module):
    """FlowModel for the tiny text renderer. Cond keys: prompt_embeds [B, L, D], prompt_mask [B, L] bool,
    and neg_prompt_embeds / neg_prompt_mask when a negative prompt is given.

    decode returns the native 32x128 resolution (the Protocol's [B, height, width, 3]); `upscale` makes
    the 64x256 images the recorded OCR scores were measured on.
    """

    def __init__(
        self,
        cfg: TextbedConfig,
        transformer: QwenImageTransformer2DModel | SD3Transformer2DModel | None = None,
        text_encoder: nn.Module | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.transformer = transformer if transformer is not None else build_transformer(cfg)
        self.text_encoder = text_encoder if text_encoder is not None else build_text_encoder(cfg)

    # -- pieces shared by pretraining and the FlowModel methods (one formula each) --

    def embed_ids(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Text encoder on token ids: [B, L] -> [B, L, text_dim]."""
        return self.text_encoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state

    def denoise(
        self, x_t: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """One transformer forward, [B, seq, p*p] in the transformer's dtype -> raw velocity (same dtype)."""
        gh, gw = self.cfg.grid
        if self.cfg.arch == "sd3":
            # SD3 attends to every text token (as to T5's padding) and takes a pooled vector: the masked mean
            # of the text states stands in for CLIP's pooled embeddings; its time embedding takes 1000 sigma.
            m = mask.to(embeds.dtype)[..., None]
            pooled = (embeds * m).sum(1) / m.sum(1)
            out = self.transformer(
                hidden_states=rearrange(x_t, "b (h w) c -> b c h w", h=gh, w=gw),
                encoder_hidden_states=embeds,
                pooled_projections=pooled,
                timestep=sigma * 1000,
                return_dict=False,
            )[0]
            return rearrange(out, "b c h w -> b (h w) c")
        return self.transformer(
            hidden_states=x_t,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            timestep=sigma,  # Qwen-Image's time embedding takes sigma in [0, 1] (it scales by 1000 itself)
            img_shapes=[(1, gh, gw)] * x_t.shape[0],
            return_dict=False,
        )[0]

    # -- FlowModel --

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompt: str | None = None) -> Cond:
        ids, mask = tokenize(prompts, self.cfg.max_text_len)
        ids, mask = ids.to(self.device), mask.to(self.device)
        cond = {"prompt_embeds": self.embed_ids(ids, mask), "prompt_mask": mask}
        if negative_prompt is not None:
            nid, nmask = tokenize([negative_prompt] * len(prompts), self.cfg.max_text_len)
            nid, nmask = nid.to(self.device), nmask.to(self.device)
            cond |= {"neg_prompt_embeds": self.embed_ids(nid, nmask), "neg_prompt_mask": nmask}
        return cond

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        self._check_size(height, width)
        gh, gw = self.cfg.grid
        return (gh * gw, self.cfg.patch**2)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        self._check_size(height, width)
        # shift=1 is the flow-match scheduler's unshifted (linear) schedule, matching how sigma was drawn
        # in pretraining (logit-normal, no resolution shift).
        return schedule.sd3_sigmas(num_steps, shift=1.0)

    def sigmas_at(self, num_steps: int, height: int, width: int, positions: torch.Tensor) -> torch.Tensor:
        self._check_size(height, width)
        return schedule.sd3_sigmas_at(positions, num_steps, shift=1.0)

    def velocity(
        self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Cond, *, guidance_scale: float
    ) -> torch.Tensor:
        embeds, mask = cond["prompt_embeds"], cond["prompt_mask"]
        use_cfg = guidance_scale != 1.0
        if use_cfg:
            if "neg_prompt_embeds" not in cond:
                raise ValueError(
                    "guidance_scale != 1 needs neg_prompt_embeds in cond: encode(..., negative_prompt=' ')"
                )
            # One batched forward over [cond; uncond]: half the kernel launches of two calls.
            x_t = torch.cat([x_t, x_t])
            sigma = torch.cat([sigma, sigma])
            embeds = torch.cat([embeds, cond["neg_prompt_embeds"]])
            mask = torch.cat([mask, cond["neg_prompt_mask"]])
        dt = self.dtype
        v = self.denoise(x_t.to(dt), sigma.to(dt), embeds.to(dt), mask).float()
        if use_cfg:
            v_cond, v_uncond = v.chunk(2)
            return guidance.cfg(v_cond, v_uncond, guidance_scale)
        return v

    def decode(self, x0: torch.Tensor, height: int, width: int) -> torch.Tensor:
        self._check_size(height, width)
        img = unpatchify(x0.float(), height, width, self.cfg.patch)  # [B, H, W] in [-1, 1]
        img = ((img.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return img.unsqueeze(-1).expand(-1, -1, -1, 3).contiguous()

    def _check_size(self, height: int, width: int) -> None:
        if (height, width) != (self.cfg.height, self.cfg.width):
            raise ValueError(
                f"textbed renders only {self.cfg.height}x{self.cfg.width} (got height={height}, width={width}); "
                f"set SamplingConfig(height={self.cfg.height}, width={self.cfg.width})"
            )


def state_dict_for_save(model: TextbedModel, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Flat {transformer.*, text_encoder.*} parameters in `dtype`, contiguous (safetensors-ready). Buffers stay out:
    the constructor rebuilds them (SD3's fixed sin-cos positions), and a bf16 copy would replace the fp32 values
    the model was trained with."""
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.named_parameters()}


def load_weights(model: TextbedModel, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy a checkpoint's parameters into `model` (each cast to the parameter's dtype). Every parameter must be
    there, and no name the model lacks; buffers a file holds (older SD3 files: the positions in bf16) are skipped,
    so the constructor's fp32 values stay."""
    params = dict(model.named_parameters())
    missing, unknown = (
        sorted(params.keys() - weights.keys()),
        sorted(weights.keys() - model.state_dict().keys()),
    )
    if missing or unknown:
        raise ValueError(
            f"textbed weights do not fit a {model.cfg.arch} model of this config: missing {missing[:3]}, "
            f"unknown {unknown[:3]} ({len(missing)} / {len(unknown)}); check config.json against the weights"
        )
    model.load_state_dict({k: weights[k] for k in params}, strict=False)


def save_textbed(model: TextbedModel, path: str | Path, meta: dict | None = None) -> None:
    """Write model.safetensors (bf16) and config.json ({"model": TextbedConfig, **meta}) into `path`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state_dict_for_save(model), str(path / "model.safetensors"))
    cfg = asdict(model.cfg) | {"axes_dims_rope": list(model.cfg.axes_dims_rope)}
    (path / "config.json").write_text(json.dumps({"model": cfg} | (meta or {}), indent=2) + "\n")


def load_textbed(
    path: str | Path | None = None, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> TextbedModel:
    """The pretrained textbed model, eval mode, frozen. path: a folder with model.safetensors and config.json, or
    a name in BUNDLED (None or '' = the bundled Qwen-Image-architecture renderer, 'sd3' = the SD3 one).

    fp32 is the right dtype on CPU (bf16 matmuls are slower there); bf16 on GPU.
    """
    from safetensors.torch import load_file

    path = BUNDLED.get(str(path or ""), Path(str(path)))
    weights = path / "model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(
            f"no textbed checkpoint at {weights}; pass path= the folder with model.safetensors"
        )
    cfg = TextbedConfig.from_dict(json.loads((path / "config.json").read_text())["model"])
    model = TextbedModel(cfg)
    load_weights(model, load_file(str(weights)))
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
