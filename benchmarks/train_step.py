"""One full training step of the Qwen-Image (SD3.5-M, Qwen-Image-Edit, LTX-2.3, FLUX.1-dev) OCR LoRA recipe at real size, phase by phase (any --algo).

Real-size QwenImageTransformer2DModel (20 B) and AutoencoderKLQwenImage with random weights built on
the GPU by benchmarks/rollout.py's `build_real` (`--model sd3`: SD3.5-Medium's 2.2 B transformer and VAE,
`build_real_sd3`; `--model qwen_image_edit`: Qwen-Image-Edit, `build_real_qwen_image_edit`, with a synthesised
condition image per prompt; `--model ltx2`: LTX-2.3's transformer, connectors, video and audio VAEs and vocoder,
`build_real_ltx2`, whose rows count videos; `--model flux`: FLUX.1-dev's 12 B transformer and VAE,
`build_real_flux`; `--model flux2`: FLUX.2 [klein] base 4B's, `build_real_flux2`; `--model flux2_dev`: FLUX.2
[dev]'s 32 B transformer and VAE, `build_real_flux2_dev`, recipe experiments/flux2_ocr.py's `dev`; `--model zimage`: Z-Image's
transformer and VAE, `build_real_zimage`, recipe experiments/zimage_ocr.py; `--model wan`: Wan 2.2 TI2V-5B's
transformer and VAE, `build_real_wan`, recipe experiments/wan_video_ocr.py (`--wan-variant a14b`: the T2V-A14B's two
14 B experts and the Wan 2.1 VAE, `build_real_wan_a14b`, its `a14b` preset, both experts' LoRA trained); `--model bagel`: BAGEL-7B-MoT's MoT
decoder and FLUX.1's VAE, `build_real_bagel`, recipe experiments/bagel_ocr.py); the text encoders are replaced by fixed random prompt embeddings of
the real shapes (their cost is one forward per distinct prompt, cached over the group). Qwen-Image-Edit,
LTX-2.3 and FLUX.1-dev sample, train their LoRA and batch by their experiment files' `recipe` presets
(experiments/qwen_image_edit_ocr.py, experiments/ltx2_ocr.py, experiments/flux_ocr.py). The reward is a stub (each image's mean pixel value), or with
`--reward vlm` the OCR reward read by a Qwen2.5-VL at the 3B's widths with random weights (benchmarks/vlm_model.py;
the tiny one with --tiny) on the same GPU, unsharded and uncompiled: OcrReward (LTX-2.3: VideoOcrReward) over
TransformersOcrEngine, each rollout micro-batch's images in one generate call of at most 16 new tokens; its seconds
are the step's "reward" phase, inside the totals and the images/GPU/s, and its weights inside the peak memory (the
FLOP ceiling below counts the transformer only).

Everything else is the trainer: the model is handed to `fgrpo.train.Trainer` (which adds the LoRA and shards it,
FSDP2, bf16 compute, fp32 masters, gradient checkpointing, and builds the optimizer, engine and algorithm from a
TrainConfig of the recipe), and a step is its methods, timed: `experience` (prompts in the trainer's order over the
prompts, rollout, reward, gathered rewards -> advantages; its "rollout" and "reward" phases) and `update` (its
"train" phase); between them the window algorithms' 'recompute' pass of old log-probs is timed on its own. Several
--algo (and --merged-rollout / --fp8 / --split-cfg settings) build one Trainer each over the one model.

    python benchmarks/train_step.py                      # H200: 2 prompts x 16 images, eager
    python benchmarks/train_step.py --compile            # regional torch.compile of the blocks
    python benchmarks/train_step.py --compile --reward vlm   # + the OCR reward of a random Qwen2.5-VL-3B, colocated
    python benchmarks/train_step.py --compile --rollout-engine diffusers,vllm_omni --real-dir /tmp/real
                                                         # the loop on each engine over one model (vLLM-Omni asleep
                                                         # through the update), written to /tmp/real first (41 GB)
    python benchmarks/train_step.py --compile --reward vlm-served --reward-stream --kill-server-at 5
                                                         # the VLM reward served by `vllm serve`, then killed mid-step
    python benchmarks/train_step.py --tiny               # CPU wiring check with a tiny model
    python benchmarks/train_step.py --compile --algo nft # another update rule (grpo dppo mixgrpo nft awm)
    python benchmarks/train_step.py --compile --algo grpo,nft,awm   # several, one model build and warm compile
    python benchmarks/train_step.py --compile --model sd3           # SD3.5-M: flow_grpo's SD3 LoRA recipe
    python benchmarks/train_step.py --compile --model qwen_image_edit   # 2 prompts x 16 edits, micro-batch 4
    python benchmarks/train_step.py --compile --model ltx2          # 2 prompts x 8 videos (81 x 256x384)
    python benchmarks/train_step.py --compile --model flux          # 2 prompts x 24 images, guidance 3.5 embedded
    python benchmarks/train_step.py --tiny --model flux2_dev --iters 0   # FLUX.2 [dev] wiring on the CPU
    python benchmarks/train_step.py --tiny --model ltx2 --iters 0   # CPU wiring check of a family
    python benchmarks/train_step.py --model wan --wan-variant a14b  # Wan 2.2 T2V-A14B, both experts (~57 GB bf16)
    torchrun --nproc-per-node 2 benchmarks/train_step.py --prompts 4   # 2 GPUs, 32 images per GPU
    python benchmarks/train_step.py --opt-steps 1 --iters 0 --save-update /tmp/u.safetensors
    torchrun --nproc-per-node 2 benchmarks/train_step.py --opt-steps 1 --iters 0 --compare-update /tmp/u.safetensors
                                                         # the 2-GPU update equals the 1-GPU one (same batch)

Ceilings: the FLOPs of one 512² transformer forward of one sequence, counted on the model itself
(torch.utils.flop_counter; Qwen-Image 14.9 TFLOP with the benchmark's ~14-token prompts); per image the Qwen-Image recipe does 10 steps x 2
(true-CFG) forwards in rollout and W=2 x 2 x (forward + input-grad backward + checkpoint recompute ~ 3
forwards) in training: 20 + 12 = 32 forwards = 477 TFLOP; over the bf16 matmul rate of an H200. Qwen-Image-Edit
and LTX-2.3 count their own forward the same way (Qwen-Image-Edit: the 512² image, its 1024² condition image and
the VL-length text; LTX-2.3: one whole clip, video and audio tokens and 1024 text tokens) and their recipes'
steps and windows.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rollout import (  # benchmarks/rollout.py: the same random models
    build_real,
    build_real_bagel,
    build_real_flux,
    build_real_flux2,
    build_real_flux2_dev,
    build_real_ltx2,
    build_real_qwen_image_edit,
    build_real_sd3,
    build_real_wan,
    build_real_wan_a14b,
    build_real_zimage,
    condition_folder,
    edit_prompts,
    forward_tflop,
    recipe,
)
from torch._C._profiler import _ExperimentalConfig

from fgrpo.models import tiny
from fgrpo.models.base import trained_transformers
from fgrpo.models.lora import float8_base_model
from fgrpo.models.registry import build_tiny

MATMUL_TFLOPS_H200 = 755.0  # bf16, measured on an H200 (RESULTS.md)
VERL_OMNI_IMAGES_PER_GPU_S = 0.305  # published, 4xH800, LoRA + CFG, same recipe
# --fp8's words: (the merged rollout's copies, model.fp8_train); fp8_train scales per row whatever the copies take
FP8_SETTINGS = {
    "off": ("off", False),
    "rowwise": ("rowwise", False),
    "tensorwise": ("tensorwise", False),
    "train": ("off", True),
    "train+rowwise": ("rowwise", True),
    "train+tensorwise": ("tensorwise", True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random model on CPU (wiring check)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step over all ranks")
    ap.add_argument("--group", type=int, default=0, help="images per prompt (0 = 16; ltx2: the recipe's 8)")
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="samples per forward (x2 sequences with CFG; 0 = 8; qwen_image_edit: the recipe's 4)",
    )
    ap.add_argument("--opt-steps", type=int, default=2, help="optimizer steps per training step")
    ap.add_argument(
        "--model",
        default="qwen_image",
        choices=[
            "qwen_image",
            "sd3",
            "qwen_image_edit",
            "ltx2",
            "flux",
            "flux2",
            "flux2_dev",
            "zimage",
            "wan",
            "bagel",
        ],  # fmt: skip
        help="qwen_image: the OCR LoRA recipe (r64, true CFG 4, flow_sde window 2 of [0, 5)); sd3: SD3.5-M with "
        "flow_grpo's SD3 LoRA recipe (r32 on attention, CFG 4.5, CPS noise 0.8 in a 3-step window of [0, 5)); "
        "qwen_image_edit, ltx2, flux, flux2, flux2_dev, zimage, wan, bagel: their experiment files' recipe presets (sampling, "
        "LoRA, optimizer)",
    )
    ap.add_argument(
        "--wan-variant",
        default="ti2v-5b",
        choices=("ti2v-5b", "a14b"),
        help="--model wan: the TI2V-5B (its `recipe` preset) or the T2V-A14B (two experts, its `a14b` preset)",
    )
    ap.add_argument(
        "--cfg", type=float, default=0.0, help="CFG scale (0 = the recipe's: 4 / 4.5; 1 = no CFG)"
    )
    ap.add_argument(
        "--algo",
        default="grpo",
        help="update rule(s), comma-separated: grpo dppo mixgrpo nft awm (fgrpo/algorithms.py); nft/awm roll "
        "out with the ODE and train --train-points forward-process points a sample, without CFG (their recipes)",
    )
    ap.add_argument(
        "--train-points",
        type=int,
        default=0,
        help="nft/awm: points per sample (0 = the recipe's: 9 for nft, 6 for awm)",
    )
    ap.add_argument(
        "--no-exact-rollout",
        action="store_true",
        help="compiled: roll out through the no-grad graph (model.exact_rollout=False) instead of the training one",
    )
    ap.add_argument("--full", action="store_true", help="train all transformer weights instead of LoRA")
    ap.add_argument(
        "--layers",
        type=int,
        default=0,
        help="transformer blocks of the real-size model (0 = all: 60 / 24 / 60 / 48 / FLUX 19 joint)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="model.compile: regional torch.compile of the transformer blocks, and the VAE decoder compiled",
    )
    ap.add_argument(
        "--eager-vae", action="store_true", help="with --compile, keep the VAE decoder eager (to measure it)"
    )
    ap.add_argument(
        "--shard",
        choices=("full", "adapters"),
        default="full",
        help="parallel.shard: FSDP2 shards every weight, or only the LoRA (the frozen base replicated)",
    )
    ap.add_argument(
        "--checkpointing",
        choices=("full", "selective"),
        default="full",
        help="model.checkpoint_policy: backward recomputes each block's forward, or its pointwise ops only",
    )
    ap.add_argument(
        "--attention-backend",
        default="",
        help="model.attention_backend: a diffusers attention dispatcher name ('native', '_native_cudnn', "
        "'_native_flash', ...; '' = the recipe's)",
    )
    ap.add_argument(
        "--reward",
        choices=("stub", "vlm", "vlm-served"),
        default="stub",
        help="stub: each image's mean pixel value (no phase of its own); vlm: the OCR reward of a random Qwen2.5-VL-3B (tiny with --tiny) on "
        "the same device, timed as the 'reward' phase; vlm-served: the same model written to --vlm-dir and served "
        "by `vllm serve` in its own process on the same GPU, read through fgrpo's OpenAI client (one request an "
        "image, all of a call in flight at once; needs vllm)",
    )
    ap.add_argument(
        "--vlm-dir",
        default="",
        help="with --reward vlm-served: the VLM's checkpoint directory, written if absent ('' = a temporary one); "
        "the server's console goes to vllm_serve.log beside it",
    )
    ap.add_argument(
        "--vlm-gpu-fraction",
        type=float,
        default=0.1,
        help="with --reward vlm-served: vLLM's --gpu-memory-utilization, its share of the GPU's memory",
    )
    ap.add_argument(
        "--kill-server-at",
        type=float,
        default=0.0,
        help="with --reward vlm-served: after the timed steps, one more step with the server killed this many "
        "seconds into it; prints how the step ended and when (0 = off)",
    )
    ap.add_argument(
        "--reward-stream",
        action="store_true",
        help="with --reward vlm(-served): each rollout micro-batch is read on a background thread (its own CUDA stream) "
        "while the next one samples (fgrpo.rewards.runner.RewardStream); the 'reward' phase is the wait after the "
        "rollout",
    )
    ap.add_argument(
        "--reward-static-cache",
        action="store_true",
        help="with --reward vlm: the VLM decodes with a preallocated KV cache, so transformers compiles its "
        "decoding step (CUDA graphs) in the warm-up step",
    )
    ap.add_argument(
        "--reward-image-backend",
        choices=("pil", "torchvision"),
        default="pil",
        help="with --reward vlm: where the VLM's images are resized and cut into patches: pil on the CPU (on the "
        "reward's thread, beside the rollout's), torchvision on the GPU (TransformersOcrEngine's image_backend)",
    )
    ap.add_argument(
        "--reward-varlen-vision",
        action="store_true",
        help="with --reward vlm: the VLM's vision tower attends within its windows in one variable-length call per "
        "layer, not one SDPA call per window (TransformersOcrEngine's varlen_vision)",
    )
    ap.add_argument(
        "--merged-rollout",
        default="off",
        help="off, on, or off,on (each in turn, after its own warm-up step): rollout steps with no row in its "
        "window run merged LoRA weights (model.merged_rollout); needs --shard adapters",
    )
    ap.add_argument(
        "--fp8",
        default="off",
        help="float8 settings, comma-separated, each in turn after its own warm-up step (needs uv sync --extra fp8): "
        "off; rowwise or tensorwise: with --merged-rollout on, the merged copies as float8 and their forwards as "
        "float8 matmuls with that scaling (model.fp8_rollout, model.fp8_scaling); train: the frozen base of the "
        "LoRA layers the merged rollout targets as float8 matmuls (rowwise) in every forward and backward, rollout "
        "window and training alike (model.fp8_train); train+rowwise, train+tensorwise: both (the copies with that "
        "scaling, training rowwise). The train settings run last: "
        "converting the base cannot be undone in the process",
    )
    ap.add_argument(
        "--fp8-deviation",
        action="store_true",
        help="after the timed steps: the step's prompts rolled out four ways from the same seeds with the trained "
        "LoRA (unmerged, merged bf16, float8 rowwise, float8 tensorwise), each compared with the merged bf16 "
        "rollout (`rollout_deviation`); needs --shard adapters and the fp8 extra",
    )
    ap.add_argument(
        "--rollout-engine",
        default="diffusers",
        help="rollout engines, comma-separated, each in turn after its own warm-up step: diffusers (in-process), "
        "vllm_omni (rollout_engine='vllm_omni': vLLM-Omni's own copy of the weights, woken for the rollout and "
        "asleep through the update, the LoRA synced every step, the old log-probs recomputed in the update; "
        "Qwen-Image, GPU, needs vllm + vllm-omni). With vllm_omni every setting reads its model from --real-dir",
    )
    ap.add_argument(
        "--real-dir",
        default="",
        help="with --rollout-engine vllm_omni: the model's diffusers directory, written with random weights if "
        "absent (real size: the 20 B transformer, the VAE and a one-layer text encoder of the real width, ~41 GB; "
        "--tiny: the tiny model); '' = a temporary directory removed at the end",
    )
    ap.add_argument(
        "--split-cfg",
        default="off",
        help="qwen_image(_edit): off (the model's default: one CFG forward over both halves, padded and masked), on "
        "(the two halves as two forwards, each trimmed to its own prompts, so without a padding mask), or off,on",
    )
    ap.add_argument(
        "--prompt-file",
        default="",
        help="the steps' prompts from this file's lines, one per group, each step the next --prompts lines (e.g. "
        "flow_grpo's OCR test prompts, whose lengths differ); default: 'A storefront sign that says \"WORD<k>\"' "
        "every step, all of one length",
    )
    ap.add_argument("--iters", type=int, default=2, help="timed steps (after the warm-up steps)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed steps first (the first compiles; with --prompt-file a second one recompiles the blocks once "
        "for a symbolic text length)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="one more step after the last setting's timed ones, under torch's profiler and left out of the table "
        "(the profiler slows it, and its teardown takes minutes at real size): time in NCCL kernels, the GPU's busy "
        "share in each phase, the kernels that take most",
    )
    ap.add_argument(
        "--comm-probe", action="store_true", help="time a full-model all-gather of the blocks' weights"
    )
    ap.add_argument(
        "--save-update",
        default="",
        help="after the warm-up step: save the trained weights and "
        "AdamW's first moment (= (1 - beta1) x the gradient) to this .safetensors (rank 0)",
    )
    ap.add_argument(
        "--compare-update", default="", help="after the warm-up step: compare them with this file"
    )
    args = ap.parse_args()
    served = args.reward == "vlm-served"
    if (args.vlm_dir or args.kill_server_at) and not served:
        ap.error(
            "--vlm-dir and --kill-server-at are for the served VLM: add --reward vlm-served or drop them"
        )
    if served and args.model == "ltx2":
        ap.error("--reward vlm-served reads images; ltx2's clips take --reward vlm")
    if args.reward_stream and (args.reward == "stub" or args.model == "ltx2"):
        ap.error(
            "--reward-stream streams images to --reward vlm or vlm-served; add one (ltx2's clips are scored whole)"
        )
    if args.eager_vae and not args.compile:
        ap.error("--eager-vae keeps the decoder eager under --compile; add --compile or drop it")
    if args.warmup < 1:
        ap.error(f"--warmup {args.warmup}: at least 1 (the first step compiles and warms up)")
    if args.reward_static_cache and args.reward != "vlm":
        ap.error("--reward-static-cache sets the VLM's cache; add --reward vlm")
    if args.reward_varlen_vision and args.reward != "vlm":
        ap.error("--reward-varlen-vision sets the VLM's vision attention; add --reward vlm")
    if args.reward_image_backend != "pil" and args.reward != "vlm":
        ap.error("--reward-image-backend sets the VLM's image processor; add --reward vlm")

    def settings(flag: str, value: str) -> list[bool]:
        """An off / on / off,on flag as the settings to run in turn."""
        words = [w.strip() for w in value.split(",")]
        if any(w not in ("off", "on") for w in words):
            ap.error(f"{flag} {value!r}: use off, on or off,on")
        return [w == "on" for w in words]

    merged_settings = settings("--merged-rollout", args.merged_rollout)
    if any(merged_settings) and (args.shard != "adapters" or args.full):
        ap.error("--merged-rollout on merges LoRA into a copy of the unsharded base: add --shard adapters")
    fp8_words = [w.strip() for w in args.fp8.split(",")]
    if any(w not in FP8_SETTINGS for w in fp8_words):
        ap.error(f"--fp8 {args.fp8!r}: use {', '.join(FP8_SETTINGS)} or a comma-separated list")
    fp8_settings = [FP8_SETTINGS[w] for w in fp8_words]  # (the merged copies' float8, fp8_train)
    if any(train for _, train in fp8_settings) and (args.full or args.fp8_deviation):
        ap.error("--fp8 train runs the LoRA's frozen base in float8: drop --full and --fp8-deviation")
    if any(copies != "off" for copies, _ in fp8_settings) and not all(merged_settings):
        ap.error("--fp8 rowwise / tensorwise quantize the merged rollout's copies: add --merged-rollout on")
    if args.fp8_deviation and (args.shard != "adapters" or args.full):
        ap.error(
            "--fp8-deviation runs the merged rollout, which needs the unsharded base: add --shard adapters"
        )
    engines = [w.strip() for w in args.rollout_engine.split(",")]
    if any(w not in ("diffusers", "vllm_omni") for w in engines):
        ap.error(f"--rollout-engine {args.rollout_engine!r}: use diffusers, vllm_omni or diffusers,vllm_omni")
    if "vllm_omni" in engines and (
        args.model != "qwen_image"
        or args.full
        or any(merged_settings)
        or args.fp8 != "off"
        or args.split_cfg != "off"
    ):
        ap.error(
            "--rollout-engine vllm_omni samples Qwen-Image's LoRA with vLLM-Omni's own kernels: use --model "
            "qwen_image and drop --full, --merged-rollout, --fp8 and --split-cfg"
        )
    if args.real_dir and "vllm_omni" not in engines:
        ap.error("--real-dir holds the model vLLM-Omni reads: add --rollout-engine vllm_omni or drop it")
    split_settings = settings("--split-cfg", args.split_cfg)
    if any(split_settings) and args.model not in ("qwen_image", "qwen_image_edit"):
        ap.error(
            f"--split-cfg {args.split_cfg!r}: only Qwen-Image's CFG pads its halves; drop it for {args.model}"
        )
    prompt_lines = []
    if args.prompt_file:
        path = Path(args.prompt_file)
        lines = path.read_text().splitlines() if path.is_file() else []
        prompt_lines = [line.strip() for line in lines if line.strip()]
        if len(prompt_lines) < args.prompts:
            ap.error(
                f"--prompt-file {args.prompt_file}: needs a file of at least --prompts {args.prompts} lines"
            )
    if args.shard == "adapters" and args.full:
        ap.error("--shard adapters shards the LoRA and --full trains every weight; drop one of them")

    from fgrpo import algorithms, parallel
    from fgrpo.algorithms import check_config
    from fgrpo.config import (
        AlgoConfig,
        DataConfig,
        GRPOConfig,
        ModelConfig,
        OptimConfig,
        ParallelConfig,
        RewardConfig,
        RunConfig,
        SamplingConfig,
        TrainConfig,
    )
    from fgrpo.logging import PhaseTimer
    from fgrpo.models.loading import compile_decoder, configure_transformer
    from fgrpo.models.ltx2 import LTX2
    from fgrpo.models.qwen_image import QwenImage
    from fgrpo.models.qwen_image_edit import QwenImageEdit
    from fgrpo.models.sd3 import SD3_LORA_TARGETS
    from fgrpo.models.wan import Wan
    from fgrpo.recompute import recompute_log_probs_and_means
    from fgrpo.rewards.runner import AsyncRewardRunner
    from fgrpo.train import Trainer

    algos = args.algo.split(",")
    unknown = [a for a in algos if a not in algorithms.ALGORITHMS]
    if unknown:
        raise SystemExit(f"--algo: unknown {unknown}; choose from {' '.join(algorithms.ALGORITHMS)}")
    d = parallel.init_distributed("cpu" if args.tiny else "cuda")
    a14b = args.model == "wan" and args.wan_variant == "a14b"
    rec = (
        recipe(args.model, "a14b" if a14b else "")
        if args.model in ("qwen_image_edit", "ltx2", "flux", "flux2", "flux2_dev", "zimage", "wan", "bagel")
        else None
    )  # experiments/*.py's recipe (the Wan A14B: its a14b preset)
    group = args.group or (rec.grpo.group_size if rec is not None else 16)
    micro_batch = args.micro_batch or (rec.sampling.micro_batch if rec is not None else 8)
    n = args.prompts * group
    if n % d.world_size:
        raise SystemExit(f"--prompts x --group = {n} is not divisible by the {d.world_size} ranks")
    n_local = n // d.world_size
    torch.manual_seed(0)  # the same random weights and LoRA init on every rank and in every run
    sd3 = args.model == "sd3"
    layers = (
        args.layers
        or {
            "qwen_image": 60,
            "sd3": 24,
            "qwen_image_edit": 60,
            "ltx2": 48,
            "flux": 19,
            "flux2": 5,
            "flux2_dev": 8,
            "zimage": 30,
            "wan": 40 if a14b else 30,
            "bagel": 28,
        }[args.model]
    )
    # the served VLM first: vLLM takes its share of the GPU from the memory free when it starts
    server = start_vlm_server(args, d) if served else None
    real_dir = None
    if "vllm_omni" in engines:
        if d.world_size > 1:
            raise SystemExit(
                "--rollout-engine vllm_omni is wired for one trainer process: run without torchrun"
            )
        real_dir = Path(args.real_dir or tempfile.mkdtemp(prefix="fgrpo-real-")) / "qwen_image"
        model = model_from_dir(real_dir, d.device, tiny=args.tiny, layers=layers)
    elif args.tiny:
        model = tiny.tiny_wan(experts=2) if a14b else build_tiny(args.model)
    elif args.model == "qwen_image":
        model = build_real(d.device, text_encoder=False, layers=layers)
    elif sd3:
        model = build_real_sd3(d.device, layers)
    elif args.model == "qwen_image_edit":
        model = build_real_qwen_image_edit(d.device, layers)
    elif args.model == "flux":
        model = build_real_flux(d.device, layers)
    elif args.model == "flux2":
        model = build_real_flux2(d.device, layers)
    elif args.model == "flux2_dev":
        model = build_real_flux2_dev(d.device, layers)
    elif args.model == "zimage":
        model = build_real_zimage(d.device, layers)
    elif a14b:
        assert rec is not None
        model = build_real_wan_a14b(d.device, layers, num_frames=rec.model.num_frames)
    elif args.model == "wan":
        assert rec is not None
        model = build_real_wan(d.device, layers, num_frames=rec.model.num_frames)
    elif args.model == "bagel":
        model = build_real_bagel(d.device, layers)
    else:
        model = build_real_ltx2(d.device, layers)
    lr = 3e-5 if args.full else 3e-4
    if rec is None:
        res = 64 if args.tiny else 512
        height = width = res
        size = f"{res}²"
        base_sampling = SamplingConfig(
            height=res,
            width=res,
            num_steps=10,
            guidance_scale=args.cfg or (4.5 if sd3 else 4.0),
            negative_prompt="" if sd3 else " ",  # each pipeline's empty negative prompt
            sde_kind="cps" if sd3 else "flow_sde",
            noise_level=0.8 if sd3 else 1.2,
            window_size=3 if sd3 else 2,
            window_range=(0, 5),
            micro_batch=micro_batch,
        )
        lora_rank = 32 if sd3 else 64
        mcfg = ModelConfig(
            kind=args.model,
            dtype="bf16",
            lora=not args.full,
            lora_rank=lora_rank,
            lora_alpha=2 * lora_rank,
            lora_targets=",".join(SD3_LORA_TARGETS) if sd3 else ModelConfig().lora_targets,
            gradient_checkpointing=True,
            checkpoint_policy=args.checkpointing,
            compile=args.compile,
            exact_rollout=not args.no_exact_rollout,
        )
        optim = OptimConfig(lr=lr, weight_decay=1e-4)
        grpo_cfg = GRPOConfig()
    else:
        if isinstance(model, LTX2):  # the model fixes its clip (the tiny one: 9 frames of 32x32)
            height, width = model.height, model.width
            size = f"{height}x{width} {model.num_frames}-frame"
        else:
            height = width = 64 if args.tiny else rec.sampling.height
            size = f"{height}²"
        base_sampling = dataclasses.replace(
            rec.sampling,
            height=height,
            width=width,
            guidance_scale=args.cfg or rec.sampling.guidance_scale,
            micro_batch=micro_batch,
        )
        mcfg = dataclasses.replace(
            rec.model,
            dtype="bf16",
            lora=not args.full,
            gradient_checkpointing=True,
            checkpoint_policy=args.checkpointing,
            compile=args.compile,
            exact_rollout=not args.no_exact_rollout,
        )
        lora_rank = mcfg.lora_rank
        optim = dataclasses.replace(rec.optim, lr=lr)
        grpo_cfg = rec.grpo
    if args.attention_backend:
        mcfg = dataclasses.replace(mcfg, attention_backend=args.attention_backend)
    if mcfg.attention_backend and not args.tiny:  # the recipe's (LTX-2: 'native'), as build_model sets it
        for transformer in trained_transformers(model).values():
            configure_transformer(transformer, attention_backend=mcfg.attention_backend)
    unit = "videos" if isinstance(model, LTX2 | Wan) else "images"
    # built once, before any timing; build_random_vlm forks the RNG, so the LoRA init is the stub run's
    reward = (
        vlm_reward(
            d.device,
            tiny=args.tiny,
            images_per_call=n_local,
            video=isinstance(model, LTX2),
            static_cache=args.reward_static_cache,
            image_backend=args.reward_image_backend,
            varlen_vision=args.reward_varlen_vision,
        )
        if args.reward == "vlm"
        else served_reward(server, images_per_call=n_local)
        if server is not None
        else None
    )
    runner = (
        AsyncRewardRunner(on_side_stream(reward, d.device), kind="thread") if args.reward_stream else None
    )
    if args.compile:  # what model.compile does, before the Trainer adds LoRA and shards (as build_model)
        for transformer in trained_transformers(model).values():
            configure_transformer(transformer, compile_blocks=True)
        if not args.eager_vae:
            compile_decoder(model)
    # The run's prompts, one per group: --prompt-file's lines or the default prompts (an edit model's each with a
    # synthesised condition image at the sampling size), in a prompt file of one run directory for all ranks.
    out = run_folder(d)
    texts = prompt_lines or [f'A storefront sign that says "WORD{p}"' for p in range(args.prompts)]
    prompt_file = write_prompt_file(
        out,
        texts,
        condition_dir=condition_folder() if isinstance(model, QwenImageEdit) else None,
        size=height,
    )

    def run_config(name: str, merged_rollout: bool, fp8: str, fp8_train: bool, engine: str) -> TrainConfig:
        """The trainer's configuration of algorithm `name`: NFT and AWM sample with the ODE and without CFG and
        train 9 / 6 grid points a sample (their recipes); no validation, checkpoint, images or wandb. On vLLM-Omni
        the window algorithms recompute the old log-probs (its kernels differ from the trainer's)."""
        points = args.train_points or {"nft": 9, "awm": 6}.get(name, 2)
        forward_process = algorithms.ALGORITHMS[name].forward_process
        sampling = (
            dataclasses.replace(base_sampling, guidance_scale=1.0) if forward_process else base_sampling
        )
        return TrainConfig(
            exp_name=f"train_step_{name}",
            num_steps=args.warmup + args.iters + args.profile,
            device=d.device.type,
            # the tiny model is fp32 on the CPU (FSDP2 computes in the parameters' dtype there)
            rollout_engine="vllm_omni" if engine == "vllm_omni" else "diffusers",
            model=dataclasses.replace(
                mcfg,
                path=str(real_dir) if real_dir is not None else mcfg.path,
                dtype="fp32" if args.tiny else "bf16",
                merged_rollout=merged_rollout,
                fp8_rollout=fp8 != "off",
                fp8_train=fp8_train,
                fp8_scaling="tensorwise" if fp8 == "tensorwise" else "rowwise",
            ),
            sampling=sampling,
            grpo=dataclasses.replace(
                grpo_cfg,
                group_size=group,
                prompts_per_step=args.prompts,
                optimizer_steps_per_step=args.opt_steps,
                old_log_prob="recompute" if engine == "vllm_omni" else grpo_cfg.old_log_prob,
            ),
            optim=optim,
            algo=dataclasses.replace(AlgoConfig(), name=name, train_steps=points, ema_delay=0),
            data=DataConfig(train_prompts=prompt_file, val_prompts=prompt_file),
            reward=RewardConfig(name="ocr"),  # scored by `reward` (the stub's stands in for OCR)
            run=RunConfig(
                out_dir=str(out),
                wandb="disabled",
                val_every=0,
                ckpt_every=0,
                log_images_every=0,
                export_lora=False,
                overwrite=True,
            ),
            parallel=ParallelConfig(shard=args.shard),
        )

    print0 = (lambda *a, **k: print(*a, **k, flush=True)) if d.is_main else (lambda *a, **k: None)

    def sync():
        if d.device.type == "cuda":
            torch.cuda.synchronize()
        if d.world_size > 1:
            torch.distributed.barrier()

    trainer = None
    tflop_per_forward = 0.0
    in_float8 = False  # whether the model's LoRA base layers were converted (model.fp8_train)
    # the fp8_train settings last: a setting's place among the others is kept
    runs = [
        (name, merged, fp8, fp8_train, split, engine)
        for fp8_train in (False, True)
        for name, merged, (fp8, train), split, engine in itertools.product(
            algos, merged_settings, fp8_settings, split_settings, engines
        )
        if train == fp8_train
    ]
    for run_index, (name, merged_rollout, fp8, fp8_train, split_cfg, engine) in enumerate(runs):
        cfg = run_config(name, merged_rollout, fp8, fp8_train, engine)
        check_config(cfg, d.world_size)
        if fp8_train and trainer is not None and not in_float8:
            # the model was set up by a setting without it: convert as the trainer's setup would have
            float8_base_model(trainer.model)
        in_float8 = in_float8 or fp8_train
        # one model build for every setting: the first Trainer adds the LoRA and shards, the next ones reuse it
        trainer = Trainer(
            cfg,
            d,
            model_builder=lambda mcfg, device, seed, built=model: built,
            model=trainer.model if trainer is not None else None,
            reward=runner or reward or StubReward(),
        )
        if tflop_per_forward == 0.0:
            tflop_per_forward = first_build_report(trainer, args, unit, layers, size, print0)
            if runner is not None and reward is not None and args.reward_static_cache:
                # The static cache compiles the VLM's decoding step at the first call of each batch size.
                # Compiling traces with torch.fx, which patches nn.Module.__call__ for the whole process, so a
                # compile on the streaming thread would capture the rollout's own module calls: compile here,
                # before anything runs beside it, at the sizes the stream sends (one rollout micro-batch, and the
                # remainder).
                prompts = trainer.prompts(0)
                for b in sorted({micro_batch, n_local % micro_batch} - {0}):
                    reward(torch.zeros(b, height, width, 3, dtype=torch.uint8).numpy(), prompts[:b])
        if isinstance(model, QwenImage):
            model.split_cfg = split_cfg
        forward_process = trainer.algo.forward_process
        points, sampling = cfg.algo.train_steps, cfg.sampling
        print0(
            f"\n## {name}: CFG {sampling.guidance_scale}"
            + (", merged LoRA outside the window (rollout)" if merged_rollout else "")
            + (f", float8 {fp8}" if fp8 != "off" else "")
            + (", the LoRA's base in float8 (rowwise) everywhere" if fp8_train else "")
            + (", CFG as two unpadded forwards" if split_cfg else "")
            + (
                ", rollout on vLLM-Omni (the update recomputes the old log-probs)"
                if engine == "vllm_omni"
                else ""
            )
            + (f", {points} points a sample" if forward_process else "")
        )
        rows = []
        nccl_s = float("nan")
        timed_end = args.warmup + args.iters
        profiling = args.profile and run_index == len(runs) - 1  # the last setting's
        for it in range(timed_end + profiling):
            profile = profiling and it == timed_end  # the extra step, not in the table
            # the host's activity too: the phases' ranges (torch records no range of a GPU-only trace) and what the
            # host did while the GPU waited, in every thread (by default torch records the host ops of the thread
            # that started the profiler only, not the streamed reward's)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if d.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = (
                torch.profiler.profile(
                    activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True)
                )
                if profile
                else None
            )
            if prof is not None:
                prof.__enter__()
            if d.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync()
            # the GPU's memory in use by every process, vLLM-Omni's workers too (only with vllm_omni settings)
            device_peak = DevicePeak(d.device) if real_dir is not None and d.device.type == "cuda" else None
            if device_peak is not None:
                device_peak.start()
            timer = PhaseTimer()
            batch = trainer.experience(it, timer)  # rollout, reward, the rewards gathered -> advantages
            experience_s = dict(timer.times)
            sync()
            with timer("recompute"):  # a phase of its own, also in --profile's lines
                if not forward_process and engine == "diffusers":
                    recompute_log_probs_and_means(
                        model, batch.traj, sampling
                    )  # the 'recompute' variant's extra pass (vLLM-Omni's: inside the update, so in "train")
                sync()
            old_s = timer.times["recompute"]
            m = trainer.update(it, batch, timer)
            m.setdefault("logprob_gap/max", float("nan"))  # NFT/AWM have no transition log-probs
            sync()
            # the step's wall before the profiler stops: its teardown and event tables can take longer than the step
            step_s = timer.total()
            t = timer.times
            roll, rew = t["rollout"], t["reward"] + experience_s["sync"]
            lora_sync = t["sync"] - experience_s["sync"]  # the update's sync: an out-of-process engine's LoRA
            train = t["train"] + lora_sync
            if prof is not None:
                prof.__exit__(None, None, None)
                events = trace_events(prof)  # read once, without torch's event tree (minutes at real size)
                nccl = [e for e in gpu_kernels(events) if kernel_kind(e.name) == "NCCL"]
                nccl_s = sum(e.time_range.elapsed_us() for e in nccl) / 1e6
                for line in kernel_profile(events, step_s):
                    print0(line)
            peak = torch.cuda.max_memory_allocated() / 2**30 if d.device.type == "cuda" else 0.0
            all_peak = device_peak.stop() / 2**30 if device_peak is not None else float("nan")
            # warm-up steps compile and warm kernels; the profiled one is slowed by the profiler
            if it < timed_end and (it >= args.warmup or args.iters == 0):
                rows.append((roll, rew, old_s, train, peak, m["logprob_gap/max"], all_peak))
            print0(
                f"step {it}: rollout {roll:.2f}s "
                + (f"reward {rew:.2f}s " if reward is not None else "")
                + f"old-logprob {old_s:.2f}s train {train:.2f}s "
                + (f"(the LoRA's sync {lora_sync:.2f}s) " if engine == "vllm_omni" else "")
                + f"peak {peak:.1f} GiB "
                + (f"(GPU, all processes: {all_peak:.1f} GiB) " if device_peak is not None else "")
                + f"gap {m['logprob_gap/max']:.2e}"
                + (f" nccl {nccl_s:.2f}s" if profile else "")
            )
            if cfg.model.compile and cfg.model.exact_rollout and batch.traj.window.shape[1]:
                # each step's own windows: a step whose rollout runs more steps through the training graph is slower
                engine_sampling = trainer.algo.sampling(it)
                grouped, consecutive = graph_steps(
                    batch.traj.window, engine_sampling.micro_batch, engine_sampling.unit_block
                )
                print0(
                    f"# step {it}: {grouped:.2f} of {sampling.num_steps} steps per micro-batch through the training "
                    f"graph (rows grouped by window; consecutive rows would give {consecutive:.2f})"
                )
            if it == 0 and m.get("skipped_steps", 0):
                print0(
                    f"# warning: {m['skipped_steps']:.0f} optimizer step(s) skipped (non-finite gradient norm)"
                )
            if it == 0 and (args.save_update or args.compare_update):
                names = [k for k, p in trainer.trained.named_parameters() if p.requires_grad]
                save_or_compare_update(
                    names, trainer.params, trainer.optimizer, args.save_update, args.compare_update, d.is_main
                )
        if server is not None and args.kill_server_at and run_index == len(runs) - 1:
            kill_mid_step(trainer, server, args.kill_server_at, timed_end + profiling, print0)
        trainer.finish()

        roll, rew, old, train, peak, gap = (sum(r[k] for r in rows) / len(rows) for k in range(6))
        all_peak = max(r[6] for r in rows)  # the GPU's, every process: the most of the timed steps
        W, steps = sampling.window_size, sampling.num_steps
        forwards = getattr(model, "cfg_forwards", 2) if sampling.guidance_scale > 1 else 1  # FLUX.1-dev: 1
        fwd_roll = n_local * steps * forwards
        # window algorithms: W steps x CFG sequences x (forward + input-grad backward + checkpoint recompute);
        # NFT/AWM: K points x (the old policy's no-grad forward + the same 3), one sequence (no CFG in training)
        fwd_train = n_local * points * 4 if forward_process else n_local * W * forwards * 3
        floor_s = (fwd_roll + fwd_train) * tflop_per_forward / MATMUL_TFLOPS_H200
        compiled = ("compiled, VAE eager" if args.eager_vae else "compiled") if args.compile else "eager"
        total = roll + rew + train  # rew: the stub scores and gathers in milliseconds
        print0()
        print0(
            f"| phase | s | {unit}/GPU/s | effective TFLOP/s per GPU | ({compiled}, "
            f"{d.world_size} GPU(s), shard {args.shard}, {args.checkpointing} checkpointing, attention "
            f"{mcfg.attention_backend or 'default'}, {n_local} {unit} per GPU, "
            f"micro-batch {micro_batch}, peak {peak:.1f} GiB, "
            + (f"GPU in use by all processes at most {all_peak:.1f} GiB, " if real_dir is not None else "")
            + f"rollout engine {engine}, "
            f"first-update log-prob gap {gap:.1e}) |"
        )
        print0("|---|---:|---:|---:|")
        vlm = reward is not None
        phases = [
            ("rollout", roll, fwd_roll),
            *(
                [
                    (
                        f"reward (random Qwen2.5-VL OCR{', served by vLLM' if server else ''}{', static cache' if args.reward_static_cache else ''}{', torchvision images' if args.reward_image_backend == 'torchvision' else ''}{', varlen vision' if args.reward_varlen_vision else ''}{', streamed: the wait' if runner else ''})",
                        rew,
                        None,
                    )
                ]
                if vlm
                else []
            ),
            # vLLM-Omni's recompute is the update's own, inside "train"
            *(
                []
                if forward_process or engine != "diffusers"
                else [("old log-prob (recompute only)", old, n_local * W * forwards)]
            ),
            ("train", train, fwd_train),
            (f"total (rollout + {'reward + ' if vlm else ''}train)", total, fwd_roll + fwd_train),
            *(
                []
                if forward_process or engine != "diffusers"
                else [("total with recompute", total + old, fwd_roll + fwd_train + n_local * W * forwards)]
            ),
        ]
        for phase, t, fwd in phases:  # the reward's FLOPs are the VLM's, not counted
            tflops = "-" if fwd is None else f"{fwd * tflop_per_forward / t:.0f}"
            print0(f"| {phase} | {t:.2f} | {n_local / t:.3f} | {tflops} |")
        if profiling:
            print0(
                f"\ntime in NCCL kernels during the profiled step: {nccl_s:.2f} s "
                f"({nccl_s / (total + old):.1%} of the step; overlapped with compute where FSDP2 prefetches)"
            )
        if not args.tiny and args.model != "qwen_image":  # verl-omni's published number is Qwen-Image's
            print0(
                f"\n{unit}/GPU/s {n_local / total:.3f}; FLOP floor {floor_s:.1f} s -> ceiling "
                f"{n_local / floor_s:.3f} {unit}/GPU/s ({floor_s / total:.0%} of it)"
            )
        elif not args.tiny:
            print0(
                f"\nimages/GPU/s {n_local / total:.3f} = {n_local / total / VERL_OMNI_IMAGES_PER_GPU_S:.2f}x verl-omni's "
                f"published {VERL_OMNI_IMAGES_PER_GPU_S}; FLOP floor {floor_s:.1f} s -> ceiling {n_local / floor_s:.2f} "
                f"images/GPU/s ({floor_s / total:.0%} of it)"
            )
    if args.fp8_deviation and trainer is not None:
        mc = trainer.cfg.model
        fp8_deviation(
            model, trainer.prompts(0), trainer.algo.sampling(0), mc.compile and mc.exact_rollout, print0
        )
    if args.comm_probe and d.device.type == "cuda":
        ag = comm_probe(model.transformer)
        weights_gib = (
            sum(p.numel() * 2 for p in model.transformer.transformer_blocks.parameters()) / 2**30
        )  # global
        print0(
            f"# all-gather of the {layers} blocks' bf16 weights ({weights_gib:.1f} GiB, each rank receives "
            f"{weights_gib * (d.world_size - 1) / d.world_size:.1f} GiB): {ag * 1e3:.0f} ms per full pass"
        )
    if runner is not None:
        runner.close()
    if server is not None:
        server.kill()
        if not args.vlm_dir:  # the temporary checkpoint
            shutil.rmtree(server.path.parent, ignore_errors=True)
    del trainer, model
    sync()  # every rank is done with the run directory
    if d.is_main:
        shutil.rmtree(out, ignore_errors=True)
        if real_dir is not None and not args.real_dir:  # the temporary model directory
            shutil.rmtree(real_dir.parent, ignore_errors=True)
    parallel.shutdown()


