"""Wan 2.2 text-to-video on tiny random modules, one expert (TI2V-5B-like) and two (T2V-A14B-like): WanPipeline parity
(encodings, η = 0 sampling, decoded frames) with its scheduler swapped for the flow-match Euler one our sampler steps
on, the expert switch at the pipeline's boundary, bit-exact log-prob recompute with and without LoRA (both experts),
and LoRA export that WanPipeline loads into each expert."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, cast

import pytest
import torch
from diffusers.pipelines.wan.pipeline_wan import WanPipeline

from fgrpo.config import SamplingConfig
from fgrpo.models import tiny
from fgrpo.models.base import FlowModel
from fgrpo.models.lora import add_lora
from fgrpo.models.registry import build_model
from fgrpo.models.wan import WAN_LORA_TARGETS, Wan, WanConfig, export_expert_loras
from fgrpo.recompute import recompute_log_prob, recompute_log_probs
from fgrpo.rollout.engine import DiffusersEngine, forward_units
from fgrpo.rollout.seeds import sample_generator

PROMPTS = ["a cat", "a sign that says hello world", "x"]
SEEDS = [11, 12, 13]
# Pixels per variant: the 5B-like VAE compresses 16x (and the transformer patchifies 2x2), the A14B-like one 8x.
SIZE = {1: 64, 2: 32}
# 5 steps at shift 3: t = 1000, 900, 750, 500, 9, so the two-expert model runs transformer for two steps (t >= 875)
# and transformer_2 for three.
BASE = SamplingConfig(
    height=32, width=32, num_steps=5, guidance_scale=3.0, negative_prompt=" ", sde_kind="cps", noise_level=0.7,
    window_size=3, window_range=(0, 4), micro_batch=2,
)  # fmt: skip


def _cfg(experts: int, **kw) -> SamplingConfig:
    return dataclasses.replace(BASE, height=SIZE[experts], width=SIZE[experts], **kw)


@pytest.fixture(scope="module", params=[1, 2], ids=["one_expert", "two_experts"])
def parts(request):
    return request.param, tiny.tiny_wan_components(seed=0, experts=request.param)


def _model(experts: int, parts: dict, **kw) -> Wan:
    return Wan.from_modules(
        parts["transformer"],
        parts["vae"],
        parts["text_encoder"],
        parts["tokenizer"],
        transformer_2=parts["transformer_2"],
        boundary_ratio=parts["boundary_ratio"],
        expand_timesteps=parts["expand_timesteps"],
        flow_shift=tiny.TINY_WAN_FLOW_SHIFT,
        num_frames=tiny.TINY_WAN_FRAMES,
        max_sequence_length=tiny.TINY_WAN_TEXT_LENGTH,
        **kw,
    )


def _pipe(parts: dict) -> WanPipeline:
    pipe = WanPipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _frames(pipe: WanPipeline, **kwargs) -> torch.Tensor:
    """The pipeline's video (latents or frames) as a tensor."""
    return cast(torch.Tensor, pipe(**kwargs, return_dict=False)[0])


def test_model_implements_the_protocol_and_every_lora_target_exists(parts):
    experts, p = parts
    model = _model(experts, p)
    assert isinstance(model, FlowModel) and len(model.experts) == experts
    for t in model.experts:
        names = [n for n, _ in t.named_modules()]
        for target in WAN_LORA_TARGETS:
            assert any(n.endswith(f".{target}") for n in names), target


def test_latent_shape_and_checks():
    """Shapes by hand: 5 frames -> (5 - 1) / 4 + 1 = 2 latent frames; 64 px / 16 = 4 (the 5B-like VAE), 32 / 8 = 4."""
    one, two = tiny.tiny_wan(experts=1), tiny.tiny_wan(experts=2)
    assert one.latent_shape(64, 128) == (4, 2, 4, 8) and two.latent_shape(32, 64) == (4, 2, 4, 8)
    with pytest.raises(ValueError, match="height=48 is not a positive multiple of 32 px"):
        one.latent_shape(48, 64)
    with pytest.raises(ValueError, match=r"num_frames=6: Wan needs 4k \+ 1 frames"):
        tiny.tiny_wan(num_frames=6)


