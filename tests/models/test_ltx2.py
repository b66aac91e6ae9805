"""LTX-2 (text to audio + video) on tiny random modules: LTX2Pipeline parity (encodings, η = 0 sampling, decoded
frames and waveform), bit-exact log-prob recompute of the joint audio-video transition with and without CFG and
LoRA, LoRA export that the pipeline loads, the joint latent's layout, and the checkpointed backward under FSDP2's
bf16 compute.

LTX2Pipeline's defaults switch on guidance our sampler does not run (spatio-temporal guidance, modality-isolation
guidance, guidance rescale, a separate audio CFG scale; `audio_* or video_value` falls back to the video value only
for a falsy audio value): the parity calls pin every one of them off, as diffusers' own LTX-2 tests do.
"""

from __future__ import annotations

import copy
import dataclasses
import typing

import pytest
import torch
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
from lora_checks import lora_recompute_grads  # tests/models on sys.path

from fgrpo import parallel
from fgrpo.config import ModelConfig, SamplingConfig
from fgrpo.models import ltx2, tiny
from fgrpo.models.base import FlowModel
from fgrpo.models.lora import add_lora, export_lora, setup_trainable
from fgrpo.models.ltx2 import LTX2, LTX2_LORA_TARGETS, LTX2Config
from fgrpo.models.registry import build_model
from fgrpo.recompute import recompute_log_probs
from fgrpo.rollout.engine import DiffusersEngine
from fgrpo.rollout.seeds import sample_generator

SIZE = 32
PROMPTS = ["a cat", "a sign that says hello world", "x"]
SEEDS = [11, 12, 13]
BASE = SamplingConfig(
    height=SIZE, width=SIZE, num_steps=5, guidance_scale=3.0, negative_prompt=" ", sde_kind="cps", noise_level=0.7,
    window_size=2, window_range=(0, 4), micro_batch=2,
)  # fmt: skip
# LTX2Pipeline's guidance beyond plain CFG, off (see the module docstring).
PLAIN_CFG = dict(
    stg_scale=0.0,
    modality_scale=1.0,
    guidance_rescale=0.0,
    audio_stg_scale=0.0,
    audio_modality_scale=1.0,
    audio_guidance_rescale=0.0,
)


@pytest.fixture(scope="module")
def parts():
    return tiny.tiny_ltx2_components(seed=0)


@pytest.fixture(scope="module")
def model(parts):
    return LTX2.from_modules(
        **{k: parts[k] for k in ltx2.MODULES},
        **tiny.TINY_LTX2_CLIP,
        max_sequence_length=tiny.TINY_LTX2_TEXT_LENGTH,
    )


@pytest.fixture(scope="module")
def pipe(parts):
    p = LTX2Pipeline(**parts)
    p.set_progress_bar_config(disable=True)
    return p


def test_model_implements_the_protocol_and_every_lora_target_exists(model):
    assert isinstance(model, FlowModel)
    names = [n for n, _ in model.transformer.named_modules()]
    for t in LTX2_LORA_TARGETS:
        assert any(n.endswith(f".{t}") for n in names), t


def test_the_joint_latent_is_video_tokens_then_audio_tokens(model):
    """Layout by hand: 9 frames -> 5 latent frames (temporal 2), 32 px -> 4 (spatial 8): 80 video tokens of 8
    channels; 9 / 24 s x 16000 / 160 / 4 = 9.375 -> 9 audio tokens of 2 x 16 / 4 = 8 features."""
    assert model.grid == (5, 4, 4) and model.audio_frames == 9
    assert model.latent_shape(SIZE, SIZE) == (80 * 8 + 9 * 8,)
    x = torch.arange(2 * 712, dtype=torch.float32).view(2, 712)
    video, audio = model.split(x)
    assert video.shape == (2, 80, 8) and audio.shape == (2, 9, 8)
    assert torch.equal(torch.cat([video.flatten(1), audio.flatten(1)], 1), x)


def test_clip_settings_are_checked(model, parts):
    with pytest.raises(ValueError, match=r"sampling 64x32 px is not this LTX-2's clip size 32x32"):
        model.latent_shape(64, 32)
    kw = {k: parts[k] for k in ltx2.MODULES}
    with pytest.raises(ValueError, match=r"num_frames=8: LTX-2 needs 2k \+ 1 frames.*e.g. 9"):
        LTX2(**kw, num_frames=8, height=SIZE, width=SIZE)
    with pytest.raises(ValueError, match="height=36 is not a positive multiple of 8 px"):
        LTX2(**kw, num_frames=9, height=36, width=SIZE)


