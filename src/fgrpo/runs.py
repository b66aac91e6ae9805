"""The run directory `out_dir/exp_name`: one writer at a time, never two runs mixed, a config record that
matches the run.

- A lock (`flock` on `.lock`, released by the kernel when the process dies) refuses a second writer.
- A fresh run refuses a directory that already holds a run, naming `--run.resume auto` (continue it) and
  `--run.overwrite` (move it aside to `<exp_name>.old-<time>`; nothing is deleted). The move is refused while
  a run directory below it is locked by a live run, which would otherwise go on writing into the moved tree.
- A resumed run compares the recorded `config.json` with the current config: fields that only steer the
  run's bookkeeping may change (and are printed), any other difference is refused with the list of fields,
  so `config.json` always describes the run that wrote the checkpoints. `config.json` also records the sha256
  of each prompt file (`data_files`); a resume refuses a file that changed. A directory with checkpoints but
  no `config.json` cannot be checked and is refused.
- `--run.resume auto` picks the newest checkpoint that verifies, says in one line when there is none. A
  checkpoint of another run directory is refused into a used one unless `--run.resume-from-other` says so.
- `save_run_metadata` writes what a run is (config.json and config.yaml, the experiment file, run_meta.json);
  `make_logger` does it on rank 0 as it opens the run's logger.
- Nothing a resume replaces is deleted: later checkpoints move to `stale_checkpoints/`, the metrics rows of
  the steps it redoes to `metrics.superseded.jsonl` (each tagged with when and why).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fgrpo import checkpoint, files, parallel
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


SUPERSEDED = "metrics.superseded.jsonl"  # metrics rows a resume redid, appended, never deleted
DATA_FILES = "data_files"  # config.json's key of the prompt files' sha256, beside the config's own fields


class RunDirError(FgrpoError, RuntimeError):
    """The run directory cannot be used as asked (in use, already holds a run, config changed on resume)."""


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def data_file_hashes(cfg: Any) -> dict[str, dict[str, str]]:
    """{field: {"path": ..., "sha256": ...}} of the prompt files `cfg.data` names.

    The bundled 'textbed:' word lists are skipped: they belong to the installed package, not to the run's data.
    """
    out = {}
    for name in ("train_prompts", "val_prompts"):
        value = str(getattr(cfg.data, name))
        if not value.startswith("textbed:") and Path(value).is_file():
            out[f"data.{name}"] = {"path": value, "sha256": file_sha256(Path(value))}
    return out


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
        # Set by `start`: the prompt files' hashes to record (rank 0), and whether metrics.jsonl already holds
        # the final validation of a run of cfg.num_steps steps (every rank).
        self.data_files: dict[str, dict[str, str]] = {}
        self.final_validation_logged = False
        self.resumed_from: Path | None = None

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def config_record(self) -> dict[str, Any]:
        """What config.json records beside the config (rank 0, after `start`): the prompt files' sha256."""
        return {DATA_FILES: self.data_files}

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
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            key = str(self.path.resolve())
            if key in _HELD:
                self._lock_fd = _HELD[key]
                return
            fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(
                f"--run.out-dir {str(self.path.parent)!r}: cannot create or write the run directory {self.path} "
                f"({e.strerror or e}); give --run.out-dir a writable directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirError(
                f"run directory {self.path} is in use by {holder}; wait for it, or give this run another "
                "--exp-name (or --run.out-dir)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        self._lock_fd = _HELD[key] = fd

    def supersede_metrics_from(self, step: int) -> None:
        """Move metrics.jsonl rows of steps >= `step` (a resume redoes them) to metrics.superseded.jsonl.

        Each moved row gets `"superseded": {"time", "why"}` (why names the checkpoint `start` chose); a line that
        is not a JSON object (a partial row of a killed run) moves as `{"superseded": ..., "line": <its text>}`.
        The side file is appended and synced before metrics.jsonl is replaced, so a crash between the two
        duplicates rows there but loses none.
        """
        path = self.path / "metrics.jsonl"
        if not path.is_file():
            return
        keep, moved = [], []
        why = f"resumed from {self.resumed_from}" if self.resumed_from else "restarted from step 0"
        tag = {"time": time.time(), "why": f"{why}: step {step} on is redone"}
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = flog.parse_row(line)
            if row is None:
                moved.append({"superseded": tag, "line": line})
            elif isinstance(row.get("step", 0), int) and row.get("step", 0) < step:
                keep.append(line + "\n")
            else:
                moved.append({**row, "superseded": tag})
        if not moved:
            return
        with open(self.path / SUPERSEDED, "a") as f:
            f.write("".join(json.dumps(r, allow_nan=False, default=str) + "\n" for r in moved))
            f.flush()
            os.fsync(f.fileno())
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
        warnings.warn(
            f"resume: moved {len(moved)} metrics row(s) of step >= {step} to {path.parent / SUPERSEDED}",
            stacklevel=2,
        )

    def unlock(self) -> None:
        if self._lock_fd is not None:
            _HELD.pop(str(self.path.resolve()), None)
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def _lock_runs_below(self) -> list[int]:
        """Lock every run directory below this one (its `.lock`), so none starts while the tree moves; raise
        RunDirError naming one that a live run holds (it would go on writing into the moved tree)."""
        fds: list[int] = []
        try:
            for root, _, files in os.walk(self.path):
                if ".lock" not in files or Path(root) == self.path:
                    continue
                fd = os.open(Path(root) / ".lock", os.O_RDONLY)
                fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise RunDirError(
                        f"--run.overwrite: {root} inside {self.path} is a live run ({_holder(fd)}); moving the "
                        "tree would split its files; wait for it to end, or give this run another --exp-name"
                    ) from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def move_aside(self) -> Path:
        """Rename the whole directory to `<name>.old-<time>`; returns the new path.

        Refused (RunDirError) while a run directory nested below it is locked by a live run.
        """
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest = self.path.with_name(f"{self.path.name}.old-{stamp}")
        n = 1
        while dest.exists():
            dest, n = self.path.with_name(f"{self.path.name}.old-{stamp}-{n}"), n + 1
        held = self._lock_runs_below()
        try:
            os.rename(self.path, dest)
        finally:
            for fd in held:
                os.close(fd)
        return dest

    def start(self, cfg: Any, *, is_main: bool, say=print) -> Path | None:
        """Check and take the directory for the run `cfg` asks for; returns the checkpoint to resume or None.

        Rank 0 locks, checks and chooses the checkpoint; every rank gets its answer (or its error), so no rank
        goes on alone and the checkpoint files are verified once.
        """
        answer: tuple[str | None, str | None, bool] = (
            None,
            None,
            False,
        )  # (error, checkpoint, final val logged)
        error: Exception | None = None
        if is_main:
            try:
                path = self._start_main(cfg, say)
                answer = (None, str(path) if path is not None else None, self.final_validation_logged)
            except (RunDirError, files.CheckpointError, FileNotFoundError, ValueError) as e:
                answer = (f"{type(e).__name__}: {e}", None, False)
                error = e
        if parallel.initialized() and parallel.world_size() > 1:
            box = [answer]
            torch.distributed.broadcast_object_list(box, src=0)
            answer = box[0]
        if answer[0] is not None:
            if error is not None:
                raise error
            raise RunDirError(f"rank 0 refused the run directory: {answer[0]}")
        self.final_validation_logged = answer[2]
        self.resumed_from = Path(answer[1]) if answer[1] is not None else None
        return self.resumed_from

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
                try:
                    moved = self.move_aside()
                finally:
                    self.unlock()
                say(f"moved the earlier run to {moved}")
        self.lock()
        self.data_files = data_file_hashes(cfg)
        if not resume:
            return None
        used = self.holds_a_run()
        config = self.path / "config.json"
        if config.is_file():
            self.check_config(cfg, say=say)
        elif checkpoint.list_checkpoints(self.checkpoints):
            # Without the record nothing says which config trained the checkpoints, and the new config.json
            # would claim values the earlier steps never used.
            raise RunDirError(
                f"--run.resume: {config} is missing, so the checkpoints under {self.checkpoints} cannot be "
                "checked against this config; restore it (config.yaml beside it holds the same values), or "
                "start a new run (another --exp-name, or --run.overwrite)"
            )
        other = False
        if resume == "auto":
            path = checkpoint.latest_valid(self.checkpoints)
        else:
            path = checkpoint.resolve(resume)
            other = self.path.resolve() not in path.resolve().parents
            if other and used and not cfg.run.resume_from_other:
                raise RunDirError(
                    f"--run.resume {resume}: that checkpoint belongs to another run directory than {self.path}, "
                    f"which holds a run ({', '.join(used)}); pass --run.resume-from-other to continue this run "
                    "from it (this run's later checkpoints and metrics rows are moved aside, not deleted), or "
                    "resume into a new --exp-name"
                )
        if path is None:
            say(f"--run.resume auto: no complete checkpoint under {self.checkpoints}; starting from step 0")
        # Another run's checkpoint replaces this run's of the same step too: `auto` must never pick this one's.
        self.set_aside_checkpoints_after(path, including_its_step=other)
        self.final_validation_logged = any(
            r.get("step") == cfg.num_steps and "val/reward_mean" in r
            for r in flog.read_metrics(self.path / "metrics.jsonl")
        )
        return path

    def set_aside_checkpoints_after(self, resumed: Path | None, *, including_its_step: bool = False) -> None:
        """Move checkpoints newer than the resumed one (damaged ones skipped by latest_valid, or a resume from an
        older step) to `stale_checkpoints/`: the run redoes their steps, and keep_last must not prefer them.
        `including_its_step`: also the one of the resumed step (the resumed checkpoint is another run's)."""
        step = int(resumed.name.removeprefix("step_")) if resumed is not None else -1
        for s, p in checkpoint.list_checkpoints(self.checkpoints):
            if s > step or (including_its_step and s == step):
                dest = self.path / "stale_checkpoints" / f"{p.name}.{time.strftime('%Y%m%d-%H%M%S')}"
                dest.parent.mkdir(exist_ok=True)
                os.rename(p, dest)
                warnings.warn(f"resume: moved {p} (after the resumed step) to {dest}", stacklevel=2)

    def check_config(self, cfg: Any, *, say=print) -> None:
        """Refuse a resume whose config differs from the recorded one in a field that changes the training, or
        whose prompt files changed since config.json recorded their sha256."""
        path = self.path / "config.json"
        try:
            recorded = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RunDirError(
                f"--run.resume: {path} is not valid JSON ({e}); restore it (config.yaml beside it holds the "
                "same values), or start a new run (another --exp-name, or --run.overwrite)"
            ) from None
        if not isinstance(recorded, dict):
            raise RunDirError(
                f"--run.resume: {path} holds a {type(recorded).__name__}, not a config object; restore it "
                "(config.yaml beside it holds the same values), or start a new run (another --exp-name)"
            )
        files = recorded.pop(DATA_FILES, None)
        changes = config_changes(flat_config(recorded), flat_config(cfg))
        changes.pop("run.resume", None)
        refused = {k: v for k, v in changes.items() if not _resumable(k)}
        o = cfg.optim
        if "num_steps" in changes and o.schedule != "constant" and o.decay_steps == 0:
            refused["num_steps"] = changes["num_steps"]  # the decay spans the run: its lr would change
        if refused:
            listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in refused.items())
            raise RunDirError(
                f"--run.resume: the config differs from the run's {path} in {listed}; "
                "resume with the recorded values (with a decaying lr, a longer run needs --optim.decay-steps as "
                "recorded), or start a new run (another --exp-name, or --run.overwrite)"
            )
        self._check_data_files(files, cfg, path, say)
        for k, (a, b) in changes.items():
            say(f"resume: {k} {a!r} -> {b!r}")

    def _check_data_files(self, recorded: Any, cfg: Any, config: Path, say) -> None:
        if not isinstance(recorded, dict):
            say(
                f"resume: {config} records no prompt-file sha256 (written by an older fgrpo); files not checked"
            )
            return
        for field, rec in recorded.items():
            p = Path(rec["path"])
            now = file_sha256(p) if p.is_file() else "(missing)"
            if now != rec["sha256"]:
                raise RunDirError(
                    f"--run.resume: {field} file {p} changed since the run recorded it (sha256 {rec['sha256'][:12]} "
                    f"in {config}, now {now[:12]}); restore the file the run trained on, or start a new run on "
                    "the new data (another --exp-name, or --run.overwrite)"
                )


