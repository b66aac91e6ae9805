"""No run loses or mixes data: the run directory's rules, non-finite rewards, resume with changed settings,
the metrics row before its checkpoint, a LoRA to start from. In-process tiny runs (tests/train_entry.py)."""

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from train_entry import Config

from fgrpo import checkpoint, runs
from fgrpo import train as train_mod
from fgrpo.config import validate_config
from fgrpo.errors import ConfigError
from fgrpo.logging import read_metrics
from fgrpo.models.lora import export_lora
from fgrpo.rewards.base import RewardOutput, check_scores
from fgrpo.runs import RunDir, RunDirError


def cfg_for(tmp_path, **run_changes):
    c = Config()
    return dataclasses.replace(
        c, num_steps=2, run=dataclasses.replace(c.run, out_dir=str(tmp_path), **run_changes)
    )


def rows(tmp_path):
    return read_metrics(Path(tmp_path) / "e2e" / "metrics.jsonl")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished 2-step run (checkpoints at steps 1 and 2); tests work on copies of it."""
    out = tmp_path_factory.mktemp("finished")
    train_mod.train(cfg_for(out))
    return out


@pytest.fixture
def done(finished, tmp_path):
    shutil.copytree(finished / "e2e", tmp_path / "e2e")
    return tmp_path


def test_fresh_run_refuses_a_used_directory_and_leaves_it_alone(done):
    tmp_path = done
    before = (tmp_path / "e2e" / "metrics.jsonl").read_text()
    ckpts = checkpoint.list_checkpoints(tmp_path / "e2e" / "checkpoints")
    with pytest.raises(RunDirError, match=r"--run.resume auto.*--run.overwrite"):
        train_mod.train(dataclasses.replace(cfg_for(tmp_path), seed=7))
    assert (tmp_path / "e2e" / "metrics.jsonl").read_text() == before
    assert checkpoint.list_checkpoints(tmp_path / "e2e" / "checkpoints") == ckpts


def test_overwrite_moves_the_old_run_aside(done):
    tmp_path = done
    old_rows = rows(tmp_path)
    d = RunDir(tmp_path / "e2e")
    assert (
        d.start(dataclasses.replace(cfg_for(tmp_path, overwrite=True), seed=7), is_main=True, say=print)
        is None
    )
    d.unlock()
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("e2e.old-")]
    assert len(moved) == 1
    assert read_metrics(moved[0] / "metrics.jsonl") == old_rows  # the old run, untouched
    assert len(checkpoint.list_checkpoints(moved[0] / "checkpoints")) == 2
    assert d.holds_a_run() == []  # a fresh directory for the new run


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from fgrpo.runs import RunDir; from pathlib import Path; "
            "RunDir(Path(sys.argv[1])).lock(); print('locked', flush=True); time.sleep(60)",
            str(tmp_path / "e2e"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None  # stdout=PIPE
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=rf"in use by pid {holder.pid}"):
            RunDir(tmp_path / "e2e").lock()
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.05)
    d = RunDir(tmp_path / "e2e")
    d.lock()  # the kernel released the dead holder's lock
    d.unlock()


def test_resume_refuses_a_changed_training_field_and_applies_bookkeeping_ones(done, capsys):
    tmp_path = done
    recorded = (tmp_path / "e2e" / "config.json").read_text()
    changed = dataclasses.replace(
        cfg_for(tmp_path, resume="auto"), optim=dataclasses.replace(Config().optim, lr=1e-6)
    )
    with pytest.raises(RunDirError, match=r"optim\.lr: 0\.03 -> 1e-06"):
        train_mod.train(changed)
    assert (tmp_path / "e2e" / "config.json").read_text() == recorded  # the record still matches the run
    longer = dataclasses.replace(cfg_for(tmp_path, resume="auto"), num_steps=3)
    train_mod.train(longer)
    assert "resume: num_steps 2 -> 3" in capsys.readouterr().out
    assert [r["step"] for r in rows(tmp_path)] == [0, 1, 2]
    assert json.loads((tmp_path / "e2e" / "config.json").read_text())["num_steps"] == 3


def test_resume_refuses_a_reward_service_that_serves_another_reward(done):
    """reward.url may change on resume (another port or host), the reward may not: the run records the one it
    trains on (reward.name, or what a service names in /health) and a resume compares."""
    from rewards.helpers import serve_in_thread

    from fgrpo.rewards import build_reward
    from fgrpo.rewards.serve import make_app

    tmp_path = done
    record = tmp_path / "e2e" / "reward.json"
    assert json.loads(record.read_text()) == {"reward": "jpeg_compressibility"}  # trained locally
    apps = [make_app(build_reward(n), n) for n in ("jpeg_incompressibility", "jpeg_compressibility")]
    with serve_in_thread(apps[0]) as other, serve_in_thread(apps[1]) as same:
        c = cfg_for(tmp_path, resume="auto")
        for url in (other, same):
            resumed = dataclasses.replace(c, num_steps=3, reward=dataclasses.replace(c.reward, url=url))
            if url == other:
                with pytest.raises(RunDirError, match=r"'jpeg_compressibility'.*'jpeg_incompressibility'"):
                    train_mod.train(resumed)
            else:
                train_mod.train(resumed)  # the same reward, served
    assert [r["step"] for r in rows(tmp_path)] == [0, 1, 2]
    # one reward in any spelling of its spec; a run without a record (an older one) records the current one
    runs.check_reward(tmp_path / "e2e", '{ "name": "jpeg_compressibility" }', resumed=True, write=True)
    record.unlink()
    runs.check_reward(tmp_path / "e2e", "ocr", resumed=True, write=True)
    assert json.loads(record.read_text()) == {"reward": "ocr"}


def test_a_resumed_run_keeps_no_optimizer_state_for_parameters_without_gradients(done):
    """The last block's text-stream LoRA (to_add_out, txt_mlp) of a Qwen-Image-like model never gets a gradient
    (nothing reads that block's text output): no optimizer state before the resume, none after it either."""
    from safetensors.torch import load_file

    train_mod.train(dataclasses.replace(cfg_for(done, resume="auto"), num_steps=3))
    ckpts = done / "e2e" / "checkpoints"
    keys = [set(load_file(str(ckpts / f"step_00000{s}" / "optimizer.safetensors"))) for s in (2, 3)]
    assert keys[0] == keys[1]
    assert not any("transformer_blocks.1.txt_mlp" in k for k in keys[1])  # the tiny model's last block


def test_resume_auto_without_a_checkpoint_says_so_and_keeps_one_row_per_step(tmp_path, capsys):
    run_dir = tmp_path / "e2e"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        '{"step": 0, "reward/mean": 1.0}\n{"step": 1, "reward/me'
    )  # died mid-row
    train_mod.train(cfg_for(tmp_path, resume="auto"))
    assert "no complete checkpoint" in capsys.readouterr().out
    assert [r["step"] for r in rows(tmp_path)] == [0, 1]


