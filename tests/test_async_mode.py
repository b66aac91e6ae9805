"""The asynchronous mode: max_staleness 0 on 1 rollout + 1 trainer gloo rank is the synchronous run bit for bit,
validation included; max_staleness 1 trains on batches one version old with the recomputed old policy and the IS
weight, and validates the trainer's weights; the trainer's drop rule and message protocol with a fake wire; the
config refusals."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from fgrpo import algorithms, async_mode, recompute
from fgrpo.config import AlgoConfig, GRPOConfig, ParallelConfig, RunConfig, TrainConfig, validate_config
from fgrpo.rollout.buffer import RolloutBuffer
from fgrpo.scripts import load_script

ENTRY = str(Path(__file__).with_name("train_entry.py"))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
STEPS = 3
VAL = ("--run.val-every", "2", "--run.val-num-steps", "3")  # validation rows at steps 0, 2 and the final 3


def _run(out_dir, *flags, nproc=1, steps=STEPS):
    cmd = [sys.executable, ENTRY]
    if nproc > 1:
        port = str(29500 + (os.getpid() + len(flags)) % 1000)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            port,
        ]
        cmd.append(ENTRY)
    cmd += ["--run.out-dir", str(out_dir), "--num-steps", str(steps), *flags]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads(line) for line in open(Path(out_dir) / "e2e" / "metrics.jsonl")]


def _weights(out_dir, step, file="model.safetensors"):
    return load_file(str(Path(out_dir) / "e2e" / "checkpoints" / f"step_{step:06d}" / file))


def _same_numbers(a: dict, b: dict, min_keys: int = 15) -> list[str]:
    """Keys of both rows whose values differ, wall-clock ones (the rollout side's too) aside."""
    clock = ("time/", "perf/")
    keys = [k for k in a if k in b and k != "time" and not k.removeprefix("rollout_").startswith(clock)]
    assert len(keys) >= min_keys
    return [k for k in keys if a[k] != b[k]]


def _validate_checkpoints(out_dir, steps: list[int]) -> list[float]:
    """val/reward_mean of train.validate in this process, on one unsharded rank, with the LoRA of each
    checkpoint of `steps`."""
    from fgrpo import logging as flog
    from fgrpo import parallel
    from fgrpo.data import load_prompts
    from fgrpo.models.lora import setup_trainable
    from fgrpo.models.registry import build_model
    from fgrpo.rewards import build_reward
    from fgrpo.rollout.build import build_engine
    from fgrpo.train import validate

    entry = load_script(ENTRY)
    cfg = entry.Config()
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, val_every=2, val_num_steps=3))
    model = build_model(cfg.model, torch.device("cpu"), cfg.seed)
    setup_trainable(model.transformer, cfg.model)
    prompts = load_prompts(cfg.data.val_prompts)[: cfg.data.val_num_prompts]
    engine = build_engine(model, cfg.rollout_engine, cfg.model.path)
    out = []  # on one thread, as the runs (tests/conftest.py)
    for step in steps:
        missing, unexpected = model.transformer.load_state_dict(_weights(out_dir, step), strict=False)
        assert unexpected == [] and not any("lora" in k for k in missing)
        val = validate(
            engine,
            build_reward(cfg.reward.spec),
            cfg.reward.name,
            prompts,
            cfg,
            flog.NullLogger(),
            step,
            torch.device("cpu"),
            parallel.Split((0,), (0,)),
        )
        out.append(val["val/reward_mean"])
    return out


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync")
    return out, _run(out, *VAL)


