"""Every experiment file: --help parses, its presets instantiate, the tiny presets run 2 steps end to end."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fgrpo.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((ROOT / "experiments").glob("*.py"))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


load = load_script


def test_every_experiment_is_covered():
    names = {p.stem for p in EXPERIMENTS}
    assert {"qwen_image_ocr", "sd35_ocr", "qwen_image_edit_ocr", "toy_2d", "pretrain_textbed"} <= names


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_help_parses(path):
    res = subprocess.run(
        [sys.executable, str(path), "--help"], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout


@pytest.mark.parametrize(
    "name",
    [
        "qwen_image_ocr",
        "sd35_ocr",
        "qwen_image_edit_ocr",
        "ltx2_ocr",
        "flux_ocr",
        "flux2_ocr",
        "zimage_ocr",
        "wan_video_ocr",
        "bagel_ocr",
    ],
)
def test_config_presets_instantiate(name):
    module = load(ROOT / "experiments" / f"{name}.py")
    recipe, tiny = module.Config(), module.tiny()
    assert recipe.exp_name == name == tiny.exp_name  # run name = file stem
    assert (
        recipe.model.kind
        in ("qwen_image", "sd3", "qwen_image_edit", "ltx2", "flux", "flux2", "zimage", "wan", "bagel")
        and recipe.model.lora
    )
    from fgrpo.algorithms import check_config

    check_config(recipe, world_size=1)
    check_config(tiny, world_size=1)


def test_tiny_gpu_preset_samples_like_the_cpu_preset_at_gpu_scale():
    """The GPU text-renderer preset keeps the CPU preset's sampling (no CFG, the same SDE window) and
    validation, and scales the batch: 32 words x 16 images, bf16 (RESULTS.md measured it)."""
    m = load(ROOT / "experiments" / "qwen_image_ocr.py")
    cpu, gpu = m.tiny(), m.tiny_gpu()
    from fgrpo.algorithms import check_config

    check_config(gpu, world_size=1)
    keep = (
        "height",
        "width",
        "num_steps",
        "guidance_scale",
        "sde_kind",
        "noise_level",
        "window_size",
        "window_range",
    )
    assert {k: getattr(gpu.sampling, k) for k in keep} == {k: getattr(cpu.sampling, k) for k in keep}
    assert gpu.sampling.guidance_scale == 1.0 and gpu.model.kind == "textbed" and gpu.model.path == ""
    assert (gpu.grpo.prompts_per_step, gpu.grpo.group_size, gpu.num_steps, gpu.model.dtype) == (
        32,
        16,
        150,
        "bf16",
    )
    assert gpu.data.val_prompts == cpu.data.val_prompts == "textbed:heldout"
    # trained on the recognizer alone on the GPU, in this process; validated by the full CPU reader in 15
    assert (gpu.reward.workers, gpu.reward.val_workers, gpu.model.compile) == (0, 15, True)
    assert json.loads(gpu.reward.name) == {"name": "ocr", "num_threads": 1, "detect": False, "device": "cuda"}
    assert json.loads(gpu.reward.val_name) == {"name": "ocr", "num_threads": 1}


def test_qwen_image_recipe_matches_the_published_one():
    c = load(ROOT / "experiments" / "qwen_image_ocr.py").Config()
    s, g = c.sampling, c.grpo
    assert (s.height, s.width, s.num_steps, s.sde_kind, s.noise_level) == (512, 512, 10, "flow_sde", 1.2)
    assert (s.window_size, s.window_range, s.guidance_scale, s.negative_prompt) == (2, (0, 5), 4.0, " ")
    assert (g.prompts_per_step, g.group_size, g.clip_range, g.adv_clip_max, g.adv_std) == (
        32,
        16,
        1e-5,
        5.0,
        "global",
    )
    assert (g.optimizer_steps_per_step, g.kl_coef, c.run.val_num_steps) == (2, 0.0, 50)
    assert (c.model.lora_rank, c.model.lora_alpha, c.optim.lr, c.optim.weight_decay) == (64, 128, 3e-4, 1e-4)


def test_qwen_image_recipe_h200_is_the_recipe_with_the_fastest_measured_settings(monkeypatch):
    m = load(ROOT / "experiments" / "qwen_image_ocr.py")
    fast, recipe = m.presets()["recipe-h200"][1], m.Config()
    mo = fast.model
    settings = (mo.compile, mo.checkpoint_policy, mo.merged_rollout, mo.fp8_rollout, fast.parallel.shard)
    assert settings == (True, "selective", True, True, "adapters")
    # everything else is the published recipe's
    same_model = dataclasses.replace(
        mo, compile=False, checkpoint_policy="full", merged_rollout=False, fp8_rollout=False
    )
    assert dataclasses.replace(fast, model=same_model, parallel=recipe.parallel) == recipe
    from fgrpo.config import TORCHAO_MISSING, validate_config

    # valid where torchao is installed (whether or not this environment has it) ...
    real_find_spec = importlib.util.find_spec
    present = {"torchao": True}

    def find_spec(name, *a):
        if name == "torchao":
            return object() if present["torchao"] else None
        return real_find_spec(name, *a)

    monkeypatch.setattr("importlib.util.find_spec", find_spec)
    validate_config(fast, world_size=1)
    # ... and without it the one-line error comes before anything is built
    present["torchao"] = False
    with pytest.raises(ValueError, match=re.escape(TORCHAO_MISSING)):
        validate_config(fast, world_size=1)


RENDERER_FLAGS = ["--grpo.prompts-per-step", "1", "--data.val-num-prompts", "2", "--run.val-every", "1"]


@pytest.mark.parametrize(
    ("name", "preset", "flags"),
    [
        ("qwen_image_ocr", "tiny", RENDERER_FLAGS),
        # sd35_ocr's `tiny` is this loop on the SD3 renderer: test_textbed trains that renderer through it
        ("sd35_ocr", "tiny-random", []),
        ("qwen_image_edit_ocr", "tiny", []),
        ("ltx2_ocr", "tiny", []),
        ("flux_ocr", "tiny", []),
        ("flux2_ocr", "tiny", []),
        ("flux2_ocr", "dev-tiny", []),
        ("zimage_ocr", "tiny", []),
        ("wan_video_ocr", "tiny", []),
        ("wan_video_ocr", "a14b-tiny", []),
        ("bagel_ocr", "tiny", []),
    ],
)
def test_tiny_preset_runs_two_steps(tmp_path, name, preset, flags):
    cmd = [
        sys.executable,
        str(ROOT / "experiments" / f"{name}.py"),
        preset,
        "--num-steps",
        "2",
        "--run.out-dir",
        str(tmp_path),
        *flags,
    ]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    run = tmp_path / name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [0, 1]
    assert any("val/reward_mean" in r for r in rows)
    assert (run / "checkpoints" / "step_000002" / "meta.json").is_file()
    experts = ("transformer", "transformer_2") if preset == "a14b-tiny" else ("",)  # one adapter per expert
    assert all((run / "lora" / e / "adapter_model.safetensors").is_file() for e in experts)
    assert (run / "config.json").is_file() and (run / f"{name}.py").is_file()  # config + source saved


def test_wan_a14b_preset_is_flow_factorys_wan22_t2v_config():
    """Flow-Factory's examples/grpo/lora/wan22_t2v.yaml on the model it names, Wan2.2-T2V-A14B: 480 px, 5 frames,
    10 steps, CFG 4 (high-noise expert) and 3 (low-noise), r64/a128 on both experts; the rest is the 5B recipe's."""
    m = load(ROOT / "experiments" / "wan_video_ocr.py")
    c, base = m.a14b(), m.Config()
    mc, s = c.model, c.sampling
    assert (mc.path, mc.experts, mc.num_frames, mc.guidance_scale_2, mc.lora_rank, mc.lora_alpha) == (
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        2,
        5,
        3.0,
        64,
        128,
    )
    assert (s.height, s.width, s.num_steps, s.guidance_scale) == (480, 480, 10, 4.0)
    assert (c.grpo, c.optim, dataclasses.replace(s, height=256, width=256, guidance_scale=5.0)) == (
        base.grpo,
        base.optim,
        base.sampling,
    )
    from fgrpo.algorithms import check_config

    check_config(c, world_size=8)
    check_config(m.a14b_tiny(), world_size=1)