def test_resume_falls_back_past_a_corrupt_checkpoint(done):
    tmp_path = done
    newest = checkpoint.latest(tmp_path / "e2e" / "checkpoints")
    assert newest is not None
    data = (newest / "model.safetensors").read_bytes()
    (newest / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.warns(UserWarning, match="step_000002"):
        path = RunDir(tmp_path / "e2e").start(cfg_for(tmp_path, resume="auto"), is_main=True, say=print)
    assert path is not None and path.name == "step_000001"
    RunDir(tmp_path / "e2e").unlock()
    # the skipped checkpoint is set aside: the run redoes step 2, and keep_last must not keep the damaged one
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / "e2e" / "checkpoints")] == [1]
    assert [p.name.split(".")[0] for p in (tmp_path / "e2e" / "stale_checkpoints").iterdir()] == [
        "step_000002"
    ]


def test_a_longer_resume_with_a_decaying_lr_is_refused(tmp_path):
    """num_steps may grow on resume, except when the lr decays over the run: every later lr would change."""
    c = Config()
    recorded = dataclasses.replace(c, optim=dataclasses.replace(c.optim, schedule="linear"))
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(c)))
    RunDir(tmp_path).check_config(
        dataclasses.replace(c, num_steps=c.num_steps + 1), say=print
    )  # constant: fine
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(recorded)))
    with pytest.raises(RunDirError, match=r"num_steps: 3 -> 4.*--optim.decay-steps"):
        RunDir(tmp_path).check_config(dataclasses.replace(recorded, num_steps=4), say=print)


def test_resuming_a_finished_run_keeps_its_final_validation_row(done):
    tmp_path = done
    with open(tmp_path / "e2e" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "val/reward_mean": 0.5}) + "\n")  # what the final validation logs
    train_mod.train(cfg_for(tmp_path, resume="auto"))
    assert [r["step"] for r in rows(tmp_path)] == [0, 1, 2]


