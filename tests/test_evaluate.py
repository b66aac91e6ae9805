"""fgrpo.evaluate and experiments/eval_ocr.py: the bootstrap by hand, the report's HTML, the one-line refusals, and
the contract that an evaluation of a run's base model and of its exported LoRA gives the run's step-0 and final
validation numbers bit for bit (the text renderer with the OCR reward, one training step, on the CPU)."""

import dataclasses
import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from train_entry import Config as RunConfigEntry

from fgrpo import evaluate, parallel
from fgrpo.config import DataConfig, GRPOConfig, ModelConfig, OptimConfig, RewardConfig
from fgrpo.data import load_prompts
from fgrpo.errors import FgrpoError
from fgrpo.logging import read_metrics
from fgrpo.rollout.base import SamplingConfig
from fgrpo.rollout.seeds import validation_seeds
from fgrpo.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _experiment():
    return load_script(ROOT / "experiments" / "eval_ocr.py")


# ---------------------------------------------------------------------------------------------------------------
# the bootstrap


def test_bootstrap_percentiles_by_hand():
    """values [0, 1, 2]; draws (0,0,0), (0,1,2), (2,2,2), (1,1,2) have means 0, 1, 2, 4/3; sorted 0, 1, 4/3, 2.
    numpy's linear percentile at q puts q/100 * 3 between the sorted means: 2.5 % -> 0.075 of the way from 0 to 1
    = 0.075; 97.5 % -> 2.925: 4/3 + 0.925 * (2 - 4/3) = 1.95."""
    draws = np.array([[0, 0, 0], [0, 1, 2], [2, 2, 2], [1, 1, 2]])
    lo, hi = evaluate.bootstrap_ci(np.array([0.0, 1.0, 2.0]), draws)
    assert lo == pytest.approx(0.075) and hi == pytest.approx(1.95)


def test_a_constant_metric_has_a_zero_width_interval_and_the_draws_are_seeded():
    draws = evaluate.bootstrap_draws(5, 200, seed=3)
    assert draws.shape == (200, 5) and draws.min() >= 0 and draws.max() <= 4
    assert np.array_equal(draws, evaluate.bootstrap_draws(5, 200, seed=3))
    assert not np.array_equal(draws, evaluate.bootstrap_draws(5, 200, seed=4))
    assert evaluate.bootstrap_ci(np.full(5, 0.7), draws) == (pytest.approx(0.7), pytest.approx(0.7))
    s = evaluate.summarize({"m": torch.full((10,), 0.25)}, 5, bootstrap=100, seed=0)
    assert s == {"m": {"n": 10, "mean": 0.25, "ci95": [0.25, 0.25]}}


def test_summary_resamples_prompts_and_averages_their_images():
    """2 prompts x 2 images, image-major [1, 0 | 1, 1]: prompt 0 scores 1 and 1, prompt 1 scores 0 and 1. The mean is
    over the 4 images (0.75); the interval resamples the per-prompt means [1, 0.5]. A NaN (a multi-reward member
    left out) is not counted."""
    values = torch.tensor([1.0, 0.0, 1.0, 1.0])
    s = evaluate.summarize(
        {"m": values, "gap": torch.tensor([1.0, np.nan, 0.0, np.nan])}, 2, bootstrap=50, seed=1
    )
    ci = evaluate.bootstrap_ci(np.array([1.0, 0.5]), evaluate.bootstrap_draws(2, 50, 1))
    assert s["m"] == {"n": 4, "mean": 0.75, "ci95": list(ci)}
    assert (
        s["gap"]["n"] == 2 and s["gap"]["mean"] == 0.5 and s["gap"]["ci95"] == [0.5, 0.5]
    )  # prompt 1 has none


# ---------------------------------------------------------------------------------------------------------------
# the report


class _Tables(HTMLParser):
    """The text of every cell of each table (by id) and the <img> tags inside each."""

    def __init__(self):
        super().__init__()
        self.cells: dict[str, list[list[str]]] = {}
        self.images: dict[str, list[dict]] = {}
        self.table = ""
        self.cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.table = a.get("id") or ""
            self.cells[self.table], self.images[self.table] = [], []
        elif tag == "tr":
            self.cells[self.table].append([])
        elif tag in ("td", "th"):
            self.cell = []
        elif tag == "img":
            self.images[self.table].append(a)

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.cells[self.table][-1].append("".join(self.cell))
            self.cell = None