@pytest.mark.slow
def test_staleness_0_is_the_synchronous_run_bit_for_bit(sync_run, tmp_path):
    """1 rollout rank + 1 trainer rank with max_staleness 0: every logged number (rewards, losses, ratios,
    gradient norms, log-prob gaps, the validation rewards of steps 0, 2 and the final one) and every
    checkpointed LoRA tensor equal the synchronous run on one rank. This needs the pushed weights to arrive
    whole before each batch: a missing push would change the rewards from step 1 on."""
    sync_out, sync_rows = sync_run
    rows = _run(tmp_path, "--parallel.rollout-ranks", "1", "--parallel.max-staleness", "0", *VAL, nproc=2)
    assert len(rows) == len(sync_rows) == STEPS + 1
    assert [r["step"] for r in rows if "val/reward_mean" in r] == [0, 2, STEPS]
    for a, b in zip(sync_rows[:STEPS], rows[:STEPS]):
        assert _same_numbers(a, b) == []
        assert b["async/staleness"] == 0 and b["async/dropped_total"] == 0
        assert not any(k.startswith("train/offpolicy/") for k in b)
    assert _same_numbers(sync_rows[STEPS], rows[STEPS], min_keys=2) == []
    assert [r.get("val/version") for r in rows[:STEPS]] == [0, None, 2]
    one = {}  # rebound by the loop (STEPS >= 1)
    for step in range(1, STEPS + 1):
        one, two = _weights(sync_out, step), _weights(tmp_path, step)
        assert one.keys() == two.keys() and len(one) > 0
        assert all(torch.equal(one[k], two[k]) for k in one)
    moved = max((_weights(sync_out, STEPS)[k] - _weights(sync_out, 1)[k]).abs().max().item() for k in one)
    assert moved > 1e-3  # the weights did move, so equality is not that of an idle run


@pytest.mark.slow
def test_two_rollout_and_two_trainer_ranks_at_staleness_0_are_the_synchronous_two_rank_run(tmp_path):
    """Splits beyond 1 + 1 use the same wire: with 2 rollout + 2 trainer ranks (rollout rank i feeds trainer rank
    i; trainer rank 0 pushes the weights to both rollout ranks) and max_staleness 0, every logged number and each
    step's checkpointed LoRA equal the synchronous run on 2 ranks (FSDP2 over 2, as the trainer side) bit for bit."""
    sync = _run(tmp_path / "sync", nproc=2, steps=2)
    rows = _run(
        tmp_path / "async", "--parallel.rollout-ranks", "2", "--parallel.max-staleness", "0", nproc=4, steps=2
    )
    assert len(rows) == len(sync) == 2
    for a, b in zip(sync, rows):
        assert _same_numbers(a, b) == []
        assert b["async/staleness"] == 0 and b["async/dropped_total"] == 0
    for step in (1, 2):
        one, two = _weights(tmp_path / "sync", step), _weights(tmp_path / "async", step)
        assert one.keys() == two.keys() and len(one) > 0
        assert all(torch.equal(one[k], two[k]) for k in one)
    moved = max(
        (_weights(tmp_path / "sync", 2)[k] - _weights(tmp_path / "sync", 1)[k]).abs().max().item()
        for k in one
    )
    assert moved > 1e-3  # the second step moved the weights


STALE_1 = ("--parallel.rollout-ranks", "1", "--parallel.max-staleness", "1", *VAL)


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("stale")
    return out, _run(out, *STALE_1, nproc=2)


@pytest.mark.slow
def test_staleness_1_trains_one_version_behind_with_the_correction(sync_run, stale_run):
    """max_staleness 1: batch k is sampled with version max(0, k - 1), so the trainer sees staleness 0, 1, 1.
    Step 0 is the synchronous step 0 exactly (same batch, same weights); the stale steps recompute the old
    log-probs (the behaviour/old gap is > 0: the rollout's weights really are one update old) and log the
    truncated IS weights, which lie in (0, 2]. Step 2's validation is of the trainer's weights (version 2, the
    step-2 checkpoint, validated here in-process), not of the rollout's (version 1) that sampled its batch."""
    sync_out, sync_rows = sync_run
    tmp_path, rows = stale_run
    rows, final = rows[:STEPS], rows[STEPS]
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]
    assert [r["async/version"] for r in rows] == [0, 0, 1]
    assert rows[2]["val/version"] == 2
    trainer, rollout, last = _validate_checkpoints(tmp_path, [2, 1, STEPS])
    assert rows[2]["val/reward_mean"] == trainer != rollout
    assert final["val/reward_mean"] == last
    assert _same_numbers(sync_rows[0], rows[0]) == []
    one, two = _weights(sync_out, 1), _weights(tmp_path, 1)
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert rows[1]["reward/mean"] != sync_rows[1]["reward/mean"]  # batch 1 sampled by version 0, not 1
    for r in rows[1:]:
        assert r["train/offpolicy/gap_abs_max"] > 1e-4
        assert 0 < r["train/offpolicy/is_min"] <= r["train/offpolicy/is_max"] <= 2.0
        assert r["async/dropped_total"] == 0