def test_metrics_row_is_written_before_the_checkpoint_that_claims_the_step(tmp_path, monkeypatch):
    def crash(*a, **k):
        raise KeyboardInterrupt("killed while checkpointing")

    monkeypatch.setattr(train_mod.checkpoint, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train(cfg_for(tmp_path))
    assert [r["step"] for r in rows(tmp_path)] == [0]


class NanReward:
    def __call__(self, images, prompts, metadata=None):
        s = np.ones(len(prompts), dtype=np.float32)
        s[1] = np.nan
        return RewardOutput(scores=s)


def test_non_finite_reward_stops_the_run_naming_reward_and_prompt(tmp_path, monkeypatch):
    monkeypatch.setattr(train_mod, "build_reward", lambda spec: NanReward())
    with pytest.raises(
        ValueError, match=r"reward 'jpeg_compressibility' returned a non-finite score \(nan\) for prompt"
    ):
        train_mod.train(cfg_for(tmp_path))
    assert not checkpoint.list_checkpoints(tmp_path / "e2e" / "checkpoints")  # nothing saved as if trained


def test_check_scores_shape_and_values():
    check_scores(RewardOutput(scores=np.array([0.5, 1.0], dtype=np.float32)), ["a", "b"], "r")
    with pytest.raises(ValueError, match=r"for prompt 'b' \(1 of 2"):
        check_scores(RewardOutput(scores=np.array([0.5, np.inf], dtype=np.float32)), ["a", "b"], "r")
    with pytest.raises(ValueError, match="shape"):
        check_scores(RewardOutput(scores=np.zeros(3, dtype=np.float32)), ["a", "b"], "r")


def test_steps_that_skip_every_update_stop_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(
        torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: torch.tensor(float("nan"))
    )
    cfg = dataclasses.replace(cfg_for(tmp_path, max_bad_steps=2), num_steps=4)
    with pytest.raises(FloatingPointError, match="2 steps in a row"):
        train_mod.train(cfg)


def test_config_changes_lists_every_differing_field():
    a = runs.flat_config(Config())
    b = runs.flat_config(
        dataclasses.replace(Config(), seed=5, grpo=dataclasses.replace(Config().grpo, clip_range=0.1))
    )
    assert runs.config_changes(a, b) == {"grpo.clip_range": (0.2, 0.1), "seed": (0, 5)}
    assert (
        runs.config_changes(a, runs.flat_config(json.loads(json.dumps(dataclasses.asdict(Config()))))) == {}
    )


def test_init_lora_starts_from_an_exported_adapter(tmp_path):
    """An adapter fgrpo exported loads back bit for bit as the starting LoRA; a rank mismatch names the flag."""
    from fgrpo.models.lora import setup_trainable
    from fgrpo.models.registry import build_model

    mcfg = Config().model
    a = build_model(mcfg, torch.device("cpu"), seed=0)
    setup_trainable(a.transformer, mcfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in a.transformer.named_parameters():
            if "lora_" in n:
                p.normal_()
    export_lora(tmp_path / "lora", a.transformer)
    b = build_model(mcfg, torch.device("cpu"), seed=0)
    setup_trainable(b.transformer, dataclasses.replace(mcfg, init_lora=str(tmp_path / "lora")))
    pa = {n: p for n, p in a.transformer.named_parameters() if "lora_" in n}
    pb = {n: p for n, p in b.transformer.named_parameters() if "lora_" in n}
    assert pa.keys() == pb.keys() and len(pa) > 0
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert all(pb[n].requires_grad and pb[n].dtype == torch.float32 for n in pb)
    c = build_model(mcfg, torch.device("cpu"), seed=0)
    with pytest.raises(ValueError, match="--model.lora-rank 4 --model.lora-alpha 8"):
        setup_trainable(
            c.transformer, dataclasses.replace(mcfg, lora_rank=8, init_lora=str(tmp_path / "lora"))
        )
    c = build_model(mcfg, torch.device("cpu"), seed=0)
    with pytest.raises(FileNotFoundError, match="model.init_lora"):
        setup_trainable(c.transformer, dataclasses.replace(mcfg, init_lora=str(tmp_path / "nothing")))


def test_init_lora_is_checked_before_the_model_and_a_non_finite_weight_is_refused(tmp_path):
    """The path and the header's rank are checked before the model is built (a real model takes minutes to
    load); a NaN in the adapter, which would skip every optimizer step, is refused at load naming the tensor."""
    from fgrpo.models.lora import setup_trainable
    from fgrpo.models.registry import build_model

    def no_model(*a, **k):
        raise AssertionError("the model was built before model.init_lora was checked")

    c = cfg_for(tmp_path)
    for init, lora_rank, match in (
        (tmp_path / "nothing", 4, "model.init_lora: no LoRA at"),
        (tmp_path / "lora", 8, "--model.lora-rank 4 --model.lora-alpha 8"),
    ):
        mcfg = dataclasses.replace(c.model, init_lora=str(init), lora_rank=lora_rank)
        if lora_rank == 8:  # an adapter of rank 4 on disk
            a = build_model(c.model, torch.device("cpu"), seed=0)
            setup_trainable(a.transformer, c.model)
            export_lora(tmp_path / "lora", a.transformer)
        with pytest.raises((FileNotFoundError, ValueError), match=match):
            train_mod.train(dataclasses.replace(c, model=mcfg), model_builder=no_model)
        assert not (tmp_path / "e2e").exists()  # before the run directory, too
    a = build_model(c.model, torch.device("cpu"), seed=0)
    setup_trainable(a.transformer, c.model)
    name = next(n for n, _ in a.transformer.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        a.transformer.get_parameter(name)[0, 0] = float("nan")
    export_lora(tmp_path / "nan", a.transformer)
    mcfg = dataclasses.replace(c.model, init_lora=str(tmp_path / "nan"))
    b = build_model(mcfg, torch.device("cpu"), seed=0)
    key = name.replace(".default.", ".")
    with pytest.raises(ValueError, match=rf"nan/adapter_model.safetensors' tensor {key} holds 1 non-finite"):
        setup_trainable(b.transformer, mcfg)


def test_a_wrong_reward_url_fails_before_the_model_is_built(tmp_path, monkeypatch):
    """--reward.url is checked with the service's /health before any model work (a closed local port here)."""
    from fgrpo.rewards.client import RewardServiceError

    def no_model(*a, **k):
        raise AssertionError("the model was built before the reward service was checked")

    monkeypatch.setattr(train_mod, "build_model", no_model)
    c = cfg_for(tmp_path)
    cfg = dataclasses.replace(c, reward=dataclasses.replace(c.reward, url="http://127.0.0.1:9"))
    t0 = time.perf_counter()
    with pytest.raises(RewardServiceError, match="127.0.0.1:9 is not up"):
        train_mod.train(cfg)
    assert time.perf_counter() - t0 < 30


# ---------------------------------------------------------------------------------------------------------
# run names, nested runs, resumes from elsewhere, lost rows, unrecorded configs and data, unreadable files


@pytest.mark.parametrize("name", [".", "..", "a/b", "/abs/e2e", "..\\x", " e2e", "e2e\n"])
def test_exp_name_must_be_one_plain_directory_name(name):
    with pytest.raises(ConfigError, match=r"exp_name .* --exp-name NAME"):
        validate_config(dataclasses.replace(Config(), exp_name=name), 1)


def test_resume_from_other_needs_a_checkpoint_path():
    c = Config()
    for resume in ("", "auto"):
        cfg = dataclasses.replace(c, run=dataclasses.replace(c.run, resume=resume, resume_from_other=True))
        with pytest.raises(ConfigError, match=r"run.resume_from_other needs --run.resume <checkpoint"):
            validate_config(cfg, 1)


def test_an_empty_exp_name_is_refused_before_anything_is_created(tmp_path):
    """An empty name made out_dir itself the run directory, which `--run.overwrite` then moved whole."""
    with pytest.raises(ConfigError, match=r"exp_name '' must be one plain directory name"):
        train_mod.train(dataclasses.replace(cfg_for(tmp_path / "out"), exp_name=""))
    assert not (tmp_path / "out").exists()


def test_overwrite_refuses_to_move_a_live_run_below_it(done):
    """A run whose directory sits inside the one to move would go on writing half into the moved tree."""
    tmp_path = done
    inner = RunDir(tmp_path / "e2e" / "inner")
    inner.lock()
    try:
        with pytest.raises(RunDirError, match=rf"e2e/inner inside .* is a live run \(pid {os.getpid()} "):
            RunDir(tmp_path / "e2e").start(cfg_for(tmp_path, overwrite=True), is_main=True, say=print)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["e2e"]  # nothing moved
        assert len(checkpoint.list_checkpoints(tmp_path / "e2e" / "checkpoints")) == 2
    finally:
        inner.unlock()
    d = RunDir(tmp_path / "e2e")
    d.start(cfg_for(tmp_path, overwrite=True), is_main=True, say=print)  # the inner run ended: it may move
    d.unlock()
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("e2e.old-")]
    assert (moved / "inner" / ".lock").is_file()


def test_resume_from_another_runs_checkpoint_needs_the_flag(done, finished):
    tmp_path = done
    shutil.copytree(finished / "e2e", tmp_path / "other")
    theirs = tmp_path / "other" / "checkpoints" / "step_000001"
    cfg = cfg_for(tmp_path, resume=str(theirs))
    d = RunDir(tmp_path / "e2e")
    with pytest.raises(RunDirError, match=r"another run directory .* --run.resume-from-other"):
        d.start(cfg, is_main=True, say=print)
    d.unlock()
    assert [s for s, _ in checkpoint.list_checkpoints(d.checkpoints)] == [1, 2]  # untouched
    assert not (d.path / "stale_checkpoints").exists()
    # Into a new directory it is a fork and needs no flag.
    fork = RunDir(tmp_path / "fork")
    assert fork.start(cfg, is_main=True, say=print) == theirs
    fork.unlock()
    # With the flag, every checkpoint of this run from that step on is set aside (auto must never pick them).
    with pytest.warns(UserWarning, match="stale_checkpoints"):
        got = d.start(cfg_for(tmp_path, resume=str(theirs), resume_from_other=True), is_main=True, say=print)
    d.unlock()
    assert got == theirs
    assert checkpoint.list_checkpoints(d.checkpoints) == []
    assert sorted(p.name.split(".")[0] for p in (d.path / "stale_checkpoints").iterdir()) == [
        "step_000001",
        "step_000002",
    ]


def test_a_resume_moves_the_rows_it_redoes_to_a_side_file(done):
    """Resuming at step 1 redoes step 1: its old row was deleted for good; now it moves, tagged."""
    tmp_path = done
    old = rows(tmp_path)
    ckpt = tmp_path / "e2e" / "checkpoints" / "step_000001"
    train_mod.train(cfg_for(tmp_path, resume=str(ckpt)))
    assert [r["step"] for r in rows(tmp_path)] == [0, 1]
    (moved,) = read_metrics(tmp_path / "e2e" / "metrics.superseded.jsonl")
    tag = moved.pop("superseded")
    assert moved == old[1]
    assert "step_000001" in tag["why"] and abs(tag["time"] - time.time()) < 600


def test_a_metrics_line_that_is_not_an_object_is_skipped_with_a_warning(done):
    """A valid-JSON line such as `42` stopped every resume with an AttributeError after the checkpoint load."""
    tmp_path = done
    path = tmp_path / "e2e" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "42", *lines[1:]]) + "\n")
    with pytest.warns(
        UserWarning, match=r"metrics.jsonl: skipped 1 line\(s\) that are not a JSON object \(line 2\)"
    ):
        train_mod.train(dataclasses.replace(cfg_for(tmp_path, resume="auto"), num_steps=3))
    assert [r["step"] for r in rows(tmp_path)] == [0, 1, 2]


