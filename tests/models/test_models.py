"""Qwen-Image / SD3 FlowModels on tiny random diffusers models: encoding, packing, CFG, LoRA, saving.

End-to-end parity with diffusers' own pipelines lives in tests/rollout/test_engine.py.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import StableDiffusion3Pipeline

from fgrpo.core import guidance
from fgrpo.models import qwen_image, tiny
from fgrpo.models.base import FlowModel
from fgrpo.models.loading import configure_transformer
from fgrpo.models.lora import add_lora
from fgrpo.models.qwen_image import (
    PROMPT_DROP,
    PROMPT_TEMPLATE,
    QWEN_IMAGE_LORA_TARGETS,
    QwenImage,
    pack,
    unpack,
)
from fgrpo.models.sd3 import SD3, SD3_LORA_TARGETS

PROMPTS = ["a cat", "a photo of a dog on a red square", "x"]


@pytest.fixture(scope="module")
def qwen_parts():
    return tiny.tiny_qwen_image_components(seed=0)


@pytest.fixture(scope="module")
def qwen(qwen_parts):
    c = qwen_parts
    return QwenImage.from_modules(c["transformer"], c["vae"], c["text_encoder"], c["tokenizer"])


@pytest.fixture(scope="module")
def sd3_parts():
    return tiny.tiny_sd3_components(seed=0)


@pytest.fixture(scope="module")
def sd3(sd3_parts):
    c = sd3_parts
    return SD3.from_modules(
        c["transformer"],
        c["vae"],
        [c["text_encoder"], c["text_encoder_2"], c["text_encoder_3"]],
        [c["tokenizer"], c["tokenizer_2"], c["tokenizer_3"]],
        max_sequence_length=tiny.T5_MAX_LENGTH_TINY,
    )


def test_models_implement_the_protocol(qwen, sd3):
    assert isinstance(qwen, FlowModel) and isinstance(sd3, FlowModel)


def test_tiny_qwen_tokenizer_splits_the_template_prefix_like_qwen():
    tok = tiny.tiny_qwen_tokenizer()
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    ids = tok(prefix)["input_ids"]
    assert len(ids) == PROMPT_DROP
    # The prefix's last token ends the "user\n" line; the prompt starts right after the drop index.
    full = tok(PROMPT_TEMPLATE.format("hello world"))["input_ids"]
    assert full[:PROMPT_DROP] == ids
    text = tok.decode(full[PROMPT_DROP:])
    assert isinstance(text, str)  # one sequence decodes to one string
    assert text.startswith("hello world<|im_end|>")
    for special in ("<|im_start|>", "<|im_end|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1


@pytest.mark.parametrize("build", [tiny.tiny_qwen_image_components, tiny.tiny_sd3_components])
def test_tiny_builders_are_deterministic(build):
    a, b, c = build(seed=3), build(seed=3), build(seed=4)
    sa, sb, sc = a["transformer"].state_dict(), b["transformer"].state_dict(), c["transformer"].state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    va, vb = a["vae"].state_dict(), b["vae"].state_dict()
    assert all(torch.equal(va[k], vb[k]) for k in va)


def test_tiny_builders_leave_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny.tiny_qwen_image_components(seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_pack_matches_the_pipeline_and_unpack_inverts_it():
    x = torch.randn(2, 4, 6, 10)
    ref = QwenImagePipeline._pack_latents(x[:, None], 2, 4, 6, 10)
    assert torch.equal(pack(x), ref)
    assert torch.equal(unpack(pack(x), 6, 10), x)
    # The pipeline's unpack takes pixel sizes (VAE factor 8): 48 x 80 px <-> 6 x 10 latents.
    assert torch.equal(QwenImagePipeline._unpack_latents(ref, 48, 80, 8)[:, :, 0], x)


def test_qwen_encode_matches_the_pipeline(qwen, qwen_parts):
    pipe = QwenImagePipeline(**qwen_parts)
    ref, ref_mask = pipe.encode_prompt(PROMPTS, device=torch.device("cpu"))
    assert ref_mask is not None
    cond = qwen.encode(PROMPTS, negative_prompt=" ")
    assert torch.equal(cond["prompt_mask"].long(), ref_mask)
    m = cond["prompt_mask"]
    # The pipeline encodes the batch padded, we encode each prompt alone: equal up to float rounding.
    torch.testing.assert_close(cond["prompt_embeds"][m], ref[m.bool()], rtol=1e-5, atol=1e-5)
    assert torch.all(cond["prompt_embeds"][~m] == 0)
    neg, _ = pipe.encode_prompt(" ", device=torch.device("cpu"))
    assert cond["neg_prompt_embeds"].shape == (3, *neg.shape[1:])
    torch.testing.assert_close(cond["neg_prompt_embeds"][1], neg[0], rtol=1e-5, atol=1e-5)


def test_sd3_encode_matches_the_pipeline(sd3, sd3_parts):
    pipe = StableDiffusion3Pipeline(**sd3_parts)
    pe, ne, pp, npool = pipe.encode_prompt(
        PROMPTS,
        None,  # pyright: ignore[reportArgumentType] - diffusers uses prompt for a None prompt_2
        None,  # pyright: ignore[reportArgumentType] - and for a None prompt_3
        device=torch.device("cpu"),
        negative_prompt="",
        max_sequence_length=tiny.T5_MAX_LENGTH_TINY,
    )
    cond = sd3.encode(PROMPTS, negative_prompt="")
    torch.testing.assert_close(cond["prompt_embeds"], pe, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cond["pooled"], pp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cond["neg_prompt_embeds"], ne, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cond["neg_pooled"], npool, rtol=1e-5, atol=1e-6)


def test_prompt_encodings_are_cached_and_independent_of_batch_mates(qwen):
    calls = []
    handle = qwen.text_encoder.register_forward_hook(lambda *a: calls.append(1))
    try:
        qwen.prompt_cache.clear()
        a = qwen.encode(["unique prompt", "unique prompt", "unique prompt"])
        assert len(calls) == 1
        b = qwen.encode(["a much longer prompt than the other one", "unique prompt"])
        assert len(calls) == 2
    finally:
        handle.remove()
    n = int(a["prompt_mask"][0].sum())
    assert torch.equal(a["prompt_embeds"][0, :n], b["prompt_embeds"][1, :n])
    assert not b["prompt_mask"][1, n:].any()


def _transformer_velocity_qwen(model: QwenImage, x, sigma, embeds, mask):
    """One plain forward, no CFG, no padding games: the reference for the batched-CFG velocity."""
    h, w = x.shape[-2:]
    out = model.transformer(
        hidden_states=pack(x),
        timestep=sigma,
        encoder_hidden_states=embeds,
        encoder_hidden_states_mask=mask,
        img_shapes=[(1, h // 2, w // 2)] * x.shape[0],
        return_dict=False,
    )[0]
    return out  # packed


@pytest.mark.parametrize("split_cfg", [True, False])
def test_qwen_true_cfg_equals_per_sample_forwards(qwen, split_cfg, monkeypatch):
    monkeypatch.setattr(qwen, "split_cfg", split_cfg)
    cond = qwen.encode(PROMPTS, negative_prompt=" ")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, *qwen.latent_shape(64, 64), generator=gen)
    sigma = torch.tensor([0.9, 0.5, 0.2])
    v = qwen.velocity(x, sigma, cond, guidance_scale=4.0)
    v_cond = torch.cat(
        [
            _transformer_velocity_qwen(qwen, x[i : i + 1], sigma[i : i + 1], *_unpadded(cond, i, ""))
            for i in range(3)
        ]
    )
    v_neg = torch.cat(
        [
            _transformer_velocity_qwen(qwen, x[i : i + 1], sigma[i : i + 1], *_unpadded(cond, i, "neg_"))
            for i in range(3)
        ]
    )
    ref = unpack(guidance.true_cfg(v_cond, v_neg, 4.0), 8, 8)
    assert v.dtype == torch.float32 and v.shape == x.shape
    torch.testing.assert_close(v, ref, rtol=1e-5, atol=1e-5)
    # guidance_scale 1: the conditional velocity alone (no negative forward).
    torch.testing.assert_close(
        qwen.velocity(x, sigma, cond, guidance_scale=1.0), unpack(v_cond, 8, 8), rtol=1e-5, atol=1e-5
    )
    assert (v - unpack(v_cond, 8, 8)).abs().max() > 1e-3  # CFG did something


def _transformer_calls(model: QwenImage, monkeypatch) -> list[tuple[int, int, bool]]:
    """(rows, text tokens, masked) of each transformer call from here on."""
    calls: list[tuple[int, int, bool]] = []
    forward = model.transformer.forward

    def record(*args, **kwargs):
        embeds, mask = kwargs["encoder_hidden_states"], kwargs["encoder_hidden_states_mask"]
        calls.append((embeds.shape[0], embeds.shape[1], mask is not None))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model.transformer, "forward", record)
    return calls


@pytest.mark.parametrize("split_cfg", [True, False])
def test_qwen_split_cfg_forwards_carry_no_padding_mask(qwen, split_cfg, monkeypatch):
    """Split, each half is trimmed to its own prompts: no mask on the negative half, nor on a positive half whose
    prompts share a length; joint, one forward over both halves, padded to the longer half and masked."""
    monkeypatch.setattr(qwen, "split_cfg", split_cfg)
    calls = _transformer_calls(qwen, monkeypatch)
    x = torch.randn(2, *qwen.latent_shape(64, 64), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.5])
    same = qwen.encode(["a photo of a dog", "a photo of a dog"], negative_prompt=" ")
    mixed = qwen.encode(["a cat", "a photo of a dog on a red square"], negative_prompt=" ")
    L, L_long, L_neg = (
        int(c.sum()) for c in (same["prompt_mask"][0], mixed["prompt_mask"][1], same["neg_prompt_mask"][0])
    )
    assert L_neg < L < L_long
    qwen.velocity(x, sigma, same, guidance_scale=4.0)
    qwen.velocity(x, sigma, mixed, guidance_scale=4.0)
    if split_cfg:
        assert calls == [(2, L, False), (2, L_neg, False), (2, L_long, True), (2, L_neg, False)]
    else:
        assert calls == [(4, L, True), (4, L_long, True)]


def _unpadded(cond, i, prefix):
    m = cond[f"{prefix}prompt_mask"][i]
    return cond[f"{prefix}prompt_embeds"][i : i + 1, m], None


def test_sd3_batched_cfg_equals_two_separate_forwards(sd3):
    cond = sd3.encode(PROMPTS, negative_prompt="")
    x = torch.randn(3, *sd3.latent_shape(64, 64), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.5, 0.2])

    def fwd(e, p):
        return sd3.transformer(
            hidden_states=x,
            timestep=sigma * 1000,
            encoder_hidden_states=e,
            pooled_projections=p,
            return_dict=False,
        )[0]

    v_cond = fwd(cond["prompt_embeds"], cond["pooled"])
    v_neg = fwd(cond["neg_prompt_embeds"], cond["neg_pooled"])
    v = sd3.velocity(x, sigma, cond, guidance_scale=4.0)
    torch.testing.assert_close(v, v_neg + 4.0 * (v_cond - v_neg), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sd3.velocity(x, sigma, cond, guidance_scale=1.0), v_cond, rtol=1e-6, atol=1e-6)


def test_sd3_without_a_clip_encoder_is_a_clear_error(sd3_parts):
    c = sd3_parts
    with pytest.raises(ValueError, match="CLIP-L and CLIP-G"):
        SD3(c["transformer"], c["vae"], [c["text_encoder"], None, None], [c["tokenizer"]] * 3)


@pytest.mark.parametrize("model_name", ["qwen", "sd3"])
def test_cfg_without_negative_prompt_is_a_clear_error(model_name, request):
    model = request.getfixturevalue(model_name)
    cond = model.encode(["a cat"])
    x = torch.zeros(1, *model.latent_shape(64, 64))
    with pytest.raises(ValueError, match="negative prompt"):
        model.velocity(x, torch.ones(1), cond, guidance_scale=4.0)


@pytest.mark.parametrize("model_name", ["qwen", "sd3"])
def test_resolution_must_be_a_multiple_of_vae_factor_times_patch(model_name, request):
    model = request.getfixturevalue(model_name)
    assert model.latent_shape(64, 96) == (4, 8, 12)
    with pytest.raises(ValueError, match=r"height=60 is not a positive multiple of 16 px.*height=64"):
        model.latent_shape(60, 64)
    with pytest.raises(ValueError, match="width=0"):
        model.latent_shape(64, 0)


def test_qwen_schedule_uses_the_packed_token_count(qwen):
    from fgrpo.core import schedule

    kwargs = qwen_image.schedule_kwargs(qwen_image.SCHEDULER_CONFIG)
    assert torch.equal(
        qwen.sigmas(5, 64, 128), schedule.qwen_image_sigmas(5, (64 // 16) * (128 // 16), **kwargs)
    )
    assert not torch.equal(qwen.sigmas(5, 64, 64), qwen.sigmas(5, 512, 512))


def test_schedule_kwargs_fill_diffusers_defaults_and_reject_other_time_shifts():
    # A key the config omits is FlowMatchEulerDiscreteScheduler's default (calculate_shift's 256 / 4096 /
    # 0.5 / 1.15, no terminal stretch), as in the scheduler diffusers would build from that file.
    assert qwen_image.schedule_kwargs({"use_dynamic_shifting": True}) == dict(
        base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15, shift_terminal=None
    )
    with pytest.raises(ValueError, match="use_dynamic_shifting=False"):
        qwen_image.schedule_kwargs({})
    with pytest.raises(ValueError, match="time_shift_type='linear'"):
        qwen_image.schedule_kwargs({**qwen_image.SCHEDULER_CONFIG, "time_shift_type": "linear"})


@pytest.mark.parametrize("kind", ["qwen", "sd3"])
def test_lora_attaches_to_the_configured_targets_and_starts_as_identity(kind):
    model = tiny.tiny_qwen_image(seed=1) if kind == "qwen" else tiny.tiny_sd3(seed=1)
    targets = QWEN_IMAGE_LORA_TARGETS if kind == "qwen" else SD3_LORA_TARGETS
    cond = model.encode(["a cat"], negative_prompt=" ")
    x = torch.randn(1, *model.latent_shape(64, 64), generator=torch.Generator().manual_seed(0))
    before = model.velocity(x, torch.tensor([0.7]), cond, guidance_scale=3.0)
    params = add_lora(model.transformer, rank=2, alpha=4, target_modules=targets)
    assert params and all(p.requires_grad for p in params)
    assert not any(p.requires_grad for n, p in model.transformer.named_parameters() if "lora_" not in n)
    names = [n for n, _ in model.transformer.named_parameters() if "lora_A" in n]
    for t in targets:  # every target name is adapted (SD3's last block has no context projections)
        assert any(f".{t}.lora_A." in n for n in names), t
    torch.testing.assert_close(model.velocity(x, torch.tensor([0.7]), cond, guidance_scale=3.0), before)
    with torch.no_grad():
        for n, p in model.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    after = model.velocity(x, torch.tensor([0.7]), cond, guidance_scale=3.0)
    assert (after - before).abs().max() > 1e-3
    # Gradient checkpointing and the attention backend are switches that keep the numbers (SD3's processors call
    # SDPA themselves: no backend reaches them, `test_an_attention_backend_that_cannot_reach_the_attention_...`).
    backend = "native" if kind == "qwen" else ""
    configure_transformer(model.transformer, gradient_checkpointing=True, attention_backend=backend)
    assert model.transformer.is_gradient_checkpointing
    torch.testing.assert_close(model.velocity(x, torch.tensor([0.7]), cond, guidance_scale=3.0), after)


def test_compile_mode_reaches_the_blocks_compile(monkeypatch):
    """configure_transformer(compile_mode=...) is torch.compile's mode for the repeated blocks (benchmarks/attention.py
    times "reduce-overhead", CUDA graphs); the default names no mode, so a family's inductor options still apply."""
    model = tiny.tiny_qwen_image(seed=0)
    calls: list[dict] = []
    monkeypatch.setattr(model.transformer, "compile_repeated_blocks", lambda **kw: calls.append(kw))
    configure_transformer(model.transformer, compile_blocks=True, compile_mode="reduce-overhead")
    configure_transformer(model.transformer, compile_blocks=True)
    assert calls[0]["mode"] == "reduce-overhead" and calls[0]["fullgraph"] is True
    assert "mode" not in calls[1]


