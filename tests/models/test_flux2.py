"""FLUX.2 [klein] on tiny random modules: Flux2KleinPipeline parity (Qwen3 encodings, packing and 4-axis positions,
the empirical-mu schedule, η = 0 sampling with and without true CFG, the batch-norm un-normalised decode), bit-exact
log-prob recompute with and without LoRA, and LoRA export that the pipeline loads."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline, compute_empirical_mu
from lora_checks import lora_recompute_grads  # tests/models on sys.path

from fgrpo.config import SamplingConfig
from fgrpo.core import schedule
from fgrpo.models import tiny
from fgrpo.models.base import FlowModel
from fgrpo.models.flux2 import FLUX2_LORA_TARGETS, Flux2, image_ids, pack, text_ids, unpack
from fgrpo.models.lora import add_lora, export_lora
from fgrpo.models.registry import build_tiny
from fgrpo.recompute import recompute_log_probs
from fgrpo.rollout.engine import DiffusersEngine
from fgrpo.rollout.seeds import sample_generator

SIZE = 64
PROMPTS = ["a cat", "a photo of a dog on a red square", "x"]
SEEDS = [11, 12, 13]
BASE = SamplingConfig(
    height=SIZE, width=SIZE, num_steps=5, guidance_scale=4.0, negative_prompt="", sde_kind="flow_sde",
    noise_level=0.7, window_size=2, window_range=(0, 4), micro_batch=2,
)  # fmt: skip
LENGTH, LAYERS = tiny.FLUX2_TEXT_LENGTH_TINY, tiny.FLUX2_TEXT_LAYERS_TINY


@pytest.fixture(scope="module")
def parts():
    return tiny.tiny_flux2_components(seed=0)


@pytest.fixture(scope="module")
def model(parts):
    return Flux2.from_modules(
        parts["transformer"],
        parts["vae"],
        parts["text_encoder"],
        parts["tokenizer"],
        max_sequence_length=LENGTH,
        text_layers=LAYERS,
    )


@pytest.fixture(scope="module")
def pipe(parts):
    p = Flux2KleinPipeline(**parts, is_distilled=False)
    p.set_progress_bar_config(disable=True)
    return p


def test_model_implements_the_protocol_and_every_lora_target_exists(model):
    assert isinstance(model, FlowModel) and isinstance(build_tiny("flux2"), Flux2)
    linear = {n for n, m in model.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    for t in FLUX2_LORA_TARGETS:
        assert any(n.endswith(f".{t}") for n in linear), t


def test_encode_matches_the_pipeline(model, pipe):
    """The pipeline encodes the batch at once, we one prompt at a time (cached): fixed-length padding and a causal
    encoder make the rows independent. The stacked layers are the tiny Qwen3's."""
    pe, ids = pipe.encode_prompt(PROMPTS, max_sequence_length=LENGTH, text_encoder_out_layers=LAYERS)
    cond = model.encode(PROMPTS, negative_prompt="")
    assert cond["prompt_embeds"].shape == (3, LENGTH, 48)
    torch.testing.assert_close(cond["prompt_embeds"], pe, rtol=0, atol=1e-6)
    neg, _ = pipe.encode_prompt("", max_sequence_length=LENGTH, text_encoder_out_layers=LAYERS)
    torch.testing.assert_close(cond["neg_prompt_embeds"], neg.expand(3, -1, -1), rtol=0, atol=1e-6)
    assert torch.equal(text_ids(LENGTH), ids[0].float())  # what velocity passes as txt_ids


def test_packing_and_positions_match_the_pipeline():
    x = torch.randn(2, 16, 3, 5)
    assert torch.equal(pack(x), Flux2KleinPipeline._pack_latents(x))
    assert torch.equal(unpack(pack(x), 3, 5), x)
    ref = Flux2KleinPipeline._prepare_latent_ids(x)
    assert torch.equal(image_ids(3, 5), ref[0].float())
    assert image_ids(3, 5)[7].tolist() == [0.0, 1.0, 2.0, 0.0]  # token 7 of a 3 x 5 grid: row 1, column 2