def test_resume_without_config_json_is_refused(done):
    """Without config.json a resume could change lr or clip range unseen, and the new file would claim them."""
    tmp_path = done
    (tmp_path / "e2e" / "config.json").unlink()
    changed = dataclasses.replace(
        cfg_for(tmp_path, resume="auto"), optim=dataclasses.replace(Config().optim, lr=1e-6)
    )
    d = RunDir(tmp_path / "e2e")
    with pytest.raises(RunDirError, match=r"e2e/config.json is missing.*restore it"):
        d.start(changed, is_main=True, say=print)
    d.unlock()


def test_resume_refuses_a_changed_prompt_file(tmp_path):
    train_file, val_file = tmp_path / "train.txt", tmp_path / "val.txt"
    train_file.write_text("a red cube\na blue ball\na green cone\na tall tree\n")
    val_file.write_text("a cat\na dog\na bird\na fish\n")
    c = cfg_for(tmp_path)
    cfg = dataclasses.replace(
        c,
        num_steps=1,
        data=dataclasses.replace(c.data, train_prompts=str(train_file), val_prompts=str(val_file)),
    )
    train_mod.train(cfg)
    recorded = json.loads((tmp_path / "e2e" / "config.json").read_text())["data_files"]
    sha = hashlib.sha256(train_file.read_bytes()).hexdigest()
    assert recorded["data.train_prompts"] == {"path": str(train_file), "sha256": sha}
    assert recorded["data.val_prompts"]["sha256"] == hashlib.sha256(val_file.read_bytes()).hexdigest()
    resume = dataclasses.replace(cfg, num_steps=2, run=dataclasses.replace(cfg.run, resume="auto"))
    d = RunDir(tmp_path / "e2e")
    assert d.start(resume, is_main=True, say=print) is not None  # unchanged: fine
    d.unlock()
    train_file.write_text("a red cube\na blue ball\na green cone\na short tree\n")
    with pytest.raises(
        RunDirError, match=r"data.train_prompts file .*train.txt changed since the run recorded"
    ):
        d.start(resume, is_main=True, say=print)
    d.unlock()


