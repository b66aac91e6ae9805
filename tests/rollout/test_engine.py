"""The in-process rollout engine on tiny random Qwen-Image and SD3.

- Parity: with no SDE window (every step the Euler step) the engine reproduces diffusers' own
  QwenImagePipeline / StableDiffusion3Pipeline images from the same initial latents and prompts.
- Exactness: recomputing the stored transitions' log-probs with unchanged weights gives the rollout's
  log-probs bit for bit (CPU), with and without CFG, with LoRA attached, with grad on.
- Determinism: same seeds -> identical trajectories; other micro-batch sizes and batch layouts agree to
  a measured float tolerance (see MICRO_BATCH_* below).
- Errors are raised before any model work.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, cast

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_output import QwenImagePipelineOutput
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_output import StableDiffusion3PipelineOutput
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import StableDiffusion3Pipeline
from diffusers.schedulers.scheduling_utils import SchedulerOutput

from fgrpo.config import SamplingConfig
from fgrpo.core import schedule
from fgrpo.models import tiny
from fgrpo.models.lora import Float8, MergedLora, add_lora
from fgrpo.models.qwen_image import QWEN_IMAGE_LORA_TARGETS, QwenImage, pack
from fgrpo.models.sd3 import SD3, SD3_LORA_TARGETS
from fgrpo.policy import transition
from fgrpo.recompute import recompute_log_prob, recompute_log_probs, recompute_log_probs_and_means
from fgrpo.rollout.engine import DiffusersEngine, forward_units
from fgrpo.rollout.seeds import sample_generator

PROMPTS = ["a cat", "a cat", "a photo of a dog on a red square", "hello", "x"]
SEEDS = [11, 12, 13, 14, 15]
BASE = SamplingConfig(
    height=64, width=64, num_steps=6, guidance_scale=4.0, negative_prompt=" ", window_size=2, window_range=(0, 5),
    micro_batch=2,
)  # fmt: skip

# Regrouping rows into other micro-batches changes the GEMM/attention shapes (and Qwen-Image's prompt padding),
# which moves fp32 results by a few ulps. Measured on this CPU (torch 2.13, 8 prompts, 2 seed sets,
# micro-batches 1/3/8 vs 2, 6 steps): max |dx| 1.7e-6, max |dlog_prob| 2.4e-7, pixels 1 level. Bounds ~3x that.
MICRO_BATCH_LATENT_ATOL = 5e-6
MICRO_BATCH_LOGPROB_ATOL = 1e-6
MICRO_BATCH_PIXEL_ATOL = 1  # uint8 levels: a value at a .5 boundary may round the other way


def _qwen(parts):
    return QwenImage.from_modules(
        parts["transformer"], parts["vae"], parts["text_encoder"], parts["tokenizer"]
    )


def _sd3(parts):
    return SD3.from_modules(
        parts["transformer"],
        parts["vae"],
        [parts["text_encoder"], parts["text_encoder_2"], parts["text_encoder_3"]],
        [parts["tokenizer"], parts["tokenizer_2"], parts["tokenizer_3"]],
        max_sequence_length=tiny.T5_MAX_LENGTH_TINY,
    )


@pytest.fixture(scope="module")
def qwen_parts():
    return tiny.tiny_qwen_image_components(seed=0)


@pytest.fixture(scope="module")
def sd3_parts():
    return tiny.tiny_sd3_components(seed=0)


@pytest.fixture(scope="module")
def models(qwen_parts, sd3_parts):
    return {"qwen": _qwen(qwen_parts), "sd3": _sd3(sd3_parts)}


def _initial_latents(seeds, shape, cfg: SamplingConfig):
    """The engine's documented draw order per sample generator: window (if any), then x_1."""
    out = []
    for s in seeds:
        g = sample_generator(s)
        if cfg.window_size:
            schedule.sample_windows(1, cfg.window_size, *cfg.window_range, g)
        out.append(torch.randn(shape, generator=g))
    return torch.stack(out)


def _assert_images_match(ours: torch.Tensor, ref: np.ndarray):
    """ours uint8 vs the pipeline's float [0, 1] images: each pixel is the pipeline's value, rounded."""
    ref_t = torch.from_numpy(ref) * 255
    assert ours.shape == ref_t.shape and ours.dtype == torch.uint8
    assert (ours.float() - ref_t).abs().max() <= 0.5 + 1e-3
    assert ref_t.std() > 1.0  # not a saturated/constant image that any latents would give


# ------------------------------------------------------------------------------------------------------
# Parity with diffusers' pipelines


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_ode_rollout_reproduces_qwen_image_pipeline(models, qwen_parts, guidance_scale):
    model = models["qwen"]
    cfg = dataclasses.replace(BASE, window_size=0, guidance_scale=guidance_scale, num_steps=5, micro_batch=5)
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    latents = _initial_latents(SEEDS, model.latent_shape(64, 64), cfg)
    pipe = QwenImagePipeline(**qwen_parts)
    pipe.set_progress_bar_config(disable=True)
    ref = cast(  # return_dict=True (the default): the output object, not the tuple diffusers also types
        QwenImagePipelineOutput,
        pipe(
            PROMPTS,
            negative_prompt=" " if guidance_scale > 1 else None,  # pyright: ignore[reportArgumentType] - diffusers' default is None
            true_cfg_scale=guidance_scale,
            height=64,
            width=64,
            num_inference_steps=5,
            latents=pack(latents),
            output_type="np",
        ),
    ).images
    assert isinstance(ref, np.ndarray)  # output_type="np"
    _assert_images_match(traj.images, ref)
    assert traj.x_t.shape == (5, 0, 4, 8, 8) and traj.log_prob.shape == (5, 0)


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_ode_rollout_reproduces_sd3_pipeline(models, sd3_parts, guidance_scale):
    model = models["sd3"]
    cfg = dataclasses.replace(
        BASE, window_size=0, guidance_scale=guidance_scale, negative_prompt="", micro_batch=5
    )
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    latents = _initial_latents(SEEDS, model.latent_shape(64, 64), cfg)
    pipe = StableDiffusion3Pipeline(**sd3_parts)
    pipe.set_progress_bar_config(disable=True)
    ref = cast(  # return_dict=True (the default): the output object, not the tuple diffusers also types
        StableDiffusion3PipelineOutput,
        pipe(
            PROMPTS,
            negative_prompt="",
            guidance_scale=guidance_scale,
            height=64,
            width=64,
            num_inference_steps=cfg.num_steps,
            latents=latents,  # pyright: ignore[reportArgumentType] - diffusers types any float tensor as FloatTensor
            output_type="np",
            max_sequence_length=tiny.T5_MAX_LENGTH_TINY,
        ),
    ).images
    assert isinstance(ref, np.ndarray)  # output_type="np"
    _assert_images_match(traj.images, ref)


