"""FLUX.2 [klein] and [dev] behind the FlowModel interface, built from diffusers' and transformers' own classes.

Text: Qwen3 reads the prompt in its chat template (user turn, generation prompt, thinking off), padded to
`max_sequence_length` tokens with an attention mask; the hidden states of layers (9, 18, 27) are concatenated per
token into [L, 3 D] (Flux2KleinPipeline._get_qwen3_prompt_embeds). The transformer gets every padded token and no
mask, so the length is part of the conditioning, as with FLUX.1's T5.
Image: AutoencoderKLFlux2 latents [32, H/8, W/8], patchified 2x2 into [128, H/16, W/16] and normalised per channel
by the VAE's batch-norm running statistics, (z - mean) / sqrt(var + eps); the transformer reads each of the
(H/16)(W/16) positions as one token. Rotary positions are 4-axis: (0, row, column, 0) per image token and
(0, 0, 0, index) per text token.

Guidance: klein's base models use true CFG (two forwards, negative prompt "" in the pipeline, no rescale); the
step-distilled klein models (`is_distilled`) ignore guidance_scale, one forward a step.
Schedule: linspace(1, 1/N, N) through the scheduler's exponential time shift with mu from FLUX.2's own empirical
fit in the token count and the step count (core.schedule.flux2_mu), then a terminal 0.

Differs from Flux2KleinPipeline:
- Each distinct prompt is encoded alone and cached; fixed-length padding and a causal encoder make an encoding
  independent of its batch-mates.
- The timestep fed to the transformer is sigma itself; the pipeline feeds (1000 sigma) / 1000.
- The CFG branch is one batched forward over [positive; negative] (both padded to the same fixed length).
- Reference images (the pipeline's `image=` editing input) are not supported.

FLUX.2 [dev] (Flux2Pipeline) shares the transformer, VAE, latents and schedule. Its text encoder is Mistral-3
(Mistral3ForConditionalGeneration) read through its processor's chat template: a system turn holding the pipeline's
system message, then the prompt as the user turn, no generation prompt, padded to `max_sequence_length` tokens; the
hidden states of layers (10, 20, 30) are concatenated per token as with klein
(Flux2Pipeline._get_mistral_3_small_prompt_embeds). It is guidance-distilled: `guidance_scale` goes into the
transformer's guidance embedding, one forward a step, no negative prompt. `from_pretrained` tells the two apart by
the pipeline class in model_index.json. Against Flux2Pipeline the differences above hold too (prompts encoded alone,
sigma as the timestep, no reference images), and its prompt rewriting (caption_upsample_temperature) is not here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch

from fgrpo.core import guidance as guidance_math
from fgrpo.core import schedule
from fgrpo.models.base import Cond
from fgrpo.models.common import (
    PatchedLatents,
    PromptCache,
    complete_scheduler_config,
    freeze,
    module_device,
    module_dtype,
    stacked_prompt_states,
    to_uint8,
)

if TYPE_CHECKING:  # diffusers is imported where a model is built
    from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel

# Flux2KleinPipeline's defaults: prompt length and the Qwen3 layers whose hidden states are stacked.
MAX_SEQUENCE_LENGTH = 512
TEXT_LAYERS = (9, 18, 27)
# Flux2Pipeline's (FLUX.2 [dev]): the Mistral-3 layers whose hidden states are stacked (its length is klein's 512).
DEV_TEXT_LAYERS = (10, 20, 30)
# The pipeline class a saved FLUX.2 directory names in model_index.json -> its variant.
VARIANTS = {"Flux2KleinPipeline": "klein", "Flux2Pipeline": "dev"}
# What FLUX.2's schedule needs of a scheduler config; a model built in code (the tiny one) is given this.
SCHEDULER_CONFIG: dict[str, Any] = {"use_dynamic_shifting": True, "time_shift_type": "exponential"}

# The transformer's Linear layers that LoRA adapts, matched as name suffixes: the joint blocks' attention (image
# and text streams) and SwiGLU feed-forwards, and the single blocks' fused qkv + MLP input projection. Flow-Factory's
# FLUX.2-klein recipe (examples/grpo/lora/flux2_klein_base/default.yaml) uses its "default" targets at r64/a128.
# The single blocks' output projection is left out: its suffix "attn.to_out" also names the joint blocks'
# ModuleList, which peft cannot adapt.
FLUX2_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
)


def pack(x: torch.Tensor) -> torch.Tensor:
    """Patchified latents [B, C, h, w] -> tokens [B, h w, C], row-major (Flux2KleinPipeline._pack_latents)."""
    return x.flatten(2).transpose(1, 2)


def unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack`: [B, h w, C] -> [B, C, h, w]."""
    return x.transpose(1, 2).unflatten(2, (h, w))


