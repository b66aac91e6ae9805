"""Z-Image (Tongyi-MAI/Z-Image and Z-Image-Turbo) behind the FlowModel interface, from diffusers' own classes.

Text: the prompt in the tokenizer's chat template (one user turn, generation prompt, thinking enabled), through a
Qwen3 causal LM; the conditioning is the second-to-last hidden layer at the real (unpadded) tokens, a variable-length
[L, D] a prompt (ZImagePipeline._encode_prompt). Image: AutoencoderKL latents [16, H/8, W/8] scaled by
(z - shift_factor) * scaling_factor; the transformer takes them unpacked, one [C, 1, h, w] tensor per sample, and
patchifies (2x2) and positions them itself. Its timestep input is 1 - sigma and its output is minus the velocity.

Guidance: the base model (Z-Image) takes true CFG, two forwards a step; Z-Image-Turbo is distilled and samples with
the pipeline's guidance_scale 0, one forward. The pipeline's scale g means pos + g (pos - neg); fgrpo's
`guidance_scale` s is the usual neg + s (pos - neg), so s = g + 1 (s <= 1: one forward, Turbo's s = 1).
Schedule: linspace(1, 1/N, N) through the checkpoint's scheduler config: a static shift, or the dynamic
(exponential) shift with mu from the patch count where the config turns it on, then a terminal 0.

Differs from ZImagePipeline:
- Each distinct prompt is encoded alone (no padding) and cached: with a causal encoder and the padding masked, a
  real token's state does not depend on its batch-mates' lengths, so the numbers equal the batched ones up to float
  rounding.
- CFG as neg + s (pos - neg) and the timestep 1 - sigma, vs the pipeline's pos + g (pos - neg) and
  (1000 - 1000 sigma) / 1000: float rounding only. Its cfg_normalization and cfg_truncation (off by default) are
  not supported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch

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
    pad_stack,
)
from fgrpo.models.qwen_image import schedule_kwargs

if TYPE_CHECKING:  # diffusers is imported where a model is built
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel

# ZImagePipeline's default prompt length (tokens of the templated prompt).
MAX_SEQUENCE_LENGTH = 512
# The scheduler config of a model built in code (the tiny one): a static shift of 3, our choice for it (the tests
# check the dynamic-shift branch too). A loaded model reads its checkpoint's scheduler_config.json.
SCHEDULER_CONFIG: dict[str, Any] = {"shift": 3.0, "use_dynamic_shifting": False}

# The transformer's Linear layers that LoRA adapts: Flow-Factory's Z-Image default (src/flow_factory/models/z_image.py,
# `default_target_modules`): each block's attention q/k/v/out and its SwiGLU feed-forward. As name suffixes they match
# the noise and context refiners' blocks as well as the main layers.
ZIMAGE_LORA_TARGETS = (
    "attention.to_q",
    "attention.to_k",
    "attention.to_v",
    "attention.to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)


class ZImage(OnTransformer):
    """Z-Image (Qwen3 text encoder, transformer, VAE) as a FlowModel. Weights are frozen; LoRA goes on later."""

    # Transformer passes a step takes with guidance_scale > 1 (true CFG); the benchmarks' FLOP counts read it.
    cfg_forwards = 2

    def __init__(
        self,
        transformer: ZImageTransformer2DModel,
        vae: AutoencoderKL,
        text_encoder: torch.nn.Module | None,
        tokenizer: Any,
        *,
        scheduler_config: Mapping[str, Any] = SCHEDULER_CONFIG,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        prompt_cache_size: int = 1024,
    ):
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        full = complete_scheduler_config(scheduler_config)
        # dynamic: Qwen-Image's exponential shift (keywords for core.schedule.qwen_image_sigmas); static: the shift
        self.schedule_kwargs = schedule_kwargs(full) if full["use_dynamic_shifting"] else None
        self.shift = float(full["shift"])
        self.max_sequence_length = max_sequence_length
        # diffusers annotates ConfigMixin.config as dict[str, Any]; it is a FrozenDict with attribute access.
        tcfg: Any = transformer.config
        vcfg: Any = vae.config
        self.vae_scale = 2 ** (len(vcfg.block_out_channels) - 1)
        self.patch = 2  # the transformer's (patch_size=2, f_patch_size=1), the pipeline's call
        self.latent_channels = vcfg.latent_channels
        if tcfg.in_channels != self.latent_channels:
            raise ValueError(
                f"transformer in_channels={tcfg.in_channels} != VAE latent_channels {self.latent_channels}; "
                "the transformer and VAE do not belong together"
            )
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
        """Load a diffusers-format Z-Image directory or hub id (Tongyi-MAI/Z-Image or Tongyi-MAI/Z-Image-Turbo)."""
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
        from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
        from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = str(path)
        transformer = ZImageTransformer2DModel.from_pretrained(
            path, subfolder="transformer", torch_dtype=dtype
        )
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype)
        encoder = AutoModelForCausalLM.from_pretrained(
            path, subfolder="text_encoder", dtype=text_encoder_dtype or dtype
        )
        tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
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
    @torch.no_grad()
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor]:
        """One prompt -> its conditioning tokens [L, D] in the transformer's dtype."""
        if self.text_encoder is None:
            raise RuntimeError("this ZImage was built without a text encoder; pass one to encode prompts")
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=True,
        )
        ids = self.tokenizer(
            [text], max_length=self.max_sequence_length, truncation=True, return_tensors="pt"
        ).input_ids.to(module_device(self.text_encoder))
        hidden = self.text_encoder(input_ids=ids, output_hidden_states=True).hidden_states[-2][0]
        return (hidden.to(device=self.device, dtype=self.dtype),)

    def encode(self, prompts: Sequence[str], *, negative_prompt: str | None = None) -> Cond:
        """Text tokens [B, L, D] zero-padded with their mask [B, L]; with `negative_prompt`, its `neg_*` rows."""
        if len(prompts) == 0:
            raise ValueError("prompts is empty; pass at least one prompt")
        embeds, mask = pad_stack([self.prompt_cache(p)[0] for p in prompts])
        cond = {"prompt_embeds": embeds, "prompt_mask": mask}
        if negative_prompt is not None:
            (neg,) = self.prompt_cache(negative_prompt)
            B = len(prompts)
            cond["neg_prompt_embeds"] = neg[None].expand(B, -1, -1)
            cond["neg_prompt_mask"] = torch.ones(B, neg.shape[0], dtype=torch.bool, device=neg.device)
        return cond

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        check_resolution("Z-Image", height, width, self.vae_scale * self.patch)
        return (self.latent_channels, height // self.vae_scale, width // self.vae_scale)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        _, h, w = self.latent_shape(height, width)
        if self.schedule_kwargs is None:
            return schedule.static_shift_sigmas(num_steps, self.shift)
        seq_len = (h // self.patch) * (w // self.patch)
        return schedule.qwen_image_sigmas(num_steps, seq_len, **self.schedule_kwargs)

    def sigmas_at(self, num_steps: int, height: int, width: int, positions: torch.Tensor) -> torch.Tensor:
        _, h, w = self.latent_shape(height, width)
        if self.schedule_kwargs is None:
            return schedule.static_shift_sigmas_at(positions, num_steps, self.shift)
        seq_len = (h // self.patch) * (w // self.patch)
        return schedule.qwen_image_sigmas_at(positions, num_steps, seq_len, **self.schedule_kwargs)

    def velocity(
        self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Cond, *, guidance_scale: float
    ) -> torch.Tensor:
        """v(x_t, sigma) [B, C, h, w] fp32; true CFG (one batched forward over both halves) when guidance_scale > 1."""
        B = x_t.shape[0]
        sigma = torch.as_tensor(sigma, device=x_t.device).float().expand(B)
        texts = [e[m] for e, m in zip(cond["prompt_embeds"], cond["prompt_mask"], strict=True)]
        if guidance_scale <= 1.0:
            return self._forward(x_t, sigma, texts)
        if "neg_prompt_embeds" not in cond:
            raise ValueError(f"guidance_scale={guidance_scale} > 1 needs a negative prompt in cond")
        negs = [e[m] for e, m in zip(cond["neg_prompt_embeds"], cond["neg_prompt_mask"], strict=True)]
        v_cond, v_uncond = self._forward(
            torch.cat([x_t, x_t]), torch.cat([sigma, sigma]), texts + negs
        ).chunk(2)
        return guidance.cfg(v_cond, v_uncond, guidance_scale)

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, texts: list[torch.Tensor]) -> torch.Tensor:
        """One transformer call on latents [N, C, h, w] and N variable-length prompts -> velocity fp32 [N, C, h, w]."""
        dtype = self.dtype
        out = self.transformer(
            list(x.to(dtype).unsqueeze(2).unbind(0)),  # one [C, 1, h, w] image per sample
            (1 - sigma).to(dtype),  # the transformer's time runs from 0 (noise) to 1 (data)
            [t.to(dtype) for t in texts],
            return_dict=False,
        )[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    @torch.no_grad()
    def decode(self, x0: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Clean latents [B, C, h, w] -> uint8 [B, H, W, 3]."""
        return decode_scaled_latents(self.vae, x0)
