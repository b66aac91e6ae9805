"""fgrpo.core.grpo: advantages (hypothesis), loss gradients (torch.func), KL and the per-prompt tracker."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fgrpo.core import grpo, sde

FAST = settings(max_examples=25, deadline=None)


INTS = st.integers(-5, 5)


@st.composite
def grouped_rewards(draw, values: st.SearchStrategy[float] = INTS):
    g = draw(st.integers(1, 6))
    n = draw(st.integers(1, 5))
    r = draw(st.lists(values, min_size=g * n, max_size=g * n))
    return torch.tensor(r, dtype=torch.float32), g


def _slow_advantages(r, g, std, eps):
    r = r.tolist()
    groups = [r[i : i + g] for i in range(0, len(r), g)]
    out = []
    for grp in groups:
        mu = statistics.fmean(grp)
        s = {"group": statistics.pstdev(grp), "global": statistics.pstdev(r), "none": 1.0}[std]
        s = s + eps if std != "none" else 1.0
        out += [0.0 if max(grp) == min(grp) else (x - mu) / s for x in grp]
    return torch.tensor(out)


@FAST
@given(grouped_rewards(values=st.floats(-10, 10)), st.sampled_from(["group", "global", "none"]))
def test_advantages_match_a_slow_loop(data, std):
    r, g = data
    torch.testing.assert_close(
        grpo.group_advantages(r, g, std=std), _slow_advantages(r, g, std, 1e-4), rtol=1e-4, atol=1e-4
    )


@FAST
@given(grouped_rewards(), st.floats(0.1, 10), st.floats(-100, 100), st.sampled_from(["group", "global"]))
def test_advantages_are_shift_and_scale_invariant(data, a, b, std):
    r, g = data
    base = grpo.group_advantages(r, g, std=std, eps=0.0)
    moved = grpo.group_advantages(a * r + b, g, std=std, eps=0.0)
    # fp32 rounding of a*r + b, relative to the smallest nonzero spread of integer rewards times a.
    torch.testing.assert_close(moved, base, rtol=1e-3, atol=2e-3)


@FAST
@given(grouped_rewards())
def test_advantages_bounds_and_moments(data):
    r, g = data
    a = grpo.group_advantages(r, g, std="group", eps=0.0).view(-1, g)
    assert (a.abs() <= math.sqrt(g - 1) + 1e-5).all()  # max |z-score| of g values with ddof 0
    torch.testing.assert_close(a.mean(1), torch.zeros(a.shape[0]), rtol=0, atol=1e-5)
    spread = r.view(-1, g).amax(1) > r.view(-1, g).amin(1)
    if spread.any() and g > 1:
        torch.testing.assert_close(
            a[spread].std(1, correction=0), torch.ones(int(spread.sum())), rtol=1e-5, atol=1e-5
        )


@FAST
@given(
    st.floats(-1e6, 1e6, allow_subnormal=False),
    st.integers(1, 8),
    st.sampled_from(["group", "global", "none"]),
)
def test_constant_group_gets_exactly_zero(value, g, std):
    r = torch.cat([torch.full((g,), value), torch.arange(g, dtype=torch.float32)])
    a = grpo.group_advantages(r, g, std=std)
    assert torch.equal(a[:g], torch.zeros(g))
    assert torch.isfinite(a).all()


def test_advantages_bad_inputs():
    with pytest.raises(ValueError, match="groups of 4"):
        grpo.group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="std"):
        grpo.group_advantages(torch.zeros(4), 2, std="batch")  # pyright: ignore[reportArgumentType] - deliberately invalid


# --- clipped policy loss ------------------------------------------------------------------------------------
EPS = 0.2


def _loss(log_prob, old, adv, **kw):
    return grpo.clipped_policy_loss(log_prob, old, adv, clip_range=EPS, **kw)


def test_loss_gradient_is_zero_where_clipped_and_minus_a_rho_elsewhere():
    old = torch.zeros(6)
    log_ratio = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.05, -0.05])  # rho = e^{...}
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, -3.0])
    # clipped: A>0 & rho>1+eps, A<0 & rho<1-eps. Active: the other two sides and the band.
    active = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    grad = torch.func.grad(lambda lp: _loss(lp, old, adv)[0])(log_ratio)
    torch.testing.assert_close(grad, -adv * log_ratio.exp() * active / 6)


@FAST
@given(st.integers(0, 10_000))
def test_loss_gradient_through_a_model(seed):
    # log_prob = sde.log_prob of a fixed x under mean theta: the chain rule must give
    # d loss / d theta = sum_b -A_b rho_b [unclipped_b] d log_prob_b / d theta / B.
    g = torch.Generator().manual_seed(seed)
    B, D = 5, 3
    x, old_mean = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
    theta = old_mean + 0.3 * torch.randn(B, D, generator=g)
    std = torch.full((B, 1), 0.7)
    adv = torch.randn(B, generator=g) * 2
    old = sde.log_prob(x, old_mean, std)

    def log_prob(th):
        return sde.log_prob(x, th, std)

    grad = torch.func.grad(lambda th: _loss(log_prob(th), old, adv)[0])(theta)
    rho = (log_prob(theta) - old).exp()
    a = adv.clamp(-5, 5)
    clipped = ((a > 0) & (rho > 1 + EPS)) | ((a < 0) & (rho < 1 - EPS))
    jac = torch.func.jacrev(log_prob)(theta)  # [B, B, D]
    ref = torch.einsum("b,bij->ij", -a * rho * (~clipped) / B, jac)
    torch.testing.assert_close(grad, ref)


@FAST
@given(
    st.lists(st.tuples(st.floats(-30, 30), st.floats(-8, 8)), min_size=1, max_size=8),
    st.floats(0.01, 0.5),
)
def test_loss_is_bounded_by_the_clip(pairs, eps):
    # However far the ratio moves, a sample gains at most A (1 + eps) (A > 0) or loses at least |A| (1 - eps).
    log_ratio = torch.tensor([p[0] for p in pairs])
    adv = torch.tensor([p[1] for p in pairs])
    loss, m = grpo.clipped_policy_loss(log_ratio, torch.zeros_like(log_ratio), adv, clip_range=eps)
    a = adv.clamp(-5, 5)
    floor = torch.where(a > 0, -a * (1 + eps), -a * (1 - eps)).mean()
    assert torch.isfinite(loss) and loss >= floor - 1e-5
    assert 0 <= m["clip_frac"] <= 1


def test_loss_vmap_over_single_samples_equals_batched():
    g = torch.Generator().manual_seed(3)
    lp, old, adv = (
        torch.randn(8, generator=g) * 0.3,
        torch.randn(8, generator=g) * 0.3,
        torch.randn(8, generator=g) * 4,
    )

    def one(lp, old, adv):
        return _loss(lp[None], old[None], adv[None])[0]

    torch.testing.assert_close(torch.func.vmap(one)(lp, old, adv).mean(), _loss(lp, old, adv)[0])
    g1 = torch.func.vmap(torch.func.grad(one))(lp, old, adv) / 8
    torch.testing.assert_close(g1, torch.func.grad(lambda x: _loss(x, old, adv)[0])(lp))


def test_loss_on_policy_value_and_advantage_clamp():
    lp = torch.randn(4)
    adv = torch.tensor([10.0, -10.0, 1.0, 2.0])
    loss, m = _loss(lp, lp.clone(), adv)
    assert loss.item() == pytest.approx(-(5 - 5 + 1 + 2) / 4)
    assert m["ratio_mean"] == 1 and m["clip_frac"] == 0 and m["approx_kl"] == 0
    loss, _ = _loss(lp, lp.clone(), adv, adv_clip_max=1.0)
    assert loss.item() == pytest.approx(-(1 - 1 + 1 + 1) / 4)


def test_loss_metrics():
    lp, old = torch.log(torch.tensor([0.5, 1.0, 1.1, 2.0])), torch.zeros(4)
    adv = torch.ones(4)
    loss, m = _loss(lp, old, adv)
    assert all(not v.requires_grad and v.ndim == 0 for v in m.values())
    torch.testing.assert_close(m["ratio_min"], torch.tensor(0.5))
    torch.testing.assert_close(m["ratio_max"], torch.tensor(2.0))
    assert m["clip_frac"].item() == 0.5
    torch.testing.assert_close(m["approx_kl"], 0.5 * (lp**2).mean())
    per = -torch.minimum(lp.exp(), torch.tensor(1 + EPS))  # A = 1: max(-rho, -clip(rho)) = -min(rho, 1+eps)
    torch.testing.assert_close(loss, per.mean())


def test_loss_huge_log_ratio_stays_finite():
    loss, m = _loss(torch.tensor([1e4, -1e4]), torch.zeros(2), torch.tensor([-1.0, 1.0]))
    assert torch.isfinite(loss) and torch.isfinite(m["ratio_max"])


def test_grpo_guard_ratio_norm_closed_form():
    # x_next = old_mean + std z  =>  normalised log-ratio = mean(z * (mean - old_mean)), for any std.
    g = torch.Generator().manual_seed(4)
    B, D = 6, 10
    old_mean, mean = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
    std = torch.rand(B, 1, generator=g) + 0.1
    z = torch.randn(B, D, generator=g)
    x = sde.sample(old_mean, std, z)
    lp, old = sde.log_prob(x, mean, std), sde.log_prob(x, old_mean, std)
    adv = torch.ones(B)
    loss, m = grpo.clipped_policy_loss(
        lp, old, adv, clip_range=100.0, ratio_norm=True, mean=mean, old_mean=old_mean, std=std
    )
    rho = (z * (mean - old_mean)).mean(1).exp()
    torch.testing.assert_close(loss, -rho.mean())
    torch.testing.assert_close(m["ratio_mean"], rho.mean())
    with pytest.raises(ValueError, match="ratio_norm"):
        grpo.clipped_policy_loss(lp, old, adv, clip_range=0.1, ratio_norm=True)


def test_loss_bad_inputs():
    with pytest.raises(ValueError, match="clip_range"):
        grpo.clipped_policy_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=0.0)
    with pytest.raises(ValueError, match="must all be"):
        grpo.clipped_policy_loss(torch.zeros(2), torch.zeros(3), torch.zeros(2), clip_range=0.1)


# --- KL ---------------------------------------------------------------------------------------------------
def test_exact_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(5)
    mean, ref = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    std = torch.rand(3, 1, 1, generator=g) + 0.2
    p = torch.distributions.Normal(mean, std.expand_as(mean))
    q = torch.distributions.Normal(ref, std.expand_as(ref))
    kl = torch.distributions.kl_divergence(p, q).flatten(1)
    torch.testing.assert_close(grpo.gaussian_kl(mean, ref, std), kl.mean(1))
    torch.testing.assert_close(grpo.gaussian_kl(mean, ref, std, reduce="sum"), kl.sum(1))
    assert torch.equal(grpo.gaussian_kl(mean, mean, std), torch.zeros(3))


def test_flow_grpo_kl_omits_the_sqrt_dt_factor():
    # flow_grpo: ((mean - ref)^2).mean / (2 s_t^2), s_t = std / sqrt(sigma - sigma_next).
    g = torch.Generator().manual_seed(6)
    x, v, v_ref = (torch.randn(2, 4, 3, generator=g) for _ in range(3))
    sigma, sigma_next = torch.tensor([0.8, 0.5]), torch.tensor([0.7, 0.2])
    mean, std = sde.step_mean_std(x, v, sigma, sigma_next, noise_level=0.7, kind="flow_sde")
    ref_mean, _ = sde.step_mean_std(x, v_ref, sigma, sigma_next, noise_level=0.7, kind="flow_sde")
    s_t = 0.7 * torch.sqrt(sigma / (1 - sigma))
    expected = ((mean - ref_mean) ** 2).mean((1, 2)) / (2 * s_t**2)
    got = grpo.gaussian_kl(mean, ref_mean, std, kind="flow_grpo", step_size=sigma - sigma_next)
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="step_size"):
        grpo.gaussian_kl(mean, ref_mean, std, kind="flow_grpo")


def test_velocity_kl_by_hand():
    """Rows [1, 2] - [0, 0] and [1, 1] - [1, 3]: means of squares (1 + 4) / 2 = 2.5 and (0 + 4) / 2 = 2."""
    from fgrpo.core.grpo import velocity_kl

    v = torch.tensor([[1.0, 2.0], [1.0, 1.0]], requires_grad=True)
    v_ref = torch.tensor([[0.0, 0.0], [1.0, 3.0]], requires_grad=True)
    kl = velocity_kl(v, v_ref)
    assert kl.tolist() == [2.5, 2.0]
    kl.sum().backward()
    # d/dv mean((v - r)^2) = 2 (v - r) / n, n = 2; nothing flows into the reference
    assert v.grad is not None and v.grad.tolist() == [[1.0, 2.0], [0.0, -2.0]]
    assert v_ref.grad is None
    with pytest.raises(ValueError, match="one \\[B, ...\\] shape"):
        velocity_kl(v, v_ref[:1])
