"""Checkpoint tests: atomic writes, keep-last-K, bit-exact resume, 2-rank FSDP2 (gloo), LoRA export."""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fgrpo import checkpoint as ckpt
from fgrpo import files
from fgrpo.models.lora import export_lora

# ---------------------------------------------------------------------------------------------------------
# a small model, optimizer and schedule; the "data" draws from every RNG the checkpoint must restore


def _build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].weight.requires_grad_(False)  # a frozen "base" weight must not be saved or touched
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def _linear(model: nn.Sequential, i: int) -> nn.Linear:
    """Layer i of `_build`'s model (nn.Sequential's indexing is typed as returning any Module)."""
    layer = model[i]
    assert isinstance(layer, nn.Linear)
    return layer


def _train(model, opt, sched, n: int) -> None:
    """n steps on batches drawn, like the trainer's, from a generator seeded by the step (sched counts them), so a
    resume needs no RNG state."""
    for _ in range(n):
        g = torch.Generator().manual_seed(sched.last_epoch)
        x = torch.randn(5, 6, generator=g) * (1.0 + torch.rand(1, generator=g).item())
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_resume_is_bit_exact(tmp_path):
    # Uninterrupted: 3 + 3 steps.
    _seed_all(1)
    model, opt, sched = _build(0)
    _train(model, opt, sched, 3)
    _train(model, opt, sched, 3)
    ref_params = {k: v.clone() for k, v in model.state_dict().items()}
    ref_lr = sched.get_last_lr()

    # Interrupted: 3 steps, save, then a fresh process-like state (other init, other RNG), load, 3 steps.
    _seed_all(1)
    model, opt, sched = _build(0)
    _train(model, opt, sched, 3)
    ckpt.save(tmp_path, 3, model=model, optimizer=opt, lr_scheduler=sched, extra_state={"data_pos": 15})
    model2, opt2, sched2 = _build(123)
    # the frozen base comes from the pretrained load
    _linear(model2, 0).weight.data.copy_(_linear(model, 0).weight)
    _seed_all(999)
    step, extra = ckpt.load(tmp_path, model=model2, optimizer=opt2, lr_scheduler=sched2)
    assert (step, extra) == (3, {"data_pos": 15})
    _train(model2, opt2, sched2, 3)

    for k, v in model2.state_dict().items():
        assert torch.equal(v, ref_params[k]), k
    assert sched2.get_last_lr() == ref_lr
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95)


def test_save_before_first_step_changes_nothing(tmp_path):
    # torch's optimizer-state gathering would take a zero-grad AdamW step on an empty optimizer.
    _seed_all(2)
    model, opt, sched = _build(0)
    _train(model, opt, sched, 2)
    ref = {k: v.clone() for k, v in model.state_dict().items()}

    _seed_all(2)
    model, opt, sched = _build(0)
    ckpt.save(tmp_path, 0, model=model, optimizer=opt, lr_scheduler=sched)
    assert not opt.state
    _train(model, opt, sched, 2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k

    model2, opt2, sched2 = _build(0)  # resume from the step-0 checkpoint: also exact
    ckpt.load(tmp_path, model=model2, optimizer=opt2, lr_scheduler=sched2)
    assert not opt2.state and opt2.param_groups[0]["betas"] == (0.8, 0.95)
    _train(model2, opt2, sched2, 2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, ref[k]), k


class _LateBranch(nn.Module):
    """`late` gets a gradient from step 3 on: until then it has no optimizer state (like a LoRA whose output
    nothing reads, which never gets one)."""

    def __init__(self):
        super().__init__()
        self.early, self.late = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = self.early(x)
        return self.late(y) if step >= 3 else y


def test_a_parameter_without_optimizer_state_resumes_as_never_stepped(tmp_path):
    """torch's optimizer-state load makes up step 1 and zero moments for such a parameter: the resumed run's
    first update of `late` then differed (5e-3) and its checkpoints carried the made-up entries."""

    def build():
        torch.manual_seed(0)
        model = _LateBranch()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def train(model, opt, steps):
        for s in steps:
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(s))
            opt.zero_grad()
            (model(x, s) ** 2).mean().backward()
            opt.step()

    model, opt = build()
    train(model, opt, range(2))
    ckpt.save(tmp_path / "a", 2, model=model, optimizer=opt)
    train(model, opt, range(2, 6))
    model2, opt2 = build()
    ckpt.load(tmp_path / "a", model=model2, optimizer=opt2)
    assert not any(p in opt2.state for p in model2.late.parameters())
    ckpt.save(tmp_path / "b", 2, model=model2, optimizer=opt2)
    optimizer_files = [load_file(str(tmp_path / d / "step_000002" / "optimizer.safetensors")) for d in "ab"]
    assert optimizer_files[0].keys() == optimizer_files[1].keys()
    train(model2, opt2, range(2, 6))
    for k, v in model2.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_files_hold_trainable_weights_and_no_pickle(tmp_path):
    model, opt, sched = _build(0)
    _train(model, opt, sched, 1)
    path = ckpt.save(tmp_path, 7, model=model, optimizer=opt, lr_scheduler=sched)
    assert path == tmp_path / "step_000007"
    weights = load_file(path / "model.safetensors")
    assert set(weights) == {"0.bias", "2.weight", "2.bias"}
    assert torch.equal(weights["2.weight"], _linear(model, 2).weight)
    o = load_file(path / "optimizer.safetensors")
    assert torch.equal(o["state/2.weight/exp_avg"], opt.state[_linear(model, 2).weight]["exp_avg"])
    assert o["state/2.weight/step"].item() == 1.0
    assert json.loads((path / "meta.json").read_text())["step"] == 7
    assert not list(path.glob("rng_*"))  # the seeded generators make RNG state redundant
    for f in path.iterdir():  # everything is safetensors or JSON
        assert f.suffix in {".safetensors", ".json"}, f


