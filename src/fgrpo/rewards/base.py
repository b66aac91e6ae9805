"""The reward interface: uint8 images [B, H, W, 3] (a video model's frames [B, F, H, W, 3]) + prompts (+ per-sample
metadata) -> scores [B].

Conventions every reward in this package follows (and every wrapper relies on):
- `scores` is float32 [B] and finite; a reward that cannot score a sample raises (never a silent 0).
  The one place a sample may lack a score is a member of a MultiReward: its `components` entry is NaN.
- `metrics` are floats for logging. A key ending in `_count` is additive (failures, retries); any other key
  is a per-sample mean. `concat_outputs` relies on this when it joins batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fgrpo.errors import ConfigError, FgrpoError


@dataclass
class RewardOutput:
    scores: np.ndarray  # [B] float32, the value the advantages are computed from
    components: dict[str, np.ndarray] = field(default_factory=dict)  # per-member [B] scores (NaN = excluded)
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. failure counts, latency


class Reward(Protocol):
    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardOutput: ...


def check_inputs(
    images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Validate a reward call's arguments before any expensive work; return metadata as a list of B dicts.

    Raises:
        TypeError / ValueError naming the field and the fix.
    """
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8:
        got = images.dtype if isinstance(images, np.ndarray) else type(images).__name__
        raise TypeError(f"images must be a uint8 numpy array [B, H, W, 3], got {got}; decode to uint8 first")
    if images.ndim not in (4, 5) or images.shape[-1] != 3:
        raise ValueError(
            f"images must have shape [B, H, W, 3] (or videos [B, F, H, W, 3]), got {list(images.shape)}"
        )
    if isinstance(prompts, str):
        raise TypeError("prompts must be a sequence of B strings, got a single str; wrap it in a list")
    if len(prompts) != len(images):
        raise ValueError(f"got {len(images)} images but {len(prompts)} prompts; pass one prompt per image")
    if metadata is None:
        return [{} for _ in range(len(images))]
    if len(metadata) != len(images):
        raise ValueError(f"got {len(images)} images but {len(metadata)} metadata dicts; pass one per image")
    return list(metadata)


class RewardError(FgrpoError, ValueError):
    """A reward answered what a run cannot train on (scores of the wrong shape, a non-finite score)."""


def check_scores(out: RewardOutput, prompts: Sequence[str], reward: str) -> None:
    """Raise RewardError if `out.scores` is not [B] finite: a NaN would make every advantage NaN and the run a
    silent no-op."""
    scores = np.asarray(out.scores)
    if scores.shape != (len(prompts),):
        raise RewardError(
            f"reward {reward!r} returned scores of shape {list(scores.shape)} for {len(prompts)} prompts"
        )
    bad = np.flatnonzero(~np.isfinite(scores))
    if len(bad):
        b = int(bad[0])
        raise RewardError(
            f"reward {reward!r} returned a non-finite score ({scores[b]}) for prompt {prompts[b]!r} "
            f"({len(bad)} of {len(scores)} samples); a reward must score every sample or raise"
        )


def concat_outputs(outputs: Sequence[RewardOutput]) -> RewardOutput:
    """Join per-batch outputs in order: scores and components concatenate, `*_count` metrics add up,
    other metrics become the sample-weighted mean over batches."""
    if not outputs:
        raise ValueError("concat_outputs needs at least one RewardOutput")
    sizes = np.array([len(o.scores) for o in outputs], dtype=np.float64)
    scores = np.concatenate([o.scores for o in outputs]).astype(np.float32)
    components = {
        k: np.concatenate([o.components[k] for o in outputs]).astype(np.float32)
        for k in outputs[0].components
    }
    metrics: dict[str, float] = {}
    for k in outputs[0].metrics:
        vals = np.array([o.metrics.get(k, np.nan) for o in outputs], dtype=np.float64)
        metrics[k] = float(vals.sum()) if k.endswith("_count") else float((vals * sizes).sum() / sizes.sum())
    return RewardOutput(scores=scores, components=components, metrics=metrics)


def weights_file(reward: str, field: str, value: str, hint: str, hub: tuple[str, str] | None = None) -> Path:
    """The local file of a reward model's weights: `value` is a path, or the name that stands for `hub` (repo,
    filename), taken from the Hugging Face cache and downloaded only when the cache lacks it and HF_HUB_OFFLINE is
    unset. A missing file is a one-line ConfigError naming the reward, the field and the fix (`hint`), raised
    before any model is built."""
    if hub is not None:
        import huggingface_hub
        from huggingface_hub.errors import HFValidationError

        repo, name = hub
        try:
            try:
                return Path(huggingface_hub.hf_hub_download(repo, name, local_files_only=True))
            except (OSError, HFValidationError):
                if huggingface_hub.constants.HF_HUB_OFFLINE:
                    raise
                return Path(huggingface_hub.hf_hub_download(repo, name))
        except (OSError, HFValidationError):
            raise ConfigError(
                f"reward {reward!r}: {field}={value!r} ({repo}/{name}) is not in the local Hugging Face cache and "
                f"cannot be downloaded; fetch it (hf download {repo} {name}) or give the file's path"
            ) from None
    file = Path(value).expanduser()
    if not file.is_file():
        raise ConfigError(f"reward {reward!r}: {field}={value!r} is not a file; {hint}")
    return file