# ------------------------------------------------------------------------------------------------------
# Rollout log-prob == recomputed log-prob, bit for bit


@pytest.mark.parametrize("kind", ["qwen", "sd3"])
@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_recomputed_log_probs_equal_the_rollouts_bit_exactly(models, kind, guidance_scale):
    model = models[kind]
    cfg = dataclasses.replace(
        BASE, guidance_scale=guidance_scale, negative_prompt="" if kind == "sd3" else " "
    )
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    assert torch.isfinite(traj.log_prob).all()
    log_probs, means = recompute_log_probs_and_means(model, traj, cfg)
    assert torch.equal(log_probs, traj.log_prob)
    assert traj.mean is not None and traj.x0 is not None
    assert torch.equal(means, traj.mean)  # Flow-DPPO's old mean needs no recompute pass
    units = forward_units(traj.window, cfg.micro_batch)
    decoded = torch.cat([model.decode(traj.x0[r], cfg.height, cfg.width) for r in units])
    # x0: the latents the rollout decoded (in its micro-batches), each image in its sample's row
    assert torch.equal(decoded, traj.images[torch.cat(units)])


@pytest.mark.parametrize("kind", ["qwen", "sd3"])
def test_recompute_is_bit_exact_with_lora_and_grad(kind):
    model = tiny.tiny_qwen_image(seed=2) if kind == "qwen" else tiny.tiny_sd3(seed=2)
    targets = QWEN_IMAGE_LORA_TARGETS if kind == "qwen" else SD3_LORA_TARGETS
    add_lora(model.transformer, rank=2, alpha=4, target_modules=targets)
    with torch.no_grad():  # a trained-looking adapter: B != 0, so LoRA really changes the velocity
        for n, p in model.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    cfg = dataclasses.replace(
        BASE, num_steps=4, sde_kind="cps", noise_level=0.7, window_range=(1, 3), micro_batch=3
    )
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    assert torch.equal(recompute_log_probs(model, traj, cfg), traj.log_prob)
    # The trainer's call: with autograd on, the same numbers, and a gradient reaches the adapter.
    rows = forward_units(traj.window, cfg.micro_batch)[0]
    log_prob, _, _ = recompute_log_prob(model, traj, cfg, rows, 1)
    assert torch.equal(log_prob.detach(), traj.log_prob[rows, 1])
    log_prob.sum().backward()
    # (The last block's text-stream adapters get no gradient: that stream's output is discarded.)
    grads = [p.grad for n, p in model.transformer.named_parameters() if "lora_" in n and p.grad is not None]
    assert (
        len(grads) > 0
        and all(torch.isfinite(g).all() for g in grads)
        and any(g.abs().max() > 0 for g in grads)
    )


# ------------------------------------------------------------------------------------------------------
# Trajectory structure, seeds and determinism


