"""The collapse guard (fgrpo.guard and its use in train.py): the best validation's adapter in lora_best/, the stop
with exit code 3 once the score stays far below the best, its state across a resume, and the gold statistics.
Tiny random Qwen-Image on the CPU (tests/train_entry.py) with a scripted validation reward
(tests/scripted_reward.py)."""

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from train_entry import Config

from fgrpo import files, guard
from fgrpo import train as train_mod
from fgrpo.errors import RunCollapsed
from fgrpo.logging import read_metrics


def test_image_stats_by_hand():
    """Image 0: 2 black and 2 white pixels (luma 0, 0, 1, 1): mean 0.5, std 0.5, black 0.5, white 0.5.
    Image 1: one grey (luma 0.5) and three pixels of pure red (luma 0.299): mean (0.5 + 3 * 0.299) / 4."""
    a = np.array([[[0, 0, 0], [0, 0, 0]], [[255, 255, 255], [255, 255, 255]]], np.uint8)
    grey = round(0.5 * 255) / 255  # the uint8 grey's luma
    b = np.array([[[128, 128, 128], [255, 0, 0]], [[255, 0, 0], [255, 0, 0]]], np.uint8)
    stats = guard.image_stats(np.stack([a, b]))
    torch.testing.assert_close(stats[0], torch.tensor([0.5, 0.5, 0.5, 0.5]))
    mean1 = (128 / 255 * (0.299 + 0.587 + 0.114) + 3 * 0.299) / 4
    assert stats[1, 0].item() == pytest.approx(mean1, abs=1e-6) and grey > 0.5
    assert stats[1, 2].item() == 0.0 and stats[1, 3].item() == 0.0
    video = np.stack([np.stack([a, a])])  # [1, F=2, 2, 2, 3]: the frames' pixels together
    torch.testing.assert_close(guard.image_stats(video)[0], torch.tensor([0.5, 0.5, 0.5, 0.5]))
    with pytest.raises(ValueError, match="uint8"):
        guard.image_stats(np.zeros((1, 2, 2, 3), np.float32))


def test_best_tracker_by_hand():
    """drop 0.15, patience 2: 0.5, 0.9 (best), 0.8 (within 0.15), 0.7 (below), 0.8 (resets), 0.7, 0.6 -> stop."""
    t = guard.BestTracker(drop=0.15, patience=2)
    seen = []
    for step, score in enumerate([0.5, 0.9, 0.8, 0.7, 0.8, 0.7, 0.6]):
        new = t.observe(step, score)
        seen.append((new, t.below, t.collapsed()))
    assert seen == [
        (True, 0, False),
        (True, 0, False),
        (False, 0, False),
        (False, 1, False),
        (False, 0, False),
        (False, 1, False),
        (False, 2, True),
    ]
    assert t.metrics() == {"val/best": 0.9, "val/best_step": 1.0}
    rows = [{"step": s, "val/reward_mean": v} for s, v in enumerate([0.5, 0.9, 0.8, 0.7])] + [{"step": 9}]
    replayed = guard.BestTracker.replay(reversed(rows), drop=0.15, patience=2)
    assert (replayed.best, replayed.best_step, replayed.below) == (0.9, 1, 1)
    off = guard.BestTracker(drop=0.0, patience=1)
    for step, score in enumerate([0.9, 0.0, 0.0]):
        off.observe(step, score)
    assert not off.collapsed()


def _cfg(tmp_path, scores, num_steps=6, **run):
    c = Config()
    spec = json.dumps(
        {"name": "scripted_reward:make"} | ({"scores": scores} if scores else {"env": "FGRPO_TEST_SCORES"})
    )
    return dataclasses.replace(
        c,
        num_steps=num_steps,
        reward=dataclasses.replace(c.reward, val_name=spec, val_workers=0),
        run=dataclasses.replace(c.run, out_dir=str(tmp_path), val_every=1, **run),
    )


def _lora(path):
    return {k: t for k, t in files.read_tensors(path).items() if "lora" in k}


