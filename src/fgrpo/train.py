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
        optimizer step per mini-batch; LoRA sync to an out-of-process engine; log; checkpoint

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

import math
import warnings
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import torch

from fgrpo import checkpoint, parallel
from fgrpo import logging as flog
from fgrpo.config import TrainConfig, validate_config
from fgrpo.core import grpo
from fgrpo.core.schedule import lr_multiplier
from fgrpo.data import load_prompts, step_prompt_indices
from fgrpo.models.base import FlowModel, cond_index
from fgrpo.models.loading import adapters_disabled, build_model, setup_trainable
from fgrpo.policy import transition
from fgrpo.rewards import build_reward
from fgrpo.rewards.base import check_scores
from fgrpo.rewards.ocr import is_exact
from fgrpo.rewards.runner import ParallelReward
from fgrpo.rollout import seeds as rs
from fgrpo.rollout.base import Trajectory
from fgrpo.rollout.engine import (
    build_engine,
    minibatch_rows,
    recompute_log_prob,
    recompute_log_probs_and_means,
    rollout,
    validation_sampling,
)
from fgrpo.runs import RunDir


def train(cfg: TrainConfig, *, experiment_source: str | Path | None = None) -> dict[str, float]:
    """Run Flow-GRPO as configured; returns the last step's metrics (rank 0's view)."""
    # FSDP2 warns that the transformer returns a view; nothing in fgrpo writes into it in place
    # (CFG and the SDE step are out-of-place), so the warning is noise in every run's console.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    d = parallel.init_distributed(cfg.device)
    validate_config(cfg, d.world_size)
    train_prompts = load_prompts(cfg.data.train_prompts, require_quoted=cfg.reward.is_ocr)
    val_prompts = load_prompts(cfg.data.val_prompts, require_quoted=cfg.reward.is_ocr,
                               field="data.val_prompts")[: cfg.data.val_num_prompts]
    run = RunDir(Path(cfg.run.out_dir) / cfg.exp_name)
    resume_from = run.start(cfg, is_main=d.is_main, say=flog.print0)
    reward = build_reward(cfg.reward.spec) if cfg.reward.workers == 0 else ParallelReward(cfg.reward.spec, cfg.reward.workers)
    if hasattr(reward, "health"):  # a reward service: a wrong URL fails now, not after the first rollout
        reward.health()

    torch.manual_seed(cfg.seed)  # LoRA init is the only draw from the global RNG
    model = build_model(cfg.model, d.device, cfg.seed)
    setup_trainable(model.transformer, cfg.model)
    parallel.shard_transformer(model.transformer, param_dtype=torch.bfloat16 if cfg.model.dtype == "bf16" else None)
    params = [p for p in model.transformer.parameters() if p.requires_grad]  # now DTensors
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(
        lr_multiplier, warmup=o.warmup_steps, schedule=o.schedule, decay_steps=cfg.lr_decay_steps,
        min_ratio=o.min_lr_ratio))
    engine = build_engine(model, cfg.rollout_engine, cfg.model.path)

    start_step = 0
    if resume_from is not None:
        start_step, _ = checkpoint.load(resume_from, model=model.transformer, optimizer=optimizer,
                                        lr_scheduler=lr_scheduler)
        flog.print0(f"resumed from {resume_from} at step {start_step}")
    if d.is_main:  # rows of steps after the checkpoint are redone below: drop them, keep the file one row a step
        run.drop_metrics_from(start_step)
    logger = flog.make_logger(cfg, run.path, enabled=d.is_main, experiment_source=experiment_source)

    G, P = cfg.grpo.group_size, cfg.grpo.prompts_per_step
    n_local = P * G // d.world_size
    sample_ids = torch.arange(d.rank * n_local, (d.rank + 1) * n_local)  # this rank's slice of the step
    metrics: dict[str, float] = {}
    bad_steps = 0
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
        seeds = rs.sample_seeds(cfg.seed, step, sample_ids)
        init_seeds = rs.group_init_seeds(cfg.seed, step, sample_ids, G) if cfg.grpo.group_init_noise else None

        # 2. rollout
        with timer("rollout"):
            traj = rollout(engine, prompts, seeds, cfg.sampling, d.device, init_seeds)

        # 3. rewards -> all ranks -> group advantages
        with timer("reward"):
            out = reward(traj.images.cpu().numpy(), prompts)
            check_scores(out, prompts, cfg.reward.name)
            local_rewards = torch.as_tensor(out.scores, dtype=torch.float32, device=d.device)
        with timer("sync"):
            rewards = parallel.all_gather_cat(local_rewards)
            advantages = grpo.group_advantages(rewards, G, std=cfg.grpo.adv_std)
            local_adv = advantages[sample_ids.to(d.device)]

        # 4. policy update
        with timer("train"):
            order = rs.stream_generator(cfg.seed, step, rs.MINIBATCH_ORDER)  # the same on resume
            train_metrics = policy_update(model, params, optimizer, lr_scheduler, traj, local_adv, cfg, order)
        with timer("sync"):
            if hasattr(engine, "update_lora"):  # an engine with its own copy of the weights (vLLM-Omni)
                engine.update_lora(checkpoint.export_lora(run.path / "engine_lora", model.transformer))

        # 5. log (before the checkpoint that claims this step, so a crash between them loses no row), checkpoint
        grouped = rewards.view(P, G)
        metrics = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(unbiased=False).item(),
            "reward/zero_std_group_frac": (grouped.std(dim=1, unbiased=False) == 0).float().mean().item(),
            **{f"reward/{k}": float(v) for k, v in out.metrics.items()},
            **{f"train/{k}": v for k, v in train_metrics.items()},
            "lr": lr_scheduler.get_last_lr()[0],
            **val_metrics,
            **timer.metrics(images=P * G),
        }
        if cfg.run.log_images_every and step % cfg.run.log_images_every == 0:
            logger.log_images("rollout", traj.images[:16].cpu().numpy(), prompts[:16], step=step)
        logger.log(metrics, step=step)
        flog.print0(flog.progress_line(step, cfg.num_steps, metrics))
        if cfg.num_steps == step + 1 or (cfg.run.ckpt_every and (step + 1) % cfg.run.ckpt_every == 0):
            checkpoint.save(run.checkpoints, step + 1, model=model.transformer, optimizer=optimizer,
                            lr_scheduler=lr_scheduler, extra_state={"exp_name": cfg.exp_name},
                            keep_last=cfg.run.keep_last)
        bad_steps = bad_steps + 1 if train_metrics["skipped_steps"] == train_metrics["optimizer_steps"] else 0
        if bad_steps >= cfg.run.max_bad_steps:
            raise FloatingPointError(
                f"{bad_steps} steps in a row skipped every optimizer step (non-finite gradients) at step {step}; "
                "the run trains nothing: lower optim.lr or check the reward (run.max_bad_steps sets the limit)"
            )

    if cfg.run.val_every and start_step < cfg.num_steps:  # the trained model, logged as step num_steps
        final = validate(engine, reward, val_prompts, cfg, logger, cfg.num_steps, d.device)
        logger.log(final, step=cfg.num_steps)
        metrics.update(final)
        flog.print0(f"final validation: {final}")
    if cfg.run.export_lora and cfg.model.lora:
        checkpoint.export_lora(run.path / "lora", model.transformer)
    logger.finish()
    run.unlock()
    del engine, optimizer, params, model
    parallel.shutdown()
    return metrics


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
            _record_gap(gap_per_step, traj.window, recomputed, traj.log_prob)
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
                        _record_gap(gap_per_step, traj.window[rows, j : j + 1], log_prob.detach()[:, None],
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
    out["optimizer_steps"] = float(len(stats["skipped_steps"]))
    for i, gaps in sorted(gap_per_step.items()):
        out[f"logprob_gap/step{i}"] = float(np.max(gaps))
    if gap_per_step:
        out["logprob_gap/max"] = max(out[f"logprob_gap/step{i}"] for i in gap_per_step)
    return out


def _record_gap(gaps: dict[int, list[float]], window: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None:
    """Append |new - old| log-prob per denoising-step index (window: [m, W'] step ids of the [m, W'] values)."""
    for i, gap in zip(window.flatten().tolist(), (new - old).abs().flatten().tolist()):
        gaps[i].append(gap)


@torch.no_grad()
def validate(
    engine, reward, prompts: list[str], cfg: TrainConfig, logger, step: int, device: torch.device
) -> dict[str, float]:
    """ODE samples of fixed prompts and seeds (the same every validation), scored by the reward."""
    world = parallel.world_size()
    n = math.ceil(len(prompts) / world) * world
    ids = torch.arange(n).view(world, -1)[parallel.rank()]
    local_prompts = [prompts[int(i) % len(prompts)] for i in ids]  # pad by wrapping so shapes match
    traj = rollout(engine, local_prompts, rs.validation_seeds(ids), validation_sampling(cfg.sampling, cfg.run.val_num_steps),
                   device)
    out = reward(traj.images.cpu().numpy(), local_prompts)
    check_scores(out, local_prompts, cfg.reward.name)
    scores = parallel.all_gather_cat(torch.as_tensor(out.scores, dtype=torch.float32, device=traj.images.device))
    scores = scores[: len(prompts)]
    logger.log_images("val", traj.images[:16].cpu().numpy(), local_prompts[:16], step=step)
    return {"val/reward_mean": scores.mean().item(), "val/reward_exact_frac": is_exact(scores).float().mean().item()}
