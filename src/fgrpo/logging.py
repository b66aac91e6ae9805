"""Run logging: wandb (or nothing) behind one call shape, console progress, image grids, reward curves.

`Logger` writes every run to disk itself (metrics.jsonl, image grids as PNG, a reward-curve PNG at
`finish`) and mirrors it to wandb when a wandb mode other than "disabled" is asked for; without a
WANDB_API_KEY an "online" request becomes "offline" (a local run dir `wandb sync` can upload later).
`NullLogger` takes the same calls and does nothing: non-zero ranks get it, so the loop never branches.
`Progress` is the console side: one line per step (tqdm's bar under it on a terminal), rank 0 only.

The module is named like the stdlib's `logging` on purpose (it is the run's log); absolute imports keep
the two apart (`from fgrpo import logging as flog`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from tqdm import tqdm

from fgrpo.parallel import rank

# Phases of one training step, in the order the console shows them.
PHASES = ("rollout", "reward", "train", "sync", "val", "checkpoint")


def print0(*args: Any, **kwargs: Any) -> None:
    """print on rank 0 only (flushed: torchrun pipes stdout, and a crash must not eat the last lines)."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


# ---------------------------------------------------------------------------------------------------------
# time split


class PhaseTimer:
    """Accumulates wall time per named phase of one training step.

        timer = PhaseTimer()
        with timer("rollout"): ...
        with timer("train"): ...
        timer.metrics(images=P * G)  # {"time/rollout": s, ..., "time/total": s, "perf/images_per_s": ...}

    A phase entered twice adds up. `total` runs from construction, so time outside any phase shows as
    `time/other` instead of vanishing. With CUDA in use the phase end synchronises the device (on by
    default): without it an asynchronous launch bills its kernels to whichever phase syncs next. Each phase is
    also a profiler range named `phase:<name>`, so a torch.profiler trace that records the host's activity shows the
    step's phases (a GPU-only trace keeps no range), and benchmarks/train_step.py --profile how busy the GPU was in
    each.
    """

    RANGE_PREFIX = "phase:"  # a phase's profiler range is RANGE_PREFIX + its name

    def __init__(self, *, sync_cuda: bool = True, clock=time.perf_counter):
        self._clock = clock
        self._sync_cuda = sync_cuda
        self._start = clock()
        self.times: dict[str, float] = {}

    def _sync(self) -> None:
        if self._sync_cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self._sync()
        t0 = self._clock()
        with torch.profiler.record_function(self.RANGE_PREFIX + phase):
            try:
                yield
            finally:
                self._sync()
                self.times[phase] = self.times.get(phase, 0.0) + self._clock() - t0

    def total(self) -> float:
        return self._clock() - self._start

    def metrics(self, *, images: int | None = None) -> dict[str, float]:
        total = self.total()
        out = {f"time/{k}": v for k, v in self.times.items()}
        out["time/other"] = max(0.0, total - sum(self.times.values()))
        out["time/total"] = total
        if images is not None:
            out["perf/images_per_s"] = images / total if total > 0 else float("nan")
        return out


def _fmt(v: float) -> str:
    if v != v:  # nan
        return "nan"
    a = abs(v)
    if a != 0 and (a < 1e-3 or a >= 1e4):
        return f"{v:.2e}"
    return f"{v:.3f}" if a < 10 else f"{v:.1f}"


# metric key -> short console label; shown when present, in this order
_CONSOLE_KEYS = (
    ("reward/zero_std_group_frac", "zero-std"),
    ("train/clip_frac", "clip"),
    ("train/ratio_mean", "ratio"),
    ("train/approx_kl", "akl"),
    ("train/kl", "kl"),
    ("train/grad_norm", "gnorm"),
    ("train/skipped_steps", "skipped"),
    ("val/reward_mean", "val"),
)


def format_metrics(metrics: Mapping[str, float]) -> str:
    """The console summary of one step: reward mean±std, the phase time split, images/s, GRPO health stats.

    Metrics use the loop's keys (reward/mean, time/rollout, perf/images_per_s, train/clip_frac...); a part
    whose keys are absent is left out.
    """
    parts = []
    if "reward/mean" in metrics:
        std = metrics.get("reward/std")
        parts.append(f"reward {_fmt(metrics['reward/mean'])}" + (f"±{_fmt(std)}" if std is not None else ""))
    times = [(p, metrics[f"time/{p}"]) for p in PHASES if f"time/{p}" in metrics]
    times += [
        (k[5:], v)
        for k, v in metrics.items()
        if k.startswith("time/") and k[5:] not in (*PHASES, "total", "other")
    ]
    if times:
        split = " ".join(f"{p} {v:.1f}s" for p, v in times)
        total = metrics.get("time/total")
        parts.append(split + (f" / {total:.1f}s" if total is not None else ""))
    if "perf/images_per_s" in metrics:
        parts.append(f"{_fmt(metrics['perf/images_per_s'])} img/s")
    extra = [f"{label} {_fmt(metrics[k])}" for k, label in _CONSOLE_KEYS if k in metrics]
    if extra:
        parts.append(" ".join(extra))
    return " | ".join(parts)


