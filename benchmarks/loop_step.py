"""The training loop's own step timers on a real-size random-weight Qwen-Image: one table.

`fgrpo.train.train` runs as a training job does, in the synchronous, asynchronous (--parallel.rollout-ranks)
or sequence-parallel (--parallel.sp) mode.

The run is experiments/qwen_image_ocr.py's recipe (512², 10 steps, true-CFG 4, flow_sde window 2 of [0, 5),
LoRA r64, 2 optimizer steps per step) with a few prompts per step, the JPEG-compressibility reward (cheap, no
weights; the OCR reward's cost is measured in benchmarks/rewards.py), no validation, images or wandb, and one
checkpoint after the last step (outside the step timers, and not quick at real size: budget time for it). The
model is benchmarks/rollout.py's `build_real` (20 B transformer and VAE, random bf16 weights built on each GPU
from the same seed; the text encoder is a stub of fixed random prompt embeddings of the real shapes), handed to
the loop through `train(model_builder=...)`.

Columns, from the run's metrics.jsonl, means over the steps after the first (whose kernels warm up or compile):
step s = the trainer's `time/total`; images/GPU/s = images per step / step s / ranks; train, wait = the
trainer's `time/train`, `time/wait` (the asynchronous trainer waiting for a batch); rollout, reward =
`time/rollout`, `time/reward` of the ranks that sample (asynchronous: the rollout ranks', logged as
`rollout_time/*`); idle = the share of the step the trainer waits / the rollout side is neither sampling nor
scoring (it waits for weights); peak = torch.cuda.max_memory_allocated per rank.

    torchrun --nproc-per-node 2 benchmarks/loop_step.py --prompts 2 --group 16    # synchronous, FSDP2 over 2
    torchrun --nproc-per-node 2 benchmarks/loop_step.py --prompts 2 --group 16 \
        --parallel.rollout-ranks 1 --parallel.max-staleness 1                      # 1 rollout + 1 trainer GPU
    torchrun --nproc-per-node 2 benchmarks/loop_step.py --prompts 1 --group 4 --parallel.sp 2      # SP=2, 512²
    torchrun --nproc-per-node 2 benchmarks/loop_step.py --prompts 1 --group 4                      # DP=2, 512²
    torchrun --nproc-per-node 2 benchmarks/loop_step.py --size 1344 --prompts 1 --group 4 --parallel.sp 2
    torchrun --nproc-per-node 2 benchmarks/loop_step.py --size 1344 --prompts 1 --group 4          # DP=2, 1344²
    torchrun --nproc-per-node 2 benchmarks/loop_step.py --prompts 2 --group 16 --compile   # not with SP
    python benchmarks/loop_step.py --tiny --prompts 1 --group 4          # CPU wiring check, tiny model at 64²
    torchrun --nproc-per-node 2 benchmarks/loop_step.py --tiny --prompts 1 --group 4 --parallel.rollout-ranks 1

1344 is Qwen-Image's native 1328 rounded up to a multiple of 32 pixels, so its 84 x 84 image tokens split
evenly over SP=2 (1328² gives 83², odd). The first steps of the asynchronous mode fill its pipeline: pass
--steps 5 or more for steadier means.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from rollout import build_real, recipe  # benchmarks/rollout.py: the same random models

from fgrpo import parallel
from fgrpo.algorithms import check_config
from fgrpo.config import DataConfig, ModelConfig, ParallelConfig, RewardConfig, TrainConfig
from fgrpo.logging import read_metrics
from fgrpo.models.base import FlowModel
from fgrpo.models.loading import compile_decoder, configure_transformer
from fgrpo.models.registry import build_tiny

# The loop's flags that this benchmark sets through its own (the loop's refusals name the loop's flags).
OWN_FLAGS = {
    "--model.compile": "--compile",
    "--sampling.micro-batch": "--micro-batch",
    "--grpo.prompts-per-step": "--prompts",
    "--grpo.group-size": "--group",
    "--num-steps": "--steps",
}
NUM_PROMPTS = 64  # distinct prompts in the file: steps draw different ones, as a real run's do
PEAK_WAIT_S = 300.0  # how long rank 0 waits for the other ranks' peak memory after the run


@dataclass(frozen=True)
class Args:
    """The benchmark's flags (the rest of the run is the Qwen-Image OCR recipe)."""

    tiny: bool = False
    """Tiny random Qwen-Image on the CPU at 64² (a wiring check; gloo ranks under torchrun)."""
    prompts: int = 2
    """grpo.prompts_per_step: prompts per step over all ranks."""
    group: int = 16
    """grpo.group_size: images per prompt."""
    micro_batch: int = 8
    """sampling.micro_batch: samples per forward (x2 sequences with true CFG; the recipe's 8)."""
    size: int = 0
    """Image side in pixels; 0 = the recipe's 512 (64 with --tiny)."""
    steps: int = 3
    """Training steps; the first (warm-up, compile) is left out of the means."""
    layers: int = 60
    """Transformer blocks of the real-size model (60 = Qwen-Image)."""
    compile: bool = False
    """model.compile: regional torch.compile of the blocks (the loop refuses it with --parallel.sp)."""
    out_dir: str = ""
    """Keep the run (metrics.jsonl, config, checkpoint) in this directory; '' = a temporary one, removed."""
    parallel: ParallelConfig = ParallelConfig()
    """The run's parallel section, passed through."""


