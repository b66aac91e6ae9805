"""fgrpo.core.nft: DiffusionNFT's optimality probability and loss: hand oracle, slow loop, closed-form gradient."""

import pytest
import torch

from fgrpo.core.nft import nft_loss, optimality_prob


def test_optimality_prob_hand_values():
    """0.5 + 0.5 clip(A / 5, -1, 1): A = -10 -> 0, -2.5 -> 0.25, 0 -> 0.5, 5 -> 1, 7 -> 1."""
    a = torch.tensor([-10.0, -2.5, 0.0, 5.0, 7.0])
    assert torch.equal(optimality_prob(a), torch.tensor([0.0, 0.25, 0.5, 1.0, 1.0]))
    assert torch.equal(optimality_prob(a, adv_clip=2.5), torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0]))
    assert optimality_prob(a.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="adv_clip"):
        optimality_prob(a, adv_clip=0.0)


def _oracle():
    """beta = 0.5, scale = 5, B = 2, latent of 2 elements.

    b=0: t = 0.5, x0 = [0, 0], x_t = [1, 1], v = [2, 0], v_old = [0, 0], r = 1
         v+ = 0.5 v + 0.5 v_old = [1, 0],  v- = 1.5 v_old - 0.5 v = [-1, 0]
         e+ = x_t - t v+ - x0 = [0.5, 1]:  mean e^2 = 0.625, mean|e| = 0.75 -> l+ = 5/6
         e- = [1.5, 1]:                    mean e^2 = 1.625, mean|e| = 1.25 -> l- = 1.3
         r l+ + (1 - r) l- = 5/6
    b=1: t = 1, x0 = [1, -1], x_t = [0, 0], v = [0, 0], v_old = [-1, 1], r = 0.25
         v+ = [-0.5, 0.5], v- = [-1.5, 1.5]
         e+ = [0, 0] - [-0.5, 0.5] - [1, -1] = [-0.5, 0.5] -> l+ = 0.25 / 0.5 = 0.5
         e- = [0, 0] - [-1.5, 1.5] - [1, -1] = [0.5, -0.5]  -> l- = 0.5
         0.25 * 0.5 + 0.75 * 0.5 = 0.5
    loss = 5 * mean(5/6, 1/2) / 0.5 = 20/3.
    d loss / d v = (2 scale t / (B n)) [(1 - r) e- / w- - r e+ / w+]:
      b=0: 2.5 / 4 * 2 = 1.25 -> -1.25 [0.5, 1] / 0.75 = [-5/6, -5/3]
      b=1: 2 * 5 / 4 = 2.5   -> 2.5 (0.75 [0.5, -0.5] / 0.5 - 0.25 [-0.5, 0.5] / 0.5) = [2.5, -2.5]
    """
    v = torch.tensor([[2.0, 0.0], [0.0, 0.0]], requires_grad=True)
    v_old = torch.tensor([[0.0, 0.0], [-1.0, 1.0]])
    x_t = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    x0 = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    t = torch.tensor([0.5, 1.0])
    r = torch.tensor([1.0, 0.25])
    return v, v_old, x_t, x0, t, r


def test_hand_computed_oracle():
    v, v_old, x_t, x0, t, r = _oracle()
    loss, m = nft_loss(v, v_old, x_t, x0, t, r, beta=0.5)
    torch.testing.assert_close(loss, torch.tensor(20 / 3))
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[-5 / 6, -5 / 3], [2.5, -2.5]]))
    torch.testing.assert_close(m["positive_loss"], torch.tensor((5 / 6 + 0.5) / 2))
    torch.testing.assert_close(m["negative_loss"], torch.tensor((1.3 + 0.5) / 2))
    torch.testing.assert_close(m["old_deviate"], torch.tensor((4.0 + 0 + 1 + 1) / 4))
    torch.testing.assert_close(m["r_mean"], torch.tensor(0.625))
    assert all(not x.requires_grad for x in m.values())


def test_uniform_weighting_hand_computed():
    """The oracle above with weighting="uniform", l+- = mean(e+-^2):
    b=0: l+ = 0.625, l- = 1.625, r = 1 -> 0.625;  b=1: l+ = l- = 0.25 -> 0.25
    loss = 5 * mean(0.625, 0.25) / 0.5 = 4.375.
    d loss / d v = (2 scale t / (B n)) [(1 - r) e- - r e+]:
      b=0: 1.25 * -[0.5, 1] = [-0.625, -1.25];  b=1: 2.5 * (0.75 [0.5, -0.5] - 0.25 [-0.5, 0.5]) = [1.25, -1.25]
    """
    v, v_old, x_t, x0, t, r = _oracle()
    loss, _ = nft_loss(v, v_old, x_t, x0, t, r, beta=0.5, weighting="uniform")
    torch.testing.assert_close(loss, torch.tensor(4.375))
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[-0.625, -1.25], [1.25, -1.25]]))
    with pytest.raises(ValueError, match="weighting"):
        nft_loss(v, v_old, x_t, x0, t, r, beta=0.5, weighting="t2")