def test_trajectory_layout_windows_and_noise_provenance(models):
    model = models["qwen"]
    cfg = BASE
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    B, W = len(PROMPTS), cfg.window_size
    assert traj.x_t.shape == traj.x_next.shape == (B, W, 4, 8, 8)
    assert traj.x_t.dtype == traj.x_next.dtype == traj.log_prob.dtype == torch.float32
    assert traj.images.shape == (B, 64, 64, 3) and traj.images.dtype == torch.uint8
    assert traj.seeds.tolist() == SEEDS and traj.prompts == PROMPTS
    assert torch.equal(traj.sigmas, model.sigmas(cfg.num_steps, 64, 64))
    # Each window is W consecutive steps inside window_range, drawn from the sample's own generator.
    lo, hi = cfg.window_range
    for b, s in enumerate(SEEDS):
        assert torch.equal(traj.window[b], schedule.sample_windows(1, W, lo, hi, sample_generator(s))[0])
    assert traj.window.min() >= lo and traj.window.max() < hi
    # Consecutive transitions chain: the state after step j is the state before step j + 1.
    assert torch.equal(traj.x_next[:, 0], traj.x_t[:, 1])
    # The SDE noise is the sample generator's next draws after (window, x_1): x_next = mean + std * noise.
    b = 2
    g = sample_generator(SEEDS[b])
    schedule.sample_windows(1, W, lo, hi, g)
    torch.randn(4, 8, 8, generator=g)
    cond = model.encode([PROMPTS[b]], negative_prompt=" ")
    for j in range(W):
        i = int(traj.window[b, j])
        mean, std = transition(
            model, traj.x_t[b : b + 1, j], traj.sigmas[i : i + 1], traj.sigmas[i + 1 : i + 2], cond, cfg
        )
        noise = torch.randn(4, 8, 8, generator=g)
        torch.testing.assert_close(traj.x_next[b, j], (mean + std * noise)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen", "sd3"])
def test_same_seeds_same_trajectory_across_runs_micro_batches_and_layouts(models, kind):
    model = models[kind]
    cfg = dataclasses.replace(BASE, negative_prompt="" if kind == "sd3" else " ")
    engine = DiffusersEngine(model)
    a = engine.generate(PROMPTS, SEEDS, cfg)
    b = engine.generate(PROMPTS, SEEDS, cfg)
    for f in ("window", "x_t", "x_next", "log_prob", "images"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    # Another grouping into micro-batches, and the samples in reverse order (another batch layout).
    perm = list(reversed(range(len(PROMPTS))))
    others = [
        (engine.generate(PROMPTS, SEEDS, dataclasses.replace(cfg, micro_batch=mb)), list(range(len(PROMPTS))))
        for mb in (5,)
    ]
    others.append(
        (
            engine.generate(
                [PROMPTS[i] for i in perm], [SEEDS[i] for i in perm], dataclasses.replace(cfg, micro_batch=3)
            ),
            perm,
        )
    )
    for other, order in others:
        assert torch.equal(other.window, a.window[order])
        torch.testing.assert_close(other.x_t, a.x_t[order], rtol=0, atol=MICRO_BATCH_LATENT_ATOL)
        torch.testing.assert_close(other.x_next, a.x_next[order], rtol=0, atol=MICRO_BATCH_LATENT_ATOL)
        torch.testing.assert_close(other.log_prob, a.log_prob[order], rtol=0, atol=MICRO_BATCH_LOGPROB_ATOL)
        assert (other.images.int() - a.images[order].int()).abs().max() <= MICRO_BATCH_PIXEL_ATOL
    # And different seeds give different samples.
    c = engine.generate(PROMPTS, [s + 100 for s in SEEDS], cfg)
    assert not torch.equal(c.x_next, a.x_next)


def test_micro_batch_size_one_is_exactly_layout_independent(models):
    """With one sample per forward, shapes never depend on batch-mates: bit-identical in any order."""
    model = models["sd3"]
    cfg = dataclasses.replace(BASE, negative_prompt="", micro_batch=1)
    engine = DiffusersEngine(model)
    a = engine.generate(PROMPTS[:3], SEEDS[:3], cfg)
    b = engine.generate(PROMPTS[2::-1], SEEDS[2::-1], cfg)
    for f in ("x_t", "x_next", "log_prob", "images"):
        assert torch.equal(getattr(b, f), getattr(a, f)[[2, 1, 0]]), f


# ------------------------------------------------------------------------------------------------------
# Errors before model work


class _NoWork:
    """Wraps a model; any encode/velocity/decode call fails the test (errors must come first)."""

    def __init__(self, model):
        self._m = model
        self.transformer = model.transformer

    def latent_shape(self, h, w):
        return self._m.latent_shape(h, w)

    def sigmas(self, n, h, w):
        return self._m.sigmas(n, h, w)

    def encode(self, *a, **k):
        raise AssertionError("model work before validation")

    velocity = decode = encode


@pytest.mark.parametrize(
    ("prompts", "seeds", "changes", "match"),
    [
        ([], [], {}, "prompts is empty"),
        (["a"], [1, 2], {}, "one seed per sample"),
        (["a"], [1], {"height": 60}, "height=60 is not a positive multiple of 16"),
        (["a"], [1], {"width": 72}, "width=72"),
        (["a"], [1], {"window_range": (0, 7)}, r"window_range=\(0, 7\).*num_steps=6"),
        (["a"], [1], {"window_range": (3, 4)}, "lo \\+ window_size <= hi"),
        (["a"], [1], {"window_size": -1}, "window_size=-1"),
        (["a"], [1], {"negative_prompt": None}, "needs negative_prompt"),
        (["a"], [1], {"micro_batch": 0}, "micro_batch=0"),
        (["a"], [1], {"num_steps": 0}, "num_steps=0"),
        (
            ["a"],
            [1],
            {"sde_kind": "cps", "noise_level": 0.7, "window_range": (4, 6)},
            "std 0 at steps \\[5\\]",
        ),
        (["a"], [1], {"noise_level": 0.0}, "std 0"),
        (["a"], [1], {"sde_kind": "nope"}, "kind must be one of"),
        (["a"], [-1], {}, "seed -1 must be in"),
    ],
)
def test_bad_requests_fail_before_model_work(models, prompts, seeds, changes, match):
    engine = DiffusersEngine(_NoWork(models["qwen"]))  # pyright: ignore[reportArgumentType] - a stand-in wrapping the model
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, seeds, dataclasses.replace(BASE, **changes))


def test_init_seeds_replace_only_the_initial_noise(models):
    """init_seeds (one per GRPO group with --grpo.group-init-noise): a sample's own seeds as init seeds change
    nothing, bit for bit; equal init seeds give equal x_1, so ODE samples of one prompt coincide and SDE
    samples whose windows start at the same step enter them in the same state; windows stay the sample's own."""
    eng = DiffusersEngine(models["qwen"])
    ref = eng.generate(PROMPTS, SEEDS, BASE)
    same = eng.generate(PROMPTS, SEEDS, BASE, init_seeds=SEEDS)
    for name in ("x_t", "x_next", "log_prob", "window", "images"):
        assert torch.equal(getattr(ref, name), getattr(same, name)), name

    prompts, seeds = ["a cat"] * 6, [21, 22, 23, 24, 25, 26]
    ode = eng.generate(prompts, seeds, dataclasses.replace(BASE, window_size=0), init_seeds=[7] * 6)
    assert all(torch.equal(ode.images[0], im) for im in ode.images[1:])
    own = eng.generate(prompts, seeds, BASE)
    shared = eng.generate(prompts, seeds, BASE, init_seeds=[7] * 6)
    assert torch.equal(shared.window, own.window)
    starts = shared.window[:, 0].tolist()
    pairs = [(a, b) for a in range(6) for b in range(a + 1, 6) if starts[a] == starts[b]]
    assert pairs, starts  # 6 windows of 2 in [0, 5): some start together (they do for these seeds)
    for a, b in pairs:
        assert torch.equal(shared.x_t[a, 0], shared.x_t[b, 0])
        assert not torch.equal(own.x_t[a, 0], own.x_t[b, 0])
    assert not torch.equal(shared.x_next[pairs[0][0], 0], shared.x_next[pairs[0][1], 0])  # own SDE noise
    with pytest.raises(ValueError, match="init_seeds"):
        eng.generate(prompts, seeds, BASE, init_seeds=[7])


# ------------------------------------------------------------------------------------------------------
# MixGRPO-Flash: DPM-Solver++(2M) on a compressed grid after the shared window

# One window for the batch (steps 1, 2 of 8), as MixGRPO's sliding window gives; after it 5 grid steps remain.
SHARED = dataclasses.replace(BASE, num_steps=8, window_range=(1, 3))
FLASH = dataclasses.replace(SHARED, ode_tail="dpmpp_2m", tail_compress=0.4)


class _Counting:
    """Wraps a model and counts its velocity calls (transformer forwards per micro-batch)."""

    def __init__(self, model):
        self._m, self.calls = model, 0

    def __getattr__(self, name):
        return getattr(self._m, name)

    def velocity(self, *a, **k):
        self.calls += 1
        return self._m.velocity(*a, **k)


@pytest.mark.parametrize("name", ["qwen", "sd3"])
def test_flash_tail_leaves_the_window_unchanged(models, name):
    """The tail comes after the window: the trained transitions are the Euler-tail rollout's bit for bit, the
    rollout's log-probs are recomputed bit for bit, and only the final latents move."""
    model = models[name]
    euler = DiffusersEngine(model).generate(PROMPTS, SEEDS, SHARED)
    flash = DiffusersEngine(model).generate(PROMPTS, SEEDS, FLASH)
    for field in ("window", "x_t", "x_next", "log_prob", "mean", "sigmas"):
        assert torch.equal(getattr(flash, field), getattr(euler, field)), field
    assert torch.equal(recompute_log_probs(model, flash, FLASH), flash.log_prob)
    assert flash.x0 is not None and euler.x0 is not None
    assert not torch.allclose(flash.x0, euler.x0, atol=1e-3)


def test_flash_tail_forward_count(models):
    """Forwards per micro-batch = steps up to the window's end (last + 1) + tail steps (M - 1): with N = 8 and the
    window ending at step 2, M = max(floor(6 ratio), 2), so ratio 0.4 -> 3 + 1 = 4 of 8, 1.0 -> 3 + 5 = 8."""
    counted = _Counting(models["qwen"])
    micro_batches_ = 3  # 5 samples in micro-batches of 2
    for cfg, per_micro_batch in ((SHARED, 8), (FLASH, 4), (dataclasses.replace(FLASH, tail_compress=1.0), 8)):
        counted.calls = 0
        DiffusersEngine(counted).generate(PROMPTS, SEEDS, cfg)  # pyright: ignore[reportArgumentType] - a stand-in wrapping the model
        assert counted.calls == micro_batches_ * per_micro_batch, cfg


@pytest.mark.parametrize(("name", "ratio"), [("qwen", 1.0), ("sd3", 1.0), ("qwen", 0.7)])
def test_flash_tail_matches_diffusers_dpmsolver_multistep(models, name, ratio):
    """From the state the window leaves, diffusers' DPMSolverMultistepScheduler (flow sigmas, dpmsolver++, order 2)
    on the tail's sigmas, its history seeded with the window's last x0 prediction and driven by the same model's
    velocity, lands on the rollout's final latents. With ratio 1 the sigmas are the model's own grid after the
    window (traj.sigmas[last:]); ratio 0.7 keeps 4 of the 6 remaining grid points (3 tail steps). Measured at
    ratio 1: max |diff| 1.2e-6 (Qwen-Image), 2.6e-6 (SD3) on latents of size ~5; without the seeded history (first
    tail step first order) the final latents are 0.48 / 0.39 off."""
    from diffusers.schedulers.scheduling_dpmsolver_multistep import DPMSolverMultistepScheduler

    model = models[name]
    cfg = dataclasses.replace(FLASH, tail_compress=ratio, micro_batch=len(PROMPTS))  # one forward shape
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    last, T, B = 2, cfg.num_steps, len(PROMPTS)
    if ratio == 1.0:
        sigmas = traj.sigmas[last:]
    else:
        tail = model.sigmas_at(T, 64, 64, schedule.compressed_tail(T, last, ratio))
        sigmas = torch.cat([traj.sigmas[last : last + 1], tail, torch.zeros(1)])
        assert len(sigmas) == 5 and sigmas[1] == traj.sigmas[last + 1]

    def velocity(x, s):
        return model.velocity(x, s.expand(B), traj.cond, guidance_scale=cfg.guidance_scale)

    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True, prediction_type="flow_prediction", algorithm_type="dpmsolver++", solver_order=2
    )
    scheduler.set_timesteps(len(sigmas) - 1)
    scheduler.sigmas, scheduler.timesteps = sigmas, sigmas[:-1] * 1000
    x0_window = traj.x_t[:, -1] - sigmas[0] * velocity(traj.x_t[:, -1], sigmas[0])
    scheduler.model_outputs, scheduler.lower_order_nums, scheduler._step_index = [None, x0_window], 1, 1
    x = traj.x_next[:, -1]
    for i in range(1, len(sigmas) - 1):
        # return_dict=True (the default) returns a SchedulerOutput; diffusers types it with the tuple form too
        x = cast(
            SchedulerOutput, scheduler.step(velocity(x, sigmas[i]), scheduler.timesteps[i], x)
        ).prev_sample
    assert traj.x0 is not None
    assert traj.x0.abs().max() > 0.5
    torch.testing.assert_close(traj.x0, x, rtol=0, atol=1e-5)