def config(args: Args, prompts_file: str, out_dir: str) -> TrainConfig:
    """The Qwen-Image OCR recipe with the benchmark's batch, size, model options and run switches."""
    base = recipe("qwen_image")
    size = args.size or (64 if args.tiny else base.sampling.height)
    return dataclasses.replace(
        base,
        exp_name="loop_step",
        num_steps=args.steps,
        device="cpu" if args.tiny else "cuda",
        # the tiny model is fp32 on the CPU (FSDP2 computes in the parameters' dtype there)
        model=dataclasses.replace(base.model, dtype="fp32" if args.tiny else "bf16", compile=args.compile),
        sampling=dataclasses.replace(base.sampling, height=size, width=size, micro_batch=args.micro_batch),
        grpo=dataclasses.replace(base.grpo, prompts_per_step=args.prompts, group_size=args.group),
        data=DataConfig(train_prompts=prompts_file, val_prompts=prompts_file),
        reward=RewardConfig(name="jpeg_compressibility"),
        run=dataclasses.replace(
            base.run,
            out_dir=out_dir,
            wandb="disabled",
            val_every=0,
            ckpt_every=0,
            log_images_every=0,
            export_lora=False,
            overwrite=True,
        ),
        parallel=args.parallel,
    )


def build(mcfg: ModelConfig, device: torch.device, seed: int, *, tiny: bool, layers: int) -> FlowModel:
    """`train`'s model_builder: the random model, the same on every rank (checked), configured as
    `fgrpo.models.registry.build_model` configures a loaded one."""
    torch.manual_seed(seed)  # build_real draws every weight from the global RNG: equal seeds, equal weights
    model = build_tiny("qwen_image") if tiny else build_real(device, text_encoder=False, layers=layers)
    configure_transformer(
        model.transformer, attention_backend=mcfg.attention_backend, compile_blocks=mcfg.compile
    )
    if mcfg.compile:
        compile_decoder(model)
    # Ranks that started from different weights would still run (the asynchronous mode pushes only the LoRA),
    # and time a run no recipe makes: refuse it.
    sums = torch.stack([p.detach().sum(dtype=torch.float64) for p in model.transformer.parameters()])
    every = parallel.all_gather_cat(sums[None].to(device)).cpu()
    if not torch.equal(every, every[:1].expand_as(every)):
        raise RuntimeError("loop_step: the ranks built different random weights; the builder is not seeded")
    return model


def write_prompts(folder: Path) -> str:
    path = folder / "prompts.txt"
    path.write_text("".join(f'A sign that says "WORD{i}"\n' for i in range(NUM_PROMPTS)))
    return str(path)


def mode_name(p: ParallelConfig, world: int) -> str:
    if p.rollout_ranks:
        return (
            f"async {world - p.rollout_ranks} train + {p.rollout_ranks} rollout, staleness {p.max_staleness}"
        )
    return f"sync SP={p.sp}" if p.sp > 1 else f"sync DP={world}"


