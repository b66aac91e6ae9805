"""fgrpo.core.sde: log-density against torch.distributions, Euler limits, and closed-form marginals."""

import math
from typing import cast

import pytest
import torch
from diffusers.schedulers.scheduling_dpmsolver_multistep import DPMSolverMultistepScheduler
from diffusers.schedulers.scheduling_utils import SchedulerOutput

from fgrpo.core import sde

SDE_KINDS = ("flow_sde", "cps", "dance_sde")


def _batch(seed=0, shape=(4, 3, 5, 6)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    sigma = torch.tensor([1.0, 0.8, 0.5, 0.1])
    sigma_next = torch.tensor([0.9, 0.6, 0.45, 0.0])
    return x, v, sigma, sigma_next


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_log_prob_matches_torch_normal(reduce):
    g = torch.Generator().manual_seed(1)
    mean = torch.randn(5, 2, 3, 4, generator=g)
    std = torch.rand(5, 1, 1, 1, generator=g) + 0.05
    x = mean + std * torch.randn(mean.shape, generator=g) * 1.7
    ref = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x).flatten(1)
    ref = ref.mean(1) if reduce == "mean" else ref.sum(1)
    torch.testing.assert_close(sde.log_prob(x, mean, std, reduce=reduce), ref)


def test_log_prob_of_flat_batch_is_per_sample():
    mean, std, x = torch.zeros(3), torch.ones(3), torch.tensor([0.0, 1.0, 2.0])
    ref = torch.distributions.Normal(mean, std).log_prob(x)
    torch.testing.assert_close(sde.log_prob(x, mean, std), ref)


@pytest.mark.parametrize("kind", ["flow_sde", "dance_sde", "ode"])
def test_zero_noise_is_the_euler_step_bit_exactly(kind):
    x, v, sigma, sigma_next = _batch()
    mean, std = sde.step_mean_std(x, v, sigma, sigma_next, noise_level=0.0, kind=kind)
    euler = x + v * (sigma_next - sigma).view(-1, 1, 1, 1)
    assert torch.equal(mean, euler)
    assert torch.equal(std, torch.zeros(4, 1, 1, 1))


def test_zero_noise_cps_is_the_euler_step():
    x, v, sigma, sigma_next = _batch()
    mean, std = sde.step_mean_std(x, v, sigma, sigma_next, noise_level=0.0, kind="cps")
    torch.testing.assert_close(mean, x + v * (sigma_next - sigma).view(-1, 1, 1, 1), rtol=0, atol=2e-6)
    assert torch.equal(std, torch.zeros(4, 1, 1, 1))


def test_flow_sde_hand_computed_step():
    # sigma = 0.5 makes s_t = eta * sqrt(0.5 / 0.5) = eta.
    x, v = torch.tensor([[2.0]]), torch.tensor([[-1.0]])
    eta, s, sn = 0.6, 0.5, 0.3
    mean, std = sde.step_mean_std(
        x, v, torch.tensor([s]), torch.tensor([sn]), noise_level=eta, kind="flow_sde"
    )
    drift = -1.0 + eta**2 / (2 * s) * (2.0 + (1 - s) * -1.0)
    assert mean.item() == pytest.approx(2.0 + drift * (sn - s), rel=1e-6)
    assert std.item() == pytest.approx(eta * math.sqrt(s - sn), rel=1e-6)


def test_flow_sde_at_sigma_one_uses_sigma_next_in_the_denominator():
    # s_t = eta * sqrt(1 / (1 - sigma_next)), so std = s_t * sqrt(1 - sigma_next) = eta: finite, and what
    # flow_grpo gets with sigma_max = sigmas[1].
    x, v = torch.randn(2, 8), torch.randn(2, 8)
    sigma, sigma_next = torch.tensor([1.0, 1.0]), torch.tensor([0.9, 0.75])
    mean, std = sde.step_mean_std(x, v, sigma, sigma_next, noise_level=0.7, kind="flow_sde")
    torch.testing.assert_close(std.flatten(), torch.tensor([0.7, 0.7]))
    s_t2 = 0.7**2 / (1 - sigma_next)[:, None]
    ref = x + (v + s_t2 / 2 * x) * (sigma_next - 1)[:, None]  # (1 - sigma) v vanishes at sigma = 1
    torch.testing.assert_close(mean, ref)