@pytest.mark.slow
def test_resume_is_the_uninterrupted_run(stale_run, tmp_path):
    """max_staleness 1: 2 steps and their checkpoint, then --run.resume auto to 3 steps, equal the straight 3-step
    run: every logged number (validation included) and the step-3 LoRA. Batch 2 was sampled ahead before the
    checkpoint with version 1; the resume re-samples it with version 1, which the checkpoint keeps (rank 0's
    'async/behind1/*' tensors = the step-1 weights); sampled with the checkpoint's version 2 instead, its rewards
    would differ. The step-3 checkpoint keeps version 2 as one behind: the history moves on after a resume."""
    straight_out, straight = stale_run
    first = _run(tmp_path, *STALE_1, nproc=2, steps=2)
    assert len(first) == 3 and first[2]["step"] == 2  # the 2-step run's final validation, redone on resume
    rows = _run(tmp_path, *STALE_1, "--run.resume", "auto", nproc=2)
    assert [r["step"] for r in rows] == [0, 1, 2, STEPS]
    for a, b in zip(straight[:STEPS], rows[:STEPS]):
        assert _same_numbers(a, b) == []
    assert _same_numbers(straight[STEPS], rows[STEPS], min_keys=2) == []
    for step in (2, STEPS):
        lora, behind = _weights(tmp_path, step), _weights(tmp_path, step, "tensors_rank0.safetensors")
        before = _weights(tmp_path, step - 1)
        assert behind.keys() == {f"async/behind1/{k}" for k in before}
        assert all(torch.equal(behind[f"async/behind1/{k}"], before[k]) for k in before)
        assert all(torch.equal(lora[k], _weights(straight_out, step)[k]) for k in lora)


# ----------------------------------------------------------------------------------------------------------
# The other algorithms

ASYNC_0 = ("--parallel.rollout-ranks", "1", "--parallel.max-staleness", "0")
NFT = ("--algo.name", "nft", "--algo.ema-delay", "0", "--algo.ema-rate", "0.1", "--algo.ema-max-decay", "0.5")


@pytest.mark.slow
def test_nft_samples_with_the_pushed_ema_bit_for_bit(tmp_path):
    """NFT samples with its EMA old policy (decay 0.2 after step 0's 2 optimizer steps, so EMA != theta). The
    trainer pushes the EMA as the rollout's weights and the rollout samples with them as they are, so 1+1 ranks
    at max_staleness 0 equal the synchronous run: step 1's rewards, the losses, the LoRA and the EMA. Pushing
    theta, or the rollout swapping in its own EMA (never updated there), would change step 1's rewards."""
    sync = _run(tmp_path / "sync", *NFT, steps=2)
    rows = _run(tmp_path / "async", *NFT, *ASYNC_0, nproc=2, steps=2)
    assert len(rows) == len(sync) == 2
    assert rows[0]["train/ema_decay"] == pytest.approx(0.2)
    for a, b in zip(sync, rows):
        assert _same_numbers(a, b) == []
    for file in ("model.safetensors", "tensors_rank0.safetensors"):
        one, two = _weights(tmp_path / "sync", 2, file), _weights(tmp_path / "async", 2, file)
        assert one.keys() == two.keys() and len(one) > 0
        assert all(torch.equal(one[k], two[k]) for k in one)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dppo", "awm"])
