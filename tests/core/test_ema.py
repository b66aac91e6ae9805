"""fgrpo.core.ema: the references' decay schedules by hand, and the in-place EMA update."""

from typing import Any

import pytest
import torch

from fgrpo.core.ema import ema_decay, ema_update_

NFT_OCR = {"rate": 0.0075, "max_decay": 0.999, "delay": 75}  # DiffusionNFT decay_type 2


@pytest.mark.parametrize(
    ("step", "kwargs", "expected"),
    [
        (0, {"rate": 0.0, "max_decay": 0.0}, 0.0),  # copy
        (10**6, {"rate": 0.0, "max_decay": 0.0}, 0.0),
        (0, {"rate": 0.001, "max_decay": 0.5}, 0.0),  # DiffusionNFT decay_type 1: 0.001 * step up to 0.5
        (100, {"rate": 0.001, "max_decay": 0.5}, 0.1),
        (600, {"rate": 0.001, "max_decay": 0.5}, 0.5),
        (74, NFT_OCR, 0.0),  # flat at 0 for the first 75 steps
        (75, NFT_OCR, 0.0),
        (76, NFT_OCR, 0.0075),
        (208, NFT_OCR, 0.0075 * 133),  # 0.9975, still ramping
        (300, NFT_OCR, 0.999),
        (200, {"rate": 0.001, "max_decay": 0.3}, 0.2),  # AWM 'linear': min(0.3, 0.001 * step)
        (1000, {"rate": 0.001, "max_decay": 0.3}, 0.3),
    ],
)
def test_decay_schedules_by_hand(step, kwargs, expected):
    assert ema_decay(step, **kwargs) == pytest.approx(expected, abs=1e-12)


def test_decay_bad_inputs():
    for kwargs in ({"step": -1}, {"delay": -1}, {"rate": -0.1}, {"max_decay": 1.5}):
        args: dict[str, Any] = {"step": 0, "rate": 0.001, "max_decay": 0.5} | kwargs
        with pytest.raises(ValueError, match="ema_decay needs"):
            ema_decay(**args)


def test_update_hand_values():
    """d = 0.25: 0.25 * [1, 2] + 0.75 * [3, 6] = [2.5, 5]; the second tensor 0.25 * 4 + 0.75 * 0 = 1."""
    old = [torch.tensor([1.0, 2.0]), torch.tensor([[4.0]])]
    ema_update_(old, [torch.tensor([3.0, 6.0]), torch.tensor([[0.0]])], 0.25)
    assert torch.equal(old[0], torch.tensor([2.5, 5.0])) and torch.equal(old[1], torch.tensor([[1.0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_is_exact_at_both_ends(dtype):
    g = torch.Generator().manual_seed(0)
    new = [(1e4 * torch.randn(7, 3, generator=g)).to(dtype), torch.randn(5, generator=g).to(dtype)]
    old = [torch.randn(7, 3, generator=g).to(dtype), (1e-4 * torch.randn(5, generator=g)).to(dtype)]
    kept = [o.clone() for o in old]
    ema_update_(old, new, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(old, kept))
    ema_update_(old, new, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(old, new))


def test_update_does_not_build_a_graph():
    new = [torch.ones(3, requires_grad=True)]
    old = [torch.zeros(3)]
    ema_update_(old, new, 0.5)
    assert not old[0].requires_grad and torch.equal(old[0], torch.full((3,), 0.5))


def test_update_bad_inputs():
    with pytest.raises(ValueError, match="decay"):
        ema_update_([torch.zeros(1)], [torch.zeros(1)], 1.5)
    with pytest.raises(ValueError, match="matching parameter lists"):
        ema_update_([torch.zeros(1)], [], 0.5)
    with pytest.raises(ValueError, match="shape"):
        ema_update_([torch.zeros(1)], [torch.zeros(2)], 0.5)