def test_qwen_image_edit_recipe_matches_verl_omni():
    """verl-omni's Qwen-Image-Edit Flow-GRPO LoRA script (examples/flowgrpo_trainer/qwen_image_edit/
    run_qwen_image_edit_lora.sh): 512², 12 steps, true-CFG 4, sde noise 0.7 in a 3-step window within [0, 6),
    n=16 images of 32 prompts in 2 mini-batches, global_std=false, clip 1e-4, lr 3e-4, wd 1e-4, r64/a128, 40 val steps."""
    c = load(ROOT / "experiments" / "qwen_image_edit_ocr.py").Config()
    s, g = c.sampling, c.grpo
    assert (s.height, s.width, s.num_steps, s.guidance_scale, s.sde_kind, s.noise_level) == (
        512,
        512,
        12,
        4.0,
        "flow_sde",
        0.7,
    )
    assert (s.window_size, s.window_range, g.group_size, g.prompts_per_step, g.optimizer_steps_per_step) == (
        3,
        (0, 6),
        16,
        32,
        2,
    )
    assert (g.adv_std, g.clip_range, c.optim.lr, c.optim.weight_decay, c.run.val_num_steps) == (
        "group",
        1e-4,
        3e-4,
        1e-4,
        40,
    )
    assert (c.model.kind, c.model.lora_rank, c.model.lora_alpha) == ("qwen_image_edit", 64, 128)