def test_crash_mid_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = _build(0)
    ckpt.save(tmp_path, 1, model=model, optimizer=opt, lr_scheduler=sched, extra_state={"v": 1})
    _train(model, opt, sched, 1)

    real = files.write_json

    def crash_on_meta(path, obj):
        if Path(path).name == "meta.json":
            assert (Path(path).parent / "model.safetensors").is_file()  # weights already written
            raise KeyboardInterrupt("simulated kill")
        real(path, obj)

    monkeypatch.setattr(files, "write_json", crash_on_meta)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, 2, model=model, optimizer=opt, lr_scheduler=sched, extra_state={"v": 2})
    monkeypatch.setattr(files, "write_json", real)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    # A hard kill cannot clean up: a stale temp dir and a step dir without meta.json must both be ignored.
    stale = tmp_path / ".tmp_step_000002_999999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "step_000003").mkdir()
    assert ckpt.latest(tmp_path) == tmp_path / "step_000001"
    model2, opt2, sched2 = _build(5)
    assert ckpt.load(tmp_path, model=model2, optimizer=opt2, lr_scheduler=sched2) == (1, {"v": 1})
    # The next successful save removes the stale temp dir.
    ckpt.save(tmp_path, 4, model=model, optimizer=opt)
    assert not stale.exists()


def test_keep_last_k(tmp_path):
    model, opt, _ = _build(0)
    for step in range(5):
        ckpt.save(tmp_path, step * 10, model=model, optimizer=opt, keep_last=2)
        kept = [s for s, _ in ckpt.list_checkpoints(tmp_path)]
        assert kept == [s * 10 for s in range(max(0, step - 1), step + 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000030", "step_000040"]
    # Re-saving an existing step replaces it atomically.
    ckpt.save(tmp_path, 40, model=model, extra_state={"again": True}, keep_last=2)
    assert json.loads((tmp_path / "step_000040" / "meta.json").read_text())["extra_state"] == {"again": True}


def test_clear_errors(tmp_path):
    model, opt, _ = _build(0)
    with pytest.raises(TypeError, match="extra_state"):
        ckpt.save(tmp_path, 1, model=model, extra_state={"bad": object()})
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="keep_last"):
        ckpt.save(tmp_path, 1, model=model, keep_last=0)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.load(tmp_path, model=model)
    ckpt.save(tmp_path, 1, model=model)
    other = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))  # base weight trainable here
    with pytest.raises(ValueError, match="missing"):
        ckpt.load(tmp_path, model=other)


# ---------------------------------------------------------------------------------------------------------
# 2 ranks, gloo, FSDP2: save a sharded model, load into a freshly built sharded model

# The toy model, shared by the worker processes and the 1-process check (exec'd in both).
_TOY = textwrap.dedent(
    """
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from torch import nn

    def build(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))
        # PEFT's layers: a frozen base_layer + lora_A/lora_B ModuleDicts keyed by adapter; A and B random
        lora = LoraConfig(r=2, lora_alpha=2, target_modules=["0", "2"], init_lora_weights=False)
        m = inject_adapter_in_model(lora, m)
        m[3].requires_grad_(True)  # a fully trained layer beside the adapter
        torch.manual_seed(0)  # identical frozen base on every rank and in every build
        for blk in (m[0], m[2]):
            nn.init.normal_(blk.base_layer.weight)
            nn.init.normal_(blk.base_layer.bias)
        return m

    def step(m, opt, k):
        g = torch.Generator().manual_seed(100 + k)
        x = torch.randn(4, 8, generator=g)
        opt.zero_grad()
        (m(x) ** 2).mean().backward()
        opt.step()
    """
)

