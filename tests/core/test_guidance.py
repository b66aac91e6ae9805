"""fgrpo.core.guidance: analytic CFG cases and bit-equality with QwenImagePipeline's true-CFG lines."""

import math

import torch

from fgrpo.core import guidance


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


def test_true_cfg_equals_qwen_image_pipeline_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    noise_pred, neg_noise_pred = torch.randn(2, 256, 64, generator=g), torch.randn(2, 256, 64, generator=g)
    true_cfg_scale = 4.0
    # diffusers 0.40 QwenImagePipeline.__call__, denoising loop:
    comb_pred = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)
    cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
    noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
    ref = comb_pred * (cond_norm / noise_norm)
    assert torch.equal(guidance.true_cfg(noise_pred, neg_noise_pred, true_cfg_scale), ref)


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
    out.sum().backward()
    assert torch.isfinite(c.grad).all()


def test_fp32_output_for_bf16_input():
    c, u = torch.randn(1, 4, 8).bfloat16(), torch.randn(1, 4, 8).bfloat16()
    assert guidance.true_cfg(c, u, 4.0).dtype == torch.float32
    assert guidance.cfg(c, u, 4.0).dtype == torch.float32