def test_dppo_and_awm_train_stale_batches(tmp_path, name):
    """max_staleness 1, 2 steps: step 1 trains batch 1, sampled by version 0. DPPO recomputes the old log-probs
    and means and weighs its loss with the truncated IS weight (statistics logged, weights in (0, 2]); AWM, whose
    forward-process loss reads no sampling likelihood, trains it with no correction (no statistics)."""
    flags = ("--algo.name", name) + (("--grpo.clip-range", "1.0") if name == "awm" else ())
    rows = _run(
        tmp_path, *flags, "--parallel.rollout-ranks", "1", "--parallel.max-staleness", "1", nproc=2, steps=2
    )
    assert [r["async/staleness"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["train/loss"]) and r["train/skipped_steps"] == 0 for r in rows)
    if name == "dppo":
        assert rows[1]["train/offpolicy/gap_abs_max"] > 1e-4
        assert 0 < rows[1]["train/offpolicy/is_min"] <= rows[1]["train/offpolicy/is_max"] <= 2.0
    else:
        assert not any(k.startswith("train/offpolicy/") for r in rows for k in r)


def test_dppo_loss_takes_the_importance_weight():
    """FlowDPPO.loss hands the weight to core.dppo: weight 0 everywhere gives loss 0, weight 1 the plain loss."""
    algo = algorithms.FlowDPPO(TrainConfig(algo=AlgoConfig(name="dppo")), [])
    args = (torch.tensor([0.1, -0.2]), torch.zeros(2), torch.ones(2, 3), torch.ones(2, 3), torch.ones(2))
    adv = torch.tensor([1.0, -1.0])
    plain, _ = algo.loss(*args, adv)
    assert plain != 0
    assert algo.loss(*args, adv, torch.zeros(2))[0] == 0
    assert torch.equal(algo.loss(*args, adv, torch.ones(2))[0], plain)


# ----------------------------------------------------------------------------------------------------------
# The trainer's loop with a fake wire: drops, messages, drain


def _batch(step, version):
    traj = dataclasses.make_dataclass("T", [])()  # the fake update never reads it
    return async_mode.Batch(step, traj, torch.zeros(4), torch.zeros(4), {}, version=version)  # pyright: ignore


class FakeWire:
    """Hands out batches of chosen versions and records the weight messages."""

    versions: list[int] = []
    first = 0  # the step of the first batch
    sent: list[async_mode.Weights] = []

    def __init__(self, split):
        self.batches = iter([_batch(self.first + i, v) for i, v in enumerate(self.versions)])
        self.pending = async_mode.parallel.Pending()
        FakeWire.sent = []

    def recv_batch(self, device):
        return next(self.batches)

    def send_weights(self, msg):
        FakeWire.sent.append(msg)


def _fake_trainer(monkeypatch, versions, max_staleness, num_steps, start_step=0, lagging=None):
    monkeypatch.setattr(async_mode, "Wire", FakeWire)
    FakeWire.versions, FakeWire.first = versions, start_step
    cfg = TrainConfig(
        num_steps=num_steps, parallel=ParallelConfig(rollout_ranks=1, max_staleness=max_staleness)
    )
    split = async_mode.parallel.Split((0,), (1,))
    layer = torch.nn.Linear(2, 1)
    torch.nn.init.constant_(layer.weight, start_step)  # updates of +1 then give exactly version k at k
    lagging = lagging or async_mode.Lagging([])
    trained, logged, validated = [], [], []

    def validation(step, timer):
        validated.append(step)
        return {"val/reward_mean": 0.5} if step % 2 == 0 else {}

    def update(step, batch, timer, off_policy):
        trained.append((step, batch.step, off_policy))
        with torch.no_grad():
            layer.weight.add_(1.0)  # a visible "update": the pushed tensors must show it
        return {}

    def record(step, batch, train_metrics, timer, extra):
        logged.append(extra)
        return extra

    def rollout_weights():
        return async_mode.trainable_tensors(layer)

    run = SimpleNamespace(
        cfg=cfg,
        split=split,
        device=torch.device("cpu"),
        start_step=start_step,
        lagging=lagging,
        rollout_weights=rollout_weights,
        validation=validation,
        update=update,
        record=record,
    )
    async_mode.run_trainer(run)  # pyright: ignore[reportArgumentType]
    assert validated == list(range(start_step, num_steps))  # once a step, whether a batch was dropped or not
    return trained, logged, FakeWire.sent


