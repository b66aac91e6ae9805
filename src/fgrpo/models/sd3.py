"""Stable Diffusion 3 / 3.5 behind the FlowModel interface, built from diffusers' and transformers' classes.

Text: CLIP-L and CLIP-G (penultimate hidden states, concatenated on features, zero-padded to T5's width)
followed on the sequence axis by T5-XXL's states; the pooled embedding is both CLIPs' projected
outputs concatenated (StableDiffusion3Pipeline's recipe). Image: AutoencoderKL latents [16, H/8, W/8],
scaled by (z - shift_factor) * scaling_factor; SD3Transformer2DModel patchifies them itself.

Differs from StableDiffusion3Pipeline: each distinct prompt is encoded alone and cached (an encoding
never depends on its batch-mates), and skip-layer guidance is not supported (plain CFG only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from fgrpo.core import guidance, schedule
from fgrpo.models.base import Cond
from fgrpo.models.common import (
    OnTransformer,
    PromptCache,
    check_resolution,
    complete_scheduler_config,
    decode_scaled_latents,
    freeze,
    module_device,
)

CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 256
# stabilityai/stable-diffusion-3.5-{medium,large}'s scheduler/scheduler_config.json, the keys that differ from
# FlowMatchEulerDiscreteScheduler's defaults. A loaded model reads its own file; a model built in code uses this.
SCHEDULER_CONFIG: dict[str, Any] = {"shift": 3.0}


# The transformer's Linear layers that LoRA adapts: q/k/v/out of the joint attention, image and text stream (the
# second attention of SD3.5's first blocks, `attn2`, is left out).
SD3_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


class SD3(OnTransformer):
    """SD3.x (two CLIPs, optional T5, transformer, VAE) as a FlowModel. Weights are frozen."""

    def __init__(
        self,
        transformer: SD3Transformer2DModel,
        vae: AutoencoderKL,
        text_encoders: Sequence[torch.nn.Module | None],
        tokenizers: Sequence,
        *,
        scheduler_config: Mapping[str, Any] = SCHEDULER_CONFIG,
        max_sequence_length: int = T5_MAX_LENGTH,
        prompt_cache_size: int = 1024,
    ):
        if len(text_encoders) != 3 or len(tokenizers) != 3:
            raise ValueError(
                "SD3 needs three text encoders and tokenizers (CLIP-L, CLIP-G, T5; T5 may be None)"
            )
        clip_l, clip_g, t5 = text_encoders
        if clip_l is None or clip_g is None:
            raise ValueError("SD3 needs the CLIP-L and CLIP-G text encoders; only T5 may be None")
        self.transformer = transformer
        self.vae = vae
        self.clips, self.t5 = (clip_l, clip_g), t5
        self.tokenizers = list(tokenizers)
        self.shift = complete_scheduler_config(scheduler_config)["shift"]
        self.max_sequence_length = max_sequence_length
        # diffusers annotates ConfigMixin.config as dict[str, Any]; it is a FrozenDict with attribute access.
        tcfg: Any = transformer.config
        vcfg: Any = vae.config
        self.vae_scale = 2 ** (len(vcfg.block_out_channels) - 1)
        self.patch = tcfg.patch_size
        self.latent_channels = tcfg.in_channels
        self.joint_dim = tcfg.joint_attention_dim
        self.prompt_cache = PromptCache(self._encode_one, prompt_cache_size)

    # ------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        text_encoder_dtype: torch.dtype | None = None,
        load_t5: bool = True,
        **kwargs,
    ) -> SD3:
        """Load a diffusers-format SD3.x directory or hub id (e.g. stabilityai/stable-diffusion-3.5-medium)."""
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        path, tdtype = str(path), text_encoder_dtype or dtype
        transformer = SD3Transformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype)
        encoders = [
            CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder", dtype=tdtype),
            CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder_2", dtype=tdtype),
            T5EncoderModel.from_pretrained(path, subfolder="text_encoder_3", dtype=tdtype)
            if load_t5
            else None,
        ]
        # AutoTokenizer: CLIP/T5 for the real checkpoints, whatever class a saved tiny pipeline recorded.
        tokenizers = [
            AutoTokenizer.from_pretrained(path, subfolder=s)
            for s in ("tokenizer", "tokenizer_2", "tokenizer_3")
        ]
        scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler")
        return cls.from_modules(
            transformer, vae, encoders, tokenizers, device=device, scheduler_config=scheduler_config, **kwargs
        )

    @classmethod
    def from_modules(cls, transformer, vae, text_encoders, tokenizers, *, device=None, **kwargs) -> SD3:
        """Freeze the modules (eval mode, no grads), move them to `device`, wrap them."""
        freeze(transformer, vae, *text_encoders, device=device)
        return cls(transformer, vae, text_encoders, tokenizers, **kwargs)

    # ------------------------------------------------------------------------------------------------
    def _clip(self, i: int, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        tok, enc = self.tokenizers[i], self.clips[i]
        ids = tok(
            [prompt], padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True, return_tensors="pt"
        )
        out = enc(ids.input_ids.to(module_device(enc)), output_hidden_states=True)
        return out.hidden_states[-2][0], out[0][0]  # [77, D_i] penultimate layer, [P_i] projected pooled

    def _t5(self, prompt: str) -> torch.Tensor:
        enc = self.t5
        if enc is None:  # SD3 runs without T5 on zeros, as the pipeline does
            return torch.zeros(self.max_sequence_length, self.joint_dim)
        ids = self.tokenizers[2](
            [prompt],
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        return enc(ids.input_ids.to(module_device(enc)))[0][0]  # [T, D_t5]

    @torch.no_grad()
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One prompt -> (tokens [77 + T, D] , pooled [P_l + P_g]) in the transformer's dtype."""
        (h_l, p_l), (h_g, p_g) = self._clip(0, prompt), self._clip(1, prompt)
        t5 = self._t5(prompt).to(h_l.device)
        clip = torch.cat([h_l, h_g.to(h_l.dtype)], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        embeds = torch.cat([clip.to(t5.dtype), t5], dim=0)
        pooled = torch.cat([p_l, p_g.to(p_l.dtype)], dim=-1)
        return embeds.to(self.device, self.dtype), pooled.to(self.device, self.dtype)

    def encode(self, prompts: Sequence[str], *, negative_prompt: str | None = None) -> Cond:
        if len(prompts) == 0:
            raise ValueError("prompts is empty; pass at least one prompt")
        enc = [self.prompt_cache(p) for p in prompts]
        cond = {"prompt_embeds": torch.stack([e for e, _ in enc]), "pooled": torch.stack([p for _, p in enc])}
        if negative_prompt is not None:
            neg, neg_pooled = self.prompt_cache(negative_prompt)
            B = len(prompts)
            cond["neg_prompt_embeds"] = neg[None].expand(B, -1, -1)
            cond["neg_pooled"] = neg_pooled[None].expand(B, -1)
        return cond

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        check_resolution("SD3", height, width, self.vae_scale * self.patch)
        return (self.latent_channels, height // self.vae_scale, width // self.vae_scale)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        self.latent_shape(height, width)
        return schedule.sd3_sigmas(num_steps, shift=self.shift)

    def sigmas_at(self, num_steps: int, height: int, width: int, positions: torch.Tensor) -> torch.Tensor:
        self.latent_shape(height, width)
        return schedule.sd3_sigmas_at(positions, num_steps, shift=self.shift)

    def velocity(
        self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Cond, *, guidance_scale: float
    ) -> torch.Tensor:
        """v(x_t, sigma) [B, C, h, w] fp32; plain CFG when guidance_scale > 1 (one batched forward)."""
        B = x_t.shape[0]
        sigma = torch.as_tensor(sigma, device=x_t.device).float().expand(B)
        embeds, pooled, x = cond["prompt_embeds"], cond["pooled"], x_t
        do_cfg = guidance_scale > 1.0
        if do_cfg:
            if "neg_prompt_embeds" not in cond:
                raise ValueError(f"guidance_scale={guidance_scale} > 1 needs a negative prompt in cond")
            # [negative; positive], the pipeline's order.
            embeds = torch.cat([cond["neg_prompt_embeds"], embeds])
            pooled = torch.cat([cond["neg_pooled"], pooled])
            x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
        dtype = self.dtype
        out = self.transformer(
            hidden_states=x.to(dtype),
            timestep=sigma * 1000,  # SD3 embeds the timestep on the 0..1000 scale (the scheduler's t)
            encoder_hidden_states=embeds.to(dtype),
            pooled_projections=pooled.to(dtype),
            return_dict=False,
        )[0].float()
        if do_cfg:
            v_uncond, v_cond = out.chunk(2)
            out = guidance.cfg(v_cond, v_uncond, guidance_scale)
        return out

    @torch.no_grad()
    def decode(self, x0: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Clean latents [B, C, h, w] -> uint8 [B, H, W, 3]."""
        return decode_scaled_latents(self.vae, x0)
