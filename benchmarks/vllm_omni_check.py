"""GPU check of the vLLM-Omni rollout engine against the in-process engine and the trainer: one table.

Sections (each prints its rows and never stops the others):
  parity      a tiny random Qwen-Image directory saved by fgrpo's tiny builder; the same prompts and seeds
              through VllmOmniEngine and DiffusersEngine (bf16 both) with every step stochastic
              (noise_level > 0, window = all steps) and pure ODE (window_size 0). Per timestep:
              |x_next| gap, |log-prob| gap engine vs in-process rollout, and engine vs the trainer's
              recomputation (fgrpo.recompute.recompute_log_probs on the engine's trajectory).
  lora        a random LoRA (PEFT dir, new adapter id per version) changes the engine's output as merging
              the same LoRA into the in-process transformer changes the in-process output; a second
              version is picked up again.
  weights     full-weight sync: perturbed transformer weights through VllmOmniEngine.update_weights
              against the same perturbation in-process.
  sleep       enable_sleep_mode: GPU memory freed by sleep(), restored by wake(), same output after.
  throughput  real-size random-weight Qwen-Image (20B transformer, real VAE; a 1-layer text encoder of the
              real width: prompts are encoded once and cached) saved to --real-dir, then images/s of
              VllmOmniEngine (eager and compiled) and DiffusersEngine for the recipe: 512^2, 10 steps,
              CFG 4, flow_sde 1.2, window 2 in [0, 5).

GPU (vllm 0.30.0 + vllm-omni 0.30.0 installed, e.g. `uv sync --extra vllm`; offline runs set
HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1):
  python3 benchmarks/vllm_omni_check.py                        # parity, lora, weights, sleep (~3 min)
  python3 benchmarks/vllm_omni_check.py --sections throughput  # on its own: writes ~41 GB, ~8 min
CPU (no vllm): `python benchmarks/vllm_omni_check.py --cpu-selftest` checks the helpers on the tiny model.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fgrpo.config import SamplingConfig
from fgrpo.models.base import FlowModel
from fgrpo.models.loading import configure_transformer
from fgrpo.models.qwen_image import QwenImage
from fgrpo.recompute import recompute_log_probs
from fgrpo.rollout.base import Trajectory
from fgrpo.rollout.engine import DiffusersEngine
from fgrpo.rollout.seeds import sample_seed
from fgrpo.rollout.vllm_omni_pipeline import as_flow_model

PROMPTS = [
    'a storefront sign that says "OPEN"',
    "a red square on a blue background",
    'a hand-written note that says "hello world"',
    "a cat holding a sign",
]
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


# ------------------------------------------------------------------------------------------------
# Helpers (CPU-testable)
# ------------------------------------------------------------------------------------------------
def step_gaps(
    got: Trajectory, want: Trajectory, recomputed: torch.Tensor | None = None
) -> list[dict[str, Any]]:
    """Per timestep i (window slots grouped by step): mean/max |x_next| gap and mean |log-prob| gaps."""
    rows = []
    steps = sorted(set(got.window.flatten().tolist()))
    for i in steps:
        sel = got.window.cpu() == i  # [B, W]
        if not torch.equal(sel, want.window.cpu() == i):
            raise ValueError(f"step {i}: the two trajectories' windows differ; compare equal seeds")
        dx = (got.x_next.cpu()[sel] - want.x_next.cpu().float()[sel]).abs()
        scale = want.x_next.cpu().float()[sel].abs().mean()
        row = {
            "step": i,
            "sigma": float(got.sigmas[i]),
            "n": int(sel.sum()),
            "dx_mean": float(dx.mean()),
            "dx_max": float(dx.max()),
            "dx_rel": float(dx.mean() / scale),
            "dlp_rollout": float((got.log_prob.cpu()[sel] - want.log_prob.cpu().float()[sel]).abs().mean()),
            "lp_mean": float(got.log_prob.cpu()[sel].mean()),
        }
        if recomputed is not None:
            row["dlp_trainer"] = float((got.log_prob.cpu()[sel] - recomputed.cpu().float()[sel]).abs().mean())
            row["dlp_trainer_max"] = float(
                (got.log_prob.cpu()[sel] - recomputed.cpu().float()[sel]).abs().max()
            )
        rows.append(row)
    return rows


def image_gap(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a.cpu().float() - b.cpu().float()).abs()
    return {"px_mean": float(d.mean()), "px_max": float(d.max())}


def random_lora(
    transformer: torch.nn.Module, *, rank: int = 4, alpha: float = 8.0, std: float = 0.2, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A random PEFT LoRA for the attention projections (B != 0, so it changes the output): (state, config)."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, mod in transformer.named_modules():
        if isinstance(mod, torch.nn.Linear) and any(name.endswith("." + t) for t in LORA_TARGETS):
            a = torch.randn(rank, mod.in_features, generator=gen) / mod.in_features**0.5
            b = torch.randn(mod.out_features, rank, generator=gen) * std
            state[f"base_model.model.{name}.lora_A.weight"] = a
            state[f"base_model.model.{name}.lora_B.weight"] = b
    if not state:
        raise ValueError("random_lora: no target Linear found in the transformer")
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(LORA_TARGETS),
        "bias": "none",
        "lora_dropout": 0.0,
        "use_rslora": False,
        "use_dora": False,
    }
    return state, config


@torch.no_grad()
def merge_lora_(
    transformer: torch.nn.Module, state: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> int:
    """W += (alpha / r) B A in place: the in-process side of the LoRA check, without peft. Returns #layers."""
    scale = float(config["lora_alpha"]) / int(config["r"])
    modules = dict(transformer.named_modules())
    n = 0
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = state[key.replace("lora_A", "lora_B")]
        w: torch.Tensor = modules[name].weight  # pyright: ignore[reportAssignmentType]
        w += (scale * (b.float() @ a.float())).to(device=w.device, dtype=w.dtype)
        n += 1
    return n


