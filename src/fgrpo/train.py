"""The Flow-GRPO training loop: thin, top to bottom, owning all state.

    for step in steps:
        (every N-th step) validate the current weights: ODE samples of held-out prompts, fixed seeds
        prompts  <- deterministic slice of the prompt order (each rank a shard of the P*G samples)
        traj     <- engine.generate(prompts, seeds)        # SDE inside each sample's window, ODE outside
        rewards  <- reward(traj.images)  -> all-gather -> group advantages (core)
        for epoch, mini-batch, window step, micro-batch:
            log_prob <- policy.transition_log_prob(...)    # the same kernel the rollout used
            loss     <- clipped_policy_loss (+ KL to the LoRA-disabled reference)
            backward (scaled so the gradient does not depend on the split)
        optimizer step per mini-batch; LoRA sync to an out-of-process engine; logging; checkpoint

Deviations from flow_grpo, and why:
- Every rank samples an arbitrary slice of the P*G samples (the G samples of a prompt may live on
  different ranks); rewards are all-gathered before the advantages, so the result does not depend on
  the number of ranks.
- The noise of every sample comes from a generator seeded by (seed, step, sample index), so a
  resumed run draws exactly the same images, and a run with another world size or micro-batch the
  same images up to the float rounding that batch shapes cause (measured <= 2e-6 in latents on CPU).
- Old log-probs are the rollout's own (the in-process engine computes them with `policy.transition`,
  the function training calls), and the |rollout - trainer| gap is measured on the first mini-batch,
  whose weights are still the rollout's. `grpo.old_log_prob="recompute"` recomputes them in training
  shapes first, for engines whose kernels differ (vLLM-Omni).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import torch

from fgrpo import parallel
from fgrpo.config import ModelConfig, TrainConfig
from fgrpo.core import grpo
from fgrpo.core.schedule import lr_multiplier
from fgrpo.data import load_prompts, step_prompt_indices
from fgrpo.models.base import FlowModel, cond_index
from fgrpo.policy import transition
from fgrpo.rollout.base import RolloutEngine, SamplingConfig, Trajectory
from fgrpo.rollout.engine import micro_batches, recompute_log_prob

# ----------------------------------------------------------------------------------------------------
# Validation of the config: every error names the field and the fix, before anything expensive.


# Max per-step |rollout - trainer| log-prob gap with regional compile on an H200 (RESULTS.md, "Compiled Flow-GRPO
# step"): the no-grad and the grad forward compile to different kernels. Eager, the two are bit-identical.
COMPILED_LOGPROB_GAP = 1e-4


def validate_config(cfg: TrainConfig, world_size: int) -> None:
    g, s = cfg.grpo, cfg.sampling
    n = cfg.samples_per_step
    if g.group_size < 2:
        raise ValueError(f"grpo.group_size={g.group_size}: GRPO needs at least 2 samples per prompt")
    if n % world_size:
        raise ValueError(
            f"grpo.prompts_per_step*grpo.group_size={n} is not divisible by the {world_size} ranks; "
            "change grpo.prompts_per_step or grpo.group_size"
        )
    local = n // world_size
    if local % g.optimizer_steps_per_step:
        raise ValueError(
            f"grpo.optimizer_steps_per_step={g.optimizer_steps_per_step} does not divide the {local} samples "
            "per rank; pick a divisor"
        )
    if s.sde_kind == "ode" or s.window_size < 1:
        raise ValueError("sampling.sde_kind='ode' / window_size<1 leaves nothing to train; use flow_sde, cps or dance_sde")
    lo, hi = s.window_range
    if not (0 <= lo and lo + s.window_size <= hi <= s.num_steps):
        raise ValueError(
            f"sampling.window_range={s.window_range} with window_size={s.window_size} must satisfy "
            f"0 <= lo, lo + window_size <= hi <= num_steps={s.num_steps}"
        )
    if cfg.model.compile and g.old_log_prob == "rollout" and g.clip_range < 10 * COMPILED_LOGPROB_GAP:
        raise ValueError(
            f"model.compile=True with grpo.old_log_prob='rollout': compiled rollout and training forwards differ "
            f"by up to ~{COMPILED_LOGPROB_GAP:g} in log-prob, not small next to grpo.clip_range={g.clip_range:g}; "
            "add --grpo.old-log-prob recompute"
        )
    if g.kl_coef > 0 and not cfg.model.lora:
        raise ValueError("grpo.kl_coef>0 needs model.lora=True (the reference is the model with adapters off)")
    if cfg.num_steps < 1:
        raise ValueError(f"num_steps={cfg.num_steps}: must be >= 1")
    o = cfg.optim
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
    if o.schedule != "constant" and cfg.lr_decay_steps <= o.warmup_steps:
        raise ValueError(
            f"optim.decay_steps={cfg.lr_decay_steps} (optimizer steps) must exceed optim.warmup_steps="
            f"{o.warmup_steps} for optim.schedule='{o.schedule}'; raise optim.decay_steps or num_steps"
        )
    if cfg.rollout_engine == "vllm_omni":
        if cfg.model.kind != "qwen_image" or not cfg.model.lora:
            raise ValueError("rollout_engine='vllm_omni' supports model.kind='qwen_image' with model.lora=True only")
        if g.old_log_prob != "recompute":
            raise ValueError("rollout_engine='vllm_omni' needs --grpo.old-log-prob recompute (its kernels differ)")
        if g.group_init_noise:
            raise ValueError("grpo.group_init_noise is in-process only; drop --grpo.group-init-noise or use diffusers")
        if world_size > 1:
            raise ValueError("rollout_engine='vllm_omni' is wired for one trainer process; use diffusers on N ranks")


# ----------------------------------------------------------------------------------------------------
# Building the pieces.


def build_model(mcfg: ModelConfig, device: torch.device, seed: int) -> FlowModel:
    """The generator named by model.kind, on `device`, frozen; trainable parameters are set up later."""
    from fgrpo.models import loading

    dtype = torch.bfloat16 if mcfg.dtype == "bf16" else torch.float32
    if mcfg.kind == "textbed":
        from fgrpo.models.textbed import load_textbed

        return load_textbed(mcfg.path or None, device=device, dtype=dtype)
    if mcfg.kind in ("tiny_qwen_image", "tiny_sd3"):
        from fgrpo.models import tiny

        build = tiny.tiny_qwen_image if mcfg.kind == "tiny_qwen_image" else tiny.tiny_sd3
        model = build(seed=seed, device=device, dtype=dtype)
        loading.configure_transformer(model.transformer, attention_backend=mcfg.attention_backend,
                                      compile_blocks=mcfg.compile)
        return model

    return loading.load_model(mcfg, device=device, dtype=dtype)


def setup_trainable(transformer: torch.nn.Module, mcfg: ModelConfig) -> list[torch.nn.Parameter]:
    """Attach LoRA (or unfreeze everything). Trainable parameters become fp32 masters whatever the base
    dtype: FSDP2 casts them to the compute dtype for forward/backward, AdamW updates them in fp32."""
    from fgrpo.models.loading import add_lora, configure_transformer

    if mcfg.lora:
        params = add_lora(transformer, rank=mcfg.lora_rank, alpha=mcfg.lora_alpha, target_modules=mcfg.lora_target_list)
    else:
        params = list(transformer.requires_grad_(True).parameters())
    for p in params:
        p.data = p.data.float()
    configure_transformer(transformer, gradient_checkpointing=mcfg.gradient_checkpointing)
    return params


@contextlib.contextmanager
def adapters_disabled(transformer: torch.nn.Module):
    """The reference policy for the KL: the same transformer with its LoRA adapters switched off."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def build_engine(model: FlowModel, cfg: TrainConfig) -> RolloutEngine:
    if cfg.rollout_engine == "vllm_omni":
        from fgrpo.rollout.vllm_omni import VllmOmniEngine

        return VllmOmniEngine(cfg.model.path, enable_sleep_mode=True)
    from fgrpo.rollout.engine import DiffusersEngine

    return DiffusersEngine(model)