_FSDP_WORKER = _TOY + textwrap.dedent(
    """
    import gc, os, sys
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from safetensors.torch import save_file
    from fgrpo import checkpoint as ckpt
    from fgrpo.models.lora import lora_state_dict

    def shard(m):
        for blk in (m[0], m[2]):
            fully_shard(blk)
        fully_shard(m)
        return m

    def full(m):
        return {n: p.detach().full_tensor().clone() for n, p in m.named_parameters()}

    def main():
        out = sys.argv[1]
        dist.init_process_group(
            "gloo", init_method="file://" + os.path.join(out, "pg"),
            rank=int(os.environ["RANK"]), world_size=2,
        )
        rank = dist.get_rank()
        m = shard(build(0))
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        for k in range(2):
            step(m, opt, k)
        ckpt.save(os.path.join(out, "ck"), 2, model=m, optimizer=opt, extra_state={"world": 2})
        lora = lora_state_dict(m)
        step(m, opt, 2)
        after = full(m)

        m2 = shard(build(7))
        opt2 = torch.optim.AdamW([p for p in m2.parameters() if p.requires_grad], lr=1e-2)
        assert ckpt.load(os.path.join(out, "ck"), model=m2, optimizer=opt2) == (2, {"world": 2})
        loaded = full(m2)
        step(m2, opt2, 2)
        for n, v in full(m2).items():
            assert torch.equal(v, after[n]), n
        if rank == 0:
            save_file(loaded, os.path.join(out, "loaded.safetensors"))
            save_file(lora, os.path.join(out, "lora.safetensors"))
            save_file(after, os.path.join(out, "after.safetensors"))
        else:
            assert lora == {}
        del m, m2, opt, opt2
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        print("rank", rank, "ok")

    main()
    """
)