def test_an_attention_backend_that_cannot_reach_the_attention_is_refused():
    """diffusers' SD3 processors call torch SDPA themselves: set_attention_backend would change nothing there."""
    sd3 = tiny.tiny_sd3(seed=0)
    with pytest.raises(ValueError, match="model.attention_backend='native': no attention processor of SD3"):
        configure_transformer(sd3.transformer, attention_backend="native")


def test_add_lora_rejects_bad_settings(qwen):
    with pytest.raises(ValueError, match="rank"):
        add_lora(qwen.transformer, rank=0, alpha=1)
    with pytest.raises(ValueError, match="target_modules"):
        add_lora(qwen.transformer, rank=2, alpha=1, target_modules=())


def test_saved_tiny_qwen_image_loads_with_diffusers_and_our_loader(tmp_path, qwen_parts):
    path = tiny.save_tiny_qwen_image(tmp_path / "tiny-qwen-image", seed=0)
    assert (path / "model_index.json").exists()
    pipe = QwenImagePipeline.from_pretrained(path)
    ref = qwen_parts["transformer"].state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in pipe.transformer.state_dict().items())
    loaded = QwenImage.from_pretrained(path, dtype=torch.float32, device="cpu")
    assert loaded.schedule_kwargs == qwen_image.schedule_kwargs(qwen_image.SCHEDULER_CONFIG)
    assert loaded.schedule_kwargs["shift_terminal"] == 0.02
    ours = QwenImage.from_modules(
        qwen_parts["transformer"], qwen_parts["vae"], qwen_parts["text_encoder"], qwen_parts["tokenizer"]
    )
    a, b = loaded.encode(PROMPTS), ours.encode(PROMPTS)
    assert torch.equal(a["prompt_mask"], b["prompt_mask"])
    torch.testing.assert_close(a["prompt_embeds"], b["prompt_embeds"], rtol=0, atol=0)


def test_saved_tiny_sd3_loads_with_our_loader(tmp_path, sd3, sd3_parts):
    StableDiffusion3Pipeline(**sd3_parts).save_pretrained(tmp_path / "tiny-sd3")
    loaded = SD3.from_pretrained(
        tmp_path / "tiny-sd3", dtype=torch.float32, device="cpu", max_sequence_length=tiny.T5_MAX_LENGTH_TINY
    )
    assert loaded.shift == 3.0
    a, b = loaded.encode(PROMPTS, negative_prompt=""), sd3.encode(PROMPTS, negative_prompt="")
    assert all(torch.equal(a[k], b[k]) for k in b)
