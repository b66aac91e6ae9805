"""Prompt files, the per-step prompt order and config validation (no model needed)."""

import dataclasses

import pytest
import torch

from fgrpo.config import GRPOConfig, TrainConfig
from fgrpo.data import load_prompts, step_prompt_indices
from fgrpo.rollout.base import SamplingConfig
from fgrpo.train import validate_config


def test_step_prompt_indices_cover_each_epoch_once():
    n, per = 10, 4
    seen = torch.cat([step_prompt_indices(n, s, per, seed=3) for s in range(5)])  # 20 = two epochs
    assert sorted(seen[:10].tolist()) == list(range(10))
    assert sorted(seen[10:].tolist()) == list(range(10))
    assert not torch.equal(seen[:10], seen[10:])  # each epoch its own permutation


def test_step_prompt_indices_pure_function_of_step_and_seed():
    assert torch.equal(step_prompt_indices(7, 5, 3, seed=1), step_prompt_indices(7, 5, 3, seed=1))
    assert not torch.equal(step_prompt_indices(50, 0, 8, seed=1), step_prompt_indices(50, 0, 8, seed=2))


def test_load_prompts_formats_and_errors(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text('A sign that says "OPEN"\n\nA cup with "TEA" on it\n')
    assert load_prompts(txt, require_quoted=True) == ['A sign that says "OPEN"', 'A cup with "TEA" on it']
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a \\"B\\""}\n')
    assert load_prompts(jl) == ['a "B"']
    bad = tmp_path / "bad.txt"
    bad.write_text('fine "X"\nno quote here\n')
    with pytest.raises(ValueError, match="line 2.*no double-quoted"):
        load_prompts(bad, require_quoted=True)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(empty)
    with pytest.raises(FileNotFoundError, match="data.train_prompts"):
        load_prompts(tmp_path / "missing.txt")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"grpo": GRPOConfig(group_size=1)}, "group_size"),
        ({"grpo": GRPOConfig(group_size=3, prompts_per_step=3)}, "not divisible by the 2 ranks"),
        ({"grpo": GRPOConfig(group_size=4, prompts_per_step=3, optimizer_steps_per_step=4)}, "does not divide"),
        ({"sampling": SamplingConfig(window_range=(0, 12))}, "window_range"),
        ({"sampling": SamplingConfig(sde_kind="ode")}, "nothing to train"),
        ({"rollout_engine": "vllm_omni"}, "old-log-prob recompute"),
        ({"rollout_engine": "vllm_omni", "grpo": GRPOConfig(old_log_prob="recompute")}, "one trainer process"),
    ],
)
def test_validate_config_names_the_field(change, match):
    cfg = dataclasses.replace(TrainConfig(), **change)
    with pytest.raises(ValueError, match=match):
        validate_config(cfg, world_size=2)


def test_validate_config_accepts_the_recipe():
    validate_config(TrainConfig(), world_size=4)
