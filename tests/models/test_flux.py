"""FLUX.1-dev on tiny random modules: FluxPipeline parity (encodings, packing and positions, the dynamic-shift
schedule, η = 0 sampling with the embedded guidance, decoded images), bit-exact log-prob recompute with and without
LoRA, LoRA export that the pipeline loads, and loading a saved pipeline directory."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, calculate_shift
from lora_checks import lora_recompute_grads  # tests/models on sys.path

from fgrpo.config import SamplingConfig
from fgrpo.models import tiny
from fgrpo.models.base import FlowModel
from fgrpo.models.flux import FLUX_LORA_TARGETS, Flux, image_ids, pack
from fgrpo.models.loading import configure_transformer, dispatching_processors
from fgrpo.models.lora import add_lora, export_lora
from fgrpo.models.registry import build_tiny
from fgrpo.recompute import recompute_log_probs
from fgrpo.rollout.engine import DiffusersEngine
from fgrpo.rollout.seeds import sample_generator

SIZE = 64
PROMPTS = ["a cat", "a photo of a dog on a red square", "x"]
SEEDS = [11, 12, 13]
BASE = SamplingConfig(
    height=SIZE, width=SIZE, num_steps=5, guidance_scale=3.5, negative_prompt=" ", sde_kind="cps", noise_level=0.8,
    window_size=2, window_range=(0, 4), micro_batch=2,
)  # fmt: skip
T5_LENGTH = tiny.T5_MAX_LENGTH_TINY


@pytest.fixture(scope="module")
def parts():
    return tiny.tiny_flux_components(seed=0)


def _model(parts) -> Flux:
    return Flux.from_modules(
        parts["transformer"],
        parts["vae"],
        [parts["text_encoder"], parts["text_encoder_2"]],
        [parts["tokenizer"], parts["tokenizer_2"]],
        max_sequence_length=T5_LENGTH,
    )


@pytest.fixture(scope="module")
def model(parts):
    return _model(parts)


@pytest.fixture(scope="module")
def pipe(parts):
    p = FluxPipeline(**parts)
    p.set_progress_bar_config(disable=True)
    return p


def test_model_implements_the_protocol_and_every_lora_target_exists(model):
    assert isinstance(model, FlowModel) and isinstance(build_tiny("flux"), Flux)
    names = [n for n, _ in model.transformer.named_modules()]
    for t in FLUX_LORA_TARGETS:
        assert any(n.startswith("transformer_blocks.") and n.endswith(f".{t}") for n in names), t
    # flow_grpo's suffixes reach the single-stream blocks' attention projections, and only those
    single = {n.split(".", 2)[2] for n in names if n.startswith("single_transformer_blocks.0.")}
    assert {t for t in FLUX_LORA_TARGETS if t in single} == {"attn.to_q", "attn.to_k", "attn.to_v"}


def test_encode_matches_the_pipeline_and_reads_no_negative_prompt(model, pipe):
    """The pipeline encodes the batch at once, we one prompt at a time (cached): fixed-length padding and no mask make
    the rows independent. A negative prompt adds nothing: the guidance is an embedding, not a second branch."""
    pe, pooled, text_ids = pipe.encode_prompt(
        PROMPTS, None, device=torch.device("cpu"), max_sequence_length=T5_LENGTH
    )
    cond = model.encode(PROMPTS, negative_prompt=" ")
    assert set(cond) == {"prompt_embeds", "pooled"}
    assert cond["prompt_embeds"].shape == (3, T5_LENGTH, 32) and cond["pooled"].shape == (3, 16)
    torch.testing.assert_close(cond["prompt_embeds"], pe, rtol=0, atol=1e-6)
    torch.testing.assert_close(cond["pooled"], pooled, rtol=0, atol=1e-6)
    assert not torch.equal(cond["pooled"][0], cond["pooled"][1])
    assert torch.equal(text_ids, torch.zeros(T5_LENGTH, 3))  # what velocity passes as txt_ids


def test_packing_and_positions_match_the_pipeline(pipe):
    x = torch.randn(2, 4, 6, 10)
    assert torch.equal(pack(x), FluxPipeline._pack_latents(x, 2, 4, 6, 10))
    # the pipeline's unpack takes pixel sizes (VAE factor 8): 48 x 80 px <-> 6 x 10 latents
    assert torch.equal(FluxPipeline._unpack_latents(pack(x), 48, 80, 8), x)
    ref = FluxPipeline._prepare_latent_image_ids(2, 3, 5, torch.device("cpu"), torch.float32)
    assert torch.equal(image_ids(6, 10), ref)
    assert image_ids(6, 10)[7].tolist() == [0.0, 1.0, 2.0]  # token 7 of a 3 x 5 grid: row 1, column 2


@pytest.mark.parametrize(("height", "width", "steps"), [(64, 64, 5), (512, 1024, 6)])
def test_schedule_is_the_pipelines_dynamic_shift(model, pipe, height, width, steps):
    """FluxPipeline's sigmas: linspace(1, 1/N, N) shifted with mu = calculate_shift(packed tokens), then 0."""
    seq_len = (height // 16) * (width // 16)
    scfg = pipe.scheduler.config
    mu = calculate_shift(
        seq_len, scfg["base_image_seq_len"], scfg["max_image_seq_len"], scfg["base_shift"], scfg["max_shift"]
    )
    scheduler = copy.deepcopy(pipe.scheduler)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps).tolist(), mu=mu)
    ours = model.sigmas(steps, height, width)
    torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=0, atol=1e-6)
    assert ours[-1] == 0 and ours[1] > 1 - 1 / steps  # shifted towards 1
    at = model.sigmas_at(steps, height, width, torch.arange(steps))
    assert torch.equal(at, ours[:-1])


