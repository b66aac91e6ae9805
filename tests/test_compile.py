"""Regional torch.compile of the transformer blocks in the full rollout + training path (CPU).

The block is traced in more variants than dynamo's default limit of 8 (no-grad rollout vs training forward,
first block vs the rest, padding mask or none, checkpoint recompute, new prompt lengths); with fullgraph=True
that limit was a hard FailOnRecompileLimitHit on the H200. The "eager" backend traces and guards exactly as
inductor does without generating kernels, so this runs in seconds.
"""

import dataclasses
from typing import Any, Literal

import pytest
import torch

from fgrpo import algorithms, parallel
from fgrpo.config import GRPOConfig, ModelConfig, SamplingConfig, TrainConfig
from fgrpo.core import grpo
from fgrpo.models.loading import configure_transformer
from fgrpo.models.lora import setup_trainable
from fgrpo.models.tiny import tiny_qwen_image, tiny_qwen_image_edit, tiny_sd3
from fgrpo.rollout.engine import DiffusersEngine


def _compiled_tiny_setup(
    *, dtype: Literal["bf16", "fp32"], backend: str, clip_range: float = GRPOConfig().clip_range
):
    """Tiny Qwen-Image with LoRA, regional compile on `backend`, FSDP2 world of one, and the trainer's config:
    (model, params, optimizer, lr scheduler, train config)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    parallel.init_distributed("cpu")
    torch.manual_seed(0)
    model = tiny_qwen_image(seed=0, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    s = SamplingConfig(
        height=32,
        width=32,
        num_steps=4,
        guidance_scale=4.0,
        negative_prompt=" ",
        noise_level=1.2,
        window_size=2,
        window_range=(0, 3),
        micro_batch=4,
    )
    mcfg = ModelConfig(
        kind="tiny_qwen_image",
        dtype=dtype,
        lora_rank=4,
        lora_alpha=8,
        gradient_checkpointing=True,
        compile=True,
    )
    cfg = dataclasses.replace(
        TrainConfig(),
        model=mcfg,
        sampling=s,
        grpo=GRPOConfig(group_size=4, prompts_per_step=2, optimizer_steps_per_step=2, clip_range=clip_range),
    )
    setup_trainable(model.transformer, mcfg)
    configure_transformer(model.transformer, compile_blocks=True, compile_backend=backend)
    parallel.shard_transformer(model.transformer, param_dtype=None)
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    return model, params, opt, sched, cfg


def test_compiled_blocks_train_with_varying_prompt_lengths():
    model, params, opt, sched, cfg = _compiled_tiny_setup(dtype="fp32", backend="eager")
    s = cfg.sampling
    engine = DiffusersEngine(model)
    texts = ["a", "a sign that says hello world", "a red square", "a cat holding a sign on a blue background"]
    try:
        for it in range(2):  # the second step brings new prompt lengths
            prompts = [texts[2 * it + p] for p in range(2) for _ in range(4)]
            with torch.no_grad():
                traj = engine.generate(prompts, list(range(8)), s)
            adv = grpo.group_advantages(torch.randn(8, generator=torch.Generator().manual_seed(it)), 4)
            m = algorithms.build(cfg, params).update(
                model, params, opt, sched, traj, adv, torch.Generator().manual_seed(it)
            )
            # compiled rollout and compiled training forward still agree exactly at unchanged weights
            assert m["logprob_gap/max"] == 0.0
            assert m["skipped_steps"] == 0.0
        # the variants really exceed dynamo's default limit of 8: without the raised limit this test fails
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 8
    finally:
        torch._dynamo.reset()


def test_sd3_regional_compile_keeps_the_velocity():
    """diffusers 0.40's SD3Transformer2DModel names no repeated block; configure_transformer names its layers'
    class, so the trainer's compile_repeated_blocks compiles them (without it: ValueError "_repeated_blocks
    attribute is empty")."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_sd3(seed=0)
    cond = model.encode(["a cat", "a red square"], negative_prompt=" ")
    x = torch.randn(2, *model.latent_shape(64, 64), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7, 0.4])
    ref = model.velocity(x, sigma, cond, guidance_scale=3.0)
    try:
        configure_transformer(model.transformer, compile_blocks=True, compile_backend="eager")
        assert torch.equal(model.velocity(x, sigma, cond, guidance_scale=3.0), ref)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the blocks ran compiled
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("arch", ["", "sd3"], ids=["qwen_image", "sd3"])
def test_text_renderer_takes_the_compile_flag(arch, monkeypatch):
    """model.compile reaches the text renderer as it reaches every other family (it was silently ignored): its
    blocks are compiled, and with the "eager" backend the velocity is unchanged, for both architectures."""
    from fgrpo.models import loading, registry
    from fgrpo.models.textbed import load_textbed, prompt_for

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    configure = loading.configure_transformer
    monkeypatch.setattr(
        registry, "configure_transformer", lambda t, **kw: configure(t, **kw, compile_backend="eager")
    )
    reference = load_textbed(arch)
    model = registry.build_model(
        ModelConfig(kind="textbed", path=arch, dtype="fp32", compile=True), torch.device("cpu"), seed=0
    )
    prompts = [prompt_for("RIVER"), prompt_for("CAT")]
    x = torch.randn(2, *model.latent_shape(32, 128), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7, 0.4])
    expected = reference.velocity(x, sigma, reference.encode(prompts), guidance_scale=1.0)
    try:
        assert getattr(model.transformer, "_fgrpo_compiled", False)
        assert torch.equal(model.velocity(x, sigma, model.encode(prompts), guidance_scale=1.0), expected)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the blocks ran compiled
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_rollout_through_the_training_graph_is_exact():
    """With inductor (bf16, FSDP2 world of one), the no-grad rollout graph and the training graph round
    differently: the first update's log-probs differ from the rollout's by 1.7e-3 on this CPU. Rolled out
    through the training graph (DiffusersEngine(train_graph=True), what model.exact_rollout sets), the first
    update's forward reproduces them bit for bit, so old_log_prob='rollout' needs no recompute when compiled."""
    model, params, opt, sched, cfg = _compiled_tiny_setup(dtype="bf16", backend="inductor", clip_range=1.0)
    s = cfg.sampling
    prompts = [t for t in ("a", "a sign that says hello world") for _ in range(4)]
    try:
        with torch.no_grad():
            traj = DiffusersEngine(model, train_graph=True).generate(prompts, list(range(8)), s)
        adv = grpo.group_advantages(torch.randn(8, generator=torch.Generator().manual_seed(0)), 4)
        m = algorithms.build(cfg, params).update(
            model, params, opt, sched, traj, adv, torch.Generator().manual_seed(0)
        )
        assert m["logprob_gap/max"] == 0.0
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_selective_checkpointing_of_compiled_blocks():
    """Selective checkpointing kept matmul outputs of a block compiled on its own, which inductor's generated code
    then reused as scratch buffers: the backward raised "Tensor cached during selective activation checkpoint has
    been mutated" (the H200's first compiled step, and here). The checkpoint now sits inside each block's compiled
    forward; the gradients are the uncompiled, uncheckpointed ones within fp32 rounding."""
    grads = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = tiny_qwen_image(seed=0)
        mcfg = ModelConfig(
            kind="tiny_qwen_image",
            lora_rank=4,
            lora_alpha=8,
            gradient_checkpointing=compiled,
            checkpoint_policy="selective",
            compile=compiled,
        )
        params = setup_trainable(model.transformer, mcfg)
        if compiled:
            configure_transformer(model.transformer, compile_blocks=True, compile_backend="inductor")
        cond = model.encode(["a sign that says hi", "a cat"], negative_prompt=" ")
        x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
        try:
            v = model.velocity(x, torch.tensor([0.7, 0.4]), cond, guidance_scale=3.0)
            v.square().sum().backward()
        finally:
            torch._dynamo.reset()
        # the last block's text-stream outputs are discarded: eager leaves those adapters' gradients None, the
        # compiled graph returns zeros
        grads[compiled] = torch.cat(
            [(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params]
        )
    assert grads[False].abs().max() > 0.1  # a real gradient
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-4, atol=1e-5)


