"""fgrpo.config: validation refuses every bad value in one line naming the field (no model needed), and the
derived values."""

import dataclasses

import pytest
import torch

from fgrpo import algorithms
from fgrpo.config import GRPOConfig, ModelConfig, OptimConfig, SamplingConfig, TrainConfig, validate_config
from fgrpo.data import step_prompt_indices
from fgrpo.models.registry import check_config
from fgrpo.presets import with_algo


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"grpo": GRPOConfig(group_size=1)}, "group_size"),
        ({"grpo": GRPOConfig(group_size=3, prompts_per_step=3)}, "not divisible by the 2 training ranks"),
        (
            {"grpo": GRPOConfig(group_size=4, prompts_per_step=3, optimizer_steps_per_step=4)},
            "does not divide",
        ),
        ({"sampling": SamplingConfig(window_range=(0, 12))}, "window_range"),
        ({"sampling": SamplingConfig(sde_kind="ode")}, "nothing to train"),
        (
            {"rollout_engine": "vllm_omni", "grpo": GRPOConfig(old_log_prob="recompute")},
            "one trainer process",
        ),
        (
            {
                "rollout_engine": "vllm_omni",
                "grpo": GRPOConfig(old_log_prob="recompute", group_init_noise=True),
            },
            "grpo.group_init_noise",
        ),
        ({"optim": OptimConfig(min_lr_ratio=1.5)}, "optim.min_lr_ratio"),
        ({"model": ModelConfig(compile=True, exact_rollout=False)}, "--grpo.old-log-prob recompute"),
        (
            {"model": ModelConfig(attention_backend="flash3")},
            "model.attention_backend='flash3' is not a diffusers",
        ),
        ({"model": ModelConfig(attention_backend="sage")}, "model.attention_backend='sage' cannot run here"),
        ({"num_steps": 3, "optim": OptimConfig(schedule="cosine", warmup_steps=6)}, "optim.decay_steps=6"),
    ],
)
def test_validate_config_names_the_field(change, match):
    cfg = dataclasses.replace(TrainConfig(), **change)
    with pytest.raises(ValueError, match=match):
        algorithms.check_config(cfg, world_size=2)


def _on_vllm_omni(name: str, **grpo) -> TrainConfig:
    """The recipe trained by algorithm `name` (preset values) with the vLLM-Omni rollout engine."""
    cfg = TrainConfig() if name == "grpo" else with_algo(TrainConfig(), name, size="recipe")
    return dataclasses.replace(cfg, rollout_engine="vllm_omni", grpo=dataclasses.replace(cfg.grpo, **grpo))


def test_vllm_omni_serves_every_algorithm():
    """The window algorithms (MixGRPO-Flash's DPM-Solver++ tail too) with recomputed old log-probs, and NFT (rolling
    out theta) and AWM, whose losses read the clean latents the engine now returns."""
    recompute = {"old_log_prob": "recompute"}
    for cfg in (
        _on_vllm_omni("grpo", **recompute),
        _on_vllm_omni("dppo", **recompute),
        _on_vllm_omni("mixgrpo", **recompute),
        _on_vllm_omni("mixgrpo-flash", **recompute),
        _on_vllm_omni("awm"),
        dataclasses.replace(
            _on_vllm_omni("nft"), algo=dataclasses.replace(_on_vllm_omni("nft").algo, sample_from_ema=False)
        ),
    ):
        algorithms.check_config(cfg, world_size=1)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("grpo", r"^rollout_engine='vllm_omni' needs --grpo.old-log-prob recompute \(its kernels differ\)$"),
        ("dppo", "needs --grpo.old-log-prob recompute"),
        ("nft", r"^algo.sample_from_ema rolls out the EMA policy, .*pass --algo.no-sample-from-ema"),
    ],
)
def test_vllm_omni_refuses_what_it_cannot_serve_in_one_line(name, match):
    """The window algorithms' log-probs come from the engine's kernels, which are not the trainer's; NFT's default
    rollout policy is its EMA, which the engine never holds."""
    with pytest.raises(ValueError, match=match) as e:
        algorithms.check_config(_on_vllm_omni(name), world_size=1)
    assert "\n" not in str(e.value)