def test_qwen_image_edit_rows_are_deterministic_and_legible(tmp_path):
    """The rendered rows: the same bytes on every write, the OCR target is the word to write, the image names the
    rows' condition file, and PP-OCR reads the source word off the condition image (the task is well posed)."""
    import numpy as np
    from PIL import Image

    from fgrpo.data import load_prompts
    from fgrpo.models.base import ImagePrompt
    from fgrpo.rewards.ocr import RapidOcrEngine, extract_target

    m = load(ROOT / "experiments" / "qwen_image_edit_ocr.py")
    words = ["CAT", "DOG", "HOUSE", "RIVER"]
    a = m.write_rows(tmp_path / "a" / "rows.jsonl", words, height=256, width=256)
    b = m.write_rows(tmp_path / "b" / "rows.jsonl", words, height=256, width=256)
    assert a.read_bytes() == b.read_bytes()
    names = sorted(os.listdir(a.parent / "images"))
    assert len(names) == 4 and names == sorted(os.listdir(b.parent / "images"))
    assert all(
        (a.parent / "images" / n).read_bytes() == (b.parent / "images" / n).read_bytes() for n in names
    )
    rows = load_prompts(a, require_quoted=True)
    assert [extract_target(r) for r in rows] == ["HOUSE", "RIVER", "CAT", "DOG"]
    assert all(isinstance(r, ImagePrompt) for r in rows)
    assert isinstance(rows[0], ImagePrompt)
    image = np.asarray(Image.open(rows[0].image).convert("RGB"))[None]
    assert "CAT" in RapidOcrEngine().recognize(image)[0].upper().replace(" ", "")


