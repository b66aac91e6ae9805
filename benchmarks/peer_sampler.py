"""flow_grpo's own SD3 sampler beside fgrpo's rollout engine, on one SD3.5-Medium in one process: one table.

Both samplers drive the same modules: the real-size random SD3.5-Medium of benchmarks/rollout.py
(`build_real_sd3`: bf16 transformer and VAE on the GPU, stub text encoders), the same conditioning (fgrpo's
`model.encode` of the same B prompts and of the empty negative prompt: [B, 77 + 256, 4096] tokens and [B, 2048]
pooled), the same batch, resolution, steps, CFG and sigma schedule (asserted equal within 1e-6 before timing).
flow_grpo's sampler is `pipeline_with_logprob` of the checkout given by `--flow-grpo` (imported from there,
nothing of it is kept here), called as its scripts/train_sd3.py calls it, on a diffusers
`StableDiffusion3Pipeline` built around fgrpo's transformer and VAE with SD3.5-Medium's scheduler
(FlowMatchEulerDiscreteScheduler, shift 3.0). It takes an SDE step and a log-prob at every step.

Rows, per mode (eager; regional torch.compile of the one shared transformer's blocks, as benchmarks/rollout.py
compiles them, so both samplers run the same compiled blocks):
    flow_grpo           pipeline_with_logprob, SDE (noise level 0.7) and log-prob at every step
    fgrpo, same work    DiffusersEngine.generate with flow_sde 0.7 in a window of all 10 steps of [0, 10):
                        the SDE and a recorded log-prob at every step, one micro-batch of B
    fgrpo, recipe SDE   the same call with experiments/sd35_ocr.py's sampler (CPS 0.8, a 3-step window in
                        [0, 5)) at this table's resolution, steps and CFG, for reference
With `--lora R`, the shared transformer carries the policy's LoRA as in a training run (flow_grpo's
scripts/train_sd3.py: rank 32, alpha 64, its eight attention projections; peft's layers, B = 0 so the numbers are
the base model's), run unmerged at every step by flow_grpo's sampler as in its training loop, and one more row:
    fgrpo, recipe, merged   the recipe row with model.merged_rollout: its steps outside the window run one
                            matmul per adapted layer with the merged weight (the window keeps the adapters)
In the compile mode, model.compile's other half: rows that decode with fgrpo's own copy of the VAE, its decoder
compiled (`compile_decoder`; flow_grpo's sampler keeps the eager one, as it ships):
    fgrpo, same work, compiled VAE              the same-work row
    fgrpo, recipe, merged, compiled VAE         the merged row (with `--lora`)
Each row: one warm-up rollout, then `--repeats` timed rollouts, the samplers' order reversed every repeat, the
device synchronised around each. Columns per rollout (mean over the repeats): total s (and the fastest); the
transformer's s (CUDA events recorded by forward pre/post hooks on the transformer, summed over its forwards;
perf_counter on the CPU); outside s = total - transformer, and of that the VAE's s (the same events around
vae.decode, which both samplers call), so the rest is the sampler's own work (step math, noise, bookkeeping,
host waits); images/s and its ratio to flow_grpo's in the same mode; transformer calls and log-probs per image;
host syncs per rollout (GPU: the ops torch.cuda.set_sync_debug_mode reports, in one extra untimed rollout); peak
memory. Under the table,
per mode, the bound that a sampler's own work sets: flow_grpo's total over its transformer + VAE time, the most
any sampler of the same work on the same modules could gain by having no work of its own (the compiled-VAE rows
run another decoder, so it does not bound them).
`--profile DIR` adds, per mode and sampler, one rollout under torch.profiler: a Chrome trace and the
key_averages table (ops by self CPU time; the top 25 printed), where the host work outside the transformer
can be read.

Differs from flow_grpo's training run: its scripts/train_sd3.py encodes prompts with max_sequence_length=128
(77 + 128 tokens), keeps its VAE in fp32 and its LoRA in fp32 (peft's upcast of adapters on a bf16 base); here
both samplers get fgrpo's 77 + 256 tokens, its bf16 VAE and bf16 adapters; the pipeline's progress bar is off.

GPU:  PYTHONPATH=src python3 benchmarks/peer_sampler.py --flow-grpo /path/to/flow_grpo     (B=16, 512²)
GPU:  PYTHONPATH=src python3 benchmarks/peer_sampler.py --flow-grpo DIR --modes eager --profile /tmp/prof
GPU:  PYTHONPATH=src python3 benchmarks/peer_sampler.py --flow-grpo DIR --lora 32     (as each trains a LoRA)
CPU:  uv run python benchmarks/peer_sampler.py --tiny --flow-grpo DIR     (tiny random SD3, 64², B=2)
CPU:  uv run python benchmarks/peer_sampler.py --tiny --flow-grpo DIR --modes compile --compile-backend eager
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import diffusers
import torch
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import StableDiffusion3Pipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from rollout import build_real_sd3, prompts_for, sync  # benchmarks/rollout.py: the same models

from fgrpo.config import SamplingConfig
from fgrpo.models import sd3
from fgrpo.models.base import Cond
from fgrpo.models.loading import compile_decoder, configure_transformer
from fgrpo.models.lora import add_lora
from fgrpo.models.registry import build_tiny
from fgrpo.models.sd3 import SD3_LORA_TARGETS
from fgrpo.rollout.engine import DiffusersEngine
from fgrpo.rollout.seeds import sample_seed
from fgrpo.scripts import load_script

SAMPLER_MODULE = "flow_grpo.diffusers_patch.sd3_pipeline_with_logprob"
# flow_grpo's text encoders come as None: the conditioning is passed in as embeddings.
NO_TEXT_ENCODERS: dict[str, Any] = {
    f"{kind}{suffix}": None for kind in ("text_encoder", "tokenizer") for suffix in ("", "_2", "_3")
}


def load_flow_grpo_sampler(root: Path) -> Callable[..., Any]:
    """`pipeline_with_logprob` of the flow_grpo checkout at `root` (flow_grpo has no __init__.py: its folders
    import as namespace packages once `root` is on sys.path)."""
    path = root / Path(*SAMPLER_MODULE.split(".")).with_suffix(".py")
    if not path.is_file():
        raise SystemExit(f"--flow-grpo {root}: no {path}; pass the root of a flow_grpo checkout")
    sys.path.insert(0, str(root.resolve()))
    return importlib.import_module(SAMPLER_MODULE).pipeline_with_logprob


def flow_grpo_commit(root: Path) -> str:
    """The checkout's short commit, or "?" when `root` is not the top of a git work tree (a copied folder inside
    another repository would otherwise report that repository's commit)."""

    def git(*args: str) -> str | None:
        res = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return res.stdout.strip() if res.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return "?"
    return git("rev-parse", "--short", "HEAD") or "?"


