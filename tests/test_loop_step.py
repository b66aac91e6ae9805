"""benchmarks/loop_step.py end to end on the tiny model: the real training loop through
train(model_builder=...), synchronous on one rank in this process and asynchronous (1 trainer + 1 rollout gloo
rank) under torchrun; the table's numbers are the means of the run's own metrics.jsonl over the steps after
the first."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fgrpo.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TINY = ("--tiny", "--size", "32", "--prompts", "1", "--group", "2", "--micro-batch", "2", "--steps", "3")


def _row(out: str, mode: str) -> list[str]:
    """The table row of `mode`, as its cells."""
    lines = [line for line in out.splitlines() if line.startswith(f"| {mode} |")]
    assert len(lines) == 1, out[-3000:]
    return [c.strip() for c in lines[0].strip("|").split("|")]


def _timed(out_dir: Path) -> list[dict]:
    """The metrics rows of the steps after the first (the benchmark's means are over these)."""
    rows = [json.loads(line) for line in open(out_dir / "loop_step" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    return rows[1:]


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def _loop_step(monkeypatch):
    """benchmarks/loop_step.py as a module."""
    monkeypatch.syspath_prepend(str(BENCH))  # loop_step imports benchmarks/rollout.py as `rollout`
    monkeypatch.delitem(sys.modules, "loop_step", raising=False)  # put back as it was after the test
    return load_script(BENCH / "loop_step.py")


def test_a_refusal_names_the_benchmarks_own_flag(monkeypatch):
    """The loop refuses compile with sequence parallelism naming --model.compile; the benchmark's flag is --compile."""
    loop_step = _loop_step(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        loop_step.main([*TINY, "--compile", "--parallel.sp", "2"])
    assert "--compile" in str(e.value) and "--model.compile" not in str(e.value)


def test_sync_tiny_in_process(tmp_path, monkeypatch, capsys):
    """One rank: the recipe's loop trains the tiny random model handed in by model_builder (without that seam
    the run would load model.path 'Qwen/Qwen-Image'), and the row is the metrics' means over steps 1 and 2."""
    loop_step = _loop_step(monkeypatch)
    loop_step.main([*TINY, "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    mode, ranks, images, step_s, per_gpu, train_s, wait_s, rollout_s, reward_s, idle, peak = _row(
        out, "sync DP=1"
    )
    assert (ranks, images, wait_s, idle, peak) == ("1", "2", "-", "-", "-")
    timed = _timed(tmp_path)
    step = _mean(timed, "time/total")
    assert float(step_s) == pytest.approx(step, abs=0.005) and step > 0
    assert float(per_gpu) == pytest.approx(2 / step, rel=0.01)
    assert float(train_s) == pytest.approx(_mean(timed, "time/train"), abs=0.005) and float(train_s) > 0
    assert float(rollout_s) == pytest.approx(_mean(timed, "time/rollout"), abs=0.005) and float(rollout_s) > 0
    assert float(reward_s) == pytest.approx(_mean(timed, "time/reward"), abs=0.005)
    for r in timed:  # the configured reward scored the images: JPEG compressibility = -kB / 500
        assert r["reward/mean"] == pytest.approx(-r["reward/jpeg/kb"] / 500, rel=1e-5)


@pytest.mark.slow
def test_async_tiny_two_ranks(tmp_path):
    """1 trainer + 1 rollout gloo rank: the row has the trainer's wait and the rollout side's times (logged as
    rollout_time/*) and the idle shares they make of the trainer's step."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(BENCH / "loop_step.py"), *TINY, "--parallel.rollout-ranks", "1", "--out-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    cells = _row(res.stdout, "async 1 train + 1 rollout, staleness 1")
    mode, ranks, images, step_s, per_gpu, train_s, wait_s, rollout_s, reward_s, idle, peak = cells
    assert (ranks, images, peak) == ("2", "2", "-")
    timed = _timed(tmp_path)
    step = _mean(timed, "time/total")
    assert float(step_s) == pytest.approx(step, abs=0.005) and step > 0
    assert float(per_gpu) == pytest.approx(2 / step / 2, rel=0.01)
    assert float(train_s) == pytest.approx(_mean(timed, "time/train"), abs=0.005) and float(train_s) > 0
    assert float(wait_s) == pytest.approx(_mean(timed, "time/wait"), abs=0.005)
    assert float(rollout_s) == pytest.approx(_mean(timed, "rollout_time/rollout"), abs=0.005)
    assert float(rollout_s) > 0
    trainer_idle = _mean(timed, "time/wait") / step
    rollout_idle = 1 - _mean(timed, "rollout_time/total") / step
    assert idle == f"{trainer_idle:.0%} / {rollout_idle:.0%}"
    assert [r["async/staleness"] for r in timed] == [1, 1]
