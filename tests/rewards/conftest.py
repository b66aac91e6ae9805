"""Session fixtures: the DejaVu font (a clear failure when absent) and one rapidocr engine for all tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import FONT


@pytest.fixture(scope="session")
def font_path() -> Path:
    if not FONT.is_file():
        pytest.fail(
            f"{FONT} is missing: the OCR tests render text with it; install it: apt-get install -y fonts-dejavu-core"
        )
    return FONT


@pytest.fixture(scope="session")
def rapid_engine():
    from fgrpo.rewards.ocr import RapidOcrEngine

    return RapidOcrEngine()
