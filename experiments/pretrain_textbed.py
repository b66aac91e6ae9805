"""Pretrain textbed: a tiny text-to-image flow model that draws one upper-case word (32x128, grayscale).

What it trains: diffusers' QwenImageTransformer2DModel (or SD3Transformer2DModel with --model.arch sd3;
tiny config, 4x4 pixel patches) and a 2-layer
byte-level BERT, jointly, from scratch, on synthetic PIL renders of English words (DejaVu Sans Bold,
random size/position/gray levels, dark on light). Rectified flow (x_t = (1 - t) x0 + t noise,
v = noise - x0) with logit-normal t, 10 % prompt dropout for CFG, AdamW, bf16 autocast, EMA.
It snapshots the EMA weights during training, writes the last one as `last/`, scores each snapshot with the
fgrpo OCR reward on held-out words (CFG 3), and keeps the snapshot whose score leaves Flow-GRPO room (about
0.5-0.75) as `chosen/` plus the best as `best/`. The committed checkpoint is `best/`: the RL presets sample it without CFG, where the fully trained
renderer starts at 0.63 (from band snapshots sampled with CFG 3, no Flow-GRPO run held 0.9 (best end 0.883);
benchmarks/RESULTS.md).

How it deviates from a "real" pretraining: the data is an on-device bank of pre-rendered images (each
seen a few times) rather than a stream; no torch.compile (one-shot GPU budget: compile time is
unmeasured risk, eager bf16 already trains it in minutes). Multi-GPU is DDP (no FSDP: 7 M parameters):
every rank draws the same global batch from the same generator and trains on its slice, so N ranks take
the same steps as one process with the whole batch. The EMA is torch's `AveragedModel`; the snapshots are
scored by fgrpo's OCR reward in a process pool (`ParallelReward`).

Commands:
  words (once; writes src/fgrpo/assets/textbed/words_*.txt from flow_grpo's OCR prompts):
      uv run python experiments/pretrain_textbed.py words --words-source <flow_grpo clone>/dataset/ocr/test.txt
  1 GPU (the committed checkpoint is its best/, ~9 minutes on one H200):
      uv run python experiments/pretrain_textbed.py recipe --out-dir runs/pretrain_textbed
  N GPUs (data parallel; --batch-size is the global batch, each rank trains on its slice):
      uv run torchrun --standalone --nproc-per-node N experiments/pretrain_textbed.py recipe
  CPU smoke test (seconds):
      uv run python experiments/pretrain_textbed.py tiny
  The SD3.5 family's renderer (diffusers' SD3Transformer2DModel with SD3.5-Medium's structure, same task):
      uv run python experiments/pretrain_textbed.py recipe --model.arch sd3 --out-dir runs/pretrain_textbed_sd3
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tyro
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from fgrpo import logging as flog
from fgrpo import parallel, runs
from fgrpo.core.schedule import lr_multiplier
from fgrpo.errors import ConfigError, MissingFileError, cli, one_line_errors
from fgrpo.fonts import dejavu_sans
from fgrpo.models import textbed as tb
from fgrpo.rewards.ocr import is_exact
from fgrpo.rewards.runner import ParallelReward
from fgrpo.rollout.engine import render_words


@dataclass(frozen=True)
class DataConfig:
    """Synthetic word renders."""

    bank_size: int = 1_000_000
    """Images pre-rendered before training (sampled with replacement each step; 1M = 4 GB on the GPU)."""
    workers: int = 0
    """Render processes per rank (0 = all cores / ranks)."""
    font: str = ""
    """TrueType font ('' = DejaVu Sans Bold: the system's, else matplotlib's copy; fgrpo.fonts)."""
    min_size_frac: float = 0.55
    """Font size is uniform in [frac * largest size that fits, largest size that fits]."""
    max_font_size: int = 28
    """Cap on the font size in pixels (short words would otherwise fill the canvas)."""
    min_font_size: int = 10
    """Floor on the font size in pixels (smaller is unreadable at 32x128)."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup, then constant or decaying to `min_lr_ratio` at `max_steps`."""

    lr: float = 1e-3
    """Peak learning rate (6e-4 at batch 512 gave the first checkpoint; 1e-3 at 2048 the committed one)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """Adam betas."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    warmup_steps: int = 200
    """Linear warmup steps."""
    schedule: str = "constant"
    """After warmup: constant, linear or cosine decay to min_lr_ratio * lr at step max_steps (set max_steps to
    the steps that fit in time_budget_s, else the budget stops training mid-decay)."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of the peak (decaying schedules only)."""
    grad_clip: float = 1.0
    """Global grad-norm clip."""


