"""fgrpo.core.correction and the weighted Flow-GRPO loss: hand-computed oracles, a slow-loop reference,
boundaries, finiteness, no gradient."""

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fgrpo.core import correction as C
from fgrpo.core import grpo

FAST = settings(max_examples=25, deadline=None)

# old - behaviour = log w = [[0, -0.5], [1, 0]]: sample 0 sums to -0.5 (mean -0.25), sample 1 to 1 (mean 0.5).
OLD = torch.tensor([[0.0, -1.0], [1.0, 0.5]])
BEHAVIOUR = torch.tensor([[0.0, -0.5], [0.0, 0.5]])
E = math.exp


def _lw():
    return C.log_ratio(OLD, BEHAVIOUR)


def test_log_ratio_oracle():
    assert torch.equal(_lw(), torch.tensor([[0.0, -0.5], [1.0, 0.0]]))


def test_is_weights_oracle():
    """upper C = 2, entries r = exp(log w):
    token TIS:      [[1, e^-.5], [min(e, 2) = 2, 1]]
    sequence TIS:   sums -0.5, 1      -> [[e^-.5, e^-.5], [2, 2]]          (e^1 = 2.718 truncated)
    geometric TIS:  means -0.25, 0.5  -> [[e^-.25, e^-.25], [e^.5, e^.5]]  (1.649 < 2 kept)
    token mask [0.5, 2]:      [[1, e^-.5 = 0.607], [0 (2.718 > 2), 1]]
    token mask [0.7, 2]:      [[1, 0], [0, 1]]
    sequence mask [0.5, 2]:   [[e^-.5, e^-.5], [0, 0]]
    """
    lw = _lw()
    cases = [
        (dict(level="token"), [[1, E(-0.5)], [2, 1]]),
        (dict(level="sequence"), [[E(-0.5), E(-0.5)], [2, 2]]),
        (dict(level="geometric"), [[E(-0.25), E(-0.25)], [E(0.5), E(0.5)]]),
        (dict(level="token", mode="mask", lower=0.5), [[1, E(-0.5)], [0, 1]]),
        (dict(level="token", mode="mask", lower=0.7), [[1, 0], [0, 1]]),
        (dict(level="sequence", mode="mask", lower=0.5), [[E(-0.5), E(-0.5)], [0, 0]]),
    ]
    for kw, want in cases:
        got = C.is_weights(lw, upper=2.0, **kw)
        torch.testing.assert_close(
            got, torch.tensor(want, dtype=torch.float32), rtol=1e-6, atol=0, msg=str(kw)
        )


def test_rejection_mask_oracle():
    """k1 = -log w = [[0, .5], [-1, 0]];  k2 = [[0, .125], [.5, 0]];  k3 = [[0, e^-.5 - .5 = .1065], [e - 2, 0]].
    token k2 <= 0.2:             [[1, 1], [0, 1]]
    seq_sum k1 in [-0.6, 0.6]:   sums 0.5, -1      -> [[1, 1], [0, 0]]
    seq_mean k1 in [-0.6, 0.6]:  means 0.25, -0.5  -> all kept
    seq_max k3 <= 0.5:           maxes .1065, .718 -> [[1, 1], [0, 0]]
    token k3 >= 0.05 (lower only matters with a bound below): upper 1, lower 0.05 -> [[0, 1], [1, 0]]
    """
    lw = _lw()
    cases: list[tuple[dict[str, Any], list[list[int]]]] = [
        (dict(estimator="k2", level="token", upper=0.2), [[1, 1], [0, 1]]),
        (dict(estimator="k1", level="seq_sum", upper=0.6, lower=-0.6), [[1, 1], [0, 0]]),
        (dict(estimator="k1", level="seq_mean", upper=0.6, lower=-0.6), [[1, 1], [1, 1]]),
        (dict(estimator="k3", level="seq_max", upper=0.5), [[1, 1], [0, 0]]),
        (dict(estimator="k3", level="token", upper=1.0, lower=0.05), [[0, 1], [1, 0]]),
    ]
    for kw, want in cases:
        assert torch.equal(C.rejection_mask(lw, **kw), torch.tensor(want, dtype=torch.float32)), kw
    torch.testing.assert_close(
        C.divergence(lw, estimator="k3"), torch.tensor([[0.0, E(-0.5) - 0.5], [E(1) - 2, 0.0]])
    )


