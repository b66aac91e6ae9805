"""The first update trains exactly the rollout's forwards, when a rank's mini-batch holds fewer samples than
sampling.micro_batch or its rollout micro-batches do not divide among the mini-batches.

Exactness (first-update log-prob gap 0) needs each training forward to have the rows, hence the shapes, of a
rollout forward: a GPU may round a matmul of another shape differently (CPU kernels, eager or inductor, fp32 or
bf16, give a regrouped row the same bits, so the gap alone cannot fail here and the tests compare the shapes). E.g. 1 prompt x 4 images, micro-batch 4 and 2 optimizer
steps: a 4-row rollout forward would be trained as two 2-row forwards; the rollout takes 2-row forwards instead.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from fgrpo import algorithms
from fgrpo.config import AlgoConfig, GRPOConfig, SamplingConfig, TrainConfig
from fgrpo.core import grpo
from fgrpo.models.base import ImagePrompt
from fgrpo.models.lora import add_lora
from fgrpo.models.tiny import tiny_qwen_image_edit
from fgrpo.recompute import exact_micro_batch, micro_batches, minibatch_rows
from fgrpo.rollout.engine import DiffusersEngine, forward_units

SIZE = 32
SAMPLING = SamplingConfig(
    height=SIZE, width=SIZE, num_steps=4, guidance_scale=4.0, negative_prompt=" ", noise_level=1.2, window_size=2,
    window_range=(0, 3), micro_batch=4,
)  # fmt: skip
TEXTS = ["make it blue", "a sign that says hello world on a red wall", "x"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    d = tmp_path_factory.mktemp("cond")
    out = []
    for i, text in enumerate(TEXTS):
        image = Image.new("RGB", (SIZE, SIZE), (40 + 80 * i, 200 - 60 * i, 90))
        image.paste((230, 30, 200), (4 * i, 6, 20 + 4 * i, 26))
        image.save(d / f"{i}.png")
        out.append(ImagePrompt(text, d / f"{i}.png"))
    return out


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = tiny_qwen_image_edit(seed=0, condition_area=SIZE * SIZE)
    add_lora(m.transformer, rank=4, alpha=4, init=False)  # random A and B: the adapter matters
    return m


def test_exact_micro_batch_hand_values():
    # (n samples, sampling.micro_batch, mini-batches) -> rows per forward
    cases = {
        (4, 4, 2): 2,
        (8, 4, 2): 4,
        (24, 8, 2): 6,
        (24, 16, 2): 12,
        (28, 4, 4): 4,
        (256, 4, 2): 4,
        (4, 8, 1): 4,
    }
    assert {c: exact_micro_batch(*c) for c in cases} == cases


@pytest.mark.parametrize(
    "n, micro_batch, k", [(4, 4, 2), (12, 4, 2), (8, 4, 4), (48, 8, 4), (28, 4, 4), (16, 4, 2)]
)
@pytest.mark.parametrize("windowed", [False, True], ids=["no-window", "per-sample-windows"])
def test_minibatch_rows_deal_whole_rollout_micro_batches(n, micro_batch, k, windowed):
    rows_per_forward = exact_micro_batch(n, micro_batch, k)
    if windowed:  # per-sample windows of 2 in steps [0, 5): the rollout groups rows by window start
        start = torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(n))
        window = torch.stack([start, start + 1], dim=1)
        rollout = {tuple(u.tolist()) for u in forward_units(window, rows_per_forward)}
        assert rows_per_forward == n or rollout != {
            tuple(range(r.start, r.stop)) for r in micro_batches(n, rows_per_forward)
        }
    else:  # no windows: the rollout's forwards are consecutive rows
        window = torch.zeros(n, 0, dtype=torch.long)
        rollout = {tuple(range(r.start, r.stop)) for r in micro_batches(n, rows_per_forward)}
    chunks = minibatch_rows(window, micro_batch, micro_batch, k, torch.Generator().manual_seed(0))
    assert len(chunks) == k and all(chunks)
    assert sorted(torch.cat([r for c in chunks for r in c]).tolist()) == list(range(n))
    assert {tuple(r.tolist()) for c in chunks for r in c} <= rollout
    counts = [len(c) for c in chunks]
    assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize(
    "num_prompts, steps, algo",
    [(1, 2, "grpo"), (3, 2, "grpo"), (2, 4, "grpo"), (1, 2, "mixgrpo")],
    ids=[
        "one-forward-two-minibatches",
        "three-forwards-two-minibatches",
        "two-prompts-four-minibatches",
        "mixgrpo",
    ],
)
def test_training_forwards_are_rollout_forwards(model, prompts, num_prompts, steps, algo):
    """Every training forward has the shapes (rows, text length, padding mask or none) of a rollout forward of
    the SDE window, and the first update's log-probs equal the rollout's."""
    cfg = dataclasses.replace(
        TrainConfig(),
        sampling=SAMPLING,
        grpo=GRPOConfig(
            group_size=4, prompts_per_step=num_prompts, optimizer_steps_per_step=steps, clip_range=1.0
        ),
        algo=AlgoConfig(name=algo),
    )
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    algo_ = algorithms.build(cfg, params)
    shapes: list[tuple] = []

    def record(module, args, kwargs):
        if torch.is_grad_enabled():  # the window's forwards: the rollout's through the training graph
            mask = kwargs["encoder_hidden_states_mask"]
            shapes.append(
                (
                    tuple(kwargs["hidden_states"].shape),
                    tuple(kwargs["encoder_hidden_states"].shape),
                    mask is None,
                )
            )

    handle = model.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        batch = [p for p in prompts[:num_prompts] for _ in range(4)]
        with torch.no_grad():
            traj = DiffusersEngine(model, train_graph=True).generate(
                batch, list(range(len(batch))), algo_.sampling(0)
            )
        rollout, shapes[:] = set(shapes), []
        adv = grpo.group_advantages(torch.randn(len(batch), generator=torch.Generator().manual_seed(0)), 4)
        opt = torch.optim.SGD(params, lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
        m = algo_.update(model, params, opt, sched, traj, adv, torch.Generator().manual_seed(0))
    finally:
        handle.remove()
        with torch.no_grad():
            for p, t in zip(params, saved):
                p.copy_(t)
    assert shapes and set(shapes) <= rollout, (set(shapes) - rollout, rollout)
    assert m["logprob_gap/max"] == 0.0