def test_dance_and_cps_hand_computed_std():
    x, v = torch.zeros(1, 3), torch.zeros(1, 3)
    s, sn = torch.tensor([0.8]), torch.tensor([0.5])
    _, std = sde.step_mean_std(x, v, s, sn, noise_level=0.4, kind="dance_sde")
    assert std.item() == pytest.approx(0.4 * math.sqrt(0.3), rel=1e-6)
    _, std = sde.step_mean_std(x, v, s, sn, noise_level=0.5, kind="cps")
    assert std.item() == pytest.approx(0.5 * math.sin(0.25 * math.pi), rel=1e-6)


@pytest.mark.parametrize("kind", sde.KINDS)
def test_per_sample_sigmas_equal_one_sample_at_a_time(kind):
    x, v, sigma, sigma_next = _batch(seed=3)
    eta = 0.0 if kind == "ode" else 0.7
    mean, std = sde.step_mean_std(x, v, sigma, sigma_next, noise_level=eta, kind=kind)
    for b in range(4):
        m1, s1 = sde.step_mean_std(
            x[b : b + 1], v[b : b + 1], sigma[b : b + 1], sigma_next[b : b + 1], noise_level=eta, kind=kind
        )
        assert torch.equal(m1, mean[b : b + 1]) and torch.equal(s1, std[b : b + 1])


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_vmap_over_single_samples_equals_batched(kind):
    x, v, sigma, _ = _batch(seed=4)
    sigma_next = torch.tensor([0.9, 0.6, 0.45, 0.05])  # cps has std 0 (no density) at sigma_next = 0
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))

    def one(x, v, s, sn, z):
        mean, std = sde.step_mean_std(x[None], v[None], s[None], sn[None], noise_level=0.7, kind=kind)
        return sde.log_prob(sde.sample(mean, std, z[None]), mean, std)[0]

    mean, std = sde.step_mean_std(x, v, sigma, sigma_next, noise_level=0.7, kind=kind)
    batched = sde.log_prob(sde.sample(mean, std, noise), mean, std)
    torch.testing.assert_close(torch.func.vmap(one)(x, v, sigma, sigma_next, noise), batched)


def test_log_prob_of_own_sample_matches_noise_density():
    # x_next = mean + std * z  =>  log_prob = mean(-z^2/2) - log std - log sqrt(2 pi), exactly.
    x, v, sigma, sigma_next = _batch(seed=6)
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    mean, std = sde.step_mean_std(x, v, sigma, sigma_next, noise_level=0.7, kind="flow_sde")
    lp = sde.log_prob(sde.sample(mean, std, z), mean, std)
    ref = (-(z**2) / 2).flatten(1).mean(1) - std.flatten().log() - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(lp, ref)


def test_bf16_inputs_give_fp32_outputs():
    x, v, sigma, sigma_next = _batch()
    mean, std = sde.step_mean_std(
        x.bfloat16(), v.bfloat16(), sigma, sigma_next, noise_level=0.7, kind="flow_sde"
    )
    assert mean.dtype == std.dtype == torch.float32
    assert sde.log_prob(mean.bfloat16(), mean, std).dtype == torch.float32


def test_bad_inputs_raise_clear_errors():
    x, v, sigma, sigma_next = _batch()
    with pytest.raises(ValueError, match="kind"):
        sde.step_mean_std(x, v, sigma, sigma_next, noise_level=0.7, kind="sde")  # pyright: ignore[reportArgumentType] - deliberately invalid
    with pytest.raises(ValueError, match="noise_level"):
        sde.step_mean_std(x, v, sigma, sigma_next, noise_level=-0.1, kind="flow_sde")
    with pytest.raises(ValueError, match="noise_level"):
        sde.step_mean_std(x, v, sigma, sigma_next, noise_level=1.5, kind="cps")
    with pytest.raises(ValueError, match="same shape"):
        sde.step_mean_std(x, v[:, :1], sigma, sigma_next, noise_level=0.7, kind="flow_sde")
    with pytest.raises(ValueError, match="one per sample"):
        sde.step_mean_std(x, v, sigma[:3], sigma_next[:3], noise_level=0.7, kind="flow_sde")
    with pytest.raises(ValueError, match="noise"):
        sde.sample(x, torch.ones(4, 1, 1, 1), x[:, :1])
    with pytest.raises(ValueError, match="reduce"):
        sde.log_prob(x, x, torch.ones(4, 1, 1, 1), reduce="max")  # pyright: ignore[reportArgumentType] - deliberately invalid


