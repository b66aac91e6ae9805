"""Errors fgrpo raises on purpose, and the exit codes an experiment's process ends with.

An `FgrpoError`'s message is complete on its own (what is wrong, which field, the fix): the experiment entry
(`fgrpo.errors.cli`) prints it as one line, without a traceback, and exits with its `exit_code`. Any other
exception is unexpected and keeps its traceback.
"""

from __future__ import annotations


class FgrpoError(Exception):
    """A refusal or stop that fgrpo explains in its message; the process exits with `exit_code`."""

    exit_code = 2


class ConfigError(FgrpoError, ValueError):
    """A config value the run cannot use (the field and the fix in the message), found before anything is built."""


class RunCollapsed(FgrpoError):
    """The validation score fell far below its best for several validations in a row (run.collapse_drop)."""

    exit_code = 3