def image_ids(h: int, w: int, device: torch.device | str | None = None) -> torch.Tensor:
    """4-axis rotary positions (time, row, column, layer) of an [*, h, w] latent's tokens: [h w, 4] fp32, each
    (0, row, column, 0), row-major."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    zeros = torch.zeros_like(rows)
    return torch.stack([zeros, rows, cols, zeros], -1).reshape(-1, 4).to(device=device, dtype=torch.float32)


def text_ids(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """4-axis rotary positions of `length` text tokens: [L, 4] fp32, each (0, 0, 0, index)."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids


def flux2_variant(path: str | Path) -> str:
    """'dev' or 'klein': which FLUX.2 a diffusers directory or hub id holds, read from its model_index.json."""
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    index: Any = DiffusionPipeline.load_config(str(path))
    name = index.get("_class_name")
    if name not in VARIANTS:
        raise ValueError(
            f"{path} holds a {name}, not a FLUX.2 pipeline ({' or '.join(VARIANTS)}); point the path at a FLUX.2 "
            "[klein] or [dev] directory"
        )
    return VARIANTS[name]


def flux2_scheduler_check(config: Mapping[str, Any]) -> None:
    """Raise unless a scheduler config gives FLUX.2's schedule: dynamic, exponential shift, no terminal stretch."""
    full = complete_scheduler_config(config)
    if not full["use_dynamic_shifting"] or full["time_shift_type"] != "exponential" or full["shift_terminal"]:
        raise ValueError(
            f"scheduler config has use_dynamic_shifting={full['use_dynamic_shifting']}, time_shift_type="
            f"{full['time_shift_type']!r}, shift_terminal={full['shift_terminal']}; FLUX.2's schedule needs true, "
            "'exponential' and none (its scheduler_config.json)"
        )


