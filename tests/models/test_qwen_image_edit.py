"""Qwen-Image-Edit on tiny random modules: diffusers' QwenImageEditPipeline parity, bit-exact log-prob recompute,
LoRA export that the edit pipeline loads, and the condition image reaching the velocity.

The pipeline resizes condition images to about 1024² pixels (a module-level `calculate_dimensions(1024 * 1024,
ratio)` call inside __call__); the tiny model's condition area is 64², so the parity tests patch that call to 64².
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
from lora_checks import lora_recompute_grads  # tests/models on sys.path
from PIL import Image

from fgrpo.config import SamplingConfig
from fgrpo.data import load_prompts
from fgrpo.models import tiny
from fgrpo.models.base import FlowModel, ImagePrompt
from fgrpo.models.lora import add_lora, export_lora
from fgrpo.models.qwen_image import QWEN_IMAGE_LORA_TARGETS, pack, unpack
from fgrpo.models.qwen_image_edit import EDIT_PROMPT_DROP, EDIT_PROMPT_TEMPLATE, QwenImageEdit
from fgrpo.recompute import recompute_log_probs
from fgrpo.rollout.engine import DiffusersEngine
from fgrpo.rollout.seeds import sample_generator

SIZE = 64  # output and condition images, pixels a side
SEEDS = [11, 12, 13]
BASE = SamplingConfig(
    height=SIZE, width=SIZE, num_steps=6, guidance_scale=4.0, negative_prompt=" ", window_size=2, window_range=(0, 5),
    micro_batch=2,
)  # fmt: skip


def _image(path, color, box) -> str:
    """A plain image with one rectangle: distinct pictures that still give non-trivial VAE latents."""
    im = Image.new("RGB", (SIZE, SIZE), color)
    im.paste((255 - color[0], 40, 200), box)
    im.save(path)
    return str(path)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("cond")
    return [
        _image(d / "a.png", (230, 200, 40), (8, 20, 40, 44)),
        _image(d / "b.png", (20, 90, 160), (30, 4, 60, 30)),
        _image(d / "c.png", (120, 120, 120), (0, 0, 20, 64)),
    ]


@pytest.fixture(scope="module")
def prompts(images):
    texts = ["make it blue", "a cat holding a sign", "hello world"]
    return [ImagePrompt(t, p) for t, p in zip(texts, images)]


@pytest.fixture(scope="module")
def parts():
    return tiny.tiny_qwen_image_edit_components(seed=0)


@pytest.fixture(scope="module")
def model(parts):
    return QwenImageEdit.from_modules(
        parts["transformer"],
        parts["vae"],
        parts["text_encoder"],
        parts["tokenizer"],
        processor=parts["processor"],
        condition_area=SIZE * SIZE,
    )


@pytest.fixture
def pipe(parts, monkeypatch):
    real = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(
        pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: real(SIZE * SIZE, ratio)
    )
    p = QwenImageEditPipeline(**parts)
    p.set_progress_bar_config(disable=True)
    return p


def test_model_implements_the_protocol_and_mirrors_the_pipelines_template(model: QwenImageEdit, pipe):
    assert isinstance(model, FlowModel)
    assert pipe.prompt_template_encode == EDIT_PROMPT_TEMPLATE
    assert pipe.prompt_template_encode_start_idx == EDIT_PROMPT_DROP
    prefix = EDIT_PROMPT_TEMPLATE.split("<|vision_start|>")[0]
    assert (
        len(model.tokenizer(prefix)["input_ids"]) == EDIT_PROMPT_DROP
    )  # the tiny tokenizer drops what Qwen's does


def test_encode_matches_the_pipeline(model, pipe, prompts, images):
    """Instruction embeddings (read with the image), negative ones (read with the same image) and the packed
    condition latents are the pipeline's."""
    cond = model.encode(prompts, negative_prompt=" ")
    pil = [Image.open(p).convert("RGB") for p in images]
    for i, p in enumerate(prompts):
        ref, _ = pipe.encode_prompt(str(p), image=pil[i])
        L = ref.shape[1]
        assert cond["prompt_mask"][i].sum() == L and not cond["prompt_mask"][i, L:].any()
        torch.testing.assert_close(cond["prompt_embeds"][i, :L], ref[0], rtol=0, atol=1e-6)
        neg, _ = pipe.encode_prompt(" ", image=pil[i])
        torch.testing.assert_close(cond["neg_prompt_embeds"][i, : neg.shape[1]], neg[0], rtol=0, atol=1e-6)
    for i, im in enumerate(pil):  # one image a VAE call, as ours (a batch of 3 moves them by ~1e-6)
        pixels = pipe.image_processor.preprocess(im, SIZE, SIZE)[:, :, None]
        _, ref_latents = pipe.prepare_latents(pixels, 1, 4, SIZE, SIZE, torch.float32, "cpu", None)
        assert torch.equal(pack(cond["image_latents"][i : i + 1]), ref_latents)


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_ode_rollout_reproduces_the_edit_pipeline(model, pipe, prompts, images, guidance_scale):
    """η = 0 (no SDE window: every step the Euler step) from the same x_1: the pipeline's final latents to fp32
    rounding and its images to the uint8 rounding."""
    cfg = dataclasses.replace(BASE, window_size=0, guidance_scale=guidance_scale, num_steps=5, micro_batch=3)
    traj = DiffusersEngine(model).generate(prompts, SEEDS, cfg)
    shape = model.latent_shape(SIZE, SIZE)
    # With no window, a sample's generator draws x_1 first.
    x1 = torch.stack([torch.randn(shape, generator=sample_generator(s)) for s in SEEDS])
    kwargs = dict(
        image=[Image.open(p).convert("RGB") for p in images],
        prompt=[str(p) for p in prompts],
        negative_prompt=[" "] * 3 if guidance_scale > 1 else None,
        true_cfg_scale=guidance_scale,
        height=SIZE,
        width=SIZE,
        num_inference_steps=5,
        latents=pack(x1),
    )
    ref_latents = pipe(**kwargs, output_type="latent").images
    assert traj.x0 is not None
    gap = (traj.x0 - unpack(ref_latents, 8, 8)).abs().max().item()
    # The pipeline batches the prompts into one VL forward (right-padded) and runs CFG as two forwards, and feeds
    # the timestep as (1000 sigma) / 1000: float rounding only (measured 4.8e-7 without CFG, 9.5e-7 with, CPU).
    assert gap < 5e-6, gap
    ref = torch.from_numpy(pipe(**kwargs, output_type="np").images) * 255
    assert (traj.images.float() - ref).abs().max() <= 0.5 + 1e-3 and ref.std() > 1.0