@pytest.mark.parametrize("guidance_scale", [1.0, 3.5])
def test_ode_rollout_reproduces_the_pipeline(model, pipe, guidance_scale):
    """η = 0 (no SDE window) from the same x_1 and prompt embeddings: the pipeline's final latents to fp32 rounding
    and its images to the uint8 rounding; the embedded guidance changes them."""
    cfg = dataclasses.replace(
        BASE, window_size=0, window_range=(0, 0), guidance_scale=guidance_scale, micro_batch=3
    )
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    x1 = torch.stack(
        [torch.randn(model.latent_shape(SIZE, SIZE), generator=sample_generator(s)) for s in SEEDS]
    )
    cond = model.encode(PROMPTS)
    kwargs = dict(
        prompt_embeds=cond["prompt_embeds"],
        pooled_prompt_embeds=cond["pooled"],
        height=SIZE,
        width=SIZE,
        num_inference_steps=cfg.num_steps,
        guidance_scale=guidance_scale,
        latents=pack(x1),
        max_sequence_length=T5_LENGTH,
    )
    latents = pipe(**kwargs, output_type="latent").images  # pyright: ignore[reportAttributeAccessIssue]
    ref = FluxPipeline._unpack_latents(latents, SIZE, SIZE, 8)
    assert traj.x0 is not None and ref.abs().max() > 1.0
    # the timestep as sigma vs the pipeline's (1000 sigma) / 1000: float rounding only (measured 0 on this CPU)
    assert (traj.x0 - ref).abs().max() < 1e-5
    images = pipe(**kwargs, output_type="np").images  # pyright: ignore[reportAttributeAccessIssue]
    ref_px = torch.from_numpy(images) * 255
    assert traj.images.shape == (3, SIZE, SIZE, 3) and traj.images.dtype == torch.uint8
    assert (traj.images.float() - ref_px).abs().max() <= 0.5 + 1e-3 and ref_px.std() > 1.0
    other = DiffusersEngine(model).generate(PROMPTS, SEEDS, dataclasses.replace(cfg, guidance_scale=2.0))
    assert other.x0 is not None and (other.x0 - traj.x0).abs().max() > 1e-3