def test_a_resume_runs_the_final_validation_a_kill_cut_short(tmp_path, monkeypatch):
    """A kill during the final validation left no final row; the resume saw step == num_steps and skipped it."""
    cfg = cfg_for(tmp_path, val_every=1, val_num_steps=2)
    real, finals = train_mod.validate, []

    def killed_at_the_final(*args, **kwargs):
        out = real(*args, **kwargs)
        if args[6] == cfg.num_steps:  # the step argument
            finals.append(out)
            raise KeyboardInterrupt("killed during the final validation")
        return out

    monkeypatch.setattr(train_mod, "validate", killed_at_the_final)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train(cfg)
    assert [r["step"] for r in rows(tmp_path) if "val/reward_mean" in r] == [0, 1]
    assert not (tmp_path / "e2e" / "lora").exists()
    monkeypatch.setattr(train_mod, "validate", real)
    train_mod.train(cfg_for(tmp_path, val_every=1, val_num_steps=2, resume="auto"))
    final = [r for r in rows(tmp_path) if r["step"] == 2 and "val/reward_mean" in r]
    assert [r["val/reward_mean"] for r in final] == [finals[0]["val/reward_mean"]]  # the same weights' score
    assert (tmp_path / "e2e" / "lora").is_dir()
    # Resumed once more, the finished run has its final row and validates nothing again.
    train_mod.train(cfg_for(tmp_path, val_every=1, val_num_steps=2, resume="auto"))
    assert len([r for r in rows(tmp_path) if r["step"] == 2]) == 1


