import sys

import pytest

from fgrpo.scripts import ROOT, load_script


def test_a_script_loads_fresh_each_time_without_its_main_block(tmp_path):
    path = tmp_path / "counter_script.py"
    path.write_text(
        "from __future__ import annotations\n"
        "import dataclasses\n"
        "@dataclasses.dataclass\n"
        "class Config:\n"
        "    n: int = 1\n"  # a string annotation: dataclasses look the module up in sys.modules
        "if __name__ == '__main__':\n"
        "    raise SystemExit('the main block ran')\n"
    )
    first, second = load_script(path), load_script(path)
    assert first is not second and first.Config is not second.Config
    assert sys.modules["counter_script"] is second
    assert second.Config().n == 1


def test_a_relative_path_is_read_from_the_repository_root():
    assert load_script("experiments/toy_2d.py").__file__ == str(ROOT / "experiments" / "toy_2d.py")
    assert load_script("experiments/sd35_ocr.py").Config().exp_name == "sd35_ocr"


def test_a_missing_script_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no script at .*nothing.py"):
        load_script(tmp_path / "nothing.py")