def test_flash_tail_without_a_window_is_the_euler_rollout(models):
    """Validation sampling (window_size 0) with a flash config: every step stays Euler, bit for bit."""
    ode = dataclasses.replace(SHARED, window_size=0)
    ref = DiffusersEngine(models["qwen"]).generate(PROMPTS, SEEDS, ode)
    out = DiffusersEngine(models["qwen"]).generate(PROMPTS, SEEDS, dataclasses.replace(FLASH, window_size=0))
    assert out.x0 is not None and ref.x0 is not None
    assert torch.equal(out.x0, ref.x0)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"ode_tail": "dpmpp_2m", "window_range": (0, 5)}, "needs one window for the whole batch"),
        ({"ode_tail": "heun"}, "ode_tail='heun'"),
        ({"ode_tail": "dpmpp_2m", "window_range": (1, 3), "tail_compress": 0.0}, "tail_compress=0.0"),
        ({"tail_compress": 0.4}, "set ode_tail='dpmpp_2m'"),
    ],
)
def test_bad_flash_requests_fail_before_model_work(models, changes, match):
    engine = DiffusersEngine(_NoWork(models["qwen"]))  # pyright: ignore[reportArgumentType] - a stand-in wrapping the model
    with pytest.raises(ValueError, match=match):
        engine.generate(["a"], [1], dataclasses.replace(BASE, **changes))