def test_encode_matches_the_pipeline(model, pipe):
    """The pipeline runs Gemma and the connectors on the whole [negative; positive] batch, we on one prompt at a
    time (cached): the same numbers on this CPU (left padding to a fixed length makes the rows independent)."""
    pe, pm, ne, nm = pipe.encode_prompt(PROMPTS, " ", True, max_sequence_length=tiny.TINY_LTX2_TEXT_LENGTH)
    video, audio, mask = pipe.connectors(torch.cat([ne, pe]), torch.cat([nm, pm]), padding_side="left")
    cond = model.encode(PROMPTS, negative_prompt=" ")
    B = len(PROMPTS)
    for prefix, rows in (("", slice(B, None)), ("neg_", slice(0, B))):
        torch.testing.assert_close(cond[f"{prefix}prompt_embeds"], video[rows], rtol=0, atol=1e-6)
        torch.testing.assert_close(cond[f"{prefix}audio_prompt_embeds"], audio[rows], rtol=0, atol=1e-6)
        assert torch.equal(cond[f"{prefix}prompt_mask"], mask[rows].bool())
    assert not torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][1])


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_ode_rollout_reproduces_the_pipeline(model, pipe, guidance_scale):
    """η = 0 (no SDE window) from the same x_1: the pipeline's final video and audio latents to fp32 rounding, its
    frames to the uint8 rounding and its waveform to fp32 rounding."""
    cfg = dataclasses.replace(
        BASE, window_size=0, window_range=(0, 0), guidance_scale=guidance_scale, micro_batch=3
    )
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    x1 = torch.stack(
        [torch.randn(model.latent_shape(SIZE, SIZE), generator=sample_generator(s)) for s in SEEDS]
    )
    video1, audio1 = model.split(x1)
    avae = model.audio_vae
    kwargs = dict(
        prompt=PROMPTS,
        negative_prompt=" ",
        height=SIZE,
        width=SIZE,
        num_frames=9,
        frame_rate=24.0,
        num_inference_steps=cfg.num_steps,
        guidance_scale=guidance_scale,
        audio_guidance_scale=guidance_scale,
        max_sequence_length=tiny.TINY_LTX2_TEXT_LENGTH,
        latents=video1,
        # The pipeline normalises given audio latents (not video ones): hand it x_1's audio denormalised.
        audio_latents=audio1 * avae.latents_std + avae.latents_mean,
        **PLAIN_CFG,
    )
    out = pipe(**kwargs, output_type="latent")
    vae = model.vae
    ref_video = pipe._pack_latents(
        pipe._normalize_latents(out.frames, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    )
    ref_audio = (pipe._pack_audio_latents(out.audio) - avae.latents_mean) / avae.latents_std
    assert traj.x0 is not None
    video0, audio0 = model.split(traj.x0)
    # CFG in x0 space vs plain CFG on v, batched prompts vs one at a time, (de)normalising the pipeline's latents
    # to compare: float rounding only (measured 4.8e-7 without CFG, 1.2e-6 with, CPU).
    assert (video0 - ref_video).abs().max() < 5e-6
    assert (audio0 - ref_audio).abs().max() < 5e-6
    assert ref_audio.abs().max() > 1.0  # the comparison sees real latents
    decoded = pipe(**kwargs, output_type="pt")
    frames = decoded.frames.permute(0, 1, 3, 4, 2) * 255  # [B, F, H, W, 3]
    assert traj.images.shape == (3, 9, SIZE, SIZE, 3) and traj.images.dtype == torch.uint8
    assert (traj.images.float() - frames).abs().max() <= 0.5 + 1e-3 and frames.std() > 1.0
    wave = model.decode_audio(traj.x0, SIZE, SIZE)
    assert wave.shape == decoded.audio.shape and model.audio_sample_rate == 16000
    torch.testing.assert_close(wave, decoded.audio.float(), rtol=0, atol=1e-5)


def test_audio_and_video_are_denoised_jointly(model):
    """Changing only the audio half of x_t changes the video velocity (audio -> video cross-attention) and
    vice versa: the transformer sees one joint state. Forwards are deterministic, so a stream that did not enter
    would leave the other's velocity bit for bit."""
    cond = model.encode(["a cat"])
    x = torch.randn(1, *model.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(0))
    n = 80 * 8
    y = x.clone()
    y[:, n:] = torch.randn(1, x.shape[1] - n, generator=torch.Generator().manual_seed(1))
    z = x.clone()
    z[:, :n] = torch.randn(1, n, generator=torch.Generator().manual_seed(2))
    sigma = torch.full((1,), 0.6)
    v, vy, vz = (model.velocity(t, sigma, cond, guidance_scale=1.0) for t in (x, y, z))
    assert (vy[:, :n] - v[:, :n]).abs().max() > 1e-4
    assert (vz[:, n:] - v[:, n:]).abs().max() > 1e-4


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_recomputed_log_probs_equal_the_rollouts_bit_exactly(model, guidance_scale):
    cfg = dataclasses.replace(BASE, guidance_scale=guidance_scale)
    traj = DiffusersEngine(model).generate(PROMPTS, SEEDS, cfg)
    assert torch.isfinite(traj.log_prob).all() and traj.x_t.shape == (3, 2, 712)
    assert torch.equal(recompute_log_probs(model, traj, cfg), traj.log_prob)


def test_recompute_is_bit_exact_with_lora_and_grad():
    m = tiny.tiny_ltx2(seed=2)
    grads = {
        n: g
        for n, g in lora_recompute_grads(m, LTX2_LORA_TARGETS, BASE, PROMPTS, SEEDS).items()
        if g is not None
    }
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    # Both streams' adapters learn from the joint log-prob.
    assert any(g.abs().max() > 0 for n, g in grads.items() if ".audio_attn1." in n)
    assert any(g.abs().max() > 0 for n, g in grads.items() if ".attn1." in n and "audio" not in n)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointed_backward_under_bf16_fsdp_recomputes_the_blocks_forward(monkeypatch, policy):
    """LoRA, bf16 compute through FSDP2 on a world of one, gradient checkpointing: backward recomputes each block
    from the inputs its forward used. Before torch 2.13 FSDP2 cast a block's floating inputs in its forward and not
    in the checkpoint's recompute (pytorch#159359), so the fp32 RoPE was bf16 in one and fp32 in the other and
    backward raised a CheckpointError; that recompute is emulated on a newer torch."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.tensor import DTensor

    cast = getattr(FSDPState, "_cast_forward_inputs", None)
    if cast is not None:  # torch >= 2.13; an older one skips the recompute's cast by itself

        def cast_as_before_2_13(self, args, kwargs):
            if self._training_state == TrainingState.PRE_BACKWARD:
                return args, kwargs
            return cast(self, args, kwargs)

        monkeypatch.setattr(FSDPState, "_cast_forward_inputs", cast_as_before_2_13)
    owned = not parallel.initialized()
    parallel.init_distributed("cpu")
    try:
        m = tiny.tiny_ltx2(seed=3, dtype=torch.bfloat16)
        mcfg = ModelConfig(
            kind="tiny_ltx2",
            dtype="bf16",
            lora_rank=2,
            lora_alpha=4,
            lora_targets=",".join(LTX2_LORA_TARGETS),
            gradient_checkpointing=True,
            checkpoint_policy=policy,
        )
        setup_trainable(m.transformer, mcfg)
        parallel.shard_transformer(m.transformer, param_dtype=torch.bfloat16)
        x = torch.randn(2, *m.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(0))
        v = m.velocity(x, torch.tensor(0.7), m.encode(PROMPTS[:2]), guidance_scale=1.0)
        v.square().sum().backward()
        # FSDP2 shards the parameters, so their gradients are DTensors
        grads = [
            typing.cast(DTensor, p.grad).full_tensor() for p in m.transformer.parameters() if p.requires_grad
        ]
        assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().max() > 0 for g in grads)
    finally:
        if owned:
            parallel.shutdown()


def _transformer_inputs(transformer):
    """Transformer inputs of one tiny clip step: 80 video tokens (5 x 4 x 4), 9 audio tokens, 6 text tokens."""
    g = torch.Generator().manual_seed(0)
    cfg = transformer.config
    return dict(
        hidden_states=torch.randn(2, 80, cfg.in_channels, generator=g),
        audio_hidden_states=torch.randn(2, 9, cfg.audio_in_channels, generator=g),
        encoder_hidden_states=torch.randn(2, 6, cfg.caption_channels, generator=g),
        audio_encoder_hidden_states=torch.randn(2, 6, cfg.caption_channels, generator=g),
        timestep=torch.tensor([900.0, 300.0]),
        sigma=torch.tensor([900.0, 300.0]),
        num_frames=5,
        height=4,
        width=4,
        audio_num_frames=9,
        use_cross_timestep=True,
        return_dict=False,
    )


def test_export_lora_loads_in_the_pipeline(tmp_path):
    comps = tiny.tiny_ltx2_components(seed=0)
    trained = comps["transformer"]
    base = copy.deepcopy(trained)
    base_out = trained(**_transformer_inputs(trained))
    add_lora(trained, rank=4, alpha=8, target_modules=LTX2_LORA_TARGETS, init=False)  # A, B random
    want = trained(**_transformer_inputs(trained))
    assert not torch.allclose(want[0], base_out[0]) and not torch.allclose(want[1], base_out[1])
    out = export_lora(tmp_path / "lora", trained)
    pipe = LTX2Pipeline(**{**comps, "transformer": base})
    pipe.load_lora_weights(str(out))
    got = pipe.transformer(**_transformer_inputs(pipe.transformer))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_build_model_reads_the_clip_from_ltx2_config():
    mcfg = LTX2Config(kind="tiny_ltx2", dtype="fp32", num_frames=5, frame_rate=12.0, height=32, width=64)
    m = build_model(mcfg, torch.device("cpu"), seed=0)
    assert isinstance(m, LTX2) and m.grid == (3, 4, 8) and m.frame_rate == 12.0
    assert m.audio_frames == round(5 / 12.0 * 25)
    plain = build_model(ModelConfig(kind="tiny_ltx2", dtype="fp32"), torch.device("cpu"), seed=0)
    assert isinstance(plain, LTX2) and plain.grid == (5, 4, 4)  # a plain ModelConfig: the tiny's default clip
