"""Logging tests: phase timer, console progress, image grid, reward curve, strict metrics.jsonl, run metadata,
null and wandb loggers."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import pytest
from PIL import Image

from fgrpo import logging as flog
from fgrpo import parallel
from fgrpo import runs as fruns


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_phase_timer_accumulates():
    clock = FakeClock()
    timer = flog.PhaseTimer(clock=clock)
    with timer("rollout"):
        clock.t += 2.0
    with timer("train"):
        clock.t += 3.0
    clock.t += 0.5  # outside any phase
    with timer("rollout"):  # a phase entered twice adds up
        clock.t += 1.0
    with pytest.raises(RuntimeError), timer("reward"):  # time counts even when the phase raises
        clock.t += 0.25
        raise RuntimeError
    m = timer.metrics(images=34)
    assert m["time/rollout"] == 3.0 and m["time/train"] == 3.0 and m["time/reward"] == 0.25
    assert m["time/total"] == 6.75 and m["time/other"] == 0.5
    assert m["perf/images_per_s"] == 34 / 6.75


def test_phase_timer_marks_each_phase_for_the_profiler():
    """Each phase is a profiler range `phase:<name>` around the work done in it (what train_step.py --profile reads
    to say how busy the GPU was per phase): the matmul run inside "train" lies within that range."""
    import torch

    timer = flog.PhaseTimer()
    x = torch.ones(8, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with timer("rollout"):
            pass
        with timer("train"):
            torch.mm(x, x)
    events = prof.events() or []
    ranges = {e.name: e.time_range for e in events if e.name.startswith("phase:")}
    assert set(ranges) == {"phase:rollout", "phase:train"}
    (mm,) = [e for e in events if e.name == "aten::mm"]
    train = ranges["phase:train"]
    assert train.start <= mm.time_range.start and mm.time_range.end <= train.end
    assert ranges["phase:rollout"].end <= train.start


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


STEP = {
    "reward/mean": 0.5,
    "reward/std": 0.25,
    "time/rollout": 3.0,
    "time/total": 4.0,
    "perf/images_per_s": 8.0,
    "train/clip_frac": 0.125,
}


def test_progress_to_a_file_writes_one_plain_line_per_step():
    """`> log.txt`: every step is one full line, and no carriage return (tqdm's redraws) reaches the file."""
    out, clock = io.StringIO(), FakeClock()
    bar = flog.Progress(total=4, initial=1, file=out, clock=clock)  # resumed at step 1
    clock.t += 10.0
    bar.update(STEP)
    clock.t += 20.0
    bar.update({})
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    # eta = elapsed / steps run * steps left: 10 / 1 * 2 = 20 s, then 30 / 2 * 1 = 15 s
    assert text.splitlines() == [
        "step 2/4 [00:10<00:20] | reward 0.500±0.250 | rollout 3.0s / 4.0s | 8.000 img/s | clip 0.125",
        "step 3/4 [00:30<00:15]",
    ]


def test_progress_on_a_terminal_keeps_tqdm_bar_under_the_lines():
    out = Terminal()
    bar = flog.Progress(total=3, file=out)
    line = bar.update(STEP)
    bar.close()
    text = out.getvalue()
    assert line.startswith("step 1/3 [") and line + "\n" in text
    assert "\r" in text and "1/3 [" in text.rsplit(line, 1)[1]  # tqdm's bar, redrawn after the line


def test_progress_is_silent_off_rank_0(monkeypatch):
    # torchrun's RANK before the group is joined: fgrpo.parallel.rank() reads it (another test in this worker
    # may have left a one-rank group up, so say there is none)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(parallel, "initialized", lambda: False)
    for out in (io.StringIO(), Terminal()):
        bar = flog.Progress(total=3, file=out)
        assert bar.update(STEP) == ""
        bar.close()
        assert out.getvalue() == ""


def _images(b=5, h=24, w=32, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(b, h, w, 3), dtype=np.uint8)


def test_image_grid_layout_pixels_and_captions():
    imgs = _images()
    caps = ["a red apple on a table", "", 'a sign that says "OPEN"', "x" * 200, "five"]
    grid = flog.image_grid(imgs, caps, ncols=3, caption_lines=2, font_size=10, pad=2)
    cap_h = 2 * 12 + 4
    assert grid.size == (3 * 34 - 2, 2 * (24 + cap_h + 2) - 2)
    a = np.asarray(grid)
    for i in range(5):
        x, y = (i % 3) * 34, (i // 3) * (24 + cap_h + 2)
        assert np.array_equal(a[y : y + 24, x : x + 32], imgs[i])  # images pasted untouched
        band = a[y + 24 : y + 24 + cap_h, x : x + 32]
        assert (band < 128).any() == (caps[i] != ""), i  # text where there is a caption, blank otherwise
    # no captions: no band
    assert flog.image_grid(imgs, None, ncols=5, pad=0).size == (5 * 32, 24)
    with pytest.raises(ValueError, match="captions"):
        flog.image_grid(imgs, caps[:2])
    with pytest.raises(ValueError, match="uint8"):
        flog.image_grid(imgs.astype(np.float32))


def test_reward_curve_plots_both_series_with_labels_and_legend_off_the_data(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    rows = [{"step": s, "reward/mean": 0.1 * s} for s in range(10)]
    rows += [{"step": s, "val/reward_mean": 1.0 - 0.1 * s} for s in (0, 4, 8)]
    rows += [{"step": 9, "reward/mean": 0.95}]  # a resumed run re-logs a step: the later row wins
    rows += [{"step": 10, "reward/mean": None}]  # a non-finite metric, logged as null: a gap, no crash
    series = flog.reward_curve_series(rows)
    assert series["train (reward/mean)"] == (list(range(11)), [0.1 * s for s in range(9)] + [0.95, None])
    assert series["held-out (val/reward_mean)"] == ([0, 4, 8], [1.0, 1.0 - 0.4, 1.0 - 0.8])

    fig = flog.curve_figure(series, ylabel="reward")
    (ax,) = fig.axes
    train, held = ax.get_lines()
    assert (train.get_label(), held.get_label()) == ("train (reward/mean)", "held-out (val/reward_mean)")
    # Line2D's data getters return arrays here (curve_figure plots arrays); matplotlib types them as ArrayLike
    np.testing.assert_allclose(cast(np.ndarray, held.get_xydata()), [[0, 1.0], [4, 0.6], [8, 0.2]])
    assert math.isnan(cast(np.ndarray, train.get_ydata())[-1])
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "reward"
    fig.canvas.draw()
    assert isinstance(fig.canvas, FigureCanvasAgg)  # curve_figure draws on Agg
    renderer = fig.canvas.get_renderer()
    leg = ax.get_legend()
    assert leg is not None
    legend, axes = leg.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert legend.x0 > axes.x1  # right of the plot area: it covers no data

    path = flog.plot_reward_curve(tmp_path / "curve.png", rows)
    assert Image.open(path).size == (750, 400)


def test_metrics_jsonl_is_strict_json_and_names_non_finite_metrics(tmp_path, capsys):
    logger = flog.Logger(tmp_path, wandb_mode="disabled")
    logger.log({"reward/mean": 0.5, "train/kl": float("nan"), "train/grad_norm": np.float32("inf")}, step=0)
    logger.log({"reward/mean": 0.6, "train/kl": float("nan"), "hist": [1.0, float("-inf")]}, step=1)
    logger.finish()

    def no_constants(name):
        raise AssertionError(f"{name} in metrics.jsonl is not JSON")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=no_constants) for line in lines]
    assert (
        rows[0]["train/kl"] is None and rows[0]["train/grad_norm"] is None and rows[0]["reward/mean"] == 0.5
    )
    assert rows[0]["nonfinite"] == ["train/kl", "train/grad_norm"]
    assert rows[1]["hist"] == [1.0, None] and rows[1]["nonfinite"] == ["train/kl", "hist"]
    out = capsys.readouterr().out
    assert out.count("train/kl") == 1 and "hist not finite at step 1" in out  # each key is reported once
    assert (tmp_path / "reward_curve.png").is_file()


def test_partial_last_row_is_skipped_and_a_resumed_run_appends_cleanly(tmp_path):
    logger = flog.Logger(tmp_path, wandb_mode="disabled")
    logger.log({"reward/mean": 0.5}, step=0)
    logger.log({"reward/mean": 0.6}, step=1)
    logger._metrics.write('{"step": 2, "reward/me')  # the run is killed mid-write
    logger._metrics.close()
    with pytest.warns(UserWarning, match="skipped 1 line"):
        assert [r["step"] for r in flog.read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]

    resumed = flog.Logger(tmp_path, wandb_mode="disabled")
    resumed.log({"reward/mean": 0.7}, step=2)
    with pytest.warns(UserWarning, match=r"line 3\)"):
        resumed.finish()  # the curve reads the file too
        rows = flog.read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(0, 0.5), (1, 0.6), (2, 0.7)]


