"""Trainer options that must leave the numbers alone, against today's path (full FSDP2 sharding, full activation
checkpointing): parallel.shard='adapters' (only the LoRA sharded, the frozen base replicated) and
model.checkpoint_policy='selective' (backward recomputes the pointwise ops only). Tiny random Qwen-Image on the
CPU: the adapter after every optimizer step, the rollout's log-probs, the first update's log-prob gap and a
checkpoint resume are equal bit for bit (tests/train_options_entry.py), at world size 1 and on 2 gloo ranks."""

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Literal

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from train_entry import Config
from train_options_entry import report

from fgrpo import checkpoint, files, parallel
from fgrpo import train as train_mod
from fgrpo.config import validate_config
from fgrpo.models.loading import configure_transformer, selective_checkpoint
from fgrpo.models.lora import MergedLora, add_lora
from fgrpo.models.tiny import tiny_qwen_image

ENTRY = str(Path(__file__).with_name("train_options_entry.py"))


def _assert_same_as_today(r: dict, variants: list[str]) -> None:
    assert r["moved"] > 1e-2  # the two steps moved the adapter by ~lr: equality is not vacuous
    assert r["today_gaps"] == [0.0, 0.0]
    for v in variants:
        got = r[v]
        assert got["optimizer_steps"] == 4
        assert got["lora_diff_per_optimizer_step"] == [0.0] * 5, v  # the init, then each optimizer step
        assert got["log_prob_diff"] == [0.0, 0.0], v  # both rollouts
        assert got["gaps"] == [0.0, 0.0], v  # rollout log-prob = the first update's, each step
        assert got["resume_diff"] == [0.0] * 3, v  # step 2 after a load of the step-1 checkpoint
        assert got["trainable_dtensors"] == 48  # 12 LoRA targets x (A, B) x 2 blocks, all sharded
        replicated = v.startswith("adapters")
        assert got["frozen_dtensors"] == (0 if replicated else got["frozen"]), v


def test_adapters_sharding_and_selective_checkpointing_equal_today_on_one_rank(tmp_path):
    parallel.init_distributed("cpu")
    _assert_same_as_today(report("fp32", ["adapters", "selective"], tmp_path), ["adapters", "selective"])


@pytest.mark.slow
def test_adapters_sharding_and_selective_checkpointing_equal_today_on_two_ranks(tmp_path):
    """2 gloo ranks, fp32 and bf16 (the GPU recipe's dtypes: bf16 base and compute, fp32 masters and gradient
    reduction); each rank's own report."""
    out = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(29500 + (os.getpid() + 500) % 1000),
        ENTRY,
        str(out),
    ]
    env = dict(os.environ)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for r in ranks:
        for dtype in ("fp32", "bf16"):
            _assert_same_as_today(r[dtype], ["adapters", "selective", "adapters_selective"])


def test_the_loop_passes_both_options_on(tmp_path, monkeypatch):
    """train() shards as parallel.shard says and checkpoints as model.checkpoint_policy says; its checkpoint
    equals today's and the first update's log-prob gap is 0."""
    seen = []
    shard = parallel.shard_transformer

    def spy(transformer, **kw):
        seen.append((kw["shard"], transformer._gradient_checkpointing_func))
        return shard(transformer, **kw)

    monkeypatch.setattr(train_mod.parallel, "shard_transformer", spy)
    c = Config()
    runs = {}
    for name, shard_mode, policy in (("today", "full", "full"), ("options", "adapters", "selective")):
        cfg = dataclasses.replace(
            c,
            num_steps=1,
            model=dataclasses.replace(c.model, gradient_checkpointing=True, checkpoint_policy=policy),
            parallel=dataclasses.replace(c.parallel, shard=shard_mode),
            run=dataclasses.replace(c.run, out_dir=str(tmp_path / name)),
        )
        m = train_mod.train(cfg)
        assert m["train/logprob_gap/max"] == 0.0
        runs[name] = files.read_tensors(
            checkpoint.resolve(tmp_path / name / "e2e" / "checkpoints") / "model.safetensors"
        )

    assert seen[0][0] == "full" and seen[0][1] is not selective_checkpoint
    assert seen[1] == ("adapters", selective_checkpoint)
    assert runs["today"].keys() == runs["options"].keys()
    assert all(torch.equal(runs["today"][k], runs["options"][k]) for k in runs["today"])