def rollout_deviation(traj, ref) -> dict[str, Any]:
    """How far rollout `traj` lands from rollout `ref` of the same prompts and seeds (same windows, initial noise
    and SDE noise; only the forwards differ): every number is a mean over samples (and window steps).

    - `prefix`: {k: ||x_k - x_k^ref|| / ||x_k^ref||} for the samples whose window starts after k >= 1 ODE steps:
      the state the window's trained transitions start from, as the forwards outside the window left it.
    - `x0`: the same relative distance for the final latents.
    - `kl`: the window transitions' KL(N(mean_ref, s^2) || N(mean, s^2)) = ||mean - mean_ref||^2 / (2 s^2) in nats,
      s^2 = ||x_next^ref - mean_ref||^2 / D the transition's variance estimated from its drawn noise (D latent
      elements; one draw of D, so within ~sqrt(2 / D) relative): how far the policy's next-state distribution
      moved because its start moved.
    - `log_prob`: max |log_prob - log_prob_ref|, the window's recorded log-probs (each transition's own noise).
    traj, ref: Trajectory-like (window [B, W], x_t, x_next, mean [B, W, ...], x0 [B, ...], log_prob [B, W])."""

    def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.flatten(1).double(), b.flatten(1).double()
        return (a - b).norm(dim=1) / b.norm(dim=1)

    start = ref.window[:, 0]
    first = rel(traj.x_t[:, 0], ref.x_t[:, 0])  # [B]
    prefix = {int(k): float(first[start == k].mean()) for k in sorted(set(start.tolist())) if k > 0}
    x_next, mean, mean_ref = (t.flatten(2).double() for t in (ref.x_next, traj.mean, ref.mean))
    var = (x_next - mean_ref).pow(2).mean(dim=2)  # [B, W]
    kl = (mean - mean_ref).pow(2).sum(dim=2) / (2 * var)
    return {
        "prefix": prefix,
        "x0": float(rel(traj.x0, ref.x0).mean()),
        "kl": float(kl.mean()),
        "log_prob": float((traj.log_prob.double() - ref.log_prob.double()).abs().max()),
    }


