"""Experiment and benchmark files are scripts, not modules of the package: nothing imports them with `import`, and
they import nothing from each other (what two of them share lives in the package, e.g. `fgrpo.presets`). Where a
benchmark or a test needs what a script defines (a family's recipe, a preset's values, the script's own functions
under test), it reads the file through `load_script`, the one place that loads a file by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

# The repository's root when fgrpo runs from its checkout (src/fgrpo/scripts.py): the registry names recipe files
# relative to it.
ROOT = Path(__file__).resolve().parents[2]


def load_script(path: str | Path) -> ModuleType:
    """The file at `path` (absolute, or relative to the repository root) executed as a fresh module named after its
    stem, without running its `if __name__ == "__main__"` block. The module stays in sys.modules under that name
    while the file runs and after: dataclasses resolve a `from __future__ import annotations` file's string
    annotations through it. A second call executes the file again."""
    path = Path(path)
    path = path if path.is_absolute() else ROOT / path
    if not path.is_file():
        raise FileNotFoundError(f"no script at {path}; pass a path to an experiment or benchmark file")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None  # a .py file always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
