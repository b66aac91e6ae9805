"""The errors fgrpo raises on purpose end an experiment in one line: its message alone on stderr, the error's exit
code; the unexpected keep their tracebacks. In process (every experiment's `__main__`), in a subprocess, and on
two torchrun ranks."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from fgrpo import errors
from fgrpo.errors import ConfigError, FgrpoError, MissingFileError, RunCollapsed, one_line_errors

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
LR = "optim.lr=-1.0: must be > 0; pass --optim.lr with a valid value"


def test_an_fgrpo_error_is_its_message_alone_and_its_exit_code(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e, one_line_errors():
        raise ConfigError("data.train_prompts: line 3 of 'p.txt' reads\n  'bad'; fix it")
    assert e.value.code == 2
    assert capsys.readouterr().err == "data.train_prompts: line 3 of 'p.txt' reads   'bad'; fix it\n"
    with pytest.raises(SystemExit) as e, one_line_errors():  # a subclass's own code
        raise RunCollapsed("val/reward_mean fell")
    assert (e.value.code, capsys.readouterr().err) == (3, "val/reward_mean fell\n")
    # builtin bases keep the `except ValueError` / `FileNotFoundError` of callers
    assert issubclass(ConfigError, ValueError) and issubclass(MissingFileError, FileNotFoundError)


def test_an_unexpected_error_keeps_its_traceback(capsys):
    with pytest.raises(KeyError), one_line_errors():
        raise KeyError("a bug")
    assert capsys.readouterr().err == ""


def test_only_rank_0_prints_at_once_another_rank_after_the_wait(capsys, monkeypatch):
    """Rank 0's line stands for every rank; a rank still alive after the wait raised alone and says so."""
    slept = []
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit), one_line_errors():
        raise FgrpoError("refused")
    assert (capsys.readouterr().err, slept) == ("refused\n", [])
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as e, one_line_errors():
        raise FgrpoError("refused")
    assert (e.value.code, capsys.readouterr().err, slept) == (
        2,
        "rank 3: refused\n",
        [errors.OTHER_RANKS_WAIT_S],
    )


# (file, preset, a flag its validation refuses, the start of the line it prints)
REFUSALS = [
    ("qwen_image_ocr", "tiny", ["--optim.lr", "-1"], LR),
    ("sd35_ocr", "tiny-random", ["--optim.lr", "-1"], LR),
    # without rendering its condition images first (20 s)
    ("qwen_image_edit_ocr", "tiny", ["--no-make-data", "--optim.lr", "-1"], LR),
    ("ltx2_ocr", "tiny", ["--optim.lr", "-1"], LR),
    ("flux_ocr", "tiny", ["--optim.lr", "-1"], LR),
    ("flux2_ocr", "tiny", ["--optim.lr", "-1"], LR),
    ("zimage_ocr", "tiny", ["--optim.lr", "-1"], LR),
    ("wan_video_ocr", "tiny", ["--optim.lr", "-1"], LR),
    ("bagel_ocr", "tiny", ["--optim.lr", "-1"], LR),
    ("toy_2d", "tiny", ["--grpo.updates-per-rollout", "7"], "grpo.updates_per_rollout=7 must divide"),
    ("pretrain_textbed", "tiny", ["--optim.min-lr-ratio", "2"], "optim.min_lr_ratio=2.0 must be in [0, 1]"),
    ("eval_ocr", "tiny", ["--num-images", "0"], "--num-images 0: must be >= 1"),
]


def test_every_experiment_file_is_checked():
    assert {name for name, *_ in REFUSALS} == {p.stem for p in (ROOT / "experiments").glob("*.py")}


@pytest.mark.parametrize(("name", "preset", "flags", "line"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_every_experiment_ends_a_refusal_in_one_line(
    name, preset, flags, line, tmp_path, monkeypatch, capsys
):
    """Each file's `__main__`, run in this process on a command line its validation refuses."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may be written; if something is, not into the checkout
    path = ROOT / "experiments" / f"{name}.py"
    out = {"eval_ocr": "--out"}.get(name, "--run.out-dir" if name.endswith("_ocr") else "--out-dir")
    monkeypatch.setattr(sys, "argv", [str(path), preset, *flags, out, "x"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(path), run_name="__main__")
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(line), err
    assert not (tmp_path / "x").exists()  # refused before the run directory


def test_a_refusal_in_a_subprocess_is_one_line_on_stderr_and_exit_2(tmp_path):
    cmd = [sys.executable, str(ROOT / "experiments" / "qwen_image_ocr.py"), "tiny", "--optim.lr", "-1"]
    res = subprocess.run(
        [*cmd, "--run.out-dir", str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert (res.returncode, res.stderr, res.stdout) == (2, LR + "\n", "")


@pytest.mark.slow
def test_a_refusal_on_two_torchrun_ranks_is_printed_once(tmp_path):
    """Both ranks refuse the config: rank 0's line alone (rank 1 is stopped by torchrun before its wait ends),
    no traceback of a rank; torchrun's own report (it exits 1) names rank 0's exit code 2."""
    port = str(29500 + os.getpid() % 1000)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
    cmd += [str(ROOT / "experiments" / "qwen_image_ocr.py"), "tiny", "--optim.lr", "-1"]
    res = subprocess.run(
        [*cmd, "--run.out-dir", str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=300
    )
    lines = res.stderr.splitlines()
    assert lines.count(LR) == 1 and sum(LR in s for s in lines) == 1, res.stderr
    assert not any(s.startswith("[rank") for s in lines), res.stderr
    assert res.returncode == 1 and "exitcode  : 2" in res.stderr, res.stderr


def test_an_nccl_group_is_destroyed_before_the_exit(monkeypatch, capsys):
    """NCCL prints a warning at exit for a group nobody destroyed (a second line); gloo's is left as it is."""
    import torch.distributed as dist

    destroyed = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: destroyed.append(True))
    for backend, want in (("gloo", []), ("nccl", [True])):
        monkeypatch.setattr(dist, "get_backend", lambda backend=backend: backend)
        with pytest.raises(SystemExit), one_line_errors():
            raise FgrpoError("refused")
        assert (destroyed, capsys.readouterr().err) == (want, "refused\n")