def test_metrics_oracle():
    """Token TIS at C = 2: w = [1, e^-.5, 2, 1], r = [1, e^-.5, e, 1].
    is_mean = (4 + e^-.5) / 4 = 1.1516, max 2, min e^-.5; frac_high = 1/4 (e > 2); frac_low = 0 (none < .5).
    ess = mean(w)^2 / mean(w^2) = 1.1516^2 / ((6 + e^-1) / 4) = 0.8331.
    gap = mean |log w| = 1.5 / 4, max 1; kl = mean(-log w) = -0.5 / 4; k3 = (e^-.5 - .5 + e - 2) / 4.
    chi2_token = (2 + e^-1 + e^2) / 4 - 1;  chi2_seq = (e^-1 + e^2) / 2 - 1.
    """
    lw = _lw()
    w = C.is_weights(lw, upper=2.0)
    m = C.correction_metrics(lw, w, upper=2.0)
    mean = (4 + E(-0.5)) / 4
    want = {
        "is_mean": mean,
        "is_max": 2.0,
        "is_min": E(-0.5),
        "is_frac_high": 0.25,
        "is_frac_low": 0.0,
        "is_frac_zero": 0.0,
        "is_ess": mean**2 / ((6 + E(-1)) / 4),
        "gap_abs_mean": 0.375,
        "gap_abs_max": 1.0,
        "kl": -0.125,
        "k3_kl": (E(-0.5) - 0.5 + E(1) - 2) / 4,
        "chi2_token": (2 + E(-1) + E(2)) / 4 - 1,
        "chi2_seq": (E(-1) + E(2)) / 2 - 1,
    }
    assert set(m) == set(want)
    for k, v in want.items():
        assert m[k].ndim == 0 and not m[k].requires_grad
        assert m[k].item() == pytest.approx(v, rel=1e-6, abs=1e-7), k
    masked = C.is_weights(lw, mode="mask", lower=0.7, upper=2.0)  # [[1, 0], [0, 1]]
    mm = C.correction_metrics(lw, masked, upper=2.0, lower=0.7)
    assert mm["is_frac_zero"].item() == 0.5 and mm["is_frac_low"].item() == 0.25
    assert mm["is_ess"].item() == pytest.approx(0.5)  # (1/2)^2 / (1/2): half the samples survive


def _slow_weights(lw, level, mode, upper, lower):
    out = []
    for row in lw.tolist():
        if level == "token":
            logs = row
        else:
            s = sum(row) if level == "sequence" else sum(row) / len(row)
            logs = [s] * len(row)
        r = [math.exp(max(-20.0, min(20.0, x))) for x in logs]
        if mode == "truncate":
            out.append([min(x, upper) for x in r])
        else:
            lo = 1 / upper if lower is None else lower
            out.append([x if lo <= x <= upper else 0.0 for x in r])
    return torch.tensor(out)


