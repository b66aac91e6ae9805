"""fgrpo.core.dppo: Flow-DPPO's divergence mask against a hand-computed oracle, a slow loop, and autograd."""

import math

import pytest
import torch

from fgrpo.core.dppo import dppo_loss

LOG_RATIO = torch.tensor([math.log(2.0), math.log(0.5), math.log(4.0)])


def _oracle_batch():
    """Three samples, latent of 2 elements, old_log_prob = 0 so rho = exp(log_prob):

    b=0: rho = 2,   A = 1,    mean - old_mean = [1, 0],   std = 1 -> D = (1/2 + 0)/2 = 0.25 >= tau = 0.1,
         rho > 1 with A > 0: further the same way -> dropped, contributes 0.
    b=1: rho = 0.5, A = 2,    mean - old_mean = [1, 1],   std = 2 -> D = (1/8 + 1/8)/2 = 0.125 >= tau, but
         rho < 1 with A > 0 moves back towards rho = 1 -> kept: -A rho = -1.
    b=2: rho = 4,   A = -0.5, mean - old_mean = [0.2, 0], std = 1 -> D = (0.02 + 0)/2 = 0.01 < tau -> kept:
         -A rho = 2.
    loss = (0 - 1 + 2) / 3 = 1/3;  d loss / d log_prob_b = -A_b rho_b / 3 where kept = [0, -1/3, 2/3].
    """
    log_prob = LOG_RATIO.clone().requires_grad_(True)
    old_log_prob = torch.zeros(3)
    old_mean = torch.zeros(3, 2)
    mean = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.2, 0.0]])
    std = torch.tensor([1.0, 2.0, 1.0])
    adv = torch.tensor([1.0, 2.0, -0.5])
    return log_prob, old_log_prob, mean, old_mean, std, adv


def test_hand_computed_oracle():
    log_prob, old_log_prob, mean, old_mean, std, adv = _oracle_batch()
    loss, m = dppo_loss(log_prob, old_log_prob, mean, old_mean, std, adv, tau=0.1)
    torch.testing.assert_close(loss, torch.tensor(1 / 3))
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([0.0, -1 / 3, 2 / 3]))
    torch.testing.assert_close(m["masked_frac"], torch.tensor(1 / 3))
    torch.testing.assert_close(m["div_mean"], torch.tensor((0.25 + 0.125 + 0.01) / 3))
    torch.testing.assert_close(m["div_max"], torch.tensor(0.25))
    torch.testing.assert_close(m["ratio_mean"], torch.tensor(6.5 / 3))
    torch.testing.assert_close(m["ratio_min"], torch.tensor(0.5))
    torch.testing.assert_close(m["ratio_max"], torch.tensor(4.0))
    torch.testing.assert_close(m["approx_kl"], 0.5 * (LOG_RATIO**2).mean())
    assert all(not v.requires_grad for v in m.values())


def test_importance_weight_hand_computed():
    """The oracle batch with w = [3, 0.5, 0]: loss = (3*0 + 0.5*(-1) + 0*2) / 3 = -1/6;
    d loss / d log_prob_b = w_b * kept_b = [0, 0.5 * -1/3, 0] = [0, -1/6, 0]; no gradient into w; the
    metrics (ratio, mask, divergence) do not see w."""
    log_prob, old_log_prob, mean, old_mean, std, adv = _oracle_batch()
    w = torch.tensor([3.0, 0.5, 0.0], requires_grad=True)
    loss, m = dppo_loss(log_prob, old_log_prob, mean, old_mean, std, adv, tau=0.1, weight=w)
    torch.testing.assert_close(loss, torch.tensor(-1 / 6))
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([0.0, -1 / 6, 0.0]))
    assert w.grad is None
    torch.testing.assert_close(m["masked_frac"], torch.tensor(1 / 3))
    with pytest.raises(ValueError, match="weight"):
        dppo_loss(log_prob, old_log_prob, mean, old_mean, std, adv, weight=torch.ones(2))


