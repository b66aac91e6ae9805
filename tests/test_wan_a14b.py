"""The loop trains both experts of a Wan 2.2 T2V-A14B (a tiny random one, experiments/wan_video_ocr.py's `a14b-tiny`):
LoRA on each, each expert optimized on the window steps of its own stage only, both adapters and their optimizer state
resumed bit-exactly, both exported in the layout WanPipeline loads into each expert."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers.pipelines.wan.pipeline_wan import WanPipeline

from fgrpo import parallel
from fgrpo.models import tiny
from fgrpo.models.base import trained_transformers
from fgrpo.scripts import load_script
from fgrpo.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
ROOT = Path(__file__).resolve().parents[1]
# The tiny model's 4 steps at shift 3 run at t = 1000, 858, 602, 9: the high-noise expert (t >= 875) at step 0, the
# low-noise one at steps 1-3. Windows (size, range): step 0 alone, all high; steps 1-2, all low; steps 0-1, one of each.
WINDOWS = {"high": (1, (0, 1)), "low": (2, (1, 3)), "both": (2, (0, 2))}


def _config(out_dir: Path, window: str, **run: Any):
    cfg = load_script(ROOT / "experiments" / "wan_video_ocr.py").a14b_tiny()
    size, steps = WINDOWS[window]
    return dataclasses.replace(
        cfg,
        num_steps=1,
        sampling=dataclasses.replace(cfg.sampling, window_size=size, window_range=steps),
        optim=dataclasses.replace(cfg.optim, lr=1e-2),
        run=dataclasses.replace(cfg.run, out_dir=str(out_dir), val_every=0, ckpt_every=1, **run),
    )


@pytest.fixture
def dist():
    owned = not parallel.initialized()
    d = parallel.init_distributed("cpu")
    yield d
    if owned:
        parallel.shutdown()


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if parallel.is_dtensor(t) else t


def _adapters(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """Each expert's trainable tensors (full, copied)."""
    return {
        name: {n: _full(p).clone() for n, p in t.named_parameters() if p.requires_grad}
        for name, t in trained_transformers(trainer.model).items()
    }


def _trained(trainer: Trainer) -> dict[str, bool]:
    """Which experts' adapters hold AdamW state (AdamW makes it for the parameters that got a gradient)."""
    state = trainer.optimizer.state
    return {
        name: any(p in state for p in t.parameters() if p.requires_grad)
        for name, t in trained_transformers(trainer.model).items()
    }


@pytest.mark.parametrize("window", ["both", "high", "low"])
def test_one_step_trains_the_experts_of_the_window_steps(tmp_path, dist, window):
    trainer = Trainer(_config(tmp_path, window), dist)
    assert set(trained_transformers(trainer.model)) == {"transformer", "transformer_2"}
    assert len(trainer.params) == sum(len(a) for a in _adapters(trainer).values())  # both adapters optimized
    before = _adapters(trainer)
    trainer.train()
    after = _adapters(trainer)
    moved = {
        name: any(not torch.equal(after[name][k], v) for k, v in before[name].items()) for name in before
    }
    want = {"transformer": window != "low", "transformer_2": window != "high"}
    assert moved == want and _trained(trainer) == want