def fp8_deviation(model, prompts: list[str], sampling, train_graph: bool, print0) -> None:
    """The rollout of `prompts` (seeds 0..B-1) four ways with the model's current LoRA: unmerged, merged bf16 (the
    reference: what --merged-rollout on runs), float8 rowwise and tensorwise; a table of `rollout_deviation`
    against the reference, each rollout's wall time beside it (the first call of a setting compiles)."""
    from fgrpo.models.lora import Float8
    from fgrpo.rollout.engine import DiffusersEngine

    seeds = list(range(len(prompts)))
    runs = {}
    settings: tuple[tuple[str, bool, Float8], ...] = (
        ("merged bf16 (reference)", True, "off"),
        ("unmerged (adapters on)", False, "off"),
        ("float8 rowwise", True, "rowwise"),
        ("float8 tensorwise", True, "tensorwise"),
    )
    for label, merged, float8 in settings:
        engine = DiffusersEngine(model, train_graph=train_graph, merged_lora=merged, float8=float8)
        t0 = time.perf_counter()
        runs[label] = (engine.generate(prompts, seeds, sampling), time.perf_counter() - t0)
    ref = runs["merged bf16 (reference)"][0]
    starts = sorted(k for k in set(ref.window[:, 0].tolist()) if k > 0)
    print0(
        f"\n| rollout of {len(prompts)} samples, against the merged bf16 one | window start after "
        + " / ".join(str(k) for k in starts)
        + " ODE steps (relative) | final latents (relative) | window KL (nats per transition) | "
        "log-prob max abs | s |"
    )
    print0("|---|---|---:|---:|---:|---:|")
    for label, (traj, seconds) in runs.items():
        dev = rollout_deviation(traj, ref)
        prefix = " / ".join(f"{dev['prefix'].get(k, float('nan')):.2e}" for k in starts)
        print0(
            f"| {label} | {prefix} | "
            f"{dev['x0']:.2e} | {dev['kl']:.2e} | {dev['log_prob']:.1e} | {seconds:.2f} |"
        )