def test_images_reach_the_sink_micro_batch_by_micro_batch(models):
    """on_images gets every micro-batch's decoded images once the next micro-batch's first forward is queued (the
    last one's at once), with the indices of their batch rows, equal to the trajectory's images; the rollout
    helper hands an engine without streaming's images over in one block."""
    from fgrpo.rollout.engine import rollout

    model = models["qwen"]
    cfg = dataclasses.replace(BASE, micro_batch=2)
    got, forwards_before = [], []
    real_velocity = model.velocity

    def counting(*a, **k):
        counting.calls += 1  # pyright: ignore[reportFunctionMemberAccess] - a call counter kept on the function
        return real_velocity(*a, **k)

    counting.calls = 0  # pyright: ignore[reportFunctionMemberAccess] - a call counter kept on the function
    model.velocity = counting
    try:
        traj = DiffusersEngine(model).generate(
            PROMPTS,
            SEEDS,
            cfg,
            on_images=lambda rows, im, meta: (  # pyright: ignore[reportArgumentType] - its return value is dropped
                got.append((rows, im, meta)),
                forwards_before.append(counting.calls),  # pyright: ignore[reportFunctionMemberAccess] - a call counter kept on the function
            ),
        )
    finally:
        del model.velocity
    units = [u.tolist() for u in forward_units(traj.window, 2)]
    # by hand: the micro-batches are the rows sorted by window start, so here not consecutive rows
    assert traj.window[:, 0].tolist() == [1, 3, 2, 3, 0] and units == [[0, 4], [1, 2], [3]]
    assert [r.tolist() for r, _, _ in got] == units  # one block per micro-batch, its rows as indices
    assert all(meta is None for _, _, meta in got)  # Qwen-Image decodes nothing besides pixels
    for rows, im, _ in got:
        np.testing.assert_array_equal(im, traj.images[torch.as_tensor(rows)].numpy())
    per_micro_batch = counting.calls // 3  # pyright: ignore[reportFunctionMemberAccess] - a call counter kept on the function
    # one forward of the next micro-batch queued, none after it; the last micro-batch's at its end
    assert forwards_before == [per_micro_batch + 1, 2 * per_micro_batch + 1, 3 * per_micro_batch]

    class Other:  # an engine that cannot stream (e.g. vLLM-Omni)
        def generate(self, prompts, seeds, cfg):
            return traj

    blocks = []
    rollout(
        Other(),
        PROMPTS,
        SEEDS,
        cfg,
        torch.device("cpu"),
        on_images=lambda r, im, meta: blocks.append((r, im)),
    )
    assert [(r.start, r.stop) for r, _ in blocks] == [(0, 5)]
    np.testing.assert_array_equal(blocks[0][1], traj.images.numpy())


def test_a_one_step_windows_images_reach_the_sink_after_the_next_micro_batchs_forwards(models):
    """MixGRPO-Flash with its window at step 0 has no second window step to hand the previous micro-batch's images
    over at: they go once the next micro-batch's forwards (its window step and ODE tail) are queued, the last
    micro-batch's at its end (3 micro-batches of p forwards each: after 2p, 3p and 3p), equal to the
    trajectory's."""
    model = models["qwen"]
    cfg = dataclasses.replace(BASE, window_size=1, window_range=(0, 1), ode_tail="dpmpp_2m")
    seen, calls = [], []
    real_velocity = model.velocity

    def counting(*a, **k):
        calls.append(1)
        return real_velocity(*a, **k)

    model.velocity = counting
    try:
        traj = DiffusersEngine(model).generate(
            PROMPTS, SEEDS, cfg, on_images=lambda rows, im, meta: seen.append((rows, im, len(calls)))
        )
    finally:
        del model.velocity
    p = len(calls) // 3
    assert [n for _, _, n in seen] == [2 * p, 3 * p, 3 * p] and p > 1
    assert sorted(np.concatenate([r for r, _, _ in seen]).tolist()) == list(range(len(PROMPTS)))
    for rows, im, _ in seen:
        np.testing.assert_array_equal(im, traj.images[torch.as_tensor(rows)].numpy())


def test_forward_units_group_rows_by_window_start():
    # starts 3, 0, 2, 0, 3, 1 -> stable order 1, 3, 5, 2, 0, 4 -> groups of 4 (each sorted) and the rest
    window = torch.tensor([[3, 4], [0, 1], [2, 3], [0, 1], [3, 4], [1, 2]])
    assert [u.tolist() for u in forward_units(window, 4)] == [[1, 2, 3, 5], [0, 4]]
    assert [u.tolist() for u in forward_units(window, 6)] == [[0, 1, 2, 3, 4, 5]]
    same = torch.tensor([[2, 3]] * 5)  # one window for all (MixGRPO): the consecutive rows
    assert [u.tolist() for u in forward_units(same, 2)] == [[0, 1], [2, 3], [4]]
    none = torch.zeros(5, 0, dtype=torch.long)  # no window (ODE sampling): the consecutive rows
    assert [u.tolist() for u in forward_units(none, 2)] == [[0, 1], [2, 3], [4]]
    # blocks of 3 rows (a rollout serving two trainers of 3 samples): each trainer's rows grouped on their own
    assert [u.tolist() for u in forward_units(window, 2, block=3)] == [[1, 2], [0], [3, 5], [4]]
    with pytest.raises(ValueError, match="micro_batch must be >= 1"):
        forward_units(window, 0)


def test_a_rollout_serving_two_trainers_groups_each_share_alone(monkeypatch):
    """In the asynchronous mode one rollout rank samples for several trainers; each trainer regroups its own rows
    (`minibatch_rows`), so the rollout groups within each trainer's share (`unit_block`), never across shares."""
    import fgrpo.algorithms as algorithms_module
    from fgrpo.config import GRPOConfig, ParallelConfig, TrainConfig

    cfg = dataclasses.replace(
        TrainConfig(),
        grpo=GRPOConfig(group_size=4, prompts_per_step=3),  # 12 samples a step
        parallel=ParallelConfig(rollout_ranks=1, max_staleness=1),
    )
    monkeypatch.setattr(algorithms_module, "world_size", lambda: 3)  # 1 rollout + 2 trainer ranks
    sampling = algorithms_module.build(cfg, []).sampling(0)
    assert sampling.unit_block == 6  # a trainer's share
    monkeypatch.setattr(algorithms_module, "world_size", lambda: 1)
    synchronous = dataclasses.replace(cfg, parallel=ParallelConfig())
    assert algorithms_module.build(synchronous, []).sampling(0).unit_block == 12  # the whole batch