@dataclass(frozen=True)
class EvalConfig:
    """Snapshots and their OCR scoring."""

    every_s: float = 35.0
    """Snapshot the EMA weights every this many seconds of training (and at the end)."""
    heldout_words: int = 128
    """Held-out words scored per snapshot (the first N of words_heldout.txt, one seed each)."""
    train_words: int = 64
    """Training words scored per snapshot (seen vs unseen gap)."""
    num_steps: int = 20
    """ODE (Euler) steps of the eval sampler."""
    guidance_scale: float = 3.0
    """Plain CFG scale of the eval sampler."""
    upscale: int = 2
    """Images are upscaled by this factor before OCR (rapidocr reads 64x256 better than 32x128)."""
    det_limit_side_len: int = 64
    """rapidocr detector resize; its default 736 would blow a 64x256 crop up 11x (about 15x slower)."""
    ocr_workers: int = 0
    """OCR processes (0 = min(cores, 12)); each runs one 1-thread onnxruntime."""
    enabled: bool = True
    """False: no OCR scoring (the last snapshot, written as `last/` in any case, can be scored elsewhere)."""
    target: tuple[float, float] = (0.5, 0.75)
    """Held-out OCR band (at this eval's CFG) of the `chosen/` snapshot, the one that leaves Flow-GRPO room
    when the RL samples with the same guidance; an RL run without CFG starts lower, so use `best/` there."""


@dataclass(frozen=True)
class Config:
    """Pretraining of the textbed text renderer."""

    exp_name: str = Path(__file__).stem
    """Run name; defaults to this file's stem."""
    out_dir: str = "runs/pretrain_textbed"
    """Snapshots, chosen checkpoints, metrics.json and sample grids go here."""
    seed: int = 0
    """Seed of the init, the data bank and the training noise."""
    device: str = "cuda"
    """Training device ("cuda": under torchrun, each rank uses cuda:LOCAL_RANK)."""
    batch_size: int = 2048
    """Images per optimizer step, over all ranks (each trains on batch_size / ranks). On an H200 a step of
    512 is launch-bound (~74 ms for ~8 ms of FLOPs): 2048 takes ~0.22 s, 1.6x the images per second."""
    max_steps: int = 100_000
    """Upper bound on optimizer steps (the time budget usually ends training first)."""
    time_budget_s: float = 420.0
    """Stop training after this many seconds (measured from the first step)."""
    p_uncond: float = 0.1
    """Probability of replacing the prompt by the empty prompt (trains the CFG branch)."""
    t_mean: float = 0.0
    """Logit-normal t: t = sigmoid(t_mean + t_std * z)."""
    t_std: float = 1.0
    """Logit-normal t: std of the normal."""
    ema: float = 0.999
    """EMA decay (warmed up as min(ema, (1 + step) / (10 + step)))."""
    log_every: int = 100
    """Print loss and throughput every this many steps."""
    words_dir: str = str(tb.ASSET_DIR)
    """Folder with words_train.txt / words_heldout.txt."""
    words_source: str = ""
    """With the `words` command: the prompt file whose unquoted text gives the vocabulary."""
    model: tb.TextbedConfig = tb.TextbedConfig()
    """Architecture."""
    init: str = ""
    """Start from these weights instead of a random init: a textbed checkpoint folder (model.safetensors and
    config.json), or 'bundled' for the committed renderer of --model.arch; e.g. to continue its pretraining (a fresh
    optimizer, warm-up and EMA). Its architecture must equal --model's. '' = random init."""
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    eval: EvalConfig = EvalConfig()

    @property
    def amp(self) -> bool:
        return self.device.startswith("cuda")


# ---------------------------------------------------------------- vocabulary


