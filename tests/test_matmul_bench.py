"""benchmarks/matmul.py on the CPU: the rate cell by hand, the rowwise operands, the table of the tiny shapes."""

import importlib.util
from pathlib import Path

import pytest
import torch

from fgrpo.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="needs the fp8 extra (uv sync --extra fp8)"
)


def _matmul():
    return load_script(ROOT / "benchmarks" / "matmul.py")


def test_rate_cells_by_hand():
    """2 x 16384 x 3072 x 3072 FLOPs in 0.5 ms: 618.5 TFLOP/s, a whole number; 2 x 32^3 in 1 ms: 6.55e-5."""
    mm = _matmul()
    assert mm.rate(2 * 16384 * 3072 * 3072, 0.5e-3) == "618"
    assert mm.rate(2 * 32**3, 1e-3) == "6.55e-05"


def test_rowwise_operands_give_the_product():
    """Rows [1, 2, -4] and [0.5, 0.25, 8]: e4m3 holds them with one scale per row (amax / 448, in bf16); the scaled
    matmul of two quantized operands equals the bf16 product within e4m3's rounding (10 % of the output's range)."""
    mm = _matmul()
    rows = torch.zeros(16, 16)
    rows[0, :3], rows[1, :3] = torch.tensor([1.0, 2.0, -4.0]), torch.tensor([0.5, 0.25, 8.0])
    rows[2:, 0] = 1.0  # float8 matmuls take multiples of 16 rows and columns
    q, scale = mm.rowwise(rows.bfloat16())
    assert q.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (16, 1)
    # the scale is kept in the input's bf16: amax / 448 to bf16's 8 bits
    torch.testing.assert_close(scale[:2].flatten(), torch.tensor([4.0, 8.0]) / 448, rtol=2**-8, atol=0)
    torch.testing.assert_close((q.float() * scale)[:2, :3], rows[:2, :3], rtol=2**-8, atol=0)
    s = mm.measure(16, 32, 48, 1, torch.device("cpu"))
    assert set(s) == {*mm.KINDS, "error"} and 0 < s["error"] < 0.1
    assert "float8 linear, tensorwise" in mm.KINDS


@pytest.mark.parametrize("compile", [False, True])
def test_tiny_table(capsys, compile):
    """--tiny prints one row per shape and the block's row, each with four rates and the float8 / bf16 ratio, eager
    and with --compile."""
    _matmul().main(["--tiny", "--iters", "1", *(["--compile"] if compile else [])])
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("compiled" if compile else "eager")
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| 32 -> 32 (4)",
        "| 32 -> 128 (1)",
        "| 128 -> 32 (1)",
        "| **one block**",
    ]
    assert all(len(r.split(" | ")) == 6 and r.endswith("x |") for r in rows[1:])
