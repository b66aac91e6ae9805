"""Session fixtures: the DejaVu font and one rapidocr engine for all tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import FONT, render_text


@pytest.fixture(scope="session")
def font_path() -> Path:
    return FONT  # fgrpo.fonts: the system's DejaVu Sans, else matplotlib's copy


@pytest.fixture(scope="session")
def rapid_engine(font_path):
    """One engine for all tests, its models loaded here with every rapidocr download path made to fail:
    so any test using it also proves the engine runs offline from the wheel's weights."""
    from rapidocr.utils.download_file import DownloadFile

    from fgrpo.rewards.ocr import RapidOcrEngine

    def no_download(*args, **kwargs):
        raise AssertionError("rapidocr tried to download a file; fgrpo must run it offline")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DownloadFile, "run", no_download)
        engine = RapidOcrEngine()
        # Text, not a blank image: rapidocr loads the recognizer only once the detector finds a box.
        assert engine.recognize(render_text("OK", font_path, size=128)[None]) == ["OK"]
    return engine
