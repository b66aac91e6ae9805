"""Flow-GRPO on Wan 2.2 text to video for a video-text task: a clip that shows the prompt's quoted word, steadily.
fgrpo.models.wan holds both Wan 2.2 variants and this file trains either: the TI2V-5B (one transformer, the Wan 2.2
VAE) and the T2V-A14B (two experts, the Wan 2.1 VAE). The A14B's experts split the steps by timestep (`transformer`
at t >= 875, `transformer_2` below, each with its CFG scale); the loop adds LoRA to both, shards each with FSDP2 as
its own units, optimizes both adapters (each gets the gradient of the window steps of its stage), checkpoints both
and exports `lora/transformer/` and `lora/transformer_2/` (fgrpo.models.wan.export_expert_loras says how WanPipeline
loads them). docs/models.md has the A14B's memory plan.

Reward: `video_ocr` (fgrpo.rewards.video): PP-OCR of the quoted word in 4 evenly spaced frames plus half a
temporal-consistency term, offline.

Presets (tyro subcommands; every field can still be overridden with a flag):
    recipe     Flow-Factory's Wan 2.2 text-to-video GRPO LoRA config (examples/grpo/lora/wan22_t2v.yaml) on
               Wan-AI/Wan2.2-TI2V-5B-Diffusers: 256x256, 41 frames, 10 steps, CFG 5, Flow-SDE noise 0.9 on one step
               drawn from steps 1-3, 48 prompts x 16 clips per step in 2 optimizer steps, per-group advantage std
               clipped at 5, clip range 1e-4, LoRA r64/a128 on attention and FFN, AdamW 1e-4 (wd 1e-4, grad clip 1),
               gradient checkpointing, validation with 28 ODE steps every 20 steps.
    a14b       the same config's own values on the model it names, Wan-AI/Wan2.2-T2V-A14B-Diffusers: 480x480, 5 frames,
               10 steps, CFG 4 on the high-noise expert and 3 on the low-noise one, LoRA r64/a128 on both experts; the
               rest as `recipe`.
    tiny       the same file end to end on a CPU in seconds: a tiny random Wan 2.2 5B-like model (fgrpo.models.tiny),
               a 5-frame 64x64 clip, 4 steps, no CFG; it proves the wiring, a random model paints no text.
    a14b-tiny  `tiny` with a tiny random A14B-like model (two experts, 32x32): both experts' LoRA trains.

How we deviate from Flow-Factory's config: `recipe` trains the 5B instead of the A14B it names; the reward is video
OCR on OCR prompts (Flow-Factory: PickScore on frames of PickScore prompts); no EMA of the policy; gradient
checkpointing on (Flow-Factory: off); validation at the training size (Flow-Factory: 720 px, 21 frames); the loop's
own deviations (experiments/qwen_image_ocr.py).

1 GPU:   uv run python experiments/wan_video_ocr.py recipe --data.train-prompts data/ocr/train.txt
N GPUs:  uv run torchrun --nproc-per-node N experiments/wan_video_ocr.py a14b --data.train-prompts ...
CPU:     uv run python experiments/wan_video_ocr.py tiny      (or a14b-tiny)
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
from fgrpo.models.wan import WAN_LORA_TARGETS, WanConfig

SIZE = 256  # Flow-Factory's train.resolution
A14B_SIZE = 480  # the same config's resolution for the A14B it names
TINY = 64  # the tiny 5B-like model's clip side (its VAE compresses 16x, the transformer patchifies 2x2)
TINY_A14B = 32  # the tiny A14B-like model's (8x, 2x2)


@dataclass(frozen=True)
class Config(TrainConfig):
    """Wan 2.2 TI2V-5B video OCR with Flow-GRPO (defaults = Flow-Factory's Wan 2.2 text-to-video LoRA config)."""

    exp_name: str = Path(__file__).stem
    """Run name; defaults to this file's stem, so a copied file is a new run."""
    seed: int = 42
    """Seed of the data order, the rollout noise and the LoRA init."""
    num_steps: int = 100
    """Training steps (each: 48 x 16 clips, then 2 optimizer steps)."""
    model: WanConfig = WanConfig(
        kind="wan",
        path="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        num_frames=41,
        lora_rank=64,
        lora_alpha=128,
        lora_targets=",".join(WAN_LORA_TARGETS),
        attention_backend="native",
    )
    """Wan 2.2 TI2V-5B in diffusers' layout; 41-frame clips; LoRA r64/alpha128 on self/cross attention and FFN (of
    each expert, for the A14B)."""
    sampling: SamplingConfig = SamplingConfig(
        height=SIZE,
        width=SIZE,
        num_steps=10,
        guidance_scale=5.0,
        negative_prompt=" ",
        sde_kind="flow_sde",
        noise_level=0.9,
        window_size=1,
        window_range=(1, 4),
        micro_batch=8,
    )
    """256x256, 10 steps, CFG 5, Flow-SDE noise 0.9 on one step drawn from steps 1-3."""
    grpo: GRPOConfig = GRPOConfig(
        group_size=16,
        prompts_per_step=48,
        clip_range=1e-4,
        adv_clip_max=5.0,
        adv_std="group",
        optimizer_steps_per_step=2,
        kl_coef=0.0,
    )
    """48 prompts x 16 clips, per-group advantage std clipped at 5, 2 updates per step, no KL."""
    optim: OptimConfig = OptimConfig(lr=1e-4, weight_decay=1e-4, betas=(0.9, 0.999), eps=1e-8, grad_clip=1.0)
    """AdamW 1e-4, weight decay 1e-4, gradient norm clipped at 1."""
    data: DataConfig = DataConfig(train_prompts="data/ocr/train.txt", val_prompts="data/ocr/test.txt")
    """flow_grpo's OCR prompt files (each quotes the word the clip must show)."""
    reward: RewardConfig = RewardConfig(name="video_ocr")
    """Offline PP-OCR of the quoted word in 4 frames plus a temporal-consistency term (fgrpo.rewards.video)."""
    run: RunConfig = RunConfig(val_every=20, val_num_steps=28, ckpt_every=20)
    """Outputs under runs/<exp_name>; validation every 20 steps (28 ODE steps), checkpoints every 20."""


def tiny() -> Config:
    """Seconds on a CPU with a tiny random Wan 2.2 (5B-like): the wiring end to end, not learning."""
    return dataclasses.replace(
        Config(),
        num_steps=2,
        device="cpu",
        model=dataclasses.replace(
            Config().model,
            kind="tiny_wan",
            dtype="fp32",
            num_frames=5,
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


def a14b() -> Config:
    """Flow-Factory's Wan 2.2 text-to-video LoRA config on the model it names, the T2V-A14B (both experts)."""
    c = Config()
    return dataclasses.replace(
        c,
        model=dataclasses.replace(
            c.model, path="Wan-AI/Wan2.2-T2V-A14B-Diffusers", experts=2, num_frames=5, guidance_scale_2=3.0
        ),
        sampling=dataclasses.replace(c.sampling, height=A14B_SIZE, width=A14B_SIZE, guidance_scale=4.0),
    )


def a14b_tiny() -> Config:
    """`tiny` with a tiny random A14B-like Wan (two experts): the wiring of both experts' training, not learning."""
    t = tiny()
    return dataclasses.replace(
        t,
        model=dataclasses.replace(t.model, experts=2),
        sampling=dataclasses.replace(t.sampling, height=TINY_A14B, width=TINY_A14B),
    )


def main(cfg: Config) -> dict[str, float]:
    from fgrpo.train import train

    return train(cfg, experiment_source=Path(__file__))


if __name__ == "__main__":
    presets = {
        "recipe": (
            "Flow-Factory's Wan 2.2 text-to-video LoRA config on the TI2V-5B (GPUs, real weights).",
            Config(),
        ),
        "a14b": (
            "Flow-Factory's Wan 2.2 text-to-video LoRA config on the T2V-A14B, both experts (GPUs, real weights).",
            a14b(),
        ),
        "tiny": ("Seconds on a CPU: a tiny random Wan 2.2, offline video OCR reward (wiring only).", tiny()),
        "a14b-tiny": ("Seconds on a CPU: a tiny random two-expert Wan 2.2 A14B (wiring only).", a14b_tiny()),
    }
    cli(main, presets)