def _slow_mask(lw, estimator, level, upper, lower):
    out = []
    for row in lw.tolist():
        d = [{"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[estimator] for x in row]
        if level == "token":
            s = d
        else:
            agg = {"seq_sum": sum(d), "seq_mean": sum(d) / len(d), "seq_max": max(d)}[level]
            s = [agg] * len(d)
        out.append([float(x <= upper and (lower is None or x >= lower)) for x in s])
    return torch.tensor(out)


LOGS = st.lists(st.lists(st.floats(-3, 3), min_size=3, max_size=3), min_size=1, max_size=4)


@FAST
@given(
    LOGS,
    st.sampled_from(["token", "sequence", "geometric"]),
    st.sampled_from(["truncate", "mask"]),
    st.floats(1.05, 5.0),
    st.one_of(st.none(), st.floats(0.05, 1.0)),
)
def test_is_weights_match_slow_loop(rows, level, mode, upper, lower):
    lw = torch.tensor(rows)
    got = C.is_weights(lw, level=level, mode=mode, upper=upper, lower=lower)
    want = _slow_weights(lw, level, mode, upper, lower)
    # an entry within rounding of a mask bound may fall on either side; compare the rest
    r = _slow_weights(lw, level, "truncate", 1e30, None)
    lo = 1 / upper if lower is None else lower
    near = ((r - upper).abs() < 1e-5 * upper) | ((r - lo).abs() < 1e-5 * lo)
    torch.testing.assert_close(got[~near], want[~near], rtol=1e-5, atol=0)


@FAST
@given(
    LOGS,
    st.sampled_from(["k1", "k2", "k3"]),
    st.sampled_from(["token", "seq_sum", "seq_mean", "seq_max"]),
    st.floats(0.0, 2.0),
    st.one_of(st.none(), st.floats(-2.0, 0.0)),
)
def test_rejection_mask_matches_slow_loop(rows, estimator, level, upper, lower):
    if level == "seq_max" and estimator == "k1":
        with pytest.raises(ValueError, match="seq_max"):
            C.rejection_mask(torch.tensor(rows), estimator=estimator, level=level, upper=upper)
        return
    lw = torch.tensor(rows)
    got = C.rejection_mask(lw, estimator=estimator, level=level, upper=upper, lower=lower)
    want = _slow_mask(lw, estimator, level, upper, lower)
    s = _slow_stat(lw, estimator, level)
    near = ((s - upper).abs() < 1e-5) | ((s - (lower if lower is not None else -1e9)).abs() < 1e-5)
    assert torch.equal(got[~near], want[~near])


def _slow_stat(lw, estimator, level):
    out = []
    for row in lw.tolist():
        d = [{"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[estimator] for x in row]
        agg = {"token": None, "seq_sum": sum(d), "seq_mean": sum(d) / len(d), "seq_max": max(d)}[level]
        out.append(d if agg is None else [agg] * len(d))
    return torch.tensor(out)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_identical_policies_give_weight_one_exactly(level, mode):
    lp = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)) * 50 - 100
    lw = C.log_ratio(lp, lp.clone())
    assert torch.equal(C.is_weights(lw, level=level, mode=mode, upper=1.5), torch.ones(5, 3))
    m = C.correction_metrics(lw, torch.ones(5, 3), level=level, upper=1.5)
    assert m["gap_abs_max"].item() == 0 and m["is_ess"].item() == 1 and m["k3_kl"].item() == 0
    assert m["chi2_token"].item() == 0 and m["chi2_seq"].item() == 0
    for est in ("k2", "k3"):
        assert torch.equal(C.rejection_mask(lw, estimator=est, upper=0.0), torch.ones(5, 3))


def test_mask_bounds_are_inclusive():
    """log w = 0 gives r = 1 exactly: the bounds lower = upper = 1 keep exactly the untouched entries; the
    neighbouring floats on either side reject them."""
    lw = torch.tensor([[0.0, 1e-3], [-1e-3, 0.0]])
    assert torch.equal(
        C.is_weights(lw, mode="mask", lower=1.0, upper=1.0), torch.tensor([[1.0, 0], [0, 1.0]])
    )
    one = torch.tensor(1.0)
    up = torch.nextafter(one, torch.tensor(0.0)).item()  # the fp32 neighbours of 1, where the test is made
    lo = torch.nextafter(one, torch.tensor(2.0)).item()
    assert torch.equal(C.is_weights(lw, mode="mask", lower=0.5, upper=up).diagonal(), torch.zeros(2))
    assert torch.equal(C.is_weights(lw, mode="mask", lower=lo, upper=2.0).diagonal(), torch.zeros(2))
    assert torch.equal(C.rejection_mask(lw, estimator="k2", upper=0.0), torch.tensor([[1.0, 0], [0, 1.0]]))


def test_huge_log_ratios_stay_finite():
    old = torch.tensor([[0.0, 1e6], [-1e6, 3e4]])
    beh = torch.tensor([[-1e6, 0.0], [0.0, -3e4]])
    lw = C.log_ratio(old, beh)
    for level in ("token", "sequence", "geometric"):
        for mode in ("truncate", "mask"):
            w = C.is_weights(lw, level=level, mode=mode, upper=3.0)
            assert torch.isfinite(w).all() and (w >= 0).all() and (w <= 3.0).all()
        m = C.correction_metrics(lw, C.is_weights(lw, level=level), level=level)
        assert all(torch.isfinite(v) for v in m.values()), m
    for est in ("k1", "k2", "k3"):
        assert torch.isfinite(C.divergence(lw, estimator=est)).all()
    assert C.is_weights(lw, upper=3.0)[0, 0].item() == 3.0  # exp(20) truncated, not inf
    allzero = C.correction_metrics(lw, torch.zeros(2, 2))
    assert allzero["is_ess"].item() == 0 and allzero["is_frac_zero"].item() == 1


def test_no_gradient_through_weights():
    old = torch.tensor([[0.2, -0.3], [0.1, 0.4]], requires_grad=True)
    beh = torch.tensor([[0.0, 0.0], [0.3, -0.2]], requires_grad=True)
    lw = C.log_ratio(old, beh)
    assert not lw.requires_grad
    w = C.is_weights(lw, level="sequence")
    assert not w.requires_grad
    assert not C.normalize_weights(w).requires_grad
    assert not C.rejection_mask(lw, estimator="k3", upper=0.1).requires_grad


def test_weighted_policy_loss_oracle():
    """rho = 1 (log_prob = old), A = [1, -2, 0.5], clip 0.2, so the per-entry terms max(-A rho, -A clip(rho)) are
    -A = [-1, 2, -0.5]; w = [2, 0.5, 0]: L = (2 * -1 + 0.5 * 2 + 0 * -0.5) / 3 = -1/3, and dL/dlog_prob =
    -A w rho / B = [-2/3, 1/3, 0] (the masked entry passes nothing). The weight, which here carries a graph,
    gets no gradient."""
    old = torch.tensor([0.3, -1.0, 2.0])
    log_prob = old.clone().requires_grad_(True)
    weight = torch.tensor([2.0, 0.5, 0.0], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, metrics = grpo.clipped_policy_loss(log_prob, old, adv, clip_range=0.2, weight=weight * 1)
    assert loss.item() == pytest.approx(-1 / 3, abs=1e-7)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([-2 / 3, 1 / 3, 0.0]))
    assert weight.grad is None
    assert metrics["ratio_mean"].item() == 1.0  # the metrics describe the ratio, not the weight


@FAST
@given(st.integers(1, 6), st.integers(0, 2**16))
def test_weight_none_is_the_unweighted_loss_bit_for_bit(b, seed):
    """weight=None is mean_b max(-A rho, -A clip(rho)) as written before the weight existed (an independent
    transcription), and weight = 1 gives the same bits and the same gradient."""
    g = torch.Generator().manual_seed(seed)
    old, adv = torch.randn(b, generator=g), torch.randn(b, generator=g)
    lp = (old + 0.3 * torch.randn(b, generator=g)).requires_grad_(True)
    lp1 = lp.detach().clone().requires_grad_(True)
    loss, _ = grpo.clipped_policy_loss(lp, old, adv, clip_range=0.1)
    loss1, _ = grpo.clipped_policy_loss(lp1, old, adv, clip_range=0.1, weight=torch.ones(b))
    rho = torch.exp(lp.detach() - old)
    a = adv.clamp(-5, 5)
    reference = torch.maximum(-a * rho, -a * rho.clamp(0.9, 1.1)).mean()
    assert torch.equal(loss.detach(), reference) and torch.equal(loss1, loss)
    loss.backward()
    loss1.backward()
    assert lp.grad is not None and lp1.grad is not None
    assert torch.equal(lp.grad, lp1.grad)


def test_weighted_loss_microbatch_accumulation():
    """The training loop adds each (rows, window step j) piece's weighted mean times len(rows) / (B W); with the
    piece's weight[rows, j] that is mean_bj(w_bj l_bj) over the whole [B, W] batch."""
    g = torch.Generator().manual_seed(1)
    B, W = 6, 3
    w = torch.rand(B, W, generator=g)
    old, adv = torch.randn(B, W, generator=g), torch.randn(B, generator=g)
    lp = old + 0.05 * torch.randn(B, W, generator=g)
    pieces = torch.zeros(())
    for j in range(W):
        for rows in (torch.tensor([0, 3]), torch.tensor([1, 2, 5]), torch.tensor([4])):
            loss, _ = grpo.clipped_policy_loss(
                lp[rows, j], old[rows, j], adv[rows], clip_range=0.2, weight=w[rows, j]
            )
            pieces += loss * len(rows) / (B * W)
    rho = torch.exp(lp - old)
    a = adv[:, None]
    terms = torch.maximum(-a * rho, -a * rho.clamp(0.8, 1.2))
    torch.testing.assert_close(pieces, (w * terms).mean())


def test_normalize_weights():
    w = torch.tensor([[1.0, 3.0], [0.0, 0.0]])
    assert torch.equal(C.normalize_weights(w), torch.tensor([[1.0, 3.0], [0.0, 0.0]]))  # mean is 1
    assert torch.equal(C.normalize_weights(2 * w), w)
    assert torch.equal(C.normalize_weights(w, mean=torch.tensor(4.0)), w / 4)  # the all-ranks mean
    assert torch.equal(C.normalize_weights(torch.zeros(2, 2)), torch.zeros(2, 2))  # all masked: no NaN


def test_bf16_inputs_computed_in_fp32():
    old, beh = OLD.bfloat16(), BEHAVIOUR.bfloat16()
    lw = C.log_ratio(old, beh)
    assert lw.dtype == torch.float32
    assert C.is_weights(lw).dtype == torch.float32


def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"\[B, W\]"):
        C.log_ratio(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="same"):
        C.log_ratio(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="upper"):
        C.is_weights(torch.zeros(2, 2), upper=0.0)
    with pytest.raises(ValueError, match="lower <= upper"):
        C.is_weights(torch.zeros(2, 2), mode="mask", lower=3.0, upper=2.0)
    with pytest.raises(ValueError, match="level"):
        C.is_weights(torch.zeros(2, 2), level="seq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"weight \(2, 2\) must be \[B\]"):
        grpo.clipped_policy_loss(
            torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=0.1, weight=torch.ones(2, 2)
        )
