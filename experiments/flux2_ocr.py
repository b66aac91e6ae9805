"""Flow-GRPO on FLUX.2 [klein] base and FLUX.2 [dev] for the OCR task (Flow-Factory's FLUX.2 GRPO LoRA recipes).

FLUX.2 [klein] base is not guidance-distilled: `sampling.guidance_scale` > 1 is true CFG against the empty prompt,
two forwards a step (fgrpo.models.flux2). The step-distilled klein checkpoints ignore the scale; train the base.
FLUX.2 [dev] is guidance-distilled: the scale goes into the transformer's guidance embedding, one forward a step,
and the negative prompt is unused.

Presets (tyro subcommands; every field can still be overridden with a flag):
    recipe  Flow-Factory's FLUX.2-klein-base GRPO LoRA config (examples/grpo/lora/flux2_klein_base/default.yaml):
            384², 8 steps, CFG 4, Flow-SDE noise 0.7 in a 1-step window within steps [1, 4), 48 prompts x 16 images
            per step in 2 optimizer steps, per-group advantage std clipped at 5, clip range 1e-4, no KL, LoRA
            r64/a128 (fgrpo.models.flux2's targets), AdamW 3e-4 (wd 1e-4, grad clip 1), validation with 28 steps and
            checkpoints every 20 steps; the OCR reward and prompts of experiments/sd35_ocr.py.
    tiny    the same file end to end on a CPU in seconds: a tiny random FLUX.2 [klein] (fgrpo.models.tiny: Qwen3,
            Flux2Transformer2DModel, AutoencoderKLFlux2), 64², 4 steps; it proves the wiring, a random model paints
            no text, so the reward stays flat.
    dev     Flow-Factory's FLUX.2-dev GRPO LoRA config (examples/grpo/lora/flux2/t2i.yaml): klein's recipe with
            512², embedded guidance 4 and Flow-SDE noise 1.0, micro-batch 4 (a 32B transformer).
    dev-tiny  `dev` on a CPU in seconds: a tiny random FLUX.2 [dev] (Mistral-3 and its processor, the transformer
            with a guidance embedding), 64², 4 steps; wiring only.

How we deviate from Flow-Factory's recipe: the 4B base (it names 4B and 9B; the 9B is a flag away, --model.path);
validation at the training resolution (it validates at 1024²); no EMA of the adapter; its reward is PickScore (dev:
CLIP + 0.5 PickScore), ours OCR; the loop's own deviations (experiments/qwen_image_ocr.py).

1 GPU:   uv run python experiments/flux2_ocr.py recipe --data.train-prompts data/ocr/train.txt
N GPUs:  uv run torchrun --nproc-per-node N experiments/flux2_ocr.py recipe --data.train-prompts ...
CPU:     uv run python experiments/flux2_ocr.py tiny       (or dev-tiny)
[dev]:   uv run torchrun --nproc-per-node N experiments/flux2_ocr.py dev --data.train-prompts ...
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
from fgrpo.models.flux2 import FLUX2_LORA_TARGETS

FLUX2_TARGETS = ",".join(FLUX2_LORA_TARGETS)


@dataclass(frozen=True)
class Config(TrainConfig):
    """FLUX.2 [klein] base OCR with Flow-GRPO (defaults = Flow-Factory's FLUX.2-klein-base GRPO LoRA recipe)."""

    exp_name: str = Path(__file__).stem
    """Run name; defaults to this file's stem, so a copied file is a new run."""
    seed: int = 42
    """Seed of the data order, the rollout noise and the LoRA init."""
    num_steps: int = 1000
    """Training steps (each: 48 x 16 images, then 2 optimizer steps)."""
    model: ModelConfig = ModelConfig(
        kind="flux2",
        path="black-forest-labs/FLUX.2-klein-base-4B",
        lora_rank=64,
        lora_alpha=128,
        lora_targets=FLUX2_TARGETS,
    )
    """FLUX.2 [klein] base 4B from the hub or a local diffusers directory, LoRA r64/alpha128 (`dev`: FLUX.2 [dev],
    kind flux2_dev, the same LoRA)."""
    sampling: SamplingConfig = SamplingConfig(
        height=384,
        width=384,
        num_steps=8,
        guidance_scale=4.0,
        negative_prompt="",
        sde_kind="flow_sde",
        noise_level=0.7,
        window_size=1,
        window_range=(1, 4),
        micro_batch=8,
    )
    """384², 8 steps, true CFG 4 against the empty prompt (Flux2KleinPipeline's), Flow-SDE noise 0.7 in a 1-step
    window within steps [1, 4) (`dev`: 512², embedded guidance 4, noise 1.0, micro-batch 4)."""
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
    run: RunConfig = RunConfig(val_every=20, val_num_steps=28, ckpt_every=20)
    """Outputs under runs/<exp_name>; validation (28 ODE steps) and checkpoints every 20 steps."""


def tiny() -> Config:
    """Seconds on a CPU with a tiny random FLUX.2 [klein]: the wiring end to end, not learning."""
    return dataclasses.replace(
        Config(),
        num_steps=2,
        device="cpu",
        model=dataclasses.replace(
            Config().model,
            kind="tiny_flux2",
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


def dev() -> Config:
    """FLUX.2 [dev] with Flow-Factory's FLUX.2-dev GRPO LoRA config (examples/grpo/lora/flux2/t2i.yaml). Its batch,
    advantages, clipping, optimizer and schedule of validation and checkpoints are klein's recipe; it differs in the
    model, the resolution, the guidance and the noise level."""
    return dataclasses.replace(
        Config(),
        model=dataclasses.replace(Config().model, kind="flux2_dev", path="black-forest-labs/FLUX.2-dev"),
        sampling=dataclasses.replace(
            Config().sampling,
            height=512,  # Flow-Factory's resolution: 512
            width=512,
            guidance_scale=4.0,  # its guidance_scale 4, here the embedded guidance (Flux2Pipeline's default 4)
            noise_level=1.0,  # its Flow-SDE noise_level 1.0 (klein's recipe: 0.7)
            micro_batch=4,  # a 32B transformer at 1024 image tokens: half of klein's 8 per forward
        ),
    )


def dev_tiny() -> Config:
    """Seconds on a CPU with a tiny random FLUX.2 [dev]: `dev`'s sampling (embedded guidance 4, noise 1.0) at the
    tiny preset's size, the wiring end to end, not learning."""
    t = tiny()
    return dataclasses.replace(
        t,
        model=dataclasses.replace(t.model, kind="tiny_flux2_dev"),
        sampling=dataclasses.replace(t.sampling, noise_level=dev().sampling.noise_level),
    )


def main(cfg: Config) -> dict[str, float]:
    from fgrpo.train import train

    return train(cfg, experiment_source=Path(__file__))


if __name__ == "__main__":
    presets = {
        "recipe": (
            "Flow-Factory's FLUX.2-klein-base GRPO LoRA recipe on OCR (GPUs, real weights).",
            Config(),
        ),
        "tiny": ("Seconds on a CPU: a tiny random FLUX.2 [klein], offline OCR reward (wiring only).", tiny()),
        "dev": ("Flow-Factory's FLUX.2-dev GRPO LoRA recipe on OCR (GPUs, real weights).", dev()),
        "dev-tiny": (
            "Seconds on a CPU: a tiny random FLUX.2 [dev], offline OCR reward (wiring only).",
            dev_tiny(),
        ),
    }
    cli(main, presets)
