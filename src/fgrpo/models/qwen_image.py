"""Qwen-Image behind the FlowModel interface, built from diffusers' and transformers' own classes.

Text: Qwen2.5-VL reads the prompt inside Qwen-Image's chat template; the hidden states of the last
layer, minus the 34 template-prefix tokens, are the conditioning (QwenImagePipeline's recipe).
Image: AutoencoderKLQwenImage latents [C, H/8, W/8], normalised with the VAE's per-channel mean/std,
packed 2x2 into tokens [(H/16)(W/16), 4C] for QwenImageTransformer2DModel (RoPE from `img_shapes`).

Differs from QwenImagePipeline:
- x_t lives unpacked, [C, H/8, W/8]: the image size is then readable from the tensor (the transformer
  needs it for RoPE) and the SDE noise is drawn in the same layout the pipeline draws its initial noise.
- True CFG is one batched forward over [positive; negative] (prompts padded to a common length with a
  mask), not two forwards; the pipeline's two calls give the same numbers up to float rounding.
  `split_cfg=True` makes the two calls instead, each trimmed to its own prompts' length, so the negative half
  (and a positive half of one prompt length) needs no padding mask: a faster bare forward, but a slower
  compiled training step (benchmarks/RESULTS.md, "cfg-split" and "cfg-split-profile"): the two calls launch
  twice the kernels, each on half the rows, faster than the host issues them, so the GPU waits for the host a
  quarter of the step (busy 74 %, against 95 % for the one batched forward). The benchmarks compare both.
- Each distinct prompt is encoded alone and cached, so an encoding never depends on its batch-mates.
- The timestep fed to the transformer is sigma itself; the pipeline feeds (1000 sigma) / 1000.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
from einops import rearrange

from fgrpo.core import guidance
from fgrpo.models.base import Cond
from fgrpo.models.common import (
    PatchedLatents,
    PromptCache,
    complete_scheduler_config,
    freeze,
    module_device,
    module_dtype,
    pad_stack,
    pad_to,
    to_uint8,
    trim_padding,
)
from fgrpo.parallel import sequence_multiple

if (
    TYPE_CHECKING
):  # diffusers is imported where a model is built, so fgrpo.config can read the constants below
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# Tokens of the template's system/user prefix (with Qwen's tokenizer); QwenImagePipeline drops them.
PROMPT_DROP = 34
MAX_SEQUENCE_LENGTH = 1024

# The transformer's Linear layers that LoRA adapts: q/k/v/out of the joint attention for the image and the
# text stream, and both streams' MLPs. In the last block, to_add_out and txt_mlp make a text output that nothing
# reads, so their adapters never get a gradient (B stays 0: no effect). They are kept: leaving them out would
# change the keys of every checkpoint and exported adapter written so far, which then would not load.
QWEN_IMAGE_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
# Those of the image stream, whose inputs hold every image token: the layers a merged rollout
# (model.merged_rollout) merges. The text stream's carry the prompt's few tokens; their adapters cost little.
QWEN_IMAGE_IMAGE_STREAM_LORA = ("to_q", "to_k", "to_v", "to_out.0", "img_mlp.net.0.proj", "img_mlp.net.2")
# Qwen/Qwen-Image's scheduler/scheduler_config.json, the keys that differ from FlowMatchEulerDiscreteScheduler's
# defaults. A loaded model reads its own file; a model built in code (the tiny one) is given this.
SCHEDULER_CONFIG: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
# Scheduler config key -> core.schedule.qwen_image_sigmas keyword.
_SCHEDULE_KEYS = {
    "base_image_seq_len": "base_seq_len",
    "max_image_seq_len": "max_seq_len",
    "base_shift": "base_shift",
    "max_shift": "max_shift",
    "shift_terminal": "shift_terminal",
}


def schedule_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """core.schedule.qwen_image_sigmas's keywords from a diffusers scheduler config.

    A key the config omits takes FlowMatchEulerDiscreteScheduler's default, as in the pipeline's scheduler.
    """
    full = complete_scheduler_config(config)
    if not full["use_dynamic_shifting"] or full["time_shift_type"] != "exponential":
        raise ValueError(
            f"scheduler config has use_dynamic_shifting={full['use_dynamic_shifting']}, time_shift_type="
            f"{full['time_shift_type']!r}; Qwen-Image's schedule needs true and 'exponential' (its scheduler_config.json)"
        )
    return {ours: full[theirs] for theirs, ours in _SCHEDULE_KEYS.items()}


def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]: 2x2 patches as tokens, channel-major inside a token."""
    return rearrange(x, "b c (h p) (w q) -> b (h w) (c p q)", p=2, q=2)


def unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack`: [B, (h/2)(w/2), 4C] -> [B, C, h, w]."""
    return rearrange(x, "b (h w) (c p q) -> b c (h p) (w q)", h=h // 2, w=w // 2, p=2, q=2)


class QwenImage(PatchedLatents):
    """Qwen-Image (text encoder, transformer, VAE) as a FlowModel. Weights are frozen; LoRA goes on later."""

    family = "Qwen-Image"

    merge_targets = (
        QWEN_IMAGE_IMAGE_STREAM_LORA  # what model.merged_rollout merges (rollout.engine.MergedLora)
    )

    def __init__(
        self,
        transformer: QwenImageTransformer2DModel,
        vae: AutoencoderKLQwenImage,
        text_encoder: torch.nn.Module | None,
        tokenizer,
        *,
        scheduler_config: Mapping[str, Any] = SCHEDULER_CONFIG,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        prompt_cache_size: int = 1024,
        split_cfg: bool = False,
    ):
        self.transformer = transformer
        self.split_cfg = split_cfg
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.schedule_kwargs = schedule_kwargs(scheduler_config)
        self.max_sequence_length = max_sequence_length
        # diffusers annotates ConfigMixin.config as dict[str, Any]; it is a FrozenDict with attribute access.
        tcfg: Any = transformer.config
        vcfg: Any = vae.config
        self.vae_scale = 2 ** len(vae.temperal_downsample)
        self.patch = tcfg.patch_size
        self.latent_channels = vcfg.z_dim
        if tcfg.in_channels != self.latent_channels * self.patch**2:
            raise ValueError(
                f"transformer in_channels={tcfg.in_channels} != VAE z_dim {self.latent_channels} "
                f"x patch {self.patch}^2; the transformer and VAE do not belong together"
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
        load_text_encoder: bool = True,
        **kwargs,
    ) -> Self:
        """Load a diffusers-format Qwen-Image directory or hub id (subfolders transformer, vae, ...)."""
        from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
        from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
        from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

        path = str(path)
        transformer = QwenImageTransformer2DModel.from_pretrained(
            path, subfolder="transformer", torch_dtype=dtype
        )
        vae = AutoencoderKLQwenImage.from_pretrained(path, subfolder="vae", torch_dtype=dtype)
        text_encoder = None
        if load_text_encoder:
            text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
                path, subfolder="text_encoder", dtype=text_encoder_dtype or dtype
            )
        tokenizer = Qwen2Tokenizer.from_pretrained(path, subfolder="tokenizer")
        return cls.from_modules(
            transformer,
            vae,
            text_encoder,
            tokenizer,
            device=device,
            scheduler_config=FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler"),
            **kwargs,
        )

    @classmethod
    def from_modules(cls, transformer, vae, text_encoder, tokenizer, *, device=None, **kwargs) -> Self:
        """Freeze the modules (eval mode, no grads), move them to `device`, wrap them."""
        freeze(transformer, vae, text_encoder, device=device)
        return cls(transformer, vae, text_encoder, tokenizer, **kwargs)

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor]:
        """One prompt -> its conditioning tokens [L, D] in the transformer's dtype (template prefix dropped)."""
        if self.text_encoder is None:
            raise RuntimeError("this QwenImage was built without a text encoder; pass one to encode prompts")
        tokens = self.tokenizer(
            [PROMPT_TEMPLATE.format(prompt)],
            max_length=self.max_sequence_length + PROMPT_DROP,
            truncation=True,
            return_tensors="pt",
        ).to(module_device(self.text_encoder))
        out = self.text_encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        )
        hidden = out.hidden_states[-1][0, PROMPT_DROP:][: self.max_sequence_length]  # [L, D]
        return (hidden.to(device=self.device, dtype=self.dtype),)

    def encode(self, prompts: Sequence[str], *, negative_prompt: str | None = None) -> Cond:
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

    def velocity(
        self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Cond, *, guidance_scale: float
    ) -> torch.Tensor:
        """v(x_t, sigma) [B, C, h, w] fp32; true CFG (per-token norm rescale) when guidance_scale > 1."""
        B, _, h, w = x_t.shape
        sigma = torch.as_tensor(sigma, device=x_t.device).float().expand(B)
        embeds, mask = cond["prompt_embeds"], cond["prompt_mask"]
        x = pack(x_t)
        tokens = x.shape[1]
        x, img_shapes = self._image_sequence(x, cond, h, w)
        if guidance_scale <= 1.0:
            return unpack(self._forward(x, sigma, embeds, mask, img_shapes, tokens), h, w)
        if "neg_prompt_embeds" not in cond:
            raise ValueError(f"guidance_scale={guidance_scale} > 1 needs a negative prompt in cond")
        neg, neg_mask = cond["neg_prompt_embeds"], cond["neg_prompt_mask"]
        if self.split_cfg:
            v_cond = self._forward(x, sigma, embeds, mask, img_shapes, tokens)
            v_uncond = self._forward(x, sigma, neg, neg_mask, img_shapes, tokens)
        else:
            length = max(embeds.shape[1], neg.shape[1])
            embeds, mask = pad_to(embeds, mask, length)
            neg, neg_mask = pad_to(neg, neg_mask, length)
            both = torch.cat([embeds, neg]), torch.cat([mask, neg_mask])
            out = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), *both, img_shapes, tokens)
            v_cond, v_uncond = out.chunk(2)
        out = guidance.true_cfg(v_cond, v_uncond, guidance_scale)  # per packed token
        return unpack(out, h, w)

    def _forward(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        img_shapes: Any,
        tokens: int,
    ) -> torch.Tensor:
        """One transformer call: image tokens x [B, N', 4C] and text [B, L, D] with its mask [B, L] -> the
        first `tokens` output tokens, fp32 [B, tokens, 4C]. The text is trimmed to these rows' longest prompt."""
        embeds, mask = trim_padding(embeds, mask)
        # Sequence parallelism splits the text tokens evenly over its ranks; the added tokens are masked keys, so
        # the image tokens' values do not change.
        multiple = sequence_multiple(self.transformer)
        embeds, mask = pad_to(embeds, mask, -(-embeds.shape[1] // multiple) * multiple)
        dtype = self.dtype
        return self.transformer(
            hidden_states=x.to(dtype),
            timestep=sigma.to(dtype),
            encoder_hidden_states=embeds.to(dtype),
            # No mask when nothing is padding: SDPA then takes its fastest (flash) path, as the pipeline does.
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[img_shapes] * x.shape[0],
            return_dict=False,
        )[0][:, :tokens].float()

    def _image_sequence(self, x: torch.Tensor, cond: Cond, h: int, w: int) -> tuple[torch.Tensor, Any]:
        """The transformer's image tokens for packed x_t [B, N, 4C] and one sample's RoPE shape(s) for
        `img_shapes`. Here x_t alone; an image-conditioned model appends its condition tokens after the N
        (velocity keeps the first N output tokens)."""
        return x, (1, h // self.patch, w // self.patch)

    @torch.no_grad()
    def decode(self, x0: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Clean latents [B, C, h, w] -> uint8 [B, H, W, 3]: undo the VAE's latent normalisation, decode."""
        cfg: Any = self.vae.config
        vdtype = module_dtype(self.vae)
        z = x0.to(vdtype)[:, :, None]  # [B, C, 1, h, w]: the VAE is a video VAE with one frame
        mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=vdtype).view(1, -1, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(cfg.latents_std, device=z.device, dtype=vdtype).view(1, -1, 1, 1, 1)
        z = z / inv_std + mean  # the pipeline's exact expression, so decoded pixels match it bit for bit
        images = self.vae.decode(z, return_dict=False)[0][:, :, 0]  # [B, 3, H, W] in [-1, 1]
        return to_uint8(images)