def test_the_condition_image_enters_the_velocity(model, prompts, images):
    """The same instruction with another image changes the velocity, both through the condition latents in the
    transformer's sequence and through the VL encoder's reading of the image. Each forward is deterministic, so
    an input that did not enter would leave the velocity bit for bit; the bounds are far above fp32 rounding
    (~1e-7) and below the measured changes (random tiny weights: 0.5 both, 2.7e-3 latents alone, 0.1 text)."""
    same_text = [ImagePrompt("make it blue", p) for p in images[:2]]
    cond = model.encode(same_text)
    x = torch.randn(1, *model.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(0)).expand(
        2, -1, -1, -1
    )
    sigma = torch.full((2,), 0.7)
    v = model.velocity(x, sigma, cond, guidance_scale=1.0)
    assert (v[0] - v[1]).abs().max() > 1e-2
    # Swap only the condition latents: the velocity still changes (the latents enter the transformer).
    swapped = {**cond, "image_latents": cond["image_latents"].flip(0)}
    v_swapped = model.velocity(x, sigma, swapped, guidance_scale=1.0)
    assert (v_swapped[0] - v[0]).abs().max() > 1e-4
    # Swap only the text (read with the other image): it changes too.
    swapped = {
        **cond,
        "prompt_embeds": cond["prompt_embeds"].flip(0),
        "prompt_mask": cond["prompt_mask"].flip(0),
    }
    assert (model.velocity(x, sigma, swapped, guidance_scale=1.0)[0] - v[0]).abs().max() > 1e-3


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_recomputed_log_probs_equal_the_rollouts_bit_exactly(model, prompts, guidance_scale):
    cfg = dataclasses.replace(BASE, guidance_scale=guidance_scale)
    traj = DiffusersEngine(model).generate(prompts, SEEDS, cfg)
    assert torch.isfinite(traj.log_prob).all() and traj.cond["image_latents"].shape[0] == len(prompts)
    assert torch.equal(recompute_log_probs(model, traj, cfg), traj.log_prob)