def test_pretrain_textbed_init_starts_from_a_checkpoint(tmp_path):
    """--init loads a textbed checkpoint (bf16 on disk) as the fp32 starting weights, 'bundled' names the committed
    renderer of the architecture, and a checkpoint of another architecture or a folder without one is refused
    before any rendering, naming the field."""
    import dataclasses

    import torch
    from safetensors.torch import load_file

    from fgrpo.models import textbed as tb

    pt = load(ROOT / "experiments" / "pretrain_textbed.py")
    base = pt.tiny()
    torch.manual_seed(1)
    tb.save_textbed(tb.TextbedModel(base.model), tmp_path / "ck")
    cfg = dataclasses.replace(base, init=str(tmp_path / "ck"))
    pt.check_config(cfg)
    saved = load_file(str(tmp_path / "ck" / "model.safetensors"))
    got = pt.build_model(cfg, torch.device("cpu")).state_dict()
    assert got.keys() == saved.keys()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], saved[k].float()) for k in saved)
    torch.manual_seed(1)
    random = pt.build_model(base, torch.device("cpu")).state_dict()
    assert not all(
        torch.equal(random[k], got[k]) for k in saved
    )  # not the random init it was saved from (bf16)

    with pytest.raises(ValueError, match=r"init=.*num_layers=1 there.*--model"):
        pt.check_config(dataclasses.replace(cfg, model=dataclasses.replace(base.model, num_layers=2)))
    with pytest.raises(FileNotFoundError, match="init="):
        pt.check_config(dataclasses.replace(cfg, init=str(tmp_path)))
    pt.check_config(dataclasses.replace(pt.Config(), init="bundled"))  # the committed renderer's architecture
    assert pt.init_folder(dataclasses.replace(base, init="bundled")) == tb.BUNDLED[""]


def test_pretrain_textbed_keeps_the_weights_when_scoring_fails(tmp_path, monkeypatch):
    """The trained weights are on disk (`last/`) before the snapshots are scored, so a run stopped while
    scoring keeps them: the folder holds the last EMA snapshot (bf16 on disk) and loads as a renderer."""
    import dataclasses

    import torch

    from fgrpo.models import textbed as tb

    pt = load(ROOT / "experiments" / "pretrain_textbed.py")
    cfg = dataclasses.replace(pt.tiny(), max_steps=2, out_dir=str(tmp_path / "run"))
    kept = {}
    train = pt.train

    def train_and_keep(c):
        kept["snapshots"] = train(c)
        return kept["snapshots"]

    def scoring_stops(c, snapshots):
        raise KeyboardInterrupt("stopped while scoring")

    monkeypatch.setattr(pt, "train", train_and_keep)
    monkeypatch.setattr(pt, "evaluate", scoring_stops)
    with pytest.raises(KeyboardInterrupt):
        pt.main(cfg)
    model = tb.load_textbed(tmp_path / "run" / "last")
    assert json.loads((tmp_path / "run" / "last" / "config.json").read_text())["pretrain"]["step"] == 2
    last = kept["snapshots"][-1][2]
    got = model.state_dict()
    assert last.keys() == got.keys()
    assert all(torch.equal(got[k].float(), last[k].to(torch.bfloat16).float()) for k in last)


def test_pretrain_textbed_continued_run_keeps_the_init_history(tmp_path):
    """A run that continues a checkpoint records that checkpoint's own pretraining entry under "init" (nested
    again for a third run), so the committed renderer's config.json tells its whole training."""
    import dataclasses

    pt = load(ROOT / "experiments" / "pretrain_textbed.py")
    first = dataclasses.replace(pt.tiny(), max_steps=2, seed=3)
    assert pt.pretrain_record(first, 2, 1.5) == {
        "pretrain": {"seed": 3, "step": 2, "train_seconds": 1.5, "batch_size": first.batch_size}
    }
    from fgrpo.models import textbed as tb

    tb.save_textbed(tb.TextbedModel(first.model), tmp_path / "a", pt.pretrain_record(first, 2, 1.5))
    second = dataclasses.replace(first, init=str(tmp_path / "a"), seed=4)
    rec = pt.pretrain_record(second, 5, 9.0, {"heldout_ocr": 0.5})
    assert rec == {
        "pretrain": {
            "seed": 4,
            "step": 5,
            "train_seconds": 9.0,
            "batch_size": first.batch_size,
            "eval": {"heldout_ocr": 0.5},
            "init": {
                "from": str(tmp_path / "a"),
                "seed": 3,
                "step": 2,
                "train_seconds": 1.5,
                "batch_size": first.batch_size,
            },
        }
    }
    tb.save_textbed(tb.TextbedModel(first.model), tmp_path / "b", rec)
    third = pt.pretrain_record(dataclasses.replace(first, init=str(tmp_path / "b")), 1, 0.5)
    assert third["pretrain"]["init"]["init"]["step"] == 2
    assert json.loads((tmp_path / "b" / "config.json").read_text())["pretrain"] == rec["pretrain"]


