"""A tiny Flow-GRPO run for the end-to-end tests (tiny random Qwen-Image, JPEG reward, CPU).

python tests/train_entry.py --run.out-dir DIR [tyro flags]
torchrun --nproc-per-node 2 tests/train_entry.py ...
"""

from dataclasses import dataclass

import tyro

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


@dataclass(frozen=True)
class Config(TrainConfig):
    exp_name: str = "e2e"
    """Run name."""
    num_steps: int = 3
    """Training steps."""
    device: str = "cpu"
    """CPU only."""
    model: ModelConfig = ModelConfig(
        kind="tiny_qwen_image", dtype="fp32", lora_rank=4, lora_alpha=8, gradient_checkpointing=False
    )
    """Tiny random Qwen-Image with LoRA r4."""
    sampling: SamplingConfig = SamplingConfig(
        height=32,
        width=32,
        num_steps=4,
        guidance_scale=3.0,
        negative_prompt=" ",
        noise_level=0.9,
        window_size=2,
        window_range=(0, 3),
        micro_batch=4,
    )
    """32², 4 steps, true-CFG 3, flow_sde in a 2-step window."""
    grpo: GRPOConfig = GRPOConfig(
        group_size=4, prompts_per_step=2, optimizer_steps_per_step=2, clip_range=0.2, adv_std="group"
    )
    """2 prompts x 4 samples, 2 updates per step."""
    optim: OptimConfig = OptimConfig(lr=3e-2)
    """A large LR so three steps move the LoRA visibly."""
    data: DataConfig = DataConfig(
        train_prompts="textbed:train", val_prompts="textbed:heldout", val_num_prompts=4
    )
    """The bundled words as prompts."""
    reward: RewardConfig = RewardConfig(name="jpeg_compressibility")
    """Cheap and image-dependent."""
    run: RunConfig = RunConfig(
        out_dir="runs", wandb="disabled", val_every=0, ckpt_every=1, keep_last=5, log_images_every=0
    )
    """Checkpoint every step; no validation."""


if __name__ == "__main__":
    from fgrpo.errors import one_line_errors
    from fgrpo.train import train

    with one_line_errors():
        train(tyro.cli(Config))
