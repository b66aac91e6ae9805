"""Evaluation: sample a prompt set with fixed seeds, score every image, summarise each metric with a bootstrap
interval, and write the report (`experiments/eval_ocr.py` is the command).

The sampling and scoring are the training run's validation (`sample_and_score`; train.validate calls it too):
deterministic ODE samples (`validation_sampling`), the prompts split over the data-parallel ranks as validation
splits them, image j of prompt i seeded by `validation_seeds([i], image=j)`. Image 0 of every prompt is therefore
the image each validation of a run draws, and an evaluation with one image a prompt and the run's validation
settings gives that validation's numbers bit for bit.

Per image the metrics are: `reward` (the score), `reward/<key>` for each component the reward returns,
`reward_exact` (OCR rewards: 1 where the text was read exactly), `gold/<stat>` (fgrpo.guard.image_stats) and
`gold/no_text` (OCR rewards: 1 where the reader found no text). A metric's mean is over every image; its 95 %
interval is a percentile bootstrap over prompts (a prompt's images move together).
"""

from __future__ import annotations

import base64
import dataclasses
import gc
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fgrpo import checkpoint, guard, parallel
from fgrpo.config import ModelConfig
from fgrpo.errors import ConfigError, MissingFileError
from fgrpo.files import read_safetensors_metadata
from fgrpo.models.base import FlowModel, trained_module, trained_transformers
from fgrpo.models.lora import ADAPTER_WEIGHTS, lora_files, setup_trainable_model
from fgrpo.models.registry import build_model
from fgrpo.rewards import build_reward
from fgrpo.rewards.base import check_scores
from fgrpo.rewards.ocr import is_exact
from fgrpo.rewards.runner import ParallelReward
from fgrpo.rollout import seeds as rs
from fgrpo.rollout.base import SamplingConfig
from fgrpo.rollout.build import build_engine
from fgrpo.rollout.engine import rollout, validation_sampling

# The validation row's name of each per-image metric that validation logs (the mean over the images).
VALIDATION_KEYS = {
    "reward": "val/reward_mean",
    "reward_exact": "val/reward_exact_frac",
    **{f"gold/{k}": f"val/gold/{k}" for k in guard.GOLD_KEYS},
    "gold/no_text": "val/gold/no_text_frac",
}


@dataclass
class Scored:
    """One image a prompt of a prompt set, scored. `metrics`: name -> fp32 [P] in prompt order (every rank holds
    all of them); `prompts` / `images`: this rank's share (padded by wrapping), images uint8 [n, H, W, 3]."""

    metrics: dict[str, torch.Tensor]
    prompts: list[str]
    images: np.ndarray
    seeds: list[int]


@torch.no_grad()
def sample_and_score(
    engine,
    reward,
    reward_name: str,
    prompts: Sequence[str],
    sampling: SamplingConfig,
    device: torch.device,
    split: parallel.Split,
    *,
    ocr: bool,
    image: int = 0,
) -> Scored:
    """Image `image` of every prompt sampled with `sampling` (validation_sampling's ODE) on this rank's share of
    the prompts, scored by `reward`, the per-image metrics gathered over the data-parallel ranks in one
    collective. ocr: the reward's scores are OCR scores (adds `reward_exact`)."""
    world = split.data_size()
    n = math.ceil(len(prompts) / world) * world
    ids = torch.arange(n).view(world, -1)[split.data_rank()]
    local_prompts = [prompts[int(i) % len(prompts)] for i in ids]  # pad by wrapping so shapes match
    seeds = rs.validation_seeds(ids, image)
    traj = rollout(engine, local_prompts, seeds, sampling, device)
    images = traj.images.cpu().numpy()
    out = reward(images, local_prompts)
    check_scores(out, local_prompts, reward_name)
    scores = torch.as_tensor(out.scores, dtype=torch.float32)
    # every rank's reward returns the same component keys; sorted, the columns line up in the gather
    components = {
        f"reward/{k}": torch.as_tensor(v, dtype=torch.float32) for k, v in sorted(out.components.items())
    }
    columns = {
        "reward": scores,
        **({"reward_exact": is_exact(scores).float()} if ocr else {}),
        **components,
        **dict(zip([f"gold/{k}" for k in guard.GOLD_KEYS], guard.image_stats(images).unbind(1))),
        "gold/no_text": torch.as_tensor(guard.no_text_flags(out.components, len(local_prompts))),
    }
    rows = torch.stack(list(columns.values()), dim=1).to(traj.images.device)
    rows = parallel.all_gather_cat(rows, split.data_group())[: len(prompts)].cpu()
    metrics = {k: rows[:, c].contiguous() for c, k in enumerate(columns)}
    if torch.isnan(metrics["gold/no_text"]).any():  # a reward without an OCR reader
        del metrics["gold/no_text"]
    return Scored(metrics, local_prompts, images, seeds)