def test_pretrain_textbed_lr_decay_reaches_the_loop(capsys):
    """The pretraining loop's LR follows warm-up then linear decay to 0 at max_steps (hand-computed), and
    settings that cannot decay are refused before any rendering."""
    import dataclasses
    import re

    pt = load(ROOT / "experiments" / "pretrain_textbed.py")
    base = pt.tiny()
    cfg = dataclasses.replace(
        base, max_steps=5, optim=dataclasses.replace(base.optim, lr=1e-3, warmup_steps=1, schedule="linear")
    )
    pt.check_config(cfg)
    pt.train(cfg)
    lrs = [float(x) for x in re.findall(r" lr ([0-9.e+-]+) ", capsys.readouterr().out)]
    # step k (0-based): k < 1 warm-up (k+1)/1; then 1 - (k-1)/(5-1)
    assert lrs == pytest.approx([1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4])

    with pytest.raises(ValueError, match="--max-steps"):
        pt.check_config(dataclasses.replace(cfg, max_steps=1))
    with pytest.raises(ValueError, match="optim.schedule"):
        pt.check_config(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, schedule="step")))


PRETRAIN_DRIVER = """
import dataclasses, sys, torch
from fgrpo.scripts import load_script
pt = load_script(sys.argv[1])
cfg = pt.tiny()
cfg = dataclasses.replace(cfg, max_steps=3, optim=dataclasses.replace(cfg.optim, lr=1e-3, warmup_steps=1))
torch.manual_seed(cfg.seed)  # train() seeds the same way before it builds the model: this is its init
init = pt.tb.state_dict_for_save(pt.tb.TextbedModel(cfg.model), torch.float32)
snapshots = pt.train(cfg)
if pt.parallel.rank() == 0:
    torch.save({"init": init, "ema": snapshots[-1][2]}, sys.argv[2])
"""