# --- Marginal preservation on Gaussian data ---------------------------------------------------------------
# Data x0 ~ N(m, S), x_t = (1 - t) x0 + t eps. Then x_t ~ N((1 - t) m, C_t), C_t = (1 - t)^2 S + t^2 I, and
# the flow's velocity E[eps - x0 | x_t] = (t I - (1 - t) S) C_t^-1 (x - (1 - t) m) - m, in closed form.


def _gaussian_velocity(m, S, t):
    """(A, b) with v(x) = x @ A.T + b at time t, fp32 (computed in fp64)."""
    eye = torch.eye(m.shape[0], dtype=torch.float64)
    C = (1 - t) ** 2 * S + t**2 * eye
    A = (t * eye - (1 - t) * S) @ torch.linalg.inv(C)
    return A.float(), (-(1 - t) * m @ A.T - m).float()


def _simulate(m, S, kind, noise_level, sigmas, n, seed, *, skip_drift_correction=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m.shape[0], generator=g)
    for s, sn in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        A, b = _gaussian_velocity(m, S, s)
        v = x @ A.T + b
        sig, sig_n = torch.full((n,), s), torch.full((n,), sn)
        mean, std = sde.step_mean_std(x, v, sig, sig_n, noise_level=noise_level, kind=kind)
        if skip_drift_correction:  # negative control: Euler mean plus the SDE's noise
            mean, _ = sde.step_mean_std(x, v, sig, sig_n, noise_level=0.0, kind="ode")
        x = sde.sample(mean, std, torch.randn(x.shape, generator=g))
    return x.double()


def _assert_gaussian_moments(x, mean, cov, z=5.0):
    """Sample mean and covariance within z standard errors (Gaussian sampling theory) of the truth."""
    n = x.shape[0]
    se_mean = (torch.diagonal(cov) / n).sqrt()
    assert ((x.mean(0) - mean).abs() <= z * se_mean).all(), (x.mean(0), mean, se_mean)
    emp = torch.cov(x.T, correction=0).reshape(cov.shape)
    d = torch.diagonal(cov)
    se_cov = ((d[:, None] * d[None, :] + cov**2) / n).sqrt()  # Var of a sample covariance entry
    assert ((emp - cov).abs() <= z * se_cov).all(), (emp, cov, se_cov)


CASES = {
    "1d": (torch.tensor([1.5], dtype=torch.float64), torch.tensor([[0.25]], dtype=torch.float64)),
    "2d": (
        torch.tensor([1.0, -2.0], dtype=torch.float64),
        torch.tensor([[0.5, 0.3], [0.3, 0.4]], dtype=torch.float64),
    ),
}
# 200 steps: the Euler-Maruyama bias measured with 400k particles is <= 0.0035 on any moment, about one
# standard error at 20k particles; the 5-SE tolerance leaves room for both.
N_PARTICLES, N_STEPS = 20_000, 200


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind,noise_level", [("flow_sde", 0.7), ("dance_sde", 0.7)])
def test_sde_preserves_the_data_marginals(case, kind, noise_level):
    m, S = CASES[case]
    sigmas = torch.linspace(1, 0, N_STEPS + 1)
    x = _simulate(m, S, kind, noise_level, sigmas, N_PARTICLES, seed=11)
    _assert_gaussian_moments(x, m, S)


@pytest.mark.parametrize("kind", ["flow_sde", "dance_sde"])
def test_sde_preserves_an_intermediate_marginal(kind):
    m, S = CASES["2d"]
    t = 0.4
    sigmas = torch.linspace(1, t, int(N_STEPS * 0.6) + 1)
    x = _simulate(m, S, kind, 0.7, sigmas, N_PARTICLES, seed=12)
    _assert_gaussian_moments(x, (1 - t) * m, (1 - t) ** 2 * S + t**2 * torch.eye(2, dtype=torch.float64))


