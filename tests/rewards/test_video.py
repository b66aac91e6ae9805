"""Video rewards: temporal consistency (closed forms), video OCR with a fake engine (hand-computed scores) and with
PP-OCR on rendered frames, the factory name, and the audio-reward slot with a test double fed by LTX2.decode_audio."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from fgrpo.logging import to_uint8_hwc
from fgrpo.rewards import build_reward
from fgrpo.rewards.base import RewardOutput
from fgrpo.rewards.video import AudioReward, VideoOcrReward, check_audio, temporal_consistency

from .helpers import render_text


def test_temporal_consistency_closed_forms():
    still = np.full((1, 5, 4, 4, 3), 77, np.uint8)
    flip = np.zeros((1, 3, 4, 4, 3), np.uint8)
    flip[:, 1] = 255  # 0 -> 255 -> 0: every pixel changes fully twice
    half = np.zeros((1, 2, 4, 4, 3), np.uint8)
    half[:, 1, :2] = 255  # half the pixels flip once
    got = temporal_consistency(np.concatenate([still[:, :2], flip[:, :2], half]))
    np.testing.assert_allclose(got, [1.0, 0.0, 0.5])
    assert temporal_consistency(flip).tolist() == [0.0]
    assert temporal_consistency(still[:, :1]).tolist() == [1.0]  # one frame: nothing moves


class _Engine:
    """Reads a frame's text from its top-left pixel: 255 -> 'HELLO', else ''. Records how many frames it saw."""

    def __init__(self):
        self.seen = 0

    def recognize(self, images: np.ndarray) -> list[str]:
        self.seen += len(images)
        return ["HELLO" if im[0, 0, 0] == 255 else "" for im in images]


def test_video_ocr_reads_evenly_spaced_frames_and_weights_consistency():
    """Clip 0: 5 still frames that read HELLO -> ocr 1, consistency 1 -> 1. Clip 1: frames 0..4 read at 0, 1, 3, 4
    (linspace(0, 4, 4) rounds to 0, 1, 3, 4); only frames 0 and 4 show the word (pixel 0 white, the rest black);
    the frames differ only at pixel (0, 0): ocr 2/4, consistency 1 - (2 changes x 3 channels x 255 / 255) /
    (4 pairs x 16 pixels x 3) = 1 - 6 / 192. Score (ocr + 0.5 c) / 1.5."""
    clips = np.zeros((2, 5, 4, 4, 3), np.uint8)
    clips[0, :, 0, 0] = 255
    clips[1, 0, 0, 0] = clips[1, 4, 0, 0] = 255
    engine = _Engine()
    out = VideoOcrReward(engine, frames=4, consistency_weight=0.5)(clips, ['a "hello" sign'] * 2)
    assert engine.seen == 8
    c1 = 1 - 6 / 192
    np.testing.assert_allclose(out.components["ocr"], [1.0, 0.5])
    np.testing.assert_allclose(out.components["consistency"], [1.0, c1], rtol=1e-6)
    np.testing.assert_allclose(out.scores, [1.0, (0.5 + 0.5 * c1) / 1.5], rtol=1e-6)
    assert out.scores.dtype == np.float32 and out.metrics["ocr/exact"] == 0.5


def test_video_ocr_rejects_images_and_bad_settings():
    with pytest.raises(ValueError, match="scores videos .*use 'ocr' for images"):
        VideoOcrReward(_Engine())(np.zeros((1, 8, 8, 3), np.uint8), ['"a"'])
    with pytest.raises(ValueError, match="frames=0"):
        VideoOcrReward(_Engine(), frames=0)
    with pytest.raises(ValueError, match="missing|has no text between double quotes"):
        VideoOcrReward(_Engine())(np.zeros((1, 2, 8, 8, 3), np.uint8), ["no quotes"])


def test_video_ocr_with_pp_ocr_on_rendered_frames(font_path, rapid_engine):
    """A steady clip of the word reads exactly; the same clip with the word in only its first frame scores less."""
    word = render_text("OPEN", font_path, size=128, font_size=40)
    blank = np.full_like(word, 255)
    steady = np.stack([word] * 3)[None]
    fading = np.stack([word, blank, blank])[None]
    reward = VideoOcrReward(rapid_engine, frames=3)
    a, b = reward(steady, ['a sign that says "OPEN"']), reward(fading, ['a sign that says "OPEN"'])
    assert a.scores[0] == pytest.approx(1.0) and a.metrics["ocr/exact"] == 1.0
    assert b.components["ocr"][0] == pytest.approx(1 / 3) and b.scores[0] < a.scores[0]


