"""benchmarks/optimizer_drift.py on checkpoints written by fgrpo.checkpoint: the LoRA update's norm and Adam's
direction consistency against values computed by hand."""

import contextlib
import io
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from fgrpo import checkpoint
from fgrpo.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _drift():
    return load_script(ROOT / "benchmarks" / "optimizer_drift.py")


class _Lora(nn.Module):
    """One layer's LoRA pair under the names peft gives it."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.lora_A = nn.ModuleDict({"default": _weight(a)})
        self.lora_B = nn.ModuleDict({"default": _weight(b)})


def _weight(w: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(2, 2, bias=False)
    layer.weight = nn.Parameter(w.clone())
    return layer


def _train(tmp_path: Path, signs: list[float]) -> Path:
    """AdamW (b1 0.9, b2 0.999, no weight decay) on B = diag(2, 3), A = I with a gradient of the given signs on
    every entry, then a checkpoint. The update only moves B and A; the test reads the moments, not the weights."""
    torch.manual_seed(0)
    layer = _Lora(torch.eye(2), torch.diag(torch.tensor([2.0, 3.0])))
    model = nn.ModuleDict({"proj": layer})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-9, betas=(0.9, 0.999), weight_decay=0.0, eps=0.0)
    for s in signs:
        for p in model.parameters():
            p.grad = torch.full_like(p, s)
        opt.step()
    return checkpoint.save(tmp_path, len(signs), model=model, optimizer=opt)


def test_update_norm_and_a_steady_gradient_by_hand(tmp_path):
    """||B A||_F of diag(2, 3) @ I is sqrt(13); a gradient that never changes has m_hat = g and v_hat = g^2, so
    its consistency is exactly 1."""
    drift = _drift()
    step_dir = _train(tmp_path, [1.0] * 5)
    ((name, step, norm, cons, *_),) = drift.rows([step_dir])
    assert name.endswith("step_000005") and step == 5
    assert norm == pytest.approx(math.sqrt(13), rel=1e-6)
    assert cons == pytest.approx(1.0, abs=1e-6)


def test_an_alternating_gradient_by_hand(tmp_path):
    """Gradients +1 then -1: m_2 = 0.9 * 0.1 - 0.1 = -0.01, m_hat = -0.01 / (1 - 0.81) = -1/19; v_2 = 0.999 *
    0.001 + 0.001, v_hat = v_2 / (1 - 0.999^2) = 1; so every entry reads 1/19. A run's checkpoint directory
    lists each of its steps."""
    drift = _drift()
    _train(tmp_path, [1.0, -1.0])
    _train(tmp_path, [1.0, -1.0, 1.0])
    out = drift.rows([tmp_path])
    assert [r[1] for r in out] == [2, 3]
    assert out[0][3] == pytest.approx(1 / 19, rel=1e-6)
    # a third step of +1: m_3 = 0.9 * -0.01 + 0.1 = 0.091, m_hat = 0.091 / 0.271; v_hat = 1
    assert out[1][3] == pytest.approx(0.091 / 0.271, rel=1e-6)


def test_random_signs_give_the_noise_level(tmp_path):
    """Random signs for many steps: |m_hat| / sqrt(v_hat) averages sqrt((1 - b1) / (1 + b1)) * sqrt(2 / pi) =
    0.183 (m_hat a sum of independent terms, v_hat exactly 1)."""
    drift = _drift()
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-9, betas=(0.9, 0.999), weight_decay=0.0, eps=0.0)
    for _ in range(400):
        model.weight.grad = torch.randint(0, 2, (64, 64), generator=g).float() * 2 - 1
        opt.step()
    state = {"w": {k: v for k, v in opt.state[model.weight].items()}}
    cons = drift.direction_consistency(state, (0.9, 0.999))
    assert cons == pytest.approx(math.sqrt(0.1 / 1.9) * math.sqrt(2 / math.pi), rel=0.05)


def test_gradient_scale_and_the_share_below_eps_by_hand(tmp_path):
    """A steady gradient has v_hat = g^2 exactly, so sqrt(v_hat) is |g|. The entries' gradients 1..8 (A's four, then
    B's) give the quantiles 1 + 0.1 * 7 = 1.7, 4.5 and 7.3 (linear interpolation over 8 order statistics); with
    eps 4.5 half the entries lie below it. The table prints them beside the other columns."""
    drift = _drift()
    layer = _Lora(torch.eye(2), torch.eye(2))
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-9, betas=(0.9, 0.999), weight_decay=0.0, eps=4.5)
    for _ in range(3):
        for p, g in zip(
            layer.parameters(), (torch.tensor([[1.0, 2], [3, 4]]), torch.tensor([[5.0, 6], [7, 8]]))
        ):
            p.grad = -g  # the sign does not matter: v holds its square
        opt.step()
    step_dir = checkpoint.save(tmp_path, 3, model=nn.ModuleDict({"proj": layer}), optimizer=opt)
    ((*_, quantiles, eps, below),) = drift.rows([step_dir])
    assert quantiles == pytest.approx((1.7, 4.5, 7.3), rel=1e-6)
    assert (eps, below) == (4.5, 0.5)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        drift.main([str(step_dir)])
    assert "| 1.70e+00 / 4.50e+00 / 7.30e+00 | 4.5e+00 (50%) |" in out.getvalue()


def test_a_checkpoint_without_optimizer_state_is_refused(tmp_path):
    drift = _drift()
    model = nn.ModuleDict({"proj": _Lora(torch.eye(2), torch.eye(2))})
    step_dir = checkpoint.save(tmp_path, 0, model=model)
    with pytest.raises(SystemExit, match="no optimizer state"):
        drift.rows([step_dir])
