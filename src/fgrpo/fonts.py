"""DejaVu Sans, the font fgrpo draws words with (the text renderer's training data, the OCR tests and benchmarks).

The system's copy (Debian's fonts-dejavu-core, what every record used) comes first; a machine without it uses the
copy matplotlib ships (a dependency), so nothing needs the system package. The two files are different builds of
the same font (a 28-px word draws the same pixels with either, tests/test_fonts.py).
"""

from __future__ import annotations

from pathlib import Path

SYSTEM_DIR = Path("/usr/share/fonts/truetype/dejavu")


def dejavu_sans(bold: bool = False) -> Path:
    """The path of DejaVu Sans (Bold): the system's if installed, else matplotlib's."""
    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    system = SYSTEM_DIR / name
    if system.is_file():
        return system
    import matplotlib

    bundled = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / name
    if not bundled.is_file():
        raise FileNotFoundError(
            f"neither {system} nor {bundled} exists; apt-get install -y fonts-dejavu-core"
        )
    return bundled
