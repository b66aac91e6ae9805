"""Sigma schedules of the supported models, and the choice of each sample's SDE window.

The schedules reproduce, bit for bit, what diffusers 0.40's FlowMatchEulerDiscreteScheduler holds in
`.sigmas` after the model's pipeline has called `set_timesteps` (tests/core/test_schedule.py compares
them). That includes diffusers' precision: Qwen-Image's shift runs in fp32 (numpy fp32 arrays), SD3's in
fp64 then rounded to fp32, so we follow the same operation order and dtypes here.

The SDE window (MixGRPO / flow_grpo's `sde_window_size`): only W consecutive steps of each trajectory
are stochastic and trained, the rest are Euler steps; each sample draws its own window.
"""

from __future__ import annotations

import math

import torch


def _check_steps(num_steps: int) -> None:
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")


def _linspace_f64(start: float, stop: float, num: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """numpy.linspace's arithmetic in fp64 (start + i * step, last = stop); torch.linspace differs by ulps.

    positions: fractional i in [0, num - 1] to evaluate instead of 0, ..., num - 1 (the same arithmetic, so an
    integer position gives the linspace's own value bit for bit).
    """
    i = torch.arange(num, dtype=torch.float64) if positions is None else positions.to(torch.float64)
    if num == 1:
        return torch.full_like(i, start)
    step = (stop - start) / (num - 1)
    return torch.where(i == num - 1, stop, i * step + start)


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def resolution_mu(
    image_seq_len: int, *, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float
) -> float:
    """The resolution-dependent shift mu: linear in the number of image tokens (diffusers' calculate_shift).

    mu = base_shift + (max_shift - base_shift) * (image_seq_len - base_seq_len) / (max_seq_len - base_seq_len),
    evaluated in diffusers' order of operations so the float is identical.
    """
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def exponential_time_shift(sigmas: torch.Tensor, mu: float) -> torch.Tensor:
    """sigma -> e^mu / (e^mu + (1/sigma - 1)), fp32 (diffusers' exponential time shift with exponent 1)."""
    e = _f32(math.exp(mu))
    one = _f32(1.0)
    return e / (e + (one / sigmas - one))


def static_time_shift(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """sigma -> shift * sigma / (1 + (shift - 1) * sigma) in `sigmas`' dtype, with `shift` a Python float as
    diffusers' flow-match scheduler holds it (SD3 eq. 23's timestep shift, alpha = shift)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def stretch_to_terminal(sigmas: torch.Tensor, shift_terminal: float) -> torch.Tensor:
    """Affinely rescale 1 - sigma so the last sigma equals shift_terminal (sigma = 1 stays 1), fp32."""
    one = _f32(1.0)
    one_minus = one - sigmas
    scale = one_minus[-1] / _f32(1.0 - shift_terminal)
    return one - one_minus / scale


def qwen_image_sigmas(
    num_steps: int,
    image_seq_len: int,
    *,
    base_seq_len: int,
    max_seq_len: int,
    base_shift: float,
    max_shift: float,
    shift_terminal: float | None,
) -> torch.Tensor:
    """Qwen-Image's schedule: [num_steps + 1] fp32, from 1 down to shift_terminal, then a terminal 0.

    QwenImagePipeline passes sigmas = linspace(1, 1/N, N) and mu from the packed latent's token count
    (image_seq_len = (H / 16) * (W / 16)); the scheduler (dynamic shifting, exponential time shift,
    shift_terminal 0.02 in Qwen/Qwen-Image's scheduler_config.json) shifts them towards 1 and stretches the
    tail.

    Args:
        num_steps: N denoising steps.
        image_seq_len: number of image tokens of the packed latent.
        base_seq_len, max_seq_len, base_shift, max_shift, shift_terminal: the scheduler config's
            base_image_seq_len, max_image_seq_len, base_shift, max_shift, shift_terminal (the model reads
            them from its scheduler_config.json: fgrpo.models.qwen_image.schedule_kwargs).

    Returns:
        [N + 1] fp32, sigmas[0] = 1, sigmas[-1] = 0.
    """
    _check_steps(num_steps)
    sigmas = qwen_image_sigmas_at(
        torch.arange(num_steps),
        num_steps,
        image_seq_len,
        base_seq_len=base_seq_len,
        max_seq_len=max_seq_len,
        base_shift=base_shift,
        max_shift=max_shift,
        shift_terminal=shift_terminal,
    )
    return torch.cat([sigmas, torch.zeros(1)])


def qwen_image_sigmas_at(
    positions: torch.Tensor,
    num_steps: int,
    image_seq_len: int,
    *,
    base_seq_len: int,
    max_seq_len: int,
    base_shift: float,
    max_shift: float,
    shift_terminal: float | None,
) -> torch.Tensor:
    """Qwen-Image's N-step schedule at fractional step positions: sigma(u) for u in [0, N - 1], fp32.

    The unshifted time is affine in the step (t(u) = 1 + u (1/N - 1) / (N - 1)); it goes through the same
    shift and the same stretch as the N-step grid (the stretch's scale is the grid's, fixed by its last
    nonzero sigma), so sigma(i) = qwen_image_sigmas(N, ...)[i] bit for bit at integer i.

    Args:
        positions: [P] step positions in [0, N - 1] (not checked).
        num_steps, image_seq_len, ...: as qwen_image_sigmas.

    Returns:
        [P] fp32.
    """
    _check_steps(num_steps)
    if image_seq_len < 1:
        raise ValueError(f"image_seq_len must be >= 1, got {image_seq_len}")
    if shift_terminal and num_steps < 2:
        # The stretch maps the last sigma (1 when N = 1) to shift_terminal: 0 / 0, NaN in diffusers too.
        raise ValueError(f"num_steps must be >= 2 when shift_terminal is set, got {num_steps}")
    mu = resolution_mu(
        image_seq_len,
        base_seq_len=base_seq_len,
        max_seq_len=max_seq_len,
        base_shift=base_shift,
        max_shift=max_shift,
    )
    # The grid's last position rides along at the end so the stretch sees the grid's own last sigma.
    u = torch.cat([positions.to(torch.float64), torch.tensor([num_steps - 1.0], dtype=torch.float64)])
    sigmas = _linspace_f64(1.0, 1.0 / num_steps, num_steps, u).float()
    sigmas = exponential_time_shift(sigmas, mu)
    if shift_terminal:
        sigmas = stretch_to_terminal(sigmas, shift_terminal)
    return sigmas[:-1]


def flux2_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's shift mu, an empirical fit in the image token count L and the step count N
    (diffusers' compute_empirical_mu, same order of operations so the float is identical).

    mu_N(L) is linear in N through two lines fitted at 10 and 200 steps,
        mu_10(L) = 8.73809524e-5 L + 1.89833333,   mu_200(L) = 1.6927e-4 L + 0.45666666,
        mu = a N + b with a = (mu_200 - mu_10) / 190, b = mu_200 - 200 a;
    for L > 4300 it is mu_200(L) whatever N.
    """
    a_200, b_200 = 0.00016927, 0.45666666
    mu_200 = a_200 * image_seq_len + b_200
    if image_seq_len > 4300:
        return float(mu_200)
    mu_10 = 8.73809524e-05 * image_seq_len + 1.89833333
    a = (mu_200 - mu_10) / 190.0
    return float(a * num_steps + (mu_200 - 200.0 * a))


def flux2_sigmas(num_steps: int, image_seq_len: int) -> torch.Tensor:
    """FLUX.2's schedule: [num_steps + 1] fp32, linspace(1, 1/N, N) through the exponential time shift with
    mu = flux2_mu(image_seq_len, N), then a terminal 0 (Flux2Pipeline / Flux2KleinPipeline with a scheduler of
    dynamic exponential shifting and no terminal stretch).

    Args:
        num_steps: N denoising steps.
        image_seq_len: image tokens, (H / 16) * (W / 16).

    Returns:
        [N + 1] fp32, sigmas[0] = 1, sigmas[-1] = 0.
    """
    _check_steps(num_steps)
    return torch.cat([flux2_sigmas_at(torch.arange(num_steps), num_steps, image_seq_len), torch.zeros(1)])


def flux2_sigmas_at(positions: torch.Tensor, num_steps: int, image_seq_len: int) -> torch.Tensor:
    """FLUX.2's N-step schedule at fractional step positions u in [0, N - 1]: [P] fp32, equal to
    flux2_sigmas(N, ...)[i] bit for bit at integer u = i (mu depends on N, not on u)."""
    _check_steps(num_steps)
    if image_seq_len < 1:
        raise ValueError(f"image_seq_len must be >= 1, got {image_seq_len}")
    sigmas = _linspace_f64(1.0, 1.0 / num_steps, num_steps, positions).float()
    return exponential_time_shift(sigmas, flux2_mu(image_seq_len, num_steps))


def static_shift_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """linspace(1, 1/N, N) under a static shift, then a terminal 0: [num_steps + 1] fp32.

    What a flow-match scheduler without dynamic shifting makes of the sigmas a pipeline passes it (Z-Image's
    pipelines pass linspace(1, 1/N, N)): sigma -> shift * sigma / (1 + (shift - 1) * sigma), in fp32. The grid is
    numpy's linspace arithmetic; ZImagePipeline's torch.linspace differs from it by float32 ulps.
    """
    _check_steps(num_steps)
    return torch.cat([static_shift_sigmas_at(torch.arange(num_steps), num_steps, shift), torch.zeros(1)])


def static_shift_sigmas_at(positions: torch.Tensor, num_steps: int, shift: float) -> torch.Tensor:
    """static_shift_sigmas's N-step schedule at fractional step positions u in [0, N - 1], fp32 [P] (equal to it
    at integer u)."""
    _check_steps(num_steps)
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return static_time_shift(_linspace_f64(1.0, 1.0 / num_steps, num_steps, positions).float(), shift)


def sd3_sigmas(num_steps: int, shift: float, *, num_train_timesteps: int = 1000) -> torch.Tensor:
    """SD3 / SD3.5's schedule: [num_steps + 1] fp32, static shift (3.0 in SD3.5's scheduler_config.json).

    The scheduler spaces N timesteps linearly between its training range's extremes (already shifted:
    sigma_max = 1, sigma_min = shift(1 / num_train_timesteps), computed in fp32 at init), then applies
    sigma -> shift * sigma / (1 + (shift - 1) * sigma) in fp64 and rounds to fp32.

    Returns:
        [N + 1] fp32, sigmas[0] = 1, sigmas[-1] = 0.
    """
    _check_steps(num_steps)
    sigmas = sd3_sigmas_at(torch.arange(num_steps), num_steps, shift, num_train_timesteps=num_train_timesteps)
    return torch.cat([sigmas, torch.zeros(1)])


def sd3_sigmas_at(
    positions: torch.Tensor, num_steps: int, shift: float, *, num_train_timesteps: int = 1000
) -> torch.Tensor:
    """SD3's N-step schedule at fractional step positions u in [0, N - 1]: the unshifted time affine in u, then
    the static shift; sigma(i) = sd3_sigmas(N, shift)[i] bit for bit at integer i.

    Args:
        positions: [P] step positions in [0, N - 1] (not checked).

    Returns:
        [P] fp32.
    """
    _check_steps(num_steps)
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    # The scheduler's training sigmas in fp32, shifted once at init; only their ends are used.
    train = torch.arange(num_train_timesteps, 0, -1, dtype=torch.float32) / num_train_timesteps
    train = static_time_shift(train, shift)
    sigma_max, sigma_min = train[0].item(), train[-1].item()
    sigmas = _linspace_f64(
        sigma_max * num_train_timesteps, sigma_min * num_train_timesteps, num_steps, positions
    )
    sigmas = sigmas / num_train_timesteps
    return static_time_shift(sigmas, shift).float()


def compressed_tail(num_steps: int, last: int, ratio: float) -> torch.Tensor:
    """MixGRPO-Flash's ODE tail after an SDE window whose last step is `last`: the step positions of its grid.

    The tail runs from sigma_{last+1} to 0 on M = max(floor((N - last) ratio), 2) points (M = 1, no step,
    when last = N - 1): M - 1 positions evenly spaced in [last + 1, N - 1] (evenly spaced in the unshifted
    time, which is affine in the step), where the model's schedule is evaluated, then the terminal sigma = 0.
    ratio = 1 gives the positions last + 1, ..., N - 1: the model's own grid.

    Args:
        num_steps: N, steps of the full grid.
        last: the window's last step, in [0, N - 1].
        ratio: the compress ratio in (0, 1] (MixGRPO's dpm_post_compress_ratio).

    Returns:
        [M - 1] fp64 positions, increasing, the first exactly last + 1 (the state the window left).

    Differs from the reference code (MixGRPO's run_sample_step, dpm_apply_strategy="post"): there the M points
    are spaced on [t_{last+1}, 0] of a schedule whose unshifted time reaches 0 at step N, and M = 1 stops the
    sampling at sigma_{last+1} > 0; here the spacing ends at the grid's last nonzero sigma (Qwen-Image's and
    SD3's grids append the terminal 0 after it) and the tail always ends at 0.
    """
    _check_steps(num_steps)
    if not 0 <= last < num_steps:
        raise ValueError(f"compressed_tail: last={last} must be a step index in [0, num_steps={num_steps})")
    if not 0 < ratio <= 1:
        raise ValueError(f"compressed_tail: ratio={ratio} must be in (0, 1]")
    if last == num_steps - 1:
        return torch.zeros(0, dtype=torch.float64)
    points = max(int((num_steps - last) * ratio), 2)
    return _linspace_f64(last + 1.0, num_steps - 1.0, points - 1)


def sample_windows(
    batch: int,
    window_size: int,
    lo: int,
    hi: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Each sample's W consecutive SDE steps: start ~ U{lo, ..., hi - W}, so the window lies in [lo, hi).

    Args:
        batch: B.
        window_size: W >= 1.
        lo, hi: the allowed step range [lo, hi) (steps are indices i of transitions sigma_i -> sigma_{i+1}).
        generator: the torch.Generator the start is drawn from (CPU); pass one, the global RNG is never used
            unless you pass None on purpose.

    Returns:
        [B, W] int64, row b = start_b + [0, ..., W - 1].

    Differs from flow_grpo: flow_grpo draws one window start per batch from Python's `random`; we draw
    per sample so one batch covers many noise levels, and from a passed generator so a rollout is a
    function of its seeds.
    """
    if window_size < 1:
        raise ValueError(f"window_size must be >= 1, got {window_size}")
    if lo < 0 or hi - lo < window_size:
        raise ValueError(
            f"window range [lo={lo}, hi={hi}) must satisfy 0 <= lo and hi - lo >= window_size={window_size}"
        )
    start = torch.randint(lo, hi - window_size + 1, (batch,), generator=generator)  # [B]
    return start[:, None] + torch.arange(window_size)  # [B, W]


def stratified_steps(
    batch: int, k: int, lo: int, hi: int, generator: torch.Generator, *, shared: bool
) -> torch.Tensor:
    """K grid-step indices per sample for the forward-process algorithms (NFT, AWM): [lo, hi) is cut into K
    strata of (nearly) equal size and one index is drawn uniformly from each, so every draw covers the range.

    stratum s = [lo + floor(s n / K), lo + floor((s + 1) n / K)),  n = hi - lo;  K = n takes every step once.

    Args:
        batch: B.
        k: K in [1, hi - lo].
        lo, hi: the allowed step range.
        generator: CPU torch.Generator.
        shared: one draw for the whole batch (AWM's reference) or one per sample (NFT's).

    Returns:
        [B, K] int64, increasing along K.
    """
    n = hi - lo
    if lo < 0 or not 1 <= k <= n:
        raise ValueError(f"stratified_steps needs 0 <= lo and 1 <= k <= hi - lo; got lo={lo}, hi={hi}, k={k}")
    edges = lo + torch.arange(k + 1) * n // k  # [K + 1]
    width = edges[1:] - edges[:-1]  # [K], every stratum holds >= 1 step
    u = torch.rand(1 if shared else batch, k, generator=generator, dtype=torch.float64)
    steps = edges[:-1] + (u * width).long().clamp_max(width - 1)
    return steps.expand(batch, k).clone() if shared else steps


def window_mask(windows: torch.Tensor, num_steps: int) -> torch.Tensor:
    """[B, W] step indices -> [B, num_steps] bool, True where step i is in sample b's window."""
    if windows.numel() and (int(windows.min()) < 0 or int(windows.max()) >= num_steps):
        raise ValueError(f"windows hold step indices outside [0, num_steps={num_steps})")
    mask = torch.zeros(windows.shape[0], num_steps, dtype=torch.bool, device=windows.device)
    return mask.scatter(1, windows, True)


def lr_multiplier(k: int, *, warmup: int, schedule: str, decay_steps: int, min_ratio: float) -> float:
    """Factor on the base LR for optimizer step k (0-based): linear warm-up over `warmup` steps, then constant or
    a linear / cosine decay from 1 at step `warmup` to `min_ratio` at step `decay_steps`, flat after."""
    if warmup and k < warmup:
        return (k + 1) / warmup
    if schedule == "constant" or decay_steps <= warmup:
        return 1.0
    frac = min(1.0, (k - warmup) / (decay_steps - warmup))
    shape = 1.0 - frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
    return min_ratio + (1.0 - min_ratio) * shape


def sliding_window(
    step: int,
    *,
    num_steps: int,
    window_size: int,
    iters_per_window: int,
    stride: int = 1,
    lo: int = 0,
    hi: int | None = None,
    roll_back: bool = False,
) -> list[int]:
    """MixGRPO's progressive SDE window at training step `step`: the same W consecutive steps for every sample.

    The window holds W steps inside [lo, hi) (hi <= N - 1: the last sampling step sigma_{N-1} -> 0 is never in
    it). It starts at `lo` and moves by `stride` steps every `iters_per_window` training steps; p = step //
    iters_per_window is the move count and last = hi - W the last start that fits:
        roll_back=False: start = min(lo + stride * p, last)       (then it stays at the end)
        roll_back=True:  start = lo + stride * (p mod n),  n = (last - lo) // stride + 1 positions
                         (it restarts at lo after its last position: the reference scripts' --roll_back)
    window = [start, ..., start + W - 1]. stride = 0 keeps the window at `lo` (MixGRPO-Flash*).

    Args:
        step: training step, >= 0.
        num_steps: N, the number of sampling steps of the trajectory.
        window_size: W >= 1 (MixGRPO's group_size).
        iters_per_window: training steps spent at each window position (MixGRPO's iters_per_group), >= 1.
        stride: steps the window moves at each shift (MixGRPO's prog_overlap_step), >= 0.
        lo: first step the window may hold, >= 0.
        hi: end (exclusive) of the steps it may hold; None = N - 1.
        roll_back: restart at lo after the last position instead of staying there.

    Returns:
        list[int] of W increasing step indices (one window for the whole batch; for sample_windows' [B, W]
        layout use torch.tensor(window).expand(B, W)).

    Differs from the reference code (MixGRPO's GRPOTrainingStates with prog_overlap): there the window is
    range(start, min(start + W, N - 2)), so it shrinks near the end and is empty at start = N - 2 (roll_back
    then restarts it at 0); here it keeps W steps, its range ends at hi <= N - 1, not N - 2, and rolled back it
    takes only the starts lo + k * stride.
    """
    for name, value, least in (
        ("step", step, 0),
        ("window_size", window_size, 1),
        ("iters_per_window", iters_per_window, 1),
        ("stride", stride, 0),
        ("lo", lo, 0),
    ):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"sliding_window: {name} must be an int >= {least}, got {value!r}")
    _check_steps(num_steps)
    top = num_steps - 1 if hi is None else hi
    if not top <= num_steps - 1:
        raise ValueError(
            f"sliding_window: hi={hi} must be <= num_steps - 1 = {num_steps - 1} (the last step is never in the window)"
        )
    if lo + window_size > top:
        raise ValueError(
            f"sliding_window: a window of {window_size} steps from lo={lo} does not fit in [lo, {top}) of "
            f"num_steps={num_steps}; lower window_size or lo, or raise num_steps or the range's end"
        )
    last, moves = top - window_size, step // iters_per_window
    if roll_back and stride > 0:
        start = lo + stride * (moves % ((last - lo) // stride + 1))
    else:
        start = min(lo + stride * moves, last)
    return list(range(start, start + window_size))
