"""The in-process rollout engine: any FlowModel, sampled step by step through fgrpo.policy.transition.

Each sample b gets a window of W consecutive steps (drawn from its own generator); inside it the step is
the configured SDE and the transition (x_t, x_next, log-prob) is recorded, outside it the step is the
deterministic Euler (ODE) step. With `cfg.ode_tail="dpmpp_2m"` (MixGRPO-Flash; one window for the batch)
the steps after the window are DPM-Solver++(2M) steps on a compressed grid instead. Samples run in
micro-batches of `cfg.micro_batch` rows grouped by window (`forward_units`), all steps of a micro-batch
before the next one.

Exactness contract (tested): fgrpo.recompute's `recompute_log_probs` - one transformer forward per (window
position j, micro-batch of the same rows) - reproduces the rollout's log-probs bit for bit with unchanged weights. It
holds because both sides call the same `model.velocity` on the same rows in the same order with the same
(trimmed) prompt padding, and the same core step and log-prob on the result: every row's numbers depend on
the shapes of the forward, not on the other rows' values.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from fgrpo.config import SamplingConfig
from fgrpo.core import schedule, sde
from fgrpo.models.base import FlowModel, cond_index, trained_module
from fgrpo.models.common import module_device
from fgrpo.models.lora import Float8, MergedLora
from fgrpo.models.textbed import TextbedModel
from fgrpo.policy import transition
from fgrpo.rollout.base import RolloutEngine, SleepingEngine, Trajectory
from fgrpo.rollout.seeds import sample_generator

# Receives a rollout's decoded samples block by block: (the block's batch rows: an int64 index array in the order
# of its images (a micro-batch) or a slice (a whole batch), uint8 [n, H, W, 3] (or video [n, F, H, W, 3]) numpy
# array, per-row reward metadata or None: what a model decodes besides pixels).
ImageSink = Callable[["np.ndarray | slice", np.ndarray, "list[dict] | None"], None]


class _GivenVelocity:
    """A stand-in model whose velocity is already computed.

    A micro-batch can hold rows inside their SDE window and rows outside it at the same step; one
    transformer forward serves both, and `transition` then turns that one velocity into the SDE step
    (window rows) and the Euler step (the others), so the step math still exists only in policy/core.
    """

    def __init__(self, v: torch.Tensor):
        self.v = v

    def velocity(self, x_t, sigma, cond, *, guidance_scale):
        return self.v


def forward_units(window: torch.Tensor, size: int, block: int = 0) -> list[torch.Tensor]:
    """The rows of each forward of a rollout and of every pass that must reproduce it: int64 index tensors of
    `size` rows (the last of a block may hold fewer), each in increasing order, together a partition of the batch.

    window: [B, W] the samples' window steps (Trajectory.window). The rows are ordered by the first step of
    their window (a stable sort: equal windows keep the batch order), then cut into groups of `size`. A group
    then holds samples whose windows coincide or overlap, so fewer of its steps have any row inside a window;
    with the exact rollout each such step is a forward through the training graph (e.g. per-sample windows of 2
    in steps [0, 5), 32 samples in forwards of 8: 2.6 such steps of 10 on average instead of 4.8 for consecutive
    rows, by simulation of the draws). Without windows (W = 0) or with one window for all rows the groups are the
    consecutive rows. Each sample's randomness is its own generator's (rollout.seeds), so the grouping changes no
    draw; it decides only which rows share a forward.

    block: if > 0, rows are grouped within each run of `block` consecutive rows (SamplingConfig.unit_block: the
    asynchronous mode's rollout serves several trainers, each of which trains whole forwards of its own rows).
    """
    if size < 1:
        raise ValueError(f"micro_batch must be >= 1, got {size}")
    if window.ndim != 2:
        raise ValueError(f"window must be [B, W], got shape {tuple(window.shape)}")
    n = window.shape[0]
    start = window[:, 0].cpu() if window.shape[1] else torch.zeros(n, dtype=torch.long)
    span = block if block > 0 else max(n, 1)
    units = []
    for first in range(0, n, span):
        order = torch.sort(start[first : first + span], stable=True).indices + first
        units += [torch.sort(unit).values for unit in order.split(size)]
    return units


def check_request(
    model: FlowModel, prompts: Sequence[str], seeds: Sequence[int], cfg: SamplingConfig
) -> None:
    """Every error a rollout request can have, raised before any model work (one line, field + fix)."""
    if len(prompts) == 0:
        raise ValueError(
            "prompts is empty; pass at least one prompt (repeat each prompt G times for a group)"
        )
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts; pass one seed per sample")
    if cfg.num_steps < 1:
        raise ValueError(f"num_steps={cfg.num_steps}: must be >= 1")
    if cfg.micro_batch < 1:
        raise ValueError(f"micro_batch={cfg.micro_batch}: must be >= 1")
    model.latent_shape(cfg.height, cfg.width)  # raises on a resolution the VAE/patching cannot represent
    if cfg.ode_tail not in ("euler", "dpmpp_2m"):
        raise ValueError(f"ode_tail={cfg.ode_tail!r}: must be 'euler' or 'dpmpp_2m'")
    if not 0 < cfg.tail_compress <= 1:
        raise ValueError(
            f"tail_compress={cfg.tail_compress}: must be in (0, 1], the fraction of tail steps kept"
        )
    if cfg.tail_compress != 1 and cfg.ode_tail != "dpmpp_2m":
        raise ValueError(
            f"tail_compress={cfg.tail_compress} compresses only the dpmpp_2m tail; set ode_tail='dpmpp_2m'"
        )
    if cfg.guidance_scale > 1.0 and cfg.negative_prompt is None:
        raise ValueError(
            f"guidance_scale={cfg.guidance_scale} > 1 needs negative_prompt (e.g. ' '); or set guidance_scale=1"
        )
    W, (lo, hi) = cfg.window_size, cfg.window_range
    if W < 0:
        raise ValueError(f"window_size={W}: must be >= 0 (0 = pure ODE sampling, nothing recorded)")
    if W == 0:
        return
    if not (0 <= lo and lo + W <= hi <= cfg.num_steps):
        raise ValueError(
            f"window_range=({lo}, {hi}) with window_size={W} must satisfy 0 <= lo, lo + window_size <= hi <= "
            f"num_steps={cfg.num_steps}"
        )
    if cfg.ode_tail == "dpmpp_2m" and hi - lo != W:
        # Per-sample windows would put rows of one forward on different tail grids.
        raise ValueError(
            f"ode_tail='dpmpp_2m' needs one window for the whole batch, but window_range=({lo}, {hi}) with "
            f"window_size={W} draws one per sample; set window_range=(lo, lo + window_size) (algo mixgrpo does)"
        )
    # The SDE kind's own checks (kind, noise_level range) and a positive std at every step a window can
    # cover, computed by the core step itself on a 1-element state: e.g. cps has std 0 at the last step.
    sigmas = model.sigmas(cfg.num_steps, cfg.height, cfg.width)
    steps = torch.arange(lo, hi)
    zeros = torch.zeros(len(steps), 1)
    _, std = sde.step_mean_std(
        zeros, zeros, sigmas[steps], sigmas[steps + 1], noise_level=cfg.noise_level, kind=cfg.sde_kind
    )
    bad = steps[~(std.flatten() > 0)].tolist()
    if bad:
        raise ValueError(
            f"sde_kind={cfg.sde_kind!r}, noise_level={cfg.noise_level} gives std 0 at steps {bad} of window_range="
            f"({lo}, {hi}); their log-prob is undefined, so shrink window_range or raise noise_level"
        )


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`. To a GPU through pinned memory without blocking: the copy is queued on the
    stream and the host goes on (a copy from pageable memory would wait for every queued kernel first); the
    caching host allocator keeps the pinned block until the copy has run."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _download(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`t` copied to the CPU without the host waiting: from a GPU into pinned memory, queued on the stream, with
    an event recorded after the copy (wait on it before reading); elsewhere copied at once, no event."""
    if t.device.type != "cuda":
        return t.cpu(), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


class DiffusersEngine:
    """Rollouts in this process with the model's own (diffusers) modules: the trainer's exact kernels.

    train_graph: run the forwards of the SDE window (the transitions that are trained) with autograd on, as the
    trainer runs them, and drop the graph at once. Compiled, a no-grad and a grad forward are two graphs whose
    kernels round differently (~1e-4 in log-prob); through the training graph the first update's forward
    reproduces the rollout's log-probs bit for bit. Eager, both modes give the same bits.

    merged_lora: steps at which no row of a micro-batch is inside its SDE window (their forwards make states,
    not trained log-probs) run each LoRA layer as one matmul with a merged bf16 copy (`MergedLora`, made once per
    call); the window's forwards keep the adapters, so the trained log-probs keep their bits. Those states then
    differ from the unmerged forward's by rounding. float8: those copies as float8, the merged forwards as float8
    matmuls (`MergedLora`'s float8; 'off': bf16 copies).
    """

    def __init__(
        self,
        model: FlowModel,
        *,
        train_graph: bool = False,
        merged_lora: bool = False,
        float8: Float8 = "off",
    ):
        self.model = model
        self.train_graph = train_graph
        self.merged_lora = merged_lora
        self.float8: Float8 = float8

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str],
        seeds: Sequence[int],
        cfg: SamplingConfig,
        init_seeds: Sequence[int] | None = None,
        on_images: ImageSink | None = None,
    ) -> Trajectory:
        """init_seeds: if given, sample b starts from the x_1 that a sample seeded init_seeds[b] starts from
        (equal init seeds = equal x_1, e.g. one per GRPO group). Its own generator still draws (and drops) its
        x_1, so its window and SDE noises are the same draws with or without init_seeds.
        on_images(rows, images, metadata): called with each micro-batch's decoded images (uint8 [m, H, W, 3], on
        the CPU), e.g. to score them while the next micro-batch samples, once the next micro-batch's first forward
        is queued (the last micro-batch's at once): the images come back by a copy queued after their decode, and
        the host waits for that copy only while the GPU has the next forward to run. metadata: the model's
        `reward_metadata` of those rows (e.g. an audio-video model's waveforms), else None."""
        model = self.model
        check_request(model, prompts, seeds, cfg)
        if init_seeds is not None and len(init_seeds) != len(prompts):
            raise ValueError(
                f"init_seeds has {len(init_seeds)} entries for {len(prompts)} prompts; pass one per sample"
            )
        device = module_device(model.transformer)
        prompts = list(prompts)
        B, T, W = len(prompts), cfg.num_steps, cfg.window_size
        shape = model.latent_shape(cfg.height, cfg.width)
        sigmas = model.sigmas(T, cfg.height, cfg.width).to(device)
        # MixGRPO-Flash: the window (shared, check_request) ends at step `last`; the steps after it run on the
        # compressed tail grid, whose first point is sigmas[last + 1] (the state the window leaves).
        flash = cfg.ode_tail == "dpmpp_2m" and W > 0
        last = cfg.window_range[1] - 1
        tail = sigmas[T:]  # the terminal sigma 0 alone: no tail step
        if flash:
            positions = schedule.compressed_tail(T, last, cfg.tail_compress)
            tail = torch.cat([model.sigmas_at(T, cfg.height, cfg.width, positions).to(device), tail])

        # Every random draw of sample b comes from gens[b], in this order: window, x_1, SDE noises
        # (with init_seeds, x_1 is replaced by the x_1 of the init seed's own stream).
        lo, hi = cfg.window_range

        def window_and_x1(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            w = schedule.sample_windows(1, W, lo, hi, g)[0] if W else torch.zeros(0, dtype=torch.long)
            return w, torch.randn(shape, generator=g)

        gens = [sample_generator(s) for s in seeds]
        window, x_init = (
            torch.stack(t) for t in zip(*(window_and_x1(g) for g in gens))
        )  # [B, W], [B, *latent]
        if init_seeds is not None:
            x_init = torch.stack([window_and_x1(sample_generator(s))[1] for s in init_seeds])
        in_window = schedule.window_mask(window, T)  # [B, T] bool, CPU

        negative = cfg.negative_prompt if cfg.guidance_scale > 1.0 else None
        cond = model.encode(prompts, negative_prompt=negative)

        x_t = torch.zeros(B, W, *shape, device=device)
        x_next = torch.zeros(B, W, *shape, device=device)
        log_prob = torch.zeros(B, W, device=device)
        means = torch.zeros(B, W, *shape, device=device)
        x0 = torch.zeros(B, *shape, device=device)
        images, image_rows = [], []
        merged = (
            MergedLora(trained_module(model), getattr(model, "merge_targets", ()), float8=self.float8)
            if self.merged_lora
            else None
        )
        span = contextlib.ExitStack()  # holds merged.active() over a run of steps with no row in its window
        merging = False
        staged = []  # the last micro-batch's images on their way to on_images: (rows, images, copy done, metadata)

        def hand_over() -> None:
            for rows_np, host, done, meta in staged:
                if done is not None:
                    done.synchronize()
                assert on_images is not None
                on_images(rows_np, host.numpy(), meta)
            staged.clear()

        def outside_window(on: bool) -> None:
            nonlocal merging
            if merged is not None and on and not merging:
                span.enter_context(merged.active())
            elif merging and not on:
                span.close()
            merging = merged is not None and on

        try:
            for rows in forward_units(window, cfg.micro_batch, cfg.unit_block):
                # Host-to-device copies never wait for the GPU (`_upload`), so the host's work for step i (the
                # draws from each sample's own CPU generator) overlaps step i's transformer forward.
                rows_dev = _upload(rows, device)
                x = _upload(x_init[rows], device)
                c = cond_index(cond, rows_dev)
                m = x.shape[0]
                in_window_dev = _upload(in_window[rows], device)  # [m, T]
                start = window[rows, 0] if W else None
                x0_prev = None
                for i in range(last + 1 if flash else T):
                    if i == 1:
                        hand_over()  # the previous micro-batch's images: this one's first forward is queued
                    sigma, sigma_next = sigmas[i].expand(m), sigmas[i + 1].expand(m)
                    sde_rows = in_window[rows, i]  # [m] bool
                    outside_window(not sde_rows.any())
                    if not sde_rows.any():
                        x, _ = transition(model, x, sigma, sigma_next, c, cfg, stochastic=False)
                        continue
                    with torch.enable_grad() if self.train_graph else contextlib.nullcontext():
                        v = model.velocity(x, sigma, c, guidance_scale=cfg.guidance_scale).detach()
                    if flash and i == last:
                        x0_prev = sde.x0_prediction(x, v, sigma)
                    given = _GivenVelocity(v)
                    mean, std = transition(given, x, sigma, sigma_next, c, cfg, stochastic=True)
                    noise = torch.stack(
                        [
                            torch.randn(shape, generator=gens[b]) if sde_rows[k] else torch.zeros(shape)
                            for k, b in enumerate(rows.tolist())
                        ]
                    )
                    noise = _upload(noise, device)
                    x_sde = sde.sample(mean, std, noise)
                    lp = sde.log_prob(x_sde, mean, std)  # [m], same call and shapes as transition_log_prob
                    if sde_rows.all():
                        x_new = x_sde
                    else:
                        x_ode, _ = transition(given, x, sigma, sigma_next, c, cfg, stochastic=False)
                        keep = in_window_dev[:, i].view(m, *([1] * len(shape)))
                        x_new = torch.where(keep, x_sde, x_ode)
                    # the window rows' transition, at window position j = i - its first step (consecutive steps)
                    assert start is not None
                    k = sde_rows.nonzero().flatten()
                    k, b, j = _upload(torch.stack([k, rows[k], i - start[k]]), device)
                    x_t[b, j], x_next[b, j], log_prob[b, j], means[b, j] = x[k], x_new[k], lp[k], mean[k]
                    x = x_new
                if flash:
                    # The solver's history is seeded with the window's last x0 prediction (taken before its SDE
                    # noise), so the tail's first step is already second order, as in MixGRPO's "post" strategy
                    # where the window's steps update the solver state; the step to sigma = 0 is first order.
                    sigma_prev = sigmas[last].expand(m)
                    outside_window(True)
                    for k in range(len(tail) - 1):
                        sigma, sigma_next = tail[k].expand(m), tail[k + 1].expand(m)
                        v = model.velocity(x, sigma, c, guidance_scale=cfg.guidance_scale)
                        x0_pred = sde.x0_prediction(x, v, sigma)
                        x = sde.dpmpp_2m_step(x, x0_pred, x0_prev, sigma_prev, sigma, sigma_next)
                        x0_prev, sigma_prev = x0_pred, sigma
                outside_window(False)
                hand_over()  # where the loop above ran one step (a Flash window at step 0)
                x0[rows_dev] = x
                images.append(model.decode(x, cfg.height, cfg.width))
                image_rows.append(rows)
                if on_images is not None:
                    extra = getattr(model, "reward_metadata", None)
                    meta = extra(x, cfg.height, cfg.width) if extra else None
                    staged.append((rows.numpy(), *_download(images[-1]), meta))
            hand_over()
        finally:
            span.close()  # the adapters and original weights back, whatever happened
        stacked = torch.cat(images)
        ordered = torch.empty_like(stacked)
        ordered[torch.cat(image_rows).to(stacked.device)] = stacked

        return Trajectory(
            prompts=prompts,
            seeds=torch.tensor([int(s) for s in seeds], dtype=torch.long, device=device),
            sigmas=sigmas,
            window=window.to(device),
            x_t=x_t,
            x_next=x_next,
            log_prob=log_prob,
            cond=cond,
            images=ordered,
            mean=means,
            x0=x0,
        )


@torch.no_grad()
def rollout(
    engine: RolloutEngine,
    prompts: list[str],
    seeds: list[int],
    cfg: SamplingConfig,
    device: torch.device,
    init_seeds: list[int] | None = None,
    on_images: ImageSink | None = None,
) -> Trajectory:
    """engine.generate, with an engine that shares the GPU (vLLM-Omni) woken for it and put back to sleep.
    on_images(rows, images) receives every image once: per micro-batch from the in-process engine, as one block
    after the rollout from the others."""
    if isinstance(engine, SleepingEngine):
        engine.wake()
    extra: dict = {} if init_seeds is None else {"init_seeds": init_seeds}
    streams = isinstance(engine, DiffusersEngine)
    if streams and on_images is not None:
        extra["on_images"] = on_images
    traj = engine.generate(prompts, seeds, cfg, **extra).to(device)
    if isinstance(engine, SleepingEngine):
        engine.sleep()
    if on_images is not None and not streams:
        on_images(slice(0, len(prompts)), traj.images.cpu().numpy(), None)
    return traj


def validation_sampling(s: SamplingConfig, num_steps: int) -> SamplingConfig:
    """Deterministic ODE sampling for evaluation (no window: nothing is trained or scored as an action)."""
    return dataclasses.replace(
        s, sde_kind="ode", noise_level=0.0, num_steps=num_steps, window_size=0, window_range=(0, 0)
    )


def render_words(
    model: TextbedModel,
    prompts: Sequence[str],
    seeds: Sequence[int],
    *,
    num_steps: int = 20,
    guidance_scale: float = 3.0,
    negative_prompt: str = "",
    micro_batch: int = 512,
) -> torch.Tensor:
    """Deterministic ODE sampling through fgrpo's rollout engine (no SDE window) -> uint8 [B, H, W, 3].

    The measuring stick of the pretrained checkpoint (pretraining eval, tests, README): sample b starts
    from torch.randn(latent_shape, generator=manual_seed(seeds[b])), so a result depends only on
    (prompt, seed), not on the batch it was drawn in.
    """
    scfg = SamplingConfig(
        height=model.cfg.height,
        width=model.cfg.width,
        num_steps=num_steps,
        guidance_scale=guidance_scale,
        negative_prompt=negative_prompt,
        window_size=0,
        micro_batch=micro_batch,
    )
    return DiffusersEngine(model).generate(list(prompts), list(seeds), scfg).images