def test_factory_builds_video_ocr():
    r = build_reward('{"name": "video_ocr", "frames": 2, "consistency_weight": 0.0}')
    assert isinstance(r, VideoOcrReward) and r.frames == 2 and r.weight == 0.0
    with pytest.raises(ValueError, match="options"):
        build_reward('{"name": "video_ocr", "frame": 2}')


class _Loudness:
    """AudioReward test double (where CLAP would go): RMS loudness of each waveform, a closed form."""

    def __call__(self, audio: np.ndarray, sample_rate: int, prompts: Sequence[str]) -> RewardOutput:
        check_audio(audio, sample_rate, prompts)
        return RewardOutput(scores=np.sqrt((audio**2).mean(axis=(1, 2))).astype(np.float32))


def test_the_audio_slot_scores_ltx2_waveforms():
    from fgrpo.models import tiny

    reward: AudioReward = _Loudness()
    model = tiny.tiny_ltx2(seed=0)
    x0 = np.random.default_rng(0).standard_normal((2, *model.latent_shape(32, 32))).astype(np.float32)
    wave = model.decode_audio(torch.from_numpy(x0), 32, 32).numpy()
    out = reward(wave, model.audio_sample_rate, ["a dog barks", "rain"])
    assert out.scores.shape == (2,) and np.all(out.scores > 0)
    np.testing.assert_allclose(out.scores[0], np.sqrt((wave[0].astype(np.float64) ** 2).mean()), rtol=1e-5)
    with pytest.raises(ValueError, match="float32 numpy"):
        reward(wave.astype(np.float64), 16000, ["a", "b"])
    with pytest.raises(ValueError, match="one prompt per waveform"):
        reward(wave, 16000, ["a"])


def test_videos_are_logged_as_filmstrips_of_four_frames():
    clips = np.arange(5, dtype=np.uint8)[None, :, None, None, None] * np.ones((2, 5, 3, 2, 3), np.uint8)
    strip = to_uint8_hwc(clips)
    assert strip.shape == (2, 3, 8, 3)
    assert strip[0, 0, ::2, 0].tolist() == [0, 1, 3, 4]  # frames linspace(0, 4, 4).round(), side by side


def test_the_audio_reward_scores_what_the_rollout_decoded(tmp_path, monkeypatch):
    """An LTX-2 rollout hands each micro-batch's waveforms to the reward with its frames (reward_metadata, equal to
    decode_audio of the clean latents); the factory's "audio" reward, built around a user's AudioReward, scores
    them through the trainer's RewardStream; a reward call without audio metadata is refused in one line."""
    from fgrpo.config import SamplingConfig
    from fgrpo.models import tiny
    from fgrpo.rewards.runner import RewardStream
    from fgrpo.rewards.video import AudioFromMetadata
    from fgrpo.rollout.engine import DiffusersEngine

    (tmp_path / "my_clap.py").write_text(
        "import numpy as np\n"
        "from fgrpo.rewards.base import RewardOutput\n"
        "def make(gain=1.0):\n"
        "    return lambda audio, rate, prompts: RewardOutput(\n"
        "        scores=(gain * np.sqrt((audio ** 2).mean(axis=(1, 2)))).astype(np.float32))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = build_reward({"name": "audio", "scorer": "my_clap:make", "gain": 2.0})
    assert isinstance(reward, AudioFromMetadata)

    model = tiny.tiny_ltx2(seed=0)
    cfg = SamplingConfig(
        height=32,
        width=32,
        num_steps=2,
        guidance_scale=1.0,
        window_size=1,
        window_range=(0, 1),
        micro_batch=2,
    )
    prompts = ['a sign that says "HI"', "rain", "a dog barks"]
    stream = RewardStream(reward, prompts)
    traj = DiffusersEngine(model).generate(prompts, [1, 2, 3], cfg, on_images=stream.add)
    assert traj.x0 is not None
    wave = model.decode_audio(traj.x0, 32, 32).numpy()
    np.testing.assert_allclose(
        stream.result().scores, 2.0 * np.sqrt((wave.astype(np.float64) ** 2).mean(axis=(1, 2))), rtol=1e-5
    )
    with pytest.raises(ValueError, match="carry no 'audio'"):
        reward(traj.images.numpy(), prompts)
