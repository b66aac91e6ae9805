"""A run's checkpoints and exact resume: the trainable state (FSDP2 shards gathered, optimizer state split into
tensors and JSON) written into and read back from step directories in fgrpo.files' format (safetensors + JSON, no
pickle on disk; the LoRA adapter export is fgrpo.models.lora's).

A checkpoint is one directory `<dir>/step_000123/`:
    model.safetensors        trainable parameters only (requires_grad), full (unsharded) tensors
    optimizer.safetensors    optimizer state tensors, key `state/<param fqn>/<name>` (exp_avg, step, ...)
    optimizer.json           param groups (hyper-parameters + param fqns) and non-tensor state
    lr_scheduler.json        `lr_scheduler.state_dict()`
    tensors_rank<i>.safetensors  rank i's own tensors when the caller passes some (an EMA of its shards)
    meta.json                step, world size, the caller's `extra_state`, and the byte size and sha256
                             of every other file (written last)

Everything is written into a hidden temporary sibling `.tmp_step_000123_<pid>`, fsync'ed, then renamed:
a crash leaves either the old set of checkpoints or the new one, never a half directory with a step
name. `latest()` only sees `step_*` directories that contain `meta.json`; `latest_valid()` also checks
every file against meta.json and walks back past damaged ones (a disk that filled up, a copy cut short),
and `load` refuses a damaged checkpoint with an error naming the file. Checkpoints of format 1 (no
checksums) still load, with a warning that they cannot be verified.

Distributed (FSDP2 `fully_shard`, DTensor parameters): tensors are gathered with
`torch.distributed.checkpoint.state_dict` (full state, CPU offload, frozen parameters skipped, so a LoRA
run never gathers the 20B base weights) and written by rank 0 only. Loading assumes every rank can read
the directory (shared or replicated file system).

No RNG state is saved: every random draw of a run comes from a generator seeded by (seed, step, ...)
(fgrpo.rollout.seeds), so a resumed run redraws exactly what the uninterrupted one drew, at any world size.

Differs from flow_grpo/verl-omni: they `torch.save`/`accelerate.save_state` pickles (or DCP shards that
need the same world size to read); we write plain safetensors a human or another tool can open, and
export the LoRA in the layout diffusers' `load_lora_weights` reads.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fgrpo import files
from fgrpo.errors import ConfigError, MissingFileError
from fgrpo.parallel import barrier, initialized, rank, world_size

_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under `ckpt_dir` as (step, path), oldest first. Temp dirs are ignored."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / files.META).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint directory under `ckpt_dir` that has a meta.json (files not checked), or None."""
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def resolve(path: str | os.PathLike) -> Path:
    """A step directory as given, or the newest one that verifies (`latest_valid`) when `path` is its parent."""
    p = Path(path)
    if (p / files.META).is_file():
        return p
    found = latest_valid(p)
    if found is None:
        raise MissingFileError(
            f"checkpoint: no complete checkpoint at {p} (want a step_* dir with meta.json, or its parent)"
        )
    return found


