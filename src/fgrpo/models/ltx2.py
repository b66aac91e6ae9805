"""LTX-2 (text to audio + video) behind the FlowModel interface, built from diffusers' and transformers' classes.

Text: Gemma 3 reads the prompt (left-padded to `max_sequence_length` tokens); the hidden states of every layer,
stacked, go through LTX2TextConnectors, which return one embedding sequence for the video stream, one for the
audio stream and their mask (LTX2Pipeline's recipe).
Video: AutoencoderKLLTX2Video latents [C, F', H/32, W/32] (F' = (F - 1) / 8 + 1), normalised per channel, packed
into tokens [F' H' W', C] (patch 1). Audio: AutoencoderKLLTX2Audio latents [C_a, L, M'] of the mel spectrogram,
packed into tokens [L, C_a M'] and normalised; L = round(F / fps * sample_rate / hop / 4) audio latent frames.

The state x_t of one sample is ONE flat vector: the packed video tokens, then the packed audio tokens,
[F' H' W' C + L C_a M']. The SDE step, the transition log-prob (a sum or mean over all elements) and the CPS
noise treat the joint audio-video latent as one action, so the core and the loop need no audio case; the
transformer sees the two streams, which it denoises jointly (audio <-> video cross-attention in every block).

The clip (frames, fps, height, width) is the model's, fixed when it is built (model.num_frames, ... of LTX2Config),
as in verl-omni: the FlowModel interface speaks of height and width only, and the flat latent does not say how its
video tokens lie on the frame grid, which the transformer's RoPE needs. latent_shape(height, width) refuses
another size with a one-line error.

Differs from LTX2Pipeline:
- Guidance is plain CFG with one scale for video and audio (the pipeline's x0-space CFG, the same velocity up to
  float rounding); no spatio-temporal guidance, modality-isolation guidance or guidance rescale (the pipeline's
  defaults switch them on: pass stg_scale=0, modality_scale=1, guidance_rescale=0 for the same sampler), as in
  verl-omni's joint audio-video CPS.
- Each distinct prompt is encoded alone and cached, so an encoding never depends on its batch-mates.
- decode returns the video frames (uint8 [B, F, H, W, 3]); the waveform is `decode_audio`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch

from fgrpo.config import ModelConfig
from fgrpo.core import guidance, schedule
from fgrpo.models.base import Cond
from fgrpo.models.common import (
    OnTransformer,
    PromptCache,
    check_resolution,
    freeze,
    module_device,
    module_dtype,
    to_uint8,
)
from fgrpo.models.qwen_image import schedule_kwargs

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
    from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import AutoencoderKLLTX2Audio
    from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformer3DModel

MAX_SEQUENCE_LENGTH = 1024
# LTX's own flow-match schedule (the pipeline's calculate_shift fallbacks 1024 / 4096 / 0.95 / 2.05 and LTX's
# sampler stretch to a terminal 0.1). A loaded model reads its scheduler_config.json; a model built in code uses this.
SCHEDULER_CONFIG: dict[str, Any] = {
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "shift_terminal": 0.1,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
# The transformer's Linear layers that LoRA adapts: video and audio self- and text cross-attention, the two
# cross-modal attentions, and both streams' MLPs (verl-omni's LTX-2.3 recipe targets these).
LTX2_LORA_TARGETS = tuple(
    f"{attn}.{proj}"
    for attn in ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
    for proj in ("to_q", "to_k", "to_v", "to_out.0")
) + ("ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2")


@dataclass(frozen=True)
class LTX2Config(ModelConfig):
    """model.kind 'ltx2' / 'tiny_ltx2': the generic model fields and the clip every sample is."""

    num_frames: int = 121
    """Video frames per clip (8k + 1; LTX2Pipeline's default 121)."""
    frame_rate: float = 24.0
    """Frames per second: the clip's duration, hence the audio length, and the video RoPE's time axis."""
    height: int = 512
    """Clip height in pixels; must equal sampling.height."""
    width: int = 768
    """Clip width in pixels; must equal sampling.width."""


class LTX2(OnTransformer):
    """LTX-2 (Gemma 3, connectors, audio-video transformer, video VAE, audio VAE, vocoder) as a FlowModel.

    Weights are frozen; LoRA goes on later. `num_frames` (8k + 1), `frame_rate`, `height` and `width` fix the clip
    every sample is.
    """

    # model.compile leaves the video VAE's decoder eager: compiled, it decodes no faster and costs a compile per
    # batch shape (benchmarks/RESULTS.md)
    compile_vae_decoder = False

    def __init__(
        self,
        transformer: LTX2VideoTransformer3DModel,
        vae: AutoencoderKLLTX2Video,
        audio_vae: AutoencoderKLLTX2Audio,
        vocoder: torch.nn.Module,
        connectors: torch.nn.Module,
        text_encoder: torch.nn.Module | None,
        tokenizer,
        *,
        num_frames: int = 121,
        frame_rate: float = 24.0,
        height: int = 512,
        width: int = 768,
        scheduler_config: Mapping[str, Any] = SCHEDULER_CONFIG,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        use_cross_timestep: bool = True,
        prompt_cache_size: int = 1024,
    ):
        self.transformer = transformer
        self.vae, self.audio_vae, self.vocoder = vae, audio_vae, vocoder
        self.connectors, self.text_encoder, self.tokenizer = connectors, text_encoder, tokenizer
        tcfg: Any = transformer.config
        acfg: Any = audio_vae.config
        self.spatial = vae.spatial_compression_ratio * tcfg.patch_size
        self.temporal = vae.temporal_compression_ratio
        if tcfg.patch_size != 1 or tcfg.patch_size_t != 1 or tcfg.audio_patch_size != 1:
            raise ValueError(
                "LTX2 packs latents with patch size 1 (LTX2Pipeline's); the transformer has another"
            )
        if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % self.temporal:
            raise ValueError(
                f"num_frames={num_frames}: LTX-2 needs {self.temporal}k + 1 frames (the VAE's temporal factor), "
                f"e.g. {max(1, round((num_frames - 1) / self.temporal)) * self.temporal + 1}"
            )
        if frame_rate <= 0:
            raise ValueError(f"frame_rate={frame_rate} must be > 0")
        self.num_frames, self.frame_rate = num_frames, float(frame_rate)
        check_resolution("LTX-2", height, width, self.spatial)
        self.height, self.width = height, width
        self.grid = ((num_frames - 1) // self.temporal + 1, height // self.spatial, width // self.spatial)
        self.video_channels = tcfg.in_channels
        self.audio_channels = acfg.latent_channels
        self.audio_mel_bins = acfg.mel_bins // audio_vae.mel_compression_ratio
        if tcfg.audio_in_channels != self.audio_channels * self.audio_mel_bins:
            raise ValueError(
                f"transformer audio_in_channels={tcfg.audio_in_channels} != audio VAE latent_channels "
                f"{self.audio_channels} x latent mel bins {self.audio_mel_bins}; the modules do not belong together"
            )
        # LTX2Pipeline: audio latent frames per second = sample_rate / hop / the audio VAE's temporal factor.
        per_second = acfg.sample_rate / acfg.mel_hop_length / float(audio_vae.temporal_compression_ratio)
        self.audio_frames = round(num_frames / self.frame_rate * per_second)
        self.audio_sample_rate = int(getattr(vocoder.config, "output_sampling_rate", acfg.sample_rate))
        self.schedule_kwargs = schedule_kwargs(scheduler_config)
        self.max_sequence_length = max_sequence_length
        self.use_cross_timestep = use_cross_timestep
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
        """Load a diffusers-format LTX-2 directory or hub id (LTX2Pipeline's layout, e.g. Lightricks/LTX-2)."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
        from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

        pipe = LTX2Pipeline.from_pretrained(str(path), torch_dtype=dtype)
        return cls.from_modules(
            **{k: getattr(pipe, k) for k in MODULES},
            device=device,
            scheduler_config=FlowMatchEulerDiscreteScheduler.load_config(str(path), subfolder="scheduler"),
            **kwargs,
        )

    @classmethod
    def from_modules(
        cls,
        transformer,
        vae,
        audio_vae,
        vocoder,
        connectors,
        text_encoder,
        tokenizer,
        *,
        device=None,
        **kwargs,
    ) -> Self:
        """Freeze the modules (eval mode, no grads), move them to `device`, wrap them."""
        freeze(transformer, vae, audio_vae, vocoder, connectors, text_encoder, device=device)
        return cls(transformer, vae, audio_vae, vocoder, connectors, text_encoder, tokenizer, **kwargs)

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One prompt -> (video text tokens [L, D], audio text tokens [L, D_a], mask [L]) in the transformer's dtype."""
        if self.text_encoder is None:
            raise RuntimeError("this LTX2 was built without a text encoder; pass one to encode prompts")
        self.tokenizer.padding_side = "left"  # Gemma's chat padding, as the pipeline sets it
        tokens = self.tokenizer(
            [prompt.strip()],
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).to(module_device(self.text_encoder))
        out = self.text_encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        )
        hidden = torch.stack(out.hidden_states, dim=-1).flatten(2, 3)  # [1, L, D * layers]
        cdtype, cdevice = module_dtype(self.connectors), module_device(self.connectors)
        video, audio, mask = self.connectors(
            hidden.to(cdevice, cdtype), tokens.attention_mask.to(cdevice), padding_side="left"
        )
        return (
            video[0].to(self.device, self.dtype),
            audio[0].to(self.device, self.dtype),
            mask[0].to(self.device, torch.bool),
        )

    def encode(self, prompts: Sequence[str], *, negative_prompt: str | None = None) -> Cond:
        if len(prompts) == 0:
            raise ValueError("prompts is empty; pass at least one prompt")
        enc = [self.prompt_cache(p) for p in prompts]
        cond = {k: torch.stack([e[i] for e in enc]) for i, k in enumerate(_TEXT_KEYS)}
        if negative_prompt is not None:
            B = len(prompts)
            neg = self.prompt_cache(negative_prompt)
            cond.update({f"neg_{k}": t[None].expand(B, *t.shape) for k, t in zip(_TEXT_KEYS, neg)})
        return cond

    # ------------------------------------------------------------------------------------------------
    def _check_size(self, height: int, width: int) -> None:
        if (height, width) != (self.height, self.width):
            raise ValueError(
                f"sampling {height}x{width} px is not this LTX-2's clip size {self.height}x{self.width}; set "
                "sampling.height/width equal to model.height/width"
            )

    def latent_shape(self, height: int, width: int) -> tuple[int]:
        """(D,): the packed video tokens' F'H'W'C elements, then the packed audio tokens' L C_a M'."""
        self._check_size(height, width)
        f, h, w = self.grid
        return (
            f * h * w * self.video_channels + self.audio_frames * self.audio_channels * self.audio_mel_bins,
        )

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat joint latents [B, D] -> packed video tokens [B, F'H'W', C] and packed audio tokens [B, L, C_a M']."""
        f, h, w = self.grid
        n = f * h * w * self.video_channels
        if x.shape[1] != n + self.audio_frames * self.audio_channels * self.audio_mel_bins:
            raise ValueError(
                f"latents [B, {x.shape[1]}] are not this LTX-2's clip (latent_shape {self.latent_shape(self.height, self.width)})"
            )
        return x[:, :n].unflatten(1, (f * h * w, -1)), x[:, n:].unflatten(1, (self.audio_frames, -1))

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """LTX2Pipeline's schedule: mu from the packed video token count F'H'W' (the audio tokens do not count)."""
        self._check_size(height, width)
        f, h, w = self.grid
        return schedule.qwen_image_sigmas(num_steps, f * h * w, **self.schedule_kwargs)

    def sigmas_at(self, num_steps: int, height: int, width: int, positions: torch.Tensor) -> torch.Tensor:
        self._check_size(height, width)
        f, h, w = self.grid
        return schedule.qwen_image_sigmas_at(positions, num_steps, f * h * w, **self.schedule_kwargs)

    def velocity(
        self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Cond, *, guidance_scale: float
    ) -> torch.Tensor:
        """v(x_t, sigma) [B, D] fp32 for the joint latent; plain CFG on both streams when guidance_scale > 1."""
        B = x_t.shape[0]
        f, h, w = self.grid
        video, audio = self.split(x_t)
        sigma = torch.as_tensor(sigma, device=x_t.device).float().expand(B)
        text = [cond[k] for k in _TEXT_KEYS]
        do_cfg = guidance_scale > 1.0
        if do_cfg:
            if f"neg_{_TEXT_KEYS[0]}" not in cond:
                raise ValueError(f"guidance_scale={guidance_scale} > 1 needs a negative prompt in cond")
            # [negative; positive], the pipeline's order.
            text = [torch.cat([cond[f"neg_{k}"], t]) for k, t in zip(_TEXT_KEYS, text)]
            video, audio, sigma = (
                torch.cat([video, video]),
                torch.cat([audio, audio]),
                torch.cat([sigma, sigma]),
            )
        embeds, audio_embeds, mask = text
        dtype = self.dtype
        t = sigma * 1000  # the scheduler's timestep scale, which the transformer's embeddings expect
        v_video, v_audio = self.transformer(
            hidden_states=video.to(dtype),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=embeds.to(dtype),
            audio_encoder_hidden_states=audio_embeds.to(dtype),
            timestep=t,
            sigma=t,  # LTX-2.3's prompt modulation reads the same scaled time (the pipeline passes both)
            encoder_attention_mask=mask.to(dtype),
            audio_encoder_attention_mask=mask.to(dtype),
            num_frames=f,
            height=h,
            width=w,
            fps=self.frame_rate,
            audio_num_frames=self.audio_frames,
            use_cross_timestep=self.use_cross_timestep,
            return_dict=False,
        )
        out = torch.cat([v_video.float().flatten(1), v_audio.float().flatten(1)], dim=1)
        if do_cfg:
            v_uncond, v_cond = out.chunk(2)
            out = guidance.cfg(v_cond, v_uncond, guidance_scale)
        return out

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, x0: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Clean joint latents [B, D] -> video frames uint8 [B, F, H, W, 3]: unpack and denormalise the video
        tokens, decode them with the video VAE (decode timestep 0, the pipeline's default)."""
        self._check_size(height, width)
        f, h, w = self.grid
        video, _ = self.split(x0)
        cfg: Any = self.vae.config
        vdtype = module_dtype(self.vae)
        z = video.to(vdtype).unflatten(1, (f, h, w)).permute(0, 4, 1, 2, 3)  # [B, C, F', H', W']
        mean = self.vae.latents_mean.view(1, -1, 1, 1, 1).to(z.device, vdtype)
        std = self.vae.latents_std.view(1, -1, 1, 1, 1).to(z.device, vdtype)
        z = (
            z * std / cfg.scaling_factor + mean
        )  # the pipeline's _denormalize_latents, operation for operation
        timestep = (
            torch.zeros(z.shape[0], device=z.device, dtype=vdtype) if cfg.timestep_conditioning else None
        )
        frames = self.vae.decode(z, timestep, return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
        return torch.stack([to_uint8(frames[:, :, i]) for i in range(frames.shape[2])], dim=1)

    @torch.no_grad()
    def decode_audio(self, x0: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Clean joint latents [B, D] -> waveform float32 [B, channels, samples] at `audio_sample_rate` Hz:
        denormalise the audio tokens, unpack them to [C_a, L, M'], decode the mel spectrogram, vocode it."""
        self._check_size(height, width)
        _, audio = self.split(x0)
        adtype = module_dtype(self.audio_vae)
        mean = self.audio_vae.latents_mean.to(audio.device, audio.dtype)
        std = self.audio_vae.latents_std.to(audio.device, audio.dtype)
        z = audio * std + mean  # the pipeline's _denormalize_audio_latents, on the packed tokens
        z = z.unflatten(2, (-1, self.audio_mel_bins)).transpose(1, 2)  # [B, C_a, L, M']
        mel = self.audio_vae.decode(z.to(adtype), return_dict=False)[0]
        return self.vocoder(mel.to(module_dtype(self.vocoder))).float().cpu()

    @torch.no_grad()
    def reward_metadata(self, x0: torch.Tensor, height: int, width: int) -> list[dict[str, Any]]:
        """What the rollout hands a reward besides the frames, per sample: the decoded waveform (float32
        [channels, samples]) and its sample rate, the input of the `audio` reward (rewards.video)."""
        wave = self.decode_audio(x0, height, width).numpy()
        return [{"audio": w, "sample_rate": self.audio_sample_rate} for w in wave]


_TEXT_KEYS = ("prompt_embeds", "audio_prompt_embeds", "prompt_mask")
MODULES = ("transformer", "vae", "audio_vae", "vocoder", "connectors", "text_encoder", "tokenizer")


def clip_kwargs(mcfg: ModelConfig) -> dict[str, Any]:
    """The clip fields of an LTX2Config (none for a plain ModelConfig: the builder's defaults then)."""
    if not isinstance(mcfg, LTX2Config):
        return {}
    return dict(num_frames=mcfg.num_frames, frame_rate=mcfg.frame_rate, height=mcfg.height, width=mcfg.width)
