"""Evaluate a base model, a run's checkpoints and exported LoRA adapters on an OCR prompt set, side by side.

Every model samples the same prompts with the same seeds (deterministic ODE sampling, the training run's
validation: fgrpo.evaluate), N images a prompt; every image is scored by the reward (its components, the OCR
exact-match share) and the gold statistics (brightness, near-black / near-white pixels, images without text).
Writes to --out: `scores.jsonl` (one row per image), `summary.json` (per model and metric: n, mean, bootstrap
95 % interval over prompts) and `report.html` (the table side by side, a grid of the same prompts and seeds per
model; images embedded, opens offline).

With --num-images 1 and a run's validation settings (model, sampling, --steps = its --run.val-num-steps, the
validation reward and prompts), the base model's numbers are the run's step-0 validation, and its exported
`lora/` gives its final validation.

Presets (tyro subcommands; every field can still be overridden with a flag):
    tiny      the text renderer on the CPU, its 32 held-out words (the main job's validation): seconds.
    ocr-test  Qwen-Image with the recipe's sampling on flow_grpo's OCR test prompts (--prompts names the file).

CPU:     uv run python experiments/eval_ocr.py tiny --lora runs/qwen_image_ocr/lora
1 GPU:   uv run python experiments/eval_ocr.py ocr-test --prompts ../shared/data/flow_grpo/dataset/ocr/test.txt \
             --lora runs/qwen_image_ocr/lora --lora runs/other/lora
N GPUs:  uv run torchrun --nproc-per-node N experiments/eval_ocr.py ocr-test ...   (the prompts split over ranks)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from fgrpo.config import ModelConfig
from fgrpo.errors import ConfigError, MissingFileError, cli
from fgrpo.rollout.base import SamplingConfig


@dataclass(frozen=True)
class Config:
    """Evaluation of models on a prompt set (defaults: Qwen-Image on flow_grpo's OCR test prompts)."""

    out: str = "runs/eval_ocr"
    """Directory of scores.jsonl, summary.json and report.html (created; the files are replaced)."""
    base: bool = True
    """Evaluate the base model (model.path without adapters) as the first column."""
    lora: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """Exported LoRA directories (adapter_model.safetensors inside, as runs/<exp_name>/lora): one column each;
    repeat the flag for several. Rank, alpha and targets are read from each adapter."""
    checkpoint: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """A run's checkpoints (a step_* directory, or runs/<exp_name>/checkpoints for its newest valid one), built
    with model.* as the run was: one column each; repeat the flag for several."""
    prompts: str = "data/ocr/test.txt"
    """Prompt file (.txt one per line, .jsonl with a 'prompt' key) or 'textbed:heldout' / 'textbed:train'."""
    num_prompts: int = 0
    """Evaluate the first N prompts (a run's --data.val-num-prompts); 0 = all of them."""
    num_images: int = 1
    """Images a prompt; image 0 has the validation's seed, image j its own fixed seed."""
    steps: int = 50
    """Denoising steps of the ODE sampling (a run's --run.val-num-steps)."""
    seed: int = 42
    """The run's --seed: the weights of the tiny random model kinds and the (zero-effect) fresh LoRA's init."""
    device: str = "auto"
    """'auto' (cuda if available), 'cuda' or 'cpu'."""
    model: ModelConfig = ModelConfig(kind="qwen_image", path="Qwen/Qwen-Image", lora_rank=64, lora_alpha=128)
    """The base model, as the run's --model.* (dtype, compile, ...); lora_* are read from each --lora."""
    sampling: SamplingConfig = SamplingConfig(
        height=512, width=512, num_steps=10, guidance_scale=4.0, negative_prompt=" ", micro_batch=8
    )
    """The run's sampling (resolution, CFG, micro-batch); the steps are `steps`, the SDE settings unused (ODE)."""
    reward: str = "ocr"
    """Reward spec for fgrpo.rewards.build_reward (the run's validation reward: --reward.val-name, else
    --reward.name); 'ocr' in it adds the exact-match share and requires quoted prompts."""
    reward_workers: int = 0
    """Processes that score (a run's --reward.val-workers); 0 scores in this process."""
    bootstrap: int = 1000
    """Bootstrap resamples of the prompts for each 95 % interval."""
    bootstrap_seed: int = 0
    """Seed of the bootstrap's resampling (numpy)."""
    show: int = 8
    """Prompts shown in the report's image grid (rank 0's first ones), with all their images."""

    @property
    def is_ocr(self) -> bool:
        return "ocr" in self.reward


def tiny() -> Config:
    """The CPU main job's validation: the text renderer, 32 held-out words, 10 ODE steps, the offline OCR reward."""
    return dataclasses.replace(
        Config(),
        device="cpu",
        model=ModelConfig(
            kind="textbed", path="", dtype="fp32", lora_rank=32, lora_alpha=64, gradient_checkpointing=False
        ),
        sampling=SamplingConfig(
            height=32, width=128, num_steps=10, guidance_scale=1.0, negative_prompt="", micro_batch=16
        ),
        prompts="textbed:heldout",
        num_prompts=32,
        steps=10,
    )


def presets() -> dict[str, tuple[str, Config]]:
    return {
        "tiny": ("The text renderer on the CPU, its 32 held-out words: seconds.", tiny()),
        "ocr-test": (
            "Qwen-Image, the recipe's sampling, flow_grpo's OCR test prompts (--prompts FILE).",
            Config(),
        ),
    }


def check(cfg: Config) -> list[str]:
    """Every refusal that needs no model, in one line naming the flag; returns the prompts."""
    from fgrpo.checkpoint import resolve
    from fgrpo.data import load_prompts
    from fgrpo.evaluate import check_adapter_dir

    if cfg.num_images < 1:
        raise ConfigError(f"--num-images {cfg.num_images}: must be >= 1")
    if cfg.num_prompts < 0:
        raise ConfigError(f"--num-prompts {cfg.num_prompts}: must be >= 0 (0 = every prompt)")
    if cfg.steps < 1:
        raise ConfigError(f"--steps {cfg.steps}: must be >= 1")
    if cfg.bootstrap < 1:
        raise ConfigError(f"--bootstrap {cfg.bootstrap}: must be >= 1")
    if not (cfg.base or cfg.lora or cfg.checkpoint):
        raise ConfigError("nothing to evaluate: --no-base without --lora DIR or --checkpoint DIR")
    for d in cfg.lora:
        check_adapter_dir(d)
    for d in cfg.checkpoint:
        try:
            resolve(d)
        except MissingFileError as e:
            raise MissingFileError(f"--checkpoint {d}: {str(e).removeprefix('checkpoint: ')}") from None
    prompts = load_prompts(cfg.prompts, require_quoted=cfg.is_ocr, field="prompts")
    return prompts[: cfg.num_prompts] if cfg.num_prompts else prompts


def main(cfg: Config) -> dict[str, dict]:
    from fgrpo import evaluate, parallel

    prompts = check(cfg)
    d = parallel.init_distributed(cfg.device)
    summary = evaluate.run(
        evaluate.EvalSpec(
            prompts=prompts,
            model=cfg.model,
            sampling=cfg.sampling,
            steps=cfg.steps,
            seed=cfg.seed,
            reward=cfg.reward,
            reward_workers=cfg.reward_workers,
            ocr=cfg.is_ocr,
            num_images=cfg.num_images,
            show=cfg.show,
        ),
        evaluate.model_columns(base=cfg.base, loras=cfg.lora, checkpoints=cfg.checkpoint),
        d,
        out_dir=Path(cfg.out) if d.is_main else None,
        bootstrap=cfg.bootstrap,
        bootstrap_seed=cfg.bootstrap_seed,
        config=dataclasses.asdict(cfg),
    )
    parallel.shutdown()
    return summary


if __name__ == "__main__":
    cli(main, presets())
