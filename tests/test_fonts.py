"""fgrpo.fonts: the system's DejaVu Sans where installed, matplotlib's copy otherwise; both draw the same word."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from fgrpo import fonts


def _ink(path: Path) -> np.ndarray:
    img = Image.new("L", (160, 40), 255)
    ImageDraw.Draw(img).text((4, 4), "FLOW", fill=0, font=ImageFont.truetype(str(path), 28))
    return np.asarray(img) < 128


@pytest.mark.parametrize("bold", [False, True])
def test_without_the_system_font_the_matplotlib_copy_serves(monkeypatch, tmp_path, bold):
    system = fonts.dejavu_sans(bold)
    monkeypatch.setattr(fonts, "SYSTEM_DIR", tmp_path)  # an empty folder: no system font
    bundled = fonts.dejavu_sans(bold)
    assert bundled != system and "matplotlib" in bundled.parts and bundled.name.startswith("DejaVuSans")
    ink = _ink(bundled)
    assert ink.sum() > 100  # a real face that draws the word
    if "matplotlib" not in system.parts:  # this machine has the system font: compare the two
        same = _ink(system)
        assert (ink != same).mean() < 0.02  # the same font, another build: a few pixels at most
