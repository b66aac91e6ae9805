"""Ulysses sequence parallelism (--parallel.sp): SP=2 on 2 gloo ranks equals one unsplit rank.

The worker (this file run under torchrun) builds the tiny random Qwen-Image twice with the same LoRA: a plain
unsplit reference, and a copy sharded by FSDP2 over both ranks with diffusers' Ulysses attention splitting
every sequence over them. Both see the same batch - two prompts of different lengths, so the joint attention
carries a padding mask and the text needs padding to an even length, with true CFG - and must agree on the
velocity, the transition log-prob, the LoRA gradient (the split copy with gradient checkpointing, the recipe's
default) and the LoRA after one AdamW step, to fp32 rounding.
"""

import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from train_entry import Config

from fgrpo import parallel
from fgrpo.config import GRPOConfig, ModelConfig, ParallelConfig, validate_config
from fgrpo.models.registry import check_config

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
PROMPTS = ["a red apple on a wooden table", "x"]
LR = 1e-2


def _lora_named(transformer) -> dict[str, torch.Tensor]:
    return {n: p for n, p in transformer.named_parameters() if p.requires_grad}


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (collective), or the tensor itself."""
    return (t.full_tensor() if parallel.is_dtensor(t) else t).detach()


def _worker(out_path: str) -> None:
    from fgrpo.config import SamplingConfig
    from fgrpo.models.lora import add_lora
    from fgrpo.models.tiny import tiny_qwen_image
    from fgrpo.policy import transition_log_prob

    parallel.init_distributed("cpu")
    models = []
    for _ in range(2):
        m = tiny_qwen_image(seed=0)
        torch.manual_seed(
            1
        )  # the same random LoRA A and B in both copies (init=False: B != 0, every grad live)
        add_lora(m.transformer, rank=4, alpha=8, init=False)
        models.append(m)
    ref, sp = models
    sp.transformer.enable_gradient_checkpointing()  # the recipe's default: each block's split forward is redone
    parallel.init_sequence_parallel(2, torch.device("cpu"))
    parallel.shard_transformer(sp.transformer, param_dtype=None)
    parallel.enable_sequence_parallel(sp.transformer)

    cfg = SamplingConfig(height=64, width=48, guidance_scale=3.0, negative_prompt=" ", noise_level=0.9)
    g = torch.Generator().manual_seed(2)
    shape = (2, *ref.latent_shape(cfg.height, cfg.width))
    x_t, x_next = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    sigma, sigma_next = torch.full((2,), 0.7), torch.full((2,), 0.6)
    advantages = torch.tensor([1.0, -0.5])
    result: dict = {}
    for name, model in (("ref", ref), ("sp", sp)):
        cond = model.encode(PROMPTS, negative_prompt=cfg.negative_prompt)
        result["text_tokens"] = [int(n) for n in cond["prompt_mask"].sum(1)]
        with torch.no_grad():
            v = model.velocity(x_t, sigma, cond, guidance_scale=cfg.guidance_scale)
        log_prob, _, _ = transition_log_prob(model, x_t, x_next, sigma, sigma_next, cond, cfg)
        (-(advantages * log_prob).mean()).backward()
        params = _lora_named(model.transformer)
        grads = {n: _full(p.grad) if p.grad is not None else torch.zeros(p.shape) for n, p in params.items()}
        opt = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=0.0)
        opt.step()
        after = {n: _full(p) for n, p in params.items()}
        result[name] = {"v": v, "log_prob": log_prob.detach(), "grads": grads, "after": after}
    result["dp_rank_size_sp"] = [None, None]
    torch.distributed.all_gather_object(
        result["dp_rank_size_sp"], [parallel.dp_rank(), parallel.dp_size(), parallel.sp_size()]
    )
    if parallel.rank() == 0:
        torch.save(result, out_path)
    del ref, sp, models
    parallel.shutdown()


@pytest.mark.slow
def test_ulysses_sp2_matches_one_rank(tmp_path):
    out = tmp_path / "sp.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(29600 + os.getpid() % 1000),
        __file__,
        str(out),
    ]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = torch.load(out)
    # Both ranks are data shard 0 of 1: they hold the same samples and split their tokens.
    assert r["dp_rank_size_sp"] == [[0, 1, 2]] * 2
    # Odd text lengths of different size: the split needs padding and the joint attention a key mask.
    assert len(set(r["text_tokens"])) == 2 and any(n % 2 for n in r["text_tokens"])
    ref, sp = r["ref"], r["sp"]
    torch.testing.assert_close(sp["v"], ref["v"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sp["log_prob"], ref["log_prob"], rtol=1e-5, atol=1e-5)
    assert ref["grads"].keys() == sp["grads"].keys()
    # The last block's text outputs reach nothing (only image tokens are decoded): its text query, text output
    # and text MLP get no gradient; every other LoRA tensor does.
    dead = {k for k, gr in ref["grads"].items() if not gr.abs().max() > 0}
    last_text = ("blocks.1.attn.add_q_proj", "blocks.1.attn.to_add_out", "blocks.1.txt_mlp")
    assert dead == {k for k in ref["grads"] if any(t in k for t in last_text)} and len(dead) == 8
    # Measured: velocity 1e-6 apart, log-probs equal, gradients 6e-9 apart (of up to 6e-3). AdamW divides each
    # gradient element by its own magnitude, so an element near zero (5e-8) moves by a visibly different fraction
    # of lr: the weights agree to 1e-2 lr (4e-5 measured).
    for k, gr in ref["grads"].items():
        torch.testing.assert_close(sp["grads"][k], gr, rtol=1e-4, atol=1e-8, msg=k)
        torch.testing.assert_close(sp["after"][k], ref["after"][k], rtol=0, atol=1e-2 * LR, msg=k)


def _cfg(**parallel) -> Config:
    return replace(Config(), parallel=ParallelConfig(**parallel))


def test_sp_config_is_validated_before_any_work():
    validate_config(_cfg(sp=2), world_size=2)
    check_config(_cfg(sp=2))
    cases = [
        (_cfg(sp=3), 2, "parallel.sp=3 must be >= 1 and divide the world size 2"),
        (_cfg(sp=0), 2, "parallel.sp=0 must be >= 1"),
        (_cfg(sp=2, rollout_ranks=2), 4, "drop --parallel.rollout-ranks"),
        (replace(_cfg(sp=2), model=ModelConfig(kind="tiny_sd3")), 2, "supports model.kind in"),
        # 48x48 is 3x3 = 9 image tokens, no even split; 64 rows make 4x3 = 12.
        (
            replace(_cfg(sp=2), sampling=replace(Config().sampling, height=48, width=48)),
            2,
            "--sampling.height 64",
        ),
    ]
    for cfg, world, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            validate_config(cfg, world_size=world)
            check_config(cfg)
    # The step's samples are cut into world / sp shards: 2 samples fit 4 ranks as 2 SP groups, not as 4 ranks.
    two = GRPOConfig(group_size=2, prompts_per_step=1, optimizer_steps_per_step=1)
    validate_config(replace(_cfg(sp=2), grpo=two), world_size=4)
    with pytest.raises(ValueError, match="not divisible by the 4 training ranks"):
        validate_config(replace(_cfg(), grpo=two), world_size=4)


@pytest.mark.slow
def test_training_loop_with_sp2_matches_one_rank(tmp_path):
    """The loop with --parallel.sp 2 on 2 ranks trains what 1 rank trains: both ranks of the SP group draw the
    same 8 samples (one data shard, not two of 4), rewards are gathered over the data shards only, and FSDP2's
    reduce-scatter sums the two halves of each gradient. Weights after 2 steps agree as for 2 data-parallel
    ranks (test_train_e2e.assert_same_training)."""
    from test_train_e2e import assert_same_training, final_weights, run

    flags = ("--num-steps", "2", "--grpo.optimizer-steps-per-step", "1")
    run(tmp_path / "one", *flags)
    run(tmp_path / "sp", *flags, "--parallel.sp", "2", nproc=2)
    one, sp = final_weights(tmp_path / "one", 2), final_weights(tmp_path / "sp", 2)
    assert_same_training(one, sp, start=final_weights(tmp_path / "one", 1))


if __name__ == "__main__":
    _worker(sys.argv[1])
