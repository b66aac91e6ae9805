"""textbed: the FlowModel contract on a tiny random model, and the committed checkpoint really renders text."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fgrpo.core import guidance
from fgrpo.models import textbed as tb
from fgrpo.models.base import FlowModel, cond_index
from fgrpo.rollout.engine import render_words
from fgrpo.scripts import load_script

TINY = tb.TextbedConfig(
    num_layers=1, num_heads=2, head_dim=16, axes_dims_rope=(4, 6, 6), text_dim=32, text_layers=1, text_heads=2
)
TINY_SD3 = dataclasses.replace(TINY, arch="sd3", num_layers=2)  # one dual-attention block, one plain


@pytest.fixture(scope="module", params=[TINY, TINY_SD3], ids=["qwen_image", "sd3"])
def tiny_model(request):
    torch.manual_seed(0)
    model = tb.TextbedModel(request.param).eval().requires_grad_(False)
    # Random init gives near-zero output projections; perturb so cond and uncond velocities differ a lot.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_shapes_and_protocol(tiny_model):
    m = tiny_model
    assert isinstance(m, FlowModel)
    cond = m.encode(['"CAT"', '"HOUSE"', '"AB"'], negative_prompt=" ")
    assert set(cond) == {"prompt_embeds", "prompt_mask", "neg_prompt_embeds", "neg_prompt_mask"}
    assert cond["prompt_embeds"].shape == (3, TINY.max_text_len, TINY.text_dim)
    assert cond["prompt_mask"].dtype == torch.bool
    # BOS + quote + letters + quote, rest padding.
    assert cond["prompt_mask"].sum(1).tolist() == [6, 8, 5]
    assert cond["neg_prompt_mask"].sum(1).tolist() == [1, 1, 1]  # " " strips to the empty (dropout) prompt
    assert m.latent_shape(32, 128) == (8 * 32, 16)
    sig = m.sigmas(10, 32, 128)
    assert sig.shape == (11,) and sig[0] == 1 and sig[-1] == 0 and (sig.diff() < 0).all()
    with pytest.raises(ValueError, match="height=64"):
        m.latent_shape(64, 128)
    with pytest.raises(ValueError, match="at most 15"):
        m.encode(['"ABCDEFGHIJKLMNOP"'])
    with pytest.raises(ValueError, match="neg_prompt_embeds"):
        m.velocity(torch.zeros(3, 256, 16), torch.ones(3), m.encode(['"A"'] * 3), guidance_scale=3.0)


def test_cfg_is_one_batched_forward_equal_to_two(tiny_model):
    m = tiny_model
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 256, 16, generator=g)
    sigma = torch.tensor([0.9, 0.5, 0.1])
    cond = m.encode(['"CAT"', '"HOUSE"', '"AB"'], negative_prompt="")
    calls = []
    h = m.transformer.register_forward_hook(lambda mod, args, kwargs_out: calls.append(1))
    try:
        v = m.velocity(x, sigma, cond, guidance_scale=4.0)
    finally:
        h.remove()
    assert len(calls) == 1 and v.dtype == torch.float32 and v.shape == x.shape
    uncond = {"prompt_embeds": cond["neg_prompt_embeds"], "prompt_mask": cond["neg_prompt_mask"]}
    v_c = m.velocity(x, sigma, cond, guidance_scale=1.0)
    v_u = m.velocity(x, sigma, uncond, guidance_scale=1.0)
    assert (v_c - v_u).abs().mean() > 1e-3  # the prompt matters, so the check below is not vacuous
    torch.testing.assert_close(v, guidance.cfg(v_c, v_u, 4.0), atol=1e-5, rtol=1e-5)
    # Per-sample independence: a row's velocity does not depend on the rest of the batch.
    v1 = m.velocity(x[1:2], sigma[1:2], cond_index(cond, slice(1, 2)), guidance_scale=4.0)
    torch.testing.assert_close(v1, v[1:2], atol=1e-5, rtol=1e-5)


def test_patchify_decode():
    g = torch.Generator().manual_seed(2)
    img = torch.rand(2, 32, 128, generator=g) * 2 - 1
    tokens = tb.patchify(img, 4)
    assert tokens.shape == (2, 256, 16)
    assert torch.equal(tokens[0, 33], img[0, 4:8, 4:8].reshape(16))  # token (row 1, col 1) is that 4x4 patch
    assert torch.equal(tb.unpatchify(tokens, 32, 128, 4), img)
    m = tb.TextbedModel(TINY)
    x0 = tb.patchify(torch.tensor([-1.0, 1.0, 0.0, 5.0]).repeat(2, 32, 32), 4)
    out = m.decode(x0, 32, 128)
    assert out.shape == (2, 32, 128, 3) and out.dtype == torch.uint8
    assert out[0, 0, :4, 0].tolist() == [
        0,
        255,
        128,
        255,
    ]  # -1 -> 0, 1 -> 255, 0 -> 127.5 rounds to 128, clamp
    assert torch.equal(out[..., 0], out[..., 1]) and torch.equal(out[..., 0], out[..., 2])
    up = tb.upscale(torch.full((1, 32, 128, 3), 77, dtype=torch.uint8), 2)
    assert up.shape == (1, 64, 256, 3) and (up == 77).all()


def test_words_and_split():
    text = 'A sign reading "Hello World" by the Seaside Cafe, it\'s open.\nA mug: "Latte" on a table'
    assert tb.extract_words(text) == ["CAFE", "MUG", "OPEN", "READING", "SEASIDE", "SIGN", "TABLE", "THE"]
    train, held = tb.read_words("train"), tb.read_words("heldout")
    assert (
        not set(train) & set(held)
        and all(tb.is_heldout(w) for w in held)
        and not any(map(tb.is_heldout, train))
    )
    assert 0.08 < len(held) / (len(train) + len(held)) < 0.18
    assert all(w.isalpha() and w.isupper() and 3 <= len(w) <= 8 for w in train + held)


def test_save_load_roundtrip(tiny_model, tmp_path):
    """Parameters go through the file in bf16; buffers stay out of it (SD3's fixed sin-cos positions), so the
    loaded model has the constructor's fp32 values, also from an older file that holds them in bf16; a file
    without a parameter is refused, naming it."""
    from safetensors.torch import load_file, save_file

    tb.save_textbed(tiny_model, tmp_path, {"note": "test"})
    params = dict(tiny_model.named_parameters())
    assert load_file(str(tmp_path / "model.safetensors")).keys() == params.keys()
    loaded = tb.load_textbed(tmp_path)
    assert loaded.cfg == tiny_model.cfg
    buffers = [k for k in tiny_model.state_dict() if k not in params]
    assert buffers == (["transformer.pos_embed.pos_embed"] if tiny_model.cfg.arch == "sd3" else [])
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16).float() if k in params else v), k

    old = tb.state_dict_for_save(tiny_model) | {
        k: tiny_model.state_dict()[k].to(torch.bfloat16) for k in buffers
    }
    save_file(old, str(tmp_path / "model.safetensors"))  # the older format: buffers in bf16 too
    again = tb.load_textbed(tmp_path).state_dict()
    assert all(torch.equal(again[k], tiny_model.state_dict()[k]) for k in buffers)
    name = next(iter(params))
    save_file({k: v for k, v in old.items() if k != name}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"missing \\['{re.escape(name)}'\\]"):
        tb.load_textbed(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        tb.load_textbed(tmp_path / "missing")


@pytest.mark.parametrize("name", ["", "sd3"])
def test_committed_checkpoint_renders_heldout_words_ocr_reads_exactly(name):
    """Each bundled checkpoint, sampled by fgrpo's rollout engine (ODE: no SDE window), draws
    held-out words (never seen in pretraining) that the fgrpo OCR engine reads back letter for letter."""
    from fgrpo.rewards.ocr import RapidOcrEngine, is_exact, ocr_score

    model = tb.load_textbed(name)
    assert model.cfg.arch == (name or "qwen_image")
    assert sum(p.numel() for p in model.parameters()) * 2 <= 20 * 2**20  # bf16 checkpoint <= 20 MiB
    # The first 5 held-out words with seeds 0-4 and 10 steps (the tiny Flow-GRPO preset's count); measured
    # on the committed checkpoints: 2 of the 5 are read exactly by the Qwen-Image renderer (AGENT, AIRPORT),
    # 3 by the SD3 one (ACTORS, AGENCY, AGENT), so one float-rounding flip cannot fail this.
    words = tb.read_words("heldout")[:5]
    images = render_words(model, [tb.prompt_for(w) for w in words], seeds=range(len(words)), num_steps=10)
    texts = RapidOcrEngine(det_limit_side_len=64, num_threads=2).recognize(tb.upscale(images, 2).numpy())
    scores = [ocr_score(t, w) for w, t in zip(words, texts)]
    exact = [w for w, s in zip(words, scores) if is_exact(s)]
    assert exact, f"no held-out word read exactly: {list(zip(words, texts))}, scores {scores}"


def _pretraining():
    return load_script(Path(__file__).resolve().parents[1] / "experiments" / "pretrain_textbed.py")


def test_pretraining_ema_is_the_hand_written_recipe_ema():
    """The pretraining's EMA (torch's AveragedModel + get_ema_multi_avg_fn) is the recipe's formula bit for
    bit: e_0 = the init weights, e_{k+1} = lerp(e_k, p_{k+1}, 1 - d_k) with d_k = min(ema, (1 + k) / (10 + k))
    (the hand-written `torch._foreach_lerp_` the committed checkpoint was trained with), which is
    d_k e_k + (1 - d_k) p_{k+1} up to rounding. ema = 0.3 makes the cap bind from step 3 on."""
    pt = _pretraining()
    cfg = dataclasses.replace(pt.Config(), ema=0.3)
    torch.manual_seed(0)
    model = tb.TextbedModel(TINY)
    params = list(model.parameters())
    ema = pt.make_ema(model)
    ref = [p.detach().clone() for p in params]
    closed = [p.detach().double() for p in params]
    g = torch.Generator().manual_seed(1)
    for k in range(6):
        with torch.no_grad():  # an optimizer step
            for p in params:
                p.add_(torch.randn(p.shape, generator=g))
        pt.update_ema(ema, model, cfg, k)
        d = min(0.3, (1 + k) / (10 + k))
        torch._foreach_lerp_(ref, [p.detach() for p in params], 1 - d)  # pyright: ignore[reportPrivateImportUsage] - torch does not re-export it
        closed = [d * c + (1 - d) * p.detach().double() for c, p in zip(closed, params)]
    averaged = list(ema.module.parameters())
    assert len(averaged) == len(ref) and all(torch.equal(a, r) for a, r in zip(averaged, ref))
    for a, c in zip(averaged, closed):
        torch.testing.assert_close(a.double(), c, rtol=1e-5, atol=1e-5)
    assert not torch.equal(averaged[0], params[0])  # it averaged, it did not copy


@pytest.mark.slow
def test_sd3_renderer_has_sd35_medium_structure_and_trains_with_fgrpo(tmp_path):
    """arch='sd3' builds diffusers' SD3Transformer2DModel with SD3.5-M's pieces (qk RMS-norm, dual attention in
    the first half), and the renderer goes through fgrpo's loop as it is: load by config.json, LoRA on SD3's
    attention projections, two Flow-GRPO steps that change the adapters, the adapter exported."""
    from diffusers.models.attention import JointTransformerBlock
    from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

    from fgrpo.models.sd3 import SD3_LORA_TARGETS

    torch.manual_seed(0)
    model = tb.TextbedModel(TINY_SD3)
    t = model.transformer
    assert isinstance(t, SD3Transformer2DModel)
    assert [b.attn2 is not None for b in t.transformer_blocks] == [True, False]
    block = t.transformer_blocks[0]
    assert isinstance(block, JointTransformerBlock)
    assert block.attn.norm_q.__class__.__name__ == "RMSNorm"
    tb.save_textbed(model, tmp_path / "renderer")
    assert tb.load_textbed(tmp_path / "renderer").cfg.arch == "sd3"

    m = _load_experiment("qwen_image_ocr")
    base = m.tiny()
    cfg = dataclasses.replace(
        base,
        num_steps=2,
        model=dataclasses.replace(
            base.model, path=str(tmp_path / "renderer"), lora_targets=",".join(SD3_LORA_TARGETS)
        ),
        grpo=dataclasses.replace(base.grpo, prompts_per_step=1, group_size=4),
        data=dataclasses.replace(base.data, val_num_prompts=2),
        # a random renderer draws no text (OCR 0 for all: no advantage); compressibility tells its images apart
        reward=dataclasses.replace(base.reward, name="jpeg_compressibility"),
        run=dataclasses.replace(
            base.run, out_dir=str(tmp_path), val_every=0, ckpt_every=0, log_images_every=0
        ),
    )
    from fgrpo.train import train

    train(cfg)
    run = tmp_path / cfg.exp_name
    rows = [line for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    assert len(rows) == 2
    adapter = next(run.rglob("*.safetensors"), None)
    assert adapter is not None
    from safetensors.torch import load_file

    weights = load_file(str(adapter))
    assert any("attn.to_q" in k for k in weights) and any("lora_B" in k for k in weights)
    assert any(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k)  # B starts at 0: it trained


@pytest.mark.slow
def test_pretraining_trains_the_sd3_renderer(capsys):
    """experiments/pretrain_textbed.py with --model.arch sd3: the same loop fits the SD3 renderer (the
    flow-matching loss falls over 12 steps of one small bank at a high lr), so the SD3.5 family gets its
    pretrained renderer from the command that made the Qwen-Image one."""
    import re

    pt = _load_experiment("pretrain_textbed")
    base = pt.tiny()
    cfg = dataclasses.replace(
        base,
        max_steps=12,
        model=dataclasses.replace(base.model, arch="sd3", num_layers=2),
        optim=dataclasses.replace(base.optim, lr=2e-3, warmup_steps=0),
        eval=dataclasses.replace(base.eval, enabled=False),
    )
    pt.check_config(cfg)
    snapshots = pt.train(cfg)
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", capsys.readouterr().out)]
    assert len(losses) == 12 and snapshots
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3


def _load_experiment(name: str):
    return load_script(Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py")