def sd3_pipeline(model: sd3.SD3) -> StableDiffusion3Pipeline:
    """A diffusers SD3 pipeline around the model's own transformer and VAE (the same module objects), with the
    scheduler SD3.5-Medium ships (sd3.SCHEDULER_CONFIG, the one fgrpo's SD3 draws its sigmas from)."""
    scheduler = FlowMatchEulerDiscreteScheduler(**sd3.SCHEDULER_CONFIG)
    pipe = StableDiffusion3Pipeline(
        # an SD3's transformer is an SD3Transformer2DModel; the shared attribute is typed as any family's
        transformer=model.transformer,  # pyright: ignore[reportArgumentType]
        scheduler=scheduler,
        vae=model.vae,
        **NO_TEXT_ENCODERS,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def check_schedules(model: sd3.SD3, pipe: StableDiffusion3Pipeline, steps: int, res: int) -> float:
    """The largest |sigma| difference between the pipeline scheduler's grid and fgrpo's; raises above 1e-6."""
    scheduler: Any = pipe.scheduler
    scheduler.set_timesteps(steps, device="cpu")
    theirs, ours = scheduler.sigmas.float().cpu(), model.sigmas(steps, res, res)
    if theirs.shape != ours.shape:
        raise SystemExit(
            f"sigma grids differ in length: scheduler {tuple(theirs.shape)}, fgrpo {tuple(ours.shape)}"
        )
    diff = (theirs - ours).abs().max().item()
    if diff > 1e-6:
        raise SystemExit(
            f"sigma grids differ by {diff:.2e} (> 1e-6): scheduler {theirs.tolist()}, fgrpo {ours.tolist()}"
        )
    return diff


class Clock:
    """Seconds inside calls: CUDA events recorded around each (the stream's time between them, read after a
    synchronize), perf_counter on the CPU. `forwards` clocks a module's forwards by pre/post hooks; `method` an
    object's method by a wrapper around it (a compiled module's own hooks would run inside its graph)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self._start: Any = None
        self._undo: list[Callable[[], None]] = []

    def forwards(self, module: torch.nn.Module) -> Clock:
        handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]
        self._undo += [h.remove for h in handles]
        return self

    def method(self, obj: Any, name: str) -> Clock:
        original = getattr(obj, name)

        def clocked(*args: Any, **kwargs: Any) -> Any:
            self._start = self._now()
            out = original(*args, **kwargs)
            self.spans.append((self._start, self._now()))
            return out

        setattr(obj, name, clocked)  # an instance attribute, over the class's method
        self._undo.append(lambda: delattr(obj, name))
        return self

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self._start = self._now()

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.spans.append((self._start, self._now()))

    def reset(self) -> None:
        self.spans = []

    def seconds(self) -> float:
        """Total over the spans since reset(); the device must be synchronised first."""
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.spans) / 1e3
        return sum(b - a for a, b in self.spans)

    def close(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []


@dataclasses.dataclass
class Sampler:
    """One row's rollout: run(repeat) samples the batch and returns (images, log-probs per image)."""

    name: str
    run: Callable[[int], tuple[torch.Tensor, int]]


def flow_grpo_sampler(
    fn: Callable[..., Any],
    pipe: StableDiffusion3Pipeline,
    cond: Cond,
    steps: int,
    guidance: float,
    res: int,
    noise_level: float,
) -> Sampler:
    """pipeline_with_logprob called as flow_grpo's scripts/train_sd3.py calls it for its training samples (its
    initial noise from the global RNG: that call passes no generator)."""

    def run(repeat: int) -> tuple[torch.Tensor, int]:
        images, latents, log_probs = fn(
            pipe,
            prompt_embeds=cond["prompt_embeds"],
            pooled_prompt_embeds=cond["pooled"],
            negative_prompt_embeds=cond["neg_prompt_embeds"],
            negative_pooled_prompt_embeds=cond["neg_pooled"],
            num_inference_steps=steps,
            guidance_scale=guidance,
            output_type="pt",
            height=res,
            width=res,
            noise_level=noise_level,
        )
        if not all(torch.isfinite(lp).all() for lp in log_probs):
            raise RuntimeError("flow_grpo's sampler returned non-finite log-probs")
        return images, len(log_probs)

    return Sampler("flow_grpo", run)


def fgrpo_sampler(
    name: str, model: sd3.SD3, prompts: list[str], cfg: SamplingConfig, *, merged_lora: bool = False
) -> Sampler:
    """DiffusersEngine.generate on the prompts (their encodings cached: the embeddings flow_grpo is given)."""
    engine = DiffusersEngine(model, merged_lora=merged_lora)

    def run(repeat: int) -> tuple[torch.Tensor, int]:
        seeds = [sample_seed(repeat, i) for i in range(len(prompts))]
        traj = engine.generate(prompts, seeds, cfg)
        if not torch.isfinite(traj.log_prob).all():
            raise RuntimeError(f"{name}: non-finite log-probs")
        return traj.images, traj.log_prob.shape[1]

    return Sampler(name, run)


@dataclasses.dataclass
class Timing:
    total: float
    transformer: float
    vae: float
    forwards: int
    log_probs: int
    peak_gib: float


def timed(
    sampler: Sampler, repeat: int, clocks: tuple[Clock, Clock], device: torch.device, batch: int
) -> Timing:
    transformer, vae = clocks
    transformer.reset()
    vae.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    images, log_probs = sampler.run(repeat)
    sync(device)
    total = time.perf_counter() - t0
    if images.shape[0] != batch:
        raise RuntimeError(f"{sampler.name}: {images.shape[0]} images for a batch of {batch}")
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return Timing(total, transformer.seconds(), vae.seconds(), len(transformer.spans), log_probs, peak)


def host_syncs(sampler: Sampler, device: torch.device) -> int | None:
    """Synchronizing CUDA ops of one rollout, as torch.cuda.set_sync_debug_mode("warn") reports them."""
    if device.type != "cuda":
        return None
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            sampler.run(10_000)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    return sum("synchroniz" in str(w.message) for w in caught)


def profile_one(sampler: Sampler, device: torch.device, out: Path, mode: str) -> None:
    """One rollout under torch.profiler: DIR/<mode>_<sampler>.json (Chrome trace) and .txt (key_averages by self
    CPU time); the top 25 rows printed."""
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        sampler.run(20_000)
        sync(device)
    stem = out / f"{mode}_{re.sub(r'[^A-Za-z0-9]+', '_', sampler.name).strip('_')}"
    prof.export_chrome_trace(str(stem.with_suffix(".json")))
    averages = prof.key_averages()
    stem.with_suffix(".txt").write_text(averages.table(sort_by="self_cpu_time_total", row_limit=-1))
    print(f"## profile, {mode}, {sampler.name}: {stem}.json / .txt (top 25 by self CPU time)")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


def sd3_recipe_sampling() -> SamplingConfig:
    """experiments/sd35_ocr.py's Config().sampling: the SD3.5 recipe's sampler."""
    return load_script("experiments/sd35_ocr.py").Config().sampling


@contextlib.contextmanager
def clocks_on(model: sd3.SD3, vaes: list[Any], device: torch.device) -> Iterator[tuple[Clock, Clock]]:
    """The transformer's clock and one clock over every VAE's decode calls."""
    vae_clock = Clock(device)
    for vae in vaes:
        vae_clock.method(vae, "decode")
    clocks = (Clock(device).forwards(model.transformer), vae_clock)
    try:
        yield clocks
    finally:
        for clock in clocks:
            clock.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--flow-grpo",
        type=Path,
        required=True,
        help="root of a flow_grpo checkout (holds flow_grpo/diffusers_patch/)",
    )
    ap.add_argument("--tiny", action="store_true", help="tiny random SD3 on the CPU (script check)")
    ap.add_argument("--batch", type=int, default=0, help="images per rollout B (0 = 16; tiny: 2)")
    ap.add_argument("--resolution", type=int, default=0, help="pixels (0 = 512; tiny: 64)")
    ap.add_argument("--steps", type=int, default=10, help="denoising steps (flow_grpo's SD3 OCR config: 10)")
    ap.add_argument("--cfg", type=float, default=4.5, help="CFG scale (flow_grpo's SD3 configs: 4.5)")
    ap.add_argument(
        "--noise-level", type=float, default=0.7, help="SDE noise level (flow_grpo's default: 0.7)"
    )
    ap.add_argument("--modes", default="eager,compile", help="eager and/or compile (regional, blocks only)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rollouts per sampler and mode")
    ap.add_argument("--profile", type=Path, default=None, help="folder for one profiled rollout per sampler")
    ap.add_argument("--layers", type=int, default=24, help="transformer blocks of the real-size model")
    ap.add_argument(
        "--lora",
        type=int,
        default=0,
        help="LoRA rank on the shared transformer (flow_grpo's SD3 recipe: 32; alpha 2x), and a merged-rollout row; "
        "0: none",
    )
    ap.add_argument("--device", default="", help="default: cuda (tiny: cpu)")
    ap.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile's backend in the compile mode ('eager' traces without making kernels: a CPU check)",
    )
    args = ap.parse_args()

    start = time.perf_counter()
    sampler_fn = load_flow_grpo_sampler(args.flow_grpo)
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    batch = args.batch or (2 if args.tiny else 16)
    res = args.resolution or (64 if args.tiny else 512)
    steps, guidance = args.steps, args.cfg
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.tiny and "compile" in modes and args.modes == ap.get_default("modes"):
        modes = ["eager"]  # inductor on a CPU takes minutes per shape; ask for it explicitly
    if unknown := set(modes) - {"eager", "compile"}:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; use eager and/or compile")
    if args.lora < 0:
        raise SystemExit(f"--lora {args.lora}: a rank >= 1, or 0 for no LoRA")
    modes = [m for m in ("eager", "compile") if m in modes]  # compiling is for the rest of the process
    torch.backends.cuda.matmul.allow_tf32 = True  # flow_grpo's configs set allow_tf32 too

    model = cast(sd3.SD3, build_tiny("sd3")) if args.tiny else build_real_sd3(device, args.layers)
    if args.lora:
        adapters = add_lora(
            model.transformer, rank=args.lora, alpha=2 * args.lora, target_modules=SD3_LORA_TARGETS
        )
        for p in adapters:  # the base's dtype, as fgrpo's trainer computes them (FSDP2's param_dtype)
            p.data = p.data.to(model.dtype)
    pipe = sd3_pipeline(model)
    sigma_diff = check_schedules(model, pipe, steps, res)
    prompts = prompts_for(batch, 1, 0)
    cond = model.encode(prompts, negative_prompt="")  # the cache the fgrpo rows read the same tensors from
    tcfg: Any = model.transformer.config
    tokens = 77 + model.max_sequence_length
    expected = {
        "prompt_embeds": (batch, tokens, tcfg.joint_attention_dim),
        "neg_prompt_embeds": (batch, tokens, tcfg.joint_attention_dim),
        "pooled": (batch, tcfg.pooled_projection_dim),
        "neg_pooled": (batch, tcfg.pooled_projection_dim),
    }
    shapes = {k: tuple(v.shape) for k, v in cond.items()}
    if shapes != expected:
        raise SystemExit(f"conditioning shapes {shapes}, expected {expected}")

    same_work = SamplingConfig(
        height=res, width=res, num_steps=steps, guidance_scale=guidance, negative_prompt="",
        sde_kind="flow_sde", noise_level=args.noise_level, window_size=steps, window_range=(0, steps),
        micro_batch=batch,
    )  # fmt: skip
    rec = sd3_recipe_sampling()
    # fewer steps than the recipe's window range: stop it before the last step, where CPS has no noise
    hi = min(rec.window_range[1], steps - 1)
    recipe_cfg = dataclasses.replace(
        rec, height=res, width=res, num_steps=steps, guidance_scale=guidance, negative_prompt="",
        window_size=min(rec.window_size, hi - rec.window_range[0]), window_range=(rec.window_range[0], hi),
        micro_batch=batch,
    )  # fmt: skip
    lo = recipe_cfg.window_range[0]
    samplers = [
        flow_grpo_sampler(sampler_fn, pipe, cond, steps, guidance, res, args.noise_level),
        fgrpo_sampler("fgrpo, same work", model, prompts, same_work),
        fgrpo_sampler(
            f"fgrpo, recipe SDE ({recipe_cfg.sde_kind} {recipe_cfg.noise_level:g}, window "
            f"{recipe_cfg.window_size} of [{lo}, {hi}))",
            model,
            prompts,
            recipe_cfg,
        ),
    ]
    if args.lora:
        samplers.append(fgrpo_sampler("fgrpo, recipe, merged", model, prompts, recipe_cfg, merged_lora=True))
    # model.compile's other half: fgrpo's own copy of the VAE, its decoder compiled in the compile mode
    own_vae = copy.copy(model)
    own_vae.vae = copy.deepcopy(model.vae)
    compiled_vae = [fgrpo_sampler("fgrpo, same work, compiled VAE", own_vae, prompts, same_work)]
    if args.lora:
        compiled_vae.append(
            fgrpo_sampler(
                "fgrpo, recipe, merged, compiled VAE", own_vae, prompts, recipe_cfg, merged_lora=True
            )
        )

    n_params = sum(p.numel() for p in model.transformer.parameters())
    size = f"{n_params / 1e9:.2f}B" if n_params >= 1e8 else f"{n_params / 1e6:.2f}M"
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"# SD3 samplers side by side: transformer {size} {model.dtype}, {res}x{res}, {steps} steps, "
        f"CFG {guidance:g}, noise level {args.noise_level:g}, B={batch}, prompt tokens {tokens}, "
        + (f"LoRA r{args.lora} on {len(SD3_LORA_TARGETS)} projections, " if args.lora else "")
        + f"device={device_name}, "
        f"torch {torch.__version__}, diffusers {diffusers.__version__}, flow_grpo {flow_grpo_commit(args.flow_grpo)} "
        f"at {args.flow_grpo}; sigma grids agree within {sigma_diff:.1e}; built in {time.perf_counter() - start:.0f}s",
        flush=True,
    )

    rows = []
    bounds = []
    with clocks_on(model, [model.vae, own_vae.vae], device) as clocks:
        for mode in modes:
            if mode == "compile":
                configure_transformer(
                    model.transformer, compile_blocks=True, compile_backend=args.compile_backend
                )
                compile_decoder(own_vae, backend=args.compile_backend)
                samplers = samplers + compiled_vae
            warm = []
            for sampler in samplers:
                t0 = time.perf_counter()
                sampler.run(0)
                sync(device)
                warm.append(f"{sampler.name} {time.perf_counter() - t0:.1f}s")
            print(f"# {mode} warm-up: " + ", ".join(warm), flush=True)
            times: dict[str, list[Timing]] = {s.name: [] for s in samplers}
            for repeat in range(1, args.repeats + 1):
                for sampler in samplers if repeat % 2 else samplers[::-1]:
                    times[sampler.name].append(timed(sampler, repeat, clocks, device, batch))
            syncs = {s.name: host_syncs(s, device) for s in samplers}
            if args.profile is not None:
                for sampler in samplers:
                    profile_one(sampler, device, args.profile, mode)
            base = None
            for sampler in samplers:
                ts = times[sampler.name]
                total = sum(t.total for t in ts) / len(ts)
                transformer = sum(t.transformer for t in ts) / len(ts)
                vae = sum(t.vae for t in ts) / len(ts)
                per_s = batch / total
                if base is None:
                    base = per_s
                    bounds.append(
                        f"# {mode}: flow_grpo's transformer + VAE take {transformer + vae:.3f} of its {total:.3f} s, so "
                        f"a sampler of its work with no work of its own runs at most {total / (transformer + vae):.4f}x it"
                    )
                n_syncs = syncs[sampler.name]
                peak = f"{max(t.peak_gib for t in ts):.1f}" if device.type == "cuda" else "-"
                rows.append(
                    f"| {mode} | {sampler.name} | {batch} | {total:.3f} | {min(t.total for t in ts):.3f} | "
                    f"{transformer:.3f} | {total - transformer:.3f} | {vae:.3f} | {total - transformer - vae:.3f} | "
                    f"{per_s:.3f} | {per_s / base:.3f} | {ts[0].forwards} | {ts[0].log_probs} | "
                    f"{'-' if n_syncs is None else n_syncs} | {peak} |"
                )
                print(rows[-1], flush=True)
    print()
    print(
        "| mode | sampler | B | total s | min s | transformer s | outside s | of it VAE s | rest s | img/s | "
        "vs flow_grpo | transformer calls | log-probs/img | host syncs | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    for line in bounds:
        print(line)
    print(
        f"# {args.repeats} timed rollouts per row (means; min s: the fastest); wall {time.perf_counter() - start:.0f}s"
    )


if __name__ == "__main__":
    main()