def test_a_falling_validation_stops_the_run_and_lora_best_is_the_best_adapter(tmp_path):
    """Validations 0.5, 0.9 (step 1), 0.6, 0.5: two in a row more than 0.15 below 0.9 -> RunCollapsed (exit 3) at
    step 3, naming step 1 and lora_best/; lora_best/ holds the weights of step 1 (the checkpoint after one step);
    no lora/ is exported; every validation row carries val/best, val/best_step and the gold statistics."""
    with pytest.raises(RunCollapsed) as caught:
        train_mod.train(_cfg(tmp_path, [0.5, 0.9, 0.6, 0.5]))
    assert caught.value.exit_code == 3
    message = str(caught.value)
    assert "\n" not in message and "(step 1)" in message and "at step 3" in message
    run = tmp_path / "e2e"
    assert str(run / "lora_best") in message
    assert not (run / "lora").exists()
    assert guard.read_best_record(run) == {"step": 1, "val/reward_mean": pytest.approx(0.9)}
    best = files.read_tensors(run / "lora_best" / "adapter_model.safetensors")
    step1 = _lora(run / "checkpoints" / "step_000001" / "model.safetensors")
    assert len(best) == len(step1) > 0
    by_module = {k.removeprefix("transformer.").replace(".weight", ""): t for k, t in best.items()}
    for k, t in step1.items():
        name = k.replace(".default", "").replace(".weight", "")
        assert torch.equal(by_module[name], t), k
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "val/reward_mean" in r]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["val/best_step"] for r in rows] == [0, 1, 1, 1]
    assert all(0 <= r["val/gold/brightness_mean"] <= 1 and "val/gold/white_frac" in r for r in rows)
    assert "val/gold/no_text_frac" not in rows[0]  # the scripted reward has no OCR reader


def test_resume_keeps_the_best(tmp_path, monkeypatch):
    """A run of 2 steps validates 0.5, 0.9 (step 1) and 0.8 (final, step 2). Resumed to 4 steps with scores 0.6,
    0.55 it stops at step 3: the best (0.9, step 1) came back from metrics.jsonl; without it 0.6 would be the
    best and nothing would stop."""
    monkeypatch.setenv("FGRPO_TEST_SCORES", "[0.5, 0.9, 0.8]")
    train_mod.train(_cfg(tmp_path, None, num_steps=2))
    run = tmp_path / "e2e"
    best_before = (run / "lora_best" / "adapter_model.safetensors").read_bytes()
    monkeypatch.setenv("FGRPO_TEST_SCORES", "[0.6, 0.55]")
    with pytest.raises(RunCollapsed, match=r"best 0\.9000 \(step 1\)"):
        train_mod.train(_cfg(tmp_path, None, num_steps=4, resume="auto"))
    assert (run / "lora_best" / "adapter_model.safetensors").read_bytes() == best_before
    last = [r for r in read_metrics(run / "metrics.jsonl") if "val/reward_mean" in r][-1]
    assert (last["step"], last["val/best"], last["val/best_step"]) == (3, pytest.approx(0.9), 1)


def test_through_the_experiment_entry_a_collapse_is_one_line_and_exit_code_3(tmp_path, capsys, monkeypatch):
    """fgrpo.errors.cli (every experiment's __main__) on a run whose validation falls: SystemExit(3), the line
    naming the best step and lora_best/ alone on stderr."""
    from fgrpo.errors import cli

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["e2e", "run"])
    with pytest.raises(SystemExit) as e:
        cli(train_mod.train, {"run": ("the falling run", _cfg(tmp_path, [0.9, 0.5, 0.5]))})
    err = capsys.readouterr().err
    assert e.value.code == 3
    assert (
        err.count("\n") == 1 and err.startswith("run stopped:") and "lora_best" in err and "(step 0)" in err
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "async"])
def test_two_ranks_stop_together_and_lora_best_is_written_once(tmp_path, mode):
    """On 2 torchrun ranks (gloo), synchronous (FSDP over both) or asynchronous (1 trainer + 1 rollout rank): the
    ranks that validate see the same all-gathered fall and stop at the same validation with exit code 3 (torchrun
    then ends the rollout rank); the export over the trainer ranks leaves one lora_best/ of the best step."""
    import os
    import subprocess

    spec = json.dumps({"name": "scripted_reward:make", "scores": [0.5, 0.9, 0.6, 0.5]})
    entry = str(Path(__file__).resolve().parent / "train_entry.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(entry).parent)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(29700 + os.getpid() % 200), entry, "--run.out-dir", str(tmp_path)]
    cmd += [
        "--num-steps",
        "6",
        "--run.val-every",
        "1",
        "--reward.val-name",
        spec,
        "--reward.val-workers",
        "0",
    ]
    if mode == "async":
        cmd += ["--parallel.rollout-ranks", "1", "--parallel.max-staleness", "1"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode != 0
    assert res.stderr.count("run stopped:") == 1 and "(step 1)" in res.stderr, res.stderr[-3000:]
    assert "exitcode  : 3" in res.stderr or "exitcode: 3" in res.stderr, res.stderr[-3000:]
    assert guard.read_best_record(tmp_path / "e2e") == {"step": 1, "val/reward_mean": pytest.approx(0.9)}
    rows = [r for r in read_metrics(tmp_path / "e2e" / "metrics.jsonl") if "val/reward_mean" in r]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
