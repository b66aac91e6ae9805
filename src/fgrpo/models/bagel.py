"""BAGEL (ByteDance-Seed/BAGEL-7B-MoT) text-to-image behind the FlowModel interface, on fgrpo's own module (bagel_mot).

Architecture (the BAGEL paper, sec. 2, and its released modeling code): a Qwen2 decoder whose every layer is a
Mixture-of-Transformer-Experts. Each layer holds two full sets of weights, the understanding expert (text tokens)
and the generation expert (VAE latent tokens): pre-attention RMSNorm, q/k/v (with bias) and o projections, q/k
RMSNorms (QK-norm), post-attention RMSNorm and the SwiGLU MLP. A token goes through its own expert's weights; the
attention is one softmax over the whole sequence. The final RMSNorm is per expert too.

Text-to-image sequence and attention (BAGEL's inference context):
- the prompt, `<|im_start|> ids <|im_end|>`, runs causally through the understanding experts at RoPE positions
  0 .. L - 1; its keys and values depend on the prompt only;
- the image query `<|vision_start|> latents <|vision_end|>` follows: the two markers are text tokens (understanding
  experts), the latent tokens use the generation experts; every query token sits at the same RoPE position L (one
  position for the whole image) and attends to all prompt tokens and to the whole query (full, not causal);
- a latent token's input is vae2llm(patch) + timestep_embedding(sigma) + a fixed 2D sin-cos position embedding of its
  (row, column) in a max_latent_size^2 grid; its output is llm2vae(norm_gen(h)), the velocity noise - x0.
Latents: the FLUX VAE's 16 channels at 1/8 scale, (z - shift) * scale; the transformer reads 2x2 patches as
64-vector tokens (channel fastest, BAGEL's patchify). x_t here is the unpatchified [16, H/8, W/8].

Sampling (BAGEL's generate_image): t = linspace(1, 0, N + 1) under the static shift t -> s t / (1 + (s - 1) t)
(timestep_shift s = 3 at inference; BAGEL's num_timesteps counts the N + 1 grid points), Euler steps x <- x - v dt. Text guidance: the unconditional branch sees no
prompt at all (an empty context: the image query at position 0), v = v_u + g (v_c - v_u) only while
sigma > cfg_interval[0] (0.4), then the global renorm v <- v * clamp(|v_c| / |v|, cfg_renorm_min, 1) with norms over
a whole sample (core.guidance.renormed_cfg). Image guidance needs an input image: not supported. (BAGEL's app leaves
cfg_img_scale at 1.5 for text-to-image too; with no image its image branch is the conditional one, so that is text
guidance 1 + 1.5 (g - 1); guidance_scale here is the notebook's setting, cfg_img_scale 1.)

Text KV: the prompt's keys and values do not depend on the latents and its experts are frozen (LoRA adapts only the
generation experts, as verl-omni does), so they are computed once per distinct prompt, without grad, and cached;
the rollout and the recompute read the same cache entry, so their velocities agree bit for bit. Training the
understanding experts is out of scope: their weights get no gradient.

Differs from BAGEL's inferencer: batched rows padded with a key mask (theirs packs one sequence per sample); the
renorm's norm is per sample (theirs over the packed batch, which its code notes is meant for batch size 1).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
import torch.nn.functional as F

from fgrpo.core import guidance, schedule
from fgrpo.errors import ConfigError
from fgrpo.models.bagel_mot import BagelTransformer, convert_bagel_state_dict, sincos_2d, transformer_config
from fgrpo.models.base import Cond
from fgrpo.models.common import (
    OnTransformer,
    PromptCache,
    check_resolution,
    decode_scaled_latents,
    freeze,
    trim_padding,
)

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL

# BAGEL's inference defaults for text-to-image (its inferencer / app): timestep_shift 3, text CFG 4 inside the
# interval (0.4, 1], global renorm with no lower clamp.
TIMESTEP_SHIFT = 3.0
CFG_INTERVAL = (0.4, 1.0)
CFG_RENORM_MIN = 0.0

# The generation experts' Linear layers (verl-omni trains BAGEL with LoRA on the generation experts only): each
# layer's attention q/k/v/o and SwiGLU MLP of the `gen` expert. As peft name suffixes they cannot match `und`.
BAGEL_LORA_TARGETS = (
    "gen.q_proj",
    "gen.k_proj",
    "gen.v_proj",
    "gen.o_proj",
    "gen.mlp.gate_proj",
    "gen.mlp.up_proj",
    "gen.mlp.down_proj",
)


# ------------------------------------------------------------------------------------------------


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """[N, C, H, W] -> [N, (H / p)(W / p), p * p * C], each token (row, col, channel) with the channel fastest."""
    N, C, H, W = x.shape
    x = x.reshape(N, C, H // p, p, W // p, p)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(N, (H // p) * (W // p), p * p * C)


def unpatchify(tokens: torch.Tensor, p: int, C: int, H: int, W: int) -> torch.Tensor:
    """patchify's inverse: [N, T, p * p * C] -> [N, C, H, W]."""
    N = tokens.shape[0]
    x = tokens.reshape(N, H // p, W // p, p, p, C)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(N, C, H, W)


class Bagel(OnTransformer):
    """BAGEL (MoT decoder, FLUX VAE, Qwen2 tokenizer) as a FlowModel. Weights frozen; LoRA goes on later."""

    # Transformer passes a step takes with guidance_scale > 1 (the text-guidance branch); the benchmarks' FLOP counts
    # read it.
    cfg_forwards = 2

    def __init__(
        self,
        transformer: BagelTransformer,
        vae: AutoencoderKL,
        tokenizer: Any,
        *,
        timestep_shift: float = TIMESTEP_SHIFT,
        cfg_interval: tuple[float, float] = CFG_INTERVAL,
        cfg_renorm_min: float = CFG_RENORM_MIN,
        prompt_cache_size: int = 1024,
    ):
        self.transformer = transformer
        self.vae = vae
        self.tokenizer = tokenizer
        self.timestep_shift = timestep_shift
        self.cfg_interval = cfg_interval
        self.cfg_renorm_min = cfg_renorm_min
        tcfg: Any = transformer.config
        vcfg: Any = vae.config
        self.vae_scale = 2 ** (len(vcfg.block_out_channels) - 1)
        self.patch = tcfg.latent_patch_size
        self.latent_channels = vcfg.latent_channels
        if tcfg.latent_channels != self.latent_channels:
            raise ValueError(
                f"transformer latent_channels={tcfg.latent_channels} != VAE latent_channels {self.latent_channels}; "
                "the transformer and VAE do not belong together"
            )
        ids = tokenizer.convert_tokens_to_ids(
            ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
        )
        self.bos, self.eos = ids[0], ids[1]
        self.markers = torch.tensor(ids[2:])
        # the prompts' KV, keyed on their token ids (the tuple of a row's real ids)
        self.kv_cache = PromptCache(self._kv_one, prompt_cache_size)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        vae_path: str | Path | None = None,
        **kwargs,
    ) -> Self:
        """Load BAGEL's released directory (BAGEL-7B-MoT: llm_config.json, ema.safetensors, the tokenizer files;
        the latent geometry is read off the checkpoint, see bagel_mot.transformer_config). The VAE is FLUX.1's in
        diffusers' format: `vae_path` (default <path>/vae), e.g. a copy of black-forest-labs/FLUX.1-dev's vae folder
        (BAGEL ships the same weights as ae.safetensors, FLUX's own layout)."""
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        root = Path(path)
        for name in ("llm_config.json", "ema.safetensors"):
            if not (root / name).is_file():
                raise ConfigError(f"model.path: no {name} in '{root}'; pass a local BAGEL-7B-MoT directory")
        vae_dir = Path(vae_path) if vae_path is not None else root / "vae"
        if not (vae_dir / "config.json").is_file():
            raise ConfigError(
                f"model.path: no diffusers VAE at '{vae_dir}'; copy FLUX.1-dev's vae folder to {root / 'vae'}"
            )
        vae = AutoencoderKL.from_pretrained(str(vae_dir), torch_dtype=dtype)
        ckpt = load_file(str(root / "ema.safetensors"))
        llm_cfg = json.loads((root / "llm_config.json").read_text())
        cfg = transformer_config(llm_cfg, ckpt, latent_channels=vae.config["latent_channels"])
        with torch.device("meta"):
            transformer = BagelTransformer(**cfg)
        sd = convert_bagel_state_dict(ckpt)
        transformer.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True, assign=True)
        transformer.register_buffer(
            "latent_pos_embed",
            sincos_2d(cfg["hidden_size"], transformer.max_latent_size),
            persistent=False,
        )
        tokenizer = AutoTokenizer.from_pretrained(str(root))
        return cls.from_modules(transformer, vae, tokenizer, device=device, **kwargs)

    @classmethod
    def from_modules(cls, transformer, vae, tokenizer, *, device=None, **kwargs) -> Self:
        """Freeze the modules (eval mode, no grads), move them to `device`, wrap them."""
        freeze(transformer, vae, device=device)
        return cls(transformer, vae, tokenizer, **kwargs)

    # ------------------------------------------------------------------------------------------------
    def _ids(self, prompt: str) -> torch.Tensor:
        """BAGEL's context text: <|im_start|> prompt <|im_end|>; the empty prompt is the empty context (no tokens,
        the unconditional branch of text guidance)."""
        if prompt == "":
            return torch.zeros(0, dtype=torch.long)
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return torch.tensor([self.bos, *ids, self.eos], dtype=torch.long)

    def _kv_one(self, ids: tuple[int, ...]) -> tuple[torch.Tensor]:
        return (self.transformer.text_kv(torch.tensor(ids, device=self.device)),)

    def _rows(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, L] zero-padded and their mask [B, L] (L >= 1 even when every row is empty)."""
        rows = [self._ids(p) for p in prompts]
        ids = torch.zeros(len(rows), max(1, *(len(r) for r in rows)), dtype=torch.long)
        mask = torch.zeros(ids.shape, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, True
        return ids.to(self.device), mask.to(self.device)

    def encode(self, prompts: Sequence[str], *, negative_prompt: str | None = None) -> Cond:
        """Prompt token ids [B, L] (zero-padded) with their mask [B, L]; with `negative_prompt`, its `neg_*` rows
        ('' = BAGEL's unconditional context: no tokens)."""
        if len(prompts) == 0:
            raise ValueError("prompts is empty; pass at least one prompt")
        ids, mask = self._rows(prompts)
        cond = {"prompt_ids": ids, "prompt_mask": mask}
        if negative_prompt is not None:
            cond["neg_prompt_ids"], cond["neg_prompt_mask"] = self._rows([negative_prompt] * len(prompts))
        return cond

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        check_resolution("BAGEL", height, width, self.vae_scale * self.patch)
        return (self.latent_channels, height // self.vae_scale, width // self.vae_scale)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """BAGEL's grid linspace(1, 0, N + 1) under its timestep shift (core.schedule.static_shift_sigmas)."""
        self.latent_shape(height, width)
        return schedule.static_shift_sigmas(num_steps, self.timestep_shift)

    def sigmas_at(self, num_steps: int, height: int, width: int, positions: torch.Tensor) -> torch.Tensor:
        self.latent_shape(height, width)
        return schedule.static_shift_sigmas_at(positions, num_steps, self.timestep_shift)

    def velocity(
        self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Cond, *, guidance_scale: float
    ) -> torch.Tensor:
        """v(x_t, sigma) [B, C, h, w] fp32; BAGEL's text guidance (one batched forward over both branches, the
        renorm, the interval) when guidance_scale > 1."""
        B = x_t.shape[0]
        sigma = torch.as_tensor(sigma, device=x_t.device).float().expand(B)
        ids, mask = cond["prompt_ids"], cond["prompt_mask"]
        if guidance_scale <= 1.0:
            return self._forward(x_t, sigma, ids, mask)
        if "neg_prompt_ids" not in cond:
            raise ValueError(f"guidance_scale={guidance_scale} > 1 needs a negative prompt in cond")
        nids, nmask = cond["neg_prompt_ids"], cond["neg_prompt_mask"]
        L = max(ids.shape[1], nids.shape[1])
        both_ids = torch.cat([F.pad(ids, (0, L - ids.shape[1])), F.pad(nids, (0, L - nids.shape[1]))])
        both_mask = torch.cat([F.pad(mask, (0, L - mask.shape[1])), F.pad(nmask, (0, L - nmask.shape[1]))])
        v_cond, v_uncond = self._forward(
            torch.cat([x_t, x_t]), torch.cat([sigma, sigma]), both_ids, both_mask
        ).chunk(2)
        guided = guidance.renormed_cfg(v_cond, v_uncond, guidance_scale, min_ratio=self.cfg_renorm_min)
        lo, hi = self.cfg_interval
        inside = ((sigma > lo) & (sigma <= hi)).view(B, *[1] * (x_t.dim() - 1))
        return torch.where(inside, guided, v_cond.float())

    def _forward(
        self, x: torch.Tensor, sigma: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """One transformer call on latents [N, C, h, w] and prompt rows -> velocity fp32 [N, C, h, w]."""
        ids, mask = trim_padding(ids[..., None], mask)
        ids = ids[..., 0]
        kvs = []
        for row, m in zip(ids, mask, strict=True):
            key = tuple(row[m].tolist())
            if key:
                kvs.append(self.kv_cache(key)[0])
            else:  # the empty context: one masked zero slot keeps the shapes
                t = self.transformer
                kvs.append(
                    torch.zeros(
                        len(t.layers),
                        2,
                        t.num_kv_heads,
                        0,
                        t.head_dim,
                        device=x.device,
                        dtype=self.dtype,
                    )
                )
        L = mask.shape[1]
        text_kv = torch.stack([F.pad(kv, (0, 0, 0, L - kv.shape[3])) for kv in kvs])
        N, C, H, W = x.shape
        out = self.transformer(
            patchify(x.to(self.dtype), self.patch),
            sigma,
            (H // self.patch, W // self.patch),
            text_kv,
            mask,
            self.markers.to(x.device),
        )
        return unpatchify(out.float(), self.patch, C, H, W)

    @torch.no_grad()
    def decode(self, x0: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Clean latents [B, C, h, w] -> uint8 [B, H, W, 3], truncated to integers as BAGEL's decode_image does."""
        return decode_scaled_latents(self.vae, x0, truncate=True)