class Progress:
    """Console progress of the training loop, on rank 0 only (other ranks print nothing).

        bar = Progress(total=cfg.num_steps, initial=start_step)
        for step in ...:
            bar.update(metrics)      # after the step: one line "step k/N [elapsed<eta] | format_metrics"
        bar.close()

    Every step writes one full line (`tqdm.write`), so a log file (`> log.txt`, CI) holds one readable
    line per step. On a terminal tqdm's bar stays under those lines; to a file or pipe the bar is off,
    since tqdm redraws it with carriage returns, which a file keeps as clutter.
    """

    def __init__(self, total: int, initial: int = 0, *, file: TextIO | None = None, clock=time.perf_counter):
        self.file = file if file is not None else sys.stdout
        self.enabled = rank() == 0
        self.total, self.n = total, initial
        self._initial, self._clock = initial, clock
        self._start = clock()
        self._bar = tqdm(
            total=total,
            initial=initial,
            file=self.file,
            unit="step",
            dynamic_ncols=True,
            disable=not (self.enabled and self.file.isatty()),
        )

    def update(self, metrics: Mapping[str, float]) -> str:
        """Count one finished step, write its line; returns the line ('' off rank 0)."""
        self.n += 1
        if not self.enabled:
            return ""
        elapsed = self._clock() - self._start
        done = self.n - self._initial  # a resumed run's rate counts only the steps it ran
        eta = elapsed / done * (self.total - self.n) if done > 0 else float("nan")
        when = (
            tqdm.format_interval(elapsed) + "<" + (tqdm.format_interval(eta) if math.isfinite(eta) else "?")
        )
        line = f"step {self.n}/{self.total} [{when}]"
        summary = format_metrics(metrics)
        line += f" | {summary}" if summary else ""
        tqdm.write(line, file=self.file)
        self.file.flush()  # torchrun pipes stdout: a crash must not eat the last lines
        self._bar.update(1)
        return line

    def close(self) -> None:
        self._bar.close()


# ---------------------------------------------------------------------------------------------------------
# images


def _font(size: int = 12) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 ships a scalable default font
    except TypeError:
        return ImageFont.load_default()


def _wrap(text: str, font, width: int, max_lines: int) -> list[str]:
    words, lines, cur = text.split(), [], ""
    for w in words:
        cand = f"{cur} {w}".strip()
        if font.getlength(cand) <= width or not cur:
            cur = cand
        else:
            lines.append(cur)
            cur = w
    if cur:
        lines.append(cur)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1].rstrip() + "…"
    # A single word wider than the cell: cut it by characters.
    out = []
    for line in lines:
        while font.getlength(line) > width and len(line) > 1:
            line = line[:-2] + "…"
        out.append(line)
    return out


def to_uint8_hwc(images: Any) -> np.ndarray:
    """uint8 [B, H, W, 3] numpy from a numpy array or torch tensor of that layout; videos [B, F, H, W, C] become
    filmstrips of 4 evenly spaced frames (first to last) side by side."""
    if hasattr(images, "detach"):
        images = images.detach().cpu().numpy()
    images = np.asarray(images)
    if images.ndim == 5:
        keep = np.linspace(0, images.shape[1] - 1, min(4, images.shape[1])).round().astype(int)
        images = np.concatenate(list(images[:, keep].transpose(1, 0, 2, 3, 4)), axis=2)
    if images.ndim != 4 or images.shape[-1] not in (1, 3, 4) or images.dtype != np.uint8:
        raise ValueError(
            f"images must be uint8 [B, H, W, C] with C in (1, 3, 4); got {images.dtype} {tuple(images.shape)} "
            "(decode() returns this layout)"
        )
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    return images[..., :3]