VLM_MAX_TOKENS = 16  # an answer is one quoted word; a random model runs to the cap, so this bounds decoding


class StubReward:
    """Each image's mean pixel value in [0, 1]: a reward of no cost that depends on the image alone, so a world of
    two ranks scores the samples as one rank does (--compare-update)."""

    def __call__(self, images, prompts, metadata=None):
        from fgrpo.rewards.base import RewardOutput

        pixels = np.asarray(images, dtype=np.float32).reshape(len(images), -1)
        return RewardOutput(scores=pixels.mean(axis=1) / 255.0)


class DevicePeak:
    """The most memory in use on a GPU by every process (vLLM-Omni's workers too) between start() and stop():
    total minus free (cudaMemGetInfo), polled every `every_s` on a thread. torch's own peak counts only this
    process's tensors."""

    def __init__(self, device: torch.device, every_s: float = 0.05):
        self.device, self.every_s, self.peak = device, every_s, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)

    def poll(self) -> None:
        while True:
            free, total = torch.cuda.mem_get_info(self.device)
            self.peak = max(self.peak, total - free)
            if self.done.wait(self.every_s):
                return

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> int:
        """The peak in bytes (the last reading is taken after stop was asked)."""
        self.done.set()
        self.thread.join()
        return self.peak


def model_from_dir(path: Path, device: torch.device, *, tiny: bool, layers: int):
    """--rollout-engine vllm_omni: Qwen-Image read from the diffusers directory vLLM-Omni loads too, written first
    if absent (random weights: vllm_omni_check's real-size directory, or the tiny model), so that both engines
    sample the same weights. The tiny one is fp32 on the CPU, as the other tiny models here."""
    from fgrpo.models.qwen_image import QwenImage
    from fgrpo.models.tiny import save_tiny_qwen_image

    if not (path / "model_index.json").exists():
        if tiny:
            save_tiny_qwen_image(path, seed=0)
        else:
            from vllm_omni_check import save_real_size_dir  # benchmarks/vllm_omni_check.py

            save_real_size_dir(path, layers, device)
    return QwenImage.from_pretrained(path, dtype=torch.float32 if tiny else torch.bfloat16, device=device)