@torch.no_grad()
def rollout(engine, prompts: list[str], seeds: list[int], s: SamplingConfig, device: torch.device,
            init_seeds: list[int] | None = None) -> Trajectory:
    """engine.generate, with an engine that shares the GPU (vLLM-Omni) woken for it and put back to sleep."""
    if hasattr(engine, "wake"):
        engine.wake()
    extra = {} if init_seeds is None else {"init_seeds": init_seeds}
    traj = engine.generate(prompts, seeds, s, **extra).to(device)
    if hasattr(engine, "sleep"):
        engine.sleep()
    return traj


def sync_engine_weights(engine, transformer: torch.nn.Module, sync_dir: Path) -> None:
    """Hand the updated LoRA to an engine that holds its own copy of the weights (vLLM-Omni).

    The in-process engine shares the trainer's module, so it needs nothing. Untested on a GPU so far.
    """
    if not hasattr(engine, "update_lora"):
        return
    from fgrpo import checkpoint

    engine.update_lora(checkpoint.export_lora(sync_dir, transformer))


def group_init_seeds(seed: int, step: int, sample_ids: torch.Tensor, group_size: int) -> list[int]:
    """One initial-noise seed per GRPO group (samples g*G .. g*G+G-1 share it), a pure function of
    (run seed, step, group index); disjoint from sample_seeds' streams by the extra key."""
    from fgrpo.rollout.seeds import sample_seed

    return [sample_seed(seed, step, int(i) // group_size, -1) for i in sample_ids]


def sample_seeds(seed: int, step: int, sample_ids: torch.Tensor) -> list[int]:
    """Per-sample seeds, a pure function of (run seed, step, global sample index)."""
    from fgrpo.rollout.seeds import sample_seed

    return [sample_seed(seed, step, int(i)) for i in sample_ids]


# ----------------------------------------------------------------------------------------------------
# One policy update on a trajectory.


def policy_update(
    model: FlowModel,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    traj: Trajectory,
    advantages: torch.Tensor,
    cfg: TrainConfig,
    generator: torch.Generator,
) -> dict[str, float]:
    """Inner epochs x mini-batches of the clipped Flow-GRPO objective on this rank's samples.

    Gradients are scaled so that the update equals that of one big batch: each micro-batch adds
    (its elements / elements of the mini-batch on this rank) of its mean loss, and FSDP averages
    equal-sized rank shards.

    Deviation from flow_grpo, which shuffles single samples: when the training micro-batch equals the
    rollout's, we shuffle whole rollout micro-batches. Each training forward then sees exactly the rows
    (and prompt padding) of a rollout forward, so at unchanged weights its log-probs are bit-identical
    to the rollout's and the first update's ratio is exactly 1.
    """
    g, s = cfg.grpo, cfg.sampling
    B, W = traj.window.shape
    mb = g.train_micro_batch or s.micro_batch
    stats: dict[str, list[float]] = defaultdict(list)
    gap_per_step: dict[int, list[float]] = defaultdict(list)
    old_log_prob, old_mean = traj.log_prob, None
    first_update = True

    # GRPO-Guard's ratio normalisation needs the rollout policy's means; they are recomputed with the
    # unchanged weights rather than stored (a trajectory would double in size for one option).
    if g.old_log_prob == "recompute" or g.ratio_norm:
        recomputed, old_mean = recompute_log_probs_and_means(model, traj, s)
        if g.old_log_prob == "recompute":
            old_log_prob = recomputed
            record_gap(gap_per_step, traj.window, recomputed, traj.log_prob)
            first_update = False  # the gap is measured; training starts from the trainer's own numbers

    for _epoch in range(g.inner_epochs):
        for chunk in minibatch_rows(B, mb, s.micro_batch, g.optimizer_steps_per_step, generator):
            n_elems = sum(len(rows) for rows in chunk) * W
            for j in range(W):
                for rows in chunk:
                    rows = rows.to(traj.x_t.device)
                    log_prob, mean, std = recompute_log_prob(model, traj, s, rows, j)
                    old = old_log_prob[rows, j]
                    if first_update:  # weights still equal the rollout's: the gap is the numerics alone
                        record_gap(gap_per_step, traj.window[rows, j : j + 1], log_prob.detach()[:, None],
                                   old[:, None])
                    loss, metrics = grpo.clipped_policy_loss(
                        log_prob, old, advantages[rows], clip_range=g.clip_range, adv_clip_max=g.adv_clip_max,
                        ratio_norm=g.ratio_norm, mean=mean, std=std,
                        old_mean=old_mean[rows, j] if old_mean is not None else None,
                    )
                    if g.kl_coef > 0:
                        steps = traj.window[rows, j]
                        sigma, sigma_next = traj.sigmas[steps], traj.sigmas[steps + 1]
                        with torch.no_grad(), adapters_disabled(model.transformer):
                            ref_mean, _ = transition(model, traj.x_t[rows, j], sigma, sigma_next,
                                                     cond_index(traj.cond, rows), s)
                        kl = grpo.gaussian_kl(mean, ref_mean, std, kind=g.kl_kind, step_size=sigma - sigma_next)
                        loss = loss + g.kl_coef * kl.mean()
                        stats["kl"].append(kl.mean().item())
                    (loss * (len(rows) * 1.0 / n_elems)).backward()
                    for k, v in metrics.items():
                        stats[k].append(float(v))
                    stats["loss"].append(loss.item())
            first_update = False
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            stats["grad_norm"].append(grad_norm)
            if math.isfinite(grad_norm):
                optimizer.step()
                stats["skipped_steps"].append(0.0)
            else:  # one bad batch must not poison AdamW's moments
                stats["skipped_steps"].append(1.0)
            optimizer.zero_grad(set_to_none=True)
            lr_scheduler.step()

    out = {k: float(np.mean(v)) for k, v in stats.items() if k not in ("skipped_steps", "ratio_min", "ratio_max")}
    out["ratio_min"] = float(np.min(stats["ratio_min"]))
    out["ratio_max"] = float(np.max(stats["ratio_max"]))
    out["skipped_steps"] = float(np.sum(stats["skipped_steps"]))
    for i, gaps in sorted(gap_per_step.items()):
        out[f"logprob_gap/step{i}"] = float(np.max(gaps))
    if gap_per_step:
        out["logprob_gap/max"] = max(out[f"logprob_gap/step{i}"] for i in gap_per_step)
    return out


def minibatch_rows(
    n: int, micro_batch: int, rollout_micro_batch: int, num_minibatches: int, generator: torch.Generator
) -> list[list[torch.Tensor]]:
    """Split n samples into `num_minibatches` mini-batches, each a list of micro-batch row index tensors.

    With micro_batch == rollout_micro_batch the units shuffled are the rollout's own micro-batches
    (consecutive rows); otherwise single samples are shuffled and cut into micro-batches.
    """
    if micro_batch == rollout_micro_batch:
        units = list(torch.arange(n).split(micro_batch))
        if len(units) % num_minibatches == 0:
            order = torch.randperm(len(units), generator=generator).tolist()
            per = len(units) // num_minibatches
            return [[units[u] for u in order[k * per : (k + 1) * per]] for k in range(num_minibatches)]
    perm = torch.randperm(n, generator=generator)
    return [list(chunk.split(micro_batch)) for chunk in perm.chunk(num_minibatches)]


def record_gap(gaps: dict[int, list[float]], window: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None:
    """Append |new - old| log-prob per denoising-step index (window: [m, W'] step ids of the [m, W'] values)."""
    for i, gap in zip(window.flatten().tolist(), (new - old).abs().flatten().tolist()):
        gaps[i].append(gap)


@torch.no_grad()
def recompute_log_probs_and_means(
    model: FlowModel, traj: Trajectory, s: SamplingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, W] log-probs, [B, W, *latent] means) of the stored transitions under the current weights, in
    the rollout's micro-batches."""
    log_probs = torch.empty_like(traj.log_prob)
    means = torch.empty_like(traj.x_next)
    for j in range(traj.window.shape[1]):
        for rows in micro_batches(len(traj), s.micro_batch):
            log_probs[rows, j], means[rows, j], _ = recompute_log_prob(model, traj, s, rows, j)
    return log_probs, means


def validation_sampling(s: SamplingConfig, num_steps: int) -> SamplingConfig:
    """Deterministic ODE sampling for evaluation (no window: nothing is trained or scored as an action)."""
    return dataclasses.replace(s, sde_kind="ode", noise_level=0.0, num_steps=num_steps, window_size=0, window_range=(0, 0))


# ----------------------------------------------------------------------------------------------------
# The loop.


def train(cfg: TrainConfig, *, experiment_source: str | None = None) -> dict[str, float]:
    """Run Flow-GRPO as configured; returns the last step's metrics (rank 0's view)."""
    from fgrpo import checkpoint
    from fgrpo import logging as flog
    from fgrpo.rewards import build_reward
    from fgrpo.rewards.runner import ParallelReward

    # FSDP2 warns that the transformer returns a view; nothing in fgrpo writes into it in place
    # (CFG and the SDE step are out-of-place), so the warning is noise in every run's console.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    d = parallel.init_distributed(cfg.device)
    validate_config(cfg, d.world_size)
    run_dir = Path(cfg.run.out_dir) / cfg.exp_name
    train_prompts = load_prompts(cfg.data.train_prompts, require_quoted=cfg.reward.is_ocr)
    val_prompts = load_prompts(cfg.data.val_prompts, require_quoted=cfg.reward.is_ocr,
                               field="data.val_prompts")[: cfg.data.val_num_prompts]
    reward = build_reward(cfg.reward.spec) if cfg.reward.workers == 0 else ParallelReward(cfg.reward.spec, cfg.reward.workers)

    torch.manual_seed(cfg.seed)  # LoRA init is the only draw from the global RNG
    model = build_model(cfg.model, d.device, cfg.seed)
    params = setup_trainable(model.transformer, cfg.model)
    param_dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else None
    parallel.shard_transformer(model.transformer, param_dtype=param_dtype)
    params = [p for p in model.transformer.parameters() if p.requires_grad]  # now DTensors
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        partial(lr_multiplier, warmup=o.warmup_steps, schedule=o.schedule, decay_steps=cfg.lr_decay_steps,
                min_ratio=o.min_lr_ratio),
    )
    engine = build_engine(model, cfg)

    start_step = 0
    extra: dict = {}
    if cfg.run.resume:
        path = checkpoint.latest(run_dir / "checkpoints") if cfg.run.resume == "auto" else Path(cfg.run.resume)
        if path is not None:
            start_step, extra = checkpoint.load(path, model=model.transformer, optimizer=optimizer,
                                                lr_scheduler=lr_scheduler)
            flog.print0(f"resumed from {path} at step {start_step}")
    logger = flog.make_logger(cfg, run_dir, enabled=d.is_main, experiment_source=experiment_source)

    G, P = cfg.grpo.group_size, cfg.grpo.prompts_per_step
    n_local = P * G // d.world_size
    sample_ids = torch.arange(d.rank * n_local, (d.rank + 1) * n_local)  # this rank's slice of the step
    metrics: dict[str, float] = {}
    for step in range(start_step, cfg.num_steps):
        timer = flog.PhaseTimer()
        # 0. validation of the weights that enter this step (step 0: the starting model)
        val_metrics = {}
        if cfg.run.val_every and step % cfg.run.val_every == 0:
            with timer("val"):
                val_metrics = validate(engine, reward, val_prompts, cfg, logger, step, d.device)

        # 1. prompts and seeds: pure functions of (seed, step)
        prompt_ids = step_prompt_indices(len(train_prompts), step, P, cfg.seed)
        prompts = [train_prompts[int(prompt_ids[int(i) // G])] for i in sample_ids]
        seeds = sample_seeds(cfg.seed, step, sample_ids)
        init_seeds = group_init_seeds(cfg.seed, step, sample_ids, G) if cfg.grpo.group_init_noise else None

        # 2. rollout
        with timer("rollout"):
            traj = rollout(engine, prompts, seeds, cfg.sampling, d.device, init_seeds)

        # 3. rewards -> all ranks -> group advantages
        with timer("reward"):
            out = reward(traj.images.cpu().numpy(), prompts)
            local_rewards = torch.as_tensor(out.scores, dtype=torch.float32, device=d.device)
        with timer("sync"):
            rewards = parallel.all_gather_cat(local_rewards)
            advantages = grpo.group_advantages(rewards, G, std=cfg.grpo.adv_std)
            local_adv = advantages[sample_ids.to(d.device)]

        # 4. policy update
        with timer("train"):
            gen = torch.Generator().manual_seed(cfg.seed * 7919 + step)  # mini-batch order, same on resume
            train_metrics = policy_update(model, params, optimizer, lr_scheduler, traj, local_adv, cfg, gen)
        with timer("sync"):
            sync_engine_weights(engine, model.transformer, run_dir / "engine_lora")

        # 5. logging, validation, checkpoint
        grouped = rewards.view(P, G)
        metrics = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(unbiased=False).item(),
            "reward/zero_std_group_frac": (grouped.std(dim=1, unbiased=False) == 0).float().mean().item(),
            **{f"reward/{k}": float(v) for k, v in out.metrics.items()},
            **{f"train/{k}": v for k, v in train_metrics.items()},
            "lr": lr_scheduler.get_last_lr()[0],
            **val_metrics,
        }
        if cfg.run.log_images_every and step % cfg.run.log_images_every == 0:
            logger.log_images("rollout", traj.images[:16].cpu().numpy(), prompts[:16], step=step)
        last = step + 1 == cfg.num_steps
        if last or (cfg.run.ckpt_every and (step + 1) % cfg.run.ckpt_every == 0):
            with timer("checkpoint"):
                checkpoint.save(run_dir / "checkpoints", step + 1, model=model.transformer, optimizer=optimizer,
                                lr_scheduler=lr_scheduler, extra_state={"exp_name": cfg.exp_name},
                                keep_last=cfg.run.keep_last)
        metrics.update(timer.metrics(images=P * G))
        logger.log(metrics, step=step)
        flog.print0(flog.progress_line(step, cfg.num_steps, metrics))

    if cfg.run.val_every and start_step < cfg.num_steps:  # the trained model, logged as step num_steps
        final = validate(engine, reward, val_prompts, cfg, logger, cfg.num_steps, d.device)
        logger.log(final, step=cfg.num_steps)
        metrics.update(final)
        flog.print0(f"final validation: {final}")
    if cfg.run.export_lora and cfg.model.lora:
        checkpoint.export_lora(run_dir / "lora", model.transformer)
    logger.finish()
    del engine, optimizer, params, model
    parallel.shutdown()
    return metrics


@torch.no_grad()
def validate(
    engine, reward, prompts: list[str], cfg: TrainConfig, logger, step: int, device: torch.device
) -> dict[str, float]:
    """ODE samples of fixed prompts and seeds (the same every validation), scored by the reward."""
    d_rank, d_world = (0, 1)
    if torch.distributed.is_initialized():
        d_rank, d_world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    n = math.ceil(len(prompts) / d_world) * d_world
    ids = torch.arange(n).view(d_world, -1)[d_rank]
    local_prompts = [prompts[int(i) % len(prompts)] for i in ids]  # pad by wrapping so shapes match
    seeds = [10_000 + int(i) for i in ids]
    s = validation_sampling(cfg.sampling, cfg.run.val_num_steps)
    traj = rollout(engine, local_prompts, seeds, s, device)
    out = reward(traj.images.cpu().numpy(), local_prompts)
    scores = parallel.all_gather_cat(torch.as_tensor(out.scores, dtype=torch.float32, device=traj.images.device))
    scores = scores[: len(prompts)]
    logger.log_images("val", traj.images[:16].cpu().numpy(), local_prompts[:16], step=step)
    return {"val/reward_mean": scores.mean().item(), "val/reward_exact_frac": (scores >= 0.999).float().mean().item()}
