"""benchmarks/forward_process_bias.py: the net share of a group's pulls towards its own samples, by hand."""

from pathlib import Path

import pytest
import torch

from fgrpo.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bias(monkeypatch):
    """The script, with benchmarks/ on the path for its own import of _textbed."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return load_script(ROOT / "benchmarks" / "forward_process_bias.py")


def test_net_share_by_hand(bias):
    share = bias.net_share(torch.tensor([1.0, -1.0, 3.0, -1.0, 0.0, 0.0]), 2)
    assert share.tolist() == pytest.approx([0.0, 0.5, 0.0])


def _pair(scale0: float):
    """One group of two samples whose residuals v - u are d and scale0 * d, advantages +1 / -1."""
    g = torch.Generator().manual_seed(0)
    x0, u, d = (torch.randn(2, 5, 3, generator=g) for _ in range(3))
    d[1] = d[0] / scale0  # sample 0's residual is scale0 times sample 1's
    t = torch.tensor([0.7, 0.7])
    x_t = x0 + t[:, None, None] * u  # (1 - t) x0 + t noise with noise = u + x0
    return u + d, u, x_t, x0, t, torch.tensor([1.0, -1.0])


@pytest.mark.parametrize(
    ("loss", "p", "expected"),
    [
        # AWM: c_b ~ A_b t m_b^(p-1), m_0 = 4 m_1
        ("awm", 0.25, (4**-0.75 - 1) / (4**-0.75 + 1)),
        ("awm", 1.0, 0.0),
        # NFT at theta = old: c_b ~ (2 r_b - 1) / w_b, w = mean|x0_hat - x0| = t mean|v - u|, w_0 = 2 w_1
        ("nft-adaptive", 0.0, (0.5 - 1) / (0.5 + 1)),
        ("nft-uniform", 0.0, 0.0),
    ],
)
def test_weighted_losses_push_away_when_the_better_sample_fits_worse(bias, loss, p, expected):
    """The better-rewarded sample has twice the residual: a weight falling with the error tips the group's net
    towards its worse sample (a push away from its own samples); a uniform weight keeps the net at 0. The
    positive sample is pulled towards its target (c > 0), the negative one pushed away (c < 0)."""
    v, u, x_t, x0, t, adv = _pair(2.0)
    c = bias.coefficients(loss, v, u, x_t, x0, t, adv, p=p)
    assert c[0] > 0 > c[1]
    assert bias.net_share(c, 2).item() == pytest.approx(expected, abs=1e-5)
