"""Rollout throughput of the in-process engine on a real-size Qwen-Image: one table.

The transformer (20B, the real config = diffusers' defaults) and the VAE are built directly on the GPU
with random bf16 weights, so nothing is downloaded; by default the 7B text encoder is replaced by random
prompt embeddings of the real width (3584) and realistic lengths, since prompts are encoded once per
prompt and cached (`--text-encoder` builds a random real-size Qwen2.5-VL instead). Each row is one
`DiffusersEngine.generate` call: B samples (groups of G per prompt), 512x512, 10 steps, true CFG 4
(one batched forward of 2B rows per step), flow_sde window of 2 steps, VAE decode included.

Columns: images/s; ms per sample-step (whole rollout / (B x steps)); ms per forward (transformer time,
rollout minus VAE decode, per sample per single non-CFG forward: compare with the measured ceilings
39.2 ms eager / 30.8 ms compiled); effective TFLOP/s (16.65 TFLOP per 512^2 forward per sample, over the
whole rollout time); peak memory. Modes: eager, then model.compile's: regional torch.compile of the transformer
blocks and the compiled VAE decoder.

`--model qwen_image_edit` / `--model ltx2` / `--model flux` / `--model zimage`: the same rows for real-size random
Qwen-Image-Edit (`build_real_qwen_image_edit`), LTX-2.3 (`build_real_ltx2`), FLUX.1-dev (`build_real_flux`) and Z-Image
(`build_real_zimage`; experiments/zimage_ocr.py: 512², 10 steps, true CFG 5, flow_sde window 1 of [1, 4)) at their experiment
recipes' sampling (experiments/qwen_image_edit_ocr.py: 512², 12 steps, true CFG 4, window 3 of [0, 6), a 1024²
condition image; experiments/ltx2_ocr.py: 81-frame 256x384 clips, 24 steps, CFG 4, CPS window 3 of [0, 10);
experiments/flux_ocr.py: 512², 6 steps, embedded guidance 3.5 in one forward, CPS window 3 of [0, 3));
`--model flux2`: FLUX.2 [klein] base 4B's transformer (`build_real_flux2`) at
experiments/flux2_ocr.py's sampling (384², 8 steps, true CFG 4, Flow-SDE window 1 of [1, 4)); `--model flux2_dev`:
FLUX.2 [dev]'s 32 B transformer (`build_real_flux2_dev`) at the file's `dev` sampling (512², embedded guidance 4 in
one forward); TFLOP/s then
uses the forward's FLOPs counted on the model as built (`forward_tflop`), and LTX-2's rows count videos.

GPU:  python benchmarks/rollout.py                   (about 5 min on one H200)
GPU:  python benchmarks/rollout.py --model ltx2 --batch-sizes 8,16
CPU:  python benchmarks/rollout.py --tiny            (tiny random model, checks the script end to end)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import hashlib
import math
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from fgrpo.config import SamplingConfig
from fgrpo.models.bagel import Bagel
from fgrpo.models.base import ImagePrompt
from fgrpo.models.common import module_device, module_dtype
from fgrpo.models.flux import Flux
from fgrpo.models.flux2 import Flux2
from fgrpo.models.loading import compile_decoder, configure_transformer
from fgrpo.models.ltx2 import LTX2, clip_kwargs
from fgrpo.models.qwen_image import QwenImage
from fgrpo.models.qwen_image_edit import QwenImageEdit
from fgrpo.models.registry import FAMILIES, build_tiny
from fgrpo.models.sd3 import SD3
from fgrpo.models.wan import Wan
from fgrpo.models.zimage import ZImage
from fgrpo.rollout.engine import DiffusersEngine
from fgrpo.rollout.seeds import sample_seed
from fgrpo.scripts import load_script

TFLOP_PER_FORWARD_512 = 16.65  # one Qwen-Image transformer forward of one 512x512 sample (1024 image tokens)


class StubTextQwenImage(QwenImage):
    """Qwen-Image whose prompt encoder returns random embeddings of the real shape (no 7B encoder).

    Length: the template's 5 suffix tokens plus ~1 token per 4 characters, like Qwen's tokenizer on English.
    """

    def _encode_one(self, prompt: str) -> tuple[torch.Tensor]:
        length = 5 + math.ceil(len(prompt) / 4)
        gen = torch.Generator().manual_seed(sample_seed(len(prompt), *map(ord, prompt[:32])))
        tcfg: Any = self.transformer.config  # diffusers annotates it dict; it has attribute access
        width = tcfg.joint_attention_dim
        return (torch.randn(length, width, generator=gen).to(self.device, self.dtype),)


@contextlib.contextmanager
def real_size(device: torch.device | str) -> Iterator[None]:
    """Modules built inside get their parameters in bf16 directly on `device`: no fp32 copy, nothing on the
    CPU first (on the meta device: shapes only, for counting)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default)