def test_velocity_is_one_forward_with_the_guidance_embedding(model, monkeypatch):
    """Guidance-distilled: one transformer call per step, `guidance` = the scale per row, no negative rows."""
    calls = []
    forward = model.transformer.forward

    def record(*args, **kwargs):
        calls.append((kwargs["hidden_states"].shape[0], kwargs["guidance"]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model.transformer, "forward", record)
    x = torch.randn(2, *model.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(0))
    model.velocity(
        x, torch.tensor([0.9, 0.4]), model.encode(PROMPTS[:2], negative_prompt=" "), guidance_scale=3.5
    )
    assert len(calls) == 1 and calls[0][0] == 2 and calls[0][1].tolist() == [3.5, 3.5]


def test_attention_backend_and_checkpointing_keep_the_velocity():
    """FLUX's processors go through diffusers' dispatcher (unlike SD3's), so model.attention_backend reaches every
    block, joint and single; the switches keep the numbers."""
    m = tiny.tiny_flux(seed=1)
    x = torch.randn(1, *m.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(0))
    cond = m.encode(PROMPTS[:1])
    before = m.velocity(x, torch.tensor([0.7]), cond, guidance_scale=3.5)
    configure_transformer(m.transformer, attention_backend="native", gradient_checkpointing=True)
    assert len(dispatching_processors(m.transformer)) == 3  # 1 joint + 2 single blocks
    assert m.transformer.is_gradient_checkpointing
    assert torch.equal(m.velocity(x, torch.tensor([0.7]), cond, guidance_scale=3.5), before)


@pytest.mark.parametrize("guidance_scale", [1.0, 3.5])
def test_recomputed_log_probs_equal_the_rollouts_bit_exactly(model, guidance_scale):
    cfg = dataclasses.replace(BASE, guidance_scale=guidance_scale)
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    assert torch.isfinite(traj.log_prob).all() and traj.x_t.shape == (3, 2, 4, 8, 8)
    assert torch.equal(recompute_log_probs(model, traj, cfg), traj.log_prob)


def test_recompute_is_bit_exact_with_lora_and_grad():
    m = tiny.tiny_flux(seed=2)
    grads = lora_recompute_grads(m, FLUX_LORA_TARGETS, BASE, PROMPTS, SEEDS)
    # every adapter learns, the last joint block's text stream too (the single-stream blocks read its output)
    assert grads and all(
        g is not None and torch.isfinite(g).all() and g.abs().max() > 0 for g in grads.values()
    )


def _transformer_inputs(transformer):
    """Transformer inputs of one tiny step: 16 image tokens (a 64² image), 6 text tokens, guidance 3.5."""
    g = torch.Generator().manual_seed(0)
    cfg = transformer.config
    return dict(
        hidden_states=torch.randn(2, 16, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(2, 6, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(2, cfg.pooled_projection_dim, generator=g),
        timestep=torch.tensor([0.9, 0.3]),
        guidance=torch.tensor([3.5, 3.5]),
        txt_ids=torch.zeros(6, 3),
        img_ids=image_ids(8, 8),
        return_dict=False,
    )


def test_export_lora_loads_in_the_pipeline(tmp_path):
    comps = tiny.tiny_flux_components(seed=0)
    trained = comps["transformer"]
    base = copy.deepcopy(trained)
    base_out = trained(**_transformer_inputs(trained))[0]
    add_lora(trained, rank=4, alpha=8, target_modules=FLUX_LORA_TARGETS, init=False)  # A, B random
    want = trained(**_transformer_inputs(trained))[0]
    assert not torch.allclose(want, base_out)
    out = export_lora(tmp_path / "lora", trained)
    pipe = FluxPipeline(**{**comps, "transformer": base})
    pipe.load_lora_weights(str(out))
    got = pipe.transformer(**_transformer_inputs(pipe.transformer))[0]
    assert torch.equal(got, want)


def test_saved_tiny_pipeline_loads_with_our_loader(tmp_path, model, parts):
    FluxPipeline(**parts).save_pretrained(tmp_path / "tiny-flux")
    loaded = Flux.from_pretrained(
        tmp_path / "tiny-flux", dtype=torch.float32, device="cpu", max_sequence_length=T5_LENGTH
    )
    assert loaded.schedule_kwargs == model.schedule_kwargs and loaded.guidance_embeds
    assert loaded.schedule_kwargs == dict(
        base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15, shift_terminal=None
    )
    a, b = loaded.encode(PROMPTS), model.encode(PROMPTS)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_bad_resolution_and_mismatched_parts_are_one_line_errors(model, parts):
    assert model.latent_shape(64, 96) == (4, 8, 12)
    with pytest.raises(ValueError, match=r"height=60 is not a positive multiple of 16 px \(FLUX.*height=64"):
        model.latent_shape(60, 64)
    other = FluxTransformer2DModel(  # 8 input channels: not the VAE's 4 x the 2x2 packing
        in_channels=8, num_layers=1, num_single_layers=0, attention_head_dim=16, num_attention_heads=1,
        joint_attention_dim=8, pooled_projection_dim=8, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    with pytest.raises(ValueError, match="in_channels=8 != VAE latent_channels 4 x 2"):
        Flux(other, parts["vae"], [None, None], [None, None])