def test_marginal_check_catches_a_missing_drift_correction():
    m, S = CASES["2d"]
    x = _simulate(
        m, S, "flow_sde", 0.7, torch.linspace(1, 0, N_STEPS + 1), N_PARTICLES, 11, skip_drift_correction=True
    )
    with pytest.raises(AssertionError):
        _assert_gaussian_moments(x, m, S)


@pytest.mark.parametrize("noise_level", [0.3, 0.8, 1.0])
def test_cps_with_point_mass_data_keeps_every_marginal(noise_level):
    # Data = the point x0: the exact velocity is (x - x0) / t, and each CPS state x_t' ~ N((1 - t') x0, t'^2 I),
    # whatever the step sizes (checked at every step of a coarse, uneven schedule).
    x0 = torch.tensor([1.5, -0.5], dtype=torch.float64)
    sigmas = torch.tensor([1.0, 0.93, 0.7, 0.5, 0.45, 0.2, 0.05, 0.0])
    n = 20_000
    g = torch.Generator().manual_seed(13)
    x = torch.randn(n, 2, generator=g)
    for s, sn in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        v = ((x.double() - x0) / s).float()
        mean, std = sde.step_mean_std(
            x, v, torch.full((n,), s), torch.full((n,), sn), noise_level=noise_level, kind="cps"
        )
        x = sde.sample(mean, std, torch.randn(x.shape, generator=g))
        if sn == 0:
            torch.testing.assert_close(x.double(), x0.expand(n, 2), rtol=0, atol=1e-5)
        else:
            _assert_gaussian_moments(x.double(), (1 - sn) * x0, sn**2 * torch.eye(2, dtype=torch.float64))


# --- DPM-Solver++(2M) ----------------------------------------------------------------------------------


def test_x0_prediction_inverts_the_interpolation():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    sigma = torch.tensor([1.0, 0.5, 0.1])
    x_t = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
    torch.testing.assert_close(
        sde.x0_prediction(x_t.bfloat16(), (noise - x0).bfloat16(), sigma), x0, atol=0.05, rtol=0
    )
    torch.testing.assert_close(sde.x0_prediction(x_t, noise - x0, sigma), x0)
    assert sde.x0_prediction(x_t.bfloat16(), x0.bfloat16(), sigma).dtype == torch.float32


# diffusers' set_timesteps builds its (unused here) DDPM sigmas through a numpy call numpy 2 deprecates.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(("num_steps", "shift"), [(6, 1.0), (10, 3.0), (20, 3.0)])
def test_dpmpp_2m_matches_diffusers_multistep_scheduler(num_steps, shift):
    """Both solvers integrate the same nonlinear velocity field on diffusers' own flow sigmas, each from its own
    state; every intermediate state agrees to fp32 rounding (measured max |diff| <= 1e-6 on states of size ~4;
    a first-order-only solver is 0.11 off at 10 steps)."""
    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        algorithm_type="dpmsolver++",
        solver_order=2,
        flow_shift=shift,
    )
    scheduler.set_timesteps(num_steps)
    sigmas = scheduler.sigmas
    g = torch.Generator().manual_seed(num_steps)
    x = torch.randn(3, 4, 5, 5, generator=g)
    c = torch.randn(3, 4, 5, 5, generator=g)

    def velocity(x, s):
        return torch.tanh(x) * (1 + s) - c

    x_ref, x_ours, x0_prev, sigma_prev = x.clone(), x.clone(), None, None
    for i, t in enumerate(scheduler.timesteps):
        # return_dict=True (the default) returns a SchedulerOutput; diffusers types it with the tuple form too
        x_ref = cast(SchedulerOutput, scheduler.step(velocity(x_ref, sigmas[i]), t, x_ref)).prev_sample
        sigma, sigma_next = sigmas[i].expand(3), sigmas[i + 1].expand(3)
        x0 = sde.x0_prediction(x_ours, velocity(x_ours, sigmas[i]), sigma)
        x_ours = sde.dpmpp_2m_step(x_ours, x0, x0_prev, sigma_prev, sigma, sigma_next)
        x0_prev, sigma_prev = x0, sigma
        torch.testing.assert_close(x_ours, x_ref, rtol=0, atol=2e-6)