def test_a_batch_older_than_max_staleness_is_dropped_counted_and_logged(monkeypatch):
    """max_staleness 1, batches of versions 0, 0, 0, 2 (a producer that fell behind): the trainer trains batch 0
    (staleness 0) and batch 1 (staleness 1), drops batch 2 (version 0 against the trainer's 2), trains batch 3 as
    its step 2; the drop is in step 2's row, the dropped batch gets a message without weights, the last update's
    message says stop, and one batch sampled ahead is drained after it. Validation (due at steps 0 and 2) runs once
    a step, drop or not, and its rows name the trainer's version then."""
    trained, logged, sent = _fake_trainer(monkeypatch, [0, 0, 0, 2, 3], max_staleness=1, num_steps=3)
    assert trained == [(0, 0, False), (1, 1, True), (2, 3, False)]
    assert [r.get("val/version") for r in logged] == [0, None, 2]
    assert [r["async/staleness"] for r in logged] == [0, 1, 0]
    assert [r["async/dropped"] for r in logged] == [0, 0, 1]
    assert [r["async/dropped_total"] for r in logged] == [0, 0, 1]
    assert [(m.index, m.version, m.trained_step, m.stop) for m in sent] == [
        (-1, 0, None, False),
        (0, 1, 0, False),
        (1, 2, 1, False),
        (2, 2, None, False),
        (3, 3, 2, True),
    ]
    assert sent[3].tensors is None
    w = [m.tensors["weight"] for m in sent if m.tensors is not None]
    assert [float(t.flatten()[0] - w[0].flatten()[0]) for t in w] == [
        0.0,
        1.0,
        2.0,
        3.0,
    ]  # versioned snapshots


def test_resume_sends_the_lagging_versions_then_the_current_one(monkeypatch):
    """From the checkpoint of step 3 with max_staleness 2 (version 3; versions 1 and 2 kept as lagging), the
    trainer sends versions 1 and 2 (which sample batches 3 and 4) and then 3, before it trains batch 3 (version
    1: staleness 2) as step 3; that update pushes version 4 and the history moves on to versions 2 and 3.
    A finished run resumed sends nothing."""
    lagging = async_mode.Lagging([{"weight": torch.full((1, 2), v)} for v in (1.0, 2.0)])
    assert list(lagging.state()) == ["async/behind2/weight", "async/behind1/weight"]
    trained, logged, sent = _fake_trainer(
        monkeypatch, [1, 2, 3], max_staleness=2, num_steps=4, start_step=3, lagging=lagging
    )
    assert trained == [(3, 3, True)]
    assert [r["async/staleness"] for r in logged] == [2]
    assert [(m.index, m.version, m.trained_step, m.stop) for m in sent] == [
        (0, 1, None, False),
        (1, 2, None, False),
        (2, 3, None, False),
        (3, 4, 3, True),
    ]
    assert [float(m.tensors["weight"][0, 0]) for m in sent if m.tensors is not None] == [1.0, 2.0, 3.0, 4.0]
    assert [float(v["weight"][0, 0]) for v in lagging.versions] == [2.0, 3.0]
    _, _, sent = _fake_trainer(monkeypatch, [], max_staleness=2, num_steps=3, start_step=3, lagging=lagging)
    assert sent == []


def test_accept_keeps_staleness_up_to_the_bound():
    buf: RolloutBuffer = RolloutBuffer(max_size=1, max_staleness=2)
    assert async_mode.accept(buf, _batch(0, 0), 3) is None  # staleness 3
    assert async_mode.accept(buf, _batch(1, 1), 3) is not None  # staleness 2
    assert [(d.version, d.current_version) for d in buf.dropped] == [(0, 3)]


# ----------------------------------------------------------------------------------------------------------
# Config


def _async_cfg(**kw):
    base = dict(
        grpo=GRPOConfig(group_size=4, prompts_per_step=4, optimizer_steps_per_step=1),
        run=RunConfig(val_every=0),
        parallel=ParallelConfig(rollout_ranks=1),
    )
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "cfg, world, match",
    [
        (_async_cfg(parallel=ParallelConfig(rollout_ranks=2)), 2, "leaves no training rank"),
        (_async_cfg(parallel=ParallelConfig(rollout_ranks=2)), 5, "must divide the 3 training ranks"),
        (_async_cfg(parallel=ParallelConfig(rollout_ranks=1, max_staleness=-1)), 2, "parallel.max_staleness"),
        (_async_cfg(parallel=ParallelConfig(rollout_ranks=1, is_threshold=0)), 2, "parallel.is_threshold"),
        (_async_cfg(rollout_engine="vllm_omni"), 2, "'vllm_omni' has no asynchronous mode"),
        (
            _async_cfg(parallel=ParallelConfig(rollout_ranks=1, is_log_ratio="max")),  # type: ignore[arg-type]
            2,
            "parallel.is_log_ratio=max: must be 'mean' or 'sum'; pass --parallel.is-log-ratio",
        ),
    ],
)
def test_config_refusals(cfg, world, match):
    with pytest.raises(ValueError, match=match):
        validate_config(cfg, world)