def run_folder(d) -> Path:
    """One temporary run directory for all ranks: rank 0 makes it and tells the others."""
    where = [str(Path(tempfile.mkdtemp(prefix="fgrpo_train_step_"))) if d.is_main else ""]
    if d.world_size > 1:
        torch.distributed.broadcast_object_list(where, src=0)
    return Path(where[0])


def write_prompt_file(out: Path, texts: list[str], *, condition_dir: Path | None, size: int) -> str:
    """The run's prompt file in `out` (every rank writes the same bytes): one line per prompt, or for an edit
    model a .jsonl of each prompt with its synthesised condition image (`edit_prompts`)."""
    if condition_dir is None:
        path = out / "prompts.txt"
        text = "".join(f"{t}\n" for t in texts)
    else:
        path = out / "prompts.jsonl"
        from fgrpo.data import ImagePrompt

        lines = []
        for p in edit_prompts(texts, condition_dir, size):
            assert isinstance(p, ImagePrompt)
            lines.append(json.dumps({"prompt": str(p), "image": str(p.image)}) + "\n")
        text = "".join(lines)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)  # whole whenever a rank reads it
    return str(path)


def first_build_report(trainer, args, unit: str, layers: int, size: str, print0) -> float:
    """Print what the model built is; returns the TFLOP of one transformer forward: the mean over the timed
    steps' distinct prompts of this rank (the default: one of ~14 text tokens), LoRA included."""
    from fgrpo.models.qwen_image import QwenImage

    model, d_world = trainer.model, trainer.split.data_size()
    steps = range(args.warmup + args.iters)
    prompts_at = [trainer.prompts(it) for it in steps]
    timed = list(dict.fromkeys(p for step in prompts_at[args.warmup :] for p in step)) or prompts_at[0][:1]
    height, width = trainer.cfg.sampling.height, trainer.cfg.sampling.width
    tflop = sum(forward_tflop(model, p, height, width) for p in timed) / len(timed)
    n_trainable = sum(p.numel() for p in trainer.params)  # a DTensor's numel() is the global size
    n = trainer.cfg.samples_per_step
    m = trainer.cfg.model
    print0(
        f"# {d_world} rank(s), {n} {unit} per step ({n // d_world} per rank), {args.model}, "
        f"{'full weights' if args.full else f'LoRA r{m.lora_rank}'} ~{n_trainable / 1e9:.2f} B trainable, "
        f"{layers} blocks, {tflop:.2f} TFLOP per {size} forward, {args.opt_steps} optimizer steps, rollout window "
        f"through the {'training' if m.compile and m.exact_rollout else 'no-grad'} graph"
    )
    if isinstance(model, QwenImage):  # one text length compiles static blocks; several, a symbolic length
        used = list(dict.fromkeys(p for step in prompts_at for p in step))
        lengths = model.encode(used)["prompt_mask"].sum(1).tolist()
        print0(f"# prompt tokens {min(lengths)}-{max(lengths)} over {len(lengths)} prompts")
    return tflop


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals in microseconds, in seconds: the time the GPU ran at
    least one kernel (kernels of several streams overlap)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e6


