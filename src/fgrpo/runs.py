"""The run directory `out_dir/exp_name`: one writer at a time, never two runs mixed, a config record that
matches the run.

- A lock (`flock` on `.lock`, released by the kernel when the process dies) refuses a second writer.
- A fresh run refuses a directory that already holds a run, naming `--run.resume auto` (continue it) and
  `--run.overwrite` (move it aside to `<exp_name>.old-<time>`; nothing is deleted).
- A resumed run compares the recorded `config.json` with the current config: fields that only steer the
  run's bookkeeping may change (and are printed), any other difference is refused with the list of fields,
  so `config.json` always describes the run that wrote the checkpoints.
- `--run.resume auto` picks the newest checkpoint that verifies, says in one line when there is none.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from fgrpo import checkpoint, parallel
from fgrpo import logging as flog
from fgrpo.errors import FgrpoError

# Fields that may differ between a run and its resume: they change what is logged or saved, or how fast the
# reward is computed, not what is trained. Prefix matches ("run." covers every RunConfig field).
RESUMABLE_FIELDS = (
    "run.",
    "num_steps",
    "device",
    "reward.workers",
    "reward.val_workers",
    "reward.url",
    "data.val_num_prompts",
)


_HELD: dict[str, int] = {}  # resolved run dir -> this process's lock fd


class RunDirError(FgrpoError, RuntimeError):
    """The run directory cannot be used as asked (in use, already holds a run, config changed on resume)."""


def flat_config(cfg: Any) -> dict[str, Any]:
    """{'grpo.clip_range': 1e-05, ...}: a config dataclass (or its config.json dict) as JSON-plain values keyed
    by dotted field path."""
    plain = cfg if isinstance(cfg, dict) else json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    out: dict[str, Any] = {}

    def walk(prefix: str, d: dict[str, Any]) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            else:
                out[f"{prefix}{k}"] = v

    walk("", plain)
    return out


def config_changes(recorded: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (recorded, current)} for every dotted field that differs (missing on one side counts)."""
    keys = sorted(set(recorded) | set(current))
    return {k: (recorded.get(k), current.get(k)) for k in keys if recorded.get(k) != current.get(k)}


def _resumable(field: str) -> bool:
    return any(field == f or (f.endswith(".") and field.startswith(f)) for f in RESUMABLE_FIELDS)