def test_a_config_json_that_is_not_json_is_named(done):
    tmp_path = done
    path = tmp_path / "e2e" / "config.json"
    path.write_text(path.read_text()[:100])  # truncated
    d = RunDir(tmp_path / "e2e")
    with pytest.raises(RunDirError, match=r"e2e/config.json is not valid JSON \(.*\); restore it"):
        d.start(cfg_for(tmp_path, resume="auto"), is_main=True, say=print)
    d.unlock()


def test_an_unusable_out_dir_names_the_field(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(RunDirError, match=r"--run.out-dir '.*a_file': cannot create .*give --run.out-dir"):
        train_mod.train(cfg_for(tmp_path / "a_file"))

    def read_only(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(RunDirError, match=r"--run.out-dir .*\(Read-only file system\)"):
        RunDir(tmp_path / "ro" / "e2e").lock()


def test_save_run_metadata(tmp_path):
    @dataclass
    class Inner:
        lr: float = 3e-4
        path: object = field(default_factory=lambda: tmp_path)

    @dataclass
    class Cfg:
        exp_name: str = "demo"
        inner: Inner = field(default_factory=Inner)

    src = tmp_path / "exp_file.py"
    src.write_text("print('hi')\n")
    run = runs.save_run_metadata(tmp_path / "run", Cfg(), src)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg == {"exp_name": "demo", "inner": {"lr": 3e-4, "path": str(tmp_path)}}
    assert (run / "exp_file.py").read_text() == "print('hi')\n"
    assert "argv" in json.loads((run / "run_meta.json").read_text())
    runs.save_run_metadata(tmp_path / "run2", {"a": 1}, "import os\nprint(os)\n")
    assert (tmp_path / "run2" / "experiment.py").read_text() == "import os\nprint(os)\n"