def fmt_table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3e}" if v and (abs(v) < 1e-2 or abs(v) >= 1e4) else f"{v:.4f}"
        return str(v)

    table = [list(cols)] + [[cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in table)


def seeds_for(n: int, run: int = 0) -> list[int]:
    return [sample_seed(2026, run, i) for i in range(n)]


# ------------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------------
class Ctx:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = torch.device("cuda")
        self.tiny_dir = self.out / "tiny_qwen_image"
        self.summary: list[dict[str, Any]] = []

    def note(self, section: str, check: str, value: Any, ok: bool | None = None) -> None:
        status = "" if ok is None else ("ok" if ok else "FAIL")
        self.summary.append({"section": section, "check": check, "value": value, "status": status})
        print(f"[{section}] {check}: {value} {status}", flush=True)


def tiny_cfg(args: argparse.Namespace, **kw: Any) -> SamplingConfig:
    base = SamplingConfig(
        height=args.size,
        width=args.size,
        num_steps=args.steps,
        guidance_scale=4.0,
        negative_prompt=" ",
        sde_kind="flow_sde",
        noise_level=1.2,
        window_size=args.steps,  # every step stochastic: a gap per timestep
        window_range=(0, args.steps),
        micro_batch=len(PROMPTS),
    )
    return dataclasses.replace(base, **kw)


def ensure_tiny_dir(ctx: Ctx) -> Path:
    if not (ctx.tiny_dir / "model_index.json").exists():
        from fgrpo.models.tiny import save_tiny_qwen_image

        save_tiny_qwen_image(ctx.tiny_dir, seed=0)
    return ctx.tiny_dir


def in_process(path: Path, device: torch.device) -> FlowModel:
    return as_flow_model(QwenImage.from_pretrained(path, dtype=torch.bfloat16, device=device))


def vllm_engine(path: Path, ctx: Ctx, max_batch: int = len(PROMPTS), **kw: Any):
    from fgrpo.rollout.vllm_omni import VllmOmniEngine

    omni_kwargs = {}
    if ctx.args.attention_backend:
        omni_kwargs["diffusion_attention_backend"] = ctx.args.attention_backend
    return VllmOmniEngine(
        str(path),
        max_batch=max_batch,
        work_dir=ctx.out / "engine_work",
        omni_kwargs=omni_kwargs,
        **kw,
    )


def section_parity(ctx: Ctx) -> None:
    path = ensure_tiny_dir(ctx)
    engine = vllm_engine(path, ctx)
    model = in_process(path, ctx.device)
    try:
        seeds = seeds_for(len(PROMPTS))
        cfg = tiny_cfg(ctx.args)
        got = engine.generate(PROMPTS, seeds, cfg)
        want = DiffusersEngine(model).generate(PROMPTS, seeds, cfg)
        recomputed = recompute_log_probs(model, got.to(ctx.device), cfg)
        rows = step_gaps(got, want, recomputed)
        print(
            f"\n## parity, noise_level {cfg.noise_level}, {cfg.sde_kind}, every step stochastic (tiny, bf16)"
        )
        print(
            fmt_table(
                rows,
                [
                    "step",
                    "sigma",
                    "n",
                    "dx_mean",
                    "dx_max",
                    "dx_rel",
                    "lp_mean",
                    "dlp_rollout",
                    "dlp_trainer",
                    "dlp_trainer_max",
                ],
            )
        )
        worst = max(r["dlp_trainer"] for r in rows)
        ctx.note(
            "parity",
            "max over steps of mean |engine - trainer| log-prob",
            f"{worst:.3e}",
            ok=worst < ctx.args.lp_tol,
        )
        ctx.note("parity", "images (SDE) " + str(image_gap(got.images, want.images)), "", None)
        for k, v in want.cond.items():  # the two text encoders' outputs (vllm-omni loads its own copy)
            L = v.shape[1]
            d = (got.cond[k][:, :L].float() - v.cpu().float()).abs().max().item()
            ctx.note("parity", f"cond {k} max |engine - in-process|", f"{d:.3e}")
        torch.save({"engine": got, "in_process": want, "recomputed": recomputed}, ctx.out / "parity.pt")

        ode = tiny_cfg(ctx.args, window_size=0, window_range=(0, 0))
        g0 = engine.generate(PROMPTS, seeds, ode)
        w0 = DiffusersEngine(model).generate(PROMPTS, seeds, ode)
        gap = image_gap(g0.images, w0.images)
        ctx.note(
            "parity",
            "ODE (noise 0) images |engine - in-process| uint8 mean/max",
            f"{gap['px_mean']:.3f}/{gap['px_max']:.0f}",
            ok=gap["px_mean"] < 2.0,
        )
        again = engine.generate(PROMPTS, seeds, cfg)
        ctx.note(
            "parity", "engine deterministic (same seeds twice)", bool(torch.equal(again.x_next, got.x_next))
        )
    finally:
        engine.close()
        del model
        gc.collect()
        torch.cuda.empty_cache()


def section_lora(ctx: Ctx) -> None:
    path = ensure_tiny_dir(ctx)
    engine = vllm_engine(path, ctx)
    model = in_process(path, ctx.device)
    try:
        seeds = seeds_for(len(PROMPTS), run=1)
        cfg = tiny_cfg(ctx.args)
        base_e = engine.generate(PROMPTS, seeds, cfg)
        base_i = DiffusersEngine(model).generate(PROMPTS, seeds, cfg)
        rows = []
        base_weights = {k: v.clone() for k, v in model.transformer.state_dict().items()}
        for version in (1, 2):
            state, config = random_lora(model.transformer, seed=version)
            req = engine.update_lora(state, config)
            merge_lora_(model.transformer, state, config)
            lora_e = engine.generate(PROMPTS, seeds, cfg)
            lora_i = DiffusersEngine(model).generate(PROMPTS, seeds, cfg)
            de = (lora_e.x_next - base_e.x_next).abs().mean().item()
            di = (lora_i.x_next.cpu().float() - base_i.x_next.cpu().float()).abs().mean().item()
            gap = (lora_e.x_next - lora_i.x_next.cpu().float()).abs().mean().item()
            base_gap = (base_e.x_next - base_i.x_next.cpu().float()).abs().mean().item()
            rows.append(
                {
                    "version": version,
                    "adapter_id": req.lora_int_id,
                    "engine_change": de,
                    "in_process_change": di,
                    "gap_after": gap,
                    "gap_base": base_gap,
                }
            )
            model.transformer.load_state_dict(base_weights)  # the engine serves one adapter at a time
        print(
            "\n## LoRA update (x_next mean |change| vs base; gap = engine vs in-process with the same adapter)"
        )
        print(
            fmt_table(
                rows, ["version", "adapter_id", "engine_change", "in_process_change", "gap_after", "gap_base"]
            )
        )
        for r in rows:
            # The engine applies the same LoRA when (a) it moves the output as much as in-process does and
            # (b) the engine-vs-in-process disagreement grows by a small fraction of that move only. The bf16
            # kernel gap (gap_base) is not part of the LoRA's effect, so it is subtracted, not compared: a
            # LoRA of std 0.05 moved x_next by 7.5e-3, only 2.4x the base gap of 3.1e-3, so "move > 5 x base
            # gap" would fail it although the gap grew by 1.3e-4 only (RESULTS.md, 2026-11-30).
            moved_alike = abs(r["engine_change"] - r["in_process_change"]) < 0.1 * r["in_process_change"]
            ok = moved_alike and (r["gap_after"] - r["gap_base"]) < 0.1 * r["in_process_change"]
            ctx.note(
                "lora",
                f"v{r['version']} changes the engine like in-process",
                f"{r['engine_change']:.3e} vs {r['in_process_change']:.3e}",
                ok=ok,
            )
    finally:
        engine.close()
        del model
        gc.collect()
        torch.cuda.empty_cache()


def section_weights(ctx: Ctx) -> None:
    path = ensure_tiny_dir(ctx)
    engine = vllm_engine(path, ctx)
    model = in_process(path, ctx.device)
    try:
        seeds = seeds_for(len(PROMPTS), run=2)
        cfg = tiny_cfg(ctx.args)
        base_e = engine.generate(PROMPTS, seeds, cfg)
        gen = torch.Generator().manual_seed(3)
        new = {}
        for k, v in model.transformer.state_dict().items():
            if ".attn.to_q." in k or ".attn.to_k." in k or ".attn.to_v." in k or "proj_out" in k:
                new[k] = (v.float().cpu() * (1 + 0.2 * torch.randn(v.shape, generator=gen))).to(v.dtype)
        loaded = engine.update_weights(new)
        model.transformer.load_state_dict({k: v.to(ctx.device) for k, v in new.items()}, strict=False)
        e = engine.generate(PROMPTS, seeds, cfg)
        i = DiffusersEngine(model).generate(PROMPTS, seeds, cfg)
        change = (e.x_next - base_e.x_next).abs().mean().item()
        gap = (e.x_next - i.x_next.cpu().float()).abs().mean().item()
        ctx.note(
            "weights",
            f"update_weights loaded {loaded} params of {len(new)} tensors; engine change / gap to in-process",
            f"{change:.3e} / {gap:.3e}",
            ok=gap < 0.5 * change,
        )
    finally:
        engine.close()
        del model
        gc.collect()
        torch.cuda.empty_cache()


def section_sleep(ctx: Ctx) -> None:
    path = ensure_tiny_dir(ctx)
    engine = vllm_engine(path, ctx, enable_sleep_mode=True)
    try:
        seeds = seeds_for(len(PROMPTS), run=3)
        cfg = tiny_cfg(ctx.args)
        before = engine.generate(PROMPTS, seeds, cfg)
        free0 = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        engine.sleep()
        t_sleep = time.perf_counter() - t
        free1 = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        engine.wake()
        t_wake = time.perf_counter() - t
        free2 = torch.cuda.mem_get_info()[0]
        after = engine.generate(PROMPTS, seeds, cfg)
        ctx.note(
            "sleep",
            "freed by sleep / re-taken by wake (GiB), sleep s, wake s",
            f"{(free1 - free0) / 2**30:.2f} / {(free1 - free2) / 2**30:.2f}, {t_sleep:.2f}, {t_wake:.2f}",
            ok=free1 > free0,
        )
        ctx.note(
            "sleep",
            "same output after sleep/wake",
            bool(torch.equal(before.x_next, after.x_next)),
            ok=bool(torch.equal(before.x_next, after.x_next)),
        )
    finally:
        engine.close()


def save_real_size_dir(path: Path, layers: int, device: torch.device) -> Path:
    """Random real-size Qwen-Image (transformer + VAE; a 1-layer text encoder of width 3584) in diffusers layout."""
    if (path / "model_index.json").exists():
        return path
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from fgrpo.models.qwen_image import SCHEDULER_CONFIG
    from fgrpo.models.tiny import tiny_qwen_tokenizer

    tokenizer = tiny_qwen_tokenizer()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            transformer = QwenImageTransformer2DModel(num_layers=layers)  # diffusers defaults = Qwen-Image
            vae = AutoencoderKLQwenImage()
            text = dict(
                hidden_size=3584, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=len(tokenizer), rope_theta=1e6,
                rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            vision = dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2, out_hidden_size=3584)
            encoder = Qwen2_5_VLForConditionalGeneration(
                Qwen2_5_VLConfig(text_config=text, vision_config=vision, vocab_size=len(tokenizer))  # pyright: ignore[reportCallIssue]
            )
    finally:
        torch.set_default_dtype(default)
    scheduler: Any = FlowMatchEulerDiscreteScheduler.from_config(
        SCHEDULER_CONFIG
    )  # from_config may return a tuple
    pipe = QwenImagePipeline(
        transformer=transformer, vae=vae, text_encoder=encoder, tokenizer=tokenizer,
        scheduler=scheduler,
    )  # fmt: skip
    tmp = path.with_name(path.name + ".tmp")
    pipe.save_pretrained(tmp, max_shard_size="10GB")
    tmp.rename(path)
    del pipe, transformer, vae, encoder
    gc.collect()
    torch.cuda.empty_cache()
    return path


def _time_engine(
    generate: Callable[[list[str], list[int], SamplingConfig], Trajectory],
    cfg: SamplingConfig,
    batch: int,
    reps: int,
) -> dict[str, Any]:
    group = 8
    prompts = [
        f"run prompt {p:03d}: a storefront sign that says OPEN 24 HOURS"
        for p in range(batch // group or 1)
        for _ in range(group)
    ][:batch]
    generate(prompts, seeds_for(batch, run=99), cfg)  # warm-up (compiles when not eager)
    torch.cuda.synchronize()
    t = time.perf_counter()
    traj = None
    for r in range(max(1, reps)):
        traj = generate(prompts, seeds_for(batch, run=100 + r), cfg)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / max(1, reps)
    assert traj is not None
    return {
        "B": batch,
        "s/rollout": dt,
        "img/s": batch / dt,
        "finite": bool(torch.isfinite(traj.log_prob).all()),
    }


def section_throughput(ctx: Ctx) -> None:
    args = ctx.args
    path = save_real_size_dir(Path(args.real_dir), args.layers, ctx.device)
    cfg = SamplingConfig(height=512, width=512, num_steps=10, guidance_scale=4.0, negative_prompt=" ", sde_kind="flow_sde", noise_level=1.2, window_size=2, window_range=(0, 5), micro_batch=args.batch)  # fmt: skip
    print(
        f"\n## throughput, real-size random weights ({args.layers} blocks), 512^2, 10 steps, CFG 4, window 2 in [0,5)"
    )
    cols = ["engine", "B", "s/rollout", "img/s", "finite"]
    print(fmt_table([], cols), flush=True)

    def row(
        r: dict[str, Any],
    ) -> None:  # each row as soon as it is measured: a later mode may run out of time
        print(fmt_table([r], cols).splitlines()[-1], flush=True)
        value = f"{r['img/s']:.3f} img/s" if "img/s" in r else r.get("finite")
        ctx.note("throughput", r["engine"], value)

    def vllm_mode(mode: str) -> None:
        try:
            engine = vllm_engine(path, ctx, max_batch=args.batch, enforce_eager=(mode == "eager"))
            try:
                row(
                    {
                        "engine": f"vllm-omni {mode}",
                        **_time_engine(engine.generate, cfg, args.batch, args.reps),
                    }
                )
            finally:
                engine.close()
                gc.collect()
                torch.cuda.empty_cache()
        except Exception as e:  # a failed mode is a row, not the end of the table
            row({"engine": f"vllm-omni {mode}", "finite": f"failed: {type(e).__name__}: {e}"[:160]})
            traceback.print_exc()

    modes = args.modes.split(",")
    vllm_mode(modes[0])
    if not args.skip_in_process:  # before the slower modes, so that a timeout still leaves the baseline
        model = in_process(path, ctx.device)
        for mode in args.in_process_modes.split(","):
            if mode == "compile":  # the same regional compile as --model.compile in training
                configure_transformer(model.transformer, compile_blocks=True)
            r = _time_engine(DiffusersEngine(model).generate, cfg, args.batch, args.reps)
            row({"engine": f"in-process {mode}", **r})
        del model
        gc.collect()
        torch.cuda.empty_cache()
    for mode in modes[1:]:
        vllm_mode(mode)


SECTIONS: dict[str, Callable[[Ctx], None]] = {
    "parity": section_parity,
    "lora": section_lora,
    "weights": section_weights,
    "sleep": section_sleep,
    "throughput": section_throughput,
}


def cpu_selftest() -> None:
    """The helpers on the tiny model, in-process only (no vllm): trajectories against themselves."""
    from fgrpo.models.tiny import tiny_qwen_image

    args = argparse.Namespace(size=32, steps=3)
    cfg = tiny_cfg(args)
    model = as_flow_model(tiny_qwen_image(0))
    seeds = seeds_for(2)
    a = DiffusersEngine(model).generate(PROMPTS[:2], seeds, cfg)
    rows = step_gaps(a, a, recompute_log_probs(model, a, cfg))
    assert all(r["dx_max"] == 0 and r["dlp_trainer"] == 0 for r in rows), rows
    state, config = random_lora(model.transformer, seed=1)
    assert merge_lora_(model.transformer, state, config) > 0
    b = DiffusersEngine(model).generate(PROMPTS[:2], seeds, cfg)
    assert (b.x_next - a.x_next).abs().mean() > 0
    print(fmt_table(step_gaps(b, a), ["step", "sigma", "n", "dx_mean", "dx_max", "dlp_rollout"]))
    print("cpu selftest ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sections", default="parity,lora,weights,sleep", help=f"comma-separated: {','.join(SECTIONS)}"
    )
    ap.add_argument(
        "--out", default=os.environ.get("OUT", "/tmp/fgrpo_vllm_omni_check"), help="output folder"
    )
    ap.add_argument("--size", type=int, default=128, help="tiny checks: image size (multiple of 16)")
    ap.add_argument("--steps", type=int, default=6, help="tiny checks: denoising steps (all stochastic)")
    ap.add_argument("--lp-tol", type=float, default=0.05, help="parity: max mean |engine - trainer| log-prob")
    ap.add_argument(
        "--attention-backend", default="", help="vllm-omni diffusion_attention_backend, e.g. TORCH_SDPA"
    )
    ap.add_argument(
        "--real-dir", default="/tmp/fgrpo_qwen_image_real", help="throughput: real-size random dir"
    )
    ap.add_argument("--layers", type=int, default=60, help="throughput: transformer blocks (60 = real)")
    ap.add_argument("--batch", type=int, default=16, help="throughput: samples per rollout")
    ap.add_argument("--reps", type=int, default=2, help="throughput: timed rollouts per row")
    ap.add_argument("--modes", default="eager,compile", help="throughput: vllm-omni eager and/or compile")
    ap.add_argument(
        "--in-process-modes", default="eager,compile", help="throughput: in-process eager and/or compile"
    )
    ap.add_argument("--skip-in-process", action="store_true", help="throughput: only the vllm-omni rows")
    ap.add_argument("--cpu-selftest", action="store_true", help="check the helpers on the CPU (no vllm)")
    args = ap.parse_args()
    if args.cpu_selftest:
        cpu_selftest()
        return
    if not torch.cuda.is_available():
        sys.exit("vllm_omni_check needs a CUDA GPU (use --cpu-selftest here)")
    ctx = Ctx(args)
    import vllm_omni  # pyright: ignore[reportMissingImports]  # the optional vllm extra

    print(
        f"# vllm-omni {vllm_omni.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, out={ctx.out}",
        flush=True,
    )
    for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
        t = time.perf_counter()
        try:
            SECTIONS[name](ctx)
        except Exception as e:  # one failed section must not hide the others
            traceback.print_exc()
            ctx.note(name, "section failed", f"{type(e).__name__}: {e}"[:300], ok=False)
        print(f"[{name}] {time.perf_counter() - t:.1f}s", flush=True)
    print("\n## summary")
    print(fmt_table(ctx.summary, ["section", "check", "value", "status"]))


if __name__ == "__main__":
    main()