class RunDir:
    """The directory of one run, locked for this process while open (rank 0 only; other ranks just read)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock_fd: int | None = None

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def holds_a_run(self) -> list[str]:
        """What in the directory belongs to an earlier run (empty: free to start fresh)."""
        found = []
        if checkpoint.list_checkpoints(self.checkpoints):
            found.append(f"{len(checkpoint.list_checkpoints(self.checkpoints))} checkpoint(s)")
        for name in ("metrics.jsonl", "config.json", "lora"):
            if (self.path / name).exists():
                found.append(name)
        return found

    def lock(self) -> None:
        """Take the directory for this process or raise RunDirError naming the holder.

        A process that already holds it (a `train()` that raised, called again in the same interpreter) takes
        it over: its own lock would otherwise refuse it until exit.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        key = str(self.path.resolve())
        if key in _HELD:
            self._lock_fd = _HELD[key]
            return
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirError(
                f"run directory {self.path} is in use by {holder}; wait for it, or give this run another "
                "--exp-name (or --run.out-dir)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        self._lock_fd = _HELD[key] = fd

    def drop_metrics_from(self, step: int) -> None:
        """Remove metrics.jsonl rows of steps >= `step` (a resume redoes them; a fresh start at 0 keeps none)."""
        path = self.path / "metrics.jsonl"
        if not path.is_file():
            return
        keep = [r for r in flog.read_metrics(path) if r.get("step", 0) < step]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in keep))
        os.replace(tmp, path)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            _HELD.pop(str(self.path.resolve()), None)
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def move_aside(self) -> Path:
        """Rename the whole directory to `<name>.old-<time>`; returns the new path."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest = self.path.with_name(f"{self.path.name}.old-{stamp}")
        n = 1
        while dest.exists():
            dest, n = self.path.with_name(f"{self.path.name}.old-{stamp}-{n}"), n + 1
        os.rename(self.path, dest)
        return dest

    def start(self, cfg: Any, *, is_main: bool, say=print) -> Path | None:
        """Check and take the directory for the run `cfg` asks for; returns the checkpoint to resume or None.

        Rank 0 locks, checks and chooses the checkpoint; every rank gets its answer (or its error), so no rank
        goes on alone and the checkpoint files are verified once.
        """
        answer: tuple[str | None, str | None] = (None, None)  # (error, checkpoint path)
        error: Exception | None = None
        if is_main:
            try:
                path = self._start_main(cfg, say)
                answer = (None, str(path) if path is not None else None)
            except (RunDirError, checkpoint.CheckpointError, FileNotFoundError, ValueError) as e:
                answer = (f"{type(e).__name__}: {e}", None)
                error = e
        if parallel.initialized() and parallel.world_size() > 1:
            box = [answer]
            torch.distributed.broadcast_object_list(box, src=0)
            answer = box[0]
        if answer[0] is not None:
            if error is not None:
                raise error
            raise RunDirError(f"rank 0 refused the run directory: {answer[0]}")
        return Path(answer[1]) if answer[1] is not None else None

    def _start_main(self, cfg: Any, say) -> Path | None:
        resume, overwrite = cfg.run.resume, cfg.run.overwrite
        if not resume:
            used = self.holds_a_run() if self.path.exists() else []
            if used and not overwrite:
                raise RunDirError(
                    f"{self.path} already holds a run ({', '.join(used)}); continue it with --run.resume auto, "
                    f"or start over with --run.overwrite (moves it to {self.path.name}.old-<time>)"
                )
            if used:
                self.lock()  # held while the directory moves: the lock file moves with it
                moved = self.move_aside()
                self.unlock()
                say(f"moved the earlier run to {moved}")
        self.lock()
        if not resume:
            return None
        if (self.path / "config.json").is_file():
            self.check_config(cfg, say=say)
        path = checkpoint.latest_valid(self.checkpoints) if resume == "auto" else checkpoint.resolve(resume)
        if path is None:
            say(f"--run.resume auto: no complete checkpoint under {self.checkpoints}; starting from step 0")
        self.set_aside_checkpoints_after(path)
        return path

    def set_aside_checkpoints_after(self, resumed: Path | None) -> None:
        """Move checkpoints newer than the resumed one (damaged ones skipped by latest_valid, or a resume from an
        older step) to `stale_checkpoints/`: the run redoes their steps, and keep_last must not prefer them."""
        step = int(resumed.name.removeprefix("step_")) if resumed is not None else -1
        for s, p in checkpoint.list_checkpoints(self.checkpoints):
            if s > step:
                dest = self.path / "stale_checkpoints" / f"{p.name}.{time.strftime('%Y%m%d-%H%M%S')}"
                dest.parent.mkdir(exist_ok=True)
                os.rename(p, dest)
                warnings.warn(f"resume: moved {p} (after the resumed step) to {dest}", stacklevel=2)

    def check_config(self, cfg: Any, *, say=print) -> None:
        """Refuse a resume whose config differs from the recorded one in a field that changes the training."""
        recorded = json.loads((self.path / "config.json").read_text())
        changes = config_changes(flat_config(recorded), flat_config(cfg))
        changes.pop("run.resume", None)
        refused = {k: v for k, v in changes.items() if not _resumable(k)}
        o = cfg.optim
        if "num_steps" in changes and o.schedule != "constant" and o.decay_steps == 0:
            refused["num_steps"] = changes["num_steps"]  # the decay spans the run: its lr would change
        if refused:
            listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in refused.items())
            raise RunDirError(
                f"--run.resume: the config differs from the run's {self.path / 'config.json'} in {listed}; "
                "resume with the recorded values (with a decaying lr, a longer run needs --optim.decay-steps as "
                "recorded), or start a new run (another --exp-name, or --run.overwrite)"
            )
        for k, (a, b) in changes.items():
            say(f"resume: {k} {a!r} -> {b!r}")


REWARD_RECORD = "reward.json"


def _same_reward(spec: str) -> str:
    """A reward spec in one spelling: JSON re-dumped with sorted keys, {"name": X} alone as X."""
    try:
        value = json.loads(spec)
    except ValueError:
        return spec.strip()
    if isinstance(value, dict) and set(value) == {"name"}:
        return str(value["name"])
    return json.dumps(value, sort_keys=True)


def check_reward(run_path: Path, reward: object, *, resumed: bool, write: bool, say=print) -> None:
    """Record the reward a run trains on in `reward.json` when it starts; refuse a resume whose reward differs.

    `reward` is the spec a reward service names in its `/health` (with `--reward.url`, which may change on
    resume: another port, another host) or the local `reward.name`, so a resume against a service that serves
    another reward is refused naming both. `write`: this process records it (rank 0; every rank compares).
    """
    path = run_path / REWARD_RECORD
    if not isinstance(reward, str):
        say(
            f"the reward service names no reward in /health; {path} is not written and a resume cannot check it"
        )
        return
    if resumed and path.is_file():
        try:
            recorded = json.loads(path.read_text())["reward"]
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise RunDirError(
                f"{path} is not a reward record ({type(e).__name__}: {e}); write it as "
                '{"reward": "<the spec the run trained on>"} or remove it to record the current one'
            ) from None
        if _same_reward(str(recorded)) != _same_reward(reward):
            raise RunDirError(
                f"--run.resume: the run trained on reward {recorded!r} (recorded in {path}), this resume would "
                f"train on {reward!r}; point --reward.url at a service that serves {recorded!r}, or start a new run"
            )
        return
    if write:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"reward": reward}) + "\n")
        os.replace(tmp, path)
