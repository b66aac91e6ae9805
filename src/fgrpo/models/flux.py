"""FLUX.1-dev behind the FlowModel interface, built from diffusers' and transformers' own classes.

Text: CLIP-L's pooled output (one vector a prompt) and T5-XXL's last hidden states, padded to
`max_sequence_length` tokens with no mask (FluxPipeline's recipe: the padding tokens are attended to, so the
length is part of the conditioning). Image: AutoencoderKL latents [16, H/8, W/8], scaled by
(z - shift_factor) * scaling_factor, packed 2x2 into tokens [(H/16)(W/16), 64] like Qwen-Image's; rotary
positions from `img_ids` (0, row, column) per token and `txt_ids` (all zero) per text token.

Guidance: FLUX.1-dev is guidance-distilled. `guidance_scale` is fed to the transformer as an embedding
(`guidance=`), one forward per step; there is no negative branch, so a negative prompt is accepted and unused.
Schedule: the pipeline's sigmas linspace(1, 1/N, N), shifted by the scheduler's dynamic (exponential) shift with
mu from the packed token count (calculate_shift), then a terminal 0: Qwen-Image's schedule without the terminal
stretch, built from the scheduler config the same way.

Differs from FluxPipeline:
- x_t lives unpacked, [C, H/8, W/8] (the size is readable from the tensor, and the SDE noise is drawn in the
  layout of the pipeline's initial noise).
- Each distinct prompt is encoded alone and cached; with fixed-length padding and no mask an encoding does not
  depend on its batch-mates, so the numbers equal the pipeline's batched ones up to float rounding.
- The timestep fed to the transformer is sigma itself; the pipeline feeds (1000 sigma) / 1000.
- True CFG (FluxPipeline's `true_cfg_scale` with a negative prompt: two forwards) is not supported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch

from fgrpo.models.base import Cond
from fgrpo.models.common import (
    PatchedLatents,
    PromptCache,
    decode_scaled_latents,
    freeze,
    module_device,
)
from fgrpo.models.qwen_image import pack, schedule_kwargs, unpack

if TYPE_CHECKING:  # diffusers is imported where a model is built
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel

CLIP_MAX_LENGTH = 77
# FluxPipeline's default and FLUX.1-dev's training length. flow_grpo's FLUX scripts encode 128 tokens
# (scripts/train_flux.py, compute_text_embeddings(max_sequence_length=128)); we keep the model's own length.
T5_MAX_LENGTH = 512
# black-forest-labs/FLUX.1-dev's scheduler/scheduler_config.json, the keys that differ from
# FlowMatchEulerDiscreteScheduler's defaults ("shift" is unused under dynamic shifting). A loaded model reads its own
# file; a model built in code (the tiny one) is given this.
SCHEDULER_CONFIG: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}

# The transformer's Linear layers that LoRA adapts: flow_grpo's FLUX list (scripts/train_flux.py, `target_modules`),
# q/k/v/out and the text stream's add_*_proj / to_add_out of the joint attention, and both streams' feed-forwards.
# Matched as name suffixes, "attn.to_q/k/v" also adapt the single-stream blocks' attention; their proj_mlp and
# proj_out are not in the reference's list and stay frozen. In the last joint block to_add_out and ff_context make a
# text output the single blocks still read, so every adapter gets a gradient.
FLUX_LORA_TARGETS = (
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)


def image_ids(h: int, w: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Rotary positions of the packed tokens of an [*, h, w] latent: [(h/2)(w/2), 3] fp32, row-major, each
    (0, row, column) of its 2x2 patch (FluxPipeline._prepare_latent_image_ids)."""
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1)  # [h/2, w/2, 3]
    return ids.reshape(-1, 3).to(device=device, dtype=torch.float32)


