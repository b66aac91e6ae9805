"""fgrpo.core.schedule: bit-equality with diffusers' scheduler + pipeline, and the SDE window."""

import math
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from fgrpo.core import schedule
from fgrpo.core.schedule import lr_multiplier
from fgrpo.models import qwen_image, sd3

# The models' scheduler configs and the keywords the models derive from them for core.schedule.
QWEN_IMAGE_SCHEDULER = qwen_image.SCHEDULER_CONFIG
QWEN = qwen_image.schedule_kwargs(QWEN_IMAGE_SCHEDULER)
SD35_SCHEDULER = sd3.SCHEDULER_CONFIG
SD35_SHIFT = SD35_SCHEDULER["shift"]


def _diffusers_qwen(num_steps, image_seq_len):
    """What QwenImagePipeline.__call__ does (diffusers 0.40, step 5 "Prepare timesteps")."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(QWEN_IMAGE_SCHEDULER)
    assert isinstance(scheduler, FlowMatchEulerDiscreteScheduler)  # not the (scheduler, unused kwargs) pair
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    c = scheduler.config
    mu = calculate_shift(image_seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)  # pyright: ignore[reportAttributeAccessIssue] - a FrozenDict: keys are attributes
    retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
    assert isinstance(scheduler.sigmas, torch.Tensor)
    return scheduler.sigmas


def _diffusers_sd3(num_steps, config=SD35_SCHEDULER):
    """What StableDiffusion3Pipeline.__call__ does: no custom sigmas, no dynamic shifting."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    assert isinstance(scheduler, FlowMatchEulerDiscreteScheduler)  # not the (scheduler, unused kwargs) pair
    retrieve_timesteps(scheduler, num_steps, "cpu")
    assert isinstance(scheduler.sigmas, torch.Tensor)
    return scheduler.sigmas


# image_seq_len = (H / 16) * (W / 16): 256 px -> 256, 512 -> 1024, 1024 -> 4096, 1328 -> 6889, and off-range.
@pytest.mark.parametrize("num_steps", [2, 3, 10, 28, 50])
@pytest.mark.parametrize("image_seq_len", [64, 256, 1024, 4096, 6889, 8192, 10000])
def test_qwen_image_sigmas_equal_diffusers_bit_for_bit(num_steps, image_seq_len):
    ours = schedule.qwen_image_sigmas(num_steps, image_seq_len, **QWEN)
    ref = _diffusers_qwen(num_steps, image_seq_len)
    assert ours.dtype == torch.float32 and ours.shape == (num_steps + 1,)
    assert torch.equal(ours, ref)
    assert ours[0] == 1 and ours[-1] == 0 and ours[-2] == pytest.approx(0.02, abs=1e-6)


@pytest.mark.parametrize("num_steps", [1, 2, 10, 28, 40, 50])
def test_sd3_sigmas_equal_diffusers_bit_for_bit(num_steps):
    ours = schedule.sd3_sigmas(num_steps, SD35_SHIFT)
    assert ours.dtype == torch.float32 and ours.shape == (num_steps + 1,)
    assert torch.equal(ours, _diffusers_sd3(num_steps))


@pytest.mark.parametrize("shift", [1.0, 2.5, 5.0])
def test_sd3_sigmas_other_shifts_equal_diffusers(shift):
    assert torch.equal(
        schedule.sd3_sigmas(12, shift), _diffusers_sd3(12, {"num_train_timesteps": 1000, "shift": shift})
    )


def test_schedules_decrease_strictly():
    for s in (schedule.qwen_image_sigmas(20, 4096, **QWEN), schedule.sd3_sigmas(20, SD35_SHIFT)):
        assert (s[1:] < s[:-1]).all()


def test_schedule_bad_inputs():
    with pytest.raises(ValueError, match="num_steps"):
        schedule.sd3_sigmas(0, SD35_SHIFT)
    with pytest.raises(ValueError, match="num_steps"):
        schedule.qwen_image_sigmas(1, 1024, **QWEN)  # diffusers gives NaN here
    with pytest.raises(ValueError, match="image_seq_len"):
        schedule.qwen_image_sigmas(10, 0, **QWEN)