def test_unit_weight_is_the_unweighted_loss_bit_for_bit():
    """w = 1 multiplies every entry by exactly 1, so it gives weight=None's loss and gradient bit for bit (the
    oracle and slow-loop tests pin weight=None's numbers)."""
    g = torch.Generator().manual_seed(0)
    B, n = 8, 6
    old_mean = torch.randn(B, n, generator=g)
    mean = old_mean + 0.05 * torch.randn(B, n, generator=g)
    rest = (old_mean, 0.1 + torch.rand(B, generator=g), torch.randn(B, generator=g))
    old_log_prob = 0.3 * torch.randn(B, generator=g)
    grads = []
    for weight in (None, torch.ones(B)):
        log_prob = (0.3 * torch.arange(B) / B).requires_grad_(True)
        loss, _ = dppo_loss(log_prob, old_log_prob, mean, *rest, tau=1e-3, weight=weight)
        loss.backward()
        grads.append((loss.detach(), log_prob.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def _slow_dppo(log_prob, old_log_prob, mean, old_mean, std, adv, tau):
    """Python floats and loops, straight from the spec."""
    total = 0.0
    B = len(log_prob)
    for b in range(B):
        rho = math.exp(log_prob[b] - old_log_prob[b])
        d = sum((x - y) ** 2 / (2 * std[b] ** 2) for x, y in zip(mean[b], old_mean[b])) / len(mean[b])
        drop = d >= tau and ((rho > 1 and adv[b] > 0) or (rho < 1 and adv[b] < 0))
        total += 0.0 if drop else -adv[b] * rho
    return total / B


@pytest.mark.parametrize("seed", range(5))
def test_matches_a_slow_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B, n = 16, 12
    log_prob = 0.3 * torch.randn(B, generator=g)
    old_log_prob = 0.3 * torch.randn(B, generator=g)
    old_mean = torch.randn(B, n, generator=g)
    mean = old_mean + 0.05 * torch.randn(B, n, generator=g) * torch.rand(B, 1, generator=g)
    std = 0.05 + torch.rand(B, generator=g)
    adv = torch.randn(B, generator=g)
    div = ((mean - old_mean) ** 2 / (2 * std[:, None] ** 2)).mean(1)
    d = div.sort().values
    tau = float(d[B // 2 - 1] + d[B // 2]) / 2  # half the batch is past it, none within rounding of it
    loss, m = dppo_loss(log_prob, old_log_prob, mean, old_mean, std, adv, tau=tau)
    ref = _slow_dppo(
        log_prob.tolist(),
        old_log_prob.tolist(),
        mean.tolist(),
        old_mean.tolist(),
        std.tolist(),
        adv.tolist(),
        tau,
    )
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert 0 < m["masked_frac"] < 1


def test_mask_blocks_the_gradient_and_nothing_flows_through_the_means():
    log_prob, old_log_prob, mean, old_mean, std, adv = _oracle_batch()
    mean = mean.clone().requires_grad_(True)
    old_log_prob = old_log_prob.clone().requires_grad_(True)
    loss, _ = dppo_loss(log_prob, old_log_prob, mean, old_mean, std, adv, tau=0.1)
    loss.backward()
    assert log_prob.grad is not None
    assert log_prob.grad[0] == 0  # the dropped entry
    assert mean.grad is None  # D only gates; it is not a penalty
    assert old_log_prob.grad is None


def test_closed_form_gradient_with_torch_func():
    """Unmasked everywhere (tau = inf): d loss / d log_prob = -A rho / B exactly as PPO without a clip."""
    g = torch.Generator().manual_seed(3)
    B = 6
    lp, old, adv = torch.randn(B, generator=g), torch.randn(B, generator=g), torch.randn(B, generator=g)
    mean = torch.randn(B, 2, 3, generator=g)
    grad = torch.func.grad(lambda x: dppo_loss(x, old, mean, mean + 1, torch.ones(B), adv, tau=math.inf)[0])(
        lp
    )
    torch.testing.assert_close(grad, -adv * torch.exp(lp - old) / B)


def test_divergence_exactly_at_tau_is_masked():
    """D = (1^2 / 2 + 0) / 2 = 0.25 exactly: D >= tau drops it at tau = 0.25, keeps it just above."""
    lp, old, adv = torch.tensor([math.log(2.0)]), torch.zeros(1), torch.ones(1)
    mean, old_mean, std = torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), torch.ones(1)
    at, m_at = dppo_loss(lp, old, mean, old_mean, std, adv, tau=0.25)
    just_above = torch.nextafter(torch.tensor(0.25), torch.tensor(1.0)).item()  # D is compared in fp32
    above, m_above = dppo_loss(lp, old, mean, old_mean, std, adv, tau=just_above)
    assert at.item() == 0.0 and m_at["masked_frac"] == 1
    torch.testing.assert_close(above, torch.tensor(-2.0))
    assert m_above["masked_frac"] == 0


def test_ratio_exactly_one_is_never_masked():
    """rho = 1 moves neither way: kept whatever D, loss = -mean(A)."""
    adv = torch.tensor([1.0, -3.0])
    lp = torch.tensor([0.5, -0.5])
    loss, m = dppo_loss(
        lp, lp.clone(), torch.full((2, 4), 9.0), torch.zeros(2, 4), torch.ones(2), adv, tau=0.0
    )
    torch.testing.assert_close(loss, torch.tensor(1.0))
    assert m["masked_frac"] == 0 and m["div_mean"] == 81 / 2


def test_zero_advantages_give_zero_loss_and_gradient():
    log_prob, old_log_prob, mean, old_mean, std, _ = _oracle_batch()
    loss, m = dppo_loss(log_prob, old_log_prob, mean, old_mean, std, torch.zeros(3), tau=0.0)
    loss.backward()
    assert loss.item() == 0.0 and m["masked_frac"] == 0
    assert log_prob.grad is not None
    assert torch.equal(log_prob.grad, torch.zeros(3))


def test_std_per_sample_or_broadcast_shape_agree():
    log_prob, old_log_prob, mean, old_mean, std, adv = _oracle_batch()
    a = dppo_loss(log_prob, old_log_prob, mean, old_mean, std, adv, tau=0.1)
    b = dppo_loss(log_prob, old_log_prob, mean, old_mean, std[:, None], adv, tau=0.1)
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_bf16_inputs_are_computed_in_fp32():
    log_prob, old_log_prob, mean, old_mean, std, adv = _oracle_batch()
    args = [x.detach().bfloat16() for x in (log_prob, old_log_prob, mean, old_mean, std, adv)]
    loss, m = dppo_loss(*args, tau=0.1)
    ref, ref_m = dppo_loss(*[x.float() for x in args], tau=0.1)
    assert loss.dtype == torch.float32 and m["div_mean"].dtype == torch.float32
    assert torch.equal(loss, ref) and torch.equal(m["div_mean"], ref_m["div_mean"])


def test_bad_inputs_raise():
    log_prob, old_log_prob, mean, old_mean, std, adv = _oracle_batch()
    with pytest.raises(ValueError, match="tau"):
        dppo_loss(log_prob, old_log_prob, mean, old_mean, std, adv, tau=-1.0)
    with pytest.raises(ValueError, match=r"must all be \[B\]"):
        dppo_loss(log_prob, old_log_prob[:2], mean, old_mean, std, adv)
    with pytest.raises(ValueError, match="old_mean"):
        dppo_loss(log_prob, old_log_prob, mean, old_mean[:, :1], std, adv)