def test_fsdp2_two_ranks_save_load(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_FSDP_WORKER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    env.pop("RANK", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)],
            env={**env, "RANK": str(r), "WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-3000:]

    ck = tmp_path / "ck" / "step_000002"
    assert {p.name for p in ck.iterdir()} == {
        "model.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "meta.json",
    }
    weights = load_file(ck / "model.safetensors")
    assert all(".lora_" in k or k.startswith("3.") for k in weights)  # frozen base layers not saved
    loaded = load_file(tmp_path / "loaded.safetensors")
    for k, v in weights.items():
        assert torch.equal(loaded[k], v), k
    # Unsharded keys without the PEFT adapter name: what diffusers' LoRA loader wants.
    lora = load_file(tmp_path / "lora.safetensors")
    assert sorted(lora) == sorted(f"{i}.lora_{ab}.weight" for i in (0, 2) for ab in ("A", "B"))
    assert torch.equal(lora["2.lora_B.weight"], weights["2.lora_B.default.weight"])

    # Another world size: the 2-rank checkpoint loads into a plain 1-process model, and one more step
    # matches the sharded run bit for bit (both ranks saw the same batch, so the mean gradient is exact).
    ns: dict = {}
    exec(_TOY, ns)
    m = ns["build"](11)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    assert ckpt.load(tmp_path / "ck", model=m, optimizer=opt) == (2, {"world": 2})
    ns["step"](m, opt, 2)
    after = load_file(tmp_path / "after.safetensors")
    for n, p in m.named_parameters():
        assert torch.equal(p, after[n]), n


# ---------------------------------------------------------------------------------------------------------
# LoRA export -> diffusers loaders


def _qwen_inputs(b=2, h=4, w=4, txt=5, dim=32):
    g = torch.Generator().manual_seed(3)
    return dict(
        hidden_states=torch.randn(b, h * w, 16, generator=g),
        encoder_hidden_states=torch.randn(b, txt, dim, generator=g),
        encoder_hidden_states_mask=torch.ones(b, txt, dtype=torch.long),
        timestep=torch.tensor([0.7, 0.2]),
        img_shapes=[(1, h, w)] * b,
        return_dict=False,
    )


def test_export_lora_loads_in_diffusers(tmp_path):
    pytest.importorskip("diffusers")
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

    from fgrpo.models import tiny
    from fgrpo.models.lora import add_lora
    from fgrpo.models.qwen_image import QWEN_IMAGE_LORA_TARGETS

    comps = tiny.tiny_qwen_image_components(seed=0)
    trained = comps["transformer"]
    base = copy.deepcopy(trained)
    base_out = trained(**_qwen_inputs())[0]
    add_lora(trained, rank=4, alpha=8, target_modules=QWEN_IMAGE_LORA_TARGETS, init=False)  # A, B random
    want = trained(**_qwen_inputs())[0]
    assert not torch.allclose(want, base_out)  # the adapter changes the output, so the test can fail

    out = export_lora(tmp_path / "lora", trained)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    keys = load_file(out / "adapter_model.safetensors")
    assert keys and all(k.startswith("transformer.") and ".default." not in k for k in keys)
    header = json.loads(
        files.read_safetensors_metadata(out / "adapter_model.safetensors")["lora_adapter_metadata"]
    )
    assert header["transformer.r"] == 4 and header["transformer.lora_alpha"] == 8
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4

    # 1) transformer.load_lora_adapter into a fresh base transformer (diffusers 0.40 only looks for
    #    safetensors there when told: use_safetensors=True or weight_name)
    fresh = copy.deepcopy(base)
    fresh.load_lora_adapter(str(out), use_safetensors=True)
    assert torch.equal(fresh(**_qwen_inputs())[0], want)

    # 2) the full pipeline's load_lora_weights (what users call)
    pipe = QwenImagePipeline(**{**comps, "transformer": base})
    pipe.load_lora_weights(str(out))
    assert torch.equal(pipe.transformer(**_qwen_inputs())[0], want)


def test_export_lora_loads_in_sd3_pipeline(tmp_path):
    pytest.importorskip("diffusers")
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import StableDiffusion3Pipeline

    from fgrpo.models import tiny
    from fgrpo.models.lora import add_lora
    from fgrpo.models.sd3 import SD3_LORA_TARGETS

    comps = tiny.tiny_sd3_components(seed=0)
    trained = comps["transformer"]
    base = copy.deepcopy(trained)
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(2, 5, trained.config.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(2, trained.config.pooled_projection_dim, generator=g),
        timestep=torch.tensor([500.0, 100.0]),
        return_dict=False,
    )
    base_out = trained(**inputs)[0]
    add_lora(trained, rank=4, alpha=8, target_modules=SD3_LORA_TARGETS, init=False)
    want = trained(**inputs)[0]
    assert not torch.allclose(want, base_out)
    out = export_lora(tmp_path / "lora", trained)
    pipe = StableDiffusion3Pipeline(**{**comps, "transformer": base})
    pipe.load_lora_weights(str(out))
    assert torch.equal(pipe.transformer(**inputs)[0], want)


# ---------------------------------------------------------------------------------------------------------
# integrity: checksums in meta.json, verified loads, walking back past broken checkpoints


def _flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_meta_records_size_and_sha256_of_every_file(tmp_path):
    import hashlib

    model, opt, sched = _build(0)
    _train(model, opt, sched, 1)
    path = ckpt.save(tmp_path, 1, model=model, optimizer=opt, lr_scheduler=sched)
    files = json.loads((path / "meta.json").read_text())["files"]
    assert set(files) == {p.name for p in path.iterdir()} - {"meta.json"}
    for name, rec in files.items():
        data = (path / name).read_bytes()
        assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p: _flip_byte(p / "model.safetensors"), r"model\.safetensors.*sha256"),  # same size
        (lambda p: _flip_byte(p / "optimizer.json", 5), r"optimizer\.json.*sha256"),
        (
            lambda p: (p / "optimizer.safetensors").write_bytes(
                (p / "optimizer.safetensors").read_bytes()[:-7]
            ),
            r"optimizer\.safetensors.*bytes",
        ),
        (lambda p: (p / "lr_scheduler.json").unlink(), r"lr_scheduler\.json.*missing"),
        (lambda p: (p / "meta.json").write_text('{"step": 1, '), r"meta\.json"),
        (
            lambda p: (p / "meta.json").write_text(
                json.dumps(
                    {k: v for k, v in json.loads((p / "meta.json").read_text()).items() if k != "files"}
                )
            ),
            r"meta\.json.*lists no files",
        ),
    ],
)
def test_load_refuses_a_damaged_file_and_names_it(tmp_path, damage, match):
    model, opt, sched = _build(0)
    _train(model, opt, sched, 1)
    path = ckpt.save(tmp_path, 1, model=model, optimizer=opt, lr_scheduler=sched)
    damage(path)
    model2, opt2, sched2 = _build(0)
    with pytest.raises(files.CheckpointError, match=match):
        ckpt.load(path, model=model2, optimizer=opt2, lr_scheduler=sched2)