def latest_valid(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint under `ckpt_dir` whose files all verify (see `verify`), or None.

    Walks back from the newest; each checkpoint skipped gets a one-line warning naming it and why.
    """
    for _, p in reversed(list_checkpoints(ckpt_dir)):
        try:
            files.verify(p)
        except files.CheckpointError as e:
            warnings.warn(f"checkpoint: skipping {p}: {str(e).removeprefix('checkpoint: ')}", stacklevel=2)
            continue
        return p
    return None


# ---------------------------------------------------------------------------------------------------------
# state gathering (works on plain modules and on FSDP2 DTensor modules alike)


def _options(**kw: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def _trainable_names(model: nn.Module) -> set[str]:
    """State-dict keys of the requires_grad parameters (wrapper prefixes such as torch.compile's
    `_orig_mod.` removed the way torch.distributed.checkpoint names them)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    names: set[str] = set()
    for n, p in model.named_parameters():
        if p.requires_grad:
            names |= set(_get_fqns(model, n))
    return names


def _gather_model(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if initialized():
        # Collective: every rank must call it; only rank 0 gets tensors back (cpu_offload).
        opts = _options(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    else:
        opts = _options(ignore_frozen_params=True)
    sd = get_model_state_dict(model, options=opts)
    # Persistent buffers (rope tables...) come from the pretrained load, like the frozen weights.
    keep = _trainable_names(model)
    return {k: v for k, v in sd.items() if k in keep and torch.is_tensor(v)}


def _gather_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if initialized():
        opts = _options(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    else:
        opts = _options(ignore_frozen_params=True)
    return get_optimizer_state_dict(model, optimizer, options=opts)


def _fresh_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": {}, "param_groups": groups, "fresh": True}


def _split_optimizer(osd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Nested optimizer state dict (param fqns as keys) -> (tensors, json)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, state in osd.get("state", {}).items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state/{fqn}/{name}"] = value
            else:
                scalars.setdefault(str(fqn), {})[name] = value
    groups = []
    for i, g in enumerate(osd.get("param_groups", [])):
        group = {}
        for k, v in g.items():
            if torch.is_tensor(v):  # e.g. a tensor learning rate
                tensors[f"param_groups/{i}/{k}"] = v
                group[k] = {"__tensor__": f"param_groups/{i}/{k}"}
            else:
                group[k] = v
        groups.append(group)
    js = {"param_groups": groups, "state_scalars": scalars, "fresh": bool(osd.get("fresh", False))}
    return tensors, files.jsonable(js, "optimizer param_groups/state", allow_nan=False)


def _join_optimizer(tensors: dict[str, torch.Tensor], js: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("state/"):
            fqn, name = key[len("state/") :].rsplit("/", 1)
            state.setdefault(fqn, {})[name] = value
    for fqn, d in js.get("state_scalars", {}).items():
        state.setdefault(fqn, {}).update(d)
    groups = []
    for g in js["param_groups"]:
        group = {}
        for k, v in g.items():
            if isinstance(v, dict) and "__tensor__" in v:
                v = tensors[v["__tensor__"]]
            group[k] = v
        groups.append(group)
    return {"state": state, "param_groups": groups}


def _read_optimizer(ck: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(optimizer state dict keyed by fqn, optimizer.json) of a step directory that holds optimizer state."""
    js = files.read_json(ck / "optimizer.json")
    return _join_optimizer(files.read_tensors(ck / "optimizer.safetensors"), js), js


def read_state(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(trainable parameters by fqn, optimizer state dict keyed by fqn) of a checkpoint, read without building a
    model: for looking into a run's state afterwards. `path` as in `load`; the files are verified first."""
    ck = resolve(path)
    files.verify(ck)
    model_sd = files.read_tensors(ck / "model.safetensors")
    if not (ck / "optimizer.json").is_file():
        return model_sd, {"state": {}, "param_groups": []}
    return model_sd, _read_optimizer(ck)[0]


# ---------------------------------------------------------------------------------------------------------
# save / load


def save(
    ckpt_dir: str | os.PathLike,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any | None = None,
    extra_state: dict[str, Any] | None = None,
    rank_tensors: dict[str, torch.Tensor] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write `<ckpt_dir>/step_<step>/` atomically; keep only the newest `keep_last` (None: keep all).

    Collective when torch.distributed is initialised: every rank must call it with the same arguments.
    `extra_state` must be JSON-able (data position, reward-tracker state, config). `rank_tensors` are this
    rank's own tensors (e.g. an EMA of its parameter shards), written per rank: they
    resume with the same world size. Returns the path.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint.save: step must be a non-negative int, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"checkpoint.save: keep_last must be >= 1 or None (keep all), got {keep_last}")
    extra = files.jsonable(extra_state or {}, "extra_state")  # fail before any collective or disk work
    if not _trainable_names(model):
        raise ValueError("checkpoint.save: model has no parameter with requires_grad=True; nothing to save")
    root = Path(ckpt_dir)
    this_rank, world = rank(), world_size()

    # Collectives first, on every rank, in the same order.
    model_sd = _gather_model(model)
    # torch's get_optimizer_state_dict "initialises" an empty optimizer with a zero-grad step, which bumps
    # AdamW's step counter and so changes every later update; a fresh optimizer is saved by hand instead.
    optim_sd = None
    if optimizer is not None:
        optim_sd = _gather_optimizer(model, optimizer) if optimizer.state else _fresh_optimizer(optimizer)
    own = {k: v.detach().cpu() for k, v in (rank_tensors or {}).items()}
    owns: list[Any] = [own]
    if (
        initialized()
    ):  # to rank 0 only (it writes them): a full-weight EMA on every rank would be world x its size
        owns = [None] * world if this_rank == 0 else []
        dist.gather_object(own, owns if this_rank == 0 else None, dst=0)

    final = root / step_dir_name(step)
    if this_rank == 0:
        # NaN in optimizer or scheduler state is a broken run: refuse before writing anything.
        o_t, o_j = _split_optimizer(optim_sd) if optim_sd is not None else ({}, None)
        sched_j = None
        if lr_scheduler is not None:
            sched_j = files.jsonable(lr_scheduler.state_dict(), "lr_scheduler state", allow_nan=False)
        with files.atomic_dir(final) as tmp:  # re-saving a step (e.g. after a resume) replaces it
            files.write_tensors(tmp / "model.safetensors", model_sd, metadata={"format": "pt"})
            if o_j is not None:
                files.write_tensors(tmp / "optimizer.safetensors", o_t, metadata={"format": "pt"})
                files.write_json(tmp / "optimizer.json", o_j)
            if sched_j is not None:
                files.write_json(tmp / "lr_scheduler.json", sched_j)
            for r, own_r in enumerate(owns):
                if own_r:
                    files.write_tensors(tmp / f"tensors_rank{r}.safetensors", own_r)
            meta = {
                "format_version": files.FORMAT_VERSION,
                "step": step,
                "world_size": world,
                "time": time.time(),
                "extra_state": extra,
                "files": files.file_records(tmp),
            }
            files.write_json(tmp / files.META, meta)  # last: a step dir without it is never trusted
        _cleanup(root, keep_last)
    barrier()
    return final


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # os.kill(0, ...) would signal our own process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    except OverflowError:
        return False
    return True


def _cleanup(root: Path, keep_last: int | None) -> None:
    # Only after the new checkpoint is complete. Temp dirs of crashed saves go too, but not those of a live
    # process: a second writer into the same directory may be filling one right now.
    for p in root.iterdir():
        if p.name.startswith(files.TMP_PREFIX + "step_") or p.name.startswith(files.TMP_PREFIX + "old_step_"):
            pid = p.name.rsplit("_", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)
    if keep_last is not None:
        for _, p in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(p, ignore_errors=True)


def load(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any | None = None,
    rank_tensors: dict[str, torch.Tensor] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Restore a checkpoint written by `save` into live objects; returns (step, extra_state).
    `rank_tensors` (the same keys as saved) are filled in place from this rank's file.

    `path` is a step directory or the checkpoint root (the newest one that verifies is used: see
    `latest_valid`). Every file is checked against meta.json first; a missing, truncated, corrupt or
    unreadable one raises files.CheckpointError naming it. The model (and optimizer) must be built exactly as
    when saving: same trainable parameters, sharded or not (the files hold full tensors, so a different
    world size or no sharding loads too; `rank_tensors` need the world size that saved them).
    Collective when torch.distributed is initialised.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    ck = resolve(path)
    meta = files.verify(ck)

    model_sd = files.read_tensors(ck / "model.safetensors")
    want = _trainable_names(model)
    if set(model_sd) != want:
        missing, extra = sorted(want - set(model_sd)), sorted(set(model_sd) - want)
        raise ConfigError(
            f"checkpoint.load: trainable parameters differ from {ck}: missing {missing[:5]}, unexpected "
            f"{extra[:5]}; build the model (LoRA targets/rank, full vs LoRA) as for the saved run"
        )
    # strict=False: the file holds trainable weights only; the frozen base comes from the pretrained load.
    opts = _options(full_state_dict=True, strict=False)
    # torch annotates this read-only argument as an invariant dict of its state-dict value union.
    set_model_state_dict(model, model_sd, options=opts)  # pyright: ignore[reportArgumentType]

    if optimizer is not None:
        if not (ck / "optimizer.json").is_file():
            raise FileNotFoundError(f"checkpoint.load: {ck} has no optimizer state; pass optimizer=None")
        osd, o_j = _read_optimizer(ck)
        tuples = [{k for k, v in g.items() if isinstance(v, tuple)} for g in optimizer.param_groups]
        if o_j.get("fresh"):  # saved before the first step: hyper-parameters only, state stays empty
            if len(osd["param_groups"]) != len(optimizer.param_groups):
                raise ValueError(
                    f"checkpoint.load: {ck} has {len(osd['param_groups'])} param groups, "
                    f"the optimizer {len(optimizer.param_groups)}; build it as for the saved run"
                )
            optimizer.state.clear()
            for g, saved in zip(optimizer.param_groups, osd["param_groups"]):
                g.update(saved)
        else:
            set_optimizer_state_dict(model, optimizer, osd, options=opts)
            _forget_made_up_state(model, optimizer, set(osd["state"]))
        for g, keys in zip(optimizer.param_groups, tuples):
            for k in keys:  # JSON (and DCP's own flattening) turn e.g. AdamW's betas into lists
                if isinstance(g.get(k), list):
                    g[k] = tuple(g[k])

    if lr_scheduler is not None:
        if not (ck / "lr_scheduler.json").is_file():
            raise FileNotFoundError(
                f"checkpoint.load: {ck} has no lr_scheduler state; pass lr_scheduler=None"
            )
        lr_scheduler.load_state_dict(files.read_json(ck / "lr_scheduler.json"))

    if rank_tensors:
        f = ck / f"tensors_rank{rank()}.safetensors"
        if meta.get("world_size") != world_size() or not f.is_file():
            raise ConfigError(
                f"checkpoint.load: {ck} holds no per-rank tensors for rank {rank()} of {world_size()} (saved with world "
                f"size {meta.get('world_size')}); resume with the world size that saved it"
            )
        saved = files.read_tensors(f)
        if set(saved) != set(rank_tensors):
            raise ValueError(
                f"checkpoint.load: {f} holds {sorted(saved)[:3]}..., expected {sorted(rank_tensors)[:3]}..."
            )
        with torch.no_grad():
            for k, t in rank_tensors.items():
                t.copy_(saved[k])

    barrier()
    return int(meta["step"]), meta["extra_state"]


def _forget_made_up_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: set[str]) -> None:
    """Drop the optimizer state of parameters that had none when saved (never stepped: no gradient yet).

    torch's `set_optimizer_state_dict` first takes a zero-gradient step on every parameter, so those get step 1
    and zero moments: a parameter that trains only later would then take its first update with step 2's bias
    correction, not step 1's as in the uninterrupted run, and every later checkpoint would carry the made-up
    entries (e.g. the LoRA of Qwen-Image's last block's text stream, whose output nothing reads)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    for name, p in model.named_parameters():
        if p in optimizer.state and not set(_get_fqns(model, name)) & saved:
            del optimizer.state[p]
