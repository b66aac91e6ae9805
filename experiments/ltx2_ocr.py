"""Flow-GRPO on LTX-2.3 (text to audio + video) for a video-text task: a clip that shows the prompt's quoted word,
steadily. The video and audio latents are one joint state (fgrpo.models.ltx2): the SDE window, the CPS noise and
the log-prob act on both, so audio is trained with video even though this reward reads only the frames.

Reward: `video_ocr` (fgrpo.rewards.video): PP-OCR of the quoted word in 4 evenly spaced frames plus half a
temporal-consistency term, offline. The audio-reward slot (CLAP / ImageBind in verl-omni) is
fgrpo.rewards.video.AudioReward; the loop scores decode()'s frames only, so an audio reward is not wired here.

Presets (tyro subcommands; every field can still be overridden with a flag):
    recipe  verl-omni's LTX-2.3 text-to-audio-video Flow-GRPO LoRA recipe (examples/flowgrpo_trainer/ltx2/
            run_ltx2_3_t2av_lora.sh): dg845/LTX-2.3-Diffusers, 256x384, 81 frames at 24 fps, 24 steps, CFG 4 on
            video and audio, CPS noise 0.8 in a 3-step window within steps [0, 10), 32 prompts x 8 clips per
            step in 2 optimizer steps, whole-batch advantage std clipped at 5, clip range 1e-4, no KL, LoRA r64/a128
            on the video, audio and cross-modal attention and both MLPs, AdamW 3e-4 (wd 1e-4, grad clip 1),
            gradient checkpointing, validation with 50 ODE steps every 20 steps, checkpoints every 50.
    tiny    the same file end to end on a CPU in seconds: a tiny random LTX-2.3 (fgrpo.models.tiny), a 9-frame
            32x32 clip, 4 steps, no CFG; it proves the wiring, a random model paints no text.

How we deviate from verl-omni's recipe: the reward is video OCR on OCR prompts (verl-omni: CLAP + ImageBind on
VidProM prompts, neither available offline); each sample's 3 trained steps are consecutive (verl-omni draws
them non-contiguously, sde_contiguous=False); the loop's own deviations (experiments/qwen_image_ocr.py).

1 GPU:   uv run python experiments/ltx2_ocr.py recipe --data.train-prompts data/ocr/train.txt
N GPUs:  uv run torchrun --nproc-per-node N experiments/ltx2_ocr.py recipe --data.train-prompts ...
CPU:     uv run python experiments/ltx2_ocr.py tiny
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from fgrpo.config import (
    DataConfig,
    GRPOConfig,
    OptimConfig,
    RewardConfig,
    RunConfig,
    SamplingConfig,
    TrainConfig,
)
from fgrpo.errors import cli
from fgrpo.models.ltx2 import LTX2_LORA_TARGETS, LTX2Config

HEIGHT, WIDTH = 256, 384  # verl-omni's pipeline.height / width
TINY = 32  # the tiny model's clip side (its VAE compresses 8x; LTX2Pipeline wants multiples of 32)


@dataclass(frozen=True)
class Config(TrainConfig):
    """LTX-2.3 video OCR with Flow-GRPO (defaults = verl-omni's LTX-2.3 text-to-audio-video recipe)."""

    exp_name: str = Path(__file__).stem
    """Run name; defaults to this file's stem, so a copied file is a new run."""
    seed: int = 42
    """Seed of the data order, the rollout noise and the LoRA init."""
    num_steps: int = 100
    """Training steps (each: 32 x 8 clips, then 2 optimizer steps)."""
    model: LTX2Config = LTX2Config(
        kind="ltx2",
        path="dg845/LTX-2.3-Diffusers",
        num_frames=81,
        frame_rate=24.0,
        height=HEIGHT,
        width=WIDTH,
        lora_rank=64,
        lora_alpha=128,
        lora_targets=",".join(LTX2_LORA_TARGETS),
        attention_backend="native",
    )
    """LTX-2.3 in diffusers' layout; 81-frame 256x384 clips at 24 fps; LoRA r64/alpha128 on every attention and MLP."""
    sampling: SamplingConfig = SamplingConfig(
        height=HEIGHT,
        width=WIDTH,
        num_steps=24,
        guidance_scale=4.0,
        negative_prompt=" ",
        sde_kind="cps",
        noise_level=0.8,
        window_size=3,
        window_range=(0, 10),
        micro_batch=8,
    )
    """256x384, 24 steps, CFG 4 on both streams, CPS noise 0.8 in a 3-step window within steps [0, 10)."""
    grpo: GRPOConfig = GRPOConfig(
        group_size=8,
        prompts_per_step=32,
        clip_range=1e-4,
        adv_clip_max=5.0,
        adv_std="global",
        optimizer_steps_per_step=2,
        kl_coef=0.0,
    )
    """32 prompts x 8 clips, whole-batch advantage std clipped at 5, 2 updates per step (mini-batch 16), no KL."""
    optim: OptimConfig = OptimConfig(lr=3e-4, weight_decay=1e-4, betas=(0.9, 0.999), eps=1e-8, grad_clip=1.0)
    """AdamW 3e-4, weight decay 1e-4, gradient norm clipped at 1."""
    data: DataConfig = DataConfig(train_prompts="data/ocr/train.txt", val_prompts="data/ocr/test.txt")
    """flow_grpo's OCR prompt files (each quotes the word the clip must show)."""
    reward: RewardConfig = RewardConfig(name="video_ocr")
    """Offline PP-OCR of the quoted word in 4 frames plus a temporal-consistency term (fgrpo.rewards.video)."""
    run: RunConfig = RunConfig(val_every=20, val_num_steps=50, ckpt_every=50)
    """Outputs under runs/<exp_name>; validation every 20 steps (50 ODE steps), checkpoints every 50."""


def tiny() -> Config:
    """Seconds on a CPU with a tiny random LTX-2.3: the wiring end to end, not learning."""
    return dataclasses.replace(
        Config(),
        num_steps=2,
        device="cpu",
        model=dataclasses.replace(
            Config().model,
            kind="tiny_ltx2",
            dtype="fp32",
            num_frames=9,
            height=TINY,
            width=TINY,
            lora_rank=4,
            lora_alpha=8,
            gradient_checkpointing=False,
            attention_backend="",
        ),
        sampling=dataclasses.replace(
            Config().sampling,
            height=TINY,
            width=TINY,
            num_steps=4,
            guidance_scale=1.0,
            window_size=2,
            window_range=(0, 3),
            micro_batch=4,
        ),
        grpo=GRPOConfig(group_size=4, prompts_per_step=1, clip_range=1e-4, optimizer_steps_per_step=1),
        data=DataConfig(train_prompts="textbed:train", val_prompts="textbed:heldout", val_num_prompts=2),
        reward=RewardConfig(name='{"name": "video_ocr", "frames": 2}'),
        run=RunConfig(wandb="disabled", val_every=2, val_num_steps=4, ckpt_every=2, log_images_every=1),
    )


def main(cfg: Config) -> dict[str, float]:
    from fgrpo.train import train

    return train(cfg, experiment_source=Path(__file__))


if __name__ == "__main__":
    presets = {
        "recipe": ("verl-omni's LTX-2.3 text-to-audio-video recipe (GPUs, real weights).", Config()),
        "tiny": ("Seconds on a CPU: a tiny random LTX-2.3, offline video OCR reward (wiring only).", tiny()),
    }
    cli(main, presets)
