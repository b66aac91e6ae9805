"""Run logging: wandb (or nothing) behind one call shape, console progress, image grids, reward curves.

`Logger` writes every run to disk itself (metrics.jsonl, image grids as PNG, a reward-curve PNG at
`finish`) and mirrors it to wandb when a wandb mode other than "disabled" is asked for; without a
WANDB_API_KEY an "online" request becomes "offline" (a local run dir `wandb sync` can upload later).
`NullLogger` takes the same calls and does nothing: non-zero ranks get it, so the loop never branches.

The module is named like the stdlib's `logging` on purpose (STYLE's file map); absolute imports keep
the two apart (`from fgrpo import logging as flog`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# Phases of one training step, in the order the console shows them.
PHASES = ("rollout", "reward", "train", "sync", "val", "checkpoint")


def rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0"))


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
    default): without it an asynchronous launch bills its kernels to whichever phase syncs next.
    """

    def __init__(self, *, sync_cuda: bool = True, clock=time.perf_counter):
        self._clock = clock
        self._sync_cuda = sync_cuda
        self._start = clock()
        self.times: dict[str, float] = {}

    def _sync(self) -> None:
        if not self._sync_cuda:
            return
        torch = sys.modules.get("torch")  # never import torch just to time a CPU-only run
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self._sync()
        t0 = self._clock()
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


def progress_line(step: int, num_steps: int, metrics: Mapping[str, float], *, width: int = 20) -> str:
    """One console line: bar, reward mean±std, the phase time split, images/s and the GRPO health stats.

    `step` is 0-based (the step just finished); metrics use the loop's keys (reward/mean, time/rollout...).
    """
    done = min(step + 1, num_steps) if num_steps > 0 else 0
    filled = round(width * done / num_steps) if num_steps > 0 else 0
    parts = [f"[{'#' * filled}{'.' * (width - filled)}] {done}/{num_steps}"]
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
    """uint8 [B, H, W, 3] numpy from a numpy array or torch tensor of that layout."""
    if hasattr(images, "detach"):
        images = images.detach().cpu().numpy()
    images = np.asarray(images)
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
        if cap_h:
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
# reward curve (PIL only: no plotting dependency for one line chart)

_COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))


