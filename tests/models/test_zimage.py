"""Z-Image on tiny random modules: ZImagePipeline parity (encodings, the schedule, η = 0 sampling with and without
true CFG, decoded images), bit-exact log-prob recompute with and without LoRA, LoRA export that the pipeline loads,
and loading a saved pipeline directory."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline, calculate_shift
from lora_checks import lora_recompute_grads  # tests/models on sys.path

from fgrpo.config import SamplingConfig
from fgrpo.models import tiny
from fgrpo.models.base import FlowModel
from fgrpo.models.lora import add_lora, export_lora
from fgrpo.models.registry import build_tiny
from fgrpo.models.zimage import ZIMAGE_LORA_TARGETS, ZImage
from fgrpo.recompute import recompute_log_probs
from fgrpo.rollout.engine import DiffusersEngine
from fgrpo.rollout.seeds import sample_generator

SIZE = 64
PROMPTS = ["a cat", "a photo of a dog on a red square", "x"]
SEEDS = [11, 12, 13]
BASE = SamplingConfig(
    height=SIZE, width=SIZE, num_steps=5, guidance_scale=5.0, negative_prompt="", sde_kind="flow_sde",
    noise_level=0.7, window_size=2, window_range=(0, 4), micro_batch=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def parts():
    return tiny.tiny_zimage_components(seed=0)


@pytest.fixture(scope="module")
def model(parts):
    return ZImage.from_modules(parts["transformer"], parts["vae"], parts["text_encoder"], parts["tokenizer"])


@pytest.fixture(scope="module")
def pipe(parts):
    p = ZImagePipeline(**parts)
    p.set_progress_bar_config(disable=True)
    return p


def test_model_implements_the_protocol_and_every_lora_target_exists(model):
    assert isinstance(model, FlowModel) and isinstance(build_tiny("zimage"), ZImage)
    names = [n for n, _ in model.transformer.named_modules()]
    for t in ZIMAGE_LORA_TARGETS:
        for stack in ("layers.", "noise_refiner.", "context_refiner."):
            assert any(n.startswith(stack) and n.endswith(f".{t}") for n in names), (stack, t)


def test_encode_matches_the_pipeline(model, pipe):
    """The pipeline pads the batch to 512 tokens and keeps the real ones; we encode each prompt alone: the causal
    encoder's real tokens do not see the padding, so the variable-length rows agree."""
    pos, neg = pipe.encode_prompt(list(PROMPTS), torch.device("cpu"), True, [""] * len(PROMPTS))
    cond = model.encode(PROMPTS, negative_prompt="")
    for i, ref in enumerate(pos):
        got = cond["prompt_embeds"][i][cond["prompt_mask"][i]]
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        n = neg[i]
        torch.testing.assert_close(
            cond["neg_prompt_embeds"][i][cond["neg_prompt_mask"][i]], n, rtol=0, atol=1e-5
        )
    assert cond["prompt_mask"].sum(1).tolist() == [p.shape[0] for p in pos]
    assert len({p.shape[0] for p in pos}) > 1  # variable lengths: the mask matters


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("height", "width", "steps"), [(64, 64, 5), (512, 1024, 10)])
def test_schedule_is_the_pipelines(parts, dynamic, height, width, steps):
    """The pipeline's sigmas: torch.linspace(1, 1/N, N) through the scheduler (a static shift, or with dynamic
    shifting mu = calculate_shift(patches)), then 0."""
    scheduler = copy.deepcopy(parts["scheduler"])
    if dynamic:
        scheduler = type(scheduler).from_config({**scheduler.config, "use_dynamic_shifting": True})
    m = ZImage(parts["transformer"], parts["vae"], None, None, scheduler_config=dict(scheduler.config))
    scfg = scheduler.config
    mu = calculate_shift(
        (height // 16) * (width // 16),
        scfg["base_image_seq_len"], scfg["max_image_seq_len"], scfg["base_shift"], scfg["max_shift"],
    )  # fmt: skip
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / steps, steps).tolist(), mu=mu)
    ours = m.sigmas(steps, height, width)
    torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=0, atol=1e-6)
    assert ours[-1] == 0 and ours[1] > 1 - 1 / steps  # shifted towards 1
    at = m.sigmas_at(steps, height, width, torch.arange(steps))
    assert torch.equal(at, ours[:-1])


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0])
def test_ode_rollout_reproduces_the_pipeline(model, pipe, guidance_scale):
    """η = 0 (no SDE window) from the same x_1 and prompts: the pipeline's final latents to fp32 rounding and its
    images to the uint8 rounding. Our scale s is the pipeline's g + 1 (Turbo's g = 0: one forward)."""
    cfg = dataclasses.replace(
        BASE, window_size=0, window_range=(0, 0), guidance_scale=guidance_scale, micro_batch=3
    )
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    x1 = torch.stack(
        [torch.randn(model.latent_shape(SIZE, SIZE), generator=sample_generator(s)) for s in SEEDS]
    )
    kwargs = dict(
        height=SIZE,
        width=SIZE,
        num_inference_steps=cfg.num_steps,
        guidance_scale=guidance_scale - 1,
        latents=x1,
    )
    # fresh prompt lists each call: the pipeline writes the templated prompts into the list it is given
    ref = pipe(list(PROMPTS), negative_prompt=[""] * 3, **kwargs, output_type="latent").images  # pyright: ignore[reportAttributeAccessIssue]
    assert traj.x0 is not None and ref.abs().max() > 1.0
    assert (traj.x0 - ref).abs().max() < 1e-4
    images = pipe(list(PROMPTS), negative_prompt=[""] * 3, **kwargs, output_type="np").images  # pyright: ignore[reportAttributeAccessIssue]
    ref_px = torch.from_numpy(images) * 255
    assert traj.images.shape == (3, SIZE, SIZE, 3) and traj.images.dtype == torch.uint8
    assert (traj.images.float() - ref_px).abs().max() <= 0.5 + 1e-3 and ref_px.std() > 1.0


