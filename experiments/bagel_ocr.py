"""Flow-GRPO on BAGEL (ByteDance-Seed/BAGEL-7B-MoT, text to image) for the OCR task, LoRA on the generation experts.

BAGEL is a unified model: one Qwen2 Mixture-of-Transformer-Experts decoder whose understanding experts read the
prompt and whose generation experts denoise FLUX-VAE latents (fgrpo.models.bagel). Only the generation experts are
adapted; the prompt's keys and values are computed once per prompt with the frozen understanding experts.

Presets (tyro subcommands; every field can still be overridden with a flag):
    recipe  verl-omni trains BAGEL with Flow-GRPO LoRA on the generation experts; its flow-GRPO example settings
            (verl examples/flowgrpo_trainer/run_flowgrpo.sh, the Qwen-Image OCR run) are taken for the training
            side: LoRA r64/a128, AdamW 3e-4 with weight decay 1e-4, no KL, flow_grpo's OCR prompts; the sampling side
            is BAGEL's own text-to-image inference (its notebook's settings): timestep shift 3, text guidance 4
            with the global renorm (min 0) inside sigma in (0.4, 1], against the empty context, image guidance 1. 512², 10 training steps,
            Flow-SDE noise 0.7 on a window of 2 steps within the first 4 (flow_grpo's fast-training schedule).
    tiny    the same file end to end on a CPU in seconds: a tiny random BAGEL (fgrpo.models.tiny), 64², 4 steps; it
            proves the wiring, a random model paints no text, so the reward stays flat.

How we deviate: BAGEL samples 50 grid points (49 steps) at 1024²; training rolls out 10 steps at 512² as flow_grpo
does for its other models. Image guidance (an input image) and BAGEL's "thinking" prefix are not used.
model.path is a local BAGEL-7B-MoT directory with FLUX.1's VAE in diffusers' format in its vae/ folder
(fgrpo.models.bagel.Bagel.from_pretrained).

1 GPU:   uv run python experiments/bagel_ocr.py recipe --model.path /path/to/BAGEL-7B-MoT --data.train-prompts ...
N GPUs:  uv run torchrun --nproc-per-node N experiments/bagel_ocr.py recipe --model.path ... --data.train-prompts ...
CPU:     uv run python experiments/bagel_ocr.py tiny
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
from fgrpo.models.bagel import BAGEL_LORA_TARGETS

BAGEL_TARGETS = ",".join(BAGEL_LORA_TARGETS)


@dataclass(frozen=True)
class Config(TrainConfig):
    """BAGEL OCR with Flow-GRPO (defaults = verl-omni's flow-GRPO settings, BAGEL's sampling)."""

    exp_name: str = Path(__file__).stem
    """Run name; defaults to this file's stem, so a copied file is a new run."""
    seed: int = 42
    """Seed of the data order, the rollout noise and the LoRA init."""
    num_steps: int = 1000
    """Training steps."""
    model: ModelConfig = ModelConfig(
        kind="bagel",
        path="BAGEL-7B-MoT",
        lora_rank=64,
        lora_alpha=128,
        lora_targets=BAGEL_TARGETS,
    )
    """A local BAGEL-7B-MoT directory; LoRA r64/alpha128 on the generation experts' attention and MLP."""
    sampling: SamplingConfig = SamplingConfig(
        height=512,
        width=512,
        num_steps=10,
        guidance_scale=4.0,
        negative_prompt="",
        sde_kind="flow_sde",
        noise_level=0.7,
        window_size=2,
        window_range=(0, 4),
        micro_batch=8,
    )
    """512², 10 steps, BAGEL's text guidance 4 against the empty context, Flow-SDE noise 0.7 on 2 of the first 4."""
    grpo: GRPOConfig = GRPOConfig(group_size=16, prompts_per_step=32, clip_range=1e-4, kl_coef=0.0)
    """32 prompts x 16 images a step, no KL."""
    optim: OptimConfig = OptimConfig(lr=3e-4, weight_decay=1e-4, grad_clip=1.0)
    """AdamW 3e-4, weight decay 1e-4, gradient norm clipped at 1."""
    data: DataConfig = DataConfig(train_prompts="data/ocr/train.txt", val_prompts="data/ocr/test.txt")
    """flow_grpo's OCR prompt files (bring train.txt; test.txt is flow_grpo's public test split)."""
    reward: RewardConfig = RewardConfig(name="ocr")
    """Offline PP-OCR (rapidocr) with flow_grpo's edit-distance score."""
    run: RunConfig = RunConfig(val_every=40, val_num_steps=40, ckpt_every=40)
    """Outputs under runs/<exp_name>; validation (40 ODE steps) and checkpoints every 40 steps."""


def tiny() -> Config:
    """Seconds on a CPU with a tiny random BAGEL: the wiring end to end, not learning."""
    return dataclasses.replace(
        Config(),
        num_steps=2,
        device="cpu",
        model=dataclasses.replace(
            Config().model,
            kind="tiny_bagel",
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
        "recipe": ("verl-omni's flow-GRPO settings on BAGEL's sampling, OCR (GPUs, real weights).", Config()),
        "tiny": ("Seconds on a CPU: a tiny random BAGEL, offline OCR reward (wiring only).", tiny()),
    }
    cli(main, presets)
