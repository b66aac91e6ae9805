"""The on-disk format of checkpoints and LoRA adapters: directories of safetensors + JSON files (no pickle),
written atomically and fsync'ed, and the integrity record (`meta.json`: each file's byte size and sha256) that
`verify` checks. Knows files, not models: what goes into them is fgrpo.checkpoint's (a run's state) and
fgrpo.models.lora's (an adapter)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from fgrpo.errors import FgrpoError

FORMAT_VERSION = 2  # 2 added the per-file sizes and sha256 to meta.json
READABLE_VERSIONS = (1, 2)
META = "meta.json"
TMP_PREFIX = ".tmp_"


class CheckpointError(FgrpoError, RuntimeError):
    """A checkpoint file is missing, truncated, corrupt or unreadable; the message names the file."""


def fsync_file(path: Path) -> None:
    """Flush the file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries to disk where the file system allows it."""
    # The rename is only durable once the parent directory entry is on disk.
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (and Windows) refuse fsync on directories
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as indented, key-sorted JSON and fsync it."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: Path) -> Any:
    """The JSON in `path`; CheckpointError naming the file if it cannot be read or parsed."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(f"checkpoint: cannot read {path} ({type(e).__name__}: {e})") from e


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; CheckpointError naming the file if it cannot be read."""
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"checkpoint: cannot read {path} ({type(e).__name__}: {e})") from e


def sha256(path: Path) -> str:
    """Hex sha256 of the file's bytes."""
    # ~1.2 GB/s with the CPU's SHA extensions: a few seconds for a real LoRA run's optimizer state.
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_records(d: Path) -> dict[str, dict[str, Any]]:
    """{file name: {"bytes": size, "sha256": hex}} of every file in `d` except meta.json."""
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(d.iterdir())
        if p.name != META and p.is_file()
    }


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh hidden sibling `.tmp_<name>_<pid>` to fill; on a clean exit fsync it and rename it to
    `final` (an existing `final` is swapped out, then removed), on an exception remove it. A crash leaves
    the old `final` or the new one under that name, never a half-written one."""
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f"{TMP_PREFIX}{final.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        if final.exists():
            old = parent / f"{TMP_PREFIX}old_{final.name}_{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write `tensors` (any device, views and shared storage allowed) as a safetensors file and fsync it."""
    # safetensors refuses non-contiguous tensors and tensors that share storage; copies are cheap next
    # to a checkpoint's disk write and keep this correct for views and tied weights.
    out = {}
    seen: set[int] = set()
    for k, v in tensors.items():
        v = v.detach().to("cpu").contiguous()
        if v.numel() and v.untyped_storage().data_ptr() in seen:
            v = v.clone()
        if v.numel():
            seen.add(v.untyped_storage().data_ptr())
        out[k] = v
    save_file(out, str(path), metadata=metadata)
    fsync_file(path)


def jsonable(obj: Any, what: str, *, allow_nan: bool = True) -> Any:
    """Tuples become lists; anything json cannot hold (NaN/inf too unless allow_nan) is a clear error
    naming `what`."""
    try:
        return json.loads(json.dumps(obj, allow_nan=allow_nan))
    except (TypeError, ValueError) as e:
        if not allow_nan and "Out of range float" in str(e):
            raise TypeError(
                f"checkpoint: {what} holds NaN or inf ({e}); a run in that state is broken"
            ) from e
        raise TypeError(
            f"checkpoint: {what} is not JSON-serialisable ({e}); store only plain data there"
        ) from e


def verify(step_dir: str | os.PathLike) -> dict[str, Any]:
    """meta.json of `step_dir` after checking every file it lists against the recorded byte size and sha256.

    Raises CheckpointError naming the first missing, truncated or corrupt file (or an unreadable or
    unknown-format meta.json). A format-1 checkpoint records no checksums: a warning says so.
    """
    d = Path(step_dir)
    meta_path = d / META
    if not meta_path.is_file():
        raise CheckpointError(f"checkpoint: {meta_path} is missing; {d} is not a complete checkpoint")
    meta = read_json(meta_path)
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"checkpoint: {meta_path} is not a checkpoint's meta.json (no integer 'step')")
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"checkpoint: {meta_path} has format_version {version}; this fgrpo reads {READABLE_VERSIONS}"
        )
    files = meta.get("files")
    if version != 1 and files is None:
        raise CheckpointError(f"checkpoint: {meta_path} (format_version {version}) lists no files to verify")
    if version == 1 or files is None:
        warnings.warn(
            f"checkpoint: {d} (format_version {version}) records no checksums; its files cannot be verified",
            stacklevel=2,
        )
        return meta
    if not isinstance(files, dict) or not all(
        isinstance(r, dict) and isinstance(r.get("bytes"), int) and isinstance(r.get("sha256"), str)
        for r in files.values()
    ):
        raise CheckpointError(f"checkpoint: {meta_path} has a malformed 'files' record")
    for name, rec in files.items():
        p = d / name
        if not p.is_file():
            raise CheckpointError(f"checkpoint: {p} is missing (listed in {meta_path})")
        size = p.stat().st_size
        if size != rec["bytes"]:
            raise CheckpointError(
                f"checkpoint: {p} has {size} bytes, {META} records {rec['bytes']} (truncated or overwritten)"
            )
        if sha256(p) != rec["sha256"]:
            raise CheckpointError(f"checkpoint: {p} does not match the sha256 in {META} (corrupt)")
    return meta


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The `__metadata__` header of a safetensors file (for inspection and tests)."""
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})