def test_resume_restores_both_adapters_and_their_optimizer_state(tmp_path, dist):
    first = Trainer(_config(tmp_path, "both"), dist)
    first.train()
    resumed = Trainer(_config(tmp_path, "both", resume="auto"), dist)
    assert resumed.start_step == 1
    for name, tensors in _adapters(first).items():
        for k, v in tensors.items():
            assert torch.equal(_adapters(resumed)[name][k], v), (name, k)
    for p, q in zip(first.params, resumed.params, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            a, b = first.optimizer.state[p][key], resumed.optimizer.state[q][key]
            assert torch.equal(_full(a), _full(b))
    resumed.finish()


def test_exported_experts_load_into_the_pipeline_with_the_trained_outputs(tmp_path, dist):
    cfg = _config(tmp_path, "both")
    trainer = Trainer(cfg, dist)
    trainer.train()
    lora = tmp_path / cfg.exp_name / "lora"
    pipe = WanPipeline(**tiny.tiny_wan_components(seed=cfg.seed, experts=2))
    base: list[torch.Tensor] = []
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 2, 4, 4, generator=g),
        timestep=torch.tensor([950.0, 300.0]),
        encoder_hidden_states=torch.randn(2, tiny.TINY_WAN_TEXT_LENGTH, 32, generator=g),
        return_dict=False,
    )
    with torch.no_grad():
        base = [t(**inputs)[0] for t in (pipe.transformer, pipe.transformer_2)]
        pipe.load_lora_weights(str(lora / "transformer"))
        pipe.load_lora_weights(str(lora / "transformer_2"), load_into_transformer_2=True)
        for (name, trained), t, b in zip(
            trained_transformers(trainer.model).items(), (pipe.transformer, pipe.transformer_2), base
        ):
            got, want = t(**inputs)[0], trained(**inputs)[0]
            assert not torch.equal(got, b), name  # the trained adapter changes the expert
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_init_lora_and_evaluation_read_the_exported_experts(tmp_path, dist):
    """model.init_lora (and an evaluation's --lora) given the exported `lora/` start each expert from its own
    adapter."""
    from fgrpo.evaluate import adapter_settings
    from fgrpo.models.lora import setup_trainable_model
    from fgrpo.models.registry import check_config

    cfg = _config(tmp_path, "both")
    trainer = Trainer(cfg, dist)
    trainer.train()
    lora = tmp_path / cfg.exp_name / "lora"
    assert adapter_settings(lora)["lora_rank"] == cfg.model.lora_rank
    mcfg = dataclasses.replace(cfg.model, init_lora=str(lora))
    check_config(dataclasses.replace(cfg, model=mcfg))
    model = tiny.tiny_wan(seed=cfg.seed, experts=2)
    setup_trainable_model(model, mcfg)
    for name, t in trained_transformers(model).items():
        want = _adapters(trainer)[name]
        got = {n: p.detach() for n, p in t.named_parameters() if p.requires_grad}
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name


def test_the_reference_policy_and_the_merged_rollout_take_both_experts():
    """The KL's reference (adapters_disabled over the trained transformers) is the base model at both stages; the
    merged rollout's copies cover the layers of both experts."""
    from fgrpo.config import ModelConfig
    from fgrpo.models.base import trained_module
    from fgrpo.models.lora import MergedLora, adapters_disabled, setup_trainable_model
    from fgrpo.models.wan import WAN_LORA_TARGETS

    model = tiny.tiny_wan(seed=1, experts=2)
    x = torch.randn(1, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond = model.encode(["a cat"])
    base = [model.velocity(x, torch.tensor(s), cond, guidance_scale=1.0) for s in (0.95, 0.3)]
    mcfg = ModelConfig(
        kind="tiny_wan", dtype="fp32", lora_rank=2, lora_alpha=4, lora_targets=",".join(WAN_LORA_TARGETS)
    )
    for p in setup_trainable_model(model, mcfg):
        torch.nn.init.normal_(p.data)  # B != 0: the adapters change both experts
    adapted = [model.velocity(x, torch.tensor(s), cond, guidance_scale=1.0) for s in (0.95, 0.3)]
    assert all(not torch.equal(a, b) for a, b in zip(adapted, base))
    with torch.no_grad(), adapters_disabled(*trained_transformers(model).values()):
        ref = [model.velocity(x, torch.tensor(s), cond, guidance_scale=1.0) for s in (0.95, 0.3)]
    assert all(torch.equal(r, b) for r, b in zip(ref, base))
    merged = MergedLora(trained_module(model))
    names = {
        n.split(".")[0]
        for n, m in trained_module(model).named_modules()
        if any(m is layer for layer, _, _ in merged.layers)
    }
    assert names == {"transformer", "transformer_2"}


def test_model_experts_is_checked():
    """model.experts picks the tiny model's variant; a count Wan has not is refused in one line naming the field."""
    from fgrpo.errors import ConfigError
    from fgrpo.models.registry import build_model
    from fgrpo.models.wan import WanConfig

    two = build_model(WanConfig(kind="tiny_wan", dtype="fp32", experts=2), torch.device("cpu"), seed=0)
    assert list(trained_transformers(two)) == ["transformer", "transformer_2"]
    with pytest.raises(ConfigError, match=r"model.experts=3: Wan has 1 \(TI2V-5B\) or 2"):
        build_model(WanConfig(kind="tiny_wan", dtype="fp32", experts=3), torch.device("cpu"), seed=0)