def test_the_report_shows_the_summary_and_a_grid_of_every_model(tmp_path):
    """Two models, 3 prompts x 2 images, 2 prompts shown: the table's cells are summary.json's numbers (4 decimals),
    the grid has 2 models x 2 prompts x 2 images <img> tags of embedded PNGs, the prompts escaped;
    scores.jsonl has one row per image."""
    prompts = ['"<b>A&B</b>"', '"CAT"', '"DOG"']
    rng = np.random.default_rng(0)

    def model(name):
        metrics = {
            "reward": torch.tensor(rng.random(6), dtype=torch.float32),
            "gold/white_frac": torch.zeros(6),
        }
        image = rng.integers(0, 256, (4, 8, 3), dtype=np.uint8)
        shown = [(i, j, 100 * j + i, image) for i in range(2) for j in range(2)]
        return evaluate.ModelScores(name, metrics, list(range(6)), shown)

    results = [model("base"), model("runs/x/lora")]
    summary = evaluate.write_report(tmp_path, results, prompts, bootstrap=20, seed=0)
    assert json.loads((tmp_path / "summary.json").read_text())["models"] == summary
    rows = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and rows[4] == {
        "model": "base",
        "prompt": '"CAT"',
        "prompt_index": 1,
        "image": 1,
        "seed": 4,
        "reward": results[0].metrics["reward"][4].item(),
        "gold/white_frac": 0.0,
    }

    page = _Tables()
    text = (tmp_path / "report.html").read_text()
    page.feed(text)
    assert "<b>A&B</b>" not in text and "&lt;b&gt;A&amp;B&lt;/b&gt;" in text
    header, *body = page.cells["summary"]
    assert header == ["metric", "base", "runs/x/lora"]
    for metric, *cells in body:
        for name, cell in zip(header[1:], cells):
            stat = summary[name][metric]
            lo, hi = stat["ci95"]
            assert cell == f"{stat['mean']:.4f} [{lo:.4f}, {hi:.4f}]"
    assert [row[0] for row in body] == ["reward", "gold/white_frac"]
    grid = page.images["grid"]
    assert len(grid) == 2 * 2 * 2 and all(img["src"].startswith("data:image/png;base64,") for img in grid)
    assert [img["alt"] for img in grid[:2]] == ["base", "runs/x/lora"]
    assert page.cells["grid"][1][0] == '"<b>A&B</b>"image 0, seed 0'


# ---------------------------------------------------------------------------------------------------------------
# refusals before any model


def test_bad_input_is_refused_in_one_line_before_a_model_is_built(tmp_path, monkeypatch):
    m = _experiment()

    def no_model(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr(evaluate, "build_model", no_model)
    no_adapter = tmp_path / "empty_dir"
    no_adapter.mkdir()
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    base = dataclasses.replace(m.tiny(), out=str(tmp_path / "out"))
    cases = {
        "--lora": dataclasses.replace(base, lora=(str(tmp_path / "missing"),)),
        "adapter_model.safetensors": dataclasses.replace(base, lora=(str(no_adapter),)),
        "holds no prompts": dataclasses.replace(base, prompts=str(empty)),
        "--num-images 0": dataclasses.replace(base, num_images=0),
        "nothing to evaluate": dataclasses.replace(base, base=False),
        "--checkpoint": dataclasses.replace(base, checkpoint=(str(no_adapter),)),
    }
    for words, cfg in cases.items():
        with pytest.raises(FgrpoError) as caught:
            m.main(cfg)
        assert words in str(caught.value) and "\n" not in str(caught.value), words
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------
# the contract with training's validation

SAMPLING = SamplingConfig(
    height=32,
    width=128,
    num_steps=3,
    guidance_scale=1.0,
    negative_prompt="",
    noise_level=0.8,
    window_size=1,
    window_range=(0, 2),
    micro_batch=4,
)


def _run(tmp_path):
    """One Flow-GRPO step of the text renderer (LoRA r4, an lr that moves it in one step) with the OCR reward,
    validated before and after it on 6 held-out words (micro-batches of 4 and 2)."""
    c = RunConfigEntry()
    return dataclasses.replace(
        c,
        num_steps=1,
        model=ModelConfig(
            kind="textbed", path="", dtype="fp32", lora_rank=4, lora_alpha=8, gradient_checkpointing=False
        ),
        sampling=SAMPLING,
        grpo=GRPOConfig(
            group_size=2, prompts_per_step=2, optimizer_steps_per_step=1, clip_range=0.2, adv_std="group"
        ),
        optim=OptimConfig(lr=3e-4),
        data=DataConfig(train_prompts="textbed:train", val_prompts="textbed:heldout", val_num_prompts=6),
        reward=RewardConfig(name="ocr"),
        run=dataclasses.replace(c.run, out_dir=str(tmp_path), val_every=1, val_num_steps=3),
    )


@pytest.mark.slow
def test_an_evaluation_gives_the_runs_step0_and_final_validation_bit_for_bit(tmp_path):
    """The run's validation rows (step 0: the base model; step 1: the trained LoRA) equal the evaluation of the base,
    of the exported lora/ and of the run's last checkpoint with one image a prompt and the run's settings: every
    val/ number, exactly. With 2
    images a prompt image 0 keeps those numbers and image 1 has its own seeds."""
    from fgrpo.train import train

    cfg = _run(tmp_path)
    train(cfg)
    run = tmp_path / cfg.exp_name
    rows = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "val/reward_mean" in r}
    prompts = load_prompts("textbed:heldout")[:6]
    spec = evaluate.EvalSpec(
        prompts=prompts, model=cfg.model, sampling=SAMPLING, steps=3, seed=cfg.seed, reward="ocr", ocr=True
    )
    d = parallel.init_distributed("cpu")
    try:
        cols = evaluate.model_columns(
            base=True, loras=[str(run / "lora")], checkpoints=[str(run / "checkpoints")]
        )
        summary = evaluate.run(spec, cols, d, out_dir=tmp_path / "eval", bootstrap=10, bootstrap_seed=0)
        two = evaluate.run(
            dataclasses.replace(spec, num_images=2),
            cols[:1],
            d,
            out_dir=tmp_path / "eval2",
            bootstrap=10,
            bootstrap_seed=0,
        )
    finally:
        parallel.shutdown()
    for step, name in ((0, "base"), (1, str(run / "lora")), (1, str(run / "checkpoints"))):
        val = {
            k: v
            for k, v in rows[step].items()
            if k.startswith("val/") and k not in ("val/best", "val/best_step")
        }
        got = {
            evaluate.VALIDATION_KEYS[k]: s["mean"]
            for k, s in summary[name].items()
            if k in evaluate.VALIDATION_KEYS
        }
        assert set(val) >= {
            "val/reward_mean",
            "val/reward_exact_frac",
            "val/gold/no_text_frac",
            "val/gold/white_frac",
        }
        assert got == val, name
    assert rows[0]["val/reward_mean"] != rows[1]["val/reward_mean"], "the step left the model as it was"

    one = [json.loads(x) for x in (tmp_path / "eval" / "scores.jsonl").read_text().splitlines()]
    both = [json.loads(x) for x in (tmp_path / "eval2" / "scores.jsonl").read_text().splitlines()]
    assert [r for r in both if r["image"] == 0] == [r for r in one if r["model"] == "base"]
    assert [r["seed"] for r in both if r["image"] == 1] == validation_seeds(torch.arange(6), 1)
    assert two["base"]["reward"]["n"] == 12