def build_real(device: torch.device, text_encoder: bool, layers: int = 60) -> QwenImage:
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

    with real_size(device):
        transformer = QwenImageTransformer2DModel(num_layers=layers)  # defaults = Qwen/Qwen-Image's config
        vae = AutoencoderKLQwenImage()
        encoder = tokenizer = None
        if text_encoder:
            encoder, tokenizer = _real_size_text_encoder()
    cls = QwenImage if text_encoder else StubTextQwenImage
    return cls.from_modules(transformer, vae, encoder, tokenizer, device=device)


# Qwen2-VL's vision tokens: 14-pixel patches merged 2x2, so one token per 28x28 pixels of the condition image.
VL_PIXELS_PER_TOKEN = 28


class StubTextQwenImageEdit(QwenImageEdit):
    """Qwen-Image-Edit whose VL encoder returns random embeddings of the real shape (no 7B encoder).

    Length: what the edit template keeps after its 64-token prefix: <|vision_start|>, the condition image's VL
    tokens (the image at the condition size, sides rounded to multiples of 28 px: 37 x 37 = 1369 tokens at
    1024²), <|vision_end|>, ~1 token per 4 characters of the instruction, the template's 5 suffix tokens.
    The condition image is still read, resized and VAE-encoded for real.
    """

    def _encode_instruction(self, key: tuple[str, str]) -> tuple[torch.Tensor]:
        prompt, path = key
        image = self._condition_pil(path)
        vl = round(image.height / VL_PIXELS_PER_TOKEN) * round(image.width / VL_PIXELS_PER_TOKEN)
        length = 1 + vl + 1 + math.ceil(len(prompt) / 4) + 5
        gen = torch.Generator().manual_seed(sample_seed(len(prompt), *map(ord, prompt[:32])))
        tcfg: Any = self.transformer.config  # diffusers annotates it dict; it has attribute access
        width = tcfg.joint_attention_dim
        return (torch.randn(length, width, generator=gen).to(self.device, self.dtype),)


def build_real_qwen_image_edit(device: torch.device | str, layers: int = 60) -> QwenImageEdit:
    """Qwen/Qwen-Image-Edit at real size with random bf16 weights and a stub VL encoder.

    Its transformer and VAE configs are Qwen-Image's (diffusers' QwenImageTransformer2DModel and
    AutoencoderKLQwenImage defaults: 60 blocks of 24 heads x 128, text width 3584, 16 latent channels); the
    pipeline's condition area is 1024² (QwenImageEditPipeline's calculate_dimensions). Not confirmed here: the
    hub's transformer/config.json of Qwen-Image-Edit itself (taken to equal Qwen-Image's, zero_cond_t off, as the
    original Edit release predates that 2511 switch) and its processor's max_pixels (taken large enough that a
    1024² image keeps its size, Qwen2-VL's default 12845056).
    """
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

    with real_size(device):
        transformer = QwenImageTransformer2DModel(num_layers=layers)
        vae = AutoencoderKLQwenImage()
    return StubTextQwenImageEdit.from_modules(transformer, vae, None, None, processor=None, device=device)