def test_encode_matches_the_pipeline(parts):
    """UMT5 on one prompt at a time (cached) vs the pipeline's batch: the same rows, zero past the real tokens."""
    experts, p = parts
    model = _model(experts, p)
    pe, ne = _pipe(p).encode_prompt(PROMPTS, " ", True, max_sequence_length=tiny.TINY_WAN_TEXT_LENGTH)
    cond = model.encode(PROMPTS, negative_prompt=" ")
    torch.testing.assert_close(cond["prompt_embeds"], pe, rtol=0, atol=1e-6)
    torch.testing.assert_close(cond["neg_prompt_embeds"], ne, rtol=0, atol=1e-6)
    assert (cond["prompt_embeds"][2, -1] == 0).all() and cond["prompt_embeds"][1].abs().sum() > 0


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_ode_rollout_reproduces_the_pipeline(parts, guidance_scale):
    """η = 0 from the same x_1, WanPipeline with the flow-match Euler scheduler (shift = flow_shift): its final
    latents to fp32 rounding, its frames to the uint8 rounding. Two experts: guidance_scale_2 differs from
    guidance_scale, so running the wrong expert or the wrong scale at any step fails."""
    experts, p = parts
    scale_2 = 2.0 if experts == 2 and guidance_scale > 1 else None
    model = _model(experts, p, guidance_scale_2=scale_2)
    cfg = _cfg(experts, window_size=0, window_range=(0, 0), guidance_scale=guidance_scale, micro_batch=3)
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    size = SIZE[experts]
    x1 = torch.stack(
        [torch.randn(model.latent_shape(size, size), generator=sample_generator(s)) for s in SEEDS]
    )
    kwargs: dict[str, Any] = dict(
        prompt=PROMPTS, negative_prompt=" ", height=size, width=size, num_frames=tiny.TINY_WAN_FRAMES,
        num_inference_steps=cfg.num_steps, guidance_scale=guidance_scale, latents=x1,
        max_sequence_length=tiny.TINY_WAN_TEXT_LENGTH,
    )  # fmt: skip
    if scale_2 is not None:
        kwargs["guidance_scale_2"] = scale_2
    pipe = _pipe(p)
    ref = _frames(pipe, **kwargs, output_type="latent")
    assert traj.x0 is not None and ref.abs().max() > 0.5
    # batched CFG halves and one-prompt encodings vs the pipeline's: float rounding only
    assert (traj.x0 - ref).abs().max() < 5e-6
    frames = _frames(pipe, **kwargs, output_type="pt").permute(0, 1, 3, 4, 2) * 255  # [B, F, H, W, 3]
    assert traj.images.shape == (3, tiny.TINY_WAN_FRAMES, size, size, 3) and traj.images.dtype == torch.uint8
    assert (traj.images.float() - frames).abs().max() <= 0.5 + 1e-3 and frames.std() > 1.0


