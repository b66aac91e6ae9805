"""End-to-end runs of the loop in subprocesses: FSDP2 on 2 gloo ranks = 1 rank; kill + resume = no kill."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ENTRY = str(Path(__file__).with_name("train_entry.py"))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def run(out_dir, *flags, nproc=1, timeout=600):
    if nproc == 1:
        cmd = [sys.executable, ENTRY]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(29500 + os.getpid() % 1000),
            ENTRY,
        ]
    cmd += ["--run.out-dir", str(out_dir), *flags]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def final_weights(out_dir, step):
    return load_file(str(Path(out_dir) / "e2e" / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


def assert_same_training(one, other, start):
    """`other` trained what `one` trained from `start` (state dicts), up to AdamW's amplification of rounding.

    AdamW divides each gradient element by its own magnitude, so the few near-zero elements whose sums round
    differently (another summation order) move by a small fraction of the step: on one 2-core AMD CPU 2 of 9,216
    elements beyond 1e-4, the largest 1.5e-4, against a median motion of 2.2e-2. Asserted: the step moved the
    weights (median motion > 1e-2), every element within 1 % of that motion, 99 % of them within 1e-5. Training
    on other samples moves most elements by a good part of the step."""
    assert one.keys() == other.keys() and len(one) > 0
    motion = torch.cat([(one[k] - start[k]).abs().flatten() for k in one]).median().item()
    assert motion > 1e-2
    diff = torch.cat([(other[k] - one[k]).abs().flatten() for k in one])
    assert diff.max().item() < 1e-2 * motion
    assert (diff > 1e-5).float().mean().item() < 0.01


def test_two_fsdp_ranks_match_one(tmp_path):
    """The same global batch on 1 and on 2 ranks: advantages from all-gathered rewards, gradients averaged
    by FSDP2's reduce-scatter. Only the summation order differs, so fp32 agreement is to rounding.

    One mini-batch per step: with several, which samples share a mini-batch depends on the layout (as in
    any PPO implementation), so the runs would legitimately differ after the first optimizer step."""
    flags = ("--num-steps", "2", "--grpo.optimizer-steps-per-step", "1")
    run(tmp_path / "one", *flags)
    run(tmp_path / "two", *flags, nproc=2)
    one, two = final_weights(tmp_path / "one", 2), final_weights(tmp_path / "two", 2)
    assert_same_training(one, two, start=final_weights(tmp_path / "one", 1))


def test_full_weights_two_fsdp_ranks_match_one(tmp_path):
    """Full-weight training (no LoRA): every transformer weight is trained, sharded over the ranks and
    checkpointed; 2 ranks = 1 rank on the same global batch, as with LoRA."""
    flags = (
        "--num-steps",
        "2",
        "--grpo.optimizer-steps-per-step",
        "1",
        "--model.no-lora",
        "--optim.lr",
        "1e-3",
    )
    run(tmp_path / "one", *flags)
    run(tmp_path / "two", *flags, nproc=2)
    one, two = final_weights(tmp_path / "one", 2), final_weights(tmp_path / "two", 2)
    start = final_weights(tmp_path / "one", 1)
    from fgrpo.models.tiny import tiny_qwen_image

    names = {n for n, _ in tiny_qwen_image(seed=0).transformer.named_parameters()}
    assert set(one) == names and set(two) == names  # the whole transformer, no LoRA keys
    moved = [k for k in one if (one[k] - start[k]).abs().max().item() > 0]
    assert len(moved) > 0.9 * len(
        one
    )  # nearly every tensor trains (a few get no gradient, e.g. unused heads)
    for k in one:
        torch.testing.assert_close(one[k], two[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_wan_a14b_two_fsdp_ranks_match_one(tmp_path):
    """Wan 2.2 T2V-A14B (experiments/wan_video_ocr.py's a14b-tiny): both experts' LoRA, each expert its own FSDP2
    units, trained on 2 ranks as on 1. Each sample's window steps pick their expert, so a rank's rows may need one
    expert where the other rank's need both: every rank runs the experts any rank needs (models.wan's velocity),
    else the ranks' FSDP2 collectives would not pair up and the run would hang (it does, without that)."""
    script = str(Path(__file__).resolve().parents[1] / "experiments" / "wan_video_ocr.py")
    flags = ["a14b-tiny", "--num-steps", "2", "--grpo.optimizer-steps-per-step", "1", "--optim.lr", "3e-2"]
    flags += ["--run.val-every", "0", "--run.ckpt-every", "1"]
    port = str(29500 + (os.getpid() + 7) % 1000)
    for name, launch in (
        ("one", [sys.executable, script]),
        (
            "two",
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-port",
                port,
                script,
            ],
        ),
    ):
        cmd = [*launch, *flags, "--run.out-dir", str(tmp_path / name)]
        res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    def weights(name: str, step: int) -> dict[str, torch.Tensor]:
        ckpt = tmp_path / name / "wan_video_ocr" / "checkpoints" / f"step_{step:06d}" / "model.safetensors"
        return load_file(str(ckpt))

    # The rollout's batch shapes differ (4 rows on one rank, 2 on each of two), so the samples agree to rounding
    # only. The first update (from the same start) agrees to a small fraction of its motion; the second is AdamW's
    # step on two gradients, where the tiny model's many near-zero elements (LoRA A's first gradient is 0, as B
    # starts at 0) amplify that rounding more than the Qwen-Image run above does: on one 2-core CPU 1.4 % of the
    # elements beyond 1e-5, the largest 1.0e-3 against a median motion of 2.2e-2.
    start = weights("one", 1)
    assert {k.split(".")[0] for k in start} == {"transformer", "transformer_2"}  # both experts' adapters
    one, two = weights("one", 2), weights("two", 2)
    motion = torch.cat([(one[k] - start[k]).abs().flatten() for k in one]).median().item()
    assert motion > 1e-2
    for k in ("transformer", "transformer_2"):  # both experts moved
        assert max((one[n] - start[n]).abs().max().item() for n in one if n.split(".")[0] == k) > 1e-2
    first = max((weights("two", 1)[k] - start[k]).abs().max().item() for k in start)
    assert first < 1e-2 * motion
    diff = torch.cat([(two[k] - one[k]).abs().flatten() for k in one])
    assert diff.max().item() < 0.1 * motion and (diff > 1e-5).float().mean().item() < 0.05


