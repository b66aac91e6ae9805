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

`Trainer` owns the run's state and has the loop body's phases as methods - `validation`, `experience` (prompts,
rollout, rewards, advantages), `update` and `record` (log, checkpoint) - so the asynchronous mode
(`--parallel.rollout-ranks N`, fgrpo/async_mode.py) runs the same code split over two sets of ranks: rollout
ranks call `experience` for step k + max_staleness while trainer ranks call `validation`, `update` and `record`
for step k; and benchmarks/train_step.py times the same methods.

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
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from fgrpo import algorithms, async_mode, checkpoint, evaluate, guard, parallel, runs
from fgrpo import logging as flog
from fgrpo.async_mode import Batch
from fgrpo.config import ModelConfig, TrainConfig
from fgrpo.core import grpo
from fgrpo.core.schedule import lr_multiplier
from fgrpo.data import load_prompts, step_prompt_indices
from fgrpo.errors import RunCollapsed
from fgrpo.models.base import FlowModel, trained_module, trained_transformers
from fgrpo.models.lora import export_loras, lora_file_tensors, setup_trainable_model
from fgrpo.models.registry import build_model
from fgrpo.models.wan import wan_kwargs
from fgrpo.rewards import build_reward
from fgrpo.rewards.base import Reward, check_scores
from fgrpo.rewards.client import HttpReward
from fgrpo.rewards.runner import ParallelReward, RewardStream
from fgrpo.rollout import seeds as rs
from fgrpo.rollout.base import ClosingEngine, LoraSyncedEngine
from fgrpo.rollout.build import build_engine
from fgrpo.rollout.engine import rollout, validation_sampling
from fgrpo.runs import RunDir


def train(
    cfg: TrainConfig,
    *,
    experiment_source: str | Path | None = None,
    model_builder: Callable[[ModelConfig, torch.device, int], FlowModel] = build_model,
) -> dict[str, float]:
    """Run the configured algorithm; returns the last step's metrics (rank 0's view).

    model_builder(cfg.model, device, cfg.seed) makes the frozen generator every rank starts from (the same
    weights on each); the default loads model.kind. benchmarks/loop_step.py passes random real-size weights,
    which no model.path names.
    """
    # FSDP2 warns that the transformer returns a view; nothing in fgrpo writes into it in place
    # (CFG and the SDE step are out-of-place), so the warning is noise in every run's console.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    d = parallel.init_distributed(cfg.device)
    algorithms.check_config(cfg, d.world_size)
    metrics = Trainer(cfg, d, experiment_source=experiment_source, model_builder=model_builder).train()
    # FSDP tensors and optimizer state died with the Trainer: the group can go (parallel.shutdown's rule).
    parallel.shutdown()
    return metrics