# Kernel families by name, first match wins: cuBLAS's Hopper kernels are `nvjet_*`, with `qq` where both inputs
# are float8; inductor's kernels are `triton_*`, named after the ops they fuse (a float8 cast fuses an amax and a
# clamp); eager ATen kernels live in `at::native`; cuDNN runs a convolution (the VAE) as an implicit GEMM.
KERNEL_KINDS = (
    ("float8 matmul", ("nvjet_sm90_qq", "f8f8", "e4m3")),
    ("matmul or convolution (implicit GEMM)", ("nvjet", "gemm", "cutlass", "xmma", "triton_tem_")),
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("Triton: float8 casts (amax, scale) fused", ("amax",)),
    ("Triton: other fused ops", ("triton_",)),
    ("eager ATen ops", ("at::native",)),
    ("NCCL", ("nccl",)),
    ("copies and fills", ("Memcpy", "Memset", "memcpy", "memset")),
)


def kernel_kind(name: str) -> str:
    """The family of a GPU kernel by its name (`KERNEL_KINDS`), or "other"."""
    return next((kind for kind, parts in KERNEL_KINDS if any(p in name for p in parts)), "other")


def graph_steps(window: torch.Tensor, micro_batch: int, unit_block: int = 0) -> tuple[float, float]:
    """Of a rollout with per-sample windows (`window`: [B, W] step indices), how many steps a micro-batch runs with
    at least one row inside its window, on average over the micro-batches: with the exact rollout, each such step
    is a forward through the training graph, the others a no-grad (merged) one. Returns (the rollout's grouping:
    rows sorted by window start, rollout.engine.forward_units; consecutive rows, for comparison)."""
    from fgrpo.recompute import micro_batches
    from fgrpo.rollout.engine import forward_units

    grouped = forward_units(window, micro_batch, unit_block)
    consecutive = [torch.arange(r.start, r.stop) for r in micro_batches(window.shape[0], micro_batch)]

    def mean_steps(units: list[torch.Tensor]) -> float:
        return sum(len(set(window[unit].flatten().tolist())) for unit in units) / len(units)

    return mean_steps(grouped), mean_steps(consecutive)