def test_dpmpp_2m_is_exact_for_point_mass_data():
    """Data = the point x0*: the exact velocity (x - x0*) / sigma makes x0_pred = x0* at every step, and both
    orders land on the exact ODE path (1 - sigma') x0* + sigma' eps, on an uneven grid starting at sigma = 1."""
    g = torch.Generator().manual_seed(1)
    x0_star, eps = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    sigmas = [1.0, 0.93, 0.7, 0.5, 0.45, 0.2, 0.05, 0.0]
    x, x0_prev, sigma_prev = eps.clone(), None, None
    for s, sn in zip(sigmas[:-1], sigmas[1:]):
        sigma, sigma_next = torch.full((2,), s), torch.full((2,), sn)
        x0 = sde.x0_prediction(x, (x - x0_star) / s, sigma)
        x = sde.dpmpp_2m_step(x, x0, x0_prev, sigma_prev, sigma, sigma_next)
        x0_prev, sigma_prev = x0, sigma
        torch.testing.assert_close(x, (1 - sn) * x0_star + sn * eps, rtol=0, atol=1e-5)


def test_dpmpp_2m_order_and_final_step_by_hand():
    """sigma = 0.5 -> 0.25 (alpha 0.5 -> 0.75): lambda = 0 -> log 3, e^-h = 1/3, alpha_next (1 - e^-h) = 0.5.
    First order: x_next = 0.5 x_t + 0.5 x0. With sigma_prev = 0.8 (lambda = log(1/4)): r = log 4 / log 3 and
    D = x0 + (x0 - x0_prev) / (2 r). At sigma_next = 0 the step returns x0_pred bit for bit, previous or not."""
    x_t, x0, x0_prev = torch.tensor([[2.0, -4.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    s, sn, sp = torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([0.8])
    torch.testing.assert_close(sde.dpmpp_2m_step(x_t, x0, None, None, s, sn), torch.tensor([[1.5, -2.0]]))
    r = math.log(4) / math.log(3)
    d = x0 + (x0 - x0_prev) / (2 * r)
    torch.testing.assert_close(sde.dpmpp_2m_step(x_t, x0, x0_prev, sp, s, sn), 0.5 * x_t + 0.5 * d)
    zero = torch.tensor([0.0])
    assert torch.equal(sde.dpmpp_2m_step(x_t, x0, x0_prev, sp, s, zero), x0)
    assert torch.equal(sde.dpmpp_2m_step(x_t, x0, None, None, s, zero), x0)
    # Per-sample choice: one sample ends at 0 (first order), the other takes the 2M step.
    both = sde.dpmpp_2m_step(
        x_t.repeat(2, 1),
        x0.repeat(2, 1),
        x0_prev.repeat(2, 1),
        sp.repeat(2),
        s.repeat(2),
        torch.tensor([0.25, 0.0]),
    )
    torch.testing.assert_close(both, torch.cat([0.5 * x_t + 0.5 * d, x0]))


def test_dpmpp_2m_bad_inputs():
    x = torch.zeros(2, 3)
    s = torch.full((2,), 0.5)
    with pytest.raises(ValueError, match="together"):
        sde.dpmpp_2m_step(x, x, x, None, s, s / 2)
    with pytest.raises(ValueError, match="same shape"):
        sde.dpmpp_2m_step(x, x[:, :1], None, None, s, s / 2)


def test_forward_noise_endpoints_and_velocity_target():
    """x_t = (1 - s) x0 + s noise: x0 at s = 0, noise at s = 1, and the exact velocity noise - x0 points back to x0."""
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    sigma = torch.tensor([0.0, 0.3, 1.0])
    x_t = sde.forward_noise(x0, noise, sigma)
    assert torch.equal(x_t[0], x0[0]) and torch.equal(x_t[2], noise[2])
    torch.testing.assert_close(x_t[1], 0.7 * x0[1] + 0.3 * noise[1])
    torch.testing.assert_close(sde.x0_prediction(x_t, noise - x0, sigma), x0)
    assert sde.forward_noise(x0.bfloat16(), noise, sigma).dtype == torch.float32