def test_the_expert_is_the_pipelines_at_the_boundary():
    """WanPipeline runs transformer at t >= boundary_ratio * 1000 and transformer_2 below: sigma = 0.875 (t = 875
    exactly) is the high-noise expert's, the next float32 below it the low-noise one's; a batch mixing both stages
    gives each row its own expert's velocity."""
    m = tiny.tiny_wan(experts=2)
    cond = m.encode(PROMPTS[:2])
    x = torch.randn(2, *m.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    at = torch.tensor(0.875)
    below = torch.nextafter(at, torch.tensor(0.0))

    def direct(expert, sigma):
        t = (sigma * 1000).expand(2)
        return expert(
            hidden_states=x, timestep=t, encoder_hidden_states=cond["prompt_embeds"], return_dict=False
        )[0]

    assert torch.equal(m.velocity(x, at, cond, guidance_scale=1.0), direct(m.transformer, at))
    assert torch.equal(m.velocity(x, below, cond, guidance_scale=1.0), direct(m.transformer_2, below))
    mixed = m.velocity(x, torch.stack([at, below]), cond, guidance_scale=1.0)
    assert torch.allclose(mixed[0], direct(m.transformer, at)[0], atol=1e-6)
    assert torch.allclose(mixed[1], direct(m.transformer_2, below)[1], atol=1e-6)
    assert not torch.allclose(direct(m.transformer, at), direct(m.transformer_2, at), atol=1e-3)


@pytest.mark.parametrize("experts", [1, 2])
@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_recomputed_log_probs_equal_the_rollouts_bit_exactly(experts, guidance_scale):
    m = tiny.tiny_wan(experts=experts, guidance_scale_2=2.0 if experts == 2 else None)
    cfg = _cfg(experts, guidance_scale=guidance_scale)
    traj = DiffusersEngine(m).generate(PROMPTS, SEEDS, cfg)
    assert torch.isfinite(traj.log_prob).all()
    assert torch.equal(recompute_log_probs(m, traj, cfg), traj.log_prob)


@pytest.mark.parametrize("experts", [1, 2])
def test_recompute_is_bit_exact_with_lora_on_every_expert_and_grad(experts):
    """LoRA (B != 0) on each expert; the window spans steps 1..3 (t = 900, 750, 500), so with two experts its
    first step is the high-noise expert's and the rest the low-noise one's: both adapters get gradients."""
    m = tiny.tiny_wan(seed=2, experts=experts)
    for t in m.experts:
        add_lora(t, rank=2, alpha=4, target_modules=WAN_LORA_TARGETS)
        with torch.no_grad():
            for n, p in t.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    cfg = _cfg(experts, window_size=3, window_range=(1, 4))
    traj = DiffusersEngine(m).generate(PROMPTS, SEEDS, cfg)
    assert torch.equal(recompute_log_probs(m, traj, cfg), traj.log_prob)
    rows = forward_units(traj.window, cfg.micro_batch)[0]
    total = 0
    for j in range(traj.log_prob.shape[1]):
        log_prob, _, _ = recompute_log_prob(m, traj, cfg, rows, j)
        assert torch.equal(log_prob.detach(), traj.log_prob[rows, j])
        total = total + log_prob.sum()
    assert isinstance(total, torch.Tensor)
    total.backward()
    for t in m.experts:
        grads = [p.grad for n, p in t.named_parameters() if "lora_" in n and p.grad is not None]
        assert grads and any(g.abs().max() > 0 for g in grads) and all(torch.isfinite(g).all() for g in grads)


def _inputs(transformer, seed):
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    return dict(
        hidden_states=torch.randn(2, cfg.in_channels, 2, 4, 4, generator=g),
        timestep=torch.tensor([900.0, 300.0]),
        encoder_hidden_states=torch.randn(2, 6, cfg.text_dim, generator=g),
        return_dict=False,
    )


def test_exported_loras_load_into_each_expert_of_the_pipeline(tmp_path):
    comps = tiny.tiny_wan_components(seed=0, experts=2)
    m = _model(2, comps)
    base = copy.deepcopy(comps)
    wants = []
    for i, t in enumerate(m.experts):
        before = t(**_inputs(t, i))[0]
        add_lora(t, rank=4, alpha=8, target_modules=WAN_LORA_TARGETS, init=False)  # A, B random
        wants.append(t(**_inputs(t, i))[0])
        assert not torch.allclose(wants[-1], before)
    out, out_2 = export_expert_loras(tmp_path / "lora", m)
    pipe = _pipe(base)
    pipe.load_lora_weights(str(out))
    pipe.load_lora_weights(str(out_2), load_into_transformer_2=True)
    for i, (t, want) in enumerate(zip((pipe.transformer, pipe.transformer_2), wants)):
        assert torch.equal(t(**_inputs(t, i))[0], want)


def test_build_model_reads_wan_config():
    mcfg = WanConfig(kind="tiny_wan", dtype="fp32", num_frames=9, guidance_scale_2=2.5)
    m = build_model(mcfg, torch.device("cpu"), seed=0)
    assert isinstance(m, Wan) and m.latent_shape(64, 64) == (4, 3, 4, 4) and m.guidance_scale_2 == 2.5


@pytest.mark.parametrize("experts", [1, 2])
def test_from_pretrained_reads_the_pipelines_switches(tmp_path, experts):
    """A saved WanPipeline (its own UniPC scheduler with flow sigmas) loads with the pipeline's boundary_ratio and
    expand_timesteps from model_index.json and the scheduler's flow_shift: the same velocities as the modules."""
    from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler

    parts = tiny.tiny_wan_components(seed=0, experts=experts)
    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=4.0)
    WanPipeline(**{**parts, "scheduler": unipc}).save_pretrained(tmp_path)
    m = Wan.from_pretrained(tmp_path, dtype=torch.float32, device="cpu", num_frames=tiny.TINY_WAN_FRAMES)
    ref = _model(experts, parts)
    assert m.flow_shift == 4.0 and len(m.experts) == experts and m.expand_timesteps == (experts == 1)
    assert m.boundary_timestep == (875.0 if experts == 2 else None)
    size = SIZE[experts]
    x = torch.randn(1, *m.latent_shape(size, size), generator=torch.Generator().manual_seed(0))
    for sigma in (0.9, 0.5):
        cond = m.encode(["a cat"])
        v = m.velocity(x, torch.tensor(sigma), cond, guidance_scale=1.0)
        assert torch.equal(v, ref.velocity(x, torch.tensor(sigma), cond, guidance_scale=1.0))