class Flux(PatchedLatents):
    """FLUX.1 (CLIP-L, T5, transformer, VAE) as a FlowModel. Weights are frozen; LoRA goes on later."""

    family = "FLUX"

    # Transformer passes a step takes with guidance_scale > 1 (true CFG's families: 2); the benchmarks' FLOP counts
    # read it.
    cfg_forwards = 1

    def __init__(
        self,
        transformer: FluxTransformer2DModel,
        vae: AutoencoderKL,
        text_encoders: Sequence[torch.nn.Module | None],
        tokenizers: Sequence,
        *,
        scheduler_config: Mapping[str, Any] = SCHEDULER_CONFIG,
        max_sequence_length: int = T5_MAX_LENGTH,
        prompt_cache_size: int = 1024,
    ):
        if len(text_encoders) != 2 or len(tokenizers) != 2:
            raise ValueError("Flux needs two text encoders and tokenizers (CLIP-L, T5; both may be None)")
        self.transformer = transformer
        self.vae = vae
        self.clip, self.t5 = text_encoders
        self.tokenizers = list(tokenizers)
        self.schedule_kwargs = schedule_kwargs(scheduler_config)
        self.max_sequence_length = max_sequence_length
        # diffusers annotates ConfigMixin.config as dict[str, Any]; it is a FrozenDict with attribute access.
        tcfg: Any = transformer.config
        vcfg: Any = vae.config
        self.vae_scale = 2 ** (len(vcfg.block_out_channels) - 1)
        self.patch = 2  # the pipeline's 2x2 packing (the transformer's own patch_size is 1)
        self.latent_channels = vcfg.latent_channels
        if tcfg.in_channels != self.latent_channels * self.patch**2:
            raise ValueError(
                f"transformer in_channels={tcfg.in_channels} != VAE latent_channels {self.latent_channels} x 2^2; "
                "the transformer and VAE do not belong together"
            )
        self.guidance_embeds = bool(tcfg.guidance_embeds)
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
        **kwargs,
    ) -> Self:
        """Load a diffusers-format FLUX.1 directory or hub id (e.g. black-forest-labs/FLUX.1-dev)."""
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
        from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
        from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        path, tdtype = str(path), text_encoder_dtype or dtype
        transformer = FluxTransformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype)
        encoders = [
            CLIPTextModel.from_pretrained(path, subfolder="text_encoder", dtype=tdtype),
            T5EncoderModel.from_pretrained(path, subfolder="text_encoder_2", dtype=tdtype),
        ]
        # AutoTokenizer: CLIP/T5 for the real checkpoint, whatever class a saved tiny pipeline recorded.
        tokenizers = [AutoTokenizer.from_pretrained(path, subfolder=s) for s in ("tokenizer", "tokenizer_2")]
        scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler")
        return cls.from_modules(
            transformer, vae, encoders, tokenizers, device=device, scheduler_config=scheduler_config, **kwargs
        )

    @classmethod
    def from_modules(cls, transformer, vae, text_encoders, tokenizers, *, device=None, **kwargs) -> Self:
        """Freeze the modules (eval mode, no grads), move them to `device`, wrap them."""
        freeze(transformer, vae, *text_encoders, device=device)
        return cls(transformer, vae, text_encoders, tokenizers, **kwargs)

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One prompt -> (T5 tokens [max_sequence_length, D], CLIP pooled [P]) in the transformer's dtype."""
        if self.clip is None or self.t5 is None:
            raise RuntimeError(
                "this Flux was built without its text encoders; pass CLIP and T5 to encode prompts"
            )
        clip_tok, t5_tok = self.tokenizers
        ids = clip_tok(
            [prompt], padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True, return_tensors="pt"
        ).input_ids
        pooled = self.clip(ids.to(module_device(self.clip)), output_hidden_states=False).pooler_output[0]
        ids = t5_tok(
            [prompt],
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        embeds = self.t5(ids.to(module_device(self.t5)), output_hidden_states=False)[0][0]
        return embeds.to(self.device, self.dtype), pooled.to(self.device, self.dtype)

    def encode(self, prompts: Sequence[str], *, negative_prompt: str | None = None) -> Cond:
        """T5 tokens [B, L, D] and CLIP pooled [B, P]. `negative_prompt` is unused: FLUX.1-dev's guidance is an
        input embedding, not a negative branch (the rollout passes one whenever guidance_scale > 1)."""
        if len(prompts) == 0:
            raise ValueError("prompts is empty; pass at least one prompt")
        enc = [self.prompt_cache(p) for p in prompts]
        return {"prompt_embeds": torch.stack([e for e, _ in enc]), "pooled": torch.stack([p for _, p in enc])}

    def velocity(
        self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Cond, *, guidance_scale: float
    ) -> torch.Tensor:
        """v(x_t, sigma) [B, C, h, w] fp32; guidance_scale is the embedded guidance (one forward, no CFG)."""
        B, _, h, w = x_t.shape
        sigma = torch.as_tensor(sigma, device=x_t.device).float().expand(B)
        embeds = cond["prompt_embeds"]
        dtype = self.dtype
        # FLUX.1-schnell has no guidance embedding: the pipeline passes None and so do we.
        guidance = (
            torch.full((B,), float(guidance_scale), device=x_t.device) if self.guidance_embeds else None
        )
        out = self.transformer(
            hidden_states=pack(x_t).to(dtype),
            timestep=sigma.to(dtype),  # the transformer scales it (and the guidance) by 1000 itself
            guidance=guidance,
            pooled_projections=cond["pooled"].to(dtype),
            encoder_hidden_states=embeds.to(dtype),
            txt_ids=torch.zeros(embeds.shape[1], 3, device=x_t.device, dtype=dtype),
            img_ids=image_ids(h, w, x_t.device).to(dtype),
            return_dict=False,
        )[0]
        return unpack(out.float(), h, w)

    @torch.no_grad()
    def decode(self, x0: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Clean latents [B, C, h, w] -> uint8 [B, H, W, 3]."""
        return decode_scaled_latents(self.vae, x0)