def test_config_splits_that_work_and_the_micro_batch_rule():
    """1 + 1 and 2 + 6 of 8 (48 samples: 24 per rollout rank, 8 per trainer, one rollout micro-batch of 8 each).
    With 4 samples per trainer a rollout micro-batch of 8 would straddle two trainers: refused."""
    validate_config(_async_cfg(), 2)
    grpo = GRPOConfig(group_size=4, prompts_per_step=12, optimizer_steps_per_step=1)
    validate_config(_async_cfg(grpo=grpo, parallel=ParallelConfig(rollout_ranks=2)), 8)
    grpo = GRPOConfig(group_size=4, prompts_per_step=6, optimizer_steps_per_step=1)
    with pytest.raises(ValueError, match="sampling.micro_batch=8 must divide the 4 samples"):
        validate_config(_async_cfg(grpo=grpo, parallel=ParallelConfig(rollout_ranks=2)), 8)


def test_off_policy_weights_per_correction():
    """log(pi_old / pi_behaviour) = [[0, ln 3], [ln 0.25, 0]], threshold 2 (lower 1/2 for the mask):
    tis: min(r, 2) = [[1, 2], [0.25, 1]];  masked_is: r inside [0.5, 2] else 0 = [[1, 0], [0, 1]];
    none: no weight, statistics of weight 1; sequence level: r_b = prod_j r_bj = [3, 0.25] -> [2, 0.25]."""
    behaviour = torch.zeros(2, 2)
    old = torch.tensor([[0.0, math.log(3.0)], [math.log(0.25), 0.0]])
    w, stats = recompute.off_policy_weights(old, behaviour, ParallelConfig(correction="tis"), elements=1)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0], [0.25, 1.0]]))
    assert stats["offpolicy/gap_abs_max"] == pytest.approx(math.log(4.0))
    w, stats = recompute.off_policy_weights(
        old, behaviour, ParallelConfig(correction="masked_is"), elements=1
    )
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert stats["offpolicy/is_frac_zero"] == 0.5
    w, stats = recompute.off_policy_weights(old, behaviour, ParallelConfig(correction="none"), elements=1)
    assert w is None and stats["offpolicy/is_max"] == 1.0
    w, _ = recompute.off_policy_weights(
        old, behaviour, ParallelConfig(correction="tis", is_level="sequence"), elements=1
    )
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0], [0.25, 0.25]]))


def test_off_policy_weights_sum_scales_the_log_ratio_by_the_element_count():
    """Per-element mean gaps [[0, ln 3 / D], [ln 0.25 / D, 1e-3]], D = 64, threshold 2.
    sum: log w = D gap = [[0, ln 3], [ln 0.25, 0.064]], tis token min(exp, 2) = [[1, 2], [0.25, e^0.064]];
    mean: w = exp(gap) < 2, untouched by the truncation."""
    D = 64
    behaviour = torch.zeros(2, 2)
    old = torch.tensor([[0.0, math.log(3.0) / D], [math.log(0.25) / D, 1e-3]])
    tis = ParallelConfig(correction="tis", is_log_ratio="mean")
    w, stats = recompute.off_policy_weights(
        old,
        behaviour,
        ParallelConfig(correction="tis"),
        elements=D,  # the default units: 'sum'
    )
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0], [0.25, math.exp(0.064)]]))
    assert stats["offpolicy/gap_abs_max"] == pytest.approx(math.log(4.0))
    assert stats["offpolicy/is_frac_high"] == 0.25
    w, stats = recompute.off_policy_weights(old, behaviour, tis, elements=D)
    torch.testing.assert_close(w, old.exp())
    assert stats["offpolicy/gap_abs_max"] == pytest.approx(math.log(4.0) / D)
    assert stats["offpolicy/is_frac_high"] == 0.0