def write_word_lists(source: str, words_dir: str) -> tuple[int, int]:
    """Vocabulary from `source`'s unquoted text, split 7:1 by hash into train / held-out files."""
    if not source or not Path(source).is_file():
        raise MissingFileError(
            f"--words-source {source!r} is not a file; pass flow_grpo's dataset/ocr/test.txt"
        )
    words = tb.extract_words(Path(source).read_text())
    heldout = [w for w in words if tb.is_heldout(w)]
    train = [w for w in words if not tb.is_heldout(w)]
    Path(words_dir).mkdir(parents=True, exist_ok=True)
    (Path(words_dir) / "words_train.txt").write_text("\n".join(train) + "\n")
    (Path(words_dir) / "words_heldout.txt").write_text("\n".join(heldout) + "\n")
    return len(train), len(heldout)


# ---------------------------------------------------------------- synthetic data

_FONTS: dict[int, Any] = {}  # PIL FreeTypeFont by size


def _font(path: str, size: int):
    from PIL import ImageFont

    if size not in _FONTS:
        _FONTS[size] = ImageFont.truetype(path, size)
    return _FONTS[size]


def render_word(
    word: str, rng: np.random.Generator, font: str, height: int, width: int, dc: DataConfig
) -> np.ndarray:
    """One uint8 [height, width] render: random size, position and gray levels, dark on light."""
    from PIL import Image, ImageDraw

    # Glyph extents scale linearly with the size; measure at 100 px to find the largest size that fits.
    left, top, right, bottom = _font(font, 100).getbbox(word)
    fit = min((width - 4) * 100 / (right - left), (height - 2) * 100 / (bottom - top))
    hi = max(dc.min_font_size, min(dc.max_font_size, int(fit)))
    lo = max(dc.min_font_size, min(hi, int(dc.min_size_frac * hi)))
    f = _font(font, int(rng.integers(lo, hi + 1)))
    left, top, right, bottom = f.getbbox(word)
    x = rng.integers(2 - left, max(2 - left, width - 2 - right) + 1)
    y = rng.integers(1 - top, max(1 - top, height - 1 - bottom) + 1)
    img = Image.new("L", (width, height), int(rng.integers(200, 256)))
    ImageDraw.Draw(img).text((int(x), int(y)), word, font=f, fill=int(rng.integers(0, 61)))
    return np.asarray(img)


def _render_chunk(args) -> tuple[np.ndarray, np.ndarray]:
    words, n, seed, chunk, font, height, width, dc = args
    rng = np.random.default_rng([seed, chunk])
    idx = rng.integers(0, len(words), n)
    return np.stack([render_word(words[i], rng, font, height, width, dc) for i in idx]), idx


def render_bank(words: list[str], cfg: Config, font: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 [N, H, W], word index int64 [N]); deterministic in cfg.seed whatever the workers."""
    from multiprocessing import get_context

    chunk = 5000
    n_chunks = math.ceil(cfg.data.bank_size / chunk)
    jobs = [
        (
            words,
            min(chunk, cfg.data.bank_size - c * chunk),
            cfg.seed,
            c,
            font,
            cfg.model.height,
            cfg.model.width,
            cfg.data,
        )
        for c in range(n_chunks)
    ]
    workers = cfg.data.workers or max(1, (os.cpu_count() or 1) // parallel.world_size())
    if workers == 1 or n_chunks == 1:
        parts = [_render_chunk(j) for j in jobs]
    else:
        with get_context("fork").Pool(min(workers, n_chunks)) as pool:
            parts = pool.map(_render_chunk, jobs)
    return torch.from_numpy(np.concatenate([p[0] for p in parts])), torch.from_numpy(
        np.concatenate([p[1] for p in parts])
    )


# ---------------------------------------------------------------- training


def ema_decay(cfg: Config, step: int) -> float:
    # Warmup keeps early snapshots from being dominated by the random init.
    return min(cfg.ema, (1 + step) / (10 + step))


def make_ema(model: nn.Module) -> AveragedModel:
    """An EMA copy of `model`'s parameters that starts at its current (init) weights."""
    ema = AveragedModel(model)  # its step counter stays on the CPU: reading it costs no device sync a step
    ema.update_parameters(model)  # the first update copies; every later one averages
    return ema


def update_ema(ema: AveragedModel, model: nn.Module, cfg: Config, step: int) -> None:
    """ema <- d * ema + (1 - d) * model, d = ema_decay(cfg, step), after optimizer step `step` (0-based)."""
    ema.multi_avg_fn = get_ema_multi_avg_fn(ema_decay(cfg, step))
    ema.update_parameters(model)


