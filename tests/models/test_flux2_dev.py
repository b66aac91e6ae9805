"""FLUX.2 [dev] on tiny random modules: Flux2Pipeline parity (Mistral-3 encodings through the processor's chat
template with the system message, η = 0 sampling with the embedded guidance), bit-exact log-prob recompute with and
without LoRA, LoRA export that the pipeline loads, and loading a saved pipeline directory (dev told from klein)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from lora_checks import lora_recompute_grads  # tests/models on sys.path

from fgrpo.config import ModelConfig, SamplingConfig
from fgrpo.errors import ConfigError
from fgrpo.models import tiny
from fgrpo.models.base import FlowModel
from fgrpo.models.flux2 import FLUX2_LORA_TARGETS, Flux2, flux2_variant, image_ids, pack, text_ids
from fgrpo.models.lora import add_lora, export_lora
from fgrpo.models.registry import FAMILIES, build_tiny
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
LENGTH, LAYERS = tiny.FLUX2_DEV_TEXT_LENGTH_TINY, tiny.FLUX2_TEXT_LAYERS_TINY


@pytest.fixture(scope="module")
def parts():
    return tiny.tiny_flux2_dev_components(seed=0)


@pytest.fixture(scope="module")
def model(parts):
    return Flux2.from_modules(
        parts["transformer"],
        parts["vae"],
        parts["text_encoder"],
        parts["tokenizer"],
        max_sequence_length=LENGTH,
        text_layers=LAYERS,
        system_message=SYSTEM_MESSAGE,
    )


@pytest.fixture(scope="module")
def pipe(parts):
    p = Flux2Pipeline(**parts)
    p.set_progress_bar_config(disable=True)
    return p


def test_model_is_a_guidance_distilled_flowmodel(model):
    # one forward a step whatever the scale: what the benchmarks' FLOP counts read
    assert model.guidance_embeds and model.cfg_forwards == 1
    assert isinstance(model, FlowModel) and isinstance(build_tiny("flux2_dev"), Flux2)


def test_encode_matches_the_pipeline(model, pipe):
    """The pipeline encodes the batch at once through Mistral-3's processor, we one prompt at a time (cached):
    fixed-length padding and a causal encoder make the rows independent, so they are bit-equal."""
    pe, ids = pipe.encode_prompt(PROMPTS, max_sequence_length=LENGTH, text_encoder_out_layers=LAYERS)
    cond = model.encode(PROMPTS)
    assert cond["prompt_embeds"].shape == (3, LENGTH, 48)
    assert torch.equal(cond["prompt_embeds"], pe)
    assert torch.equal(text_ids(LENGTH), ids[0].float())  # what velocity passes as txt_ids


def test_the_template_holds_the_system_turn_and_drops_image_placeholders(model, parts):
    """The tokens are the system message's turn then the prompt's (the pipeline's format), padded to the length;
    another system message changes the encoding; "[IMG]" in a prompt is dropped before the template."""
    tokens = model._tokenize("a cat")
    text = parts["tokenizer"].tokenizer.decode(tokens["input_ids"][0][tokens["attention_mask"][0].bool()])
    assert text == f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]a cat[/INST]"
    assert tokens["input_ids"].shape == (1, LENGTH)
    other = copy.copy(model)
    other.system_message = "You draw."
    other.prompt_cache = type(model.prompt_cache)(other._encode_one, 4)
    assert not torch.equal(other.encode(["a cat"])["prompt_embeds"], model.encode(["a cat"])["prompt_embeds"])
    assert torch.equal(model._encode_one("a [IMG]cat")[0], model._encode_one("a cat")[0])


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_ode_rollout_reproduces_the_pipeline(model, pipe, guidance_scale):
    """η = 0 from the same x_1 and prompt embeddings, the guidance fed to the transformer's embedding (one forward, no
    negative prompt): the pipeline's final latents to fp32 rounding (its timestep is (1000 σ) / 1000, ours σ) and its
    images to the uint8 rounding; another guidance value changes them."""
    cfg = dataclasses.replace(
        BASE, window_size=0, window_range=(0, 0), guidance_scale=guidance_scale, micro_batch=3
    )
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    x1 = torch.stack(
        [torch.randn(model.latent_shape(SIZE, SIZE), generator=sample_generator(s)) for s in SEEDS]
    )
    kwargs = dict(
        prompt_embeds=model.encode(PROMPTS)["prompt_embeds"],
        height=SIZE,
        width=SIZE,
        num_inference_steps=cfg.num_steps,
        guidance_scale=guidance_scale,
        latents=x1,
        max_sequence_length=LENGTH,
    )
    # Flux2Pipeline's "latent" output is the packed, still normalised tokens [B, h w, 128]: our x0 packed
    ref = pipe(**kwargs, output_type="latent").images  # pyright: ignore[reportAttributeAccessIssue]
    assert traj.x0 is not None
    assert ref.abs().max() > 1.0 and (pack(traj.x0) - ref).abs().max() < 1e-5
    images = pipe(**kwargs, output_type="np").images  # pyright: ignore[reportAttributeAccessIssue]
    ref_px = torch.from_numpy(images) * 255
    assert traj.images.shape == (3, SIZE, SIZE, 3) and traj.images.dtype == torch.uint8
    assert (traj.images.float() - ref_px).abs().max() <= 0.5 + 1e-3 and ref_px.std() > 1.0
    other = DiffusersEngine(model).generate(PROMPTS, SEEDS, dataclasses.replace(cfg, guidance_scale=2.5))
    assert other.x0 is not None and (other.x0 - traj.x0).abs().max() > 1e-4


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_recomputed_log_probs_equal_the_rollouts_bit_exactly(model, guidance_scale):
    cfg = dataclasses.replace(BASE, guidance_scale=guidance_scale)
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    assert torch.isfinite(traj.log_prob).all() and traj.x_t.shape == (3, 2, 16, 4, 4)
    assert torch.equal(recompute_log_probs(model, traj, cfg), traj.log_prob)


def test_recompute_is_bit_exact_with_lora_and_grad():
    m = tiny.tiny_flux2_dev(seed=2)
    grads = lora_recompute_grads(m, FLUX2_LORA_TARGETS, BASE, PROMPTS, SEEDS)
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert sum(g.abs().max() > 0 for g in grads.values() if g is not None) > len(grads) // 2


def _transformer_inputs(transformer):
    """Transformer inputs of one tiny step: 16 image tokens (a 64² image), 6 text tokens, guidance 4."""
    g = torch.Generator().manual_seed(0)
    cfg = transformer.config
    return dict(
        hidden_states=torch.randn(2, 16, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(2, 6, cfg.joint_attention_dim, generator=g),
        timestep=torch.tensor([0.9, 0.3]),
        guidance=torch.full((2,), 4.0),
        txt_ids=text_ids(6),
        img_ids=image_ids(4, 4),
        return_dict=False,
    )


def test_export_lora_loads_in_the_pipeline(tmp_path):
    comps = tiny.tiny_flux2_dev_components(seed=0)
    trained = comps["transformer"]
    base = copy.deepcopy(trained)
    base_out = trained(**_transformer_inputs(trained))[0]
    add_lora(trained, rank=4, alpha=8, target_modules=FLUX2_LORA_TARGETS, init=False)  # A, B random
    want = trained(**_transformer_inputs(trained))[0]
    assert not torch.allclose(want, base_out)
    out = export_lora(tmp_path / "lora", trained)
    pipe = Flux2Pipeline(**{**comps, "transformer": base})
    pipe.load_lora_weights(str(out))
    got = pipe.transformer(**_transformer_inputs(pipe.transformer))[0]
    assert torch.equal(got, want)


def test_from_pretrained_tells_dev_from_klein(tmp_path, model):
    """A saved Flux2Pipeline loads with Mistral-3, its processor, the system message and the dev layers (10, 20, 30);
    a saved Flux2KleinPipeline with Qwen3; the registry refuses a directory of the other variant."""
    dev_dir, klein_dir = tmp_path / "dev", tmp_path / "klein"
    Flux2Pipeline(**tiny.tiny_flux2_dev_components(seed=0)).save_pretrained(dev_dir)
    Flux2KleinPipeline(**tiny.tiny_flux2_components(seed=0), is_distilled=False).save_pretrained(klein_dir)
    assert (flux2_variant(dev_dir), flux2_variant(klein_dir)) == ("dev", "klein")
    loaded = Flux2.from_pretrained(dev_dir, dtype=torch.float32, device="cpu")
    assert (loaded.system_message, loaded.text_layers, loaded.guidance_embeds) == (
        SYSTEM_MESSAGE,
        (10, 20, 30),
        True,
    )
    type_name = type(loaded.text_encoder).__name__
    assert (
        type_name == "Mistral3ForConditionalGeneration"
        and type(loaded.tokenizer).__name__ == "PixtralProcessor"
    )
    # the tiny encoder has 3 layers: read them, and the saved modules encode as the in-memory ones
    loaded.text_layers, loaded.max_sequence_length = LAYERS, LENGTH
    assert torch.equal(loaded._encode_one(PROMPTS[1])[0], model._encode_one(PROMPTS[1])[0])
    klein = Flux2.from_pretrained(klein_dir, dtype=torch.float32, device="cpu")
    assert klein.system_message is None and not klein.guidance_embeds and klein.cfg_forwards == 2
    with pytest.raises(
        ConfigError,
        match=r"holds FLUX.2 \[klein\], model.kind='flux2_dev' wants \[dev\]; use --model.kind flux2",
    ):
        FAMILIES["flux2_dev"].load(
            ModelConfig(kind="flux2_dev", path=str(klein_dir)), "cpu", torch.float32, 0
        )
    with pytest.raises(
        ConfigError,
        match=r"holds FLUX.2 \[dev\], model.kind='flux2' wants \[klein\]; use --model.kind flux2_dev",
    ):
        FAMILIES["flux2"].load(ModelConfig(kind="flux2", path=str(dev_dir)), "cpu", torch.float32, 0)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    with pytest.raises(ConfigError, match="model.path: .* holds a FluxPipeline, not a FLUX.2 pipeline"):
        FAMILIES["flux2_dev"].load(
            ModelConfig(kind="flux2_dev", path=str(tmp_path / "other")), "cpu", torch.float32, 0
        )
