"""Wan 2.2 text-to-video (TI2V-5B and T2V-A14B) behind the FlowModel interface, from diffusers' own classes.

Text: UMT5 reads the cleaned prompt (WanPipeline's prompt_clean), padded to `max_sequence_length` tokens (the
pipeline's call default, 512) with its mask; the embeddings at the real tokens are kept and the rest set to zero, and
the transformer cross-attends to all `max_sequence_length` rows unmasked (WanPipeline._get_t5_prompt_embeds), so the
zero rows are part of the conditioning and are kept.
Video: AutoencoderKLWan latents [z_dim, F', H / s, W / s] with F' = (F - 1) / t + 1 (t, s: the VAE config's
scale_factor_temporal / scale_factor_spatial: 4 / 16 for the Wan 2.2 VAE of the 5B, z_dim 48; 4 / 8 for the Wan 2.1
VAE of the A14B, z_dim 16), patchified 1x2x2 by the transformer; decode maps z -> z * std + mean per channel first.
The frame count is the model's (model.num_frames of WanConfig), fixed when it is built.

Two variants, one class:
- TI2V-5B: one transformer; its pipeline's `expand_timesteps` gives the transformer one timestep per latent token
  (all equal in text-to-video).
- T2V-A14B: two experts, `transformer` for high noise and `transformer_2` for low noise. WanPipeline runs
  `transformer` at scheduler timesteps t >= boundary_ratio * num_train_timesteps and `transformer_2` below, with
  guidance_scale and guidance_scale_2. `velocity` makes the same comparison on t = sigma * 1000 in fp32, the
  flow-match scheduler's own timestep, so the rollout and the training recompute (same sigma) run the same expert.

Schedule: WanPipeline's scheduler config is UniPC with flow sigmas and a static `flow_shift`; our sampler is an
Euler / SDE step, so the grid is FlowMatchEulerDiscreteScheduler's with shift = flow_shift (core.schedule.sd3_sigmas),
the pipeline's sampler when that scheduler is swapped in (the parity tests do so).

Differs from WanPipeline:
- Each distinct prompt is encoded alone and cached (padding masked in UMT5, so the rows equal the batched ones).
- CFG runs the positive and negative halves in one batched forward (float rounding only).
- An Euler / SDE sampler on the flow-match grid instead of UniPC's multistep solver.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch

from fgrpo.config import ModelConfig
from fgrpo.core import guidance, schedule
from fgrpo.errors import ConfigError
from fgrpo.models.base import Cond
from fgrpo.models.common import (
    OnTransformer,
    PromptCache,
    check_resolution,
    freeze,
    module_device,
    stacked_prompt_states,
    to_uint8,
)
from fgrpo.models.lora import export_loras
from fgrpo.parallel import any_across_shards

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

# WanPipeline.__call__'s default prompt length (tokens).
MAX_SEQUENCE_LENGTH = 512
# The flow-match scheduler's training timesteps: sigma * 1000 is the transformer's time input and the scale of
# the pipeline's expert boundary.
NUM_TRAIN_TIMESTEPS = 1000
# The transformer's Linear layers that LoRA adapts, in both experts: self- and text cross-attention q/k/v/out and
# the feed-forward, as Flow-Factory's Wan 2.x adapter (src/flow_factory/models/wan/wan2_t2v.py,
# `default_target_modules`, applied to `transformer` and `transformer_2`), in diffusers' module names.
WAN_LORA_TARGETS = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
    "ffn.net.0.proj",
    "ffn.net.2",
)


@dataclass(frozen=True)
class WanConfig(ModelConfig):
    """model.kind 'wan' / 'tiny_wan': the generic model fields, the clip length and the second expert's CFG scale."""

    num_frames: int = 81
    """Video frames per clip (4k + 1; WanPipeline's default 81)."""
    guidance_scale_2: float = 0.0
    """CFG scale of the low-noise expert (T2V-A14B); 0 = sampling.guidance_scale, WanPipeline's default."""
    experts: int = 0
    """Transformers: 1 (TI2V-5B) or 2 (T2V-A14B). model.kind 'wan': 0 = model.path's, else checked against it;
    'tiny_wan': 0 = 1."""