def test_recompute_is_bit_exact_with_lora_and_grad(prompts):
    m = tiny.tiny_qwen_image_edit(seed=2)
    base = dataclasses.replace(BASE, sde_kind="cps", noise_level=0.7)
    by_name = lora_recompute_grads(m, QWEN_IMAGE_LORA_TARGETS, base, prompts, SEEDS)
    grads = [g for g in by_name.values() if g is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().max() > 0 for g in grads)


def _edit_inputs(transformer):
    """Transformer inputs shaped as in an edit step: 16 target + 16 condition tokens, two RoPE shapes."""
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(2, 32, transformer.config.in_channels, generator=g),
        encoder_hidden_states=torch.randn(2, 7, transformer.config.joint_attention_dim, generator=g),
        timestep=torch.tensor([0.9, 0.3]),
        img_shapes=[[(1, 4, 4), (1, 4, 4)]] * 2,
        return_dict=False,
    )


def test_export_lora_loads_in_the_edit_pipeline(tmp_path):
    comps = tiny.tiny_qwen_image_edit_components(seed=0)
    trained = comps["transformer"]
    base = copy.deepcopy(trained)
    base_out = trained(**_edit_inputs(trained))[0]
    add_lora(trained, rank=4, alpha=8, target_modules=QWEN_IMAGE_LORA_TARGETS, init=False)  # A, B random
    want = trained(**_edit_inputs(trained))[0]
    assert not torch.allclose(want, base_out)  # the adapter changes the output, so the test can fail
    out = export_lora(tmp_path / "lora", trained)
    pipe = QwenImageEditPipeline(**{**comps, "transformer": base})
    pipe.load_lora_weights(str(out))
    assert torch.equal(pipe.transformer(**_edit_inputs(pipe.transformer))[0], want)


def test_prompts_without_an_image_or_of_mixed_shapes_are_clear_errors(model, images, tmp_path):
    with pytest.raises(ValueError, match="needs a condition image per prompt"):
        model.encode(["make it blue"])
    wide = tmp_path / "wide.png"
    Image.new("RGB", (128, 64), (0, 0, 0)).save(wide)
    with pytest.raises(ValueError, match="same aspect ratio"):
        model.encode([ImagePrompt("x", images[0]), ImagePrompt("x", wide)])


def test_jsonl_rows_name_their_condition_image(tmp_path, images):
    """load_prompts: an 'image' field makes the prompt an ImagePrompt (path relative to the file's folder or
    absolute) that is still the plain text for rewards, and survives pickling (reward worker processes)."""
    (tmp_path / "imgs").mkdir()
    Image.open(images[0]).save(tmp_path / "imgs" / "a.png")
    f = tmp_path / "rows.jsonl"
    f.write_text(
        '{"prompt": "Write \\"DOG\\" here", "image": "imgs/a.png"}\n'
        f'{{"prompt": "plain", "image": "{images[1]}"}}\n'
        '{"prompt": "no image"}\n'
    )
    rows = load_prompts(f, require_quoted=False)
    assert rows == ['Write "DOG" here', "plain", "no image"]
    assert isinstance(rows[0], ImagePrompt) and rows[0].image == str(tmp_path / "imgs" / "a.png")
    assert isinstance(rows[1], ImagePrompt) and rows[1].image == images[1]
    assert not isinstance(rows[2], ImagePrompt)
    back = pickle.loads(pickle.dumps(rows[0]))
    assert back == rows[0] and back.image == rows[0].image
    f.write_text('{"prompt": "x", "image": "missing.png"}\n')
    with pytest.raises(ValueError, match="line 1 .*'image' 'missing.png' is not a file"):
        load_prompts(f)


def test_condition_latents_are_the_vae_mode_of_the_resized_image(model, images):
    """Hand check of the condition path: Lanczos resize to the condition size, [-1, 1], VAE mode, (z - mean) / std."""
    pil = Image.open(images[1]).convert("RGB")
    assert pil.size == (SIZE, SIZE)
    x = torch.from_numpy(np.asarray(pil, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)[None, :, None]
    z = model.vae.encode(x).latent_dist.mode()[0, :, 0]
    cfg = model.vae.config
    want = (z - torch.tensor(cfg.latents_mean).view(-1, 1, 1)) / torch.tensor(cfg.latents_std).view(-1, 1, 1)
    (got,) = model.condition_cache(images[1])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