def edit_prompts(prompts: Sequence[str], folder: str | Path, size: int) -> list[str]:
    """Each prompt with a condition image of its own: the prompt's first quoted word, black on a white
    size x size square (the edit recipe renders its condition images at the sampling size), as a PNG in
    `folder` named by the prompt, so a fresh prompt is a fresh image (encoded again) and a repeat is cached."""
    from PIL import Image, ImageDraw, ImageFont

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for prompt in prompts:
        path = folder / f"{hashlib.sha1(prompt.encode()).hexdigest()[:16]}.png"
        if not path.exists():
            word = prompt.split('"')[1] if prompt.count('"') >= 2 else prompt[:12]
            image = Image.new("RGB", (size, size), "white")
            font = ImageFont.load_default(size=max(8, size // 6))
            ImageDraw.Draw(image).text((size // 8, size // 3), word, fill="black", font=font)
            image.save(path)
        out.append(ImagePrompt(prompt, path))
    return out


# Gemma 3 12B, LTX-2's text encoder: hidden size 3840 and 48 layers, whose 49 hidden states (embeddings included)
# LTX2TextConnectors reads stacked (its caption_channels and text_proj_in_factor).
GEMMA_WIDTH, GEMMA_STATES = 3840, 49


class StubTextLTX2(LTX2):
    """LTX-2 whose Gemma 3 returns random hidden states of the real shape (no 12B encoder): 49 states of width
    3840 for <bos> plus ~1 token per 4 characters, left-padded with zeros to max_sequence_length (1024) as the
    pipeline pads; the text connectors (real size) then run on them as in LTX2Pipeline."""

    @torch.no_grad()
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg: Any = self.connectors.config
        length = self.max_sequence_length
        valid = min(length, 1 + math.ceil(len(prompt) / 4))
        gen = torch.Generator().manual_seed(sample_seed(len(prompt), *map(ord, prompt[:32])))
        tokens = torch.randn(valid, cfg.caption_channels * cfg.text_proj_in_factor, generator=gen)
        device, dtype = module_device(self.connectors), module_dtype(self.connectors)
        hidden = torch.zeros(1, length, tokens.shape[1], device=device, dtype=dtype)
        hidden[0, length - valid :] = tokens.to(device, dtype)
        mask = torch.zeros(1, length, dtype=torch.long, device=device)
        mask[0, length - valid :] = 1
        video, audio, mask = self.connectors(hidden, mask, padding_side="left")
        return (
            video[0].to(self.device, self.dtype),
            audio[0].to(self.device, self.dtype),
            mask[0].to(self.device, torch.bool),
        )


def build_real_ltx2(device: torch.device | str, layers: int = 48, **clip) -> LTX2:
    """LTX-2.3 at real size with random bf16 weights and a stub Gemma 3 (StubTextLTX2); `clip` (num_frames,
    frame_rate, height, width) overrides experiments/ltx2_ocr.py's recipe clip (81 frames of 256x384 at 24 fps).

    Configs: diffusers' scripts/convert_ltx2_to_diffusers.py, version "2.3" (model id Lightricks/LTX-2.3):
    transformer 48 blocks, video 32 heads x 128 (cross-attention 4096), audio 32 heads x 64 (2048), 128 video and
    128 audio input channels, gated attention and prompt modulation in both streams, split RoPE, no caption
    projection (per-modality projections in the connectors), perturbed-attention weights; connectors 8 + 8
    layers (video 32 x 128, audio 32 x 64), 128 learnable registers, per-modality projections to 4096 / 2048;
    video VAE 128 latent channels, 32x spatial and 8x temporal compression, encoder blocks (256, 512, 1024, 1024),
    decoder blocks (256, 512, 512, 1024); audio VAE as LTX-2.0 (8 latent channels, 64 mel bins, 16 kHz, hop 160);
    vocoder with bandwidth extension to 48 kHz (LTX2VocoderWithBWE's defaults = that version's values).
    Not confirmed here: the video VAE's timestep_conditioning and scaling_factor (the converter takes the first
    as a flag, off by default; the second is left at diffusers' 1.0) and the latent statistics (random weights
    anyway: zeros / ones here); the clip is the recipe's (verl-omni's LTX-2.3 example), not LTX2Pipeline's default.
    """
    from diffusers.models.autoencoders.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
    from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import AutoencoderKLLTX2Audio
    from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    with real_size(device):
        transformer = LTX2VideoTransformer3DModel(
            num_layers=layers,
            gated_attn=True,
            cross_attn_mod=True,
            audio_gated_attn=True,
            audio_cross_attn_mod=True,
            rope_type="split",
            use_prompt_embeddings=False,
            perturbed_attn=True,
        )  # the rest = diffusers' defaults, which equal the "2.3" conversion config
        connectors = LTX2TextConnectors(
            caption_channels=GEMMA_WIDTH,
            text_proj_in_factor=GEMMA_STATES,
            video_connector_num_attention_heads=32,
            video_connector_attention_head_dim=128,
            video_connector_num_layers=8,
            video_connector_num_learnable_registers=128,
            video_gated_attn=True,
            audio_connector_num_attention_heads=32,
            audio_connector_attention_head_dim=64,
            audio_connector_num_layers=8,
            audio_connector_num_learnable_registers=128,
            audio_gated_attn=True,
            connector_rope_base_seq_len=4096,
            rope_type="split",
            per_modality_projections=True,
            video_hidden_dim=4096,
            audio_hidden_dim=2048,
            proj_bias=True,
        )
        vae = AutoencoderKLLTX2Video(
            block_out_channels=(256, 512, 1024, 1024),
            decoder_block_out_channels=(256, 512, 512, 1024),
            layers_per_block=(4, 6, 4, 2, 2),
            decoder_layers_per_block=(4, 6, 4, 2, 2),
            decoder_spatio_temporal_scaling=(True, True, True, True),
            decoder_inject_noise=(False,) * 5,
            upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
            upsample_residual=(False,) * 4,
            upsample_factor=(2, 2, 1, 2),
            decoder_causal=False,
            decoder_spatial_padding_mode="zeros",
            spatial_compression_ratio=32,
            temporal_compression_ratio=8,
        )
        audio_vae = AutoencoderKLLTX2Audio()
        vocoder = LTX2VocoderWithBWE()
    clip = {**clip_kwargs(recipe("ltx2").model), **clip}
    return StubTextLTX2.from_modules(
        transformer, vae, audio_vae, vocoder, connectors, None, None, device=device, **clip
    )


class StubTextSD3(SD3):
    """SD3.5 whose prompt encoder returns random embeddings of the real shapes (no CLIP-L/G, no T5-XXL):
    77 CLIP + 256 T5 tokens of width 4096 and a pooled vector of 2048, as StableDiffusion3Pipeline makes."""

    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(sample_seed(len(prompt), *map(ord, prompt[:32])))
        cfg: Any = self.transformer.config
        embeds = torch.randn(77 + self.max_sequence_length, cfg.joint_attention_dim, generator=gen)
        pooled = torch.randn(cfg.pooled_projection_dim, generator=gen)
        return embeds.to(self.device, self.dtype), pooled.to(self.device, self.dtype)


def build_real_sd3(device: torch.device, layers: int = 24) -> SD3:
    """SD3.5-Medium at real size with random bf16 weights (stabilityai/stable-diffusion-3.5-medium's transformer
    and VAE configs: 24 MMDiT-X blocks, dual attention in the first 13, qk RMS-norm; 16-channel VAE) and stub
    text encoders."""
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

    with real_size(device):
        transformer = SD3Transformer2DModel(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            num_layers=layers,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=384,
            dual_attention_layers=tuple(range(min(13, layers))),
            qk_norm="rms_norm",
        )
        # diffusers annotates the block tuples as 1-tuples (tuple[str]); they take one entry per level
        vae_config: dict[str, Any] = dict(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            latent_channels=16,
            shift_factor=0.0609,
            scaling_factor=1.5305,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        vae = AutoencoderKL(**vae_config)
    unused = [torch.nn.Identity(), torch.nn.Identity(), None]  # the stub encodes; CLIPs are never called
    return StubTextSD3.from_modules(transformer, vae, unused, [None, None, None], device=device)


class StubTextFlux(Flux):
    """FLUX.1 whose prompt encoder returns random embeddings of the real shapes (no CLIP-L, no T5-XXL): 512 T5
    tokens of width 4096 and CLIP's pooled vector of 768, as FluxPipeline makes."""

    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(sample_seed(len(prompt), *map(ord, prompt[:32])))
        cfg: Any = self.transformer.config
        embeds = torch.randn(self.max_sequence_length, cfg.joint_attention_dim, generator=gen)
        pooled = torch.randn(cfg.pooled_projection_dim, generator=gen)
        return embeds.to(self.device, self.dtype), pooled.to(self.device, self.dtype)


# FLUX.1's VAE (black-forest-labs/FLUX.1-dev vae/config.json): 16 latent channels, no quant convs; Z-Image's row
# builds its VAE at these sizes too (not checked against its checkpoint)
FLUX_VAE: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=16,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


def build_real_flux(device: torch.device | str, layers: int = 19) -> Flux:
    """FLUX.1-dev at real size with random bf16 weights (black-forest-labs/FLUX.1-dev's transformer and VAE configs:
    19 joint and 38 single-stream blocks of 24 heads x 128, the guidance embedding; 16-channel VAE without quant
    convs) and stub text encoders. `layers` joint blocks come with twice as many single ones."""
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel

    with real_size(device):
        # diffusers' defaults are FLUX.1's sizes; FLUX.1-dev adds the guidance embedding
        transformer = FluxTransformer2DModel(
            num_layers=layers, num_single_layers=2 * layers, guidance_embeds=True
        )
        vae = AutoencoderKL(**FLUX_VAE)
    unused = [torch.nn.Identity(), torch.nn.Identity()]  # the stub encodes; CLIP and T5 are never called
    return StubTextFlux.from_modules(transformer, vae, unused, [None, None], device=device)


class StubTextFlux2(Flux2):
    """FLUX.2 whose prompt encoder returns random embeddings of the transformer's text width (no Qwen3): the
    pipeline's 512 padded tokens."""

    def _encode_one(self, prompt: str) -> tuple[torch.Tensor]:
        gen = torch.Generator().manual_seed(sample_seed(len(prompt), *map(ord, prompt[:32])))
        cfg: Any = self.transformer.config
        embeds = torch.randn(self.max_sequence_length, cfg.joint_attention_dim, generator=gen)
        return (embeds.to(self.device, self.dtype),)


def build_real_flux2(device: torch.device | str, layers: int = 5) -> Flux2:
    """FLUX.2 [klein] base 4B's transformer (5 joint and 20 single-stream blocks of 24 heads x 128, MLP ratio 3, text
    width 7680 = three stacked Qwen3-4B layers of 2560, no guidance embedding: the published klein 4B config) with
    random bf16 weights, the 32-channel AutoencoderKLFlux2 at its defaults and a stub text encoder. `layers` joint
    blocks come with four times as many single ones."""
    from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel

    with real_size(device):
        transformer = Flux2Transformer2DModel(
            num_layers=layers,
            num_single_layers=4 * layers,
            num_attention_heads=24,
            attention_head_dim=128,
            joint_attention_dim=7680,
            mlp_ratio=3.0,
            guidance_embeds=False,
        )
        vae = AutoencoderKLFlux2()
    return StubTextFlux2.from_modules(transformer, vae, None, None, device=device)


def build_real_flux2_dev(device: torch.device | str, layers: int = 8) -> Flux2:
    """FLUX.2 [dev]'s transformer (8 joint and 48 single-stream blocks of 48 heads x 128 = 6144, MLP ratio 3, text
    width 15360 = three stacked Mistral-Small-3.1 layers of 5120, guidance embedding: the published FLUX.2-dev config,
    which is diffusers' Flux2Transformer2DModel default) with random bf16 weights, the 32-channel AutoencoderKLFlux2
    at its defaults and a stub text encoder. `layers` joint blocks come with six times as many single ones."""
    from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel

    with real_size(device):
        transformer = Flux2Transformer2DModel(
            num_layers=layers,
            num_single_layers=6 * layers,
            num_attention_heads=48,
            attention_head_dim=128,
            joint_attention_dim=15360,
            mlp_ratio=3.0,
            guidance_embeds=True,
        )
        vae = AutoencoderKLFlux2()
    return StubTextFlux2.from_modules(transformer, vae, None, None, device=device)


class StubTextZImage(ZImage):
    """Z-Image whose prompt encoder returns random embeddings of the real width (the transformer's cap_feat_dim) and a
    templated prompt's length (about 20 + the prompt's words tokens; no Qwen3)."""

    def _encode_one(self, prompt: str) -> tuple[torch.Tensor]:
        gen = torch.Generator().manual_seed(sample_seed(len(prompt), *map(ord, prompt[:32])))
        cfg: Any = self.transformer.config
        embeds = torch.randn(20 + len(prompt.split()), cfg.cap_feat_dim, generator=gen)
        return (embeds.to(self.device, self.dtype),)


def build_real_zimage(device: torch.device | str, layers: int = 30) -> ZImage:
    """Z-Image at real size with random bf16 weights (ZImageTransformer2DModel's defaults: `layers` main blocks of
    30 heads x 128 and two refiner blocks each for image and text, text width 2560; a 16-channel AutoencoderKL at
    FLUX.1's VAE sizes) and a stub text encoder."""
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel

    with real_size(device):
        transformer = ZImageTransformer2DModel(n_layers=layers)
        vae = AutoencoderKL(**FLUX_VAE)
    return StubTextZImage.from_modules(transformer, vae, torch.nn.Identity(), None, device=device)


class StubTextWan(Wan):
    """Wan whose prompt encoder returns random embeddings of the real shape (the pipeline's 512 padded UMT5 rows of
    the transformer's text_dim, zero past the prompt's words; no UMT5)."""

    def _encode_one(self, prompt: str) -> tuple[torch.Tensor]:
        gen = torch.Generator().manual_seed(sample_seed(len(prompt), *map(ord, prompt[:32])))
        cfg: Any = self.transformer.config
        embeds = torch.zeros(self.max_sequence_length, cfg.text_dim)
        n = min(self.max_sequence_length, 2 + len(prompt.split()))
        embeds[:n] = torch.randn(n, cfg.text_dim, generator=gen)
        return (embeds.to(self.device, self.dtype),)


def build_real_wan(device: torch.device | str, layers: int = 30, num_frames: int = 41) -> Wan:
    """Wan 2.2 TI2V-5B at real size with random bf16 weights (its transformer config: `layers` blocks of 24 heads x
    128, FFN 14336, text width 4096, 48 latent channels; the Wan 2.2 VAE: base 160 / decoder 256, z 48, 16x spatial
    and 4x temporal, patchified 2x2; flow shift 5, one timestep per token) and a stub text encoder."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    with real_size(device):
        transformer = WanTransformer3DModel(
            num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48, ffn_dim=14336,
            num_layers=layers,
        )  # fmt: skip
        vae = AutoencoderKLWan(
            base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
            patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4, dim_mult=[1, 2, 4, 4],
            temperal_downsample=[False, True, True], latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
        )  # fmt: skip
    return StubTextWan.from_modules(
        transformer,
        vae,
        None,
        None,
        expand_timesteps=True,
        flow_shift=5.0,
        num_frames=num_frames,
        device=device,
    )


def build_real_wan_a14b(device: torch.device | str, layers: int = 40, num_frames: int = 5) -> Wan:
    """Wan 2.2 T2V-A14B at real size with random bf16 weights: two experts of the published transformer config
    (`layers` blocks of 40 heads x 128 = 5120 wide, FFN 13824, text width 4096, 16 latent channels; ~14 B and ~28 GB
    in bf16 each), the high-noise one at t >= 875 (boundary_ratio 0.875), the Wan 2.1 VAE (diffusers' defaults: base
    96, z 16, 8x spatial and 4x temporal), a flow shift of 3, and a stub text encoder. docs/models.md has the memory
    plan."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    with real_size(device):
        experts = [
            WanTransformer3DModel(
                num_attention_heads=40,
                attention_head_dim=128,
                in_channels=16,
                out_channels=16,
                ffn_dim=13824,
                num_layers=layers,
            )  # fmt: skip
            for _ in range(2)
        ]
        vae = AutoencoderKLWan()
    return StubTextWan.from_modules(
        experts[0],
        vae,
        None,
        None,
        transformer_2=experts[1],
        boundary_ratio=0.875,
        flow_shift=3.0,
        num_frames=num_frames,
        device=device,
    )


def build_real_bagel(device: torch.device | str, layers: int = 28) -> Bagel:
    """BAGEL-7B-MoT at real size with random bf16 weights (BagelTransformer's defaults: `layers` MoT layers of
    3584 wide, 28 heads x 128 over 4 key/value heads, both experts: 7 B active, 14 B in all; FLUX.1's VAE sizes) and
    the tiny Qwen tokenizer (the prompt's KV comes from the real-size understanding experts)."""
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL

    from fgrpo.models.bagel_mot import BagelTransformer
    from fgrpo.models.qwen_image_edit import EDIT_PROMPT_DROP, EDIT_PROMPT_TEMPLATE
    from fgrpo.models.tiny import tiny_qwen_tokenizer

    with real_size(device):
        transformer = BagelTransformer(num_hidden_layers=layers)
        vae = AutoencoderKL(**FLUX_VAE)
    tokenizer = tiny_qwen_tokenizer(EDIT_PROMPT_TEMPLATE, EDIT_PROMPT_DROP)  # has BAGEL's vision markers
    return Bagel.from_modules(transformer, vae, tokenizer, device=device)


def _real_size_text_encoder():
    """Random Qwen2.5-VL-7B text tower (the vision tower shrunk: it is never run) + the offline tokenizer."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from fgrpo.models.tiny import tiny_qwen_tokenizer

    text = dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        rope_theta=1e6,
        rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    )
    vision = dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2, out_hidden_size=3584)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    return Qwen2_5_VLForConditionalGeneration(config), tiny_qwen_tokenizer()


def recipe(model: str, preset: str = ""):
    """The recipe Config of family `model`'s experiment file (its registry entry's recipe and preset), or another
    preset function of that file (`a14b`): the values the benchmark rows use."""
    family = FAMILIES[model]
    return getattr(load_script(family.recipe), preset or family.preset)()


def condition_folder() -> Path:
    """Where this process writes its synthesised condition images (removed at exit)."""
    folder = tempfile.mkdtemp(prefix="fgrpo_bench_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return Path(folder)


def audio_sink(model):
    """LTX-2: a reward sink that takes each micro-batch's frames and waveforms, so the rollout decodes the audio
    as it does for the trainer's reward stream (reward_metadata); None for image models (frames only)."""
    return (lambda rows, images, metadata: None) if isinstance(model, LTX2) else None


def forward_tflop(model, prompt: str, height: int, width: int) -> float:
    """TFLOP of one transformer forward of one sample (no CFG) at height x width (LTX-2: one clip of the model's
    frames) with `prompt`'s conditioning, counted by torch's flop counter (matmuls and attention) on the model.

    The count runs eagerly: dynamo does not trace under the counter (a dispatch mode), and a compiled block it is
    asked to trace there is skipped for the rest of the process, so every later no-grad forward would run eager."""
    from torch.utils.flop_counter import FlopCounterMode

    device = module_device(model.transformer)
    x = torch.zeros(1, *model.latent_shape(height, width), device=device)
    cond = model.encode([prompt])
    counter = FlopCounterMode(display=False)
    with torch.compiler.set_stance("force_eager"), torch.no_grad(), counter:
        model.velocity(x, torch.full((1,), 0.5, device=device), cond, guidance_scale=1.0)
    return counter.get_total_flops() / 1e12


def prompts_for(batch: int, group: int, run: int) -> list[str]:
    """B prompts in groups of G; fresh strings per run so prompt encoding is part of every rollout."""
    texts = [
        f"run {run:03d} prompt {p:03d}: a storefront sign that says OPEN 24 HOURS in neon"
        for p in range(batch)
    ]
    return [texts[i // group] for i in range(batch)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(
    model, cfg: SamplingConfig, batch: int, group: int, run: int, device, condition_dir: Path | None = None
) -> dict:
    engine = DiffusersEngine(model)
    prompts = prompts_for(batch, group, run)
    if condition_dir is not None:  # an edit model: each prompt with its condition image
        prompts = edit_prompts(prompts, condition_dir, cfg.height)
    seeds = [sample_seed(run, i) for i in range(batch)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    traj = engine.generate(prompts, seeds, cfg, on_images=audio_sink(model))
    sync(device)
    total = time.perf_counter() - t0
    # The decode share, to report transformer-only time per forward.
    x0 = torch.randn(batch, *model.latent_shape(cfg.height, cfg.width), device=device)
    sync(device)
    t0 = time.perf_counter()
    model.decode(x0, cfg.height, cfg.width)
    sync(device)
    decode = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    assert traj.images.shape[0] == batch
    return {
        "total": total,
        "decode": decode,
        "peak_gib": peak,
        "finite": bool(torch.isfinite(traj.log_prob).all()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default="qwen_image",
        choices=[
            "qwen_image",
            "qwen_image_edit",
            "ltx2",
            "flux",
            "flux2",
            "flux2_dev",
            "zimage",
        ],  # the families with a real-size builder here
        help="qwen_image (the rows above), qwen_image_edit, ltx2, flux, flux2, flux2_dev or zimage (their experiment "
        "recipes' sampling)",
    )
    ap.add_argument("--tiny", action="store_true", help="tiny random model on the CPU (script check)")
    ap.add_argument("--batch-sizes", default="", help="comma-separated B (default 8,16,32; tiny: 2,4)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt G")
    ap.add_argument("--steps", type=int, default=0, help="denoising steps (0 = 10; the recipe's: 12 / 24)")
    ap.add_argument("--cfg", type=float, default=0.0, help="CFG scale (0 = 4, the recipes' too; 1 = no CFG)")
    ap.add_argument(
        "--resolution", type=int, default=0, help="pixels (default 512; tiny: 64); LTX-2: the model's clip"
    )
    ap.add_argument(
        "--modes",
        default="eager,compile",
        help="eager and/or compile (regional: the blocks; and the VAE decoder)",
    )
    ap.add_argument("--attention-backend", default="", help="diffusers attention backend name; '' = SDPA")
    ap.add_argument("--text-encoder", action="store_true", help="random real-size Qwen2.5-VL instead of stub")
    ap.add_argument(
        "--layers",
        type=int,
        default=0,
        help="transformer blocks of the real-size model (0 = all: 60 / 48 / FLUX 19 joint / Z-Image 30)",
    )
    ap.add_argument("--device", default="", help="default: cuda (tiny: cpu)")
    ap.add_argument(
        "--budget-min", type=float, default=8.0, help="skip remaining rows after this many minutes"
    )
    args = ap.parse_args()

    if args.model == "ltx2" and args.resolution:
        raise SystemExit(
            "--resolution: an LTX-2 model fixes its clip size (256x384 real, 32x32 tiny); leave it out"
        )
    if args.text_encoder and args.model != "qwen_image":
        raise SystemExit("--text-encoder: only for --model qwen_image (the others run stub text encoders)")
    start = time.perf_counter()
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    batches = [int(b) for b in (args.batch_sizes or ("2,4" if args.tiny else "8,16,32")).split(",")]
    res = args.resolution or (64 if args.tiny else 512)
    steps, guidance = args.steps or 10, args.cfg or 4.0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.tiny and "compile" in modes and args.modes == ap.get_default("modes"):
        modes = ["eager"]  # inductor on this CPU takes minutes per shape; ask for it explicitly
    torch.backends.cuda.matmul.allow_tf32 = True
    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64

    if args.tiny:
        model = cast(
            QwenImage | LTX2 | Flux | Flux2 | ZImage, build_tiny(args.model)
        )  # the tiny version of one of these families
    elif args.model == "qwen_image":
        model = build_real(device, args.text_encoder, args.layers or 60)
    elif args.model == "qwen_image_edit":
        model = build_real_qwen_image_edit(device, args.layers or 60)
    elif args.model == "flux":
        model = build_real_flux(device, args.layers or 19)
    elif args.model == "flux2":
        model = build_real_flux2(device, args.layers or 5)
    elif args.model == "flux2_dev":
        model = build_real_flux2_dev(device, args.layers or 8)
    elif args.model == "zimage":
        model = build_real_zimage(device, args.layers or 30)
    else:
        model = build_real_ltx2(device, args.layers or 48)
    if args.attention_backend:
        configure_transformer(model.transformer, attention_backend=args.attention_backend)
    n_params = sum(p.numel() for p in model.transformer.parameters())
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    condition_dir = condition_folder() if isinstance(model, QwenImageEdit) else None
    if args.model == "qwen_image":
        print(
            f"# Qwen-Image rollout: transformer {n_params / 1e9:.2f}B params {model.dtype}, {res}x{res}, "
            f"{steps} steps, CFG {guidance}, G={args.group}, device={device_name}, "
            f"torch {torch.__version__}, built in {time.perf_counter() - start:.0f}s"
        )
        cfg = SamplingConfig(
            height=res, width=res, num_steps=steps, guidance_scale=guidance, negative_prompt=" ",
            window_size=2, window_range=(0, min(5, steps)), micro_batch=max(batches),
        )  # fmt: skip
        tflop_per_forward = TFLOP_PER_FORWARD_512 * (res / 512) ** 2  # attention's quadratic part ignored
    else:
        rec = recipe(args.model).sampling
        steps, guidance = args.steps or rec.num_steps, args.cfg or rec.guidance_scale
        height, width = (model.height, model.width) if isinstance(model, LTX2) else (res, res)
        # fewer --steps than the recipe: the window stops before the last step, where CPS has no noise
        cfg = dataclasses.replace(
            rec, height=height, width=width, num_steps=steps, guidance_scale=guidance,
            window_range=(rec.window_range[0], min(rec.window_range[1], steps - 1)), micro_batch=max(batches),
        )  # fmt: skip
        probe = prompts_for(1, 1, 0)
        if condition_dir is not None:
            probe = edit_prompts(probe, condition_dir, height)
        tflop_per_forward = forward_tflop(model, probe[0], height, width)
        clip = f", {model.num_frames} frames at {model.frame_rate:g} fps" if isinstance(model, LTX2) else ""
        print(
            f"# {args.model} rollout: transformer {n_params / 1e9:.2f}B params {model.dtype}, {height}x{width}{clip}, "
            f"{steps} steps, CFG {guidance}, {cfg.sde_kind} window {cfg.window_size} of {cfg.window_range}, "
            f"G={args.group}, {tflop_per_forward:.2f} TFLOP per forward, device={device_name}, "
            f"torch {torch.__version__}, built in {time.perf_counter() - start:.0f}s"
        )
    forwards = (
        getattr(model, "cfg_forwards", 2) if guidance > 1 else 1
    )  # FLUX.1-dev: the guidance is an input

    per_s = "vid/s" if isinstance(model, LTX2) else "img/s"
    header = f"{'mode':8} {'B':>3} {per_s:>7} {'ms/sample-step':>15} {'ms/forward':>11} {'TFLOP/s':>8} {'decode s':>9} {'peak GiB':>9} {'total s':>8}"
    rows = []
    run = 0
    fullgraph_failed = False
    for mode in modes:
        if mode == "compile":
            try:
                configure_transformer(model.transformer, compile_blocks=True)
                compile_decoder(model)  # as model.compile
            except Exception as e:  # keep the eager rows even if this torch cannot compile the blocks
                rows.append(f"compile  failed: {type(e).__name__}: {e}"[:200])
                continue
        for batch in batches:
            if time.perf_counter() - start > args.budget_min * 60:
                rows.append(f"{mode:8} {batch:>3} skipped (time budget --budget-min {args.budget_min})")
                continue
            c = SamplingConfig(**{**cfg.__dict__, "micro_batch": batch})
            # a short rollout with the same window; one step after it, as CPS has no noise on the final step
            W = c.window_size
            warm = dataclasses.replace(c, num_steps=W + 1, window_range=(0, W))
            try:
                run += 1
                try:
                    # compile / allocator warm-up
                    run_one(model, warm, batch, args.group, run, device, condition_dir)
                except Exception as e:
                    if mode != "compile" or fullgraph_failed:
                        raise
                    # A graph break somewhere in the block: compile the pieces between breaks instead.
                    fullgraph_failed = True
                    print(
                        f"# fullgraph compile failed ({type(e).__name__}: {str(e)[:120]}); retrying fullgraph=False"
                    )
                    model.transformer.compile_repeated_blocks(fullgraph=False)
                    run_one(model, warm, batch, args.group, run, device, condition_dir)
                run += 1
                r = run_one(model, c, batch, args.group, run, device, condition_dir)
            except Exception as e:
                rows.append(f"{mode:8} {batch:>3} failed: {type(e).__name__}: {e}"[:200])
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            sample_steps = batch * steps
            tflops = sample_steps * forwards * tflop_per_forward / r["total"]
            ms_fwd = (r["total"] - r["decode"]) * 1e3 / (sample_steps * forwards)
            rows.append(
                f"{mode:8} {batch:>3} {batch / r['total']:>7.2f} {r['total'] * 1e3 / sample_steps:>15.1f} "
                f"{ms_fwd:>11.1f} {tflops if not args.tiny else float('nan'):>8.1f} {r['decode']:>9.2f} "
                f"{r['peak_gib']:>9.1f} {r['total']:>8.2f}"
                + ("" if r["finite"] else "  (non-finite log-probs)")
            )
            print(rows[-1], flush=True)
    print()
    print(header)
    for r in rows:
        print(r)
    print(f"# wall {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
