"""Flow-GRPO on Qwen-Image-Edit for a text-edit task: given an image that shows one word, render another word
in its place and style; the OCR reward reads the new word.

Data: each row pairs two words of the bundled word lists (train / held-out) and a condition image that shows the
first word, in a colour, size and place drawn from the row itself (so every image and row is deterministic):
    {"prompt": "Write \\"DOG\\" in place of the text \\"CAT\\", in the same position and style", "image": "..."}
The OCR reward scores the first quoted text (fgrpo.rewards.ocr.extract_target), the word to write; it does not
score position, style or the rest of the image. `main` renders the rows before training (--no-make-data trains
on existing rows: any .jsonl of {"prompt", "image"} whose prompt quotes its target first).

Presets (tyro subcommands; every field can still be overridden with a flag):
    recipe  verl-omni's Qwen-Image-Edit Flow-GRPO LoRA recipe (examples/flowgrpo_trainer/qwen_image_edit/
            run_qwen_image_edit_lora.sh): 512², 12 steps, true-CFG 4 with negative prompt " ", flow_sde noise
            0.7 in a 3-step window within steps [0, 6), 32 prompts x 16 images per step in 2 optimizer steps,
            per-group advantage std, clip range 1e-4, LoRA r64/a128 on the attention + MLP projections, AdamW
            3e-4 (wd 1e-4), validation with 40 ODE steps every 20 steps.
    tiny    the same file end to end on a CPU in seconds: a tiny random Qwen-Image-Edit (fgrpo.models.tiny), 64²,
            no CFG, 8 rows a split; it proves the wiring, a random model paints no text.

How we deviate from verl-omni's recipe: the model is Qwen/Qwen-Image-Edit through diffusers' QwenImageEditPipeline
layout (verl-omni trains Qwen-Image-Edit-2511 through the EditPlus pipeline: "Picture 1:" prompts, a 384² VL
image), the reward is OCR instead of PickScore, and the loop's own deviations (experiments/qwen_image_ocr.py).

1 GPU:   uv run python experiments/qwen_image_edit_ocr.py recipe
N GPUs:  uv run torchrun --nproc-per-node N experiments/qwen_image_edit_ocr.py recipe
CPU:     uv run python experiments/qwen_image_edit_ocr.py tiny
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
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


@dataclass(frozen=True)
class Config(TrainConfig):
    """Qwen-Image-Edit text editing with Flow-GRPO (defaults = verl-omni's Qwen-Image-Edit LoRA recipe)."""

    exp_name: str = Path(__file__).stem
    """Run name; defaults to this file's stem, so a copied file is a new run."""
    seed: int = 42
    """Seed of the data order, the rollout noise and the LoRA init."""
    num_steps: int = 300
    """Training steps (each: 32 x 16 images, then 2 optimizer steps); verl-omni's total_training_steps."""
    model: ModelConfig = ModelConfig(
        kind="qwen_image_edit", path="Qwen/Qwen-Image-Edit", lora_rank=64, lora_alpha=128
    )
    """Qwen-Image-Edit from the hub or a local diffusers directory, LoRA r64/alpha128."""
    sampling: SamplingConfig = SamplingConfig(
        height=512,
        width=512,
        num_steps=12,
        guidance_scale=4.0,
        negative_prompt=" ",
        sde_kind="flow_sde",
        noise_level=0.7,
        window_size=3,
        window_range=(0, 6),
        # the condition image's 4096 tokens (1024² condition area) make each sequence 5x Qwen-Image's at 512²
        micro_batch=4,
    )
    """512², 12 steps, true-CFG 4, flow_sde noise 0.7 in a 3-step window within steps [0, 6)."""
    grpo: GRPOConfig = GRPOConfig(
        group_size=16,
        prompts_per_step=32,
        clip_range=1e-4,
        adv_clip_max=5.0,
        adv_std="group",
        optimizer_steps_per_step=2,
        kl_coef=0.0,
    )
    """32 prompts x 16 images, clip 1e-4, per-group-std advantages clipped at 5, 2 updates per step, no KL."""
    optim: OptimConfig = OptimConfig(lr=3e-4, weight_decay=1e-4)
    """AdamW 3e-4, weight decay 1e-4."""
    data: DataConfig = DataConfig(
        train_prompts="data/qwen_image_edit_ocr/train.jsonl",
        val_prompts="data/qwen_image_edit_ocr/test.jsonl",
    )
    """Rows {"prompt", "image"}: rendered there by `main` unless --no-make-data."""
    reward: RewardConfig = RewardConfig(name="ocr")
    """Offline PP-OCR (rapidocr) with flow_grpo's edit-distance score, on the word to write."""
    run: RunConfig = RunConfig(val_every=20, val_num_steps=40, ckpt_every=20)
    """Outputs under runs/<exp_name>; validation (40 ODE steps) and checkpoints every 20 steps."""
    make_data: bool = True
    """Render data.train_prompts / data.val_prompts (rows and condition PNGs beside them) from the bundled train /
    held-out word lists before training, at the sampling size; False trains on the rows already there."""
    max_rows: int = 0
    """Rows rendered per split (0 = one per word: 2236 train, 316 held-out)."""


def edit_prompt(source: str, target: str) -> str:
    """The instruction; `target` is quoted first, the text the OCR reward reads back."""
    return f'Write "{target}" in place of the text "{source}", in the same position and style'


def render_word(word: str, height: int, width: int, rng: random.Random):
    """`word` in one colour on a plain background of another, at a size and place drawn from `rng` (PIL)."""
    from PIL import Image, ImageDraw, ImageFont

    background = tuple(rng.randint(150, 255) for _ in range(3))
    ink = tuple(rng.randint(0, 90) for _ in range(3))  # dark on light: legible to OCR whatever the draw
    font = ImageFont.load_default(size=max(8, int(rng.uniform(0.12, 0.25) * height)))
    image = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    x = rng.uniform(0, max(0, width - (right - left))) - left
    y = rng.uniform(0, max(0, height - (bottom - top))) - top
    draw.text((x, y), word, font=font, fill=ink)
    return image


def write_rows(path: str | Path, words: list[str], *, height: int, width: int, max_rows: int = 0) -> Path:
    """Row i rewrites word i as the word half the list away, its condition image rendered from a generator
    seeded by the row's text; writes `path` (.jsonl) and `images/` beside it. Every file is written to a
    temporary name and renamed, so ranks rendering the same rows at once leave whole, identical files."""
    path = Path(path)
    (path.parent / "images").mkdir(parents=True, exist_ok=True)
    n = len(words)
    lines = []
    for i in range(min(n, max_rows) if max_rows else n):
        source, target = words[i], words[(i + n // 2) % n]
        prompt = edit_prompt(source, target)
        name = f"images/{i:05d}_{source}.png"
        image = render_word(source, height, width, random.Random(prompt))
        tmp = path.parent / f"{name}.{os.getpid()}.tmp.png"
        image.save(tmp)
        os.replace(tmp, path.parent / name)
        lines.append(json.dumps({"prompt": prompt, "image": name}))
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def tiny() -> Config:
    """Seconds on a CPU with a tiny random Qwen-Image-Edit: the wiring end to end, not learning."""
    return dataclasses.replace(
        Config(),
        num_steps=2,
        device="cpu",
        model=ModelConfig(
            kind="tiny_qwen_image_edit", dtype="fp32", lora_rank=4, lora_alpha=8, gradient_checkpointing=False
        ),
        # No CFG: it doubles every forward, and the model tests cover the CFG path against the pipeline.
        sampling=dataclasses.replace(
            Config().sampling,
            height=64,
            width=64,
            num_steps=6,
            guidance_scale=1.0,
            window_size=2,
            micro_batch=8,
        ),
        grpo=GRPOConfig(
            group_size=2, prompts_per_step=2, clip_range=1e-4, adv_std="group", optimizer_steps_per_step=2
        ),
        data=dataclasses.replace(Config().data, val_num_prompts=2),
        run=RunConfig(wandb="disabled", val_every=2, val_num_steps=6, ckpt_every=2, log_images_every=1),
        max_rows=8,
    )


def main(cfg: Config) -> dict[str, float]:
    from fgrpo.models.textbed import read_words
    from fgrpo.train import train

    if cfg.make_data:
        s = cfg.sampling
        for path, split in ((cfg.data.train_prompts, "train"), (cfg.data.val_prompts, "heldout")):
            write_rows(path, read_words(split), height=s.height, width=s.width, max_rows=cfg.max_rows)
    return train(cfg, experiment_source=Path(__file__))


if __name__ == "__main__":
    presets = {
        "recipe": ("verl-omni's Qwen-Image-Edit Flow-GRPO LoRA recipe (GPUs, real weights).", Config()),
        "tiny": (
            "Seconds on a CPU: a tiny random Qwen-Image-Edit, offline OCR reward (wiring only).",
            tiny(),
        ),
    }
    cli(main, presets)