def test_edit_model_compiles_its_blocks_without_comprehensive_padding(monkeypatch):
    """Qwen-Image-Edit's compiled training backward failed inductor's stride assert on the H200 (a padded text
    stride); it compiles its blocks with comprehensive padding off, the other families with inductor's defaults.
    (The CPU does not reproduce the failure: this checks that the option reaches the blocks' compile.)"""
    seen = {"edit": [], "t2i": []}
    for name, model in (("edit", tiny_qwen_image_edit(seed=0)), ("t2i", tiny_qwen_image(seed=0))):
        monkeypatch.setattr(
            model.transformer, "compile_repeated_blocks", lambda calls=seen[name], **kw: calls.append(kw)
        )
        configure_transformer(model.transformer, compile_blocks=True)
        configure_transformer(model.transformer, compile_blocks=True, compile_backend="eager")
    assert [kw["options"] for kw in seen["edit"]] == [
        {"comprehensive_padding": False},
        None,
    ]  # eager: no inductor
    assert [kw["options"] for kw in seen["t2i"]] == [None, None]


@pytest.mark.parametrize("kind", ["tiny_sd3", "tiny_qwen_image"])
def test_model_compile_compiles_the_vae_decoder(kind, monkeypatch):
    """model.compile compiles the VAE decoder too (build_model -> compile_decoder), in place: the VAE's parameter
    names stay, and with the "eager" backend the decoded pixels are the eager decoder's bit for bit."""
    from fgrpo.models import loading, registry

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    configure, compile_vae = loading.configure_transformer, loading.compile_decoder
    monkeypatch.setattr(
        registry, "configure_transformer", lambda t, **kw: configure(t, **kw, compile_backend="eager")
    )
    monkeypatch.setattr(registry, "compile_decoder", lambda m: compile_vae(m, backend="eager"))
    mcfg = ModelConfig(kind=kind, dtype="fp32", compile=True)
    reference = registry.build_model(dataclasses.replace(mcfg, compile=False), torch.device("cpu"), seed=0)
    model = registry.build_model(mcfg, torch.device("cpu"), seed=0)
    x0 = torch.randn(2, *model.latent_shape(64, 64), generator=torch.Generator().manual_seed(0))
    expected = reference.decode(x0, 64, 64)
    try:
        vae: Any = getattr(model, "vae")  # noqa: B009  # the families with a VAE; FlowModel declares none
        assert list(vae.state_dict()) == list(getattr(reference, "vae").state_dict())  # noqa: B009
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # nothing traced yet
        assert torch.equal(model.decode(x0, 64, 64), expected)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the decoder ran compiled
    finally:
        torch._dynamo.reset()


def test_compile_decoder_skips_a_model_without_a_vae_or_a_gain():
    """The text renderer paints pixels itself, LTX-2's video VAE decodes no faster compiled: nothing compiled."""
    from fgrpo.models.loading import compile_decoder
    from fgrpo.models.textbed import load_textbed
    from fgrpo.models.tiny import tiny_ltx2

    assert compile_decoder(load_textbed("")) is False
    ltx2 = tiny_ltx2(seed=0)
    assert compile_decoder(ltx2, backend="eager") is False
    assert getattr(ltx2.vae.decoder, "_compiled_call_impl", None) is None
    sd3 = tiny_sd3(seed=0)
    assert compile_decoder(sd3, backend="eager") is True
    assert sd3.vae.decoder._compiled_call_impl is not None