def test_lr_decay_spans_the_run_by_default():
    cfg = TrainConfig(num_steps=5, grpo=GRPOConfig(optimizer_steps_per_step=2, inner_epochs=3))
    assert cfg.optimizer_steps == 30 and cfg.lr_decay_steps == 30
    assert dataclasses.replace(cfg, optim=OptimConfig(decay_steps=7)).lr_decay_steps == 7


def test_validate_config_accepts_the_recipe():
    validate_config(TrainConfig(), world_size=4)
    check_config(TrainConfig())
    compiled = TrainConfig(model=ModelConfig(compile=True), grpo=GRPOConfig(old_log_prob="recompute"))
    validate_config(compiled, world_size=4)
    check_config(compiled)
    # compiled with the rollout's window through the training graph: the rollout's log-probs are reused
    validate_config(TrainConfig(model=ModelConfig(compile=True)), world_size=4)
    check_config(TrainConfig(model=ModelConfig(compile=True)))


def test_a_seed_outside_the_seed_mixers_range_is_refused_before_the_run_directory(tmp_path):
    """torch.manual_seed would take 2^63 (and -1), the seed mixer's signed 64-bit keys not: the run failed after
    making its directory. The range's ends both work."""
    from fgrpo.rollout.seeds import sample_seeds
    from fgrpo.train import train

    for seed in (2**63, 2**64, -1):
        cfg = dataclasses.replace(TrainConfig(), seed=seed)
        with pytest.raises(ValueError, match=rf"^seed={seed}: must be in \[0, 2\^63\); pass --seed"):
            validate_config(cfg, world_size=1)
    cfg = dataclasses.replace(
        TrainConfig(), seed=2**63, run=dataclasses.replace(TrainConfig().run, out_dir=str(tmp_path))
    )
    with pytest.raises(ValueError, match="^seed="):
        train(cfg)
    assert list(tmp_path.iterdir()) == []
    for seed in (0, 2**63 - 1):
        validate_config(dataclasses.replace(TrainConfig(), seed=seed), world_size=1)
        torch.manual_seed(seed)
        assert len(sample_seeds(seed, 0, torch.arange(2))) == 2 and step_prompt_indices(
            5, 0, 2, seed
        ).shape == (2,)


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("optim", "grad_clip", -1.0),  # clip_grad_norm_ with a negative bound flips every gradient's sign
        ("optim", "grad_clip", 0.0),  # ... and zero zeroes it
        ("optim", "lr", 0.0),
        ("optim", "lr", -1e-4),
        ("grpo", "clip_range", 0.0),
        ("grpo", "clip_range", -0.2),
        ("run", "keep_last", 0),
        ("grpo", "inner_epochs", 0),
        ("grpo", "prompts_per_step", 0),
        ("sampling", "micro_batch", 0),
        ("grpo", "train_micro_batch", -1),
        ("sampling", "noise_level", -0.5),
        ("sampling", "height", 500),  # not a multiple of VAE 8 x patch 2
        ("sampling", "width", 8),
        ("optim", "betas", (0.9, 1.0)),
        ("run", "val_num_steps", 0),
    ],
)
def test_nonsense_values_are_refused_naming_the_field(section, field, value):
    """Each of these passed validation before and failed (or silently misbehaved) only inside the run."""
    base = TrainConfig()
    cfg = dataclasses.replace(
        base, **{section: dataclasses.replace(getattr(base, section), **{field: value})}
    )
    with pytest.raises(ValueError, match=rf"^{section}\.{field}=.*--{section}\.{field.replace('_', '-')}"):
        validate_config(cfg, world_size=1)
        check_config(cfg)


def test_resolution_multiple_follows_the_model_kind():
    """The text renderer packs 4x4 pixel patches: 36 px is fine there, not for Qwen-Image's 16."""
    cfg = dataclasses.replace(TrainConfig(), sampling=SamplingConfig(height=36, width=128))
    with pytest.raises(ValueError, match="sampling.height=36.*multiple of 16"):
        validate_config(cfg, world_size=1)
        check_config(cfg)
    validate_config(dataclasses.replace(cfg, model=ModelConfig(kind="textbed")), world_size=1)
    check_config(dataclasses.replace(cfg, model=ModelConfig(kind="textbed")))
