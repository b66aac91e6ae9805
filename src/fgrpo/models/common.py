"""Small pieces the diffusers-backed models share: the prompt cache, padding, resolution checks, pixels."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import torch

from fgrpo.core import schedule

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL


Key = TypeVar("Key", bound=Hashable)


class PromptCache(Generic[Key]):
    """A bounded LRU of per-prompt encodings (a tuple of tensors per key).

    The G samples of a group share one prompt, and prompts recur across steps; the text encoder is
    run once per distinct string, alone (batch of one, no padding), so an encoding depends on its
    prompt only and never on which other prompts shared the batch. A key may be any hashable (an
    image-conditioned model keys on the (prompt, image) pair).
    """

    def __init__(self, encode_one: Callable[[Key], tuple[torch.Tensor, ...]], max_size: int = 1024):
        if max_size < 1:
            raise ValueError(f"prompt cache max_size must be >= 1, got {max_size}")
        self._encode_one = encode_one
        self._max_size = max_size
        self._store: OrderedDict[Key, tuple[torch.Tensor, ...]] = OrderedDict()

    def __call__(self, prompt: Key) -> tuple[torch.Tensor, ...]:
        if prompt in self._store:
            self._store.move_to_end(prompt)
            return self._store[prompt]
        out = self._encode_one(prompt)
        self._store[prompt] = out
        if len(self._store) > self._max_size:
            self._store.popitem(last=False)
        return out

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        self._store.clear()


def complete_scheduler_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A flow-match scheduler config (a model's scheduler_config.json) with diffusers' defaults for the keys it
    omits: what the FlowMatchEulerDiscreteScheduler a pipeline builds from that file holds."""
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    return {**FlowMatchEulerDiscreteScheduler().config, **config}


