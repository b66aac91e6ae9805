"""build_reward: one entry point from a config value to a Reward.

A spec is one of
- a name:                 "ocr", "video_ocr", "jpeg_compressibility", "jpeg_incompressibility"
- a dict with options:    {"name": "ocr", "engine": "vlm", "base_url": "http://127.0.0.1:8000",
                           "model": "Qwen/Qwen2.5-VL-3B-Instruct"}
                          {"name": "http", "url": "http://127.0.0.1:8765", "timeout_s": 30}
- a multi-reward:         a list of member specs, or {"name": "multi", "members": [...]}; a member spec is a
                          spec plus "weight" (default 1.0), "required" (default true) and "key" (its name
                          in logs; default the member's name)
- a model-based reward: "clip_score", "pickscore", "hps" (HPSv2/2.1), "aesthetic" (LAION's predictor),
  "imagereward"; their
  options (weights' directory or hub id, device, dtype, batch_size) are in their modules' docstrings:
                          {"name": "pickscore", "model": "/ckpt/PickScore_v1", "processor": "/ckpt/CLIP-H"}
- {"name": "audio", "scorer": "package.module:factory", ...}: an AudioReward (rewards.video; CLAP-like) built by
  that factory with the other options, scoring the waveforms an audio-video model decodes (its reward metadata)
- "package.module:factory" (or {"name": "package.module:factory", ...}) for a reward defined elsewhere
- any of the above as a JSON string (what a command-line flag carries).

    build_reward("ocr")
    build_reward('[{"name": "ocr"}, {"name": "jpeg_compressibility", "weight": 0.1, "required": false}]')

Options of "ocr": engine = "rapidocr" (default; RapidOcrEngine options), "vlm" (VlmOcrEngine, the openai
client of a `vllm serve`: base_url, model, timeout_s, max_retries, api_key, ...), "vllm" (VllmOcrEngine,
in-process: model, ...) or "transformers" (TransformersOcrEngine, in-process: model = a checkpoint directory,
device, batch_size, max_tokens, ...). Options of "http": those of HttpReward.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fgrpo.errors import ConfigError
from fgrpo.rewards import vlm
from fgrpo.rewards.base import Reward
from fgrpo.rewards.client import HttpReward
from fgrpo.rewards.jpeg import JpegReward
from fgrpo.rewards.multi import Member, MultiReward
from fgrpo.rewards.ocr import OcrReward, RapidOcrEngine
from fgrpo.rewards.video import AudioFromMetadata, VideoOcrReward


def _check_options(what: str, fn: Callable[..., Any], options: Mapping[str, Any]) -> None:
    """Fail on unknown or missing options before building anything (a misspelt key is a one-line error)."""
    try:
        inspect.signature(fn).bind(**options)
    except TypeError as e:
        params = [p for p in inspect.signature(fn).parameters if p not in ("self", "args", "kwargs")]
        raise ConfigError(f"reward {what!r}: {e}; its options are {params}") from None


def _ocr(engine: str = "rapidocr", **options: Any) -> Reward:
    engines = ["rapidocr", "vlm", "vllm", "transformers"]
    if engine not in engines:
        raise ConfigError(f"reward 'ocr': engine must be one of {engines}, got {engine!r}")
    if engine == "rapidocr":
        build: Callable[..., Any] = RapidOcrEngine
    else:
        build = {
            "vlm": vlm.VlmOcrEngine,
            "vllm": vlm.VllmOcrEngine,
            "transformers": vlm.TransformersOcrEngine,
        }[engine]
    if engine != "vllm":  # VllmOcrEngine forwards unknown options to vllm.LLM
        _check_options(f"ocr/{engine}", build, options)
    return OcrReward(build(**options))


def _audio(*, scorer: str, **options: Any) -> Reward:
    make: Callable[..., Any] = _import(scorer)  # a factory of an AudioReward, not of a Reward
    return AudioFromMetadata(make(**options))


def _video_ocr(*, frames: int = 4, consistency_weight: float = 0.5) -> Reward:
    return VideoOcrReward(frames=frames, consistency_weight=consistency_weight)


def _jpeg(compressible: bool) -> Callable[..., Reward]:
    def build(*, scale: float = 1 / 500, quality: int = 95) -> Reward:
        return JpegReward(compressible=compressible, scale=scale, quality=quality)

    return build


def _http(**options: Any) -> Reward:
    _check_options("http", HttpReward, options)
    return HttpReward(**options)


def _multi(members: Sequence[Any]) -> Reward:
    if isinstance(members, str | Mapping) or not isinstance(members, Sequence):
        raise ConfigError("reward 'multi': members must be a list of member specs")
    built = []
    for spec in members:
        spec = {"name": spec} if isinstance(spec, str) else dict(spec)
        if "name" not in spec:
            raise ConfigError(f"multi-reward member spec {spec} has no 'name'")
        weight, required = float(spec.pop("weight", 1.0)), spec.pop("required", True)
        if not isinstance(required, bool):
            raise ConfigError(
                f"multi-reward member {spec['name']!r}: 'required' must be true or false, got {required!r}"
            )
        key = str(spec.pop("key", spec["name"]))
        built.append(Member(name=key, reward=build_reward(spec), weight=weight, required=required))
    return MultiReward(built)


# Model-based rewards are named by their factory's import path: torch and the model code load only when used.
REWARDS: dict[str, Callable[..., Reward] | str] = {
    "ocr": _ocr,
    "video_ocr": _video_ocr,
    "audio": _audio,
    "jpeg_compressibility": _jpeg(compressible=True),
    "jpeg_incompressibility": _jpeg(compressible=False),
    "http": _http,
    "multi": _multi,
    "clip_score": "fgrpo.rewards.clip:clip_score",
    "pickscore": "fgrpo.rewards.pickscore:pickscore",
    "hps": "fgrpo.rewards.hps:hps",
    "aesthetic": "fgrpo.rewards.aesthetic:aesthetic",
    "imagereward": "fgrpo.rewards.imagereward:imagereward",
}


def _import(target: str) -> Callable[..., Reward]:
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"reward {target!r}: cannot import {attr!r} from {module!r} ({e})") from e


def build_reward(spec: str | Mapping[str, Any] | Sequence[Any]) -> Reward:
    """Build a Reward from a spec (see the module docstring for the forms a spec takes)."""
    if isinstance(spec, str):
        s = spec.strip()
        if s.startswith(("{", "[")):
            try:
                return build_reward(json.loads(s))
            except json.JSONDecodeError as e:
                raise ConfigError(f"reward spec is not valid JSON ({e}): {s[:200]}") from e
        spec = {"name": s}
    if isinstance(spec, Sequence):
        return _multi(spec)
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise ConfigError(
            f"reward spec must be a name, a dict with a 'name', or a list of those; got {spec!r}"
        )
    options = dict(spec)
    name = options.pop("name")
    if name in REWARDS:
        fn = REWARDS[name]
        fn = _import(fn) if isinstance(fn, str) else fn
        if name != "ocr":  # _ocr checks against the chosen engine's options
            _check_options(name, fn, options)
        return fn(**options)
    if ":" in name:
        return _import(name)(**options)
    raise ConfigError(f"unknown reward {name!r}; known: {sorted(REWARDS)} or 'package.module:factory'")