def test_sample_windows_are_contiguous_and_inside_the_range():
    g = torch.Generator().manual_seed(0)
    w = schedule.sample_windows(4000, 3, 2, 9, g)
    assert w.shape == (4000, 3) and w.dtype == torch.int64
    assert torch.equal(w - w[:, :1], torch.arange(3).expand(4000, 3))
    assert int(w.min()) == 2 and int(w.max()) == 8
    # start uniform on {2, ..., 6}: each of 5 values has 800 expected hits, sd ~ 25.
    counts = torch.bincount(w[:, 0] - 2, minlength=5)
    assert counts.shape == (5,) and ((counts - 800).abs() < 150).all()


def test_sample_windows_depend_only_on_the_generator():
    a = schedule.sample_windows(16, 2, 0, 5, torch.Generator().manual_seed(7))
    torch.manual_seed(123)
    b = schedule.sample_windows(16, 2, 0, 5, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_sample_windows_full_range_has_one_choice():
    w = schedule.sample_windows(3, 4, 1, 5, torch.Generator().manual_seed(0))
    assert torch.equal(w, torch.tensor([[1, 2, 3, 4]] * 3))


@pytest.mark.parametrize("size,lo,hi", [(0, 0, 5), (3, 2, 4), (2, -1, 5)])
def test_sample_windows_bad_range(size, lo, hi):
    with pytest.raises(ValueError):
        schedule.sample_windows(2, size, lo, hi, torch.Generator())


def test_window_mask():
    w = torch.tensor([[0, 1], [3, 4]])
    ref = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(schedule.window_mask(w, 5), ref)
    with pytest.raises(ValueError, match="outside"):
        schedule.window_mask(w, 4)


# MixGRPO's recipe (scripts/finetune/finetune_flux_grpo_MixGRPO.sh): 25 steps, group_size 4, iters_per_group 25,
# prog_overlap_step 1.
MIXGRPO: dict[str, Any] = {"num_steps": 25, "window_size": 4, "iters_per_window": 25, "stride": 1}


@pytest.mark.parametrize(
    ("step", "window"),
    [
        (0, [0, 1, 2, 3]),
        (24, [0, 1, 2, 3]),  # 25 training steps at each position
        (25, [1, 2, 3, 4]),
        (299, [11, 12, 13, 14]),  # the recipe's last step (max_train_steps 300)
        (499, [19, 20, 21, 22]),
        (500, [20, 21, 22, 23]),  # the last full window before step 24 (sigma_24 -> 0)
        (525, [20, 21, 22, 23]),  # the reference would shrink to [21, 22] here; ours stays W = 4
        (10**6, [20, 21, 22, 23]),
    ],
)
def test_sliding_window_mixgrpo_recipe(step, window):
    assert schedule.sliding_window(step, **MIXGRPO) == window


def test_sliding_window_stride_lo_and_clamp_by_hand():
    """N = 10, W = 3, 2 steps per position, stride 2, lo = 1: starts 1, 3, 5, then min(7, 9 - 3) = 6 for good."""
    kw: dict[str, Any] = {"num_steps": 10, "window_size": 3, "iters_per_window": 2, "stride": 2, "lo": 1}
    got = [schedule.sliding_window(k, **kw) for k in range(8)]
    assert got == [[1, 2, 3]] * 2 + [[3, 4, 5]] * 2 + [[5, 6, 7]] * 2 + [[6, 7, 8]] * 2
    # stride 0 freezes the window at lo (MixGRPO-Flash*); a window that just fits never moves.
    assert schedule.sliding_window(10**4, **{**kw, "stride": 0}) == [1, 2, 3]
    assert schedule.sliding_window(7, num_steps=5, window_size=4, iters_per_window=1) == [0, 1, 2, 3]


def test_sliding_window_always_holds_w_steps_inside_the_range():
    for step in range(0, 400, 7):
        w = schedule.sliding_window(step, num_steps=12, window_size=3, iters_per_window=5, stride=2, lo=2)
        assert w == list(range(w[0], w[0] + 3)) and 2 <= w[0] and w[-1] < 11


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window_size": 0}, "window_size"),
        ({"iters_per_window": 0}, "iters_per_window"),
        ({"stride": -1}, "stride"),
        ({"lo": -1}, "lo"),
        ({"step": -1}, "step"),
        ({"step": 1.5}, "step"),
        ({"num_steps": 0}, "num_steps"),
        ({"window_size": 25}, "does not fit"),
        ({"lo": 21}, "does not fit"),
    ],
)
def test_sliding_window_bad_inputs(kwargs, match):
    args = {"step": 0, **MIXGRPO} | kwargs
    step = args.pop("step")
    with pytest.raises(ValueError, match=match):
        schedule.sliding_window(step, **args)