def pad_stack(seqs: list[torch.Tensor], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[L_i, D] tensors -> zero-padded [N, L, D] and a bool mask [N, L] (True on real tokens)."""
    length = max(s.shape[0] for s in seqs) if length is None else length
    out = seqs[0].new_zeros(len(seqs), length, seqs[0].shape[-1])
    mask = torch.zeros(len(seqs), length, dtype=torch.bool, device=seqs[0].device)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
        mask[i, : s.shape[0]] = True
    return out, mask


def pad_to(embeds: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad [B, L, D] embeddings (zeros) and [B, L] mask (False) to `length` tokens."""
    extra = length - embeds.shape[1]
    if extra <= 0:
        return embeds, mask
    return (
        torch.nn.functional.pad(embeds, (0, 0, 0, extra)),
        torch.nn.functional.pad(mask, (0, extra), value=False),
    )


def trim_padding(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop trailing token columns that are padding in every row.

    A stored Trajectory pads prompts to the longest of the whole rollout batch; trimming to the longest
    of the rows actually passed makes the forward's shapes a function of those rows alone, so rollout
    and training (same rows) see identical shapes, and short prompts do not pay for a long neighbour.
    """
    active = mask.any(0).nonzero()
    length = int(active.max()) + 1 if active.numel() else 1
    return embeds[:, :length], mask[:, :length]


def check_resolution(name: str, height: int, width: int, multiple: int) -> None:
    """Raise a one-line error unless height and width are positive multiples of `multiple` pixels."""
    for field, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or value <= 0 or value % multiple:
            near = (
                max(multiple, round(value / multiple) * multiple)
                if isinstance(value, int | float)
                else multiple
            )
            raise ValueError(
                f"{field}={value} is not a positive multiple of {multiple} px ({name}: VAE factor x patch size); "
                f"use e.g. {field}={near}"
            )


def to_uint8(images: torch.Tensor, *, truncate: bool = False) -> torch.Tensor:
    """VAE output in [-1, 1], [B, 3, H, W] -> uint8 [B, H, W, 3] on the CPU (diffusers' postprocess rounding;
    truncate: the cast's floor instead, as pipelines that convert with .to(uint8) do, e.g. BAGEL's)."""
    x = (images.float() / 2 + 0.5).clamp(0, 1) * 255
    return (x if truncate else x.round()).to(torch.uint8).permute(0, 2, 3, 1).cpu()


def decode_scaled_latents(vae: AutoencoderKL, x0: torch.Tensor, *, truncate: bool = False) -> torch.Tensor:
    """Clean latents [B, C, h, w] of an AutoencoderKL scaled as (z - shift_factor) * scaling_factor (SD3's, FLUX's)
    -> uint8 [B, H, W, 3]: the pipelines' unscaling, the VAE's decode, to_uint8's pixel conversion."""
    cfg: Any = vae.config
    z = x0.to(module_dtype(vae)) / cfg.scaling_factor + cfg.shift_factor
    return to_uint8(vae.decode(z, return_dict=False)[0], truncate=truncate)


def freeze(*modules: torch.nn.Module | None, device: torch.device | str | None = None) -> None:
    """Frozen pipeline parts: eval mode, no gradients, moved to `device` (None: left where they are; a None
    module, e.g. an absent text encoder, is skipped). LoRA goes on the transformer afterwards."""
    for m in modules:
        if m is not None:
            m.requires_grad_(False).eval()
            if device is not None:
                m.to(device)


def module_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype a module computes in: its first parameter's outside the modules diffusers and transformers keep in
    float32 on a low-precision load (`_keep_in_fp32_modules`, matched as they match it: a substring of the name;
    Wan's `scale_shift_table` comes first). Their own `dtype` property applies the same rule but first walks every
    submodule for casting hooks, milliseconds a call at real size, and the families ask on every forward."""
    keep = getattr(module, "_keep_in_fp32_modules", None) or ()
    for name, param in module.named_parameters():
        if not any(k in name for k in keep):
            return param.dtype
    return next(module.parameters()).dtype


def stacked_prompt_states(
    cache: Callable[[str], tuple[torch.Tensor, ...]], prompts: Sequence[str], negative_prompt: str | None
) -> dict[str, torch.Tensor]:
    """The conditioning of families whose prompt states all have one length (a fixed padded length, or one shared
    by the batch): `prompt_embeds` [B, L, D] from each prompt's cached states, and with a negative prompt its
    states as `neg_prompt_embeds`, one (shared, expanded) row per prompt."""
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass at least one prompt")
    cond = {"prompt_embeds": torch.stack([cache(p)[0] for p in prompts])}
    if negative_prompt is not None:
        (neg,) = cache(negative_prompt)
        cond["neg_prompt_embeds"] = neg[None].expand(len(prompts), -1, -1)
    return cond


class _HasTransformer(Protocol):
    @property
    def transformer(self) -> torch.nn.Module: ...


class OnTransformer:
    """A model's device and dtype: its transformer's (the module LoRA wraps and FSDP shards). The families' one
    definition of both; a family keeps its own type of `transformer`."""

    @property
    def device(self: _HasTransformer) -> torch.device:
        return module_device(self.transformer)

    @property
    def dtype(self: _HasTransformer) -> torch.dtype:
        return module_dtype(self.transformer)


class PatchedLatents(OnTransformer):
    """Latents [C, H / vae_scale, W / vae_scale] that the transformer reads as (h / patch) x (w / patch) tokens,
    sampled on the dynamically shifted schedule of their token count (core.schedule.qwen_image_sigmas): the
    families whose latents, resolution rule and schedule are these (Qwen-Image, FLUX.1) set the attributes."""

    family: ClassVar[str]  # the name a resolution error gives
    vae_scale: int
    patch: int
    latent_channels: int
    schedule_kwargs: dict[str, Any]

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        check_resolution(self.family, height, width, self.vae_scale * self.patch)
        return (self.latent_channels, height // self.vae_scale, width // self.vae_scale)

    def _tokens(self, height: int, width: int) -> int:
        _, h, w = self.latent_shape(height, width)
        return (h // self.patch) * (w // self.patch)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        return schedule.qwen_image_sigmas(num_steps, self._tokens(height, width), **self.schedule_kwargs)

    def sigmas_at(self, num_steps: int, height: int, width: int, positions: torch.Tensor) -> torch.Tensor:
        seq_len = self._tokens(height, width)
        return schedule.qwen_image_sigmas_at(positions, num_steps, seq_len, **self.schedule_kwargs)