def test_validation_scores_with_its_own_reward(tmp_path):
    """reward.val_name: the validation reads its own reward and training the other. A run trained on JPEG
    compressibility (-kB / 500) and validated on incompressibility (+kB / 500) logs, at every validation, the
    exact negative of the same run validated on compressibility (the validation's prompts and seeds are fixed,
    so the images are the same), and the same training rewards and loss."""
    from fgrpo.logging import read_metrics

    c = Config()
    rows = {}
    for name, val_name in (("same", ""), ("own", "jpeg_incompressibility")):
        cfg = dataclasses.replace(
            c,
            num_steps=1,
            reward=dataclasses.replace(c.reward, val_name=val_name),
            run=dataclasses.replace(c.run, out_dir=str(tmp_path / name), val_every=1),
        )
        train_mod.train(cfg)
        rows[name] = read_metrics(tmp_path / name / "e2e" / "metrics.jsonl")

    def logged(name: str, key: str) -> list[float]:
        return [r[key] for r in rows[name] if r.get(key) is not None]

    same = logged("same", "val/reward_mean")
    assert len(same) == 2 and all(v < 0 for v in same)  # step 0 and the final validation
    assert logged("own", "val/reward_mean") == [-v for v in same]
    for key in ("reward/mean", "train/loss"):
        assert logged("own", key) == logged("same", key) and logged("same", key)


def test_validation_scores_in_its_own_worker_count(tmp_path, monkeypatch):
    """reward.val_workers: the training reward scores in this process (workers 0, as a GPU reader must) while
    the validation's reward is scored by a pool of its own size; -1 (the default) keeps reward.workers for both,
    and a run's numbers are the same either way."""
    from fgrpo.logging import read_metrics

    pools = []

    class Pool:  # ParallelReward's interface, scored here (a spawned pool would only cost time)
        def __init__(self, spec, workers):
            pools.append((spec, workers))
            self.reward = train_mod.build_reward(spec)

        def __call__(self, images, prompts, metadata=None):
            return self.reward(images, prompts, metadata)

    monkeypatch.setattr(train_mod, "ParallelReward", Pool)
    c = Config()
    rows = {}
    for name, workers, val_workers in (("default", 0, -1), ("own", 0, 3)):
        cfg = dataclasses.replace(
            c,
            num_steps=1,
            reward=dataclasses.replace(c.reward, workers=workers, val_workers=val_workers),
            run=dataclasses.replace(c.run, out_dir=str(tmp_path / name), val_every=1),
        )
        train_mod.train(cfg)
        rows[name] = read_metrics(tmp_path / name / "e2e" / "metrics.jsonl")
    assert pools == [(c.reward.spec, 3)]  # only the second run's validation got a pool, of its own size
    for key in ("val/reward_mean", "reward/mean", "train/loss"):
        got = [[r[key] for r in rows[n] if r.get(key) is not None] for n in ("default", "own")]
        assert got[0] == got[1] and got[0]
    bad = dataclasses.replace(c, reward=dataclasses.replace(c.reward, val_workers=-2))
    with pytest.raises(ValueError, match="reward.val_workers"):
        validate_config(bad, 1)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(checkpointing: bool, policy: Literal["full", "selective"]) -> Counter:
    torch.manual_seed(0)
    model = tiny_qwen_image(seed=0)
    add_lora(model.transformer, rank=4, alpha=8)
    configure_transformer(model.transformer, gradient_checkpointing=checkpointing, checkpoint_policy=policy)
    cond = model.encode(["a sign that says hi", "a cat"], negative_prompt=" ")
    x = torch.randn(2, *model.latent_shape(32, 32))
    v = model.velocity(x, torch.tensor([0.7, 0.7]), cond, guidance_scale=3.0)
    with _CountOps() as count:
        v.square().sum().backward()
    return count.ops


def test_the_optimizer_takes_every_adamw_value_of_the_config(tmp_path):
    """optim.lr, betas, eps and weight_decay reach AdamW as given (a preset such as awm-tiny-gpu sets eps)."""
    c = Config()
    optim = dataclasses.replace(c.optim, lr=3e-3, betas=(0.8, 0.95), eps=5e-6, weight_decay=0.03)
    cfg = dataclasses.replace(c, optim=optim, run=dataclasses.replace(c.run, out_dir=str(tmp_path)))
    trainer = train_mod.Trainer(cfg, parallel.init_distributed("cpu"))
    (group,) = trainer.optimizer.param_groups
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.95), 5e-6, 0.03)
    assert group["initial_lr"] == 3e-3  # the lr scheduler's base; group["lr"] is its step-0 multiple
    trainer.logger.finish()
    trainer.run.unlock()


def test_selective_checkpointing_recomputes_only_pointwise_ops_and_lora_b():
    """Ops that backward runs beyond no checkpointing's: full checkpointing redoes each block's whole forward
    (its 28 biased Linears as addmm, 2 x 24 LoRA matmuls, 2 attentions); selective redoes only LoRA's B
    (12 targets x 2 blocks = 24 matmuls of inner size r = 4, kept off the saved list by the low-rank rule) and
    the pointwise ops (the 4 GELUs), none of the base matmuls or attentions."""
    off, full = _backward_ops(False, "full"), _backward_ops(True, "full")
    selective = _backward_ops(True, "selective")
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    redo_full = {k: full[k] - off[k] for k in ("addmm", "mm", sdpa, "gelu")}
    redo_selective = {k: selective[k] - off[k] for k in ("addmm", "mm", sdpa, "gelu")}
    assert redo_full == {"addmm": 28, "mm": 48, sdpa: 2, "gelu": 4}
    assert redo_selective == {"addmm": 0, "mm": 24, sdpa: 0, "gelu": 4}