def image_grid(
    images: Any,
    captions: Sequence[str] | None = None,
    *,
    ncols: int | None = None,
    caption_lines: int = 3,
    font_size: int = 12,
    pad: int = 2,
) -> Image.Image:
    """Tile B images into one RGB picture with each caption (prompt, reward...) under its image.

    Cell (r, c) holds image r*ncols + c at pixel (c*(W+pad), r*(H+cap_h+pad)); the caption band is
    white with black text, `caption_lines` wrapped lines tall (0 or no captions: no band).
    """
    imgs = to_uint8_hwc(images)
    b, h, w, _ = imgs.shape
    if captions is not None and len(captions) != b:
        raise ValueError(f"image_grid: {b} images but {len(captions)} captions; pass one caption per image")
    ncols = ncols or math.ceil(math.sqrt(b))
    nrows = math.ceil(b / ncols)
    font = _font(font_size)
    line_h = font_size + 2
    cap_h = caption_lines * line_h + 4 if captions is not None and caption_lines > 0 else 0
    grid = Image.new("RGB", (ncols * (w + pad) - pad, nrows * (h + cap_h + pad) - pad), "white")
    draw = ImageDraw.Draw(grid)
    for i in range(b):
        x, y = (i % ncols) * (w + pad), (i // ncols) * (h + cap_h + pad)
        grid.paste(Image.fromarray(imgs[i]), (x, y))
        if captions is not None and cap_h:
            for j, line in enumerate(_wrap(str(captions[i]), font, w - 4, caption_lines)):
                draw.text((x + 2, y + h + 2 + j * line_h), line, fill="black", font=font)
    return grid


def save_image_grid(
    path: str | os.PathLike, images: Any, captions: Sequence[str] | None = None, **kw
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, captions, **kw).save(path)
    return path


# ---------------------------------------------------------------------------------------------------------
# reward curve


def curve_figure(
    series: Mapping[str, tuple[Sequence[float], Sequence[float | None]]],
    *,
    xlabel: str = "step",
    ylabel: str = "reward",
    title: str | None = None,
):
    """A matplotlib Figure of named (steps, values) line series; None / non-finite values are gaps.

    A bare `Figure` on the Agg canvas, no pyplot: no global state, no display needed, safe off the main
    thread. The legend sits right of the axes, never over the data.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7.5, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, (xs, ys) in series.items():
        y = np.array([np.nan if v is None else float(v) for v in ys], dtype=np.float64)
        y[~np.isfinite(y)] = np.nan
        ax.plot(np.asarray(xs, dtype=np.float64), y, marker="o", markersize=3, linewidth=1.5, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))  # steps are integers
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)
    return fig


def plot_curves(
    path: str | os.PathLike,
    series: Mapping[str, tuple[Sequence[float], Sequence[float | None]]],
    **kw: Any,
) -> Path:
    """`curve_figure(series, **kw)` saved as a PNG at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    curve_figure(series, **kw).savefig(path, dpi=100)
    return path


def parse_row(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl line as its row, or None when it is not a JSON object (partial, garbage, a bare value)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl written by `Logger.log` (each has "step").

    A line that is not a JSON object (a run killed mid-write leaves a partial last line; a hand edit may leave
    a bare value such as `42`) is skipped with a warning naming it.
    """
    p = Path(path)
    if not p.is_file():
        return []
    rows, bad = [], []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = parse_row(line)
        if row is not None:
            rows.append(row)
        else:
            bad.append(i)
    if bad:
        warnings.warn(
            f"{p}: skipped {len(bad)} line(s) that are not a JSON object (line {', '.join(map(str, bad[:5]))}); "
            "a run killed mid-write leaves such a partial row",
            stacklevel=2,
        )
    return rows


def reward_curve_series(
    rows: Sequence[Mapping[str, Any]], *, train_key: str = "reward/mean", val_key: str = "val/reward_mean"
) -> dict[str, tuple[list[int], list[float | None]]]:
    """{"train (<train_key>)": (steps, values), "held-out (<val_key>)": (steps, values)} from logged rows."""
    series = {}
    for name, key in ((f"train ({train_key})", train_key), (f"held-out ({val_key})", val_key)):
        # A resumed run re-logs the steps after its checkpoint: the later row of a step wins.
        by_step = {r["step"]: r[key] for r in rows if key in r and r.get("step") is not None}
        xs = sorted(by_step)
        series[name] = (xs, [by_step[x] for x in xs])
    return series


def plot_reward_curve(
    path: str | os.PathLike,
    rows: Sequence[Mapping[str, Any]],
    *,
    train_key: str = "reward/mean",
    val_key: str = "val/reward_mean",
) -> Path:
    """Train and held-out reward vs step from logged metric rows, as a PNG."""
    series = reward_curve_series(rows, train_key=train_key, val_key=val_key)
    return plot_curves(path, series, ylabel="reward")


# ---------------------------------------------------------------------------------------------------------
# loggers


def plain(obj: Any) -> Any:
    """A dataclass as its dict (nested), anything else as it is: the form configs are written in."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def resolve_wandb_mode(requested: str) -> Literal["online", "offline", "disabled"]:
    """'online' | 'offline' | 'disabled'. 'online' without credentials becomes 'offline' (with a note)."""
    if requested not in ("online", "offline", "disabled"):
        raise ValueError(f"run.wandb must be 'online', 'offline' or 'disabled', got {requested!r}")
    if requested == "online" and not os.environ.get("WANDB_API_KEY"):
        netrc = Path.home() / ".netrc"
        if not (netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")):
            print0("wandb: no WANDB_API_KEY / login; logging offline (upload later with `wandb sync`)")
            return "offline"
    return requested


class NullLogger:
    """Same calls as `Logger`, does nothing (non-zero ranks, tests)."""

    run_dir: Path | None = None

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        pass

    def log_images(self, key: str, images: Any, captions: Sequence[str] | None = None, *, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class Logger:
    """Disk logging of a run (metrics.jsonl, images/<key>_<step>.png, reward_curve.png) mirrored to wandb.

    wandb_mode "disabled" keeps only the disk part. Call shape follows wandb: log(dict, step), finish().
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        project: str = "fgrpo",
        name: str | None = None,
        config: Any = None,
        wandb_mode: str = "offline",
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        # A killed run may have left a partial last row; a resumed run must not glue its first row onto it.
        partial = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
        self._metrics = open(path, "a")  # noqa: SIM115 - closed in finish()
        if partial:
            self._metrics.write("\n")
        self._warned_nonfinite: set[str] = set()
        self.wandb_run = None
        mode = resolve_wandb_mode(wandb_mode)
        if mode != "disabled":
            import wandb

            self.wandb_run = wandb.init(
                project=project,
                name=name,
                config=json.loads(json.dumps(plain(config), default=str)) if config is not None else None,
                dir=str(self.run_dir),
                mode=mode,
                reinit="create_new",
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            )

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Append one row to metrics.jsonl (strict JSON: a NaN/inf metric is written as null and named in
        the row's "nonfinite" list) and to wandb (which takes NaN as is)."""
        row, nonfinite = json_row(metrics)
        row = {"step": step, "time": time.time(), **row}
        if nonfinite:
            row["nonfinite"] = nonfinite
            new = [k for k in nonfinite if k not in self._warned_nonfinite]
            if new:
                print0(
                    f"metrics: {', '.join(new)} not finite at step {step} (written as null; later steps "
                    "list such keys under 'nonfinite' in metrics.jsonl)"
                )
                self._warned_nonfinite.update(new)
        self._metrics.write(json.dumps(row, allow_nan=False, default=str) + "\n")
        self._metrics.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(dict(metrics), step=step)

    def log_images(self, key: str, images: Any, captions: Sequence[str] | None = None, *, step: int) -> None:
        grid = image_grid(images, captions)
        path = self.run_dir / "images" / f"{key.replace('/', '_')}_{step:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        grid.save(path)
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.log({f"images/{key}": wandb.Image(grid)}, step=step)

    def finish(self) -> None:
        if not self._metrics.closed:
            self._metrics.close()
        rows = read_metrics(self.run_dir / "metrics.jsonl")  # the whole run, also across resumes
        if rows:
            plot_reward_curve(self.run_dir / "reward_curve.png", rows)
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _scalar(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
        return v.item()
    return v


def _finite_or_none(v: Any) -> tuple[Any, bool]:
    """(v with every non-finite float inside it replaced by None, whether there was one)."""
    v = _scalar(v)
    if isinstance(v, float):
        return (v, False) if math.isfinite(v) else (None, True)
    if isinstance(v, Mapping):
        items = {k: _finite_or_none(x) for k, x in v.items()}
        return {k: x for k, (x, _) in items.items()}, any(bad for _, bad in items.values())
    if isinstance(v, list | tuple):
        items = [_finite_or_none(x) for x in v]
        return [x for x, _ in items], any(bad for _, bad in items)
    return v, False


def json_row(metrics: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(metrics as strict-JSON values, names of the metrics that held a NaN or an infinity, now None)."""
    row, nonfinite = {}, []
    for k, v in metrics.items():
        row[k], bad = _finite_or_none(v)
        if bad:
            nonfinite.append(k)
    return row, nonfinite