def test_stratified_steps_one_per_stratum():
    """[2, 12) in K=4 strata: [2, 4), [4, 7), [7, 9), [9, 12) (edges 2 + s*10//4 = 2, 4, 7, 9, 12)."""
    g = torch.Generator().manual_seed(0)
    got = schedule.stratified_steps(1000, 4, 2, 12, g, shared=False)
    assert got.shape == (1000, 4) and got.dtype == torch.long
    for s, (a, b) in enumerate([(2, 4), (4, 7), (7, 9), (9, 12)]):
        assert set(got[:, s].tolist()) == set(range(a, b))  # every step of the stratum occurs, nothing else
    everything = schedule.stratified_steps(3, 5, 0, 5, g, shared=False)
    assert torch.equal(everything, torch.arange(5).expand(3, 5))  # K = n: each step once
    shared = schedule.stratified_steps(6, 3, 0, 9, g, shared=True)
    assert (shared == shared[0]).all()
    with pytest.raises(ValueError, match="1 <= k <= hi - lo"):
        schedule.stratified_steps(2, 4, 0, 3, g, shared=True)


# ------------------------------------------------------------------------------------------------------
# MixGRPO-Flash's compressed ODE tail


@pytest.mark.parametrize(
    ("num_steps", "last", "ratio", "positions"),
    [
        (10, 1, 0.4, [2.0, 9.0]),  # M = floor(9 * 0.4) = 3 points: 2, 9, then the terminal 0
        (10, 1, 0.2, [2.0]),  # floor(1.8) = 1 point would stop at sigma_2 > 0: at least one step to 0
        (10, 1, 1.0, [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]),  # the model's own grid
        (10, 8, 0.4, [9.0]),
        (10, 9, 0.4, []),  # the window's last step already lands on 0
        (
            25,
            3,
            0.4,
            [4.0, 4 + 20 / 6, 4 + 40 / 6, 14.0, 4 + 80 / 6, 4 + 100 / 6, 24.0],
        ),  # floor(8.8) = 8 points
    ],
)
def test_compressed_tail_by_hand(num_steps, last, ratio, positions):
    out = schedule.compressed_tail(num_steps, last, ratio)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.tensor(positions, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_steps": 10, "last": 10, "ratio": 0.4}, "last=10"),
        ({"num_steps": 10, "last": -1, "ratio": 0.4}, "last=-1"),
        ({"num_steps": 10, "last": 2, "ratio": 0.0}, "ratio=0.0"),
        ({"num_steps": 10, "last": 2, "ratio": 1.5}, "ratio=1.5"),
        ({"num_steps": 0, "last": 0, "ratio": 0.4}, "num_steps"),
    ],
)
def test_compressed_tail_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        schedule.compressed_tail(**kwargs)


def _qwen_at(num_steps, seq_len):
    return lambda u: schedule.qwen_image_sigmas_at(u, num_steps, seq_len, **QWEN)


def _sd3_at(num_steps):
    return lambda u: schedule.sd3_sigmas_at(u, num_steps, SD35_SHIFT)


@pytest.mark.parametrize("num_steps", [2, 7, 10, 25])
def test_sigmas_at_integer_positions_is_the_grid_bit_for_bit(num_steps):
    """At integer positions the schedules at fractional steps are the grids themselves (which equal diffusers'),
    so the ratio-1 tail is the model's own grid after the window."""
    grids = [
        (_qwen_at(num_steps, 1024), schedule.qwen_image_sigmas(num_steps, 1024, **QWEN)),
        (_sd3_at(num_steps), schedule.sd3_sigmas(num_steps, SD35_SHIFT)),
    ]
    for at, grid in grids:
        assert torch.equal(at(torch.arange(num_steps)), grid[:-1])
        for last in range(num_steps):
            assert torch.equal(at(schedule.compressed_tail(num_steps, last, 1.0)), grid[last + 1 : -1])


