"""fgrpo.core.guidance: analytic CFG cases and bit-equality with QwenImagePipeline's own true CFG."""

import contextlib
import math
from types import SimpleNamespace

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from fgrpo.core import guidance
from fgrpo.models import qwen_image


def test_cfg_endpoints_and_linearity():
    c, u = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0]])
    assert torch.equal(guidance.cfg(c, u, 1.0), c)
    assert torch.equal(guidance.cfg(c, u, 0.0), u)
    assert torch.equal(guidance.cfg(c, u, 4.0), torch.tensor([[-5.0, 11.0]]))  # u + 4 (c - u)


def test_true_cfg_analytic_cases():
    # Parallel velocities: guidance only lengthens, the rescale undoes it exactly.
    c, u = torch.tensor([[[3.0, 4.0]]]), torch.zeros(1, 1, 2)
    torch.testing.assert_close(guidance.true_cfg(c, u, 7.0), c)
    # Orthogonal unit velocities, s = 2: cfg = u + 2 (c - u) = (2, -1); rescaled to |c| = 1.
    c, u = torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[0.0, 1.0]]])
    torch.testing.assert_close(guidance.true_cfg(c, u, 2.0), torch.tensor([[[2.0, -1.0]]]) / math.sqrt(5))


def test_true_cfg_keeps_each_token_norm_and_the_cfg_direction():
    g = torch.Generator().manual_seed(0)
    c, u = torch.randn(2, 16, 64, generator=g), torch.randn(2, 16, 64, generator=g)
    out = guidance.true_cfg(c, u, 4.0)
    torch.testing.assert_close(out.norm(dim=-1), c.norm(dim=-1))
    cos = torch.nn.functional.cosine_similarity(out, guidance.cfg(c, u, 4.0), dim=-1)
    torch.testing.assert_close(cos, torch.ones(2, 16))


class _FixedVelocity(torch.nn.Module):
    """A stand-in Qwen-Image transformer: v_cond for the prompt's embeddings (ones), v_uncond for the negative's."""

    def __init__(self, v_cond: torch.Tensor, v_uncond: torch.Tensor):
        super().__init__()
        self.v_cond, self.v_uncond = v_cond, v_uncond
        self.device = torch.device(
            "cpu"
        )  # what the pipeline asks its components for (diffusers' ModelMixin.device)
        self.config = SimpleNamespace(in_channels=v_cond.shape[-1], guidance_embeds=False)

    def cache_context(self, name: str):
        return contextlib.nullcontext()

    def forward(self, *, encoder_hidden_states: torch.Tensor, **kwargs) -> tuple[torch.Tensor]:
        return (self.v_cond if bool(encoder_hidden_states.gt(0).all()) else self.v_uncond,)


def test_true_cfg_equals_qwen_image_pipeline_bit_for_bit():
    """QwenImagePipeline.__call__ itself guides the two velocities; we read what it hands the scheduler."""
    g = torch.Generator().manual_seed(1)
    B, seq, D, scale = 2, 256, 64, 4.0  # 256 x 256 px: (256 / 16)^2 tokens of 4 x 16 channels
    v_cond, v_uncond = torch.randn(B, seq, D, generator=g), torch.randn(B, seq, D, generator=g)
    scheduler = FlowMatchEulerDiscreteScheduler(**qwen_image.SCHEDULER_CONFIG)
    guided = []
    step = scheduler.step

    def record(model_output, *args, **kwargs):
        guided.append(model_output)
        return step(model_output, *args, **kwargs)

    scheduler.step = record
    pipe = QwenImagePipeline(
        scheduler=scheduler,
        vae=None,  # pyright: ignore[reportArgumentType]
        text_encoder=None,  # pyright: ignore[reportArgumentType]
        tokenizer=None,  # pyright: ignore[reportArgumentType]
        transformer=_FixedVelocity(v_cond, v_uncond),  # pyright: ignore[reportArgumentType]
    )
    pipe.set_progress_bar_config(disable=True)
    mask = torch.ones(B, 3, dtype=torch.long)
    pipe(
        prompt_embeds=torch.ones(B, 3, 8),
        prompt_embeds_mask=mask,
        negative_prompt_embeds=torch.zeros(B, 3, 8),
        negative_prompt_embeds_mask=mask,
        true_cfg_scale=scale,
        height=256,
        width=256,
        num_inference_steps=2,
        latents=torch.zeros(B, seq, D),
        output_type="latent",
    )
    ours = guidance.true_cfg(v_cond, v_uncond, scale)
    assert len(guided) == 2 and all(torch.equal(v, ours) for v in guided)
    assert not torch.equal(ours, guidance.cfg(v_cond, v_uncond, scale))  # the rescale did something


def test_true_cfg_token_dim():
    g = torch.Generator().manual_seed(2)
    c, u = torch.randn(2, 8, 4, 5, generator=g), torch.randn(2, 8, 4, 5, generator=g)
    out = guidance.true_cfg(c, u, 3.0, token_dim=1)
    ref = guidance.true_cfg(c.movedim(1, -1), u.movedim(1, -1), 3.0).movedim(-1, 1)
    torch.testing.assert_close(out, ref)


def test_true_cfg_zero_guided_velocity_stays_zero_with_finite_gradient():
    # s = 2, u = 2c: u + 2 (c - u) = 0 for this token.
    c = torch.tensor([[[1.0, 2.0], [1.0, 0.0]]], requires_grad=True)
    u = torch.tensor([[[2.0, 4.0], [0.0, 1.0]]])
    out = guidance.true_cfg(c, u, 2.0)
    assert torch.equal(out[0, 0], torch.zeros(2))
    (grad,) = torch.autograd.grad(out.sum(), c)
    assert torch.isfinite(grad).all()


def test_fp32_output_for_bf16_input():
    c, u = torch.randn(1, 4, 8).bfloat16(), torch.randn(1, 4, 8).bfloat16()
    assert guidance.true_cfg(c, u, 4.0).dtype == torch.float32
    assert guidance.cfg(c, u, 4.0).dtype == torch.float32


def test_renormed_cfg_hand_computed_and_clamped():
    """BAGEL's global renorm: the guided sample is scaled by |v_c| / |v| when that is below 1, left alone above."""
    v_c = torch.tensor([[3.0, 4.0], [1.0, 0.0]])  # norms 5 and 1
    v_u = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    out = guidance.renormed_cfg(v_c, v_u, 2.0)
    # row 0: cfg = (6, 8), norm 10 -> scaled by 5 / 10; row 1: cfg = v_c, ratio 1 (clamped, stays)
    torch.testing.assert_close(out, torch.tensor([[3.0, 4.0], [1.0, 0.0]]), rtol=0, atol=1e-6)
    # min_ratio floors the factor: 0.8 keeps row 0 at 0.8 * (6, 8)
    torch.testing.assert_close(
        guidance.renormed_cfg(v_c, v_u, 2.0, min_ratio=0.8)[0], torch.tensor([4.8, 6.4]), rtol=0, atol=1e-6
    )
    # a shorter guided velocity is not lengthened (unlike true_cfg): 0.5 * v_c keeps norm 2.5 < 5
    torch.testing.assert_close(guidance.renormed_cfg(v_c, v_u, 0.5)[0], torch.tensor([1.5, 2.0]))