@pytest.mark.parametrize("unit", ["mean", "sum"])
def test_window_update_weighs_stale_entries_in_the_configured_units(unit):
    """A stale batch on the tiny model, weights unchanged since the rollout, so the recomputed old log-probs are
    the rollout's (to rounding); the behaviour log-probs are shifted by ln 3 / D on sample 0 and ln 0.25 / D on
    sample 1 (D = one sample's latent elements). 'sum': weights min(3, 2) = 2 and 0.25, the gap ln 4;
    'mean': weights e^(ln 3 / D) and e^(ln 0.25 / D), both within 1 +- 2 / D."""
    from fgrpo.config import SamplingConfig
    from fgrpo.models.lora import add_lora
    from fgrpo.models.tiny import tiny_qwen_image
    from fgrpo.rollout.engine import DiffusersEngine

    s = SamplingConfig(
        height=32, width=32, num_steps=3, guidance_scale=1.0, sde_kind="flow_sde", noise_level=0.9,
        window_size=1, window_range=(0, 2), micro_batch=2,
    )  # fmt: skip
    model = tiny_qwen_image(seed=0)
    add_lora(model.transformer, rank=4, alpha=4)
    traj = DiffusersEngine(model).generate(['a sign "OPEN"'] * 2, [0, 1], s)
    D = traj.x_t[0, 0].numel()
    shift = torch.tensor([[math.log(3.0)], [math.log(0.25)]]) / D
    traj = dataclasses.replace(traj, log_prob=traj.log_prob - shift)
    cfg = TrainConfig(
        sampling=s,
        grpo=GRPOConfig(group_size=2, prompts_per_step=1, optimizer_steps_per_step=1),
        parallel=ParallelConfig(correction="tis", is_log_ratio=unit),
    )
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    m = algorithms.build(cfg, params).update(
        model, params, opt, sched, traj, torch.tensor([1.0, -1.0]), torch.Generator().manual_seed(0), True
    )
    scale = D if unit == "sum" else 1
    assert m["offpolicy/gap_abs_max"] == pytest.approx(math.log(4.0) * scale / D, rel=1e-3)
    assert m["offpolicy/is_max"] == pytest.approx(2.0 if unit == "sum" else 3 ** (1 / D), rel=1e-3)
    assert m["offpolicy/is_min"] == pytest.approx(0.25 if unit == "sum" else 0.25 ** (1 / D), rel=1e-3)


def test_the_trainer_gets_the_whole_batch_on_its_device(monkeypatch):
    """Rewards and advantages travel with the trajectory and land on the receiving rank's device with it (they
    index that rank's samples there). 'meta' stands in for the trainer's GPU."""
    from fgrpo import parallel
    from fgrpo.rollout.base import Trajectory

    n, w = 2, 1
    traj = Trajectory(
        prompts=['"A"', '"B"'],
        seeds=torch.arange(n),
        sigmas=torch.linspace(1, 0, 3),
        window=torch.zeros(n, w, dtype=torch.long),
        x_t=torch.zeros(n, w, 3),
        x_next=torch.zeros(n, w, 3),
        log_prob=torch.zeros(n, w),
        cond={"embeds": torch.zeros(n, 2)},
        images=torch.zeros(n, 1, 1, 3, dtype=torch.uint8),
    )
    batch = async_mode.Batch(0, traj, torch.ones(n), torch.ones(n), {})
    monkeypatch.setattr(parallel, "recv_object", lambda src, **kw: batch)
    monkeypatch.setattr(parallel, "rank", lambda: 0)
    wire = async_mode.Wire(parallel.Split(trainer_ranks=(0,), rollout_ranks=(1,)))
    got = wire.recv_batch(torch.device("meta"))
    tensors = [got.rewards, got.advantages, got.traj.x_t, got.traj.log_prob, got.traj.cond["embeds"]]
    assert all(t.device.type == "meta" for t in tensors)
