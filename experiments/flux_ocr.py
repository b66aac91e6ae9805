"""Flow-GRPO on FLUX.1-dev for the OCR task (flow_grpo's Flow-GRPO-Fast FLUX recipe).

FLUX.1-dev is guidance-distilled: `sampling.guidance_scale` is fed to the transformer as its guidance embedding,
one forward per step, no negative prompt (the model reads none; fgrpo.models.flux). The recipe's choice is
flow_grpo's: guidance 3.5 for sampling, training and validation alike.

Presets (tyro subcommands; every field can still be overridden with a flag):
    recipe  flow_grpo has no FLUX OCR config; this takes its FLUX GenEval "fast" config (config/grpo.py,
            `geneval_flux_fast`, a rule-based reward like OCR, run with scripts/multi_node/flux_fast.sh) and
            flow_grpo's FLUX LoRA (scripts/train_flux.py): 512², 6 steps, embedded guidance 3.5, CPS noise 0.8 in
            a 3-step window within steps [0, 3), 48 prompts x 24 images per step in 2 optimizer steps, whole-batch
            advantage std clipped at 5, clip range 1e-5, no KL, LoRA r64/a128 on the joint blocks' attention and
            feed-forwards (and the single blocks' q/k/v), AdamW 3e-4 (wd 1e-4, grad clip 1), validation with 28 steps
            every 30 steps, checkpoints every 30; the OCR reward and prompts of experiments/sd35_ocr.py.
    tiny    the same file end to end on a CPU in seconds: a tiny random FLUX.1-dev (fgrpo.models.tiny: CLIP, T5,
            FluxTransformer2DModel with the guidance embedding, VAE), 64², 4 steps; it proves the wiring, a random
            model paints no text, so the reward stays flat.

How we deviate from flow_grpo's recipe: T5 encodes FLUX's own 512 tokens (flow_grpo 128; the padded length is part
of the conditioning, fgrpo.models.flux); no EMA of the adapter for validation (flow_grpo keeps one); the loop's own
deviations (experiments/qwen_image_ocr.py: all-gathered rewards, per-sample seeds and windows, exact old log-probs
with a logged gap). DanceGRPO's FLUX script (full fine-tuning at 720², 16 steps, static shift 3, lr 1e-5) is another
recipe, not this one.

1 GPU:   uv run python experiments/flux_ocr.py recipe --data.train-prompts data/ocr/train.txt
N GPUs:  uv run torchrun --nproc-per-node N experiments/flux_ocr.py recipe --data.train-prompts ...
CPU:     uv run python experiments/flux_ocr.py tiny
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
from fgrpo.models.flux import FLUX_LORA_TARGETS

FLUX_TARGETS = ",".join(FLUX_LORA_TARGETS)


@dataclass(frozen=True)
class Config(TrainConfig):
    """FLUX.1-dev OCR with Flow-GRPO (defaults = flow_grpo's Flow-GRPO-Fast FLUX recipe)."""

    exp_name: str = Path(__file__).stem
    """Run name; defaults to this file's stem, so a copied file is a new run."""
    seed: int = 42
    """Seed of the data order, the rollout noise and the LoRA init."""
    num_steps: int = 1000
    """Training steps (each: 48 x 24 images, then 2 optimizer steps)."""
    model: ModelConfig = ModelConfig(
        kind="flux",
        path="black-forest-labs/FLUX.1-dev",
        lora_rank=64,
        lora_alpha=128,
        lora_targets=FLUX_TARGETS,
        attention_backend="_native_flash",
    )
    """FLUX.1-dev from the hub or a local diffusers directory, LoRA r64/alpha128 on flow_grpo's FLUX targets; torch's
    flash attention, since the backward of the cuDNN attention torch picks by default fails on FLUX's shapes
    (an illegal memory access on an H200, benchmarks/RESULTS.md)."""
    sampling: SamplingConfig = SamplingConfig(
        height=512,
        width=512,
        num_steps=6,
        guidance_scale=3.5,
        negative_prompt=" ",
        sde_kind="cps",
        noise_level=0.8,
        window_size=3,
        window_range=(0, 3),
        micro_batch=8,
    )
    """512², 6 steps, embedded guidance 3.5 (the negative prompt is unused by FLUX), CPS noise 0.8 in a 3-step window
    within steps [0, 3)."""
    grpo: GRPOConfig = GRPOConfig(
        group_size=24,
        prompts_per_step=48,
        clip_range=1e-5,
        adv_clip_max=5.0,
        adv_std="global",
        optimizer_steps_per_step=2,
        kl_coef=0.0,
    )
    """48 prompts x 24 images, whole-batch advantage std clipped at 5, 2 updates per step, no KL."""
    optim: OptimConfig = OptimConfig(lr=3e-4, weight_decay=1e-4, betas=(0.9, 0.999), eps=1e-8, grad_clip=1.0)
    """AdamW 3e-4, weight decay 1e-4, gradient norm clipped at 1 (flow_grpo's config/base.py)."""
    data: DataConfig = DataConfig(train_prompts="data/ocr/train.txt", val_prompts="data/ocr/test.txt")
    """flow_grpo's OCR prompt files (bring train.txt; test.txt is flow_grpo's public test split)."""
    reward: RewardConfig = RewardConfig(name="ocr")
    """Offline PP-OCR (rapidocr) with flow_grpo's edit-distance score."""
    run: RunConfig = RunConfig(val_every=30, val_num_steps=28, ckpt_every=30)
    """Outputs under runs/<exp_name>; validation (28 ODE steps) and checkpoints every 30 steps."""


def tiny() -> Config:
    """Seconds on a CPU with a tiny random FLUX.1-dev: the wiring end to end, not learning."""
    return dataclasses.replace(
        Config(),
        num_steps=2,
        device="cpu",
        model=dataclasses.replace(
            Config().model,
            kind="tiny_flux",
            dtype="fp32",
            lora_rank=4,
            lora_alpha=8,
            gradient_checkpointing=False,
            attention_backend="",
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
        "recipe": ("flow_grpo's Flow-GRPO-Fast FLUX.1-dev recipe on OCR (GPUs, real weights).", Config()),
        "tiny": ("Seconds on a CPU: a tiny random FLUX.1-dev, offline OCR reward (wiring only).", tiny()),
    }
    cli(main, presets)