class Wan(OnTransformer):
    """Wan 2.2 (UMT5, one or two transformer experts, Wan VAE) as a FlowModel. Weights are frozen; LoRA goes on
    later (on both experts of the A14B: `transformer` and `transformer_2`)."""

    # model.compile leaves the VAE's decoder eager: AutoencoderKLWan decodes one latent frame per call through a
    # cache of causal-conv features (a Python list it mutates), which a compiled decoder would retrace; not measured
    compile_vae_decoder = False

    def __init__(
        self,
        transformer: WanTransformer3DModel,
        vae: AutoencoderKLWan,
        text_encoder: torch.nn.Module | None,
        tokenizer: Any,
        *,
        transformer_2: WanTransformer3DModel | None = None,
        boundary_ratio: float | None = None,
        expand_timesteps: bool = False,
        flow_shift: float,
        num_frames: int = 81,
        guidance_scale_2: float | None = None,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        prompt_cache_size: int = 1024,
    ):
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.vae, self.text_encoder, self.tokenizer = vae, text_encoder, tokenizer
        if (transformer_2 is None) != (boundary_ratio is None):
            raise ValueError(
                "Wan: transformer_2 and boundary_ratio go together (T2V-A14B has both, TI2V-5B neither)"
            )
        # WanPipeline: transformer at t >= this, transformer_2 below (a Python float, compared as the pipeline does)
        self.boundary_timestep = None if boundary_ratio is None else boundary_ratio * NUM_TRAIN_TIMESTEPS
        self.expand_timesteps = expand_timesteps
        self.flow_shift = float(flow_shift)
        self.guidance_scale_2 = guidance_scale_2
        tcfg: Any = transformer.config
        vcfg: Any = vae.config
        self.patch = tuple(tcfg.patch_size)
        if self.patch[0] != 1 or self.patch[1] != self.patch[2]:
            raise ValueError(f"Wan: transformer patch_size {self.patch} is not (1, p, p)")
        self.temporal, self.spatial = vcfg.scale_factor_temporal, vcfg.scale_factor_spatial
        self.latent_channels = vcfg.z_dim
        for t in (transformer, transformer_2):
            ecfg: Any = None if t is None else t.config
            if ecfg is not None and ecfg.in_channels != self.latent_channels:
                raise ValueError(
                    f"transformer in_channels={ecfg.in_channels} != VAE z_dim {self.latent_channels}; "
                    "the transformer and VAE do not belong together"
                )
        if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % self.temporal:
            raise ValueError(
                f"num_frames={num_frames}: Wan needs {self.temporal}k + 1 frames (the VAE's temporal factor), "
                f"e.g. {max(0, round((num_frames - 1) / self.temporal)) * self.temporal + 1}"
            )
        self.num_frames = num_frames
        self.max_sequence_length = max_sequence_length
        self.prompt_cache = PromptCache(self._encode_one, prompt_cache_size)

    # ------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        **kwargs,
    ) -> Self:
        """Load a diffusers-format Wan 2.2 directory or hub id (Wan-AI/Wan2.2-TI2V-5B-Diffusers or
        Wan-AI/Wan2.2-T2V-A14B-Diffusers): its boundary_ratio and expand_timesteps from model_index.json, the
        flow shift from its scheduler config."""
        from diffusers.pipelines.wan.pipeline_wan import WanPipeline

        pipe = WanPipeline.from_pretrained(str(path), dtype=dtype)
        pcfg: Any = pipe.config
        scfg: Any = pipe.scheduler.config
        return cls.from_modules(
            pipe.transformer,
            pipe.vae,
            pipe.text_encoder,
            pipe.tokenizer,
            transformer_2=pipe.transformer_2,
            boundary_ratio=pcfg.boundary_ratio,
            expand_timesteps=bool(pcfg.expand_timesteps),
            flow_shift=scfg.flow_shift,
            device=device,
            **kwargs,
        )

    @classmethod
    def from_modules(
        cls, transformer, vae, text_encoder, tokenizer, *, transformer_2=None, device=None, **kwargs
    ) -> Self:
        """Freeze the modules (eval mode, no grads), move them to `device`, wrap them."""
        freeze(transformer, transformer_2, vae, text_encoder, device=device)
        return cls(transformer, vae, text_encoder, tokenizer, transformer_2=transformer_2, **kwargs)

    @property
    def experts(self) -> tuple[WanTransformer3DModel, ...]:
        """The transformers that LoRA adapts: (transformer,) or (transformer, transformer_2)."""
        return (self.transformer,) if self.transformer_2 is None else (self.transformer, self.transformer_2)

    @property
    def trained_transformers(self) -> dict[str, WanTransformer3DModel]:
        """The experts by attribute name (models.base.trained_transformers): LoRA, FSDP2, the optimizer, checkpoints
        and exports take each of them."""
        return dict(zip(("transformer", "transformer_2"), self.experts))

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor]:
        """One prompt -> UMT5 states [max_sequence_length, D], zero past its real tokens, in the transformer's dtype."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        if self.text_encoder is None:
            raise RuntimeError("this Wan was built without a text encoder; pass one to encode prompts")
        tokens = self.tokenizer(
            [prompt_clean(prompt)],
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        ).to(module_device(self.text_encoder))
        hidden = self.text_encoder(tokens.input_ids, tokens.attention_mask).last_hidden_state[0]
        n = int(tokens.attention_mask[0].sum())
        out = torch.zeros_like(hidden)
        out[:n] = hidden[:n]
        return (out.to(self.device, self.dtype),)

    def encode(self, prompts: Sequence[str], *, negative_prompt: str | None = None) -> Cond:
        """Text states [B, max_sequence_length, D]; with `negative_prompt`, its `neg_prompt_embeds` rows."""
        return stacked_prompt_states(self.prompt_cache, prompts, negative_prompt)

    # ------------------------------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(z_dim, F', H / s, W / s)."""
        check_resolution("Wan", height, width, self.spatial * self.patch[1])
        frames = (self.num_frames - 1) // self.temporal + 1
        return (self.latent_channels, frames, height // self.spatial, width // self.spatial)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        self.latent_shape(height, width)
        return schedule.sd3_sigmas(num_steps, self.flow_shift, num_train_timesteps=NUM_TRAIN_TIMESTEPS)

    def sigmas_at(self, num_steps: int, height: int, width: int, positions: torch.Tensor) -> torch.Tensor:
        self.latent_shape(height, width)
        return schedule.sd3_sigmas_at(
            positions, num_steps, self.flow_shift, num_train_timesteps=NUM_TRAIN_TIMESTEPS
        )

    def velocity(
        self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Cond, *, guidance_scale: float
    ) -> torch.Tensor:
        """v(x_t, sigma) [B, C, F', h, w] fp32. Each row runs the expert of its timestep t = sigma * 1000 (the
        high-noise `transformer` at t >= the boundary, `transformer_2` below) with that expert's CFG scale."""
        B = x_t.shape[0]
        t = torch.as_tensor(sigma, device=x_t.device).float().expand(B) * NUM_TRAIN_TIMESTEPS
        if self.boundary_timestep is None:
            return self._guided(self.transformer, x_t, t, cond, guidance_scale)
        high = t >= self.boundary_timestep
        # WanPipeline turns CFG on or off by guidance_scale alone; guidance_scale_2 only rescales it
        scale_2 = (
            guidance_scale
            if guidance_scale <= 1.0 or self.guidance_scale_2 is None
            else self.guidance_scale_2
        )
        low_expert: Any = self.transformer_2
        # Sharded experts: every rank of the mesh runs the experts that any of its ranks needs (their FSDP2
        # collectives), whose rows of another stage it drops below; unsharded, those its rows need.
        run_high, run_low = any_across_shards([bool(high.any()), not bool(high.all())], self.transformer)
        if not run_low:
            return self._guided(self.transformer, x_t, t, cond, guidance_scale)
        if not run_high:
            return self._guided(low_expert, x_t, t, cond, scale_2)
        # Rows of both stages (a training forward over samples whose windows sit at different steps): both experts
        # on the whole batch, each row kept from its own. The rollout ran each row in a batch of this shape through
        # that expert (one step: one stage), so the row's numbers are the rollout's bit for bit; a batch of only
        # the expert's rows would have another shape, hence other kernels and other rounding.
        v_high = self._guided(self.transformer, x_t, t, cond, guidance_scale)
        v_low = self._guided(low_expert, x_t, t, cond, scale_2)
        return torch.where(high.view(-1, *[1] * (x_t.ndim - 1)), v_high, v_low)

    def _guided(
        self, expert: WanTransformer3DModel, x: torch.Tensor, t: torch.Tensor, cond: Cond, scale: float
    ) -> torch.Tensor:
        """One expert's velocity fp32; CFG (one batched forward over [positive; negative]) when scale > 1."""
        if scale <= 1.0:
            return self._forward(expert, x, t, cond["prompt_embeds"])
        if "neg_prompt_embeds" not in cond:
            raise ValueError(f"guidance_scale={scale} > 1 needs a negative prompt in cond")
        text = torch.cat([cond["prompt_embeds"], cond["neg_prompt_embeds"]])
        v_cond, v_uncond = self._forward(expert, torch.cat([x, x]), torch.cat([t, t]), text).chunk(2)
        return guidance.cfg(v_cond, v_uncond, scale)

    def _forward(
        self, expert: WanTransformer3DModel, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor
    ) -> torch.Tensor:
        dtype = self.dtype
        if self.expand_timesteps:
            # TI2V: one timestep per latent token (F' x h/2 x w/2), as the pipeline's expand_timesteps makes them
            _, _, f, h, w = x.shape
            t = t[:, None].expand(-1, f * (h // self.patch[1]) * (w // self.patch[2]))
        out = expert(
            hidden_states=x.to(dtype), timestep=t, encoder_hidden_states=text.to(dtype), return_dict=False
        )[0]
        return out.float()

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, x0: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Clean latents [B, C, F', h, w] -> frames uint8 [B, F, H, W, 3]: the pipeline's de-normalisation
        (operation for operation), the VAE's decode, diffusers' pixel rounding per frame."""
        cfg: Any = self.vae.config
        vdtype = next(self.vae.parameters()).dtype
        z = x0.to(vdtype)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, vdtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, vdtype)
        frames = self.vae.decode(z / inv_std + mean, return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
        return torch.stack([to_uint8(frames[:, :, i]) for i in range(frames.shape[2])], dim=1)


def wan_kwargs(mcfg: ModelConfig) -> dict[str, Any]:
    """The Wan fields of a WanConfig (none for a plain ModelConfig: the builder's defaults then)."""
    if not isinstance(mcfg, WanConfig):
        return {}
    return dict(num_frames=mcfg.num_frames, guidance_scale_2=mcfg.guidance_scale_2 or None)


def wan_experts(mcfg: ModelConfig) -> int:
    """model.experts of a WanConfig (0 for a plain ModelConfig: the model's own count)."""
    n = mcfg.experts if isinstance(mcfg, WanConfig) else 0
    if n not in (0, 1, 2):
        raise ConfigError(
            f"model.experts={n}: Wan has 1 (TI2V-5B) or 2 (T2V-A14B); pass 1 or 2, or 0 for model.path's"
        )
    return n


def check_experts(mcfg: ModelConfig, model: Wan) -> Wan:
    """The loaded model, after checking that it has the transformers model.experts names (when set)."""
    n = wan_experts(mcfg)
    if n and n != len(model.experts):
        variant = "Wan-AI/Wan2.2-T2V-A14B-Diffusers" if n == 2 else "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
        raise ConfigError(
            f"model.experts={n}: model.path '{mcfg.path}' has {len(model.experts)} transformer(s); point "
            f"--model.path at {variant} or drop --model.experts"
        )
    return model


def export_expert_loras(out_dir: str | Path, model: Wan) -> tuple[Path, ...]:
    """Write each expert's LoRA (models.lora.export_loras) into its own directory: `out_dir/transformer` and, for
    the A14B, `out_dir/transformer_2`, the layout the loop's `lora/` and `lora_best/` have for the A14B. WanPipeline
    loads them with `pipe.load_lora_weights(out_dir / "transformer")` and
    `pipe.load_lora_weights(out_dir / "transformer_2", load_into_transformer_2=True)` (diffusers' Wan loader reads
    the same `transformer.`-prefixed keys into whichever expert it is told)."""
    export_loras(out_dir, model.trained_transformers, subdirs=True)
    return tuple(Path(out_dir) / name for name in model.trained_transformers)