def test_exact_rollout_runs_the_training_graph_only_where_a_unit_has_a_window_row(models, monkeypatch):
    """With train_graph, a micro-batch's step runs through autograd when any of its rows is in its window. The
    rollout and the recompute use the same units (`forward_units`: rows grouped by window start), so the
    training graph runs on the union of the windows of rows that share a forward: here 8 forwards of 6 rows' steps
    against 9 for consecutive rows (by hand below)."""
    import fgrpo.recompute as recompute_module
    import fgrpo.rollout.engine as engine_module

    model = models["qwen"]
    rollout_rows: list[list[int]] = []
    real_cond_index = engine_module.cond_index

    def recording(cond, rows):
        rollout_rows.append(rows.tolist())
        return real_cond_index(cond, rows)

    grad_forwards = []
    real_velocity = model.velocity

    def velocity(*a, **k):
        grad_forwards.append(torch.is_grad_enabled())
        return real_velocity(*a, **k)

    monkeypatch.setattr(engine_module, "cond_index", recording)
    monkeypatch.setattr(recompute_module, "cond_index", recording)
    model.velocity = velocity
    try:
        with torch.no_grad():
            traj = DiffusersEngine(model, train_graph=True).generate(PROMPTS, SEEDS, BASE)
    finally:
        del model.velocity
    units = [u.tolist() for u in forward_units(traj.window, BASE.micro_batch)]
    assert rollout_rows == units  # the rollout's forwards are the units

    def union(rows):  # steps at which some row of the forward is in its window
        return len({int(i) for r in rows for i in traj.window[r]})

    # starts 1, 3, 2, 3, 0 (window 2): units [0, 4] {0, 1, 2}, [1, 2] {2, 3, 4}, [3] {3, 4}
    assert traj.window[:, 0].tolist() == [1, 3, 2, 3, 0]
    assert sum(grad_forwards) == sum(union(u) for u in units) == 3 + 3 + 2
    consecutive = [[0, 1], [2, 3], [4]]  # {1, 2, 3, 4}, {2, 3, 4}, {0, 1}
    assert sum(union(u) for u in consecutive) == 4 + 3 + 2
    assert len(grad_forwards) == 3 * BASE.num_steps
    rollout_rows.clear()
    assert torch.equal(recompute_log_probs(model, traj, BASE), traj.log_prob)
    assert rollout_rows == units * BASE.window_size  # the recompute: the same rows, per window position


def _lora_qwen(seed: int) -> QwenImage:
    """A tiny Qwen-Image with a trained-looking adapter (B != 0) on every target."""
    model = tiny.tiny_qwen_image(seed=seed)
    add_lora(model.transformer, rank=2, alpha=4, target_modules=QWEN_IMAGE_LORA_TARGETS)
    with torch.no_grad():
        for n, p in model.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    return model


def test_merged_lora_layer_is_w_plus_scaled_ba_and_restores_the_module():
    model = _lora_qwen(3)
    tr = model.transformer
    merged = MergedLora(tr, ("to_q",))
    names = {n for n, m in tr.named_modules() for layer, _, _ in merged.layers if m is layer}
    assert names and all(n.endswith(".to_q") for n in names)  # only the named targets
    layer, original, copy = merged.layers[0]
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert layer.scaling["default"] == 2.0  # alpha / r
    assert torch.equal(copy, torch.addmm(original, b, a, alpha=2.0))
    x = torch.randn(3, original.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unmerged = layer(x)
        with merged.active():
            assert layer.disable_adapters and layer.get_base_layer().weight.data_ptr() == copy.data_ptr()
            inside = layer(x)
        after = layer(x)
    assert torch.equal(inside, torch.nn.functional.linear(x, copy, layer.get_base_layer().bias))
    torch.testing.assert_close(inside, unmerged, atol=1e-5, rtol=1e-5)  # the same function, rounded otherwise
    assert torch.equal(after, unmerged)  # the adapter back, the original weight tensor back
    assert not layer.disable_adapters and layer.get_base_layer().weight.data_ptr() == original.data_ptr()
    assert all(p.requires_grad for n, p in tr.named_parameters() if "lora_" in n)
    with pytest.raises(ValueError, match="model.merged_rollout found no LoRA layer"):
        MergedLora(tr, ("no_such_layer",))


def test_merged_rollout_merges_only_outside_the_window_and_keeps_the_window_exact(models):
    """merged_lora: forwards of steps where no row of the unit is in its window run the merged image-stream
    layers (the text stream keeps its adapter); the window's forwards run the adapters, so the recompute equals
    the rollout's log-probs bit for bit; the states differ from the unmerged rollout's by rounding only."""
    model = _lora_qwen(4)
    image_q = next(m for n, m in model.transformer.named_modules() if n.endswith("0.attn.to_q"))
    text_q = next(m for n, m in model.transformer.named_modules() if n.endswith("0.attn.add_q_proj"))
    weights = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.transformer.named_parameters()}
    seen: list[tuple[bool, bool, bool]] = []  # per forward: image stream merged, text stream merged, grad on
    real_velocity = model.velocity

    def velocity(*a, **k):
        seen.append((bool(image_q.disable_adapters), bool(text_q.disable_adapters), torch.is_grad_enabled()))
        return real_velocity(*a, **k)

    model.velocity = velocity
    try:
        traj = DiffusersEngine(model, train_graph=True, merged_lora=True).generate(PROMPTS, SEEDS, BASE)
    finally:
        del model.velocity
    units = forward_units(traj.window, BASE.micro_batch)
    in_window = [len({int(i) for r in u for i in traj.window[r]}) for u in units]
    assert [g for _, _, g in seen] == [not m for m, _, _ in seen]  # merged exactly where not through autograd
    assert sum(m for m, _, _ in seen) == sum(BASE.num_steps - w for w in in_window) > 0
    assert not any(t for _, t, _ in seen)  # the text stream is not a merge target
    assert torch.equal(recompute_log_probs(model, traj, BASE), traj.log_prob)
    plain = DiffusersEngine(model, train_graph=True).generate(PROMPTS, SEEDS, BASE)
    assert traj.x0 is not None and plain.x0 is not None
    assert not torch.equal(traj.x0, plain.x0)  # the merged forwards did run ...
    torch.testing.assert_close(traj.x0, plain.x0, atol=1e-4, rtol=0)  # ... and differ by rounding only
    for n, p in model.transformer.named_parameters():  # every tensor back, bit for bit
        assert p.data_ptr() == weights[n][0] and torch.equal(p, weights[n][1]), n
    assert not image_q.disable_adapters


