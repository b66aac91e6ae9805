"""BAGEL's Mixture-of-Transformer-Experts decoder with its generation heads, as an nn.Module (a diffusers ModelMixin),
and the mapping from BAGEL's released checkpoint keys to it. The FlowModel around it is fgrpo.models.bagel, whose
docstring describes the architecture and the sampling."""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from fgrpo.errors import ConfigError


class RMSNorm(nn.Module):
    """Qwen2's RMSNorm: normalise in fp32, then the weight in the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """One token stream's weights in one layer (BAGEL's plain or `_moe_gen` parameters)."""

    def __init__(self, dim: int, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(dim, eps)
        self.q_proj = nn.Linear(dim, heads * head_dim)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = MLP(dim, hidden)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fp32_qk: bool = False):
        """Residual stream [N, S, D] -> q [N, H, S, Dh], k, v [N, Hkv, S, Dh] (QK-norm, then RoPE on q and k).

        fp32_qk: QK-norm and RoPE on fp32 q and k, rounded to the input dtype after. BAGEL's attention does this in
        its "gen" mode (the image query, markers included) but not for the prompt; in bf16 the roundings differ."""
        x = self.input_layernorm(h)
        N, S, _ = x.shape
        q = self.q_proj(x).view(N, S, self.heads, self.head_dim)
        k = self.k_proj(x).view(N, S, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(N, S, self.kv_heads, self.head_dim).transpose(1, 2)
        if fp32_qk:
            q, k = q.float(), k.float()
        q, k = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2)
        return rope(q, cos, sin).to(v.dtype), rope(k, cos, sin).to(v.dtype), v

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention output [N, S, H * Dh] and the MLP."""
        h = h + self.o_proj(attn)
        return h + self.mlp(self.post_attention_layernorm(h))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Qwen2's rotary embedding (halves rotated): x cos + rotate_half(x) sin; cos, sin [N, 1, S, Dh]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def sincos_2d(dim: int, size: int) -> torch.Tensor:
    """The fixed 2D sin-cos table of a size x size grid, [size * size, dim] fp32, row r * size + c: the first half
    encodes the column, the second the row, each as [sin, cos] of position / 10000^(i / (dim / 4)) (MAE's table,
    which BAGEL's latent_pos_embed holds)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")

    def one(pos: torch.Tensor) -> torch.Tensor:
        out = pos.reshape(-1, 1).double() * omega
        return torch.cat([out.sin(), out.cos()], dim=1)

    return torch.cat([one(cols), one(rows)], dim=1).float()


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """DiT's sinusoidal embedding of t [N] (BAGEL feeds sigma in [0, 1] unscaled): [cos(t f), sin(t f)], [N, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int, freq_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.freq_dim = freq_dim

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        emb = timestep_embedding(t, self.freq_dim)
        return self.mlp(emb.to(next(self.mlp.parameters()).dtype))