def _exercise(logger):
    logger.log({"reward/mean": 0.5, "reward/std": np.float32(0.1)}, step=0)
    logger.log_images("rollout", _images(4), ["p0", "p1", "p2", "p3"], step=0)
    logger.log({"reward/mean": 0.7, "val/reward_mean": 0.6}, step=1)
    logger.finish()


def test_null_logger_accepts_the_same_calls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _exercise(flog.NullLogger())
    assert list(tmp_path.iterdir()) == []
    assert isinstance(fruns.make_logger(object(), tmp_path / "x", enabled=False), flog.NullLogger)
    assert not (tmp_path / "x").exists()


def test_disabled_wandb_still_logs_to_disk(tmp_path):
    logger = flog.Logger(tmp_path, wandb_mode="disabled")
    assert logger.wandb_run is None
    _exercise(logger)
    rows = flog.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and rows[0]["reward/std"] == pytest.approx(0.1)
    assert (tmp_path / "images" / "rollout_000000.png").is_file()
    assert (tmp_path / "reward_curve.png").is_file()
    assert not (tmp_path / "wandb").exists()


def test_wandb_offline_writes_a_run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login: 'online' must fall back to offline
    assert flog.resolve_wandb_mode("online") == "offline"

    @dataclass
    class Run:
        wandb: str = "online"

    @dataclass
    class Cfg:
        exp_name: str = "wb"
        run: Run = field(default_factory=Run)

    logger = fruns.make_logger(Cfg(), tmp_path / "run", experiment_source="x = 1\n")
    assert isinstance(logger, flog.Logger)  # enabled: not the NullLogger
    assert logger.wandb_run is not None
    _exercise(logger)
    runs = list((tmp_path / "run").rglob("offline-run-*"))
    assert runs, sorted(str(p) for p in tmp_path.rglob("*"))[:20]
    assert list(runs[0].glob("*.wandb")), list(runs[0].iterdir())
    assert (tmp_path / "run" / "config.json").is_file() and (tmp_path / "run" / "experiment.py").is_file()
    with pytest.raises(ValueError, match="run.wandb"):
        flog.resolve_wandb_mode("on")