# Idle gaps of the GPU by length, in microseconds: below the first edge the next kernel was already queued behind a
# launch (the host paces small kernels); up to the second the host was busy between launches; above it the host
# waited or worked (a synchronisation, Python between micro-batches, a thread holding the interpreter).
GAP_EDGES_US = (20.0, 1000.0)
GAP_NAMES = ("< 20 us", "20 us - 1 ms", ">= 1 ms")


def gaps(intervals: list[tuple[float, float]]) -> Iterator[tuple[float, float]]:
    """The GPU's idle gaps (start, end) between kernel `intervals` (overlaps merged), in order; none before the
    first kernel or after the last."""
    reach = None
    for a, b in sorted(intervals):
        if reach is not None and a > reach:
            yield reach, a
        reach = b if reach is None else max(reach, b)


def idle_gaps(
    intervals: list[tuple[float, float]], start: float, end: float
) -> tuple[list[list[float]], float]:
    """The GPU's idle time in [start, end) (microseconds) between kernel `intervals` inside it (overlaps merged), by
    gap length (`GAP_EDGES_US`): [count, seconds] per bucket, and the longest gap in seconds."""
    buckets = [[0.0, 0.0] for _ in range(len(GAP_EDGES_US) + 1)]
    longest = 0.0
    for a, b in gaps([(start, start), *intervals, (end, end)]):  # the two ends count too
        k = sum(b - a >= edge for edge in GAP_EDGES_US)
        buckets[k][0] += 1
        buckets[k][1] += (b - a) / 1e6
        longest = max(longest, (b - a) / 1e6)
    return buckets, longest


# Profiler-internal events that torch's own event list leaves out too (torch.autograd.profiler_util's filter).
PROFILER_INTERNAL = (
    "[memory]",
    "[OutOfMemory]",
    "profiler::_record_function_enter",
    "profiler::_record_function_enter_new",
    "profiler::_record_function_exit",
    "aten::is_leaf",
    "aten::output_nr",
    "aten::_version",
)


def trace_events(prof) -> list:
    """A stopped profiler's events as light records with the attributes of torch's FunctionEvent that
    `kernel_profile` reads (name, device_type, is_user_annotation, thread, device_resource_id, time_range in
    microseconds from the trace's start), read from its Kineto results. `prof.events()` gives the same events but
    first links them into torch's tree of FunctionEvents in Python, several times slower (RESULTS `profile-read`);
    a real-size step traced with its host holds millions."""
    from types import SimpleNamespace

    from torch.autograd.profiler_util import Interval

    results = prof.profiler.kineto_results
    t0 = results.trace_start_ns()
    names: dict[str, str] = {}  # demangled as torch's event list does, each distinct name once
    out = []
    for e in results.events():
        name = e.name()
        if name in PROFILER_INTERNAL or e.is_hidden_event():
            continue
        if name not in names:
            names[name] = torch._C._demangle(name) if len(name) > 1 else name
        out.append(
            SimpleNamespace(
                name=names[name],
                device_type=e.device_type(),
                is_user_annotation=e.is_user_annotation(),
                thread=e.start_thread_id(),
                device_resource_id=e.device_resource_id(),  # a kernel's CUDA stream, an op's thread
                time_range=Interval((e.start_ns() - t0) / 1000, (e.end_ns() - t0) / 1000),
            )
        )
    return out


def gpu_kernels(events) -> list:
    """The GPU kernels among a trace's events. A range of record_function also shows on the GPU's track (a
    "gpu_user_annotation" spanning its kernels): it is no kernel."""
    return [e for e in events if e.device_type == torch.profiler.DeviceType.CUDA and not e.is_user_annotation]


def longest_gaps(intervals: list[tuple[float, float]], n: int, at_least: float) -> list[tuple[float, float]]:
    """The `n` longest `gaps` of at least `at_least` between kernel `intervals`, longest first."""
    return sorted((g for g in gaps(intervals) if g[1] - g[0] >= at_least), key=lambda g: g[0] - g[1])[:n]


def kernel_profile(events, wall_s: float, top: int = 8) -> list[str]:
    """Lines on a profiled step's GPU kernels (`events`: the profiler's events): how many, the share of the step's
    wall time the GPU was busy (the rest it waited for the host), the same within each of the step's phases (the
    PhaseTimer's `phase:<name>` ranges, in the order they began; a phase entered twice adds up), the device time of
    each kernel family (`kernel_kind`; families can overlap across streams, so their sum can pass the busy time),
    and the kernels that took the most device time. Each phase's idle time is split by gap length (`idle_gaps`):
    many short gaps mean kernels too small for their launches, a few long ones the host's own waits; for the 5
    longest gaps of 1 ms or more, what the host was running then (with the host's events in the trace)."""
    cpu = torch.profiler.DeviceType.CPU
    kernels = gpu_kernels(events)
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    busy = busy_seconds(intervals)
    lines = [
        f"# profiled step: {len(kernels)} kernels, GPU busy {busy:.2f} of {wall_s:.2f} s ({busy / wall_s:.1%})"
    ]
    from fgrpo.logging import PhaseTimer

    prefix = PhaseTimer.RANGE_PREFIX
    phases: dict[str, list] = {}  # name -> [wall s, busy s, gap buckets, longest gap s]
    ranges = []  # (name, start, end) of each phase entered
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.device_type == cpu and e.name.startswith(prefix):
            name, start, end = e.name.removeprefix(prefix), e.time_range.start, e.time_range.end
            ranges.append((name, start, end))
            inside = [(max(a, start), min(b, end)) for a, b in intervals if a < end and b > start]
            buckets, longest = idle_gaps(inside, start, end)
            p = phases.setdefault(name, [0.0, 0.0, [[0.0, 0.0] for _ in buckets], 0.0])
            p[0] += (end - start) / 1e6
            p[1] += busy_seconds(inside)
            p[2] = [[n + m, t + u] for (n, t), (m, u) in zip(p[2], buckets)]
            p[3] = max(p[3], longest)
    for name, (phase_s, phase_busy, buckets, longest) in phases.items():
        share = phase_busy / phase_s if phase_s > 0 else float("nan")
        lines.append(f"# phase {name}: GPU busy {phase_busy:.2f} of {phase_s:.2f} s ({share:.1%})")
        idle = ", ".join(f"{t:.2f} s in {n:.0f} gaps {g}" for g, (n, t) in zip(GAP_NAMES, buckets))
        lines.append(f"#   idle: {idle}; the longest {longest * 1e3:.1f} ms")
    lines += stream_lines(kernels, ranges)
    host = [e for e in events if e.device_type == cpu and not e.is_user_annotation]
    for a, b in longest_gaps(intervals, 5, GAP_EDGES_US[-1]):
        mid = (a + b) / 2
        phase = next((f"{n} +{(mid - s0) / 1e6:.2f} s" for n, s0, s1 in ranges if s0 <= mid < s1), "no phase")
        # each thread's innermost op running then (the rollout's thread, the streamed reward's, ...)
        inner: dict[int, Any] = {}
        for e in host:
            if e.time_range.start <= mid < e.time_range.end:
                if (
                    e.thread not in inner
                    or e.time_range.elapsed_us() < inner[e.thread].time_range.elapsed_us()
                ):
                    inner[e.thread] = e
        doing = "; ".join(f"thread {t} in {e.name[:50]}" for t, e in sorted(inner.items())) or "no host op"
        lines.append(f"#   gap of {(b - a) / 1e3:.1f} ms ({phase}): {doing}")
    totals: dict[str, list[float]] = {}
    kinds: dict[str, float] = {}
    for e in kernels:
        t = totals.setdefault(e.name, [0.0, 0])
        t[0] += e.time_range.elapsed_us()
        t[1] += 1
        kind = kernel_kind(e.name)
        kinds[kind] = kinds.get(kind, 0.0) + e.time_range.elapsed_us() / 1e6
    for kind, s in sorted(kinds.items(), key=lambda kv: -kv[1]):
        lines.append(f"# {kind}: {s:.2f}s ({s / busy:.1%} of the busy time)")
    for name, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"#   {name[:80]}: {us / 1e6:.2f}s x{count:.0f}")
    return lines


