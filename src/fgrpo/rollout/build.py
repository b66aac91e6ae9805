"""The configured rollout engine: this process's diffusers modules, or vLLM-Omni with its own weights."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fgrpo.models.base import FlowModel
from fgrpo.models.lora import Float8
from fgrpo.rollout.base import RolloutEngine
from fgrpo.rollout.engine import DiffusersEngine
from fgrpo.rollout.vllm_omni import VllmOmniEngine


def build_engine(
    model: FlowModel,
    engine: str,
    model_path: str,
    *,
    train_graph: bool = False,
    merged_lora: bool = False,
    float8: Float8 = "off",
    keep: Sequence[str] = (),
    kind: str = "qwen_image",
    model_kwargs: Mapping[str, Any] | None = None,
    compile: bool = False,
) -> RolloutEngine:
    """The configured rollout engine: this process's diffusers modules (train_graph, merged_lora, float8: see
    DiffusersEngine), or vLLM-Omni with its own weights. keep: the Trajectory's optional fields the run reads
    (`Algorithm.rollout_fields`), which vLLM-Omni then sends back; the in-process engine fills them all. kind,
    model_kwargs: model.kind and the family's model keywords (vLLM-Omni builds its own copy of the model).
    compile: model.compile; vLLM-Omni then compiles its copy too (its own torch.compile, not enforce_eager)."""
    if engine == "vllm_omni":
        return VllmOmniEngine(
            model_path,
            kind=kind,
            model_kwargs=model_kwargs,
            enable_sleep_mode=True,
            keep=keep,
            enforce_eager=not compile,
        )
    return DiffusersEngine(model, train_graph=train_graph, merged_lora=merged_lora, float8=float8)
