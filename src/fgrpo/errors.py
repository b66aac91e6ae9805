"""Errors fgrpo raises on purpose, and the exit codes an experiment's process ends with.

An `FgrpoError`'s message is complete on its own (what is wrong, which field, the fix): the experiment entry
(`fgrpo.errors.cli`) prints it as one line, without a traceback, and exits with its `exit_code`. Any other
exception is unexpected and keeps its traceback.

The subclasses that also derive from a builtin (ValueError, FileNotFoundError) keep `except ValueError` and
`pytest.raises(ValueError)` working where those were raised before.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any


class FgrpoError(Exception):
    """A refusal or stop that fgrpo explains in its message; the process exits with `exit_code`."""

    exit_code = 2


class ConfigError(FgrpoError, ValueError):
    """A config value, or the content of a file a config field names, that the run cannot use."""


class MissingFileError(FgrpoError, FileNotFoundError):
    """A file or directory that a config field names is not there."""


class RunCollapsed(FgrpoError):
    """The validation score fell far below its best for several validations in a row (run.collapse_drop)."""

    exit_code = 3


def one_line(error: BaseException) -> str:
    """The error's message as one line (a message that quotes a file's text may hold line breaks)."""
    return " ".join(str(error).split("\n")).strip() or type(error).__name__


# How long a rank other than 0 holds its line back. A refusal raised on every rank (config, run directory, the
# files every rank reads) is printed by rank 0, whose exit makes torchrun stop the other ranks within its
# monitor interval (0.1 s); a rank that is still alive after this long raised alone (its own reward slice, its
# checkpoint file), and its line is the only account of why the run stopped.
OTHER_RANKS_WAIT_S = 5.0


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Inside, an `FgrpoError` ends the process with its message alone, one line on stderr, and its `exit_code`;
    any other exception passes through with its traceback.

    Under torchrun each rank runs this: rank 0 (torchrun's RANK) prints at once; another rank prints its line,
    prefixed with its rank, only if it is still running `OTHER_RANKS_WAIT_S` later (see there).
    """
    try:
        yield
    except FgrpoError as e:
        rank = int(os.environ.get("RANK", "0"))
        line = one_line(e)
        if rank != 0:
            time.sleep(OTHER_RANKS_WAIT_S)
            line = f"rank {rank}: {line}"
        sys.stdout.flush()  # the lines printed before the error come first
        print(line, file=sys.stderr, flush=True)
        _leave_nccl_group()
        raise SystemExit(e.exit_code) from None


def _leave_nccl_group() -> None:
    """Destroy an NCCL process group, which otherwise warns at exit that it was not destroyed: a second line (seen
    on an H200). A gloo group says nothing, and is left alone: destroying it while FSDP tensors live can abort."""
    dist = sys.modules.get("torch.distributed")  # never imported here: a run that has a group imported it
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    with contextlib.suppress(Exception):  # the process ends either way; the message is already out
        dist.destroy_process_group()


def cli(main: Callable[[Any], object], presets: Mapping[str, tuple[str, Any]]) -> None:
    """An experiment file's `__main__`: choose a preset (a tyro subcommand whose every field a flag overrides),
    run `main` on it, and end an `FgrpoError` in one line (`one_line_errors`)."""
    import tyro  # only the experiment entry parses a command line

    with one_line_errors():
        main(tyro.extras.overridable_config_cli(dict(presets)))