class Trainer:
    """One run's state - model, trainable parameters, optimizer, lr scheduler, rollout engine, algorithm,
    rewards, run directory, logger, collapse guard - with the step's phases as methods: `validation`,
    `experience` (prompts, rollout, rewards, advantages), `update`, `record` (log, `save`). `train` is their loop;
    the asynchronous mode (async_mode.run_trainer / run_rollout) calls the same methods from its two sides, and
    benchmarks/train_step.py times them on random real-size weights.

    Building it starts the run: the run directory is claimed (or resumed), the rewards and the model built, LoRA
    added and the transformer sharded, the checkpoint loaded. `model`: a transformer already made trainable and
    sharded by an earlier Trainer of this process (a benchmark's several algorithms over one model build), whose
    adapter an engine with weights of its own gets before the first rollout, as after a resume; `reward`: a Reward
    object in place of reward.spec's (a benchmark's stub or colocated model).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        d: parallel.Dist,
        *,
        experiment_source: str | Path | None = None,
        model_builder: Callable[[ModelConfig, torch.device, int], FlowModel] = build_model,
        model: FlowModel | None = None,
        reward: Reward | None = None,
    ):
        self.cfg, self.device = cfg, d.device
        self.split = split = parallel.split(cfg.parallel.rollout_ranks)  # all ranks do both, or one side each
        parallel.init_sequence_parallel(
            cfg.parallel.sp, d.device
        )  # SP groups of consecutive ranks share samples
        self.train_prompts = load_prompts(cfg.data.train_prompts, require_quoted=cfg.reward.is_ocr)
        self.val_prompts = load_prompts(
            cfg.data.val_prompts, require_quoted=cfg.reward.val_is_ocr, field="data.val_prompts"
        )[: cfg.data.val_num_prompts]
        self.run = RunDir(Path(cfg.run.out_dir) / cfg.exp_name)
        resume_from = self.run.start(cfg, is_main=d.is_main, say=flog.print0)
        self._build_rewards(reward, resumed=resume_from is not None, is_main=d.is_main)

        reused = model is not None  # its adapter may have been trained already
        if model is None:
            torch.manual_seed(cfg.seed)  # LoRA init is the only draw from the global RNG
            model = model_builder(cfg.model, d.device, cfg.seed)
            setup_trainable_model(model, cfg.model)
            for transformer in trained_transformers(model).values():  # each its own FSDP units
                parallel.shard_transformer(
                    transformer,
                    param_dtype=torch.bfloat16 if cfg.model.dtype == "bf16" else None,
                    mesh=split.mesh(d.device),
                    shard=cfg.parallel.shard,
                )
                parallel.enable_sequence_parallel(transformer)  # rollout and training forwards alike
        self.model = model
        # The transformers' trainable parameters as one module (checkpoints, weight pushes): model.transformer
        # itself when it is the only one.
        self.trained = trained_module(model)
        self.params = [p for p in self.trained.parameters() if p.requires_grad]  # now DTensors
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            partial(
                lr_multiplier,
                warmup=o.warmup_steps,
                schedule=o.schedule,
                decay_steps=cfg.lr_decay_steps,
                min_ratio=o.min_lr_ratio,
            ),
        )
        self.algo = algorithms.build(cfg, self.params)
        self.engine = build_engine(
            model,
            cfg.rollout_engine,
            cfg.model.path,
            train_graph=cfg.model.compile and cfg.model.exact_rollout,
            merged_lora=cfg.model.merged_rollout,
            float8=cfg.model.merged_float8,
            keep=self.algo.rollout_fields(),
            kind=cfg.model.kind,
            model_kwargs=wan_kwargs(cfg.model),
            compile=cfg.model.compile,
        )
        # The asynchronous mode's weights the rollout still samples with, checkpointed (empty when synchronous).
        self.lagging = async_mode.Lagging.of(self.rollout_weights, split, cfg.parallel.max_staleness)

        self.start_step = 0
        if resume_from is not None:
            self.start_step, _ = checkpoint.load(
                resume_from,
                model=self.trained,
                optimizer=self.optimizer if split.trains else None,
                lr_scheduler=self.lr_scheduler if split.trains else None,
                rank_tensors=self.algo.state() | self.lagging.state(),
            )
            flog.print0(f"resumed from {resume_from} at step {self.start_step}")
        if resume_from is not None or cfg.model.init_lora or reused:
            self.sync_engine()  # else its first rollout would sample the base weights it was started with
        # Rows of the steps after the checkpoint are redone below: move them aside, so the file keeps one row a
        # step (a finished run resumed has nothing to redo and keeps its final validation's row).
        if d.is_main and self.start_step < cfg.num_steps:
            self.run.supersede_metrics_from(self.start_step)
        self.logger = runs.make_logger(
            cfg,
            self.run.path,
            enabled=d.is_main,
            experiment_source=experiment_source,
            record=self.run.config_record(),
        )
        self.tracker = self._replay_guard()
        self.trainer_group = (
            split.group if split.is_async else None
        )  # the ranks that hold the trained weights

        G, P = cfg.grpo.group_size, cfg.grpo.prompts_per_step
        n_local = P * G // split.data_size()
        i = split.data_rank()
        self.sample_ids = torch.arange(i * n_local, (i + 1) * n_local)  # this rank's slice of the step
        self.bad_steps = 0
        self.bar = flog.Progress(total=cfg.num_steps, initial=self.start_step)

    def _build_rewards(self, reward: Reward | None, *, resumed: bool, is_main: bool) -> None:
        """The training reward; the validation's own, where one is set, on the ranks that validate (the trainer
        ranks); and the check that a resumed run trains on the reward it started with."""
        r = self.cfg.reward

        def scorer(spec: str | dict, workers: int) -> Reward:
            return build_reward(spec) if workers == 0 else ParallelReward(spec, workers)

        self.reward = reward if reward is not None else scorer(r.spec, r.workers)
        val_workers = r.workers if r.val_workers < 0 else r.val_workers
        val_own = r.val_name or val_workers != r.workers
        self.val_reward = scorer(r.val_spec, val_workers) if val_own and self.split.trains else self.reward
        self.val_reward_name = r.val_name or r.url or r.name
        # The reward this run trains on: what a reward service names in /health (asked now, so a wrong URL fails
        # before the model is built), else reward.name. reward.url may change on resume, the reward may not.
        trained_reward = HttpReward(r.url).health().get("reward") if r.url else r.name
        runs.check_reward(self.run.path, trained_reward, resumed=resumed, write=is_main, say=flog.print0)

    def _replay_guard(self) -> guard.BestTracker:
        """The collapse guard (fgrpo.guard), resumed from the validation rows the run keeps (read on every rank,
        by step: rank 0 may still be moving the redone ones aside)."""
        cfg, start = self.cfg, self.start_step
        kept = [
            r
            for r in flog.read_metrics(self.run.path / "metrics.jsonl")
            if r["step"] < start or start >= cfg.num_steps
        ]
        tracker = guard.BestTracker.replay(
            kept, drop=cfg.run.collapse_drop, patience=cfg.run.collapse_patience
        )
        best_record = guard.read_best_record(self.run.path)
        if best_record is not None and best_record.get("step") != tracker.best_step:
            flog.print0(
                f"note: {guard.BEST_DIR}/ holds the adapter of step {best_record.get('step')}, a validation after "
                f"the checkpoint; the kept best is step {tracker.best_step}, and the next better validation "
                "replaces it"
            )
        return tracker

    # ------------------------------------------------------------------------------------------------------
    # the loop

    def train(self) -> dict[str, float]:
        """Every step from the checkpoint's to cfg.num_steps, then the final validation and the LoRA export;
        returns the last step's metrics (with the final validation's)."""
        cfg, split = self.cfg, self.split
        metrics: dict[str, float] = {}
        if not split.is_async:
            for step in range(self.start_step, cfg.num_steps):
                timer = flog.PhaseTimer()
                val_metrics = self.validation(step, timer)  # 0.
                batch = self.experience(step, timer)  # 1.-3.
                train_metrics = self.update(step, batch, timer)  # 4.
                metrics = self.record(step, batch, train_metrics, timer, val_metrics)  # 5.
        elif split.trains:
            metrics = async_mode.run_trainer(self)
        else:
            async_mode.run_rollout(self)
        return metrics | self.finish()

    def finish(self) -> dict[str, float]:
        """After the last step: the trained model's validation, logged as step num_steps (by the trainer ranks:
        the rollout's copy lags), also when a finished run is resumed whose final validation was cut short
        (metrics.jsonl has no row of it); the LoRA export; the logger, the run directory and an engine with
        processes of its own closed."""
        cfg, run = self.cfg, self.run
        self.bar.close()
        final_due = self.start_step < cfg.num_steps or (
            self.start_step == cfg.num_steps and not run.final_validation_logged
        )
        final: dict[str, float] = {}
        if cfg.run.val_every and final_due and self.split.trains:
            final = self.guarded(
                cfg.num_steps, self.validate(cfg.num_steps)
            )  # a collapse stops before `lora/` is exported
            self.logger.log(final, step=cfg.num_steps)
            flog.print0(f"final validation: {final}")
        if cfg.run.export_lora and cfg.model.lora:
            self.export_lora(run.path / "lora")
        self.logger.finish()
        if isinstance(self.engine, ClosingEngine):  # its workers hold GPU memory until they exit
            self.engine.close()
        run.unlock()
        return final

    # ------------------------------------------------------------------------------------------------------
    # the step's phases

    def validation(self, step: int, timer: flog.PhaseTimer) -> dict[str, float]:
        """0. validation of the weights that enter this step (step 0: the starting model), every run.val_every."""
        if not (self.cfg.run.val_every and step % self.cfg.run.val_every == 0):
            return {}
        with timer("val"):
            return self.guarded(step, self.validate(step))

    def validate(self, step: int) -> dict[str, float]:
        """The validation metrics of the current weights (`validate`), their images logged at `step`."""
        return validate(
            self.engine,
            self.val_reward,
            self.val_reward_name,
            self.val_prompts,
            self.cfg,
            self.logger,
            step,
            self.device,
            self.split,
        )

    def guarded(self, step: int, val: dict[str, float]) -> dict[str, float]:
        """The collapse guard after a validation: a new best's adapter to lora_best/, and the stop (the row logged
        first) once run.collapse_patience validations in a row fall run.collapse_drop below the best."""
        cfg, tracker = self.cfg, self.tracker
        score = val["val/reward_mean"]
        if tracker.observe(step, score) and cfg.model.lora:
            self.export_lora(
                self.run.path / guard.BEST_DIR,
                group=self.trainer_group,
                extra_json=guard.best_record(step, score),
            )
        val = val | tracker.metrics()
        if tracker.collapsed():
            self.logger.log(val, step=step)
            self.logger.finish()
            self.bar.close()
            self.run.unlock()
            raise RunCollapsed(
                guard.collapse_message(tracker, step, score, self.run.path, lora=cfg.model.lora)
            )
        return val

    def prompts(self, step: int) -> list[str]:
        """This rank's prompts of `step`, one per sample: a pure function of (seed, step)."""
        G, P = self.cfg.grpo.group_size, self.cfg.grpo.prompts_per_step
        prompt_ids = step_prompt_indices(len(self.train_prompts), step, P, self.cfg.seed)
        return [self.train_prompts[int(prompt_ids[int(i) // G])] for i in self.sample_ids]

    def experience(self, step: int, timer: flog.PhaseTimer) -> Batch:
        """1.-3. of the step: prompts and seeds, rollout, rewards -> group advantages."""
        cfg, G = self.cfg, self.cfg.grpo.group_size
        # 1. prompts and seeds: pure functions of (seed, step)
        prompts = self.prompts(step)
        seeds = rs.sample_seeds(cfg.seed, step, self.sample_ids)
        init_seeds = (
            rs.group_init_seeds(cfg.seed, step, self.sample_ids, G) if cfg.grpo.group_init_noise else None
        )

        # 2. rollout, each micro-batch's images scored while the next one samples; rollout ranks of the
        # asynchronous mode are sent the sampling weights and sample with the module as it is
        stream = RewardStream(self.reward, prompts)
        weights = self.algo.sampling_weights() if self.split.trains else contextlib.nullcontext()
        with timer("rollout"), weights:
            traj = rollout(
                self.engine, prompts, seeds, self.algo.sampling(step), self.device, init_seeds, stream.add
            )

        # 3. rewards -> all ranks (of the rollout side) -> group advantages
        with timer("reward"):
            out = stream.result()
            check_scores(out, prompts, cfg.reward.url or cfg.reward.name)
            local_rewards = torch.as_tensor(out.scores, dtype=torch.float32, device=self.device)
        with timer("sync"):
            rewards = parallel.all_gather_cat(local_rewards, self.split.data_group())
            advantages = grpo.group_advantages(rewards, G, std=cfg.grpo.adv_std)
        return Batch(step, traj, rewards, advantages, dict(out.metrics))

    def update(
        self, step: int, batch: Batch, timer: flog.PhaseTimer, off_policy: bool = False
    ) -> dict[str, float]:
        """4. the policy update on this rank's samples (off_policy: stale samples, see async_mode)."""
        cfg = self.cfg
        with timer("train"):
            order = rs.stream_generator(cfg.seed, batch.step, rs.MINIBATCH_ORDER)  # the same on resume
            local_adv = batch.advantages[self.sample_ids.to(self.device)]
            train_metrics = self.algo.update(
                self.model,
                self.params,
                self.optimizer,
                self.lr_scheduler,
                batch.traj,
                local_adv,
                order,
                off_policy=off_policy,
            )
            train_metrics.update(self.algo.after_update(step))
        with timer("sync"):
            self.sync_engine()
        return train_metrics

    def sync_engine(self) -> None:
        """An engine with its own weights (vLLM-Omni) gets the trained adapter from memory (no file of it written
        and read back); the in-process one shares it. The engine takes one transformer's (it refuses a two-expert
        Wan by name)."""
        if isinstance(self.engine, LoraSyncedEngine):
            transformer = next(iter(trained_transformers(self.model).values()))
            self.engine.update_lora(*lora_file_tensors(transformer))

    def export_lora(self, out_dir: Path, **kwargs) -> Path:
        """The trained LoRA in diffusers' layout (models.lora.export_loras: one directory of each transformer's
        where the model has several)."""
        return export_loras(out_dir, trained_transformers(self.model), **kwargs)

    def record(
        self,
        step: int,
        batch: Batch,
        train_metrics: dict[str, float],
        timer: flog.PhaseTimer,
        extra: dict[str, float],
    ) -> dict[str, float]:
        """5. log (before the checkpoint that claims this step, so a crash between them loses no row),
        checkpoint, and stop a run whose every optimizer step is skipped."""
        cfg = self.cfg
        P, G = cfg.grpo.prompts_per_step, cfg.grpo.group_size
        rewards = batch.rewards
        grouped = rewards.view(P, G)
        metrics = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(unbiased=False).item(),
            "reward/zero_std_group_frac": (grouped.std(dim=1, unbiased=False) == 0).float().mean().item(),
            **{f"reward/{k}": float(v) for k, v in batch.reward_metrics.items()},
            **{f"train/{k}": v for k, v in train_metrics.items()},
            "lr": float(self.lr_scheduler.get_last_lr()[0]),
            **extra,
            **timer.metrics(images=P * G),
        }
        if cfg.run.log_images_every and step % cfg.run.log_images_every == 0:
            traj = batch.traj
            self.logger.log_images("rollout", traj.images[:16].cpu().numpy(), traj.prompts[:16], step=step)
        self.logger.log(metrics, step=step)
        self.bar.update(metrics)
        self.save_if_due(step)
        all_skipped = train_metrics["skipped_steps"] == train_metrics["optimizer_steps"]
        self.bad_steps = self.bad_steps + 1 if all_skipped else 0
        if self.bad_steps >= cfg.run.max_bad_steps:
            raise FloatingPointError(
                f"{self.bad_steps} steps in a row skipped every optimizer step (non-finite gradients) at step "
                f"{step}; the run trains nothing: lower optim.lr or check the reward (run.max_bad_steps sets the "
                "limit)"
            )
        return metrics

    def save_if_due(self, step: int) -> None:
        """The checkpoint after `step`, every run.ckpt_every steps and after the last. Collective over every
        rank; in the asynchronous mode rollout ranks join it with their model copy."""
        cfg = self.cfg
        due = cfg.num_steps == step + 1 or bool(cfg.run.ckpt_every and (step + 1) % cfg.run.ckpt_every == 0)
        if not due:
            return
        trains = self.split.trains
        checkpoint.save(
            self.run.checkpoints,
            step + 1,
            model=self.trained,
            optimizer=self.optimizer if trains else None,
            lr_scheduler=self.lr_scheduler if trains else None,
            extra_state={"exp_name": cfg.exp_name},
            rank_tensors=self.algo.state() | self.lagging.state(),
            keep_last=cfg.run.keep_last,
        )

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """What the asynchronous mode pushes: the trainable tensors the rollout samples with (NFT: the EMA)."""
        with self.algo.sampling_weights():
            return async_mode.trainable_tensors(self.trained)


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
    training ranks (all of them; the trainer ranks of the asynchronous mode, which hold the current weights).
    The sampling and scoring are fgrpo.evaluate's, so an evaluation reproduces these numbers."""
    sampling = validation_sampling(cfg.sampling, cfg.run.val_num_steps)
    scored = evaluate.sample_and_score(
        engine, reward, reward_name, prompts, sampling, device, split, ocr=cfg.reward.val_is_ocr
    )
    logger.log_images("val", scored.images[:16], scored.prompts[:16], step=step)
    return evaluate.validation_metrics(scored.metrics)