def table(cfg: TrainConfig, rows: list[dict], world: int, peaks: list[float]) -> str:
    """The markdown table of a finished run's metrics rows (rank 0's metrics.jsonl)."""
    steps = [r for r in rows if "time/total" in r]
    timed = steps[1:]
    if not timed:
        raise SystemExit("loop_step: no timed step in metrics.jsonl (the run logged fewer than 2 steps)")

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in timed) / len(timed)

    is_async = bool(cfg.parallel.rollout_ranks)
    side = "rollout_time/" if is_async else "time/"
    step_s = mean("time/total")
    n = cfg.samples_per_step

    idle = (
        f"{mean('time/wait') / step_s:.0%} / {1 - mean('rollout_time/total') / step_s:.0%}"
        if is_async
        else "-"
    )
    wait = f"{mean('time/wait'):.2f}" if is_async else "-"
    peak = " / ".join(f"{p:.1f}" for p in peaks) if peaks else "-"
    header = (
        "| mode | ranks | images/step | step s | images/GPU/s | train s | wait s | rollout s | reward s "
        "| idle (trainer / rollout) | peak GiB per rank |"
    )
    line = (
        f"| {mode_name(cfg.parallel, world)} | {world} | {n} | {step_s:.2f} | {n / step_s / world:.3f} "
        f"| {mean('time/train'):.2f} | {wait} "
        f"| {mean(side + 'rollout'):.2f} | {mean(side + 'reward'):.2f} | {idle} | {peak} |"
    )
    return "\n".join([header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", line])


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(Args, args=argv, description=(__doc__ or "").splitlines()[0])
    if args.steps < 2:
        raise SystemExit(f"--steps {args.steps}: need >= 2 (the first step warms up and is not timed)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:  # bad flags fail here, before any model is built
        check_config(config(args, "prompts.txt", "runs"), world)
    except ValueError as e:
        msg = str(e)
        for loop_flag, flag in OWN_FLAGS.items():  # name the flag this benchmark takes
            msg = msg.replace(loop_flag, flag)
        raise SystemExit(f"loop_step: {msg}") from None
    d = parallel.init_distributed("cpu" if args.tiny else "cuda")
    # One run directory for all ranks: rank 0 makes it and writes the prompts, then tells the others.
    where = [None]
    if d.is_main:
        out = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="fgrpo_loop_step_"))
        out.mkdir(parents=True, exist_ok=True)
        where = [str(out)]
        write_prompts(out)
    if d.world_size > 1:
        torch.distributed.broadcast_object_list(where, src=0)
    out = Path(str(where[0]))
    cfg = config(args, str(out / "prompts.txt"), str(out))
    if d.is_main:
        print(
            f"# loop_step: {'tiny' if args.tiny else f'real-size, {args.layers} blocks'}, "
            f"{cfg.sampling.height}², {cfg.grpo.prompts_per_step} x {cfg.grpo.group_size} images a step, "
            f"micro-batch {cfg.sampling.micro_batch}, {'compiled' if cfg.model.compile else 'eager'}, "
            f"{mode_name(cfg.parallel, d.world_size)}, {cfg.num_steps} steps (the first untimed)",
            flush=True,
        )

    def builder(mcfg: ModelConfig, device: torch.device, seed: int) -> FlowModel:
        return build(mcfg, device, seed, tiny=args.tiny, layers=args.layers)

    from fgrpo.train import train

    train(cfg, model_builder=builder)  # leaves the process group: the ranks meet through files from here

    peaks: list[float] = []
    if d.device.type == "cuda":
        mine = out / f"peak_rank{d.rank}.txt"
        mine.with_suffix(".tmp").write_text(str(torch.cuda.max_memory_allocated(d.device) / 2**30))
        mine.with_suffix(".tmp").replace(mine)  # whole or absent when rank 0 reads it
        if d.is_main:
            files = [out / f"peak_rank{r}.txt" for r in range(d.world_size)]
            deadline = time.monotonic() + PEAK_WAIT_S
            while not all(f.is_file() for f in files) and time.monotonic() < deadline:
                time.sleep(0.5)
            peaks = [float(f.read_text()) if f.is_file() else float("nan") for f in files]
    if not d.is_main:
        return
    rows = read_metrics(out / cfg.exp_name / "metrics.jsonl")
    for r in rows:
        print(
            f"step {r['step']}: " + " ".join(f"{k} {v:.2f}" for k, v in r.items() if "time/" in k), flush=True
        )
    print(table(cfg, rows, d.world_size, peaks), flush=True)
    if not args.out_dir:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