def test_unreadable_files_of_unverifiable_checkpoints_are_wrapped(tmp_path):
    """A checkpoint without checksums (format 1) still loads, with a warning; a garbled file in it is a
    CheckpointError naming the file, never a raw safetensors or JSON exception."""
    model, opt, sched = _build(0)
    _train(model, opt, sched, 1)
    path = ckpt.save(tmp_path, 1, model=model, optimizer=opt, lr_scheduler=sched, extra_state={"v": 1})
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]
    meta["format_version"] = 1
    (path / "meta.json").write_text(json.dumps(meta))
    model2, opt2, sched2 = _build(3)
    with pytest.warns(UserWarning, match="cannot be verified"):
        assert ckpt.load(path, model=model2, optimizer=opt2, lr_scheduler=sched2) == (1, {"v": 1})
    assert torch.equal(_linear(model2, 2).weight, _linear(model, 2).weight)

    (path / "optimizer.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.warns(UserWarning), pytest.raises(files.CheckpointError, match=r"optimizer\.safetensors"):
        ckpt.load(path, model=model2, optimizer=opt2)
    (path / "lr_scheduler.json").write_text("{not json")
    with pytest.warns(UserWarning), pytest.raises(files.CheckpointError, match=r"lr_scheduler\.json"):
        ckpt.load(path, model=model2, lr_scheduler=sched2)


def test_latest_valid_walks_back_past_broken_checkpoints(tmp_path):
    model, opt, _ = _build(0)
    for step in (1, 2, 3, 4):
        ckpt.save(tmp_path, step, model=model, optimizer=opt)
    _flip_byte(tmp_path / "step_000004" / "model.safetensors")
    (tmp_path / "step_000003" / "meta.json").write_text("")
    with pytest.warns(UserWarning) as record:
        assert ckpt.latest_valid(tmp_path) == tmp_path / "step_000002"
    msgs = [str(w.message) for w in record]
    assert len(msgs) == 2 and all("\n" not in m for m in msgs)
    assert "step_000004" in msgs[0] and "model.safetensors" in msgs[0]
    assert "step_000003" in msgs[1] and "meta.json" in msgs[1]
    assert ckpt.latest(tmp_path) == tmp_path / "step_000004"  # latest() only looks for meta.json
    # load(<root>) resumes from the newest verified checkpoint too
    model2, opt2, _ = _build(1)
    with pytest.warns(UserWarning) as record:
        assert ckpt.load(tmp_path, model=model2, optimizer=opt2)[0] == 2
    assert [str(w.message).split(":")[1] for w in record] == [
        f" skipping {tmp_path / 'step_000004'}",
        f" skipping {tmp_path / 'step_000003'}",
    ]
    for step in (1, 2):
        (tmp_path / step_dir(step) / "model.safetensors").unlink()
    with pytest.warns(UserWarning):
        assert ckpt.latest_valid(tmp_path) is None
    assert ckpt.latest_valid(tmp_path / "nothing_here") is None


def step_dir(step: int) -> str:
    return ckpt.step_dir_name(step)


def test_cleanup_keeps_temp_dirs_of_live_processes(tmp_path):
    """Two writers into one directory must not delete each other's half-written checkpoint."""
    model, _, _ = _build(0)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        mine = tmp_path / f".tmp_step_000005_{live.pid}"
        mine.mkdir(parents=True)
        stale = tmp_path / f".tmp_old_step_000002_{dead.pid}"
        stale.mkdir()
        ckpt.save(tmp_path, 1, model=model)
        assert mine.is_dir() and not stale.exists()
    finally:
        live.kill()
        live.wait()


def test_nan_in_optimizer_or_scheduler_state_is_refused_before_writing(tmp_path):
    model, opt, sched = _build(0)
    _train(model, opt, sched, 1)
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(TypeError, match="optimizer.*NaN"):
        ckpt.save(tmp_path, 1, model=model, optimizer=opt)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    # the caller's extra_state may hold NaN (e.g. a statistic of no samples yet)
    ckpt.save(tmp_path, 1, model=model, extra_state={"mean": float("nan")})
    model2, _, _ = _build(0)
    assert np.isnan(ckpt.load(tmp_path, model=model2)[1]["mean"])