def test_a_merged_first_forward_keeps_the_sharded_lora_gradients_fp32():
    """FSDP2 fixes a unit's gradient dtypes at the model's first forward from the parameters that require grad
    then, and peft's switch that `MergedLora.active()` uses freezes the adapters. A rollout whose first forward
    is a merged one (every window starts after step 0) still leaves the sharded LoRA's bf16 gradients reduced to
    its fp32 masters: the first backward runs and every LoRA gradient is fp32."""
    from fgrpo import parallel

    parallel.init_distributed("cpu")
    model = _lora_qwen(5)
    cast(Any, model.transformer).to(
        torch.bfloat16
    )  # a bf16 base with fp32 LoRA masters, as the trainer sets them up
    for n, p in model.transformer.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    parallel.shard_transformer(model.transformer, param_dtype=torch.bfloat16, shard="adapters")
    # every adapter merged (the renderer's way; Qwen-Image's text-stream adapters would stay on and trainable)
    cast(Any, model).merge_targets = ()
    cfg = dataclasses.replace(BASE, window_range=(2, 5))  # steps 0 and 1 of every unit run merged
    traj = DiffusersEngine(model, merged_lora=True).generate(PROMPTS[:2], SEEDS[:2], cfg)
    assert bool((traj.window[:, 0] >= 2).all())
    sigma = traj.sigmas[traj.window[:, 0]]
    v = model.velocity(traj.x_t[:, 0], sigma, traj.cond, guidance_scale=cfg.guidance_scale)
    v.float().square().mean().backward()
    # the last block's text-stream output is dropped by the model: its adapters get no gradient
    grads = [p.grad for n, p in model.transformer.named_parameters() if "lora_" in n and p.grad is not None]
    assert len(grads) > 10 and {g.dtype for g in grads} == {torch.float32}


needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="model.fp8_rollout needs the fp8 extra (uv sync --extra fp8)",
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _float8_rollout_seen(model, probe, scaling: Float8 = "rowwise") -> tuple[Any, list[tuple[Any, bool]]]:
    """The float8 merged rollout (through the training graph) of PROMPTS, and per forward what `probe()` saw and
    whether grad was on (the window's forwards)."""
    seen: list[tuple[Any, bool]] = []
    real_velocity = model.velocity

    def velocity(*a, **k):
        seen.append((probe(), torch.is_grad_enabled()))
        return real_velocity(*a, **k)

    model.velocity = velocity
    try:
        traj = DiffusersEngine(model, train_graph=True, merged_lora=True, float8=scaling).generate(
            PROMPTS, SEEDS, BASE
        )
    finally:
        del model.velocity
    return traj, seen


@needs_torchao
@pytest.mark.parametrize("scaling, scale_shape", [("rowwise", (32, 1)), ("tensorwise", (1, 1))])
def test_fp8_merged_lora_keeps_only_a_float8_copy_and_restores_the_module(scaling, scale_shape):
    """float8: the merged copy is torchao's Float8Tensor (e4m3 data, a scale per row or per tensor) and is the one
    copy kept; inside, the layer is one float8 matmul of the merged weight, near the bf16 merge's output; on
    leaving, the original Parameter object and the adapter come back, bit for bit."""
    Float8Tensor = pytest.importorskip("torchao.quantization").Float8Tensor  # the optional fp8 extra

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # peft draws lora_A from the global generator
        model = _lora_qwen(3)
    tr = model.transformer
    bf16 = MergedLora(tr, ("to_q",))
    fp8 = MergedLora(tr, ("to_q",), float8=scaling)
    (layer, original, copy), (_, _, merged) = fp8.layers[0], bf16.layers[0]
    f8: Any = copy  # torchao's tensor subclass: its qdata and scale
    assert isinstance(f8, Float8Tensor) and f8.qdata.dtype == torch.float8_e4m3fn
    assert tuple(f8.scale.shape) == scale_shape and f8.dtype == original.dtype  # the model's dtype outside
    torch.testing.assert_close(copy.dequantize(), merged, atol=0, rtol=2**-3)  # e4m3: 3 mantissa bits
    parameter = layer.get_base_layer().weight
    x = torch.randn(3, 7, original.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unmerged = layer(x)
        with fp8.active():
            assert layer.disable_adapters and layer.get_base_layer().weight is copy
            inside = layer(x)
        after = layer(x)
    assert 0 < _rel(inside, unmerged) < 0.05, _rel(inside, unmerged)  # 0.031 rowwise, 0.028 tensorwise
    assert torch.equal(after, unmerged)
    assert layer.get_base_layer().weight is parameter and parameter.data_ptr() == original.data_ptr()
    assert all(p.requires_grad for n, p in tr.named_parameters() if "lora_" in n)


@needs_torchao
def test_fp8_merged_rollout_keeps_the_window_exact():
    """float8: the forwards outside every window run the float8 merged layers (and only those), the window's
    forwards the adapters in the model's dtype, so the recompute equals the rollout's log-probs bit for bit;
    the images differ from the bf16-merged rollout's by a bounded relative error."""
    Float8Tensor = pytest.importorskip("torchao.quantization").Float8Tensor  # the optional fp8 extra

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # peft draws lora_A from the global generator
        model = _lora_qwen(4)
    image_q = next(m for n, m in model.transformer.named_modules() if n.endswith("0.attn.to_q"))
    traj, seen = _float8_rollout_seen(
        model, lambda: isinstance(image_q.get_base_layer().weight, Float8Tensor)
    )
    assert [g for _, g in seen] == [not f for f, _ in seen] and any(f for f, _ in seen)
    assert torch.equal(recompute_log_probs(model, traj, BASE), traj.log_prob)  # the first update's gap: 0
    merged = DiffusersEngine(model, train_graph=True, merged_lora=True).generate(PROMPTS, SEEDS, BASE)
    assert traj.x0 is not None and merged.x0 is not None
    rel = _rel(traj.x0, merged.x0)  # the final latents: 0.041 (6 steps, a unit outside its window at 3 or 4)
    assert 0 < rel < 0.06, rel
    assert not isinstance(image_q.get_base_layer().weight, Float8Tensor)


@needs_torchao
def test_fp8_train_runs_the_base_in_float8_in_rollout_and_training_alike():
    """model.fp8_train: the frozen base of each merge-target LoRA layer becomes torchao's float8 training linear (the
    text stream's stay), so the rollout's window forwards and the recompute are one float8 function (the log-probs
    equal bit for bit), the adapters get gradients through it, and the final latents move from the unconverted
    model's by a bounded relative error. Rowwise scaling only: with one scale per tensor the recompute, whose
    forwards hold other rows than the rollout's, gave other log-probs (config refuses it)."""
    from torchao.float8.float8_linear import Float8Linear  # pyright: ignore[reportMissingImports]

    from fgrpo.models.lora import float8_base_layers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # peft draws lora_A from the global generator
        model = _lora_qwen(4)
    before = DiffusersEngine(model).generate(PROMPTS, SEEDS, BASE)
    names = float8_base_layers(model.transformer, model.merge_targets, "rowwise")
    modules = dict(model.transformer.named_modules())
    assert names and all(isinstance(modules[n].get_base_layer(), Float8Linear) for n in names)
    assert not any(n.endswith("add_q_proj") for n in names)  # the text stream keeps its bf16 base
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, BASE)
    assert torch.equal(recompute_log_probs(model, traj, BASE), traj.log_prob)  # the first update's gap: 0
    assert traj.x0 is not None and before.x0 is not None
    rel = _rel(traj.x0, before.x0)
    assert 0 < rel < 0.1, rel
    sigma = traj.sigmas[traj.window[:, 0]]
    model.velocity(
        traj.x_t[:, 0], sigma, traj.cond, guidance_scale=BASE.guidance_scale
    ).square().mean().backward()
    q = modules[names[0]]
    assert q.lora_A["default"].weight.grad is not None and q.get_base_layer().weight.grad is None