def test_velocity_takes_one_forward_without_cfg_and_one_doubled_batch_with_it(model, monkeypatch):
    calls = []
    forward = model.transformer.forward

    def record(*args, **kwargs):
        calls.append(len(args[0]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model.transformer, "forward", record)
    x = torch.randn(2, *model.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(0))
    cond = model.encode(PROMPTS[:2], negative_prompt="")
    v1 = model.velocity(x, torch.tensor([0.9, 0.4]), cond, guidance_scale=1.0)
    v5 = model.velocity(x, torch.tensor([0.9, 0.4]), cond, guidance_scale=5.0)
    assert calls == [2, 4] and (v1 - v5).abs().max() > 1e-3
    with pytest.raises(ValueError, match="needs a negative prompt"):
        model.velocity(x, torch.tensor([0.9, 0.4]), model.encode(PROMPTS[:2]), guidance_scale=5.0)


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0])
def test_recomputed_log_probs_equal_the_rollouts_bit_exactly(model, guidance_scale):
    cfg = dataclasses.replace(BASE, guidance_scale=guidance_scale)
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    assert torch.isfinite(traj.log_prob).all() and traj.x_t.shape == (3, 2, 4, 8, 8)
    assert torch.equal(recompute_log_probs(model, traj, cfg), traj.log_prob)


def test_recompute_is_bit_exact_with_lora_and_grad():
    m = tiny.tiny_zimage(seed=2)
    grads = lora_recompute_grads(m, ZIMAGE_LORA_TARGETS, BASE, PROMPTS, SEEDS)
    # every adapter learns, the text refiner's too (its output is the main blocks' text stream)
    assert grads and all(
        g is not None and torch.isfinite(g).all() and g.abs().max() > 0 for g in grads.values()
    )


def _transformer_inputs(transformer):
    """Transformer inputs of one tiny step: two 64² latents, prompts of 6 and 9 tokens."""
    g = torch.Generator().manual_seed(0)
    cfg = transformer.config
    return dict(
        x=[torch.randn(cfg.in_channels, 1, 8, 8, generator=g) for _ in range(2)],
        t=torch.tensor([0.1, 0.7]),
        cap_feats=[torch.randn(n, cfg.cap_feat_dim, generator=g) for n in (6, 9)],
        return_dict=False,
    )


def test_export_lora_loads_in_the_pipeline(tmp_path):
    comps = tiny.tiny_zimage_components(seed=0)
    trained = comps["transformer"]
    base = copy.deepcopy(trained)
    base_out = torch.stack(trained(**_transformer_inputs(trained))[0])
    add_lora(trained, rank=4, alpha=8, target_modules=ZIMAGE_LORA_TARGETS, init=False)  # A, B random
    want = torch.stack(trained(**_transformer_inputs(trained))[0])
    assert not torch.allclose(want, base_out)
    out = export_lora(tmp_path / "lora", trained)
    pipe = ZImagePipeline(**{**comps, "transformer": base})
    pipe.load_lora_weights(str(out))
    got = torch.stack(pipe.transformer(**_transformer_inputs(pipe.transformer))[0])
    assert torch.equal(got, want)


def test_saved_tiny_pipeline_loads_with_our_loader(tmp_path, model, parts):
    ZImagePipeline(**parts).save_pretrained(tmp_path / "tiny-zimage")
    loaded = ZImage.from_pretrained(tmp_path / "tiny-zimage", dtype=torch.float32, device="cpu")
    assert loaded.schedule_kwargs is None and loaded.shift == model.shift == 3.0
    a, b = loaded.encode(PROMPTS), model.encode(PROMPTS)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_bad_resolution_and_mismatched_parts_are_one_line_errors(model, parts):
    assert model.latent_shape(64, 96) == (4, 8, 12)
    with pytest.raises(
        ValueError, match=r"height=60 is not a positive multiple of 16 px \(Z-Image.*height=64"
    ):
        model.latent_shape(60, 64)
    other = copy.deepcopy(parts["vae"])
    other.register_to_config(latent_channels=8)
    with pytest.raises(ValueError, match="in_channels=4 != VAE latent_channels 8"):
        ZImage(parts["transformer"], other, None, None)