def test_sigmas_at_fractional_positions_follow_the_shifted_time_in_fp64():
    """Between grid steps the unshifted time is affine in the position, then shifted as the grid (fp64 closed
    forms of the two shifts, Qwen-Image's stretch scale taken from its own grid's last nonzero sigma)."""
    n, seq_len = 10, 1024
    u = torch.tensor([0.0, 0.5, 2.25, 4.0 + 1 / 3, 8.9, 9.0], dtype=torch.float64)

    e = math.exp(schedule.resolution_mu(seq_len, **{k: v for k, v in QWEN.items() if k != "shift_terminal"}))

    def shifted(t):
        return e * t / (e * t + 1 - t)

    t = 1 + u * (1 / n - 1) / (n - 1)
    scale = (1 - shifted(torch.tensor(1 / n, dtype=torch.float64))) / (1 - QWEN["shift_terminal"])
    qwen_ref = 1 - (1 - shifted(t)) / scale
    torch.testing.assert_close(_qwen_at(n, seq_len)(u).double(), qwen_ref, rtol=0, atol=1e-6)

    s = SD35_SHIFT
    sigma_min = s * 1e-3 / (1 + (s - 1) * 1e-3)
    t = 1 + u * (sigma_min - 1) / (n - 1)
    torch.testing.assert_close(_sd3_at(n)(u).double(), s * t / (1 + (s - 1) * t), rtol=0, atol=1e-6)


def test_sliding_window_range_end_and_roll_back_by_hand():
    """N = 10, W = 2 in [0, 5), one step per position: starts 0, 1, 2, 3 (3 = 5 - W, the last that fits), then
    roll_back restarts at 0 where the plain window stays at 3; stride 2 from lo 1 in [1, 8): starts 1, 3, 5, 1."""
    kw: dict[str, Any] = {"num_steps": 10, "window_size": 2, "iters_per_window": 1, "hi": 5}
    rolled = [schedule.sliding_window(k, roll_back=True, **kw)[0] for k in range(10)]
    assert rolled == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert [schedule.sliding_window(k, **kw)[0] for k in range(6)] == [0, 1, 2, 3, 3, 3]
    kw2: dict[str, Any] = {
        "num_steps": 10,
        "window_size": 2,
        "iters_per_window": 3,
        "stride": 2,
        "lo": 1,
        "hi": 8,
    }
    assert [schedule.sliding_window(k, roll_back=True, **kw2)[0] for k in range(0, 12, 3)] == [1, 3, 5, 1]
    # stride 0 never moves, rolled back or not; a range ending past N - 1 is refused
    assert schedule.sliding_window(50, roll_back=True, **{**kw, "stride": 0}) == [0, 1]
    with pytest.raises(ValueError, match="hi=10 must be <= num_steps - 1"):
        schedule.sliding_window(0, num_steps=10, window_size=2, iters_per_window=1, hi=10)
    with pytest.raises(ValueError, match="does not fit"):
        schedule.sliding_window(0, num_steps=10, window_size=3, iters_per_window=1, lo=3, hi=5)


def test_lr_multiplier_hand_computed():
    f = partial(lr_multiplier, warmup=2, decay_steps=6, min_ratio=0.1)
    # warm-up: (k+1)/2, then 1 at k=2 where the decay starts, floor 0.1 from k=6 on
    assert [f(k, schedule="constant") for k in range(8)] == [0.5, 1, 1, 1, 1, 1, 1, 1]
    linear = [f(k, schedule="linear") for k in range(8)]
    assert linear == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1])
    cosine = [f(k, schedule="cosine") for k in range(8)]
    # halfway (k=4) the cosine is at the mid-point 0.55; a quarter in, 0.1 + 0.9 * (1 + cos(pi/4)) / 2
    assert cosine == pytest.approx(
        [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + 2**-0.5), 0.55, 0.1 + 0.45 * (1 - 2**-0.5), 0.1, 0.1]
    )