class BagelLayer(nn.Module):
    """One MoT decoder layer: the understanding and generation experts around one shared attention."""

    fsdp_forward_methods = ("text_forward",)  # fgrpo.parallel.shard_transformer gives it FSDP's hooks

    def __init__(self, dim: int, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.und = Expert(dim, hidden, heads, kv_heads, head_dim, eps)
        self.gen = Expert(dim, hidden, heads, kv_heads, head_dim, eps)

    def forward(
        self,
        h: torch.Tensor,
        text_k: torch.Tensor,
        text_v: torch.Tensor,
        key_mask: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Image query h [N, 2 + T, D] (markers first and last: understanding; the T latents: generation) against
        the prompt's keys/values [N, Hkv, L, Dh]; key_mask [N, L + 2 + T] (False on prompt padding)."""
        mid = slice(1, -1)
        und_rows = h[:, [0, -1]]
        qu, ku, vu = self.und.qkv(und_rows, cos[:, :, :2], sin[:, :, :2], fp32_qk=True)
        qg, kg, vg = self.gen.qkv(h[:, mid], cos[:, :, 1:-1], sin[:, :, 1:-1], fp32_qk=True)

        def order(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # back to [marker, latents, marker]
            return torch.cat([a[:, :, :1], b, a[:, :, 1:]], dim=2)

        q = order(qu, qg)
        k = torch.cat([text_k, order(ku, kg)], dim=2)
        v = torch.cat([text_v, order(vu, vg)], dim=2)
        rep = q.shape[1] // k.shape[1]  # grouped-query attention: each key head serves `rep` query heads
        attn = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=key_mask[:, None, None, :]
        )
        attn = attn.transpose(1, 2).flatten(2)  # [N, 2 + T, H * Dh]
        out_und = self.und.finish(und_rows, attn[:, [0, -1]])
        out_gen = self.gen.finish(h[:, mid], attn[:, mid])
        return torch.cat([out_und[:, :1], out_gen, out_und[:, 1:]], dim=1)

    def text_forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The prompt alone, causal, understanding expert: (h_next, k, v) for h [1, L, D]."""
        q, k, v = self.und.qkv(h, cos, sin)
        rep = q.shape[1] // k.shape[1]
        attn = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
        )
        return self.und.finish(h, attn.transpose(1, 2).flatten(2)), k, v


class BagelTransformer(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """BAGEL's MoT decoder with its generation heads (timestep embedder, vae2llm, llm2vae, latent positions).

    A diffusers ModelMixin so that peft's add_adapter, gradient checkpointing and regional compile work on it as on
    the other families' transformers. Its vision (ViT) branch and LM head are not part of text-to-image.
    """

    _supports_gradient_checkpointing = True
    fsdp_forward_methods = ("text_kv",)  # fgrpo.parallel.shard_transformer gives it FSDP's hooks
    _repeated_blocks = ["BagelLayer"]
    _no_split_modules = ["BagelLayer"]

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 152064,
        hidden_size: int = 3584,
        intermediate_size: int = 18944,
        num_hidden_layers: int = 28,
        num_attention_heads: int = 28,
        num_key_value_heads: int = 4,
        rope_theta: float = 1_000_000.0,
        rms_norm_eps: float = 1e-6,
        latent_channels: int = 16,
        latent_patch_size: int = 2,
        max_latent_size: int = 64,
        timestep_freq_dim: int = 256,
    ):
        super().__init__()
        head_dim = hidden_size // num_attention_heads
        self.head_dim = head_dim
        # plain attributes: diffusers' config is typed as a dict
        self.rope_theta, self.max_latent_size, self.num_kv_heads = (
            rope_theta,
            max_latent_size,
            num_key_value_heads,
        )
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            BagelLayer(
                hidden_size,
                intermediate_size,
                num_attention_heads,
                num_key_value_heads,
                head_dim,
                rms_norm_eps,
            )
            for _ in range(num_hidden_layers)
        )
        self.norm_gen = RMSNorm(hidden_size, rms_norm_eps)  # the generation expert's final norm
        self.time_embedder = TimestepEmbedder(hidden_size, timestep_freq_dim)
        patch_dim = latent_patch_size**2 * latent_channels
        self.vae2llm = nn.Linear(patch_dim, hidden_size)
        self.llm2vae = nn.Linear(hidden_size, patch_dim)
        self.register_buffer("latent_pos_embed", sincos_2d(hidden_size, max_latent_size), persistent=False)
        self.gradient_checkpointing = False

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [N, 1, S, Dh] of integer positions [N, S] (Qwen2's inverse frequencies, fp32 angles)."""
        dh = self.head_dim
        inv = 1.0 / self.rope_theta ** (
            torch.arange(0, dh, 2, dtype=torch.float32, device=positions.device) / dh
        )
        ang = positions.float()[..., None] * inv  # [N, S, Dh / 2]
        emb = torch.cat([ang, ang], dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.no_grad()
    def text_kv(self, ids: torch.Tensor) -> torch.Tensor:
        """A prompt's token ids [L] -> its keys and values at every layer, [layers, 2, Hkv, L, Dh] (causal,
        understanding experts, RoPE positions 0 .. L - 1)."""
        h = self.embed_tokens(ids[None])
        cos, sin = self.rope_cos_sin(torch.arange(ids.shape[0], device=ids.device)[None], h.dtype)
        kvs = []
        for layer in self.layers:
            assert isinstance(layer, BagelLayer)
            h, k, v = layer.text_forward(h, cos, sin)
            kvs.append(torch.stack([k[0], v[0]]))
        return torch.stack(kvs)

    def forward(
        self,
        tokens: torch.Tensor,
        sigma: torch.Tensor,
        grid: tuple[int, int],
        text_kv: torch.Tensor,
        text_mask: torch.Tensor,
        markers: torch.Tensor,
    ) -> torch.Tensor:
        """Velocity tokens of one batch.

        Args:
            tokens: [N, T, patch_dim] patchified x_t, row-major over the (h, w) = grid of patches.
            sigma: [N] the flow time (1 = noise).
            text_kv: [N, layers, 2, Hkv, L, Dh] the prompts' keys/values (text_kv), zero where text_mask is False.
            text_mask: [N, L] True on real prompt tokens (a row may have none: the unconditional context).
            markers: [2] token ids of <|vision_start|> and <|vision_end|>.

        Returns:
            [N, T, patch_dim] in the module's dtype.
        """
        N, T, _ = tokens.shape
        dtype = self.vae2llm.weight.dtype
        h, w = grid
        size = self.max_latent_size
        if h > size or w > size:
            raise ValueError(f"{h}x{w} latent patches exceed BAGEL's max_latent_size={size} per side")
        pos_ids = (
            torch.arange(h, device=tokens.device)[:, None] * size + torch.arange(w, device=tokens.device)
        ).flatten()
        lat = (
            self.vae2llm(tokens.to(dtype))
            + self.time_embedder(sigma)[:, None]
            + self.latent_pos_embed[pos_ids].to(dtype)
        )
        mark = self.embed_tokens(markers).expand(N, 2, -1)
        x = torch.cat([mark[:, :1], lat, mark[:, 1:]], dim=1)
        # the whole image query at the position right after the prompt
        positions = text_mask.sum(1, keepdim=True).expand(N, T + 2)
        cos, sin = self.rope_cos_sin(positions, dtype)
        key_mask = torch.cat([text_mask, text_mask.new_ones(N, T + 2)], dim=1)
        checkpoint = self._gradient_checkpointing_func if self.gradient_checkpointing else None
        for i, layer in enumerate(self.layers):
            args = (x, text_kv[:, i, 0], text_kv[:, i, 1], key_mask, cos, sin)
            if torch.is_grad_enabled() and checkpoint is not None:
                x = checkpoint(layer, *args)
            else:
                x = layer(*args)
        return self.llm2vae(self.norm_gen(x[:, 1:-1]))


# ------------------------------------------------------------------------------------------------
# BAGEL's released checkpoint (ema.safetensors) -> BagelTransformer's names.

_LAYER_KEY = re.compile(
    r"language_model\.model\.layers\.(\d+)\.(?:self_attn\.)?"
    r"(input_layernorm|post_attention_layernorm|q_proj|k_proj|v_proj|o_proj|q_norm|k_norm|mlp)"
    r"(_moe_gen)?(\..+)$"
)
_OTHER_KEYS = {
    "language_model.model.embed_tokens.weight": "embed_tokens.weight",
    "language_model.model.norm_moe_gen.weight": "norm_gen.weight",
}
_HEAD_PREFIXES = ("time_embedder.", "vae2llm.", "llm2vae.")
# Parts of the checkpoint that text-to-image does not use: the ViT branch, the LM head, the understanding expert's
# final norm (its outputs are never read), and the position table (rebuilt from its formula).
_UNUSED = re.compile(
    r"(vit_model|connector|vit_pos_embed)\.|language_model\.lm_head\.|language_model\.model\.norm\.weight$"
    r"|latent_pos_embed\."
)


def bagel_key(name: str) -> str | None:
    """A key of BAGEL's checkpoint -> BagelTransformer's parameter name, None for a part text-to-image drops.
    Raises KeyError on a key of neither kind (a different checkpoint)."""
    if m := _LAYER_KEY.match(name):
        layer, part, gen, rest = m.groups()
        return f"layers.{layer}.{'gen' if gen else 'und'}.{part}{rest}"
    if name in _OTHER_KEYS:
        return _OTHER_KEYS[name]
    if name.startswith(_HEAD_PREFIXES):
        return name
    if _UNUSED.match(name):
        return None
    raise KeyError(name)


def convert_bagel_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BAGEL's checkpoint tensors under BagelTransformer's names (the unused parts dropped)."""
    out = {}
    for k, v in sd.items():
        try:
            name = bagel_key(k)
        except KeyError:
            raise ConfigError(
                f"model.path: '{k}' is not a key of BAGEL's checkpoint layout; pass BAGEL-7B-MoT"
            ) from None
        if name is not None:
            out[name] = v
    return out


def transformer_config(
    llm_config: dict[str, Any], checkpoint: dict[str, torch.Tensor], latent_channels: int
) -> dict[str, Any]:
    """BagelTransformer's config from BAGEL's llm_config.json (a Qwen2Config), its checkpoint's tensors and the
    VAE's latent channels.

    The latent geometry comes from the weights, not from config.json: BAGEL's own loader (app.py, the inferencer)
    sets latent_patch_size=2 and max_latent_size=64 in code, and BagelConfig's defaults (max_latent_size=32) differ,
    so only the checkpoint's latent_pos_embed table (max_latent_size^2 rows) and vae2llm's input width
    (patch^2 * latent_channels) say what the weights were trained with. A missing Qwen2 field takes Qwen2Config's
    default, as BAGEL's loader would (rope_theta 10000, 32 key/value heads)."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    cfg = {k: llm_config[k] for k in keys}
    cfg["num_key_value_heads"] = llm_config.get("num_key_value_heads", 32)
    cfg["rope_theta"] = llm_config.get("rope_theta", 10_000.0)
    cfg["rms_norm_eps"] = llm_config.get("rms_norm_eps", 1e-6)
    for key in ("latent_pos_embed.pos_embed", "vae2llm.weight"):
        if key not in checkpoint:
            raise ConfigError(f"model.path: ema.safetensors has no {key}; pass BAGEL-7B-MoT's checkpoint")
    table = checkpoint["latent_pos_embed.pos_embed"]
    size = math.isqrt(table.shape[0])
    if size * size != table.shape[0]:
        raise ConfigError(
            f"model.path: latent_pos_embed.pos_embed has {table.shape[0]} rows, not a square grid"
        )
    width = checkpoint["vae2llm.weight"].shape[1]
    patch = math.isqrt(width // latent_channels)
    if patch * patch * latent_channels != width:
        raise ConfigError(
            f"model.path: vae2llm reads {width}-wide tokens, not patch^2 x the VAE's {latent_channels} channels; "
            "pass FLUX.1's VAE"
        )
    cfg |= {"max_latent_size": size, "latent_patch_size": patch, "latent_channels": latent_channels}
    return cfg
