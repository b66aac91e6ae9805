"""Trainer options that must not change the numbers - parallel.shard='adapters' and
model.checkpoint_policy='selective' - against today's path (full sharding, full checkpointing) on the tiny
random Qwen-Image with LoRA: two Flow-GRPO steps (rollout, then 2 optimizer steps each) through the trainer's
own pieces (DiffusersEngine, algorithms.window_update, checkpoint.save/load).

tests/test_train_options.py calls `report` in-process (world size 1) and runs this file under torchrun:
    torchrun --nproc-per-node 2 tests/train_options_entry.py OUT.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

from fgrpo import algorithms, checkpoint, parallel
from fgrpo.config import GRPOConfig, ModelConfig, OptimConfig, SamplingConfig, TrainConfig
from fgrpo.models.lora import setup_trainable
from fgrpo.models.tiny import tiny_qwen_image
from fgrpo.rollout.engine import DiffusersEngine

SAMPLING = SamplingConfig(
    height=32,
    width=32,
    num_steps=4,
    guidance_scale=3.0,
    negative_prompt=" ",
    noise_level=0.9,
    window_size=2,
    window_range=(0, 3),
    micro_batch=2,
)
N = 8  # samples a step over all ranks: 2 prompts x 4
PROMPTS = ["a sign that says hi", "a cat"]
# (shard, gradient_checkpointing, checkpoint_policy); "today" is the recipe's default path.
VARIANTS = {
    "today": ("full", True, "full"),
    "adapters": ("adapters", True, "full"),
    "selective": ("full", True, "selective"),
    "adapters_selective": ("adapters", True, "selective"),
    "no_checkpointing": ("full", False, "full"),
}


def config(variant: str, dtype: str) -> TrainConfig:
    shard, ckpt, policy = VARIANTS[variant]
    model = ModelConfig(
        kind="tiny_qwen_image",
        dtype=dtype,  # pyright: ignore[reportArgumentType]
        lora_rank=4,
        lora_alpha=8,
        gradient_checkpointing=ckpt,
        checkpoint_policy=policy,  # pyright: ignore[reportArgumentType]
    )
    return dataclasses.replace(
        TrainConfig(),
        model=model,
        sampling=SAMPLING,
        # A large LR and clip range, so the two steps move every adapter weight and the second step's ratio
        # is far from 1 (the clip is active).
        optim=OptimConfig(lr=3e-2),
        grpo=GRPOConfig(group_size=4, prompts_per_step=2, optimizer_steps_per_step=2, clip_range=0.2),
        parallel=dataclasses.replace(TrainConfig().parallel, shard=shard),  # pyright: ignore[reportArgumentType]
    )


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if parallel.is_dtensor(p) else p).detach().cpu().clone()


class Run:
    """One model built, sharded and optimised as train.py does, for a variant; `lora` holds the full adapter
    tensors after every optimizer step."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        torch.manual_seed(0)  # the LoRA init, as train.py seeds it
        dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
        self.model = tiny_qwen_image(seed=0, dtype=dtype)
        setup_trainable(self.model.transformer, cfg.model)
        parallel.shard_transformer(
            self.model.transformer,
            param_dtype=torch.bfloat16 if cfg.model.dtype == "bf16" else None,
            shard=cfg.parallel.shard,
        )
        self.params = [p for p in self.model.transformer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.optim.lr)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda k: 1.0)
        self.lora: list[list[torch.Tensor]] = [[_full(p) for p in self.params]]
        self.optimizer.register_step_post_hook(lambda *_: self.lora.append([_full(p) for p in self.params]))
        self.log_probs: list[torch.Tensor] = []
        self.gaps: list[float] = []

    def step(self, step: int) -> None:
        """Rollout of this rank's share of the step's samples, then window_update (2 optimizer steps)."""
        n = N // parallel.world_size()
        ids = range(parallel.rank() * n, (parallel.rank() + 1) * n)
        prompts = [PROMPTS[i // 4] for i in ids]
        seeds = [1000 * step + i for i in ids]
        traj = DiffusersEngine(self.model).generate(prompts, seeds, self.cfg.sampling)
        advantages = torch.linspace(-1.5, 1.5, N)[list(ids)] * (-1) ** step
        gen = torch.Generator().manual_seed(step)
        algo = algorithms.Algorithm(self.cfg, self.params)
        m = algorithms.window_update(
            self.model, self.params, self.optimizer, self.lr_scheduler, traj, advantages, self.cfg, gen, algo
        )
        self.log_probs.append(parallel.all_gather_cat(traj.log_prob))
        self.gaps.append(m["logprob_gap/max"])


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def report(dtype: str, variants: list[str], ckpt_root: str | Path) -> dict:
    """For each variant against "today": max |difference| of the full adapter after each of the 4 optimizer
    steps and of the rollouts' log-probs, the |rollout - first update| log-prob gap of each step, and for the
    variants that shard adapters, a run resumed from the step-1 checkpoint against the uninterrupted run.
    Collective: every rank calls it with the same arguments."""
    runs = {}
    for v in ["today", *variants]:
        run = runs[v] = Run(config(v, dtype))
        for step in range(2):
            run.step(step)
            if step == 0 and v != "today":
                checkpoint.save(
                    Path(ckpt_root) / v,
                    1,
                    model=run.model.transformer,
                    optimizer=run.optimizer,
                    lr_scheduler=run.lr_scheduler,
                )
    today = runs["today"]
    out: dict = {
        "moved": _max_diff(today.lora[0], today.lora[-1]),
        "today_gaps": today.gaps,
    }
    for v in variants:
        run = runs[v]
        resumed = Run(config(v, dtype))
        checkpoint.load(
            Path(ckpt_root) / v / "step_000001",
            model=resumed.model.transformer,
            optimizer=resumed.optimizer,
            lr_scheduler=resumed.lr_scheduler,
        )
        resumed.lora = [[_full(p) for p in resumed.params]]
        resumed.step(1)
        frozen = [p for p in run.model.transformer.parameters() if not p.requires_grad]
        out[v] = {
            "lora_diff_per_optimizer_step": [_max_diff(a, b) for a, b in zip(today.lora, run.lora)],
            "optimizer_steps": len(run.lora) - 1,
            "log_prob_diff": [_max_diff([a], [b]) for a, b in zip(today.log_probs, run.log_probs)],
            "gaps": run.gaps,
            "resume_diff": [_max_diff(a, b) for a, b in zip(run.lora[2:], resumed.lora)],
            "frozen_dtensors": sum(parallel.is_dtensor(p) for p in frozen),
            "frozen": len(frozen),
            "trainable_dtensors": sum(parallel.is_dtensor(p) for p in run.params),
        }
    return out


if __name__ == "__main__":
    parallel.init_distributed("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        # Every rank must write into the same directory: rank 0's, broadcast.
        root = [tmp]
        torch.distributed.broadcast_object_list(root, src=0)
        results = {
            dtype: report(dtype, ["adapters", "selective", "adapters_selective"], root[0])
            for dtype in ("fp32", "bf16")
        }
        reports: list = [None] * parallel.world_size()
        torch.distributed.all_gather_object(reports, results)
        if parallel.rank() == 0:
            Path(sys.argv[1]).write_text(json.dumps(reports))
        parallel.barrier()
    parallel.shutdown()
