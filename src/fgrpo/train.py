"""The training loop: thin, top to bottom, owning all state. Flow-GRPO's algorithm box, with the parts
that differ between algorithms asked of `algo` (fgrpo/algorithms.py: Flow-GRPO, Flow-DPPO, MixGRPO,
DiffusionNFT, AWM):

    for step in steps:
        (every N-th step) validate the current weights: ODE samples of held-out prompts, fixed seeds
        prompts  <- deterministic slice of the prompt order (each rank a shard of the P*G samples)
        traj     <- engine.generate(prompts, seeds, algo.sampling(step))   # with algo.sampling_weights()
                    (Flow-GRPO: SDE inside each sample's window, ODE outside; NFT/AWM: the ODE)
        rewards  <- reward(traj.images)  -> all-gather -> group advantages (core)
        algo.update: for epoch, mini-batch, trained point, micro-batch:
            Flow-GRPO: log_prob <- policy.transition_log_prob(...)   # the same kernel the rollout used
                       loss     <- clipped_policy_loss (+ KL to the LoRA-disabled reference)
            backward (scaled so the gradient does not depend on the split); optimizer step per mini-batch
        algo.after_update (the EMA old policy); LoRA sync to an out-of-process engine; log; checkpoint

The loop body is four functions - `validation`, `experience` (prompts, rollout, rewards, advantages), `update`
and `record` (log, checkpoint) - so the asynchronous mode (`--parallel.rollout-ranks N`, fgrpo/async_mode.py)
runs the same code split over two sets of ranks: rollout ranks call `experience` for step k + max_staleness
while trainer ranks call `validation`, `update` and `record` for step k.

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
import math
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from fgrpo import algorithms, async_mode, checkpoint, guard, parallel, runs
from fgrpo import logging as flog
from fgrpo.async_mode import Batch
from fgrpo.config import ModelConfig, TrainConfig, validate_config
from fgrpo.core import grpo
from fgrpo.core.schedule import lr_multiplier
from fgrpo.data import load_prompts, step_prompt_indices
from fgrpo.errors import RunCollapsed
from fgrpo.models.base import FlowModel
from fgrpo.models.lora import export_lora, setup_trainable
from fgrpo.models.registry import build_model, check_config
from fgrpo.rewards import build_reward
from fgrpo.rewards.base import check_scores
from fgrpo.rewards.client import HttpReward
from fgrpo.rewards.ocr import is_exact
from fgrpo.rewards.runner import ParallelReward, RewardStream
from fgrpo.rollout import seeds as rs
from fgrpo.rollout.base import LoraSyncedEngine
from fgrpo.rollout.build import build_engine
from fgrpo.rollout.engine import rollout, validation_sampling
from fgrpo.runs import RunDir


def train(
    cfg: TrainConfig,
    *,
    experiment_source: str | Path | None = None,
    model_builder: Callable[[ModelConfig, torch.device, int], FlowModel] = build_model,
) -> dict[str, float]:
    """Run Flow-GRPO as configured; returns the last step's metrics (rank 0's view).

    model_builder(cfg.model, device, cfg.seed) makes the frozen generator every rank starts from (the same
    weights on each); the default loads model.kind. benchmarks/loop_step.py passes random real-size weights,
    which no model.path names.
    """
    # FSDP2 warns that the transformer returns a view; nothing in fgrpo writes into it in place
    # (CFG and the SDE step are out-of-place), so the warning is noise in every run's console.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    d = parallel.init_distributed(cfg.device)
    validate_config(cfg, d.world_size)
    check_config(cfg)
    metrics = _train(cfg, d, experiment_source, model_builder)
    # FSDP tensors and optimizer state died with _train's frame: the group can go (parallel.shutdown's rule).
    parallel.shutdown()
    return metrics


def _train(
    cfg: TrainConfig,
    d: parallel.Dist,
    experiment_source: str | Path | None,
    model_builder: Callable[[ModelConfig, torch.device, int], FlowModel],
) -> dict[str, float]:
    split = parallel.split(cfg.parallel.rollout_ranks)  # every rank trains and rolls out, or one of the two
    parallel.init_sequence_parallel(cfg.parallel.sp, d.device)  # SP groups of consecutive ranks share samples
    train_prompts = load_prompts(cfg.data.train_prompts, require_quoted=cfg.reward.is_ocr)
    val_prompts = load_prompts(
        cfg.data.val_prompts, require_quoted=cfg.reward.val_is_ocr, field="data.val_prompts"
    )[: cfg.data.val_num_prompts]
    run = RunDir(Path(cfg.run.out_dir) / cfg.exp_name)
    resume_from = run.start(cfg, is_main=d.is_main, say=flog.print0)

    def scorer(spec: str | dict, workers: int):
        return build_reward(spec) if workers == 0 else ParallelReward(spec, workers)

    reward = scorer(cfg.reward.spec, cfg.reward.workers)
    # The validation's own reward, where one is set, on the ranks that validate (the trainer ranks).
    val_workers = cfg.reward.workers if cfg.reward.val_workers < 0 else cfg.reward.val_workers
    val_own = cfg.reward.val_name or val_workers != cfg.reward.workers
    val_reward = scorer(cfg.reward.val_spec, val_workers) if val_own and split.trains else reward
    val_reward_name = cfg.reward.val_name or cfg.reward.url or cfg.reward.name
    # The reward this run trains on: what a reward service names in /health (asked now, so a wrong URL fails before
    # the model is built), else reward.name. reward.url may change on resume, the reward may not.
    trained_reward = HttpReward(cfg.reward.url).health().get("reward") if cfg.reward.url else cfg.reward.name
    runs.check_reward(
        run.path, trained_reward, resumed=resume_from is not None, write=d.is_main, say=flog.print0
    )

    torch.manual_seed(cfg.seed)  # LoRA init is the only draw from the global RNG
    model = model_builder(cfg.model, d.device, cfg.seed)
    setup_trainable(model.transformer, cfg.model)
    parallel.shard_transformer(
        model.transformer,
        param_dtype=torch.bfloat16 if cfg.model.dtype == "bf16" else None,
        mesh=split.mesh(d.device),
        shard=cfg.parallel.shard,
    )
    parallel.enable_sequence_parallel(model.transformer)  # rollout and training forwards alike
    params = [p for p in model.transformer.parameters() if p.requires_grad]  # now DTensors
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        partial(
            lr_multiplier,
            warmup=o.warmup_steps,
            schedule=o.schedule,
            decay_steps=cfg.lr_decay_steps,
            min_ratio=o.min_lr_ratio,
        ),
    )
    engine = build_engine(
        model,
        cfg.rollout_engine,
        cfg.model.path,
        train_graph=cfg.model.compile and cfg.model.exact_rollout,
        merged_lora=cfg.model.merged_rollout,
    )
    algo = algorithms.build(cfg, params)

    def rollout_weights() -> dict[str, torch.Tensor]:
        """What the asynchronous mode pushes: the trainable tensors the rollout samples with (NFT: the EMA)."""
        with algo.sampling_weights():
            return async_mode.trainable_tensors(model.transformer)

    # Rollout ranks of the asynchronous mode are sent those weights: they sample with the module as it is.
    sampling_weights = algo.sampling_weights if split.trains else contextlib.nullcontext
    # The asynchronous mode's weights the rollout still samples with, checkpointed (empty when synchronous).
    lagging = async_mode.Lagging.of(rollout_weights, split, cfg.parallel.max_staleness)

    start_step = 0
    if resume_from is not None:
        start_step, _ = checkpoint.load(
            resume_from,
            model=model.transformer,
            optimizer=optimizer if split.trains else None,
            lr_scheduler=lr_scheduler if split.trains else None,
            rank_tensors=algo.state() | lagging.state(),
        )
        flog.print0(f"resumed from {resume_from} at step {start_step}")
    # Rows of the steps after the checkpoint are redone below: move them aside, so the file keeps one row a step
    # (a finished run resumed has nothing to redo and keeps its final validation's row).
    if d.is_main and start_step < cfg.num_steps:
        run.supersede_metrics_from(start_step)
    logger = flog.make_logger(
        cfg,
        run.path,
        enabled=d.is_main,
        experiment_source=experiment_source,
        record=run.config_record(),
    )
    # The collapse guard (fgrpo.guard) resumes from the validation rows the run keeps (read on every rank, by
    # step: rank 0 may still be moving the redone ones aside).
    kept = [
        r
        for r in flog.read_metrics(run.path / "metrics.jsonl")
        if r["step"] < start_step or start_step >= cfg.num_steps
    ]
    tracker = guard.BestTracker.replay(kept, drop=cfg.run.collapse_drop, patience=cfg.run.collapse_patience)
    best_record = guard.read_best_record(run.path)
    if best_record is not None and best_record.get("step") != tracker.best_step:
        flog.print0(
            f"note: {guard.BEST_DIR}/ holds the adapter of step {best_record.get('step')}, a validation after the "
            f"checkpoint; the kept best is step {tracker.best_step}, and the next better validation replaces it"
        )
    trainer_group = split.group if split.is_async else None  # the ranks that hold the trained weights

    G, P = cfg.grpo.group_size, cfg.grpo.prompts_per_step
    n_local = P * G // split.data_size()
    i = split.data_rank()
    sample_ids = torch.arange(i * n_local, (i + 1) * n_local)  # this rank's slice of the step
    bad_steps = 0
    bar = flog.Progress(total=cfg.num_steps, initial=start_step)

    def validation(step: int, timer: flog.PhaseTimer) -> dict[str, float]:
        """0. validation of the weights that enter this step (step 0: the starting model), every run.val_every."""
        if not (cfg.run.val_every and step % cfg.run.val_every == 0):
            return {}
        with timer("val"):
            return guarded(
                step,
                validate(
                    engine, val_reward, val_reward_name, val_prompts, cfg, logger, step, d.device, split
                ),
            )

    def guarded(step: int, val: dict[str, float]) -> dict[str, float]:
        """The collapse guard after a validation: a new best's adapter to lora_best/, and the stop (the row logged
        first) once run.collapse_patience validations in a row fall run.collapse_drop below the best."""
        score = val["val/reward_mean"]
        if tracker.observe(step, score) and cfg.model.lora:
            export_lora(
                run.path / guard.BEST_DIR,
                model.transformer,
                group=trainer_group,
                extra_json=guard.best_record(step, score),
            )
        val = val | tracker.metrics()
        if tracker.collapsed():
            logger.log(val, step=step)
            logger.finish()
            bar.close()
            run.unlock()
            raise RunCollapsed(guard.collapse_message(tracker, step, score, run.path, lora=cfg.model.lora))
        return val

    def experience(step: int, timer: flog.PhaseTimer) -> Batch:
        """1.-3. of the step: prompts and seeds, rollout, rewards -> group advantages."""
        # 1. prompts and seeds: pure functions of (seed, step)
        prompt_ids = step_prompt_indices(len(train_prompts), step, P, cfg.seed)
        prompts = [train_prompts[int(prompt_ids[int(i) // G])] for i in sample_ids]
        seeds = rs.sample_seeds(cfg.seed, step, sample_ids)
        init_seeds = rs.group_init_seeds(cfg.seed, step, sample_ids, G) if cfg.grpo.group_init_noise else None

        # 2. rollout, each micro-batch's images scored while the next one samples
        stream = RewardStream(reward, prompts)
        with timer("rollout"), sampling_weights():
            traj = rollout(engine, prompts, seeds, algo.sampling(step), d.device, init_seeds, stream.add)

        # 3. rewards -> all ranks (of the rollout side) -> group advantages
        with timer("reward"):
            out = stream.result()
            check_scores(out, prompts, cfg.reward.url or cfg.reward.name)
            local_rewards = torch.as_tensor(out.scores, dtype=torch.float32, device=d.device)
        with timer("sync"):
            rewards = parallel.all_gather_cat(local_rewards, split.data_group())
            advantages = grpo.group_advantages(rewards, G, std=cfg.grpo.adv_std)
        return Batch(step, traj, rewards, advantages, dict(out.metrics))

    def update(step: int, batch: Batch, timer: flog.PhaseTimer, off_policy: bool = False) -> dict[str, float]:
        """4. the policy update on this rank's samples (off_policy: stale samples, see async_mode)."""
        with timer("train"):
            order = rs.stream_generator(cfg.seed, batch.step, rs.MINIBATCH_ORDER)  # the same on resume
            local_adv = batch.advantages[sample_ids.to(d.device)]
            train_metrics = algo.update(
                model, params, optimizer, lr_scheduler, batch.traj, local_adv, order, off_policy=off_policy
            )
            train_metrics.update(algo.after_update(step))
        with timer("sync"):
            if isinstance(engine, LoraSyncedEngine):
                engine.update_lora(export_lora(run.path / "engine_lora", model.transformer))
        return train_metrics

    def checkpoint_due(step: int) -> bool:
        return cfg.num_steps == step + 1 or bool(cfg.run.ckpt_every and (step + 1) % cfg.run.ckpt_every == 0)

    def save(step: int) -> None:
        """Collective over every rank; in the asynchronous mode rollout ranks join it with their model copy."""
        checkpoint.save(
            run.checkpoints,
            step + 1,
            model=model.transformer,
            optimizer=optimizer if split.trains else None,
            lr_scheduler=lr_scheduler if split.trains else None,
            extra_state={"exp_name": cfg.exp_name},
            rank_tensors=algo.state() | lagging.state(),
            keep_last=cfg.run.keep_last,
        )

    def record(
        step: int,
        batch: Batch,
        train_metrics: dict[str, float],
        timer: flog.PhaseTimer,
        extra: dict[str, float],
    ) -> dict[str, float]:
        """5. log (before the checkpoint that claims this step, so a crash between them loses no row),
        checkpoint, and stop a run whose every optimizer step is skipped."""
        nonlocal bad_steps
        rewards = batch.rewards
        grouped = rewards.view(P, G)
        metrics = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(unbiased=False).item(),
            "reward/zero_std_group_frac": (grouped.std(dim=1, unbiased=False) == 0).float().mean().item(),
            **{f"reward/{k}": float(v) for k, v in batch.reward_metrics.items()},
            **{f"train/{k}": v for k, v in train_metrics.items()},
            "lr": float(lr_scheduler.get_last_lr()[0]),
            **extra,
            **timer.metrics(images=P * G),
        }
        if cfg.run.log_images_every and step % cfg.run.log_images_every == 0:
            traj = batch.traj
            logger.log_images("rollout", traj.images[:16].cpu().numpy(), traj.prompts[:16], step=step)
        logger.log(metrics, step=step)
        bar.update(metrics)
        if checkpoint_due(step):
            save(step)
        bad_steps = bad_steps + 1 if train_metrics["skipped_steps"] == train_metrics["optimizer_steps"] else 0
        if bad_steps >= cfg.run.max_bad_steps:
            raise FloatingPointError(
                f"{bad_steps} steps in a row skipped every optimizer step (non-finite gradients) at step {step}; "
                "the run trains nothing: lower optim.lr or check the reward (run.max_bad_steps sets the limit)"
            )
        return metrics

    metrics: dict[str, float] = {}
    if not split.is_async:
        for step in range(start_step, cfg.num_steps):
            timer = flog.PhaseTimer()
            val_metrics = validation(step, timer)  # 0.
            batch = experience(step, timer)  # 1.-3.
            train_metrics = update(step, batch, timer)  # 4.
            metrics = record(step, batch, train_metrics, timer, val_metrics)  # 5.
    elif split.trains:
        metrics = async_mode.run_trainer(
            cfg, split, rollout_weights, d.device, start_step, lagging, validation, update, record
        )
    else:
        async_mode.run_rollout(
            cfg,
            split,
            model.transformer,
            start_step,
            experience,
            lambda step: save(step) if checkpoint_due(step) else None,
        )

    bar.close()
    # The trained model, logged as step num_steps (by the trainer ranks: the rollout's copy lags); also when a
    # finished run is resumed whose final validation was cut short (metrics.jsonl has no row of it).
    final_due = start_step < cfg.num_steps or (
        start_step == cfg.num_steps and not run.final_validation_logged
    )
    if cfg.run.val_every and final_due and split.trains:
        final = validate(
            engine, val_reward, val_reward_name, val_prompts, cfg, logger, cfg.num_steps, d.device, split
        )
        final = guarded(cfg.num_steps, final)  # a collapsed run stops here, before `lora/` is exported
        logger.log(final, step=cfg.num_steps)
        metrics.update(final)
        flog.print0(f"final validation: {final}")
    if cfg.run.export_lora and cfg.model.lora:
        export_lora(run.path / "lora", model.transformer)
    logger.finish()
    run.unlock()
    return metrics


