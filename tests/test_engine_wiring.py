"""The loop's contract with an engine that keeps its own weights (vLLM-Omni's shape): wake before every
rollout, sleep after it, a fresh LoRA after every training step, CPU trajectories moved to the device, closed when
the run ends."""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_entry import Config  # noqa: E402

import fgrpo.train as train_mod  # noqa: E402
from fgrpo.rollout.engine import DiffusersEngine  # noqa: E402
from fgrpo.rollout.seeds import group_init_seeds  # noqa: E402


class RecordingEngine:
    """The in-process engine behind the interface of an out-of-process one."""

    def __init__(self, model):
        self.inner = DiffusersEngine(model)
        self.calls: list[str] = []
        self.adapters: list[dict] = []
        self.weights: list[dict[str, torch.Tensor]] = []

    def wake(self):
        self.calls.append("wake")

    def sleep(self):
        self.calls.append("sleep")

    def generate(self, prompts, seeds, cfg):
        self.calls.append("generate")
        traj = self.inner.generate(prompts, seeds, cfg)
        return traj.to("cpu")  # what a remote engine hands back

    def close(self):
        self.calls.append("close")

    def update_lora(self, state, config):
        """The trainer's adapter from memory: its tensors (the export's keys) and peft config."""
        self.calls.append("update_lora")
        self.adapters.append(config.to_dict())
        self.weights.append({k: t.detach().clone() for k, t in state.items()})


def recording_engines(monkeypatch) -> list[RecordingEngine]:
    """The loop builds RecordingEngines in place of its engine: the list of those built, in order."""
    engines = []

    def build(model, engine, path, **kw):
        engines.append(RecordingEngine(model))
        return engines[-1]

    monkeypatch.setattr(train_mod, "build_engine", build)
    return engines


def test_out_of_process_engine_is_woken_synced_and_slept(tmp_path, monkeypatch):
    engines = recording_engines(monkeypatch)
    cfg = dataclasses.replace(
        Config(),
        num_steps=2,
        run=dataclasses.replace(Config().run, out_dir=str(tmp_path), val_every=2, ckpt_every=0),
    )
    train_mod.train(cfg)
    calls = engines[0].calls
    rollout = ["wake", "generate", "sleep"]
    # step 0: validation rollout, training rollout, LoRA sync; step 1: rollout, sync; then final validation, and
    # the engine's processes closed at the end
    assert calls == rollout * 2 + ["update_lora"] + rollout + ["update_lora"] + rollout + ["close"]
    assert all(a["r"] == cfg.model.lora_rank for a in engines[0].adapters)
    assert torch.distributed.is_initialized() is False  # the loop left the process group cleanly


def test_a_resumed_run_sends_the_engine_its_adapter_before_the_first_rollout(tmp_path, monkeypatch):
    """The engine starts from the base weights: a resume must send it the checkpoint's adapter before it samples
    (without it, the first rollout after a resume samples the untrained model)."""
    engines = recording_engines(monkeypatch)
    base = Config()
    run = dataclasses.replace(base.run, out_dir=str(tmp_path), val_every=0, ckpt_every=1)
    train_mod.train(dataclasses.replace(base, num_steps=1, run=run))
    trained = engines[0].weights[-1]  # the adapter after step 0, the one its checkpoint holds
    assert any(t.abs().sum() > 0 for k, t in trained.items() if "lora_B" in k)  # not the starting adapter
    train_mod.train(dataclasses.replace(base, num_steps=2, run=dataclasses.replace(run, resume="auto")))
    calls = engines[1].calls
    assert calls[: calls.index("generate")] == ["update_lora", "wake"]
    sent = engines[1].weights[0]
    assert sent.keys() == trained.keys() and all(torch.equal(sent[k], trained[k]) for k in sent)


def test_a_trainer_over_an_earlier_trainers_model_sends_the_engine_its_adapter_first(tmp_path, monkeypatch):
    """A Trainer handed the model of an earlier one (train_step.py's settings over one model build) holds an adapter
    that has trained; the new engine starts from the base weights, so it gets that adapter before it samples.
    Without it, the first rollout sampled the base model against a trained policy: the likely cause of the first
    step's log-prob gap of 5.3e-3 in RESULTS vllm-loop-1 (vLLM-Omni after the in-process setting), 4e-5 after."""
    from fgrpo import parallel
    from fgrpo.logging import PhaseTimer

    engines = recording_engines(monkeypatch)
    base = Config()
    d = parallel.init_distributed("cpu")

    def config(name):
        run = dataclasses.replace(base.run, out_dir=str(tmp_path / name), val_every=0, ckpt_every=0)
        return dataclasses.replace(base, num_steps=1, run=run)

    first = train_mod.Trainer(config("first"), d)
    first.update(0, first.experience(0, PhaseTimer()), PhaseTimer())
    first.finish()
    trained = engines[0].weights[-1]
    assert any(t.abs().sum() > 0 for k, t in trained.items() if "lora_B" in k)  # not the starting adapter
    second = train_mod.Trainer(config("second"), d, model=first.model)
    assert engines[1].calls == ["update_lora"]  # before its first wake and rollout
    sent = engines[1].weights[0]
    assert sent.keys() == trained.keys() and all(torch.equal(sent[k], trained[k]) for k in sent)
    second.finish()
    parallel.shutdown()


def test_group_init_noise_reaches_the_engine(tmp_path, monkeypatch):
    """--grpo.group-init-noise: the training rollout gets one init seed per group (validation gets none)."""
    seen = []

    class Capturing(DiffusersEngine):
        def generate(self, prompts, seeds, cfg, init_seeds=None, *a, **kw):
            seen.append(init_seeds)
            return super().generate(prompts, seeds, cfg, init_seeds, *a, **kw)

    monkeypatch.setattr(train_mod, "build_engine", lambda model, engine, path, **kw: Capturing(model))
    base = Config()
    cfg = dataclasses.replace(
        base,
        num_steps=1,
        grpo=dataclasses.replace(base.grpo, group_init_noise=True),
        run=dataclasses.replace(base.run, out_dir=str(tmp_path), val_every=1, ckpt_every=0),
    )
    train_mod.train(cfg)
    G, n = cfg.grpo.group_size, cfg.grpo.group_size * cfg.grpo.prompts_per_step
    assert [s for s in seen if s is not None] == [group_init_seeds(cfg.seed, 0, torch.arange(n), G)]
    assert seen.count(None) >= 1  # validation draws its own fixed noise