def test_refusals():
    c = Config()
    with pytest.raises(ValueError, match="parallel.shard='adapters'.*model.lora=False"):
        validate_config(
            dataclasses.replace(
                c,
                model=dataclasses.replace(c.model, lora=False),
                parallel=dataclasses.replace(c.parallel, shard="adapters"),
            ),
            1,
        )
    with pytest.raises(ValueError, match="model.checkpoint_policy='selective'.*gradient_checkpointing=False"):
        validate_config(
            dataclasses.replace(c, model=dataclasses.replace(c.model, checkpoint_policy="selective")), 1
        )
    parallel.init_distributed("cpu")
    frozen = tiny_qwen_image(seed=0).transformer
    with pytest.raises(ValueError, match="parallel.shard='adapters'.*none"):
        parallel.shard_transformer(frozen, param_dtype=None, shard="adapters")
    # A merged rollout copies W + (alpha / r) B A of the frozen base: it needs LoRA, the base unsharded and the
    # in-process engine, refused by name before anything is built; and by the merge itself on a sharded base.
    lora_adapters = dataclasses.replace(c.parallel, shard="adapters")
    merged = dataclasses.replace(c.model, merged_rollout=True)
    validate_config(dataclasses.replace(c, model=merged, parallel=lora_adapters), 1)
    for bad in (
        dataclasses.replace(c, model=merged),  # shard full
        dataclasses.replace(c, model=merged, parallel=lora_adapters, rollout_engine="vllm_omni"),
    ):
        with pytest.raises(ValueError, match="model.merged_rollout.*--parallel.shard adapters"):
            validate_config(bad, 1)
    sharded = tiny_qwen_image(seed=0).transformer
    add_lora(sharded, rank=2, alpha=4)
    parallel.shard_transformer(sharded, param_dtype=None, shard="full")
    with pytest.raises(ValueError, match="model.merged_rollout: the base weight of .* is sharded"):
        MergedLora(sharded)


def test_fp8_rollout_refusals(monkeypatch):
    """model.fp8_rollout quantizes the merged rollout's copies: refused by name without merged_rollout, and
    without torchao (the fp8 extra), before anything is built; merged_float8 names the scaling the engine gets.
    model.fp8_train is refused without torchao and without LoRA; beside fp8_rollout it is taken with either scaling
    of the copies (the merged forwards run the copies quantized at the merge). model.fp8_scaling tensorwise without
    fp8_rollout is refused: it would scale nothing."""
    import importlib.util

    c = Config()
    lora_adapters = dataclasses.replace(c.parallel, shard="adapters")
    fp8 = dataclasses.replace(c.model, fp8_rollout=True)
    assert c.model.merged_float8 == "off"
    with pytest.raises(ValueError, match=r"model.fp8_rollout .*model.merged_rollout.*--model.merged-rollout"):
        validate_config(dataclasses.replace(c, model=fp8, parallel=lora_adapters), 1)
    both = dataclasses.replace(fp8, merged_rollout=True)
    assert both.merged_float8 == "rowwise"
    assert dataclasses.replace(both, fp8_scaling="tensorwise").merged_float8 == "tensorwise"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"model.fp8_rollout .*torchao is missing; uv sync --extra fp8"):
        validate_config(dataclasses.replace(c, model=both, parallel=lora_adapters), 1)
    train = dataclasses.replace(c.model, fp8_train=True)
    with pytest.raises(ValueError, match=r"model.fp8_train .*torchao is missing; uv sync --extra fp8"):
        validate_config(dataclasses.replace(c, model=train), 1)
    monkeypatch.undo()
    if real("torchao") is not None:
        validate_config(dataclasses.replace(c, model=both, parallel=lora_adapters), 1)
        validate_config(dataclasses.replace(c, model=train), 1)
        for scaling in ("rowwise", "tensorwise"):  # the copies' scales; training's are rowwise
            both_train = dataclasses.replace(both, fp8_train=True, fp8_scaling=scaling)
            validate_config(dataclasses.replace(c, model=both_train, parallel=lora_adapters), 1)
    # model.fp8_scaling names the merged copies' scales: without fp8_rollout it would scale nothing (fp8_train is
    # rowwise whatever it says: one scale per tensor depends on the batch, and the recompute batches otherwise)
    for bad, words in (
        (dataclasses.replace(train, lora=False), r"model.fp8_train .*model.lora=False"),
        (
            dataclasses.replace(train, fp8_scaling="tensorwise"),
            r"model.fp8_scaling=tensorwise .*model.fp8_rollout.*--model.fp8-rollout or drop --model.fp8-scaling",
        ),
        (
            dataclasses.replace(c.model, fp8_scaling="tensorwise"),
            r"model.fp8_scaling=tensorwise .*model.fp8_rollout, which is off",
        ),
    ):
        with pytest.raises(ValueError, match=words):
            validate_config(dataclasses.replace(c, model=bad, parallel=lora_adapters), 1)
