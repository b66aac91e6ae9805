"""The policy update on real (tiny) rollouts: exact first-update ratio, split-invariant gradients."""

import copy
import dataclasses

import pytest
import torch

from fgrpo import algorithms
from fgrpo.config import GRPOConfig, OptimConfig, SamplingConfig, TrainConfig
from fgrpo.models.lora import add_lora
from fgrpo.models.tiny import tiny_qwen_image
from fgrpo.recompute import minibatch_rows
from fgrpo.rollout.engine import DiffusersEngine

SAMPLING = SamplingConfig(
    height=32,
    width=32,
    num_steps=4,
    guidance_scale=3.0,
    negative_prompt=" ",
    sde_kind="flow_sde",
    noise_level=0.9,
    window_size=2,
    window_range=(0, 3),
    micro_batch=4,
)


@pytest.fixture(scope="module")
def rollout():
    torch.manual_seed(0)
    model = tiny_qwen_image(seed=0)
    add_lora(model.transformer, rank=4, alpha=4, init=False)  # random A and B: the adapter matters
    prompts = ['a sign "OPEN"'] * 4 + ['a cup "TEA"'] * 4
    traj = DiffusersEngine(model).generate(prompts, list(range(8)), SAMPLING)
    return model, traj


def run_update(model, traj, grpo_cfg, advantages, lr=1.0):
    model = copy.deepcopy(model)
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    cfg = dataclasses.replace(
        TrainConfig(), sampling=SAMPLING, grpo=grpo_cfg, optim=OptimConfig(grad_clip=1e9)
    )
    metrics = algorithms.build(cfg, params).update(
        model, params, opt, sched, traj, advantages, torch.Generator().manual_seed(0)
    )
    return model, metrics


def lora_params(model):
    return {n: p.detach().clone() for n, p in model.transformer.named_parameters() if "lora_" in n}


def test_first_update_ratio_is_exactly_one(rollout):
    model, traj = rollout
    adv = torch.linspace(-1, 1, 8)
    _, m = run_update(
        model, traj, GRPOConfig(group_size=4, prompts_per_step=2, optimizer_steps_per_step=1), adv
    )
    # Training recomputes each transition with the rollout's rows and kernels: not close, identical.
    assert m["logprob_gap/max"] == 0.0
    assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0


def test_update_does_not_depend_on_micro_batch_split(rollout):
    model, traj = rollout
    adv = torch.linspace(-1, 1, 8)
    g = GRPOConfig(group_size=4, prompts_per_step=2, optimizer_steps_per_step=1, clip_range=1e-3)
    before = lora_params(model)
    big, _ = run_update(model, traj, dataclasses.replace(g, train_micro_batch=8), adv)
    small, _ = run_update(model, traj, dataclasses.replace(g, train_micro_batch=2), adv)
    a, b = lora_params(big), lora_params(small)
    moved = max((a[n] - before[n]).abs().max().item() for n in a)
    assert moved > 1e-6  # the update is not trivially zero
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-7)


def test_zero_advantages_leave_weights_unchanged(rollout):
    model, traj = rollout
    before = lora_params(model)
    after, m = run_update(model, traj, GRPOConfig(group_size=4, prompts_per_step=2), torch.zeros(8))
    assert m["grad_norm"] == 0.0
    for n, p in lora_params(after).items():
        assert torch.equal(p, before[n])


def test_minibatch_rows_partition_the_samples():
    g = torch.Generator().manual_seed(0)
    for mb, rollout_mb in [(4, 4), (3, 4)]:
        chunks = minibatch_rows(torch.zeros(16, 1, dtype=torch.long), mb, rollout_mb, 2, g)  # one window
        assert len(chunks) == 2
        rows = torch.cat([r for chunk in chunks for r in chunk])
        assert sorted(rows.tolist()) == list(range(16))
        if mb == rollout_mb:  # whole rollout micro-batches, consecutive rows
            for chunk in chunks:
                for r in chunk:
                    assert r.tolist() == list(range(int(r[0]), int(r[0]) + mb))