@needs_torchao
@pytest.mark.parametrize("scaling, scale_shape", [("rowwise", (32, 1)), ("tensorwise", (1, 1))])
def test_fp8_train_with_fp8_rollout_runs_the_copies_quantized_once_and_keeps_the_window_exact(
    scaling, scale_shape
):
    """model.fp8_train with model.fp8_rollout: the merged forwards run a plain Linear that holds the float8 copy
    quantized at the merge (torchao's float8 training linear would quantize its weight again in every forward and
    does not take a float8 weight), the window's forwards the float8 training linear with the adapters, so the
    recompute equals the rollout's log-probs bit for bit; on leaving, the very base module comes back. Inside, the
    layer's output is F.linear with the float8 copy, exactly. The copies may scale per tensor (the merged forwards
    give no log-prob) while training stays rowwise: the window is exact either way."""
    import torch.nn.functional as F
    from torchao.float8.float8_linear import Float8Linear  # pyright: ignore[reportMissingImports]

    Float8Tensor = pytest.importorskip("torchao.quantization").Float8Tensor
    from fgrpo.models.lora import float8_base_layers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # peft draws lora_A from the global generator
        model = _lora_qwen(4)
    names = float8_base_layers(model.transformer, model.merge_targets, "rowwise")
    image_q = dict(model.transformer.named_modules())[names[0]]
    base = image_q.get_base_layer()
    traj, seen = _float8_rollout_seen(model, lambda: type(image_q.get_base_layer()).__name__, scaling)
    assert {s for s in seen if not s[1]} == {("Linear", False)}  # merged: the plain stand-in
    assert {s for s in seen if s[1]} == {("Float8Linear", True)}  # the window: the float8 training linear
    assert torch.equal(recompute_log_probs(model, traj, BASE), traj.log_prob)  # the first update's gap: 0
    assert image_q.get_base_layer() is base and isinstance(base, Float8Linear)
    merged = MergedLora(model.transformer, model.merge_targets, float8=scaling)
    copy = next(m for layer, _, m in merged.layers if layer is image_q)
    f8: Any = copy  # torchao's tensor subclass: its scale
    assert isinstance(copy, Float8Tensor) and tuple(f8.scale.shape) == scale_shape
    x = torch.randn(2, 5, base.in_features, generator=torch.Generator().manual_seed(0)).to(base.weight.dtype)
    with torch.no_grad(), merged.active():
        assert torch.equal(image_q(x), F.linear(x, copy, base.bias))
    assert image_q.get_base_layer() is base and not image_q.disable_adapters


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: counts host-device synchronisations")
def test_the_step_loop_never_waits_for_the_gpu(sd3_parts):
    """Every host-to-device copy of the rollout is queued without a stream sync (`_upload`), so the host never
    waits for the GPU inside the step loop: a rollout with twice the SDE steps (each one draws CPU noise and
    stores its transition) synchronises as often, within one, and no more than twice per micro-batch plus the
    setup's few (the decoded images' copy to the CPU is the one a micro-batch needs). On an H200: 7 and 6 for
    windows of 2 and 4. The windows of 2 put an SDE step in 8 (micro-batch, step) pairs, those of 4 in 12: one
    sync per SDE step (each step's noise copied from pageable memory) would exceed the bound and differ by 4."""
    import copy
    import warnings

    cuda = {
        k: copy.deepcopy(v).to("cuda") if isinstance(v, torch.nn.Module) else v for k, v in sd3_parts.items()
    }
    model = _sd3(cuda)
    counts = {}
    for W in (2, 4):
        cfg = dataclasses.replace(BASE, window_size=W, window_range=(0, 6))
        DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)  # warm: the prompt cache, cuBLAS handles
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[W] = sum("synchroniz" in str(w.message) for w in seen)
    units = -(-len(PROMPTS) // BASE.micro_batch)
    assert abs(counts[2] - counts[4]) <= 1 and max(counts.values()) <= 2 * units + 4, counts
    # an image sink adds no synchronisation: each micro-batch's images come back by a copy into pinned memory,
    # waited for by its event once the next micro-batch's forward is queued (an event wait, which the sync debug
    # mode does not count). On an H100 the sink's rollout counted one fewer than the one without (6 against 7).
    cfg = dataclasses.replace(BASE, window_size=2, window_range=(0, 6))
    got = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            traj = DiffusersEngine(model).generate(
                PROMPTS, SEEDS, cfg, on_images=lambda rows, im, meta: got.append((rows, im.copy()))
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum("synchroniz" in str(w.message) for w in seen) <= counts[2], counts
    for rows, im in got:
        np.testing.assert_array_equal(im, traj.images[torch.as_tensor(rows)].cpu().numpy())