def stream_lines(kernels, ranges: list[tuple[str, float, float]]) -> list[str]:
    """With kernels on more than one CUDA stream (the streamed reward reads on a stream of its own): each stream's
    busy time (the union of its kernels), its kernels, its busy time within each phase `ranges` (name, start, end
    in microseconds; a phase entered twice adds up), and the time two or more streams ran at once."""
    by_stream: dict[int, list[tuple[float, float]]] = {}
    for e in kernels:
        by_stream.setdefault(e.device_resource_id, []).append((e.time_range.start, e.time_range.end))
    if len(by_stream) < 2:
        return []
    busy = {stream: busy_seconds(intervals) for stream, intervals in by_stream.items()}
    lines = []
    for stream, intervals in sorted(by_stream.items(), key=lambda kv: -busy[kv[0]]):
        in_phase: dict[str, float] = {}
        for name, start, end in ranges:
            inside = [(max(a, start), min(b, end)) for a, b in intervals if a < end and b > start]
            in_phase[name] = in_phase.get(name, 0.0) + busy_seconds(inside)
        where = ", ".join(f"{n} {s:.2f} s" for n, s in in_phase.items())
        lines.append(
            f"# stream {stream}: busy {busy[stream]:.2f} s in {len(intervals)} kernels"
            + (f" ({where})" if where else "")
        )
    both = sum(busy.values()) - busy_seconds([i for v in by_stream.values() for i in v])
    lines.append(f"#   streams at once: {both:.2f} s")
    return lines


def vlm_reward(
    device: torch.device,
    *,
    tiny: bool,
    images_per_call: int,
    video: bool,
    static_cache: bool = False,
    image_backend: str = "pil",
    varlen_vision: bool = False,
):
    """The OCR reward read by a random Qwen2.5-VL on `device`: the 3B's widths in bf16, or the tiny one in fp32 on
    the CPU; greedy, every image of a call in one generate batch (a clip: its read frames). Not sharded; with
    `static_cache` a preallocated KV cache, whose decoding step transformers compiles on a GPU."""
    from vlm_model import build_random_vlm  # benchmarks/vlm_model.py

    from fgrpo.rewards.ocr import OcrReward
    from fgrpo.rewards.video import VideoOcrReward
    from fgrpo.rewards.vlm import TransformersOcrEngine

    model, processor = build_random_vlm(
        "tiny" if tiny else "3b", device, dtype=torch.float32 if tiny else torch.bfloat16
    )
    engine = TransformersOcrEngine(
        model,
        processor,
        batch_size=images_per_call,
        max_tokens=VLM_MAX_TOKENS,
        static_cache=static_cache,
        image_backend=image_backend,
        varlen_vision=varlen_vision,
    )
    if not video:
        return OcrReward(engine)
    reward = VideoOcrReward(engine)
    engine.batch_size *= reward.frames  # a clip is read as its sampled frames, all in the one call
    return reward


def start_vlm_server(args, d):
    """--reward vlm-served: the random Qwen2.5-VL (the 3B's widths in bf16, or the tiny one) written to
    --vlm-dir if absent, and `vllm serve` of it started and waited for (benchmarks/vlm_model.py's VllmServer)."""
    from vlm_model import VllmServer, write_random_vlm  # benchmarks/vlm_model.py

    if d.world_size > 1:
        raise SystemExit("--reward vlm-served starts one server for one process: run without torchrun")
    root = Path(args.vlm_dir or tempfile.mkdtemp(prefix="fgrpo-vlm-"))
    path = root / ("qwen2_5_vl_tiny" if args.tiny else "qwen2_5_vl_3b")
    if not (path / "config.json").exists():
        write_random_vlm(path, "tiny" if args.tiny else "3b", dtype=torch.bfloat16, seed=0)
    server = VllmServer(path, root / "vllm_serve.log", gpu_fraction=args.vlm_gpu_fraction)
    print(f"# vllm serve {path}: answering after {server.wait():.0f} s (console: {server.log})", flush=True)
    return server


def served_reward(server, *, images_per_call: int):
    """The OCR reward read through fgrpo's OpenAI client from `server`, every image of a call in flight at once,
    greedy, at most VLM_MAX_TOKENS new tokens (as the in-process VLM)."""
    from fgrpo.rewards import build_reward

    spec = {"name": "ocr", "engine": "vlm", "base_url": server.url, "model": str(server.path)}
    return build_reward({**spec, "max_tokens": VLM_MAX_TOKENS, "max_concurrency": images_per_call})


def kill_mid_step(trainer, server, after_s: float, step: int, print0) -> None:
    """One more experience step with the VLM server killed `after_s` seconds into it: how the step ends (the
    client's error, or its scores if they were read before the kill) and how long after the kill."""
    from fgrpo.logging import PhaseTimer

    killer = threading.Timer(after_s, server.kill)
    t0 = time.perf_counter()
    killer.start()
    try:
        trainer.experience(step, PhaseTimer())
        outcome = "finished: its images were read before the kill"
    except Exception as e:  # what the trainer would stop with
        outcome = f"raised {type(e).__name__}: {str(e).splitlines()[0][:240]}"
    end = time.perf_counter() - t0
    killer.join()
    print0(
        f"# the VLM server killed {after_s:.1f} s into step {step}: the step {outcome}; it ended {end:.1f} s "
        f"after it began ({end - after_s:+.1f} s from the kill)"
    )


def gather_scores(out, prompts: list[str], device: torch.device) -> torch.Tensor:
    """This rank's RewardOutput for `prompts`, checked, gathered over the ranks in rank order: [n] float32 on
    `device` (the collectives' device), as the trainer gathers them."""
    from fgrpo import parallel
    from fgrpo.rewards.base import check_scores

    check_scores(out, prompts, "ocr")
    return parallel.all_gather_cat(torch.as_tensor(out.scores, dtype=torch.float32, device=device))


def on_side_stream(reward, device: torch.device):
    """`reward` called on a CUDA stream of its own, so that a background thread's kernels run beside the rollout's
    instead of queueing behind them (the images arrive on the CPU; the scores leave as Python floats)."""
    import contextlib

    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def score(images, prompts, metadata=None):
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            return reward(images, prompts, metadata)

    return score


def save_or_compare_update(names, params, optimizer, save: str, compare: str, is_main: bool) -> None:
    """Gather the trained weights and AdamW's first moment after one step; save them or compare with a file.

    AdamW's first step moves every weight by about lr x sign(gradient), which turns rounding noise in a
    near-zero gradient into a full-size difference; the first moment (1 - beta1) x gradient is linear in the
    gradient, so it is the quantity to compare across world sizes.
    """
    from safetensors.torch import load_file, save_file

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu()

    tensors = {}
    for name, p in zip(names, params):
        tensors[f"param/{name}"] = full(p)
        state = optimizer.state.get(
            p, {}
        )  # no state: the parameter got no gradient (or the step was skipped)
        tensors[f"m/{name}"] = full(state["exp_avg"]) if "exp_avg" in state else torch.zeros(p.shape)
    if not is_main:
        return
    if save:
        save_file(tensors, save)
        print(f"# saved {len(tensors)} tensors to {save}", flush=True)
    if compare:
        compare_updates(tensors, load_file(compare))


def compare_updates(got, ref) -> None:
    """Print how far one run's step is from another's: first moments (gradients) and weights (fp64 sums)."""
    for kind in ("m", "param"):
        keys = [k for k in ref if k.startswith(kind + "/")]
        a = torch.cat([got[k].flatten() for k in keys]).double()
        b = torch.cat([ref[k].flatten() for k in keys]).double()
        rel = ((a - b).norm() / b.norm()).item()
        line = (
            f"# {'first moment (gradient)' if kind == 'm' else 'weights after the step'}: relative L2 "
            f"difference {rel:.2e}, max |diff| {(a - b).abs().max().item():.2e}, max |ref| {b.abs().max().item():.2e}"
        )
        if kind == "m":
            nz = b != 0
            cos = (a @ b / (a.norm() * b.norm())).item()
            line += (
                f", sign agreement on nonzero entries {(a[nz].sign() == b[nz].sign()).double().mean().item():.4%}, "
                f"cosine {cos:.6f}"
            )
        print(line, flush=True)


def compare_files(a: str, b: str) -> None:
    from safetensors.torch import load_file

    print(f"# {a} vs {b}", flush=True)
    compare_updates(load_file(a), load_file(b))


def comm_probe(transformer, passes: int = 3) -> float:
    """Seconds per full-model FSDP2 all-gather (every block unsharded then resharded, synchronously)."""
    blocks = list(transformer.transformer_blocks)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(passes):
        for block in blocks:
            block.unshard()
            block.reshard()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / passes


if __name__ == "__main__":
    main()