def save_run_metadata(
    run_dir: str | os.PathLike,
    config: Any,
    experiment_source: str | os.PathLike | None = None,
    record: Mapping[str, Any] | None = None,
) -> Path:
    """config.json (+ config.yaml), the experiment file's source, and where/when/what ran, into run_dir.

    `experiment_source` is the source text (written as experiment.py) or a path to the file (copied under
    its own name). Non-JSON values in the config (paths, enums) are written as strings. `record` adds
    top-level keys beside the config's fields (the run directory's `data_files` hashes).
    """
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(json.dumps(flog.plain(config), default=str)) | dict(record or {})
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
    env["torch"] = torch.__version__
    (run / "run_meta.json").write_text(json.dumps(env, indent=2) + "\n")
    return run


def make_logger(
    cfg: Any,
    run_dir: str | os.PathLike,
    *,
    enabled: bool = True,
    experiment_source: str | os.PathLike | None = None,
    record: Mapping[str, Any] | None = None,
) -> flog.Logger | flog.NullLogger:
    """The loop's logger: rank 0 saves the run metadata (`record`: extra keys of config.json) and gets a
    `Logger`; other ranks a `NullLogger`.

    Reads `cfg.exp_name` and `cfg.run.wandb` ('online' | 'offline' | 'disabled').
    """
    if not enabled:
        return flog.NullLogger()
    save_run_metadata(run_dir, cfg, experiment_source, record)
    return flog.Logger(run_dir, name=getattr(cfg, "exp_name", None), config=cfg, wandb_mode=cfg.run.wandb)


def _holder(fd: int) -> str:
    """Who holds a lock file, as its holder wrote it ("pid 123 on host")."""
    return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"


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