def test_kill_and_resume_is_bit_exact(tmp_path):
    # A decaying LR, so that a scheduler resumed at the wrong optimizer step changes the weights.
    flags = ["--num-steps", "3", "--optim.schedule", "linear"]
    run(tmp_path / "straight", *flags)
    logged = [
        json.loads(line)
        for line in (tmp_path / "straight" / "e2e" / "metrics.jsonl").read_text().splitlines()
    ]
    lrs = [m["lr"] for m in logged if "lr" in m]
    assert lrs == pytest.approx(
        [3e-2 * (1 - k / 6) for k in (2, 4, 6)]
    )  # after each step's 2 optimizer steps
    # Start the same run, SIGKILL it as soon as its step-1 checkpoint is complete, then resume.
    out = tmp_path / "killed"
    cmd = [sys.executable, ENTRY, "--run.out-dir", str(out), *flags]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpt = out / "e2e" / "checkpoints" / "step_000001"
    deadline = time.time() + 600
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.stderr is not None  # stderr=PIPE
    assert ckpt.exists(), proc.stderr.read().decode()[-3000:] if proc.poll() is not None else "timed out"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "e2e" / "checkpoints" / "step_000003").exists()  # it really died mid-run
    res = run(out, *flags, "--run.resume", "auto")
    assert "resumed from" in res.stdout
    a, b = final_weights(tmp_path / "straight", 3), final_weights(out, 3)
    for k in a:
        assert torch.equal(a[k], b[k]), k