def test_pretrain_textbed_two_ranks_take_the_steps_of_one(tmp_path):
    import torch

    """Data parallel pretraining: 2 gloo ranks, each on half of the global batch, end on the weights that one
    process reaches with the whole batch (same losses and grad norms in the log; the weights agree up to
    the float summation order of the gradient average)."""
    driver = tmp_path / "driver.py"
    driver.write_text(PRETRAIN_DRIVER)
    script = str(ROOT / "experiments" / "pretrain_textbed.py")
    one = subprocess.run(
        [sys.executable, str(driver), script, str(tmp_path / "one.pt")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(driver),
            script,
            str(tmp_path / "two.pt"),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]

    def steps(out: str) -> list[str]:
        return [line.split(" lr ")[0] for line in out.splitlines() if line.startswith("step ")]

    assert len(steps(one.stdout)) == 3 and steps(two.stdout) == steps(
        one.stdout
    )  # loss and grad norm per step
    one_pt, two_pt = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    a, b, init = one_pt["ema"], two_pt["ema"], one_pt["init"]
    assert a.keys() == b.keys() == init.keys()
    gap = max((a[k] - b[k]).abs().max().item() for k in a)
    moved = max((a[k] - init[k]).abs().max().item() for k in a)
    print(f"one vs two ranks: {gap:.2e}; moved by training: {moved:.2e}")
    assert moved > 1e-3 and gap < 1e-3 * moved, (gap, moved)


def test_ltx2_recipe_matches_verl_omni():
    """verl-omni's LTX-2.3 text-to-audio-video Flow-GRPO LoRA script (examples/flowgrpo_trainer/ltx2/
    run_ltx2_3_t2av_lora.sh): 256x384, 81 frames at 24 fps, 24 steps, CFG 4, CPS noise 0.8 in a 3-step window
    within [0, 10), n=8 clips of 32 prompts in 2 mini-batches of 16, global std, clip 1e-4, adv clip 5, no KL,
    lr 3e-4, wd 1e-4, grad clip 1, r64/a128 on its 28 target modules, 50 validation steps every 20 steps."""
    m = load(ROOT / "experiments" / "ltx2_ocr.py")
    c = m.Config()
    s, g, mc = c.sampling, c.grpo, c.model
    assert (mc.kind, mc.path, mc.num_frames, mc.frame_rate, mc.height, mc.width) == (
        "ltx2",
        "dg845/LTX-2.3-Diffusers",
        81,
        24.0,
        256,
        384,
    )
    assert (s.height, s.width, s.num_steps, s.guidance_scale, s.sde_kind, s.noise_level) == (
        256,
        384,
        24,
        4.0,
        "cps",
        0.8,
    )
    assert (s.window_size, s.window_range) == (3, (0, 10))
    assert (g.group_size, g.prompts_per_step, g.optimizer_steps_per_step, g.adv_std) == (8, 32, 2, "global")
    assert (g.clip_range, g.adv_clip_max, g.kl_coef) == (1e-4, 5.0, 0.0)
    assert (c.optim.lr, c.optim.weight_decay, c.optim.grad_clip) == (3e-4, 1e-4, 1.0)
    assert (mc.lora_rank, mc.lora_alpha, len(mc.lora_target_list), mc.gradient_checkpointing) == (
        64,
        128,
        28,
        True,
    )
    assert (c.run.val_num_steps, c.run.val_every, c.run.ckpt_every, c.num_steps) == (50, 20, 50, 100)
    t = m.tiny()
    assert (t.model.height, t.model.width) == (t.sampling.height, t.sampling.width)


def test_sd3_renderer_gpu_preset_trains_and_reads_like_the_qwen_image_one():
    q = load(ROOT / "experiments" / "qwen_image_ocr.py").tiny_gpu()
    s = load(ROOT / "experiments" / "sd35_ocr.py").tiny_gpu()
    from fgrpo.algorithms import check_config

    check_config(s, world_size=1)
    assert (s.reward, s.optim, s.grpo, s.run, s.num_steps) == (q.reward, q.optim, q.grpo, q.run, q.num_steps)
    assert (s.model.compile, s.model.dtype, s.model.path) == (True, "bf16", "sd3")
    assert s.sampling.micro_batch == 256


def test_flux_recipe_matches_flow_grpo():
    """flow_grpo's `geneval_flux_fast` (config/grpo.py; 32 GPUs x 3 images x 12 batches = 48 prompts x 24 images a
    step, gradient accumulation 6 = 2 updates) with config/base.py's optimizer and scripts/train_flux.py's LoRA:
    512², 6 steps, guidance 3.5 as the embedding, CPS noise 0.8 in a 3-step window within [0, 3), global std,
    clip 1e-5, no KL, lr 3e-4, wd 1e-4, grad clip 1, r64/a128 on its 12 targets, 28 validation steps every 30."""
    m = load(ROOT / "experiments" / "flux_ocr.py")
    c = m.Config()
    s, g, mc = c.sampling, c.grpo, c.model
    assert (mc.kind, mc.path, mc.lora_rank, mc.lora_alpha) == (
        "flux",
        "black-forest-labs/FLUX.1-dev",
        64,
        128,
    )
    assert len(mc.lora_target_list) == 12 and "ff_context.net.2" in mc.lora_target_list
    assert (s.height, s.width, s.num_steps, s.guidance_scale, s.sde_kind, s.noise_level) == (
        512,
        512,
        6,
        3.5,
        "cps",
        0.8,
    )
    assert (s.window_size, s.window_range, g.group_size, g.prompts_per_step, g.optimizer_steps_per_step) == (
        3,
        (0, 3),
        24,
        48,
        2,
    )
    assert (g.adv_std, g.adv_clip_max, g.clip_range, g.kl_coef) == ("global", 5.0, 1e-5, 0.0)
    assert (c.optim.lr, c.optim.weight_decay, c.optim.grad_clip) == (3e-4, 1e-4, 1.0)
    assert (c.run.val_num_steps, c.run.val_every, c.run.ckpt_every, c.reward.name) == (28, 30, 30, "ocr")


def test_flux2_recipe_matches_flow_factory():
    """Flow-Factory's FLUX.2-klein-base GRPO LoRA config (examples/grpo/lora/flux2_klein_base/default.yaml): r64/a128,
    384², 8 steps, CFG 4, Flow-SDE noise 0.7 on one step of [1, 2, 3], 48 prompts x 16 images, 2 gradient steps,
    per-group std, advantages clipped at 5, clip 1e-4, no KL, AdamW 3e-4 / wd 1e-4 / grad clip 1, 28 eval steps."""
    c = load(ROOT / "experiments" / "flux2_ocr.py").Config()
    s, g, mc = c.sampling, c.grpo, c.model
    assert (mc.kind, mc.path, mc.lora_rank, mc.lora_alpha) == (
        "flux2",
        "black-forest-labs/FLUX.2-klein-base-4B",
        64,
        128,
    )
    assert (s.height, s.width, s.num_steps, s.guidance_scale, s.negative_prompt) == (384, 384, 8, 4.0, "")
    assert (s.sde_kind, s.noise_level, s.window_size, s.window_range) == ("flow_sde", 0.7, 1, (1, 4))
    assert (g.group_size, g.prompts_per_step, g.optimizer_steps_per_step) == (16, 48, 2)
    assert (g.adv_std, g.adv_clip_max, g.clip_range, g.kl_coef) == ("group", 5.0, 1e-4, 0.0)
    assert (c.optim.lr, c.optim.weight_decay, c.optim.grad_clip) == (3e-4, 1e-4, 1.0)
    assert (c.run.val_num_steps, c.run.val_every, c.run.ckpt_every, c.reward.name) == (28, 20, 20, "ocr")


def test_flux2_dev_recipe_matches_flow_factory():
    """Flow-Factory's FLUX.2-dev GRPO LoRA config (examples/grpo/lora/flux2/t2i.yaml): klein's recipe but 512²,
    guidance 4 (embedded), Flow-SDE noise 1.0 on one step of [1, 2, 3]; the tiny preset runs the dev tiny model."""
    m = load(ROOT / "experiments" / "flux2_ocr.py")
    c, klein, t = m.dev(), m.Config(), m.dev_tiny()
    s, g, mc = c.sampling, c.grpo, c.model
    assert (mc.kind, mc.path, mc.lora_rank, mc.lora_alpha) == (
        "flux2_dev",
        "black-forest-labs/FLUX.2-dev",
        64,
        128,
    )
    assert mc.lora_targets == klein.model.lora_targets
    assert (s.height, s.width, s.num_steps, s.guidance_scale) == (512, 512, 8, 4.0)
    assert (s.sde_kind, s.noise_level, s.window_size, s.window_range) == ("flow_sde", 1.0, 1, (1, 4))
    assert (g.group_size, g.prompts_per_step, g.optimizer_steps_per_step) == (16, 48, 2)
    assert (g.adv_std, g.adv_clip_max, g.clip_range, g.kl_coef) == ("group", 5.0, 1e-4, 0.0)
    assert (c.optim.lr, c.optim.weight_decay, c.optim.grad_clip) == (3e-4, 1e-4, 1.0)
    assert (c.run.val_num_steps, c.run.val_every, c.run.ckpt_every) == (28, 20, 20)
    assert (t.model.kind, t.device, t.sampling.height, t.sampling.noise_level) == (
        "tiny_flux2_dev",
        "cpu",
        64,
        1.0,
    )
    from fgrpo.algorithms import check_config

    check_config(c, world_size=1)
    check_config(t, world_size=1)


def test_zimage_recipe_matches_flow_factory():
    """Flow-Factory's Z-Image GRPO LoRA config (examples/grpo/lora/z_image/default.yaml) on the base model: 512², 10
    steps, its CFG 4.0 (pos + 4 (pos - neg), our 5.0), Flow-SDE noise 0.7 on one step of 1-3, 48 prompts x 16 images,
    2 updates, per-group std, advantages clipped at 5, clip 1e-4, no KL, lr 3e-4, wd 1e-4, grad clip 1, r64/a128 on
    its default targets (every block's attention and feed-forward), 40 validation steps every 40."""
    c = load(ROOT / "experiments" / "zimage_ocr.py").Config()
    s, g, mc, o = c.sampling, c.grpo, c.model, c.optim
    assert (mc.kind, mc.path, mc.lora_rank, mc.lora_alpha) == ("zimage", "Tongyi-MAI/Z-Image", 64, 128)
    assert len(mc.lora_target_list) == 7 and "feed_forward.w3" in mc.lora_target_list
    assert (s.height, s.width, s.num_steps, s.guidance_scale, s.sde_kind, s.noise_level) == (
        512, 512, 10, 5.0, "flow_sde", 0.7,
    )  # fmt: skip
    assert (s.window_size, s.window_range, g.group_size, g.prompts_per_step, g.optimizer_steps_per_step) == (
        1, (1, 4), 16, 48, 2,
    )  # fmt: skip
    assert (g.adv_std, g.adv_clip_max, g.clip_range, g.kl_coef) == ("group", 5.0, 1e-4, 0.0)
    assert (o.lr, o.weight_decay, o.grad_clip) == (3e-4, 1e-4, 1.0)
    assert (c.run.val_every, c.run.val_num_steps, c.run.ckpt_every) == (40, 40, 40)


def test_wan_recipe_matches_flow_factory():
    """Flow-Factory's Wan 2.2 text-to-video GRPO LoRA config (examples/grpo/lora/wan22_t2v.yaml), on the TI2V-5B:
    256², 41 frames, 10 steps, CFG 5, Flow-SDE noise 0.9 on one step of steps 1-3, 16 clips of 48 prompts in 2
    gradient steps, per-group std, clip 1e-4, adv clip 5, lr 1e-4, wd 1e-4, grad clip 1, r64/a128 on attention and
    FFN, 28 validation steps every 20 steps."""
    c = load(ROOT / "experiments" / "wan_video_ocr.py").Config()
    s, g, mc = c.sampling, c.grpo, c.model
    assert (mc.kind, mc.path, mc.num_frames) == ("wan", "Wan-AI/Wan2.2-TI2V-5B-Diffusers", 41)
    assert (s.height, s.width, s.num_steps, s.guidance_scale, s.sde_kind, s.noise_level) == (
        256,
        256,
        10,
        5.0,
        "flow_sde",
        0.9,
    )
    assert (s.window_size, s.window_range) == (1, (1, 4))
    assert (g.group_size, g.prompts_per_step, g.optimizer_steps_per_step, g.adv_std) == (16, 48, 2, "group")
    assert (g.clip_range, g.adv_clip_max, g.kl_coef) == (1e-4, 5.0, 0.0)
    assert (c.optim.lr, c.optim.weight_decay, c.optim.grad_clip) == (1e-4, 1e-4, 1.0)
    assert (mc.lora_rank, mc.lora_alpha, len(mc.lora_target_list), mc.gradient_checkpointing) == (
        64,
        128,
        10,
        True,
    )
    assert (c.run.val_num_steps, c.run.val_every) == (28, 20)