def test_a_bf16_load_keeps_diffusers_float32_parameters_and_computes_in_bf16(tmp_path):
    """diffusers loads a bf16 WanTransformer3DModel with its `_keep_in_fp32_modules` in float32, the first
    parameter (`scale_shift_table`) among them: the model's compute dtype is the weights' bf16 all the same, so a
    velocity feeds bf16 to the patch embedding (a float32 input there fails: "Input type (float) and bias type
    (c10::BFloat16) should be the same")."""
    from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler

    parts = tiny.tiny_wan_components(seed=0, experts=1)
    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=4.0)
    WanPipeline(**{**parts, "scheduler": unipc}).save_pretrained(tmp_path)
    m = Wan.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cpu", num_frames=tiny.TINY_WAN_FRAMES)
    assert next(m.transformer.parameters()).dtype == torch.float32  # the premise: a kept-fp32 parameter first
    assert m.dtype == torch.bfloat16 and m.transformer.patch_embedding.weight.dtype == torch.bfloat16
    x = torch.randn(1, *m.latent_shape(SIZE[1], SIZE[1]), generator=torch.Generator().manual_seed(0))
    v = m.velocity(x, torch.tensor(0.5), m.encode(["a cat"]), guidance_scale=1.0)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


def test_fsdp_shards_the_experts_blocks_and_trains_through_them():
    """parallel.shard_transformer finds Wan's `blocks` (neither `transformer_blocks` nor `layers`): LoRA, bf16
    compute through FSDP2 on a world of one, gradient checkpointing, finite and nonzero adapter gradients."""
    from torch.distributed.tensor import DTensor

    from fgrpo import parallel
    from fgrpo.config import ModelConfig
    from fgrpo.models.lora import setup_trainable

    owned = not parallel.initialized()
    parallel.init_distributed("cpu")
    try:
        m = tiny.tiny_wan(seed=3, dtype=torch.bfloat16)
        mcfg = ModelConfig(
            kind="tiny_wan",
            dtype="bf16",
            lora_rank=2,
            lora_alpha=4,
            lora_targets=",".join(WAN_LORA_TARGETS),
            gradient_checkpointing=True,
        )
        setup_trainable(m.transformer, mcfg)
        parallel.shard_transformer(m.transformer, param_dtype=torch.bfloat16)
        x = torch.randn(2, *m.latent_shape(64, 64), generator=torch.Generator().manual_seed(0))
        v = m.velocity(x, torch.tensor(0.7), m.encode(PROMPTS[:2]), guidance_scale=1.0)
        v.square().sum().backward()
        grads = [cast(DTensor, p.grad).full_tensor() for p in m.transformer.parameters() if p.requires_grad]
        assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().max() > 0 for g in grads)
    finally:
        if owned:
            parallel.shutdown()