def test_flux2_mu_is_the_two_fits_interpolated_in_the_step_count():
    """At 10 steps mu is the 10-step fit, at 200 the 200-step fit; above 4300 tokens the 200-step fit always."""
    L = 4096
    assert schedule.flux2_mu(L, 10) == pytest.approx(8.73809524e-05 * L + 1.89833333, abs=1e-12)
    assert schedule.flux2_mu(L, 200) == pytest.approx(0.00016927 * L + 0.45666666, abs=1e-12)
    assert (
        schedule.flux2_mu(5000, 4)
        == schedule.flux2_mu(5000, 50)
        == pytest.approx(0.00016927 * 5000 + 0.45666666)
    )
    for seq_len, steps in ((16, 5), (4096, 28), (9216, 8)):
        assert schedule.flux2_mu(seq_len, steps) == compute_empirical_mu(seq_len, steps)


@pytest.mark.parametrize(("height", "width", "steps"), [(64, 64, 5), (1024, 1024, 28), (1536, 1536, 8)])
def test_schedule_is_the_pipelines(model, pipe, height, width, steps):
    """Flux2KleinPipeline's sigmas: linspace(1, 1/N, N) shifted with mu = compute_empirical_mu(tokens, N), then 0."""
    seq_len = (height // 16) * (width // 16)
    scheduler = copy.deepcopy(pipe.scheduler)
    scheduler.set_timesteps(
        sigmas=np.linspace(1.0, 1 / steps, steps).tolist(), mu=compute_empirical_mu(seq_len, steps)
    )
    ours = model.sigmas(steps, height, width)
    assert torch.equal(ours, scheduler.sigmas.float())
    assert ours[-1] == 0 and ours[1] > 1 - 1 / steps  # shifted towards 1
    assert torch.equal(model.sigmas_at(steps, height, width, torch.arange(steps)), ours[:-1])


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_ode_rollout_reproduces_the_pipeline(model, pipe, guidance_scale):
    """η = 0 from the same x_1 and prompt embeddings: the pipeline's final latents to fp32 rounding and its images to
    the uint8 rounding (through the batch-norm un-normalisation and unpatchify); true CFG changes them."""
    cfg = dataclasses.replace(
        BASE, window_size=0, window_range=(0, 0), guidance_scale=guidance_scale, micro_batch=3
    )
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    x1 = torch.stack(
        [torch.randn(model.latent_shape(SIZE, SIZE), generator=sample_generator(s)) for s in SEEDS]
    )
    cond = model.encode(PROMPTS, negative_prompt="")
    kwargs = dict(
        prompt_embeds=cond["prompt_embeds"],
        negative_prompt_embeds=cond["neg_prompt_embeds"],
        height=SIZE,
        width=SIZE,
        num_inference_steps=cfg.num_steps,
        guidance_scale=guidance_scale,
        latents=x1,
        max_sequence_length=LENGTH,
    )
    # the pipeline's "latent" output is already un-normalised and unpatchified: compare our x0 mapped the same way
    ref = pipe(**kwargs, output_type="latent").images  # pyright: ignore[reportAttributeAccessIssue]
    assert traj.x0 is not None
    vae = pipe.vae
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    ours = Flux2KleinPipeline._unpatchify_latents(traj.x0 * std + vae.bn.running_mean.view(1, -1, 1, 1))
    assert ref.abs().max() > 1.0 and (ours - ref).abs().max() < 1e-5
    images = pipe(**kwargs, output_type="np").images  # pyright: ignore[reportAttributeAccessIssue]
    ref_px = torch.from_numpy(images) * 255
    assert traj.images.shape == (3, SIZE, SIZE, 3) and traj.images.dtype == torch.uint8
    assert (traj.images.float() - ref_px).abs().max() <= 0.5 + 1e-3 and ref_px.std() > 1.0
    other = DiffusersEngine(model).generate(PROMPTS, SEEDS, dataclasses.replace(cfg, guidance_scale=2.0))
    assert other.x0 is not None and (other.x0 - traj.x0).abs().max() > 1e-3


def test_distilled_model_ignores_the_guidance_scale(parts):
    """A step-distilled klein takes one forward whatever the scale, like the pipeline with is_distilled=True."""
    m = Flux2(parts["transformer"], parts["vae"], parts["text_encoder"], parts["tokenizer"], is_distilled=True,
              max_sequence_length=LENGTH, text_layers=LAYERS)  # fmt: skip
    x = torch.randn(2, *m.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(0))
    cond = m.encode(PROMPTS[:2], negative_prompt="")
    sigma = torch.tensor([0.9, 0.4])
    assert torch.equal(
        m.velocity(x, sigma, cond, guidance_scale=4.0), m.velocity(x, sigma, cond, guidance_scale=1.0)
    )
    assert (m.cfg_forwards, tiny.tiny_flux2().cfg_forwards) == (
        1,
        2,
    )  # what the benchmarks' FLOP counts read


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_recomputed_log_probs_equal_the_rollouts_bit_exactly(model, guidance_scale):
    cfg = dataclasses.replace(BASE, guidance_scale=guidance_scale)
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    assert torch.isfinite(traj.log_prob).all() and traj.x_t.shape == (3, 2, 16, 4, 4)
    assert torch.equal(recompute_log_probs(model, traj, cfg), traj.log_prob)


def test_recompute_is_bit_exact_with_lora_and_grad():
    m = tiny.tiny_flux2(seed=2)
    grads = lora_recompute_grads(m, FLUX2_LORA_TARGETS, BASE, PROMPTS, SEEDS)
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert sum(g.abs().max() > 0 for g in grads.values() if g is not None) > len(grads) // 2


def _transformer_inputs(transformer):
    """Transformer inputs of one tiny step: 16 image tokens (a 64² image), 6 text tokens."""
    g = torch.Generator().manual_seed(0)
    cfg = transformer.config
    return dict(
        hidden_states=torch.randn(2, 16, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(2, 6, cfg.joint_attention_dim, generator=g),
        timestep=torch.tensor([0.9, 0.3]),
        txt_ids=text_ids(6),
        img_ids=image_ids(4, 4),
        return_dict=False,
    )


def test_export_lora_loads_in_the_pipeline(tmp_path):
    comps = tiny.tiny_flux2_components(seed=0)
    trained = comps["transformer"]
    base = copy.deepcopy(trained)
    base_out = trained(**_transformer_inputs(trained))[0]
    add_lora(trained, rank=4, alpha=8, target_modules=FLUX2_LORA_TARGETS, init=False)  # A, B random
    want = trained(**_transformer_inputs(trained))[0]
    assert not torch.allclose(want, base_out)
    out = export_lora(tmp_path / "lora", trained)
    pipe = Flux2KleinPipeline(**{**comps, "transformer": base})
    pipe.load_lora_weights(str(out))
    got = pipe.transformer(**_transformer_inputs(pipe.transformer))[0]
    assert torch.equal(got, want)


def test_bad_resolution_and_mismatched_parts_are_one_line_errors(model, parts):
    assert model.latent_shape(64, 96) == (16, 4, 6)
    with pytest.raises(
        ValueError, match=r"height=60 is not a positive multiple of 16 px \(FLUX.2.*height=64"
    ):
        model.latent_shape(60, 64)
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel

    other = Flux2Transformer2DModel(  # 8 input channels: not the VAE's 4 x the 2x2 patchify
        in_channels=8, num_layers=1, num_single_layers=0, attention_head_dim=16, num_attention_heads=1,
        joint_attention_dim=8, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="in_channels=8 != VAE latent_channels 4 x 2"):
        Flux2(other, parts["vae"], None, None)
    with pytest.raises(ValueError, match="shift_terminal=0.02; FLUX.2's schedule needs"):
        Flux2(parts["transformer"], parts["vae"], None, None,
              scheduler_config={"use_dynamic_shifting": True, "shift_terminal": 0.02})  # fmt: skip