class Denoiser(nn.Module):
    """The training forward (prompt ids -> text embedding -> velocity) as one module call, so DDP sees it."""

    def __init__(self, model: tb.TextbedModel):
        super().__init__()
        self.model = model

    def forward(
        self, x_t: torch.Tensor, t: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        return self.model.denoise(x_t, t, self.model.embed_ids(ids, mask), mask)


def init_folder(cfg: Config) -> Path | None:
    """The checkpoint folder that `init` names (None for a random init)."""
    if not cfg.init:
        return None
    return tb.BUNDLED["sd3" if cfg.model.arch == "sd3" else ""] if cfg.init == "bundled" else Path(cfg.init)


def pretrain_record(cfg: Config, step: int, train_seconds: float, scores: dict | None = None) -> dict:
    """config.json's entry for a snapshot of this run: {"pretrain": {seed, step, train_seconds, batch_size,
    eval (its scores), init}}. A run that continues a checkpoint (`init`) nests that checkpoint's own entry under
    "init" with where it came from, so a checkpoint trained in several runs keeps its whole history."""
    record: dict = {
        "seed": cfg.seed,
        "step": step,
        "train_seconds": train_seconds,
        "batch_size": cfg.batch_size,
    }
    if scores is not None:
        record["eval"] = scores
    folder = init_folder(cfg)
    if folder is not None:
        previous = json.loads((folder / "config.json").read_text()).get("pretrain", {})
        record["init"] = {"from": cfg.init} | previous
    return {"pretrain": record}


def build_model(cfg: Config, device: torch.device) -> tb.TextbedModel:
    """The model to pretrain, fp32, in train mode: random (seeded by the caller) or `init`'s weights."""
    model = tb.TextbedModel(cfg.model)
    folder = init_folder(cfg)
    if folder is not None:
        from safetensors.torch import load_file

        tb.load_weights(model, load_file(str(folder / "model.safetensors")))  # bf16 -> fp32
    return model.to(device).train()


def check_config(cfg: Config) -> None:
    """One-line errors for settings that would waste a GPU run."""
    folder = init_folder(cfg)
    if folder is not None:
        if not (folder / "model.safetensors").is_file() or not (folder / "config.json").is_file():
            raise MissingFileError(
                f"init={cfg.init!r}: no model.safetensors and config.json in {folder}; pass a textbed checkpoint "
                "folder (a snapshot of this script's out_dir) or 'bundled'"
            )
        saved = tb.TextbedConfig.from_dict(json.loads((folder / "config.json").read_text())["model"])
        if saved != cfg.model:
            diff = ", ".join(
                f"{f.name}={getattr(saved, f.name)!r}"
                for f in dataclasses.fields(saved)
                if getattr(saved, f.name) != getattr(cfg.model, f.name)
            )
            raise ConfigError(
                f"init={cfg.init!r} is a different architecture than --model ({diff} there); pass those --model "
                "flags or another init"
            )
    if cfg.optim.schedule not in ("constant", "linear", "cosine"):
        raise ConfigError(f"optim.schedule={cfg.optim.schedule!r}: use constant, linear or cosine")
    if cfg.optim.schedule != "constant" and cfg.max_steps <= cfg.optim.warmup_steps:
        raise ConfigError(
            f"optim.schedule={cfg.optim.schedule} decays until max_steps={cfg.max_steps}, which is not after "
            f"optim.warmup_steps={cfg.optim.warmup_steps}: raise --max-steps"
        )
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be in [0, 1]")


def train(cfg: Config) -> list[tuple[float, int, dict[str, torch.Tensor]]]:
    """Train; returns the EMA snapshots [(train seconds, step, fp32 state dict)] (empty on ranks > 0)."""
    if cfg.batch_size % parallel.world_size():
        n = parallel.world_size()
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is not divisible by the {n} ranks; make it a multiple"
        )
    d = parallel.init_distributed(cfg.device)
    rank, world, device = d.rank, d.world_size, d.device
    torch.manual_seed(cfg.seed)
    font = cfg.data.font or str(dejavu_sans(bold=True))
    words = tb.read_words("train", cfg.words_dir)

    t0 = time.perf_counter()
    bank, bank_word = render_bank(words, cfg, font)
    log = flog.print0
    log(f"bank: {len(bank)} renders of {len(words)} words in {time.perf_counter() - t0:.1f}s")
    bank, bank_word = bank.to(device), bank_word.to(device)
    word_ids, word_mask = (
        t.to(device) for t in tb.tokenize([tb.prompt_for(w) for w in words], cfg.model.max_text_len)
    )
    empty_ids, empty_mask = (t.to(device) for t in tb.tokenize([""], cfg.model.max_text_len))

    model = build_model(cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    log(
        f"params: transformer {sum(p.numel() for p in model.transformer.parameters()) / 1e6:.2f}M, "
        f"text encoder {sum(p.numel() for p in model.text_encoder.parameters()) / 1e6:.2f}M"
    )
    # No weight decay on norms, biases and embeddings' 1-D params (standard AdamW practice).
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.optim.lr,
        betas=cfg.optim.betas,
        fused=device.type == "cuda",
    )
    ema = make_ema(model)
    ema_model: tb.TextbedModel = ema.module  # type: ignore[assignment]  # AveragedModel keeps a deep copy of model
    # The last block's text-stream output feeds nothing (no gradient, ever): a static graph lets DDP skip
    # those parameters without searching the graph every step.
    ddp = DistributedDataParallel(
        Denoiser(model), device_ids=[device.index] if device.type == "cuda" else None, static_graph=True
    )
    # Same seed on every rank: all ranks draw the same global batch and each keeps its slice [lo, lo + b).
    gen = torch.Generator(device).manual_seed(cfg.seed + 1)
    snapshots = []

    def snapshot(elapsed: float, step: int) -> None:
        if rank:
            return
        snapshots.append((elapsed, step, tb.state_dict_for_save(ema_model, torch.float32)))
        print(f"snapshot at step {step} ({elapsed:.0f}s)", flush=True)

    B, b = cfg.batch_size, cfg.batch_size // world
    lo = rank * b
    t_start = time.perf_counter()
    next_snap = cfg.eval.every_s
    step, seen, t_log = 0, 0, t_start
    while step < cfg.max_steps:
        idx = torch.randint(len(bank), (B,), device=device, generator=gen)[lo : lo + b]
        x0 = tb.patchify(bank[idx].float() / 127.5 - 1.0, cfg.model.patch)  # [b, seq, p*p] in [-1, 1]
        w = bank_word[idx]
        drop = (torch.rand(B, device=device, generator=gen) < cfg.p_uncond)[lo : lo + b]
        ids = torch.where(drop[:, None], empty_ids, word_ids[w])
        mask = torch.where(drop[:, None], empty_mask, word_mask[w])
        t = torch.sigmoid(cfg.t_mean + cfg.t_std * torch.randn(B, device=device, generator=gen))[lo : lo + b]
        noise = torch.randn((B, *x0.shape[1:]), device=device, generator=gen)[lo : lo + b]
        x_t = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
        target = noise - x0

        lr = cfg.optim.lr * lr_multiplier(
            step,
            warmup=cfg.optim.warmup_steps,
            schedule=cfg.optim.schedule,
            decay_steps=cfg.max_steps,
            min_ratio=cfg.optim.min_lr_ratio,
        )
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device.type, torch.bfloat16, enabled=cfg.amp):
            v = ddp(x_t, t, ids, mask)
        loss = torch.nn.functional.mse_loss(v.float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over the ranks: the gradient of the global batch mean
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        opt.step()
        update_ema(ema, model, cfg, step)
        step += 1
        seen += B

        if step % cfg.log_every == 0 or step == cfg.max_steps:
            loss_v = loss.detach()
            if world > 1:
                torch.distributed.all_reduce(loss_v)
                loss_v /= world
            loss_v, gn = loss_v.item(), gnorm.item()  # syncs; the timing below is then honest
            now = time.perf_counter()
            log(
                f"step {step} loss {loss_v:.4f} gnorm {gn:.2f} lr {lr:.2e} {seen / (now - t_log):.0f} img/s "
                f"({now - t_start:.0f}s)"
            )
            seen, t_log = 0, now
        elapsed = time.perf_counter() - t_start
        if elapsed >= next_snap:
            snapshot(elapsed, step)
            next_snap += cfg.eval.every_s
        if out_of_time(elapsed >= cfg.time_budget_s, step % cfg.log_every == 0, device, world):
            if cfg.optim.schedule != "constant":
                log(f"time budget hit at step {step} of {cfg.max_steps}: the LR decay did not finish")
            break
    if not rank and (not snapshots or snapshots[-1][1] != step):
        snapshot(time.perf_counter() - t_start, step)
    del ddp, opt, bank  # the reducer and optimizer state go before the process group
    parallel.shutdown()
    return snapshots


def out_of_time(mine: bool, sync_point: bool, device: torch.device, world: int) -> bool:
    """Whether this run is out of time. Ranks must leave the loop at the same step, so with several they
    agree (any rank out of time) only at sync points, the log steps: a collective every step would stall
    the launch-bound loop. A multi-rank run can therefore overrun its budget by up to log_every steps."""
    if world == 1:
        return mine
    if not sync_point:
        return False
    flag = torch.tensor([float(mine)], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def evaluate(cfg: Config, snapshots) -> list[dict]:
    """Render held-out and train words with each snapshot and score them with the fgrpo OCR reward."""
    device = torch.device(cfg.device)
    heldout = tb.read_words("heldout", cfg.words_dir)[: cfg.eval.heldout_words]
    trainw = tb.read_words("train", cfg.words_dir)[
        :: max(1, len(tb.read_words("train", cfg.words_dir)) // max(1, cfg.eval.train_words))
    ][: cfg.eval.train_words]
    words = heldout + trainw
    prompts = [tb.prompt_for(w) for w in words]
    seeds = list(range(len(words)))  # seed i for the i-th word: same noise for every snapshot
    model = tb.TextbedModel(cfg.model).to(device).eval()
    dt = torch.bfloat16 if cfg.amp else torch.float32
    images = []
    for _, _, sd in snapshots:
        tb.load_weights(model, sd)
        model.to(dt)
        images.append(
            tb.upscale(
                render_words(
                    model,
                    prompts,
                    seeds,
                    num_steps=cfg.eval.num_steps,
                    guidance_scale=cfg.eval.guidance_scale,
                ),
                cfg.eval.upscale,
            ).cpu()
        )
        model.float()
    # Ground-truth renders of the held-out words: the OCR ceiling a perfect generator would reach.
    font = cfg.data.font or str(dejavu_sans(bold=True))
    rng = np.random.default_rng([cfg.seed, 10**6])
    real = np.stack([render_word(w, rng, font, cfg.model.height, cfg.model.width, cfg.data) for w in heldout])
    real = tb.upscale(torch.from_numpy(real)[..., None].expand(-1, -1, -1, 3), cfg.eval.upscale)
    flat = torch.cat([*images, real]).numpy()
    t0 = time.perf_counter()
    # One 1-thread onnxruntime per process: rapidocr's per-image loop scales with processes, not threads.
    spec = {"name": "ocr", "det_limit_side_len": cfg.eval.det_limit_side_len, "num_threads": 1}
    with ParallelReward(spec, cfg.eval.ocr_workers or min(os.cpu_count() or 1, 12)) as reward:
        scores = reward(flat, [tb.prompt_for(w) for w in words * len(snapshots) + heldout]).scores
    real_ocr = float(scores[-len(heldout) :].mean())
    print(f"OCR ceiling (real renders of the held-out words): {real_ocr:.3f}", flush=True)
    print(f"OCR of {len(flat)} images in {time.perf_counter() - t0:.1f}s", flush=True)
    results = []
    n_h = len(heldout)
    for k, (elapsed, step, _) in enumerate(snapshots):
        s = scores[k * len(words) : (k + 1) * len(words)].astype(np.float64)
        exact = is_exact(s)
        results.append(
            {
                "step": step,
                "train_seconds": round(elapsed, 1),
                "heldout_ocr": float(s[:n_h].mean()),
                "heldout_exact": float(exact[:n_h].mean()),
                "train_ocr": float(s[n_h:].mean()) if len(s) > n_h else float("nan"),
                "train_exact": float(exact[n_h:].mean()) if len(s) > n_h else float("nan"),
                "real_renders_heldout_ocr": real_ocr,
            }
        )
        print(
            f"step {step} ({elapsed:.0f}s): held-out OCR {results[-1]['heldout_ocr']:.3f} "
            f"exact {results[-1]['heldout_exact']:.2f} | train OCR {results[-1]['train_ocr']:.3f}",
            flush=True,
        )
    # The first (up to) 32 held-out samples of every snapshot, 8 a row, each captioned with its OCR score.
    n = min(32, n_h)
    flog.save_image_grid(
        Path(cfg.out_dir) / "samples.png",
        np.concatenate([im[:n].numpy() for im in images]),
        [
            f"step {step}: {w} {scores[k * len(words) + i]:.2f}"
            for k, (_, step, _) in enumerate(snapshots)
            for i, w in enumerate(words[:n])
        ],
        ncols=min(8, n),
        caption_lines=1,
    )
    return results


def choose(results: list[dict], band: tuple[float, float]) -> tuple[int, int]:
    """(index of the snapshot to commit, index of the best). Commit: the last snapshot inside the band
    (later = better-trained text encoder and layout); if none is inside, the one closest to its middle."""
    best = max(range(len(results)), key=lambda k: results[k]["heldout_ocr"])
    inside = [k for k, r in enumerate(results) if band[0] <= r["heldout_ocr"] <= band[1]]
    if inside:
        return inside[-1], best
    mid = sum(band) / 2
    return min(range(len(results)), key=lambda k: abs(results[k]["heldout_ocr"] - mid)), best


def main(cfg: Config) -> dict:
    check_config(cfg)
    out = Path(cfg.out_dir)
    rank = parallel.rank()
    if rank == 0:
        runs.save_run_metadata(out, cfg, __file__)
    snapshots = train(cfg)
    if rank != 0:
        return {}
    # The trained weights reach the disk before the scoring starts: a run stopped while scoring (a time limit, a
    # missing OCR package) keeps them as `last/`.
    elapsed, step, sd = snapshots[-1]
    model = tb.TextbedModel(cfg.model)
    tb.load_weights(model, sd)
    tb.save_textbed(model, out / "last", pretrain_record(cfg, step, round(elapsed, 1)))
    print(f"wrote {out / 'last'} (step {step}, not scored)", flush=True)
    if not cfg.eval.enabled:
        return {"snapshots": [{"step": s, "train_seconds": round(e, 1)} for e, s, _ in snapshots]}
    results = evaluate(cfg, snapshots)
    pick, best = choose(results, cfg.eval.target)
    for name, k in (("chosen", pick), ("best", best)):
        tb.load_weights(model, snapshots[k][2])
        scores = {k2: v for k2, v in results[k].items() if k2 != "examples"}
        meta = pretrain_record(cfg, results[k]["step"], results[k]["train_seconds"], scores)
        tb.save_textbed(model, out / name, meta)
    summary = {"snapshots": results, "chosen": pick, "best": best}
    (out / "metrics.json").write_text(json.dumps(summary, indent=2))
    print(
        f"chosen: step {results[pick]['step']} held-out OCR {results[pick]['heldout_ocr']:.3f}; "
        f"best: step {results[best]['step']} held-out OCR {results[best]['heldout_ocr']:.3f}",
        flush=True,
    )
    return summary


def recipe() -> Config:
    return Config()


def tiny() -> Config:
    """Seconds on a CPU: a few steps of a 1-layer model, a handful of OCR reads."""
    return dataclasses.replace(
        Config(),
        device="cpu",
        batch_size=8,
        max_steps=3,
        time_budget_s=1e9,
        log_every=1,
        out_dir="runs/pretrain_textbed_tiny",
        model=dataclasses.replace(tb.TextbedConfig(), num_layers=1),
        data=DataConfig(bank_size=64, workers=1),
        eval=dataclasses.replace(
            EvalConfig(), every_s=1e9, heldout_words=2, train_words=1, num_steps=2, ocr_workers=1
        ),
    )


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "words":
        cfg = tyro.cli(Config, args=sys.argv[2:])
        with one_line_errors():
            print("train/heldout words:", write_word_lists(cfg.words_source, cfg.words_dir))
    else:
        presets = {
            "recipe": ("The committed checkpoint's run (1 GPU, ~7 min).", recipe()),
            "tiny": ("CPU smoke test (seconds).", tiny()),
        }
        cli(main, presets)