class Flux2(PatchedLatents):
    """FLUX.2 [klein] (Qwen3, transformer, VAE) or FLUX.2 [dev] (Mistral-3 and its processor, transformer with a
    guidance embedding, VAE) as a FlowModel. Weights are frozen; LoRA goes on later."""

    family = "FLUX.2"

    # Transformer passes a step takes with guidance_scale > 1 (the benchmarks' FLOP counts read it): 2 for true CFG,
    # 1 where the guidance is an embedding or ignored (set per model in __init__).
    cfg_forwards: int

    def __init__(
        self,
        transformer: Flux2Transformer2DModel,
        vae: AutoencoderKLFlux2,
        text_encoder: torch.nn.Module | None,
        tokenizer: Any,
        *,
        scheduler_config: Mapping[str, Any] = SCHEDULER_CONFIG,
        is_distilled: bool = False,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        text_layers: Sequence[int] = TEXT_LAYERS,
        system_message: str | None = None,
        prompt_cache_size: int = 1024,
    ):
        flux2_scheduler_check(scheduler_config)
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.is_distilled = is_distilled
        self.max_sequence_length = max_sequence_length
        self.text_layers = tuple(text_layers)
        # None: klein's Qwen3 template; a string: [dev]'s Mistral-3 processor template with this system turn
        self.system_message = system_message
        self.schedule_kwargs = {}  # PatchedLatents' Qwen-Image keywords; FLUX.2 overrides sigmas and sigmas_at
        tcfg: Any = transformer.config
        vcfg: Any = vae.config
        # x_t is the patchified latent: one token per position, so the VAE's 8x and the 2x2 patchify make 16 px.
        self.vae_scale = 2 ** (len(vcfg.block_out_channels) - 1) * 2
        self.patch = 1
        self.latent_channels = vcfg.latent_channels * 4
        if tcfg.in_channels != self.latent_channels:
            raise ValueError(
                f"transformer in_channels={tcfg.in_channels} != VAE latent_channels {vcfg.latent_channels} x 2^2; "
                "the transformer and VAE do not belong together"
            )
        self.guidance_embeds = bool(tcfg.guidance_embeds)
        self.cfg_forwards = 1 if self.guidance_embeds or is_distilled else 2
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
        """Load a diffusers-format FLUX.2 directory or hub id: [klein] (e.g. black-forest-labs/FLUX.2-klein-base-4B,
        Qwen3 and its tokenizer) or [dev] (black-forest-labs/FLUX.2-dev, Mistral-3 and its processor), told apart by
        the pipeline class its model_index.json names."""
        from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
        from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
        from diffusers.pipelines.pipeline_utils import DiffusionPipeline
        from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

        path = str(path)
        variant = flux2_variant(path)
        transformer = Flux2Transformer2DModel.from_pretrained(
            path, subfolder="transformer", torch_dtype=dtype
        )
        vae = AutoencoderKLFlux2.from_pretrained(path, subfolder="vae", torch_dtype=dtype)
        text_dtype = text_encoder_dtype or dtype
        if variant == "dev":
            from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
            from transformers import AutoProcessor, Mistral3ForConditionalGeneration

            encoder = Mistral3ForConditionalGeneration.from_pretrained(
                path, subfolder="text_encoder", dtype=text_dtype
            )
            tokenizer = AutoProcessor.from_pretrained(path, subfolder="tokenizer")
            kwargs.setdefault("system_message", SYSTEM_MESSAGE)
            kwargs.setdefault("text_layers", DEV_TEXT_LAYERS)
        else:
            from transformers import AutoTokenizer, Qwen3ForCausalLM

            encoder = Qwen3ForCausalLM.from_pretrained(path, subfolder="text_encoder", dtype=text_dtype)
            tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
            # model_index.json records whether the klein checkpoint is step-distilled (guidance ignored).
            index: Any = DiffusionPipeline.load_config(path)
            kwargs.setdefault("is_distilled", bool(index.get("is_distilled", False)))
        scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler")
        return cls.from_modules(
            transformer, vae, encoder, tokenizer, device=device, scheduler_config=scheduler_config, **kwargs
        )

    @classmethod
    def from_modules(cls, transformer, vae, text_encoder, tokenizer, *, device=None, **kwargs) -> Self:
        """Freeze the modules (eval mode, no grads), move them to `device`, wrap them."""
        freeze(transformer, vae, text_encoder, device=device)
        return cls(transformer, vae, text_encoder, tokenizer, **kwargs)

    # ------------------------------------------------------------------------------------------------
    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        return schedule.flux2_sigmas(num_steps, self._tokens(height, width))

    def sigmas_at(self, num_steps: int, height: int, width: int, positions: torch.Tensor) -> torch.Tensor:
        return schedule.flux2_sigmas_at(positions, num_steps, self._tokens(height, width))

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor]:
        """One prompt -> the text encoder's stacked hidden states [max_sequence_length, len(text_layers) D],
        transformer dtype."""
        if self.text_encoder is None:
            raise RuntimeError(
                "this Flux2 was built without its text encoder; pass Qwen3 or Mistral-3 to encode"
            )
        tokens = self._tokenize(prompt)
        device = module_device(self.text_encoder)
        out = self.text_encoder(
            input_ids=tokens["input_ids"].to(device),
            attention_mask=tokens["attention_mask"].to(device),
            output_hidden_states=True,
            use_cache=False,
        )
        hidden = torch.cat([out.hidden_states[k][0] for k in self.text_layers], dim=-1)  # [L, layers x D]
        return (hidden.to(self.device, self.dtype),)

    def _tokenize(self, prompt: str) -> Mapping[str, torch.Tensor]:
        """One prompt in its chat template, padded (or cut) to max_sequence_length: input_ids and attention_mask
        [1, L]."""
        padding = dict(padding="max_length", max_length=self.max_sequence_length, truncation=True)
        if self.system_message is None:  # klein: Qwen3's template rendered, then tokenised
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            return self.tokenizer(text, return_tensors="pt", **padding)
        # [dev]: the processor renders and tokenises the system and user turns. "[IMG]" is removed from the prompt,
        # as the pipeline does: the processor would count it as an image placeholder with no image.
        turns = [
            {"role": "system", "content": [{"type": "text", "text": self.system_message}]},
            {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]},
        ]
        return self.tokenizer.apply_chat_template(
            [turns],
            add_generation_prompt=False,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            processor_kwargs=padding,
        )

    def encode(self, prompts: Sequence[str], *, negative_prompt: str | None = None) -> Cond:
        """Stacked text-encoder states [B, L, 3 D]; with a negative prompt also its states, one row per prompt."""
        return stacked_prompt_states(self.prompt_cache, prompts, negative_prompt)

    def velocity(
        self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Cond, *, guidance_scale: float
    ) -> torch.Tensor:
        """v(x_t, sigma) [B, C, h, w] fp32; plain true CFG when guidance_scale > 1 and the model is not
        step-distilled (a transformer with a guidance embedding reads the scale there instead)."""
        B, _, h, w = x_t.shape
        sigma = torch.as_tensor(sigma, device=x_t.device).float().expand(B)
        embeds = cond["prompt_embeds"]
        x = pack(x_t)
        if self.guidance_embeds or self.is_distilled or guidance_scale <= 1.0:
            guidance = (
                torch.full((B,), float(guidance_scale), device=x_t.device) if self.guidance_embeds else None
            )
            return unpack(self._forward(x, sigma, embeds, h, w, guidance), h, w)
        if "neg_prompt_embeds" not in cond:
            raise ValueError(f"guidance_scale={guidance_scale} > 1 needs a negative prompt in cond")
        both = torch.cat([embeds, cond["neg_prompt_embeds"]])
        v_cond, v_uncond = self._forward(
            torch.cat([x, x]), torch.cat([sigma, sigma]), both, h, w, None
        ).chunk(2)
        return unpack(guidance_math.cfg(v_cond, v_uncond, guidance_scale), h, w)

    def _forward(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        embeds: torch.Tensor,
        h: int,
        w: int,
        guidance: torch.Tensor | None,
    ) -> torch.Tensor:
        """One transformer pass on packed tokens [B, h w, C] -> velocity tokens [B, h w, C] fp32."""
        dtype = self.dtype
        out = self.transformer(
            hidden_states=x.to(dtype),
            timestep=sigma.to(dtype),  # the transformer scales it (and the guidance) by 1000 itself
            guidance=guidance,
            encoder_hidden_states=embeds.to(dtype),
            txt_ids=text_ids(embeds.shape[1], x.device).to(dtype),
            img_ids=image_ids(h, w, x.device).to(dtype),
            return_dict=False,
        )[0]
        return out.float()

    @torch.no_grad()
    def decode(self, x0: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Clean patchified latents [B, 128, h, w] -> uint8 [B, H, W, 3]: the batch-norm statistics undone, the 2x2
        patchify undone, the VAE's decode, diffusers' pixel rounding."""
        vcfg: Any = self.vae.config
        bn: Any = self.vae.bn
        z = x0.to(module_dtype(self.vae))
        mean = bn.running_mean.view(1, -1, 1, 1).to(z)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + vcfg.batch_norm_eps).to(z)
        z = z * std + mean
        B, C, h, w = z.shape
        z = z.reshape(B, C // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(B, C // 4, 2 * h, 2 * w)
        return to_uint8(self.vae.decode(z, return_dict=False)[0])
