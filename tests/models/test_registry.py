"""The model-family registry: one entry per model.kind, and the config's defaults agree with it."""

import typing
from pathlib import Path

import pytest

from fgrpo.config import ModelConfig, TrainConfig
from fgrpo.models.registry import FAMILIES, build_tiny, check_config

ROOT = Path(__file__).resolve().parent.parent.parent


def test_every_kind_has_an_entry_and_every_entry_a_kind():
    """tyro needs model.kind as a Literal in config.py; a family added to one and not the other fails here."""
    kinds = typing.get_args(typing.get_type_hints(ModelConfig)["kind"])
    assert sorted(kinds) == sorted(FAMILIES)


def test_the_default_lora_targets_are_the_default_familys():
    """config.py spells the default targets out (it imports no model code); they must be its default kind's."""
    mcfg = ModelConfig()
    assert mcfg.lora_target_list == list(FAMILIES[mcfg.kind].lora_targets)


def test_entries_name_files_and_tiny_kinds_that_exist():
    for kind, family in FAMILIES.items():
        assert (ROOT / family.recipe).is_file(), (kind, family.recipe)
        if family.tiny:
            tiny = FAMILIES[family.tiny]
            assert not tiny.tiny and family.tiny.startswith("tiny_"), kind
            assert (tiny.lora_targets, tiny.pixel_multiple, tiny.sequence_parallel, tiny.recipe) == (
                family.lora_targets,
                family.pixel_multiple,
                family.sequence_parallel,
                family.recipe,
            ), kind


@pytest.mark.parametrize("kind", ["qwen_image", "sd3", "flux", "flux2", "flux2_dev", "wan"])
def test_the_pixel_multiple_is_the_tiny_models_latent_patch(kind):
    """The resolution check reads pixel_multiple: the tiny model takes that multiple and refuses half of it."""
    model = build_tiny(kind)
    m = FAMILIES[kind].pixel_multiple
    model.latent_shape(2 * m, 3 * m)
    with pytest.raises(ValueError):
        model.latent_shape(2 * m + m // 2, 3 * m)


def test_check_config_reads_the_family():
    """The pixel multiple and the abilities come from the kind's entry (the text renderer packs 4 px)."""
    import dataclasses

    from fgrpo.config import ParallelConfig, SamplingConfig

    for kind, family in FAMILIES.items():
        px = 8 * family.pixel_multiple
        cfg = TrainConfig(model=ModelConfig(kind=kind), sampling=SamplingConfig(height=px, width=px))  # pyright: ignore[reportArgumentType]
        check_config(cfg)
        sp = dataclasses.replace(cfg, parallel=ParallelConfig(sp=2))
        if family.sequence_parallel:
            check_config(sp)
        else:
            with pytest.raises(ValueError, match="parallel.sp>1 supports model.kind in"):
                check_config(sp)
        vllm = dataclasses.replace(cfg, rollout_engine="vllm_omni")
        if family.vllm_omni:
            check_config(vllm)
        else:
            with pytest.raises(ValueError, match="rollout_engine='vllm_omni' supports model.kind in"):
                check_config(vllm)
