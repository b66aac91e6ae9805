"""One full Flow-GRPO step of the Qwen-Image OCR LoRA recipe at real size, phase by phase.

Real-size QwenImageTransformer2DModel (20 B) and AutoencoderKLQwenImage with random weights built on
the GPU by benchmarks/rollout.py's `build_real`; the 7 B text encoder is replaced by fixed random prompt
embeddings of realistic lengths (its cost is one forward per distinct prompt, cached over the group). The reward is a stub (random scores);
the OCR reward's cost is measured separately in benchmarks/rewards.py. Everything else is the
trainer's own code: DiffusersEngine.generate, train.policy_update (LoRA r64, FSDP2 world of one, bf16
compute, fp32 masters, gradient checkpointing), recompute of old log-probs.

    python benchmarks/train_step.py                      # H200: 2 prompts x 16 images, eager
    python benchmarks/train_step.py --compile            # regional torch.compile of the blocks
    python benchmarks/train_step.py --tiny               # CPU wiring check with a tiny model

Ceilings: 16.65 TFLOP per 512² transformer forward (one sequence); per image the recipe does
10 steps x 2 (true-CFG) forwards in rollout and W=2 x 2 x (forward + input-grad backward + checkpoint
recompute ~ 3 forwards) in training: 20 + 12 = 32 forwards = 533 TFLOP.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from rollout import build_real, build_tiny  # benchmarks/rollout.py: the same random real-size model

TFLOP_PER_FORWARD_512 = 16.65
MATMUL_TFLOPS_H200 = 755.0  # bf16, measured on this machine kind (see RESULTS.md)
VERL_OMNI_IMAGES_PER_GPU_S = 0.305  # published, 4xH800, LoRA + CFG, same recipe

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random model on CPU (wiring check)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step on this GPU")
    ap.add_argument("--group", type=int, default=16, help="images per prompt")
    ap.add_argument("--micro-batch", type=int, default=8, help="samples per forward (x2 sequences with CFG)")
    ap.add_argument("--compile", action="store_true", help="regional torch.compile of the transformer blocks")
    ap.add_argument("--iters", type=int, default=2, help="timed steps (after one warm-up step)")
    args = ap.parse_args()

    from fgrpo import parallel
    from fgrpo.config import GRPOConfig, ModelConfig, OptimConfig, TrainConfig
    from fgrpo.core import grpo
    from fgrpo.models.loading import configure_transformer
    from fgrpo.rollout.base import SamplingConfig
    from fgrpo.rollout.engine import DiffusersEngine
    from fgrpo.train import policy_update, recompute_log_probs_and_means, setup_trainable

    d = parallel.init_distributed("cpu" if args.tiny else "cuda")
    model = build_tiny() if args.tiny else build_real(d.device, text_encoder=False)
    res = 64 if args.tiny else 512
    sampling = SamplingConfig(height=res, width=res, num_steps=10, guidance_scale=4.0, negative_prompt=" ",
                              sde_kind="flow_sde", noise_level=1.2, window_size=2, window_range=(0, 5),
                              micro_batch=args.micro_batch)
    mcfg = ModelConfig(kind="qwen_image", dtype="bf16", lora_rank=64, lora_alpha=128, gradient_checkpointing=True)
    cfg = dataclasses.replace(
        TrainConfig(), model=mcfg, sampling=sampling,
        grpo=GRPOConfig(group_size=args.group, prompts_per_step=args.prompts, optimizer_steps_per_step=2),
        optim=OptimConfig(lr=3e-4, weight_decay=1e-4),
    )
    params = setup_trainable(model.transformer, mcfg)
    if args.compile:
        configure_transformer(model.transformer, compile_blocks=True)
    parallel.shard_transformer(model.transformer, param_dtype=None if args.tiny else torch.bfloat16)
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-4, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0)
    engine = DiffusersEngine(model)
    n = args.prompts * args.group
    prompts = [f'A storefront sign that says "WORD{p}"' for p in range(args.prompts) for _ in range(args.group)]

    def sync():
        if d.device.type == "cuda":
            torch.cuda.synchronize()

    rows = []
    for it in range(args.iters + 1):
        if d.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.no_grad():
            traj = engine.generate(prompts, [it * 1000 + i for i in range(n)], sampling)
        sync()
        t1 = time.perf_counter()
        rewards = torch.randn(n, generator=torch.Generator().manual_seed(it)).to(d.device)
        adv = grpo.group_advantages(rewards, args.group, std="global")
        recompute_log_probs_and_means(model, traj, sampling)  # the 'recompute' variant's extra pass
        sync()
        t2 = time.perf_counter()
        m = policy_update(model, params, optimizer, sched, traj, adv, cfg, torch.Generator().manual_seed(it))
        sync()
        t3 = time.perf_counter()
        peak = torch.cuda.max_memory_allocated() / 2**30 if d.device.type == "cuda" else 0.0
        if it > 0:  # the first step warms up kernels (and compiles)
            rows.append((t1 - t0, t2 - t1, t3 - t2, peak, m["logprob_gap/max"]))
        print(f"step {it}: rollout {t1 - t0:.2f}s old-logprob {t2 - t1:.2f}s train {t3 - t2:.2f}s "
              f"peak {peak:.1f} GiB gap {m['logprob_gap/max']:.2e}", flush=True)

    roll, old, train, peak, gap = (sum(r[k] for r in rows) / len(rows) for k in range(5))
    W, steps = sampling.window_size, sampling.num_steps
    fwd_roll = n * steps * 2
    fwd_train = n * W * 2 * 3
    floor_s = (fwd_roll + fwd_train) * TFLOP_PER_FORWARD_512 / MATMUL_TFLOPS_H200
    total = roll + train
    print()
    print(f"| phase | s | images/s | effective TFLOP/s | ({'compiled' if args.compile else 'eager'}, {n} images,"
          f" micro-batch {args.micro_batch}, peak {peak:.1f} GiB, first-update log-prob gap {gap:.1e}) |")
    print("|---|---:|---:|---:|")
    for name, t, fwd in [("rollout", roll, fwd_roll), ("old log-prob (recompute only)", old, n * W * 2),
                         ("train", train, fwd_train), ("total (rollout + train)", total, fwd_roll + fwd_train),
                         ("total with recompute", total + old, fwd_roll + fwd_train + n * W * 2)]:
        print(f"| {name} | {t:.2f} | {n / t:.3f} | {fwd * TFLOP_PER_FORWARD_512 / t:.0f} |")
    if not args.tiny:
        print(f"\nimages/GPU/s {n / total:.3f} = {n / total / VERL_OMNI_IMAGES_PER_GPU_S:.2f}x verl-omni's "
              f"published {VERL_OMNI_IMAGES_PER_GPU_S}; FLOP floor {floor_s:.1f} s -> ceiling {n / floor_s:.2f} images/s "
              f"({floor_s / total:.0%} of it)")
    del engine, optimizer, params, model
    parallel.shutdown()


if __name__ == "__main__":
    main()
