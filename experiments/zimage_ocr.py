"""Flow-GRPO on Z-Image (the base model, Tongyi-MAI/Z-Image) for the OCR task (Flow-Factory's Z-Image LoRA recipe).

The recipe means the base Z-Image, which samples with true CFG (two forwards a step). fgrpo's guidance_scale is the
usual neg + s (pos - neg); ZImagePipeline's and Flow-Factory's scale g is pos + g (pos - neg), so s = g + 1: their
4.0 is our 5.0 (fgrpo.models.zimage). Z-Image-Turbo (distilled, the pipeline's g = 0) is `--model.path
Tongyi-MAI/Z-Image-Turbo --sampling.guidance-scale 1`, one forward a step; this file's recipe is not tuned for it.

Presets (tyro subcommands; every field can still be overridden with a flag):
    recipe  Flow-Factory has no Z-Image OCR config; this takes its Z-Image GRPO LoRA config
            (X-GenGroup/Flow-Factory, examples/grpo/lora/z_image/default.yaml, a PickScore run) with its default
            LoRA targets (src/flow_factory/models/z_image.py): 512², 10 steps, CFG 4.0 theirs (5.0 here), Flow-SDE
            noise 0.7 on one step drawn from steps 1-3, 48 prompts x 16 images per step in 2 optimizer steps,
            per-group advantage std clipped at 5, clip range 1e-4, no KL, LoRA r64/a128 on every block's attention
            q/k/v/out and feed-forward, AdamW 3e-4 (wd 1e-4, grad clip 1), validation with 40 steps every 40 steps,
            checkpoints every 40; the OCR reward and prompts of experiments/sd35_ocr.py.
    tiny    the same file end to end on a CPU in seconds: a tiny random Z-Image (fgrpo.models.tiny: Qwen3, the
            ZImageTransformer2DModel, VAE), 64², 4 steps; it proves the wiring, a random model paints no text, so
            the reward stays flat.

How we deviate from Flow-Factory's recipe: validation at the training resolution (theirs 1024²); no EMA of the
adapter (theirs decays 0.9 every 4 steps); the transformer in bf16 with fp32 LoRA (theirs keeps the transformer in
fp32); a plain GRPO advantage (theirs aggregates rewards GDPO-style, the same for one reward); the loop's own
deviations (experiments/qwen_image_ocr.py).

1 GPU:   uv run python experiments/zimage_ocr.py recipe --data.train-prompts data/ocr/train.txt
N GPUs:  uv run torchrun --nproc-per-node N experiments/zimage_ocr.py recipe --data.train-prompts ...
CPU:     uv run python experiments/zimage_ocr.py tiny
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from fgrpo.config import (
    DataConfig,
    GRPOConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RunConfig,
    SamplingConfig,
    TrainConfig,
)
from fgrpo.errors import cli
from fgrpo.models.zimage import ZIMAGE_LORA_TARGETS

ZIMAGE_TARGETS = ",".join(ZIMAGE_LORA_TARGETS)


@dataclass(frozen=True)
class Config(TrainConfig):
    """Z-Image OCR with Flow-GRPO (defaults = Flow-Factory's Z-Image LoRA recipe)."""

    exp_name: str = Path(__file__).stem
    """Run name; defaults to this file's stem, so a copied file is a new run."""
    seed: int = 42
    """Seed of the data order, the rollout noise and the LoRA init."""
    num_steps: int = 1000
    """Training steps (each: 48 x 16 images, then 2 optimizer steps)."""
    model: ModelConfig = ModelConfig(
        kind="zimage",
        path="Tongyi-MAI/Z-Image",
        lora_rank=64,
        lora_alpha=128,
        lora_targets=ZIMAGE_TARGETS,
    )
    """Z-Image (base) from the hub or a local diffusers directory, LoRA r64/alpha128 on Flow-Factory's targets."""
    sampling: SamplingConfig = SamplingConfig(
        height=512,
        width=512,
        num_steps=10,
        guidance_scale=5.0,
        negative_prompt="",
        sde_kind="flow_sde",
        noise_level=0.7,
        window_size=1,
        window_range=(1, 4),
        micro_batch=8,
    )
    """512², 10 steps, true CFG 5.0 (the pipeline's 4.0) against the empty prompt (the pipeline's default negative),
    Flow-SDE noise 0.7 on one step of [1, 4)."""
    grpo: GRPOConfig = GRPOConfig(
        group_size=16,
        prompts_per_step=48,
        clip_range=1e-4,
        adv_clip_max=5.0,
        adv_std="group",
        optimizer_steps_per_step=2,
        kl_coef=0.0,
    )
    """48 prompts x 16 images, per-group advantage std clipped at 5, 2 updates per step, no KL."""
    optim: OptimConfig = OptimConfig(lr=3e-4, weight_decay=1e-4, betas=(0.9, 0.999), eps=1e-8, grad_clip=1.0)
    """AdamW 3e-4, weight decay 1e-4, gradient norm clipped at 1."""
    data: DataConfig = DataConfig(train_prompts="data/ocr/train.txt", val_prompts="data/ocr/test.txt")
    """flow_grpo's OCR prompt files (bring train.txt; test.txt is flow_grpo's public test split)."""
    reward: RewardConfig = RewardConfig(name="ocr")
    """Offline PP-OCR (rapidocr) with flow_grpo's edit-distance score."""
    run: RunConfig = RunConfig(val_every=40, val_num_steps=40, ckpt_every=40)
    """Outputs under runs/<exp_name>; validation (40 ODE steps) and checkpoints every 40 steps."""


def tiny() -> Config:
    """Seconds on a CPU with a tiny random Z-Image: the wiring end to end, not learning."""
    return dataclasses.replace(
        Config(),
        num_steps=2,
        device="cpu",
        model=dataclasses.replace(
            Config().model,
            kind="tiny_zimage",
            dtype="fp32",
            lora_rank=4,
            lora_alpha=8,
            gradient_checkpointing=False,
        ),
        sampling=dataclasses.replace(
            Config().sampling,
            height=64,
            width=64,
            num_steps=4,
            window_size=2,
            window_range=(0, 3),
            micro_batch=4,
        ),
        grpo=GRPOConfig(group_size=4, prompts_per_step=2, clip_range=1e-4, optimizer_steps_per_step=2),
        data=DataConfig(train_prompts="textbed:train", val_prompts="textbed:heldout", val_num_prompts=4),
        run=RunConfig(wandb="disabled", val_every=2, val_num_steps=4, ckpt_every=2, log_images_every=1),
    )


def main(cfg: Config) -> dict[str, float]:
    from fgrpo.train import train

    return train(cfg, experiment_source=Path(__file__))


if __name__ == "__main__":
    presets = {
        "recipe": ("Flow-Factory's Z-Image (base) LoRA recipe on OCR (GPUs, real weights).", Config()),
        "tiny": ("Seconds on a CPU: a tiny random Z-Image, offline OCR reward (wiring only).", tiny()),
    }
    cli(main, presets)