def mean(values: torch.Tensor) -> float:
    """The mean of a per-image metric over the images that have it (NaN: a multi-reward member left out)."""
    return values[~torch.isnan(values)].mean().item()


def validation_metrics(metrics: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """A validation row (val/reward_mean, val/reward_exact_frac, val/gold/*) from per-image metrics."""
    return {VALIDATION_KEYS[k]: mean(v) for k, v in metrics.items() if k in VALIDATION_KEYS}


def bootstrap_draws(n: int, num: int, seed: int) -> np.ndarray:
    """[num, n] indices: `num` resamples, with replacement, of n prompts (numpy's PCG64 seeded by `seed`)."""
    return np.random.default_rng(seed).integers(0, n, size=(num, n))


def bootstrap_ci(values: np.ndarray, draws: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` [n]: the (1 - level) / 2 and (1 + level) / 2
    percentiles (numpy's linear interpolation) of the means of values[draws[b]] over the draws [B, n]."""
    means = np.asarray(values, dtype=np.float64)[draws].mean(axis=1)
    lo, hi = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def summarize(
    metrics: Mapping[str, torch.Tensor], num_prompts: int, *, bootstrap: int, seed: int
) -> dict[str, dict]:
    """Per metric: n (images that have it), mean (over them) and ci95 (bootstrap over prompts of the per-prompt
    means). metrics: name -> [N * P] image-major (image j of prompt i at j * P + i)."""
    out = {}
    for name, values in metrics.items():
        per_prompt = values.view(-1, num_prompts).double().nanmean(dim=0).numpy()  # [P]
        per_prompt = per_prompt[~np.isnan(per_prompt)]
        n = int((~torch.isnan(values)).sum())
        if n == 0:
            continue
        ci = bootstrap_ci(per_prompt, bootstrap_draws(len(per_prompt), bootstrap, seed))
        out[name] = {"n": n, "mean": mean(values), "ci95": list(ci)}
    return out


@dataclass
class ModelScores:
    """An evaluated model: per-image metrics [N * P] image-major, their seeds, and the images the report shows
    (rank 0's first prompts: (prompt index, image, seed, uint8 [H, W, 3]))."""

    name: str
    metrics: dict[str, torch.Tensor]
    seeds: list[int]
    shown: list[tuple[int, int, int, np.ndarray]] = field(default_factory=list)


def score_model(
    name: str,
    engine,
    reward,
    reward_name: str,
    prompts: Sequence[str],
    sampling: SamplingConfig,
    device: torch.device,
    split: parallel.Split,
    *,
    ocr: bool,
    num_images: int,
    show: int,
) -> ModelScores:
    """`num_images` images a prompt (`sample_and_score` with image 0 .. num_images - 1), each pass over the prompts
    shaped as a validation, so image 0 is the validation's; `show` prompts' images kept for the report."""
    passes = []
    shown = []
    seeds: list[int] = []
    for j in range(num_images):
        s = sample_and_score(engine, reward, reward_name, prompts, sampling, device, split, ocr=ocr, image=j)
        passes.append(s.metrics)
        seeds += rs.validation_seeds(torch.arange(len(prompts)), j)
        if split.data_rank() == 0:  # its first local prompts are the prompt set's first
            shown += [(i, j, s.seeds[i], s.images[i]) for i in range(min(show, len(prompts), len(s.images)))]
    keys = [k for k in passes[0] if all(k in p for p in passes)]
    metrics = {k: torch.cat([p[k] for p in passes]) for k in keys}
    return ModelScores(name, metrics, seeds, sorted(shown, key=lambda t: (t[0], t[1])))


# ---------------------------------------------------------------------------------------------------------------
# the models


@dataclass(frozen=True)
class Column:
    """One evaluated model: the base (neither set), an exported LoRA directory, or a run's checkpoint."""

    name: str
    lora: str = ""
    checkpoint: str = ""


def model_columns(*, base: bool, loras: Sequence[str], checkpoints: Sequence[str]) -> list[Column]:
    """The report's columns in order: the base, each LoRA, each checkpoint (named by the path given)."""
    cols = [Column("base")] if base else []
    cols += [Column(str(p), lora=str(p)) for p in loras] + [
        Column(str(p), checkpoint=str(p)) for p in checkpoints
    ]
    names = [c.name for c in cols]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{dup[0]!r} is given twice; name each model once")
    return cols


def check_adapter_dir(path: str | Path) -> Path:
    """An exported LoRA directory's adapter file, refused in one line naming --lora when it is not there."""
    p = Path(path)
    if not p.is_dir():
        raise MissingFileError(
            f"--lora {path}: no such directory; pass an exported adapter (runs/<exp_name>/lora)"
        )
    f = lora_files(p)[0] / ADAPTER_WEIGHTS  # a model of several transformers: its first one's
    if not f.is_file():
        raise MissingFileError(
            f"--lora {path}: no {ADAPTER_WEIGHTS} in it; pass a directory fgrpo exported (runs/<exp_name>/lora or "
            "lora_best) or diffusers' save_lora_weights wrote"
        )
    adapter_settings(p)
    return f


def adapter_settings(path: str | Path) -> dict[str, int | str]:
    """The LoraConfig an exported adapter keeps in its safetensors header (diffusers' `lora_adapter_metadata`)
    as model.* fields: lora_rank, lora_alpha, lora_targets; {} when the header has none. A directory of one adapter
    per transformer (models.lora.export_loras): the first one's (the loop exports them all with one config)."""
    f = lora_files(path)[0] / ADAPTER_WEIGHTS
    try:
        header = json.loads(read_safetensors_metadata(f).get("lora_adapter_metadata", "{}"))
    except Exception as e:  # safetensors' and json's own errors do not say which file
        raise ConfigError(f"--lora {path}: cannot read {f} as a safetensors adapter ({e})") from None
    if "transformer.r" not in header:
        return {}
    targets = header.get("transformer.target_modules") or []
    return {
        "lora_rank": int(header["transformer.r"]),
        "lora_alpha": int(header.get("transformer.lora_alpha", header["transformer.r"])),
        **({"lora_targets": ",".join(sorted(targets))} if targets else {}),
    }


@dataclass(frozen=True)
class EvalSpec:
    """What every column is evaluated on: the prompts, the model as a run builds it (`model`, `seed`), the
    validation's sampling (`sampling` at `steps` ODE steps), the reward (a build_reward spec, scored in
    `reward_workers` processes; `ocr`: its scores are OCR scores), images a prompt and prompts shown."""

    prompts: list[str]
    model: ModelConfig
    sampling: SamplingConfig
    steps: int
    seed: int
    reward: str
    reward_workers: int = 0
    ocr: bool = True
    num_images: int = 1
    show: int = 8


def build_column(spec: EvalSpec, column: Column, device: torch.device) -> FlowModel:
    """The column's model built as a training run builds its own (fgrpo.train.Trainer): the seeded build, LoRA
    (the column's adapter loaded, else a fresh one, which changes no output), FSDP2 with the run's compute dtype,
    then the column's checkpoint."""
    mcfg = spec.model
    if column.lora:
        mcfg = dataclasses.replace(mcfg, lora=True, init_lora=column.lora, **adapter_settings(column.lora))
    torch.manual_seed(spec.seed)  # the LoRA init draws from the global RNG, as in training
    model = build_model(mcfg, device, spec.seed)
    setup_trainable_model(model, mcfg)
    for transformer in trained_transformers(model).values():
        parallel.shard_transformer(transformer, param_dtype=torch.bfloat16 if mcfg.dtype == "bf16" else None)
    if column.checkpoint:
        checkpoint.load(column.checkpoint, model=trained_module(model))
    return model


def run(
    spec: EvalSpec,
    columns: Sequence[Column],
    d: parallel.Dist,
    *,
    out_dir: Path | None,
    bootstrap: int,
    bootstrap_seed: int,
    config: Mapping | None = None,
) -> dict[str, dict[str, dict]]:
    """Evaluate every column on every rank (the prompts split over them), one model in memory at a time; rank 0
    writes the report into `out_dir` (None: not written). Returns the summary (model -> metric -> n, mean, ci95)."""
    split = parallel.split(0)
    reward = (
        build_reward(spec.reward)
        if spec.reward_workers == 0
        else ParallelReward(spec.reward, spec.reward_workers)
    )
    sampling = validation_sampling(spec.sampling, spec.steps)
    results = []
    try:
        for column in columns:
            model = build_column(spec, column, d.device)
            engine = build_engine(
                model,
                "diffusers",
                spec.model.path,
                merged_lora=spec.model.merged_rollout,
                float8=spec.model.merged_float8,
            )
            results.append(
                score_model(
                    column.name,
                    engine,
                    reward,
                    spec.reward,
                    spec.prompts,
                    sampling,
                    d.device,
                    split,
                    ocr=spec.ocr,
                    num_images=spec.num_images,
                    show=spec.show,
                )
            )
            del model, engine  # one model in memory at a time
            gc.collect()
    finally:
        if isinstance(reward, ParallelReward):
            reward.close()
    summary = {
        r.name: summarize(r.metrics, len(spec.prompts), bootstrap=bootstrap, seed=bootstrap_seed)
        for r in results
    }
    if out_dir is not None:
        write_report(out_dir, results, spec.prompts, bootstrap=bootstrap, seed=bootstrap_seed, config=config)
    return summary


# ---------------------------------------------------------------------------------------------------------------
# the report


def _jsonable(x: float) -> float | None:
    return None if math.isnan(x) else x


def score_rows(result: ModelScores, prompts: Sequence[str]) -> list[dict]:
    """scores.jsonl's rows of one model: one per image (model, prompt, its index, image, seed, each metric)."""
    P = len(prompts)
    table = {k: v.tolist() for k, v in result.metrics.items()}
    return [
        {
            "model": result.name,
            "prompt": prompts[r % P],
            "prompt_index": r % P,
            "image": r // P,
            "seed": seed,
            **{k: _jsonable(v[r]) for k, v in table.items()},
        }
        for r, seed in enumerate(result.seeds)
    ]


def png_data_uri(image: np.ndarray) -> str:
    """A uint8 [H, W, 3] image as a data: URI of a PNG (the report then opens offline)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def format_cell(stat: Mapping) -> str:
    """A summary entry as the report's table shows it: the mean and its interval, 4 decimals."""
    lo, hi = stat["ci95"]
    return f"{stat['mean']:.4f} [{lo:.4f}, {hi:.4f}]"


def render_html(
    summary: Mapping[str, Mapping[str, dict]], results: Sequence[ModelScores], prompts: Sequence[str]
) -> str:
    """report.html: a table of the metrics (rows) by model (columns), then a grid of the shown prompts and seeds
    (rows) by model (columns), every image embedded."""
    names = [r.name for r in results]
    metrics = list(dict.fromkeys(k for r in results for k in summary[r.name]))
    e = html.escape
    head = "".join(f"<th>{e(n)}</th>" for n in names)
    body = []
    for m in metrics:
        cells = "".join(
            f'<td class="num">{format_cell(summary[n][m])}</td>' if m in summary[n] else "<td>-</td>"
            for n in names
        )
        body.append(f"<tr><th>{e(m)}</th>{cells}</tr>")
    grid = []
    by_model = [{(i, j): (seed, img) for i, j, seed, img in r.shown} for r in results]
    for i, j in sorted({(i, j) for r in results for i, j, _, _ in r.shown}):
        seed = next(b[(i, j)][0] for b in by_model if (i, j) in b)
        cells = "".join(
            f'<td><img alt="{e(n)}" src="{png_data_uri(b[(i, j)][1])}"></td>' if (i, j) in b else "<td></td>"
            for n, b in zip(names, by_model)
        )
        grid.append(f"<tr><th>{e(prompts[i])}<br><small>image {j}, seed {seed}</small></th>{cells}</tr>")
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>fgrpo evaluation</title><style>'
        "body{font-family:sans-serif}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}td.num{font-family:monospace}"
        "img{image-rendering:pixelated;min-width:128px}</style></head><body>\n"
        f"<h1>fgrpo evaluation</h1>\n<p>{len(prompts)} prompts; mean [bootstrap 95 % interval over prompts]</p>\n"
        f'<table id="summary"><tr><th>metric</th>{head}</tr>\n' + "\n".join(body) + "</table>\n"
        f'<table id="grid"><tr><th>prompt</th>{head}</tr>\n' + "\n".join(grid) + "</table>\n</body></html>\n"
    )


def write_report(
    out_dir: str | Path,
    results: Sequence[ModelScores],
    prompts: Sequence[str],
    *,
    bootstrap: int,
    seed: int,
    config: Mapping | None = None,
) -> dict[str, dict[str, dict]]:
    """Write scores.jsonl, summary.json and report.html into out_dir; returns the summary (model -> metric ->
    n, mean, ci95)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {r.name: summarize(r.metrics, len(prompts), bootstrap=bootstrap, seed=seed) for r in results}
    with open(out / "scores.jsonl", "w") as f:
        for r in results:
            for row in score_rows(r, prompts):
                f.write(json.dumps(row, allow_nan=False) + "\n")
    record = {"models": summary, "num_prompts": len(prompts), "bootstrap": bootstrap, "bootstrap_seed": seed}
    (out / "summary.json").write_text(
        json.dumps(record | ({"config": config} if config else {}), indent=2) + "\n"
    )
    (out / "report.html").write_text(render_html(summary, results, prompts))
    return summary
