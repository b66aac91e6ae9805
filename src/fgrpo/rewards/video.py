"""Rewards for a text-to-audio-video model: video OCR with a temporal-consistency term, and the audio-reward slot.

Video (offline): the clip should show the quoted text of its prompt, steadily.
    reward = (ocr + w * consistency) / (1 + w), in [0, 1]
    ocr         = mean over K evenly spaced frames (first to last) of ocr_score(frame's text, target)
    consistency = 1 - mean over consecutive frame pairs and pixels of |frame_{t+1} - frame_t| / 255
A flickering clip of the right word scores below a steady one; a steady clip of nothing scores w / (1 + w).

Audio: `AudioReward` is the slot a prompt-audio scorer fills (CLAP or ImageBind in verl-omni's LTX-2.3 recipe:
text-audio and audio-video similarity); none ships here since no such weights are on these machines. LTX2's
`decode_audio` gives its input (waveform [B, channels, samples] at `audio_sample_rate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from fgrpo.rewards.base import RewardOutput, check_inputs
from fgrpo.rewards.ocr import OcrEngine, OcrReward, is_exact


def temporal_consistency(videos: np.ndarray) -> np.ndarray:
    """1 - mean |frame_{t+1} - frame_t| / 255 per clip: 1 for a still clip, 0 when every pixel flips 0 <-> 255.

    Args:
        videos: uint8 [B, F, H, W, 3]; a one-frame clip is still (1).

    Returns:
        [B] float32 in [0, 1].
    """
    if videos.shape[1] < 2:
        return np.ones(len(videos), dtype=np.float32)
    diff = np.abs(np.diff(videos.astype(np.int16), axis=1))  # [B, F - 1, H, W, 3]
    return (1.0 - diff.reshape(len(videos), -1).mean(axis=1) / 255.0).astype(np.float32)


class VideoOcrReward:
    """OCR of the quoted target in `frames` evenly spaced frames plus a temporal-consistency term (module docstring).

    Components: `ocr` and `consistency` per clip. Metrics: `ocr/exact` (clips whose sampled frames all read the
    target exactly), `ocr/time_per_image_s` (per frame read), `video/consistency`.
    """

    def __init__(self, engine: OcrEngine | None = None, *, frames: int = 4, consistency_weight: float = 0.5):
        if frames < 1:
            raise ValueError(f"reward 'video_ocr': frames={frames} must be >= 1 (frames read per clip)")
        if consistency_weight < 0:
            raise ValueError(f"reward 'video_ocr': consistency_weight={consistency_weight} must be >= 0")
        self.ocr = OcrReward(engine)
        self.frames, self.weight = frames, consistency_weight

    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput:
        check_inputs(images, prompts, metadata)
        if images.ndim != 5:
            raise ValueError(
                f"reward 'video_ocr' scores videos [B, F, H, W, 3], got {list(images.shape)}; use 'ocr' for images"
            )
        B, F = images.shape[:2]
        keep = np.linspace(0, F - 1, min(self.frames, F)).round().astype(int)  # [K]
        frames = images[:, keep].reshape(-1, *images.shape[2:])  # [B K, H, W, 3], clip-major
        read = self.ocr(frames, [p for p in prompts for _ in keep])
        ocr = read.scores.reshape(B, len(keep))
        consistency = temporal_consistency(images)
        scores = (ocr.mean(axis=1) + self.weight * consistency) / (1 + self.weight)
        metrics = {
            "ocr/exact": float(is_exact(ocr).all(axis=1).mean()),
            "ocr/time_per_image_s": read.metrics["ocr/time_per_image_s"],
            "video/consistency": float(consistency.mean()),
        }
        return RewardOutput(
            scores=scores.astype(np.float32),
            components={"ocr": ocr.mean(axis=1).astype(np.float32), "consistency": consistency},
            metrics=metrics,
        )


class AudioReward(Protocol):
    """A prompt-audio reward (CLAP-like): waveforms + prompts -> scores [B] (the RewardOutput conventions)."""

    def __call__(self, audio: np.ndarray, sample_rate: int, prompts: Sequence[str]) -> RewardOutput:
        """audio: float32 [B, channels, samples] in [-1, 1] at `sample_rate` Hz (LTX2.decode_audio's output)."""
        ...


class AudioFromMetadata:
    """A Reward that scores the audio a model decoded beside its frames: each row's metadata carries "audio"
    (float32 [channels, samples]) and "sample_rate" (what `LTX2.reward_metadata` gives the trainer's reward);
    the pixels are ignored. Mix it with `video_ocr` in a multi-reward spec to train audio and video together."""

    def __init__(self, scorer: AudioReward):
        self.scorer = scorer

    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput:
        meta = check_inputs(images, prompts, metadata)
        missing = [i for i, m in enumerate(meta) if "audio" not in m or "sample_rate" not in m]
        if missing:
            raise ValueError(
                f"reward 'audio': rows {missing[:5]} carry no 'audio'/'sample_rate' metadata; the model must decode "
                "audio (e.g. model.kind ltx2) and the reward run inside the trainer"
            )
        rates = {int(m["sample_rate"]) for m in meta}
        if len(rates) > 1:
            raise ValueError(f"reward 'audio': one sample rate per batch, got {sorted(rates)}")
        audio = (
            np.stack([np.asarray(m["audio"], dtype=np.float32) for m in meta])
            if meta
            else np.zeros((0, 1, 1), np.float32)
        )
        return self.scorer(audio, rates.pop() if rates else 1, prompts)


def check_audio(audio: np.ndarray, sample_rate: int, prompts: Sequence[str]) -> None:
    """Validate an AudioReward call before any expensive work (one line naming the argument and the fix)."""
    if not isinstance(audio, np.ndarray) or audio.dtype != np.float32 or audio.ndim != 3:
        got = f"{audio.dtype} {list(audio.shape)}" if isinstance(audio, np.ndarray) else type(audio).__name__
        raise ValueError(
            f"audio must be float32 numpy [B, channels, samples], got {got}; pass decode_audio's output"
        )
    if sample_rate <= 0:
        raise ValueError(f"sample_rate={sample_rate} must be > 0 (LTX2.audio_sample_rate)")
    if isinstance(prompts, str) or len(prompts) != len(audio):
        raise ValueError(f"got {len(audio)} waveforms but prompts {prompts!r}; pass one prompt per waveform")