def _slow_nft(v, v_old, x_t, x0, t, r, beta, scale):
    """Python floats and loops, straight from the spec."""
    total = 0.0
    for b in range(len(v)):
        terms = []
        for sign in (+1, -1):
            vi = [
                beta * a + (1 - beta) * o if sign > 0 else (1 + beta) * o - beta * a
                for a, o in zip(v[b], v_old[b])
            ]
            e = [(x - t[b] * w) - y for x, w, y in zip(x_t[b], vi, x0[b])]
            n = len(e)
            terms.append((sum(z * z for z in e) / n) / max(sum(abs(z) for z in e) / n, 1e-5))
        total += scale * (r[b] * terms[0] + (1 - r[b]) * terms[1]) / beta
    return total / len(v)


def _random(seed, B=5, n=7):
    g = torch.Generator().manual_seed(seed)
    x0, noise = torch.randn(B, n, generator=g), torch.randn(B, n, generator=g)
    t = torch.rand(B, generator=g)
    x_t = (1 - t[:, None]) * x0 + t[:, None] * noise
    v_old = noise - x0 + 0.3 * torch.randn(B, n, generator=g)
    v = v_old + 0.1 * torch.randn(B, n, generator=g)
    r = torch.rand(B, generator=g)
    return v, v_old, x_t, x0, t, r


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_matches_a_slow_loop(seed, beta):
    args = _random(seed)
    loss, _ = nft_loss(*args, beta=beta, scale=3.0)
    ref = _slow_nft(*[a.tolist() for a in args], beta=beta, scale=3.0)
    assert loss.item() == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_gradient_wrt_v_is_the_closed_form(seed):
    """The adaptive weights are stop-gradients: grad = (2 scale t / (B n)) [(1 - r) e-/w- - r e+/w+]."""
    v, v_old, x_t, x0, t, r = _random(seed)
    beta, scale = 0.3, 5.0
    B, n = v.shape
    grad = torch.func.grad(lambda u: nft_loss(u, v_old, x_t, x0, t, r, beta=beta, scale=scale)[0])(v)
    tt = t[:, None]
    e_pos = x_t - tt * (beta * v + (1 - beta) * v_old) - x0
    e_neg = x_t - tt * ((1 + beta) * v_old - beta * v) - x0
    w_pos, w_neg = e_pos.abs().mean(1, keepdim=True), e_neg.abs().mean(1, keepdim=True)
    rr = r[:, None]
    expect = 2 * scale * tt / (B * n) * ((1 - rr) * e_neg / w_neg - rr * e_pos / w_pos)
    torch.testing.assert_close(grad, expect)


def test_no_gradient_reaches_the_old_velocity():
    v, v_old, x_t, x0, t, r = _oracle()
    v_old = v_old.clone().requires_grad_(True)
    nft_loss(v, v_old, x_t, x0, t, r, beta=0.5)[0].backward()
    assert v_old.grad is None


def test_neutral_samples_pull_both_ways_equally_at_v_equal_v_old():
    """r = 1/2 and v = v_old: v+ = v- = v_old, so l+ = l- and the gradient (2 scale t/(B n)) (e/2w - e/2w) = 0."""
    v, v_old, x_t, x0, t, _ = _random(7)
    grad = torch.func.grad(lambda u: nft_loss(u, v_old, x_t, x0, t, torch.full((5,), 0.5), beta=0.7)[0])(
        v_old
    )
    torch.testing.assert_close(grad, torch.zeros_like(grad))


def test_adaptive_weight_floor_for_a_perfect_prediction():
    """e+- = 0 exactly: the weight floors at 1e-5 and the loss is 0, not NaN."""
    x0 = torch.tensor([[1.0, 2.0]])
    noise = torch.tensor([[0.5, -1.0]])
    t = torch.tensor([0.4])
    x_t = (1 - t) * x0 + t * noise
    v = noise - x0
    loss, _ = nft_loss(v, v.clone(), x_t, x0, t, torch.tensor([0.8]), beta=1.0)
    assert loss.item() == 0.0


def test_bf16_inputs_are_computed_in_fp32():
    args = [a.bfloat16() for a in _random(2)]
    loss, m = nft_loss(*args, beta=0.5)
    ref, _ = nft_loss(*[a.float() for a in args], beta=0.5)
    assert loss.dtype == torch.float32 and m["positive_loss"].dtype == torch.float32
    assert torch.equal(loss, ref)


def test_bad_inputs_raise():
    v, v_old, x_t, x0, t, r = _oracle()
    with pytest.raises(ValueError, match="beta"):
        nft_loss(v, v_old, x_t, x0, t, r, beta=0.0)
    with pytest.raises(ValueError, match="share one"):
        nft_loss(v, v_old[:1], x_t, x0, t, r, beta=1.0)
    with pytest.raises(ValueError, match=r"t \(1,\)"):
        nft_loss(v, v_old, x_t, x0, t[:1], r, beta=1.0)
