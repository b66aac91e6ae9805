"""Rollout throughput of the in-process engine on a real-size Qwen-Image: one table.

The transformer (20B, the real config = diffusers' defaults) and the VAE are built directly on the GPU
with random bf16 weights, so nothing is downloaded; by default the 7B text encoder is replaced by random
prompt embeddings of the real width (3584) and realistic lengths, since prompts are encoded once per
prompt and cached (`--text-encoder` builds a random real-size Qwen2.5-VL instead). Each row is one
`DiffusersEngine.generate` call: B samples (groups of G per prompt), 512x512, 10 steps, true CFG 4
(one batched forward of 2B rows per step), flow_sde window of 2 steps, VAE decode included.

Columns: images/s; ms per sample-step (whole rollout / (B x steps)); ms per forward (transformer time,
rollout minus VAE decode, per sample per single non-CFG forward: compare with the measured ceilings
39.2 ms eager / 30.8 ms compiled); effective TFLOP/s (16.65 TFLOP per 512^2 forward per sample, over the
whole rollout time); peak memory. Modes: eager, then regional torch.compile of the transformer blocks.

GPU:  python benchmarks/rollout.py                   (about 5 min on one H200)
CPU:  python benchmarks/rollout.py --tiny            (tiny random model, checks the script end to end)
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from fgrpo.models.loading import configure_transformer
from fgrpo.models.qwen_image import QwenImage
from fgrpo.models.sd3 import SD3
from fgrpo.rollout.base import SamplingConfig
from fgrpo.rollout.engine import DiffusersEngine
from fgrpo.rollout.seeds import sample_seed

TFLOP_PER_FORWARD_512 = 16.65  # one Qwen-Image transformer forward of one 512x512 sample (1024 image tokens)


class StubTextQwenImage(QwenImage):
    """Qwen-Image whose prompt encoder returns random embeddings of the real shape (no 7B encoder).

    Length: the template's 5 suffix tokens plus ~1 token per 4 characters, like Qwen's tokenizer on English.
    """

    def _encode_one(self, prompt: str) -> tuple[torch.Tensor]:
        length = 5 + math.ceil(len(prompt) / 4)
        gen = torch.Generator().manual_seed(sample_seed(len(prompt), *map(ord, prompt[:32])))
        width = self.transformer.config.joint_attention_dim
        return (torch.randn(length, width, generator=gen).to(self.device, self.dtype),)


def build_real(device: torch.device, text_encoder: bool, layers: int = 60) -> QwenImage:
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters are created in bf16 on the GPU: no fp32 copy
    try:
        with torch.device(device):
            transformer = QwenImageTransformer2DModel(
                num_layers=layers
            )  # defaults = Qwen/Qwen-Image's config
            vae = AutoencoderKLQwenImage()
            encoder = tokenizer = None
            if text_encoder:
                encoder, tokenizer = _real_size_text_encoder()
    finally:
        torch.set_default_dtype(default)
    cls = QwenImage if text_encoder else StubTextQwenImage
    return cls.from_modules(transformer, vae, encoder, tokenizer, device=device)


class StubTextSD3(SD3):
    """SD3.5 whose prompt encoder returns random embeddings of the real shapes (no CLIP-L/G, no T5-XXL):
    77 CLIP + 256 T5 tokens of width 4096 and a pooled vector of 2048, as StableDiffusion3Pipeline makes."""

    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(sample_seed(len(prompt), *map(ord, prompt[:32])))
        cfg = self.transformer.config
        embeds = torch.randn(77 + self.max_sequence_length, cfg.joint_attention_dim, generator=gen)
        pooled = torch.randn(cfg.pooled_projection_dim, generator=gen)
        return embeds.to(self.device, self.dtype), pooled.to(self.device, self.dtype)


def build_real_sd3(device: torch.device, layers: int = 24) -> SD3:
    """SD3.5-Medium at real size with random bf16 weights (stabilityai/stable-diffusion-3.5-medium's transformer
    and VAE configs: 24 MMDiT-X blocks, dual attention in the first 13, qk RMS-norm; 16-channel VAE) and stub
    text encoders."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            transformer = SD3Transformer2DModel(
                sample_size=128,
                patch_size=2,
                in_channels=16,
                num_layers=layers,
                attention_head_dim=64,
                num_attention_heads=24,
                joint_attention_dim=4096,
                caption_projection_dim=1536,
                pooled_projection_dim=2048,
                out_channels=16,
                pos_embed_max_size=384,
                dual_attention_layers=tuple(range(min(13, layers))),
                qk_norm="rms_norm",
            )
            vae = AutoencoderKL(
                in_channels=3,
                out_channels=3,
                down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(128, 256, 512, 512),
                layers_per_block=2,
                latent_channels=16,
                shift_factor=0.0609,
                scaling_factor=1.5305,
                use_quant_conv=False,
                use_post_quant_conv=False,
            )
    finally:
        torch.set_default_dtype(default)
    unused = [torch.nn.Identity(), torch.nn.Identity(), None]  # the stub encodes; CLIPs are never called
    return StubTextSD3.from_modules(transformer, vae, unused, [None, None, None], device=device)