def test_the_presets_evaluate_as_their_training_presets_validate():
    """`tiny` is the main job's validation (experiments/qwen_image_ocr.py tiny) and `ocr-test` the recipe's: the
    same model, resolution, CFG, micro-batch, ODE steps and reward; `tiny` also its prompts."""
    m = _experiment()
    train = load_script(ROOT / "experiments" / "qwen_image_ocr.py")
    presets = m.presets()
    assert set(presets) == {"tiny", "ocr-test"}
    keep = ("height", "width", "guidance_scale", "negative_prompt", "micro_batch")
    for (_, ev), run in ((presets["tiny"], train.tiny()), (presets["ocr-test"], train.Config())):
        assert {k: getattr(ev.sampling, k) for k in keep} == {k: getattr(run.sampling, k) for k in keep}
        assert (ev.model.kind, ev.model.path, ev.model.dtype) == (
            run.model.kind,
            run.model.path,
            run.model.dtype,
        )
        assert (ev.steps, ev.reward, ev.device, ev.num_images) == (
            run.run.val_num_steps,
            run.reward.val_name or run.reward.name,
            run.device,
            1,
        )
    tiny_eval, tiny_run = presets["tiny"][1], train.tiny()
    assert (tiny_eval.prompts, tiny_eval.num_prompts) == (
        tiny_run.data.val_prompts,
        tiny_run.data.val_num_prompts,
    )


@pytest.mark.slow
def test_the_main_jobs_lora_scores_higher_than_the_base(tmp_path):
    """The README's evaluation: the `tiny` preset on the base renderer and on the main job's exported adapter
    (`experiments/qwen_image_ocr.py tiny --seed 42`, 20 steps; a copy in tests/assets/main_job_lora). The base
    gives the main job's step-0 validation (0.629) and the adapter its final one (0.714), and the report holds both
    columns."""
    m = _experiment()
    lora = ROOT / "tests" / "assets" / "main_job_lora"
    cfg = dataclasses.replace(m.tiny(), lora=(str(lora),), out=str(tmp_path), bootstrap=100)
    summary = m.main(cfg)
    base, tuned = summary["base"]["reward"]["mean"], summary[str(lora)]["reward"]["mean"]
    assert base == pytest.approx(0.629, abs=1e-3) and tuned == pytest.approx(0.714, abs=1e-3)
    assert summary[str(lora)]["reward_exact"]["mean"] > summary["base"]["reward_exact"]["mean"]
    assert json.loads((tmp_path / "summary.json").read_text())["models"] == summary
    assert (tmp_path / "report.html").read_text().count("<img") >= 2
