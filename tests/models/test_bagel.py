"""BAGEL on tiny random weights: the sampling loop against a plain reading of BAGEL's generate_image (η = 0), the
schedule, SDE/ODE transitions, bit-exact recompute with and without LoRA, LoRA export and reload, the MoT routing,
and loading a directory in BAGEL's released checkpoint layout. (Parity with vLLM-Omni's BAGEL pipeline needs a GPU
and the real weights: not here.)"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import cast

import pytest
import torch
from safetensors.torch import save_file

from fgrpo.config import SamplingConfig
from fgrpo.core import sde
from fgrpo.errors import ConfigError
from fgrpo.models import tiny
from fgrpo.models.bagel import BAGEL_LORA_TARGETS, Bagel
from fgrpo.models.bagel_mot import BagelLayer, bagel_key, convert_bagel_state_dict, transformer_config
from fgrpo.models.base import FlowModel
from fgrpo.models.lora import add_lora, export_lora, load_lora_weights
from fgrpo.models.registry import build_tiny
from fgrpo.policy import transition
from fgrpo.recompute import recompute_log_prob, recompute_log_probs
from fgrpo.rollout.engine import DiffusersEngine, forward_units
from fgrpo.rollout.seeds import sample_generator

SIZE = 64
PROMPTS = ["a cat", "a photo of a dog on a red square", "x"]
SEEDS = [11, 12, 13]
BASE = SamplingConfig(
    height=SIZE, width=SIZE, num_steps=5, guidance_scale=4.0, negative_prompt="", sde_kind="flow_sde",
    noise_level=0.7, window_size=2, window_range=(0, 4), micro_batch=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return tiny.tiny_bagel(seed=0)


def _lora(m: Bagel, seed: int = 0) -> None:
    """LoRA on the generation experts with a trained-looking B (nonzero), so it changes the velocity."""
    add_lora(m.transformer, rank=2, alpha=4, target_modules=BAGEL_LORA_TARGETS)
    with torch.no_grad():
        for n, p in m.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed + len(n)))


def test_model_implements_the_protocol_and_lora_targets_are_the_generation_experts(model):
    assert isinstance(model, FlowModel) and isinstance(build_tiny("bagel"), Bagel)
    m = tiny.tiny_bagel(seed=0)
    _lora(m)
    adapted = {n.rsplit(".lora_", 1)[0] for n, _ in m.transformer.named_parameters() if "lora_A" in n}
    assert len(adapted) == 2 * len(BAGEL_LORA_TARGETS)  # every target in both layers
    assert all(".gen." in n for n in adapted)
    assert all(not p.requires_grad for n, p in m.transformer.named_parameters() if "lora_" not in n)


# ------------------------------------------------------------------------------------------------
# A plain reading of BAGEL's text-to-image sampling (modeling/bagel/bagel.py generate_image / _forward_flow and
# qwen2_navit.py's MoT layer in "gen" mode), one sample at a time, on the module's raw weights.


def _rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [S, H, Dh], pos [S]: rotate the two halves by angle pos * theta^(-2i / Dh)
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2).double() / d)
    ang = (pos.double()[:, None] * freq)[:, None, :].float()
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1)


def _layer_qkv(e, x, pos, cfg):
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    Dh = cfg.hidden_size // H
    h = _rms(x, e.input_layernorm.weight)
    q = (h @ e.q_proj.weight.T + e.q_proj.bias).view(-1, H, Dh)
    k = (h @ e.k_proj.weight.T + e.k_proj.bias).view(-1, Hkv, Dh)
    v = (h @ e.v_proj.weight.T + e.v_proj.bias).view(-1, Hkv, Dh)
    q, k = _rms(q, e.q_norm.weight), _rms(k, e.k_norm.weight)
    return _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta), v


def _attend(q, k, v, causal):  # q [S, H, Dh], k, v [K, Hkv, Dh]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("shd,khd->hsk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones_like(s[0], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hsk,khd->shd", s.softmax(-1), v).flatten(1)


def _finish(e, x, a):
    x = x + a @ e.o_proj.weight.T
    h = _rms(x, e.post_attention_layernorm.weight)
    mlp = e.mlp
    return (
        x
        + (torch.nn.functional.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T))
        @ mlp.down_proj.weight.T
    )


def _context(t, ids):
    """The prompt's KV cache: causal, understanding weights, positions 0 .. L - 1 (forward_cache_update_text)."""
    x, pos, cache = t.embed_tokens.weight[ids], torch.arange(len(ids)), []
    for layer in t.layers:
        q, k, v = _layer_qkv(layer.und, x, pos, t.config)
        cache.append((k, v))
        x = _finish(layer.und, x, _attend(q, k, v, causal=True))
    return cache


