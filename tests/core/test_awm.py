"""fgrpo.core.awm: AWM's log-weight and clipped loss: hand oracles, a slow loop, the shared surrogate, gradients."""

import math

import pytest
import torch

from fgrpo.core.awm import awm_log_weight, awm_loss
from fgrpo.core.grpo import clipped_policy_loss


def test_log_weight_hand_values():
    """B = 2, latent of 2 elements, err = v - (noise - x0).

    b=0: v = [1, 1], noise = [1, 1], x0 = [0, 0] -> err = 0, m = 0 -> -((1e-10)^p - (1e-10)^p) t / p = 0.
    b=1: v = [4, 4], noise = x0 = 0 -> err = [4, 4], m = 16, t = 1:
         p = 0.25: -((16)^0.25 - (1e-10)^0.25) / 0.25 = -(2 - 10^-2.5) * 4 = -7.98735...
         p = 0.5 (t = 0.5): -(4 - 1e-5) * 0.5 / 0.5 = -3.99999.
    """
    v = torch.tensor([[1.0, 1.0], [4.0, 4.0]])
    noise = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    x0 = torch.zeros(2, 2)
    lw = awm_log_weight(v, x0, noise, torch.tensor([0.7, 1.0]))
    assert lw[0].item() == 0.0
    torch.testing.assert_close(lw[1], torch.tensor(-(2 - 10**-2.5) * 4))
    lw = awm_log_weight(v, x0, noise, torch.tensor([0.7, 0.5]), p=0.5)
    torch.testing.assert_close(lw[1], torch.tensor(-(4 - 1e-5)))


def test_log_weight_with_p_one_is_minus_t_times_the_flow_matching_loss():
    g = torch.Generator().manual_seed(0)
    v, x0, noise = (torch.randn(3, 2, 4, generator=g) for _ in range(3))
    t = torch.rand(3, generator=g)
    mse = ((v - (noise - x0)) ** 2).mean(dim=(1, 2))
    torch.testing.assert_close(awm_log_weight(v, x0, noise, t, p=1.0), -t * mse)


def test_log_weight_gradient_closed_form():
    """d lw / d v = -t (m + 1e-10)^(p - 1) * 2 err / n: it points against the error, so ascent fits the velocity."""
    g = torch.Generator().manual_seed(1)
    v, x0, noise = (torch.randn(2, 6, generator=g) for _ in range(3))
    t, p = torch.tensor([0.3, 0.9]), 0.25
    grad = torch.func.grad(lambda u: awm_log_weight(u, x0, noise, t, p=p).sum())(v)
    err = v - (noise - x0)
    m = (err**2).mean(1, keepdim=True)
    torch.testing.assert_close(grad, -t[:, None] * (m + 1e-10) ** (p - 1) * 2 * err / 6)


def test_loss_hand_computed_oracle():
    """N = 2 entries, adv_clip = 5 -> A~ = clip(A, +-5) / 5, clip_range = 1 -> rho clipped to [0, 2].

    n=0: A = 10 -> A~ = 1,      rho = 3:   max(-3, -2) = -2 (the clip binds: no gradient)
    n=1: A = -2.5 -> A~ = -0.5, rho = 0.5: max(0.25, 0.25) = 0.25, d/d log_weight = -A~ rho / N = 0.125
    loss = (-2 + 0.25) / 2 = -0.875.
    """
    lw = torch.tensor([math.log(3.0), math.log(0.5)], requires_grad=True)
    loss, m = awm_loss(lw, torch.zeros(2), torch.tensor([10.0, -2.5]))
    torch.testing.assert_close(loss, torch.tensor(-0.875))
    loss.backward()
    torch.testing.assert_close(lw.grad, torch.tensor([0.0, 0.125]))
    torch.testing.assert_close(m["clip_frac"], torch.tensor(0.5))


def _slow_awm(lw, old, adv, adv_clip, clip_range):
    total = 0.0
    for a, b, c in zip(lw, old, adv):
        at = max(-adv_clip, min(adv_clip, c)) / adv_clip
        rho = math.exp(a - b)
        clipped = max(1 - clip_range, min(1 + clip_range, rho))
        total += max(-at * rho, -at * clipped)
    return total / len(lw)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip_range", [1.0, 0.2])
def test_loss_matches_a_slow_loop(seed, clip_range):
    g = torch.Generator().manual_seed(seed)
    lw, old = 0.5 * torch.randn(12, generator=g), 0.5 * torch.randn(12, generator=g)
    adv = 4 * torch.randn(12, generator=g)
    loss, _ = awm_loss(lw, old, adv, adv_clip=3.0, clip_range=clip_range)
    ref = _slow_awm(lw.tolist(), old.tolist(), adv.tolist(), 3.0, clip_range)
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-7)


def test_loss_is_the_shared_clipped_surrogate_on_normalised_advantages():
    g = torch.Generator().manual_seed(5)
    lw, old, adv = torch.randn(8, generator=g), torch.randn(8, generator=g), 9 * torch.randn(8, generator=g)
    ours = awm_loss(lw, old, adv, adv_clip=5.0, clip_range=0.5)
    shared = clipped_policy_loss(lw, old, adv.clamp(-5, 5) / 5, clip_range=0.5, adv_clip_max=1.0)
    assert torch.equal(ours[0], shared[0])
    assert all(torch.equal(ours[1][k], shared[1][k]) for k in shared[1])


def test_zero_advantages_and_unit_ratio():
    lw = torch.randn(4, requires_grad=True)
    loss, m = awm_loss(lw, lw.detach(), torch.zeros(4))
    loss.backward()
    assert lw.grad is not None
    assert loss.item() == 0.0 and torch.equal(lw.grad, torch.zeros(4))
    assert m["ratio_mean"] == 1 and m["clip_frac"] == 0


def test_bf16_inputs_are_computed_in_fp32():
    g = torch.Generator().manual_seed(2)
    v, x0, noise = (torch.randn(3, 5, generator=g).bfloat16() for _ in range(3))
    t = torch.rand(3, generator=g).bfloat16()
    lw = awm_log_weight(v, x0, noise, t)
    assert lw.dtype == torch.float32
    assert torch.equal(lw, awm_log_weight(v.float(), x0.float(), noise.float(), t.float()))
    loss, _ = awm_loss(
        lw.bfloat16(), torch.zeros(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)
    )
    assert loss.dtype == torch.float32


def test_bad_inputs_raise():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="p must"):
        awm_log_weight(x, x, x, torch.zeros(2), p=0.0)
    with pytest.raises(ValueError, match="share one"):
        awm_log_weight(x, x[:1], x, torch.zeros(2))
    with pytest.raises(ValueError, match=r"t \(3,\)"):
        awm_log_weight(x, x, x, torch.zeros(3))
    with pytest.raises(ValueError, match="adv_clip"):
        awm_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), adv_clip=0.0)