def plot_curves(
    path: str | os.PathLike,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str = "reward",
    size: tuple[int, int] = (640, 400),
) -> Path:
    """Line chart of named (steps, values) series, PNG. Series i is drawn in `_COLORS[i]`."""
    W, H = size
    left, right, top, bottom = 60, 16, 28, 36
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    font = _font(11)
    pts = [
        (float(x), float(y)) for xs, ys in series.values() for x, y in zip(xs, ys) if math.isfinite(float(y))
    ]
    d.text((left, 8), title, fill="black", font=font)
    if pts:
        x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
        y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
        if x1 == x0:
            x0, x1 = x0 - 1, x1 + 1
        if y1 == y0:
            y0, y1 = y0 - 0.5, y1 + 0.5
        dy = 0.05 * (y1 - y0)
        y0, y1 = y0 - dy, y1 + dy

        def px(x: float, y: float) -> tuple[float, float]:
            return (
                left + (x - x0) / (x1 - x0) * (W - left - right),
                H - bottom - (y - y0) / (y1 - y0) * (H - top - bottom),
            )

        for k in range(5):  # grid lines and tick labels
            yv = y0 + k * (y1 - y0) / 4
            _, yy = px(x0, yv)
            d.line([(left, yy), (W - right, yy)], fill=(225, 225, 225))
            d.text((4, yy - 6), _fmt(yv), fill="black", font=font)
            xv = x0 + k * (x1 - x0) / 4
            xx, _ = px(xv, y0)
            d.text((xx - 8, H - bottom + 6), f"{xv:g}", fill="black", font=font)
        d.rectangle([left, top, W - right, H - bottom], outline="black")
        for i, (name, (xs, ys)) in enumerate(series.items()):
            color = _COLORS[i % len(_COLORS)]
            line = [px(float(x), float(y)) for x, y in zip(xs, ys) if math.isfinite(float(y))]
            if len(line) > 1:
                d.line(line, fill=color, width=2)
            for cx, cy in line:
                d.ellipse([cx - 2, cy - 2, cx + 2, cy + 2], fill=color)
            lx = W - right - 150
            d.line([(lx, top + 10 + 14 * i), (lx + 20, top + 10 + 14 * i)], fill=color, width=2)
            d.text((lx + 24, top + 4 + 14 * i), name, fill="black", font=font)
    else:
        d.text((left, H // 2), "no data yet", fill="black", font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl written by `Logger.log` (each has "step")."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def plot_reward_curve(
    path: str | os.PathLike,
    rows: Sequence[Mapping[str, Any]],
    *,
    train_key: str = "reward/mean",
    val_key: str = "val/reward_mean",
) -> Path:
    """Train and held-out reward vs step from logged metric rows, as a PNG."""
    series = {}
    for name, key in (("train", train_key), ("held-out", val_key)):
        # A resumed run re-logs the steps after its checkpoint: the later row of a step wins.
        by_step = {r["step"]: r[key] for r in rows if key in r and r.get("step") is not None}
        xs = sorted(by_step)
        series[name] = (xs, [by_step[x] for x in xs])
    return plot_curves(path, series, title=f"{train_key} / {val_key} vs step")


# ---------------------------------------------------------------------------------------------------------
# run metadata


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def save_run_metadata(
    run_dir: str | os.PathLike, config: Any, experiment_source: str | os.PathLike | None = None
) -> Path:
    """config.json (+ config.yaml), the experiment file's source, and where/when/what ran, into run_dir.

    `experiment_source` is the source text (written as experiment.py) or a path to the file (copied under
    its own name). Non-JSON values in the config (paths, enums) are written as strings.
    """
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(json.dumps(_to_plain(config), default=str))
    (run / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    try:
        import yaml

        (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    except ImportError:
        pass
    if isinstance(experiment_source, Path) or (
        isinstance(experiment_source, str)
        and "\n" not in experiment_source
        and os.path.isfile(experiment_source)
    ):
        shutil.copyfile(experiment_source, run / Path(experiment_source).name)
    elif experiment_source is not None:
        (run / "experiment.py").write_text(str(experiment_source))
    env = {"argv": sys.argv, "python": sys.version.split()[0], "host": platform.node(), "time": time.time()}
    try:
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
    (run / "run_meta.json").write_text(json.dumps(env, indent=2) + "\n")
    return run


# ---------------------------------------------------------------------------------------------------------
# loggers


def resolve_wandb_mode(requested: str) -> str:
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
        self._metrics = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in finish()
        self.wandb_run = None
        mode = resolve_wandb_mode(wandb_mode)
        if mode != "disabled":
            import wandb

            self.wandb_run = wandb.init(
                project=project,
                name=name,
                config=json.loads(json.dumps(_to_plain(config), default=str)) if config is not None else None,
                dir=str(self.run_dir),
                mode=mode,
                reinit="create_new",
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            )

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        row = {"step": step, "time": time.time(), **{k: _scalar(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(row, default=str) + "\n")
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


def make_logger(
    cfg: Any,
    run_dir: str | os.PathLike,
    *,
    enabled: bool = True,
    experiment_source: str | os.PathLike | None = None,
) -> Logger | NullLogger:
    """The loop's logger: rank 0 saves the run metadata and gets a `Logger`; other ranks a `NullLogger`.

    Reads `cfg.exp_name` and `cfg.run.wandb` ('online' | 'offline' | 'disabled').
    """
    if not enabled:
        return NullLogger()
    save_run_metadata(run_dir, cfg, experiment_source)
    return Logger(run_dir, name=getattr(cfg, "exp_name", None), config=cfg, wandb_mode=cfg.run.wandb)