@torch.no_grad()
def validate(
    engine,
    reward,
    reward_name: str,
    prompts: list[str],
    cfg: TrainConfig,
    logger,
    step: int,
    device: torch.device,
    split: parallel.Split,
) -> dict[str, float]:
    """ODE samples of fixed prompts and seeds (the same every validation), scored by the reward, on the
    training ranks (all of them; the trainer ranks of the asynchronous mode, which hold the current weights)."""
    world = split.data_size()
    n = math.ceil(len(prompts) / world) * world
    ids = torch.arange(n).view(world, -1)[split.data_rank()]
    local_prompts = [prompts[int(i) % len(prompts)] for i in ids]  # pad by wrapping so shapes match
    traj = rollout(
        engine,
        local_prompts,
        rs.validation_seeds(ids),
        validation_sampling(cfg.sampling, cfg.run.val_num_steps),
        device,
    )
    images = traj.images.cpu().numpy()
    out = reward(images, local_prompts)
    check_scores(out, local_prompts, reward_name)
    # per image: the score, then the gold statistics (fgrpo.guard), gathered in one collective
    no_text = guard.no_text_flags(out.components, len(local_prompts))
    rows = torch.cat(
        [
            torch.as_tensor(out.scores, dtype=torch.float32)[:, None],
            guard.image_stats(images),
            torch.as_tensor(no_text)[:, None],
        ],
        dim=1,
    )
    rows = parallel.all_gather_cat(rows.to(traj.images.device), split.data_group())[: len(prompts)].cpu()
    scores = rows[:, 0]
    logger.log_images("val", images[:16], local_prompts[:16], step=step)
    gold: dict[str, float] = dict(zip(guard.GOLD_KEYS, rows[:, 1:5].mean(dim=0).tolist()))
    if not torch.isnan(rows[:, 5]).any():
        gold["no_text_frac"] = rows[:, 5].mean().item()
    return {
        "val/reward_mean": scores.mean().item(),
        "val/reward_exact_frac": is_exact(scores).float().mean().item(),
        **{f"val/gold/{k}": v for k, v in gold.items()},
    }