def _pos_table(dim, size):
    """modeling_utils.get_2d_sincos_pos_embed: np.meshgrid(grid_w, grid_h) (w first), the first half of each row
    from grid[0] (the column), the second from grid[1] (the row), each half [sin, cos] at 1 / 10000^(i / (dim / 4))."""
    grid = torch.stack(torch.meshgrid(torch.arange(size), torch.arange(size), indexing="xy")).double()

    def one(d, pos):
        omega = 1.0 / 10000 ** (torch.arange(d // 2).double() / (d / 2))
        out = pos.reshape(-1)[:, None] * omega[None]
        return torch.cat([out.sin(), out.cos()], dim=1)

    return torch.cat([one(dim // 2, grid[0]), one(dim // 2, grid[1])], dim=1).float()


def _flow(t, x_tokens, sigma, cache, n_text, hw, markers):
    """_forward_flow for one sample: the query [start, latents, end], all at rope position n_text, text tokens on
    the understanding weights (packed_text_indexes), latents on the generation ones (packed_vae_token_indexes)."""
    cfg = t.config
    n = x_tokens.shape[0]
    h, w = hw
    pos_ids = torch.tensor([r * cfg.max_latent_size + c for r in range(h) for c in range(w)])
    half = cfg.timestep_freq_dim // 2
    f = torch.exp(-math.log(10000) * torch.arange(half) / half) * sigma
    temb = torch.cat([f.cos(), f.sin()]) @ t.time_embedder.mlp[0].weight.T + t.time_embedder.mlp[0].bias
    temb = torch.nn.functional.silu(temb) @ t.time_embedder.mlp[2].weight.T + t.time_embedder.mlp[2].bias
    table = _pos_table(cfg.hidden_size, cfg.max_latent_size)
    lat = x_tokens @ t.vae2llm.weight.T + t.vae2llm.bias + temb + table[pos_ids]
    seq = torch.cat([t.embed_tokens.weight[markers[:1]], lat, t.embed_tokens.weight[markers[1:]]])
    text_idx, vae_idx = [0, n + 1], list(range(1, n + 1))
    pos = torch.full((n + 2,), n_text)
    for layer, (ck, cv) in zip(t.layers, cache, strict=True):
        q, k, v = torch.empty(n + 2, cfg.num_attention_heads, t.head_dim), [], []
        qu, ku, vu = _layer_qkv(layer.und, seq[text_idx], pos[text_idx], cfg)
        qg, kg, vg = _layer_qkv(layer.gen, seq[vae_idx], pos[vae_idx], cfg)
        q = torch.cat([qu[:1], qg, qu[1:]])
        k = torch.cat([ck, ku[:1], kg, ku[1:]])
        v = torch.cat([cv, vu[:1], vg, vu[1:]])
        a = _attend(q, k, v, causal=False)
        out = seq.clone()
        out[text_idx] = _finish(layer.und, seq[text_idx], a[text_idx])
        out[vae_idx] = _finish(layer.gen, seq[vae_idx], a[vae_idx])
        seq = out
    return _rms(seq[vae_idx], t.norm_gen.weight) @ t.llm2vae.weight.T + t.llm2vae.bias


def _patchify(x, p=2):  # [C, H, W] -> [(H/p)(W/p), p*p*C], BAGEL's einsum "chpwq->hwpqc"
    C, H, W = x.shape
    return torch.einsum("chpwq->hwpqc", x.reshape(C, H // p, p, W // p, p)).reshape(-1, p * p * C)


def _unpatchify(tokens, C, H, W, p=2):
    x = tokens.reshape(H // p, W // p, p, p, C)
    return torch.einsum("hwpqc->chpwq", x).reshape(C, H, W)


def _generate_image(m: Bagel, prompt, x1, num_timesteps, cfg_text_scale):
    """generate_image: num_timesteps grid points linspace(1, 0, num_timesteps) shifted (num_timesteps - 1 steps),
    Euler x <- x - v dt, text CFG against the empty context inside cfg_interval, then the global renorm."""
    t = m.transformer
    tok = m.tokenizer
    ids = torch.tensor(
        [
            tok.convert_tokens_to_ids("<|im_start|>"),
            *tok(prompt)["input_ids"],
            tok.convert_tokens_to_ids("<|im_end|>"),
        ]
    )
    markers = torch.tensor(tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"]))
    cache = _context(t, ids)
    empty = [(k[:0], v[:0]) for k, v in cache]
    C, H, W = x1.shape
    hw = (H // 2, W // 2)
    s = m.timestep_shift
    ts = torch.linspace(1, 0, num_timesteps)
    ts = s * ts / (1 + (s - 1) * ts)
    dts = ts[:-1] - ts[1:]
    x = _patchify(x1)
    for i, sig in enumerate(ts[:-1]):
        v = _flow(t, x, sig, cache, len(ids), hw, markers)
        if cfg_text_scale > 1.0 and 0.4 < sig <= 1.0:
            v_u = _flow(t, x, sig, empty, 0, hw, markers)
            v_ = v_u + cfg_text_scale * (v - v_u)
            v = v_ * (v.norm() / (v_.norm() + 1e-8)).clamp(min=0.0, max=1.0)
        x = x - v * dts[i]
    return _unpatchify(x, C, H, W)


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_ode_rollout_matches_a_plain_reading_of_bagels_sampling_loop(model, guidance_scale):
    # 8 steps: the last sigmas (0.3, 0) fall outside the guidance interval (0.4, 1]
    cfg = dataclasses.replace(
        BASE, num_steps=8, window_size=0, window_range=(0, 0), guidance_scale=guidance_scale, micro_batch=3
    )
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    assert traj.x0 is not None
    with torch.no_grad():
        for i, seed in enumerate(SEEDS):
            x1 = torch.randn(model.latent_shape(SIZE, SIZE), generator=sample_generator(seed))
            # BAGEL's num_timesteps counts grid points: N steps are num_timesteps = N + 1
            ref = _generate_image(model, PROMPTS[i], x1, cfg.num_steps + 1, guidance_scale)
            assert ref.abs().max() > 0.5
            torch.testing.assert_close(traj.x0[i], ref, rtol=0, atol=2e-5)
    assert traj.images.shape == (3, SIZE, SIZE, 3) and traj.images.dtype == torch.uint8


def test_decode_truncates_pixels_as_bagels_decode_image(model):
    x0 = torch.randn(2, *model.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        z = x0 / 0.3611 + 0.1159  # the FLUX VAE's scale and shift, BAGEL's autoencoder params
        pixels = (model.vae.decode(z, return_dict=False)[0] * 0.5 + 0.5).clamp(0, 1) * 255
    # inferencer.decode_image converts with .to(torch.uint8): a floor, where diffusers rounds
    want = pixels.to(torch.uint8).permute(0, 2, 3, 1)
    got = model.decode(x0, SIZE, SIZE)
    assert torch.equal(got, want) and not torch.equal(got, pixels.round().to(torch.uint8).permute(0, 2, 3, 1))


def test_schedule_is_bagels_shifted_linspace(model):
    for n in (5, 49):
        ts = torch.linspace(1, 0, n + 1)
        ts = 3.0 * ts / (1 + 2.0 * ts)
        ours = model.sigmas(n, SIZE, SIZE)
        torch.testing.assert_close(ours, ts, rtol=0, atol=1e-6)
        assert torch.equal(model.sigmas_at(n, SIZE, SIZE, torch.arange(n)), ours[:-1])


def test_guidance_only_inside_the_interval_and_one_batched_forward(model, monkeypatch):
    calls = []
    forward = model.transformer.forward

    def record(*args, **kwargs):
        calls.append(len(args[0]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model.transformer, "forward", record)
    x = torch.randn(2, *model.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(0))
    cond = model.encode(PROMPTS[:2], negative_prompt="")
    sigma = torch.tensor([0.9, 0.3])  # inside (0.4, 1] and outside
    v1 = model.velocity(x, sigma, cond, guidance_scale=1.0)
    v4 = model.velocity(x, sigma, cond, guidance_scale=4.0)
    assert calls == [2, 4]
    assert (v1[0] - v4[0]).abs().max() > 1e-3
    torch.testing.assert_close(
        v4[1], v1[1], rtol=0, atol=1e-6
    )  # the conditional branch alone (batch rounding)
    with pytest.raises(ValueError, match="needs a negative prompt"):
        model.velocity(x, sigma, model.encode(PROMPTS[:2]), guidance_scale=4.0)


def test_sde_and_ode_transitions(model):
    cond = model.encode(PROMPTS[:2], negative_prompt="")
    x = torch.randn(2, *model.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(1))
    s, s_next = torch.tensor([0.9, 0.7]), torch.tensor([0.8, 0.5])
    v = model.velocity(x, s, cond, guidance_scale=BASE.guidance_scale)
    mean, std = transition(model, x, s, s_next, cond, BASE, stochastic=False)
    torch.testing.assert_close(mean, x + (s_next - s).view(2, 1, 1, 1) * v, rtol=0, atol=1e-6)
    assert (std == 0).all()
    mean_sde, std_sde = transition(model, x, s, s_next, cond, BASE)
    want_mean, want_std = sde.step_mean_std(x, v, s, s_next, noise_level=0.7, kind="flow_sde")
    assert torch.equal(mean_sde, want_mean) and torch.equal(std_sde, want_std) and (std_sde > 0).all()


@pytest.mark.parametrize("lora", [False, True])
def test_recomputed_log_probs_equal_the_rollouts_bit_exactly(lora):
    m = tiny.tiny_bagel(seed=2)
    if lora:
        _lora(m)
    cfg = dataclasses.replace(BASE, num_steps=4, window_range=(1, 3))
    traj = DiffusersEngine(m).generate(PROMPTS, SEEDS, cfg)
    assert torch.isfinite(traj.log_prob).all() and traj.x_t.shape == (3, 2, 4, 8, 8)
    assert torch.equal(recompute_log_probs(m, traj, cfg), traj.log_prob)
    if not lora:
        return
    rows = forward_units(traj.window, cfg.micro_batch)[0]
    log_prob, _, _ = recompute_log_prob(m, traj, cfg, rows, 1)
    assert torch.equal(log_prob.detach(), traj.log_prob[rows, 1])
    log_prob.sum().backward()
    named = dict(m.transformer.named_parameters())
    lora_grads = [p.grad for n, p in named.items() if "lora_" in n]
    assert lora_grads and all(g is not None and g.abs().max() > 0 for g in lora_grads)
    assert all(p.grad is None for n, p in named.items() if ".und." in n or "embed_tokens" in n)


def test_mot_routing_each_weight_moves_only_its_stream():
    """A generation expert's weight changes the velocity but not the prompt's KV; the understanding expert's last
    MLP only feeds the markers' final states, which nothing reads; its first-layer weights move both."""
    m = tiny.tiny_bagel(seed=3)
    cond = m.encode(PROMPTS[:2])
    x = torch.randn(2, *m.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.8, 0.5])
    ids = cond["prompt_ids"][0][cond["prompt_mask"][0]]

    def run():
        m.kv_cache.clear()
        return m.velocity(x, sigma, cond, guidance_scale=1.0), m.transformer.text_kv(ids)

    v0, kv0 = run()
    layers = [cast(BagelLayer, layer) for layer in m.transformer.layers]
    for weight, moves_v, moves_kv in (
        (layers[0].gen.k_proj.weight, True, False),
        (layers[1].gen.mlp.up_proj.weight, True, False),
        (layers[1].und.mlp.up_proj.weight, False, False),
        (layers[0].und.q_proj.weight, True, True),
        (layers[1].und.k_proj.weight, True, True),
    ):
        saved = weight.detach().clone()
        with torch.no_grad():
            weight.add_(0.5)
        v, kv = run()
        with torch.no_grad():
            weight.copy_(saved)
        assert (not torch.equal(v, v0)) == moves_v
        assert (not torch.equal(kv, kv0)) == moves_kv


def test_image_query_qk_norm_and_rope_run_in_fp32_as_bagels_gen_mode(monkeypatch):
    t = tiny.tiny_bagel_components(seed=0)["transformer"].to(torch.bfloat16)
    layer = cast(BagelLayer, t.layers[0])
    e = layer.gen
    h = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    cos, sin = t.rope_cos_sin(torch.full((1, 5), 7), torch.bfloat16)
    # PackedAttentionMoT.forward_inference, mode "gen": q, k cast to fp32 before q_norm / k_norm and RoPE
    x = e.input_layernorm(h)
    q = e.q_proj(x).view(1, 5, 4, 8).float()
    q = (e.q_norm.weight * (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6))).transpose(1, 2)
    q1, q2 = q.chunk(2, dim=-1)
    want = (q * cos + torch.cat([-q2, q1], dim=-1) * sin).bfloat16()
    got = e.qkv(h, cos, sin, fp32_qk=True)[0]
    assert torch.equal(got, want) and not torch.equal(e.qkv(h, cos, sin)[0], want)
    seen = []
    qkv = type(e).qkv
    monkeypatch.setattr(type(e), "qkv", lambda self, *a, **k: seen.append(k) or qkv(self, *a, **k))
    kv = torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)
    cos, sin = t.rope_cos_sin(torch.full((1, 4), 3), torch.bfloat16)
    layer(h[:, :4], kv, kv, torch.ones(1, 7, dtype=torch.bool), cos, sin)
    assert seen == [{"fp32_qk": True}] * 2  # both experts' rows of the image query
    layer.text_forward(h, cos[:, :, :1].expand(1, 1, 5, 8), sin[:, :, :1].expand(1, 1, 5, 8))
    assert seen[-1] == {}  # the prompt pass stays in the module dtype, as BAGEL's "und" mode


def test_export_lora_reloads_to_identical_velocities(tmp_path):
    trained = tiny.tiny_bagel(seed=4)
    _lora(trained, seed=1)
    cond = trained.encode(PROMPTS, negative_prompt="")
    x = torch.randn(3, *trained.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(3))
    sigma = torch.tensor([0.9, 0.6, 0.2])
    want = trained.velocity(x, sigma, cond, guidance_scale=4.0)
    out = export_lora(tmp_path / "lora", trained.transformer)
    fresh = tiny.tiny_bagel(seed=4)
    base = fresh.velocity(x, sigma, cond, guidance_scale=4.0)
    add_lora(fresh.transformer, rank=2, alpha=4, target_modules=BAGEL_LORA_TARGETS)
    load_lora_weights(fresh.transformer, out, rank=2, alpha=4)
    got = fresh.velocity(x, sigma, cond, guidance_scale=4.0)
    assert not torch.allclose(base, want) and torch.equal(got, want)


def _to_bagel_layout(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> BAGEL's ema.safetensors names, written out by hand, plus parts that loading drops."""
    out = {}
    for name, v in sd.items():
        parts = name.split(".")
        if parts[0] == "layers":
            i, expert, rest = parts[1], parts[2], ".".join(parts[3:])
            suffix = "_moe_gen" if expert == "gen" else ""
            module, tail = rest.split(".", 1)
            attn = module in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
            out[f"language_model.model.layers.{i}.{'self_attn.' if attn else ''}{module}{suffix}.{tail}"] = v
        elif name == "embed_tokens.weight":
            out["language_model.model.embed_tokens.weight"] = v
        elif name == "norm_gen.weight":
            out["language_model.model.norm_moe_gen.weight"] = v
        else:
            out[name] = v
    hidden = sd["embed_tokens.weight"].shape[1]
    out["language_model.model.norm.weight"] = torch.ones(hidden)
    out["language_model.lm_head.weight"] = torch.zeros_like(sd["embed_tokens.weight"])
    out["vit_model.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    out["connector.fc1.weight"] = torch.zeros(hidden, 4)
    out["latent_pos_embed.pos_embed"] = torch.zeros(16 * 16, hidden)
    return out


def test_key_mapping_and_loading_bagels_checkpoint_layout(tmp_path, model):
    parts = tiny.tiny_bagel_components(seed=0)
    t = parts["transformer"]
    bagel_sd = _to_bagel_layout(t.state_dict())
    assert (
        bagel_key("language_model.model.layers.1.self_attn.q_proj_moe_gen.bias") == "layers.1.gen.q_proj.bias"
    )
    assert (
        bagel_key("language_model.model.layers.0.mlp.down_proj.weight") == "layers.0.und.mlp.down_proj.weight"
    )
    assert bagel_key("language_model.model.layers.0.input_layernorm_moe_gen.weight") == (
        "layers.0.gen.input_layernorm.weight"
    )
    assert bagel_key("vit_model.anything") is None
    assert convert_bagel_state_dict(bagel_sd).keys() == t.state_dict().keys()

    root = tmp_path / "BAGEL-tiny"
    root.mkdir()
    save_file({k: v.contiguous() for k, v in bagel_sd.items()}, str(root / "ema.safetensors"))
    c = t.config
    llm = {k: c[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    llm |= {k: c[k] for k in ("num_attention_heads", "num_key_value_heads", "rope_theta", "rms_norm_eps")}
    (root / "llm_config.json").write_text(json.dumps(llm))
    # BagelConfig's defaults: BAGEL's loader never reads these (it sets the geometry in code), and neither may ours;
    # the checkpoint's 16 x 16 position table and vae2llm's width fix it
    bagel_cfg = {
        "latent_patch_size": 1,
        "max_latent_size": 32,
        "vae_config": {"z_channels": 16, "downsample": 8},
    }
    (root / "config.json").write_text(json.dumps(bagel_cfg))
    parts["vae"].save_pretrained(root / "vae")
    parts["tokenizer"].save_pretrained(root)
    loaded = Bagel.from_pretrained(root, dtype=torch.float32, device="cpu")
    public = lambda cfg: {k: v for k, v in cfg.items() if not k.startswith("_")}  # noqa: E731
    assert public(loaded.transformer.config) == public(c)
    cond = model.encode(PROMPTS, negative_prompt="")
    x = torch.randn(3, *model.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.9, 0.6, 0.2])
    want = model.velocity(x, sigma, cond, guidance_scale=4.0)
    assert torch.equal(
        loaded.velocity(x, sigma, loaded.encode(PROMPTS, negative_prompt=""), guidance_scale=4.0), want
    )


def test_transformer_config_reads_the_geometry_off_the_checkpoint_and_qwen2s_defaults():
    llm = {"vocab_size": 8, "hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1}
    llm |= {"num_attention_heads": 2}
    ckpt = {"latent_pos_embed.pos_embed": torch.zeros(9, 4), "vae2llm.weight": torch.zeros(4, 36)}
    cfg = transformer_config(llm, ckpt, latent_channels=4)
    assert (cfg["max_latent_size"], cfg["latent_patch_size"], cfg["latent_channels"]) == (3, 3, 4)
    # Qwen2Config's defaults, what BAGEL's loader falls back to
    assert (cfg["rope_theta"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]) == (10_000.0, 32, 1e-6)
    with pytest.raises(ConfigError, match="8 rows, not a square grid"):
        transformer_config(llm, ckpt | {"latent_pos_embed.pos_embed": torch.zeros(8, 4)}, latent_channels=4)
    with pytest.raises(
        ConfigError, match="vae2llm reads 36-wide tokens, not patch\\^2 x the VAE's 16 channels"
    ):
        transformer_config(llm, ckpt, latent_channels=16)
    with pytest.raises(ConfigError, match="ema.safetensors has no latent_pos_embed.pos_embed"):
        transformer_config(llm, {"vae2llm.weight": torch.zeros(4, 36)}, latent_channels=4)


def test_unknown_checkpoint_key_and_missing_files_are_one_line_errors(tmp_path, model):
    with pytest.raises(ConfigError, match="'foo.weight' is not a key of BAGEL's checkpoint layout"):
        convert_bagel_state_dict({"foo.weight": torch.zeros(1)})
    with pytest.raises(ConfigError, match="no llm_config.json in"):
        Bagel.from_pretrained(tmp_path, device="cpu")
    with pytest.raises(ValueError, match=r"height=60 is not a positive multiple of 16 px \(BAGEL"):
        model.latent_shape(60, 64)