def _real_size_text_encoder():
    """Random Qwen2.5-VL-7B text tower (the vision tower shrunk: it is never run) + the offline tokenizer."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from fgrpo.models.tiny import tiny_qwen_tokenizer

    text = dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        rope_theta=1e6,
        rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    )
    vision = dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2, out_hidden_size=3584)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, vocab_size=152064)
    return Qwen2_5_VLForConditionalGeneration(config), tiny_qwen_tokenizer()


def build_tiny() -> QwenImage:
    from fgrpo.models.tiny import tiny_qwen_image

    return tiny_qwen_image(seed=0)


def prompts_for(batch: int, group: int, run: int) -> list[str]:
    """B prompts in groups of G; fresh strings per run so prompt encoding is part of every rollout."""
    texts = [
        f"run {run:03d} prompt {p:03d}: a storefront sign that says OPEN 24 HOURS in neon"
        for p in range(batch)
    ]
    return [texts[i // group] for i in range(batch)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(model, cfg: SamplingConfig, batch: int, group: int, run: int, device) -> dict:
    engine = DiffusersEngine(model)
    prompts = prompts_for(batch, group, run)
    seeds = [sample_seed(run, i) for i in range(batch)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    traj = engine.generate(prompts, seeds, cfg)
    sync(device)
    total = time.perf_counter() - t0
    # The decode share, to report transformer-only time per forward.
    x0 = torch.randn(batch, *model.latent_shape(cfg.height, cfg.width), device=device)
    sync(device)
    t0 = time.perf_counter()
    model.decode(x0, cfg.height, cfg.width)
    sync(device)
    decode = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    assert traj.images.shape[0] == batch
    return {
        "total": total,
        "decode": decode,
        "peak_gib": peak,
        "finite": bool(torch.isfinite(traj.log_prob).all()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny random Qwen-Image on the CPU (script check)")
    ap.add_argument("--batch-sizes", default="", help="comma-separated B (default 8,16,32; tiny: 2,4)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt G")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cfg", type=float, default=4.0, help="true-CFG scale (1 = no CFG)")
    ap.add_argument("--resolution", type=int, default=0, help="pixels (default 512; tiny: 64)")
    ap.add_argument("--modes", default="eager,compile", help="eager and/or compile (regional, blocks only)")
    ap.add_argument("--attention-backend", default="", help="diffusers attention backend name; '' = SDPA")
    ap.add_argument("--text-encoder", action="store_true", help="random real-size Qwen2.5-VL instead of stub")
    ap.add_argument(
        "--layers", type=int, default=60, help="transformer blocks of the real-size model (debug)"
    )
    ap.add_argument("--device", default="", help="default: cuda (tiny: cpu)")
    ap.add_argument(
        "--budget-min", type=float, default=8.0, help="skip remaining rows after this many minutes"
    )
    args = ap.parse_args()

    start = time.perf_counter()
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    batches = [int(b) for b in (args.batch_sizes or ("2,4" if args.tiny else "8,16,32")).split(",")]
    res = args.resolution or (64 if args.tiny else 512)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.tiny and "compile" in modes and args.modes == ap.get_default("modes"):
        modes = ["eager"]  # inductor on this CPU takes minutes per shape; ask for it explicitly
    torch.backends.cuda.matmul.allow_tf32 = True
    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64

    model = build_tiny() if args.tiny else build_real(device, args.text_encoder, args.layers)
    if args.attention_backend:
        configure_transformer(model.transformer, attention_backend=args.attention_backend)
    n_params = sum(p.numel() for p in model.transformer.parameters())
    print(
        f"# Qwen-Image rollout: transformer {n_params / 1e9:.2f}B params {model.dtype}, {res}x{res}, "
        f"{args.steps} steps, CFG {args.cfg}, G={args.group}, device={torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
        f"torch {torch.__version__}, built in {time.perf_counter() - start:.0f}s"
    )
    cfg = SamplingConfig(
        height=res, width=res, num_steps=args.steps, guidance_scale=args.cfg, negative_prompt=" ",
        window_size=2, window_range=(0, min(5, args.steps)), micro_batch=max(batches),
    )  # fmt: skip
    forwards = 2 if args.cfg > 1 else 1
    flop_scale = (res / 512) ** 2  # attention's quadratic part ignored: only 512^2 is the reference point

    header = f"{'mode':8} {'B':>3} {'img/s':>7} {'ms/sample-step':>15} {'ms/forward':>11} {'TFLOP/s':>8} {'decode s':>9} {'peak GiB':>9} {'total s':>8}"
    rows = []
    run = 0
    fullgraph_failed = False
    for mode in modes:
        if mode == "compile":
            try:
                configure_transformer(model.transformer, compile_blocks=True)
            except Exception as e:  # keep the eager rows even if this torch cannot compile the blocks
                rows.append(f"compile  failed: {type(e).__name__}: {e}"[:200])
                continue
        for batch in batches:
            if time.perf_counter() - start > args.budget_min * 60:
                rows.append(f"{mode:8} {batch:>3} skipped (time budget --budget-min {args.budget_min})")
                continue
            c = SamplingConfig(**{**cfg.__dict__, "micro_batch": batch})
            warm = SamplingConfig(**{**c.__dict__, "num_steps": 2, "window_range": (0, 2)})
            try:
                run += 1
                try:
                    run_one(model, warm, batch, args.group, run, device)  # compile / allocator warm-up
                except Exception as e:
                    if mode != "compile" or fullgraph_failed:
                        raise
                    # A graph break somewhere in the block: compile the pieces between breaks instead.
                    fullgraph_failed = True
                    print(
                        f"# fullgraph compile failed ({type(e).__name__}: {str(e)[:120]}); retrying fullgraph=False"
                    )
                    model.transformer.compile_repeated_blocks(fullgraph=False)
                    run_one(model, warm, batch, args.group, run, device)
                run += 1
                r = run_one(model, c, batch, args.group, run, device)
            except Exception as e:
                rows.append(f"{mode:8} {batch:>3} failed: {type(e).__name__}: {e}"[:200])
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            sample_steps = batch * args.steps
            tflops = sample_steps * forwards * TFLOP_PER_FORWARD_512 * flop_scale / r["total"]
            ms_fwd = (r["total"] - r["decode"]) * 1e3 / (sample_steps * forwards)
            rows.append(
                f"{mode:8} {batch:>3} {batch / r['total']:>7.2f} {r['total'] * 1e3 / sample_steps:>15.1f} "
                f"{ms_fwd:>11.1f} {tflops if not args.tiny else float('nan'):>8.1f} {r['decode']:>9.2f} "
                f"{r['peak_gib']:>9.1f} {r['total']:>8.2f}"
                + ("" if r["finite"] else "  (non-finite log-probs)")
            )
            print(rows[-1], flush=True)
    print()
    print(header)
    for r in rows:
        print(r)
    print(f"# wall {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
