"""GPU check of the vLLM-Omni rollout engine against the in-process engine and the trainer: one table.

--model picks the family (default qwen_image; every section runs for it). For qwen_image_edit, sd3, flux2, flux2_dev
and wan only `parity` runs, on a tiny random directory in diffusers' layout (tokenizers of the classes vLLM-Omni's
loader instantiates: CLIP and T5 for SD3.5; Qwen2TokenizerFast for FLUX.2 [klein], the Pixtral processor for [dev];
Wan's with --wan-experts 1 (TI2V-5B-like) or 2 (T2V-A14B-like); Qwen-Image-Edit's with the released `processor`
folder, read as a Qwen2VLProcessor, and its prompts naming condition images written as PNG files under --out).
For zimage `parity` runs on --model-dir, a released Z-Image directory (Tongyi-MAI/Z-Image or -Turbo), or without
it on a random one written under --out with the released transformer (~12 GB): vLLM-Omni builds its Z-Image
transformer at the released size whatever the directory's config says, so a tiny one does not load. For bagel, `parity` is issue #44's: a
tiny random BAGEL directory in BAGEL's released layout (ema.safetensors, ae.safetensors, llm/vit/config JSONs, the
tokenizer; plus vae/, the diffusers VAE fgrpo's loader reads), sampled by vLLM-Omni's own BagelPipeline
(single-stage deploy, NOT fgrpo's custom pipeline) and by fgrpo's in-process transition from vLLM-Omni's initial
noise; same prompt, seed and noise, eta 0; the max abs/rel difference of the latents after every step.

Sections (each prints its rows and never stops the others):
  parity      a tiny random directory of the family saved by fgrpo's tiny builders; the same prompts and seeds
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
  python3 benchmarks/vllm_omni_check.py --model sd3            # parity of each added family
  python3 benchmarks/vllm_omni_check.py --model qwen_image_edit  # each prompt with its condition image file
  python3 benchmarks/vllm_omni_check.py --model flux2          # FLUX.2 [klein]; --model flux2_dev for [dev]
  python3 benchmarks/vllm_omni_check.py --model zimage [--model-dir /path/to/Z-Image-Turbo]
  python3 benchmarks/vllm_omni_check.py --model wan --wan-experts 2
  python3 benchmarks/vllm_omni_check.py --model bagel          # issue #44: vLLM-Omni's BAGEL vs fgrpo's
CPU (no vllm): `python benchmarks/vllm_omni_check.py --cpu-selftest` checks the helpers on the tiny model and the
family directory writers, the Edit condition images too (what runs without vLLM-Omni; tests/test_vllm_omni_check.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from fgrpo.config import SamplingConfig
from fgrpo.models import tiny
from fgrpo.models.bagel import Bagel, patchify, unpatchify
from fgrpo.models.bagel_mot import BagelTransformer, sincos_2d
from fgrpo.models.base import FlowModel, ImagePrompt
from fgrpo.models.flux2 import DEV_TEXT_LAYERS, TEXT_LAYERS, Flux2
from fgrpo.models.loading import configure_transformer
from fgrpo.models.qwen_image import QwenImage
from fgrpo.models.qwen_image_edit import QwenImageEdit
from fgrpo.models.sd3 import SD3
from fgrpo.models.wan import Wan
from fgrpo.models.zimage import ZImage
from fgrpo.policy import transition
from fgrpo.recompute import recompute_log_probs
from fgrpo.rollout.base import Trajectory
from fgrpo.rollout.engine import DiffusersEngine
from fgrpo.rollout.seeds import sample_seed
from fgrpo.rollout.vllm_omni_pipeline import (
    ADAPTERS,
    IMAGE_KEY,
    as_flow_model,
    edit_flow_model,
    flux2_settings,
    request_prompt,
)

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
# Tiny random directories of the added families, in the layouts vLLM-Omni's loaders read (CPU-testable but the
# parts of BAGEL only vLLM-Omni instantiates)
# ------------------------------------------------------------------------------------------------
# The model keywords both sides build the family with (the tiny builders' text lengths and clip length).
FAMILY_KWARGS: dict[str, dict[str, Any]] = {
    "sd3": {"max_sequence_length": tiny.T5_MAX_LENGTH_TINY},
    # the tiny Qwen3 / Mistral's every layer stacked (the released models' are (9, 18, 27) / (10, 20, 30))
    "flux2": {
        "max_sequence_length": tiny.FLUX2_TEXT_LENGTH_TINY,
        "text_layers": list(tiny.FLUX2_TEXT_LAYERS_TINY),
    },
    "flux2_dev": {
        "max_sequence_length": tiny.FLUX2_DEV_TEXT_LENGTH_TINY,
        "text_layers": list(tiny.FLUX2_TEXT_LAYERS_TINY),
    },
    "wan": {"num_frames": tiny.TINY_WAN_FRAMES, "max_sequence_length": tiny.TINY_WAN_TEXT_LENGTH},
    # the tiny Edit model's condition area (64²; the released model's 1024² would be 4096 tokens an image)
    "qwen_image_edit": {"condition_area": tiny.TINY_CONDITION_AREA},
}


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins of the 256 bytes (the alphabet of CLIP's byte-level BPE)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in keep]
    return [chr(c) for c in keep] + [chr(256 + i) for i in range(len(rest))]


def clip_t5_tokenizers() -> tuple[Any, Any]:
    """A CLIP tokenizer (bytes only, no merges) and a T5 unigram one (letters), of the classes vLLM-Omni's SD3
    loader instantiates (CLIPTokenizer, T5Tokenizer; fgrpo's tiny tokenizers are not of those classes)."""
    from transformers import CLIPTokenizer, T5Tokenizer

    chars = _byte_chars()
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": 256 + i for i, c in enumerate(chars)}
    vocab |= {"<|startoftext|>": 512, "<|endoftext|>": 513}
    clip = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -1.0) for c in letters] + [("\u2581" + c, -1.5) for c in letters]
    t5 = T5Tokenizer(vocab=pieces, extra_ids=0)
    return clip, t5


def save_tiny_sd3_dir(path: Path) -> Path:
    """fgrpo's tiny SD3.5 (seed 0) with CLIP/T5-class tokenizers (the CLIP encoders' vocabularies resized to
    theirs), saved by diffusers' StableDiffusion3Pipeline."""
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import StableDiffusion3Pipeline

    c = tiny.tiny_sd3_components(0)
    clip, t5 = clip_t5_tokenizers()
    for name in ("text_encoder", "text_encoder_2"):
        enc = c[name]
        enc.resize_token_embeddings(len(clip))
        enc.config.bos_token_id, enc.config.eos_token_id = clip.bos_token_id, clip.eos_token_id
        enc.config.pad_token_id = clip.pad_token_id
    if len(t5) > c["text_encoder_3"].config.vocab_size:
        raise ValueError("the T5 tokenizer outgrew the tiny T5's vocabulary")
    c |= {"tokenizer": clip, "tokenizer_2": clip, "tokenizer_3": t5}
    StableDiffusion3Pipeline(**c).save_pretrained(str(path))
    return path


def save_tiny_wan_dir(path: Path, experts: int) -> Path:
    """fgrpo's tiny Wan 2.2 (seed 0), saved by diffusers' WanPipeline with the released repos' scheduler config
    (UniPC, flow_shift), which fgrpo's loader and vLLM-Omni both read."""
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline
    from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler

    c = tiny.tiny_wan_components(0, experts=experts)
    scheduler: Any = UniPCMultistepScheduler(  # the released repos' (WanPipeline annotates FlowMatch's)
        flow_shift=tiny.TINY_WAN_FLOW_SHIFT, prediction_type="flow_prediction", use_flow_sigmas=True
    )
    WanPipeline(
        tokenizer=c["tokenizer"], text_encoder=c["text_encoder"], vae=c["vae"], scheduler=scheduler,
        transformer=c["transformer"], transformer_2=c["transformer_2"], boundary_ratio=c["boundary_ratio"],
        expand_timesteps=c["expand_timesteps"],
    ).save_pretrained(str(path))  # fmt: skip
    return path


def save_tiny_flux2_dir(path: Path, kind: str) -> Path:
    """fgrpo's tiny FLUX.2 (seed 0), saved by diffusers' Flux2KleinPipeline (kind flux2; a base model, not
    step-distilled) or Flux2Pipeline (flux2_dev): the model_index.json both fgrpo's loader and the adapter read."""
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    # text encoders as deep as the released layers read (vLLM-Omni's start-up request carries no fgrpo keywords,
    # so its model reads the released layers); fgrpo's requests read the tiny ones (FAMILY_KWARGS)
    if kind == "flux2_dev":
        parts = tiny.tiny_flux2_dev_components(0, text_depth=max(DEV_TEXT_LAYERS))
        Flux2Pipeline(**parts).save_pretrained(str(path))
    else:
        parts = tiny.tiny_flux2_components(0, text_depth=max(TEXT_LAYERS))
        Flux2KleinPipeline(**parts, is_distilled=False).save_pretrained(str(path))
    return path


# The subfolders of a Qwen-Image-Edit directory that vLLM-Omni 0.30's QwenImageEditPipeline reads (`processor` as a
# Qwen2VLProcessor; fgrpo's loader and adapter read its image processor), besides model_index.json.
EDIT_FOLDERS = ("scheduler", "text_encoder", "tokenizer", "processor", "transformer", "vae")
# The condition images' size (width, height): one for all, as the condition latents of a batch share one shape.
EDIT_IMAGE_SIZE = (96, 64)


def save_tiny_edit_dir(path: Path) -> Path:
    """fgrpo's tiny Qwen-Image-Edit (seed 0) in the released diffusers layout: the modules saved by diffusers'
    QwenImageEditPipeline (model_index.json naming it), and the `processor` folder as the released repos carry it,
    Qwen2-VL's image processor (at the tiny model's pixel bounds), its video processor and the tokenizer, one file
    set each. fgrpo's images-only processor has no video processor, without which transformers does not save a
    Qwen2VLProcessor, so the pipeline is saved without it and the folder written part by part."""
    import shutil

    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    c = tiny.tiny_qwen_image_edit_components(0)
    processor = c.pop("processor")
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    QwenImageEditPipeline(**c, processor=None).save_pretrained(str(tmp))  # pyright: ignore[reportArgumentType]
    processor.image_processor.save_pretrained(str(tmp / "processor"))
    Qwen2VLVideoProcessor().save_pretrained(str(tmp / "processor"))
    processor.tokenizer.save_pretrained(str(tmp / "processor"))
    index = json.loads((tmp / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]  # the released model_index.json's entry
    (tmp / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    tmp.rename(path)  # model_index.json in place marks a finished directory
    return path


def write_edit_prompts(root: Path, texts: Sequence[str] = PROMPTS, seed: int = 0) -> list[str]:
    """One condition image per prompt, a PNG file under `root` (the same pixels on every call): seeded-random colour
    blocks of 8 px with a yellow rectangle at a place of its own. Returns the prompts as ImagePrompts naming them."""
    from PIL import Image, ImageDraw

    root.mkdir(parents=True, exist_ok=True)
    w, h = EDIT_IMAGE_SIZE
    gen = torch.Generator().manual_seed(seed)
    out: list[str] = []
    for i, text in enumerate(texts):
        blocks = torch.randint(0, 256, (h // 8, w // 8, 3), generator=gen, dtype=torch.uint8)
        image = Image.fromarray(blocks.repeat_interleave(8, 0).repeat_interleave(8, 1).numpy())
        ImageDraw.Draw(image).rectangle((8 + 12 * i, 12, 40 + 12 * i, 44), fill=(230, 220, 40))
        file = root / f"condition_{i}.png"
        image.save(file)
        out.append(ImagePrompt(text, file))
    return out


# BAGEL at a width every attention backend takes (head_dim 64), FLUX's 16 latent channels (vLLM-Omni's BAGEL builds
# FLUX's autoencoder, 16 channels, whatever the checkpoint), a 32 x 32 grid of latent patches: 512 px images at most
# (8 x the VAE, 2 x the patch), the size of the warm-up request vLLM-Omni's engine sends when it starts.
BAGEL_TINY: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    latent_channels=16, max_latent_size=32,
)  # fmt: skip
BAGEL_VIT: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
    image_size=980, vision_use_head=False,
)  # fmt: skip
_LAYER = re.compile(r"layers\.(\d+)\.(und|gen)\.([a-z_]+)(\..+)$")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def released_bagel_name(name: str) -> str:
    """BagelTransformer's parameter name -> BAGEL's released checkpoint key (models.bagel_mot.bagel_key's inverse:
    the understanding expert unsuffixed, the generation expert `_moe_gen`, attention parts under self_attn)."""
    if m := _LAYER.match(name):
        layer, expert, part, rest = m.groups()
        where = "self_attn." if part in _ATTENTION else ""
        return (
            f"language_model.model.layers.{layer}.{where}{part}{'_moe_gen' if expert == 'gen' else ''}{rest}"
        )
    fixed = {"embed_tokens.weight": "language_model.model.embed_tokens.weight"}
    fixed["norm_gen.weight"] = "language_model.model.norm_moe_gen.weight"
    return fixed.get(name, name)  # time_embedder.*, vae2llm.*, llm2vae.* keep their names


def released_vit_state(vit: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A SigLIP vision model's tensors under BAGEL's released names, `vit_model.vision_model.<name>`, which
    vLLM-Omni's BagelPipeline loads: transformers 5 names them without the `vision_model.` level (4.x with it)."""
    return {
        f"vit_model.vision_model.{k.removeprefix('vision_model.')}": v.contiguous()
        for k, v in vit.state_dict().items()
    }


def save_tiny_bagel_dir(path: Path, *, vllm_omni_parts: bool, seed: int = 0) -> Path:
    """A random BAGEL in BAGEL's released layout, which both loaders read: fgrpo's (llm_config.json,
    ema.safetensors, the tokenizer, a diffusers VAE in vae/) and vLLM-Omni's (config.json, vit_config.json,
    preprocessor_config.json, every tensor its BagelPipeline holds: the ViT, connector, LM head and ae.safetensors,
    FLUX's autoencoder). vllm_omni_parts=False leaves out the parts only vLLM-Omni's classes can build (the CPU
    self-test); text-to-image reads neither the ViT nor the autoencoder, so the latents do not depend on them."""
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from safetensors.torch import save_file
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    from fgrpo.models.qwen_image_edit import EDIT_PROMPT_DROP, EDIT_PROMPT_TEMPLATE

    tokenizer = tiny.tiny_qwen_tokenizer(
        EDIT_PROMPT_TEMPLATE, EDIT_PROMPT_DROP
    )  # has BAGEL's chat/vision markers
    dims = dict(BAGEL_TINY)
    hidden, vocab = dims["hidden_size"], len(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = BagelTransformer(vocab_size=vocab, **dims)
        for n, p in transformer.named_parameters():
            if "norm" in n:  # RMSNorm weights start at 1; random ones make each norm count
                p.data.uniform_(0.5, 1.5)
        state = {released_bagel_name(k): v.contiguous() for k, v in transformer.state_dict().items()}
        state["latent_pos_embed.pos_embed"] = sincos_2d(hidden, dims["max_latent_size"])  # fgrpo rebuilds it
        state["language_model.model.norm.weight"] = torch.rand(hidden) + 0.5  # the understanding expert's
        state["language_model.lm_head.weight"] = torch.randn(vocab, hidden) * 0.02
        vit_config = SiglipVisionConfig(**BAGEL_VIT)
        if vllm_omni_parts:
            state |= released_vit_state(SiglipVisionModel(vit_config))
            side = BAGEL_VIT["image_size"] // BAGEL_VIT["patch_size"]
            state |= {
                "connector.fc1.weight": torch.randn(hidden, BAGEL_VIT["hidden_size"]) * 0.02,
                "connector.fc1.bias": torch.zeros(hidden),
                "connector.fc2.weight": torch.randn(hidden, hidden) * 0.02,
                "connector.fc2.bias": torch.zeros(hidden),
                "vit_pos_embed.pos_embed": sincos_2d(hidden, side),
            }
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,  # pyright: ignore[reportArgumentType]
            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16),  # pyright: ignore[reportArgumentType]
            layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=64, scaling_factor=0.3611,
            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
        )  # fmt: skip
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "ema.safetensors"))
    vae.save_pretrained(str(tmp / "vae"))
    tokenizer.save_pretrained(str(tmp))
    llm = dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=dims["intermediate_size"], num_hidden_layers=dims["num_hidden_layers"],
        num_attention_heads=dims["num_attention_heads"], num_key_value_heads=dims["num_key_value_heads"],
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, hidden_act="silu",
        tie_word_embeddings=False, layer_module="Qwen2MoTDecoderLayer", qk_norm=True, torch_dtype="bfloat16",
    )  # fmt: skip
    (tmp / "llm_config.json").write_text(json.dumps(llm, indent=1))
    vit_config.to_json_file(str(tmp / "vit_config.json"))
    SiglipImageProcessor().save_pretrained(str(tmp))
    top = dict(
        model_type="bagel", architectures=["BagelForConditionalGeneration"],
        vae_config={"z_channels": dims["latent_channels"], "downsample": 8},
        vit_config={"patch_size": BAGEL_VIT["patch_size"], "hidden_size": BAGEL_VIT["hidden_size"]},
        latent_patch_size=2, max_latent_size=dims["max_latent_size"], vit_max_num_patch_per_side=70,
        connector_act="gelu_pytorch_tanh", interpolate_pos=False, timestep_shift=1.0,
    )  # fmt: skip
    if vllm_omni_parts:  # vLLM-Omni's own FLUX autoencoder, random, under BAGEL's ae.safetensors names
        from vllm_omni.diffusion.models.bagel.autoencoder import AutoEncoder  # pyright: ignore[reportMissingImports]
        from vllm_omni.diffusion.models.bagel.pipeline_bagel import default_ae_params  # pyright: ignore[reportMissingImports]

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            ae = AutoEncoder(default_ae_params())
        save_file({k: v.contiguous() for k, v in ae.state_dict().items()}, str(tmp / "ae.safetensors"))
    (tmp / "config.json").write_text(
        json.dumps(top, indent=1)
    )  # last: its presence marks a finished directory
    tmp.rename(path)
    return path


def bagel_inprocess_latents(
    model: FlowModel, prompt: str, x1: torch.Tensor, num_steps: int, guidance: float, height: int, width: int
) -> list[torch.Tensor]:
    """fgrpo's ODE (eta 0) from a given x_1 [C, h, w]: the in-process engine's deterministic step
    (policy.transition, stochastic=False, as DiffusersEngine runs it outside the SDE window) on the model's
    schedule. Returns the latents before the first step and after each, [C, h, w] fp32 on the CPU."""
    cfg = SamplingConfig(
        height=height, width=width, num_steps=num_steps, guidance_scale=guidance,
        negative_prompt="" if guidance > 1.0 else None, window_size=0, window_range=(0, 0), micro_batch=1,
    )  # fmt: skip
    device = next(model.transformer.parameters()).device
    cond = model.encode([prompt], negative_prompt=cfg.negative_prompt if guidance > 1.0 else None)
    sigmas = model.sigmas(num_steps, height, width).to(device)
    x = x1[None].to(device).float()
    out = [x[0].cpu()]
    with torch.no_grad():
        for i in range(num_steps):
            x, _ = transition(
                model, x, sigmas[i].expand(1), sigmas[i + 1].expand(1), cond, cfg, stochastic=False
            )
            out.append(x[0].float().cpu())
    return out


def latent_gaps(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    """Per trajectory point: max |got - want| and that over max |want| (the relative gap)."""
    rows = []
    for i, (g, w) in enumerate(zip(got, want)):
        d = (g.float() - w.float()).abs().max().item()
        rows.append({"point": i, "max_abs": d, "max_rel": d / max(w.float().abs().max().item(), 1e-12)})
    return rows


# ------------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------------
class Ctx:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = torch.device("cuda")
        suffix = f"_{args.wan_experts}" if args.model == "wan" else ""
        self.tiny_dir = self.out / f"tiny_{args.model}{suffix}"
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
    model, path = ctx.args.model, ctx.tiny_dir
    if model == "zimage":  # released-size (the module docstring says why not a tiny one)
        if ctx.args.model_dir:
            return Path(ctx.args.model_dir)
        return save_real_size_zimage_dir(path, ctx.device)
    done = path / ("config.json" if model == "bagel" else "model_index.json")
    if not done.exists():
        if model == "qwen_image":
            tiny.save_tiny_qwen_image(path, seed=0)
        elif model == "sd3":
            save_tiny_sd3_dir(path)
        elif model == "wan":
            save_tiny_wan_dir(path, ctx.args.wan_experts)
        elif model in ("flux2", "flux2_dev"):
            save_tiny_flux2_dir(path, model)
        elif model == "qwen_image_edit":
            save_tiny_edit_dir(path)
        else:
            save_tiny_bagel_dir(path, vllm_omni_parts=True)
    return path


def in_process(path: Path, device: torch.device, model: str = "qwen_image") -> FlowModel:
    """fgrpo's model of the family from the directory, bf16, with the tiny builders' text lengths and clip."""
    kwargs: dict[str, Any] = dict(dtype=torch.bfloat16, device=device, **FAMILY_KWARGS.get(model, {}))
    if model == "bagel":
        return as_flow_model(Bagel.from_pretrained(path, **kwargs))
    cls = {
        "qwen_image": QwenImage,
        "qwen_image_edit": QwenImageEdit,
        "sd3": SD3,
        "wan": Wan,
        "zimage": ZImage,
        "flux2": Flux2,
        "flux2_dev": Flux2,
    }[model]
    return as_flow_model(cls.from_pretrained(path, **kwargs))


def vllm_engine(path: Path, ctx: Ctx, max_batch: int = len(PROMPTS), **kw: Any):
    from fgrpo.rollout.vllm_omni import VllmOmniEngine

    omni_kwargs = {}
    if ctx.args.attention_backend:
        omni_kwargs["diffusion_attention_backend"] = ctx.args.attention_backend
    return VllmOmniEngine(
        str(path),
        kind=ctx.args.model,
        model_kwargs=FAMILY_KWARGS.get(ctx.args.model, {}),
        max_batch=max_batch,
        work_dir=ctx.out / "engine_work",
        omni_kwargs=omni_kwargs,
        **kw,
    )


def section_parity(ctx: Ctx) -> None:
    if ctx.args.model == "bagel":
        section_bagel_parity(ctx)
        return
    path = ensure_tiny_dir(ctx)
    # the Edit family's prompts name their condition image files (each request carries its file's path)
    edit = ctx.args.model == "qwen_image_edit"
    prompts = write_edit_prompts(ctx.out / "edit_images") if edit else PROMPTS
    engine = vllm_engine(path, ctx)
    model = in_process(path, ctx.device, ctx.args.model)
    try:
        seeds = seeds_for(len(PROMPTS))
        cfg = tiny_cfg(ctx.args)
        got = engine.generate(prompts, seeds, cfg)
        want = DiffusersEngine(model).generate(prompts, seeds, cfg)
        recomputed = recompute_log_probs(model, got.to(ctx.device), cfg)
        rows = step_gaps(got, want, recomputed)
        print(
            f"\n## parity of {ctx.args.model}, noise_level {cfg.noise_level}, {cfg.sde_kind}, every step stochastic "
            "(tiny, bf16)"
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
        # the text encoders' outputs (vllm-omni loads its own copy); Edit: and the condition images' latents
        for k, v in want.cond.items():
            L = v.shape[1]
            d = (got.cond[k][:, :L].float() - v.cpu().float()).abs().max().item()
            ctx.note("parity", f"cond {k} max |engine - in-process|", f"{d:.3e}")
        torch.save({"engine": got, "in_process": want, "recomputed": recomputed}, ctx.out / "parity.pt")

        ode = tiny_cfg(ctx.args, window_size=0, window_range=(0, 0))
        g0 = engine.generate(prompts, seeds, ode)
        w0 = DiffusersEngine(model).generate(prompts, seeds, ode)
        gap = image_gap(g0.images, w0.images)
        ctx.note(
            "parity",
            "ODE (noise 0) images |engine - in-process| uint8 mean/max",
            f"{gap['px_mean']:.3f}/{gap['px_max']:.0f}",
            ok=gap["px_mean"] < 2.0,
        )
        again = engine.generate(prompts, seeds, cfg)
        ctx.note(
            "parity", "engine deterministic (same seeds twice)", bool(torch.equal(again.x_next, got.x_next))
        )
    finally:
        engine.close()
        del model
        gc.collect()
        torch.cuda.empty_cache()


def section_bagel_parity(ctx: Ctx) -> None:
    """Issue #44: vLLM-Omni's own BAGEL pipeline (single-stage deploy; not fgrpo's custom pipeline) against fgrpo's
    in-process BAGEL on the same tiny random weights, prompt and seed, eta 0. vLLM-Omni draws the initial noise on
    its worker and returns it as the first trajectory latent; fgrpo starts from that noise, so the gap is the
    kernels' (bf16) and any difference of the two implementations."""
    import vllm_omni  # pyright: ignore[reportMissingImports]  # the optional vllm extra
    from vllm_omni.entrypoints.omni import Omni  # pyright: ignore[reportMissingImports]
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams  # pyright: ignore[reportMissingImports]

    args = ctx.args
    path = ensure_tiny_dir(ctx)
    deploy = Path(str(vllm_omni.__file__)).parent / "deploy" / "bagel_single_stage.yaml"
    kwargs: dict[str, Any] = {"model": str(path), "deploy_config": str(deploy)}
    if args.attention_backend:
        kwargs["diffusion_attention_backend"] = args.attention_backend
    omni = Omni(**kwargs)
    model = in_process(path, ctx.device, "bagel")
    try:
        size, steps, g = args.size, args.steps, args.bagel_guidance
        worst = 0.0
        for k, (prompt, seed) in enumerate(zip(PROMPTS, seeds_for(len(PROMPTS)))):
            params = OmniDiffusionSamplingParams(
                height=size, width=size, num_inference_steps=steps + 1,  # BAGEL counts the N + 1 grid points
                seed=int(seed), return_trajectory_latents=True,
                extra_args={
                    "cfg_text_scale": g, "cfg_img_scale": 1.0, "cfg_interval": [0.4, 1.0], "cfg_renorm_min": 0.0,
                    "cfg_renorm_type": "global", "timestep_shift": 3.0,
                },
            )  # fmt: skip
            outs = [o for o in omni.generate([{"prompt": prompt}], params, use_tqdm=False) if o is not None]
            out = outs[-1]
            traj = getattr(out, "trajectory_latents", None)
            if traj is None:
                traj = ((getattr(out, "multimodal_output", None) or {}).get("trajectory") or {}).get(
                    "latents"
                )
            if traj is None:
                raise RuntimeError(
                    "vLLM-Omni's BAGEL returned no trajectory_latents (return_trajectory_latents)"
                )
            traj = traj.float().cpu()  # [points, tokens, p * p * C], BAGEL's packed layout
            C, p = BAGEL_TINY["latent_channels"], 2
            h = w = size // 8
            ref = [unpatchify(t[None], p, C, h, w)[0] for t in traj]
            n = len(ref) - 1  # the steps vLLM-Omni took
            mine = bagel_inprocess_latents(model, prompt, ref[0], n, g, size, size)
            rows = latent_gaps(ref, mine)
            if k == 0:
                print(f"\n## BAGEL parity: vLLM-Omni's BagelPipeline vs fgrpo in-process (tiny, bf16, eta 0, "
                      f"guidance {g}, {n} steps, {size}px); latents after each step")  # fmt: skip
                print(fmt_table(rows, ["point", "max_abs", "max_rel"]))
            assert torch.equal(patchify(ref[0][None], p)[0], traj[0])  # the packing round-trips
            worst = max(worst, rows[-1]["max_rel"])
            ctx.note(
                "parity",
                f"bagel prompt {k}: final latents max abs / rel |vLLM-Omni - fgrpo|",
                f"{rows[-1]['max_abs']:.3e} / {rows[-1]['max_rel']:.3e}",
            )
        ctx.note("parity", "bagel worst final max rel gap", f"{worst:.3e}", ok=worst < args.bagel_tol)
    finally:
        omni.close()
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


def save_real_size_zimage_dir(
    path: Path, device: torch.device, transformer_kwargs: Mapping[str, Any] | None = None
) -> Path:
    """Random Z-Image in diffusers' layout whose transformer has the released sizes (ZImageTransformer2DModel's
    defaults: vLLM-Omni builds that size whatever the directory's config says; `transformer_kwargs` shrink it for
    the CPU test only), a small 16-channel VAE (vLLM-Omni builds the VAE from the directory's config, and its size
    is not what the check compares) and a 2-layer Qwen3 of Qwen3-4B's width (2560, the transformer's cap_feat_dim;
    the conditioning is its second-to-last layer, which both sides read), bf16."""
    if (path / "model_index.json").exists():
        return path
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
    from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fgrpo.models.zimage import SCHEDULER_CONFIG

    tokenizer: Any = tiny.tiny_qwen_tokenizer()
    tokenizer.chat_template = tiny.QWEN3_CHAT_TEMPLATE
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            transformer = ZImageTransformer2DModel(**(transformer_kwargs or {}))
            width = transformer.config["cap_feat_dim"]
            vae_config: dict[str, Any] = dict(
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(32, 32, 64, 64), layers_per_block=1, latent_channels=16, norm_num_groups=16,
                scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
            )  # fmt: skip
            vae = AutoencoderKL(**vae_config)
            encoder = Qwen3ForCausalLM(
                Qwen3Config(
                    vocab_size=len(tokenizer), hidden_size=width, intermediate_size=1024, num_hidden_layers=2,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128,  # Qwen3-4B's heads
                    max_position_embeddings=4096,
                )
            )  # fmt: skip
    finally:
        torch.set_default_dtype(default)
    scheduler: Any = FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG)
    pipe = ZImagePipeline(
        transformer=transformer, vae=vae, text_encoder=encoder, tokenizer=tokenizer, scheduler=scheduler
    )
    tmp = path.with_name(path.name + ".tmp")
    pipe.save_pretrained(tmp, max_shard_size="10GB")
    tmp.rename(path)
    del pipe, transformer, vae, encoder
    gc.collect()
    if device.type == "cuda":
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


MODELS = ("qwen_image", "qwen_image_edit", "sd3", "zimage", "flux2", "flux2_dev", "wan", "bagel")
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
    with tempfile.TemporaryDirectory(prefix="fgrpo-vllm-check-") as root:  # removed afterwards, pass or fail
        selftest_family_dirs(Path(root))
    print("cpu selftest ok")


def selftest_family_dirs(root: Path) -> None:
    """The added families' directory writers, each writing below `root`: fgrpo's loaders read them (and, for SD3 and
    FLUX.2 [klein], the tokenizer classes vLLM-Omni instantiates agree with fgrpo's), the Wan and FLUX.2 adapters read
    the settings fgrpo's loader does, the BAGEL reference loop is the in-process engine's ODE bit for bit, and the
    Qwen-Image-Edit directory and condition images pass selftest_edit_dir."""
    from transformers import (
        AutoTokenizer,
        CLIPTokenizer,
        Qwen2Tokenizer,
        SiglipVisionConfig,
        SiglipVisionModel,
        T5Tokenizer,
    )

    from fgrpo.rollout.seeds import sample_generator
    from fgrpo.rollout.vllm_omni_pipeline import wan_settings

    sd3_dir = save_tiny_sd3_dir(root / "sd3")
    for sub, cls in (
        ("tokenizer", CLIPTokenizer),
        ("tokenizer_2", CLIPTokenizer),
        ("tokenizer_3", T5Tokenizer),
    ):
        a, b = (
            cls.from_pretrained(str(sd3_dir), subfolder=sub),
            AutoTokenizer.from_pretrained(str(sd3_dir), subfolder=sub),
        )
        assert a(PROMPTS[0]).input_ids == b(PROMPTS[0]).input_ids, sub
    cfg = tiny_cfg(argparse.Namespace(size=64, steps=2))
    sd3 = as_flow_model(
        SD3.from_pretrained(sd3_dir, dtype=torch.float32, device="cpu", **FAMILY_KWARGS["sd3"])
    )
    assert torch.isfinite(DiffusersEngine(sd3).generate(PROMPTS[:1], seeds_for(1), cfg).log_prob).all()
    for experts in (1, 2):
        wan_dir = save_tiny_wan_dir(root / f"wan{experts}", experts)
        wan = Wan.from_pretrained(wan_dir, dtype=torch.float32, device="cpu", **FAMILY_KWARGS["wan"])
        settings = wan_settings(wan_dir)
        assert (
            settings["expand_timesteps"] == wan.expand_timesteps and settings["flow_shift"] == wan.flow_shift
        )
        boundary = settings["boundary_ratio"]
        assert (None if boundary is None else boundary * 1000) == wan.boundary_timestep, (boundary, experts)
    for kind in ("flux2", "flux2_dev"):
        flux2_dir = save_tiny_flux2_dir(root / kind, kind)
        flux2 = Flux2.from_pretrained(flux2_dir, dtype=torch.float32, device="cpu", **FAMILY_KWARGS[kind])
        # the adapter's settings are the loader's (text_layers aside: the tiny model's come from FAMILY_KWARGS)
        settings = flux2_settings(flux2_dir, "dev" if kind == "flux2_dev" else "klein")
        settings.pop("text_layers", None)
        assert {k: getattr(flux2, k) for k in settings} == settings, settings
        assert torch.isfinite(
            DiffusersEngine(as_flow_model(flux2)).generate(PROMPTS[:1], seeds_for(1), cfg).log_prob
        ).all()
        # the start-up request's model (the released layers) runs on it too, and [dev]'s LM head was written
        released = Flux2.from_pretrained(flux2_dir, dtype=torch.float32, device="cpu")
        assert released.text_layers == (DEV_TEXT_LAYERS if kind == "flux2_dev" else TEXT_LAYERS)
        assert (
            released.encode(PROMPTS[:1])["prompt_embeds"].shape[-1]
            == flux2.encode(PROMPTS[:1])["prompt_embeds"].shape[-1]
        )
        if kind == "flux2_dev":
            from safetensors import safe_open

            (weights,) = (flux2_dir / "text_encoder").glob("*.safetensors")
            with safe_open(str(weights), "pt") as f:
                assert "language_model.lm_head.weight" in set(f.keys())  # the released names
    # vLLM-Omni's Flux2KleinPipeline loads the tokenizer as Qwen2TokenizerFast (transformers 5: Qwen2Tokenizer)
    klein_tok = Qwen2Tokenizer.from_pretrained(str(root / "flux2"), subfolder="tokenizer")
    fgrpo_tok = AutoTokenizer.from_pretrained(str(root / "flux2"), subfolder="tokenizer")
    assert klein_tok(PROMPTS[2]).input_ids == fgrpo_tok(PROMPTS[2]).input_ids
    vit = released_vit_state(SiglipVisionModel(SiglipVisionConfig(**BAGEL_VIT)))
    # the names vLLM-Omni's BagelPipeline holds (its wrapper keeps a `vision_model`), one ViT layer here
    assert {"vit_model.vision_model.embeddings.patch_embedding.weight", "vit_model.vision_model.post_layernorm.weight",
            "vit_model.vision_model.encoder.layers.0.self_attn.q_proj.weight"} <= set(vit), sorted(vit)[:4]  # fmt: skip
    assert all(
        k.startswith("vit_model.vision_model.") and ".vision_model.vision_model." not in k for k in vit
    )
    bagel_dir = save_tiny_bagel_dir(root / "bagel", vllm_omni_parts=False)
    bagel = as_flow_model(Bagel.from_pretrained(bagel_dir, dtype=torch.float32, device="cpu"))  # strict load
    ode = dataclasses.replace(cfg, guidance_scale=4.0, negative_prompt="", window_size=0, window_range=(0, 0))
    seed = seeds_for(1)[0]
    want = DiffusersEngine(bagel).generate(PROMPTS[:1], [seed], ode)
    x1 = torch.randn(bagel.latent_shape(64, 64), generator=sample_generator(seed))  # the engine's x_1 draw
    mine = bagel_inprocess_latents(bagel, PROMPTS[0], x1, ode.num_steps, 4.0, 64, 64)
    assert want.x0 is not None
    final = want.x0[0].float()
    assert torch.equal(mine[-1], final), latent_gaps([mine[-1]], [final])
    assert torch.equal(unpatchify(patchify(x1[None], 2), 2, 16, 8, 8)[0], x1)
    selftest_edit_dir(root)
    print("family directories ok")


def selftest_edit_dir(root: Path) -> None:
    """The Qwen-Image-Edit directory writer and the condition images: the directory has the folders and the
    architecture name vLLM-Omni's Edit pipeline reads, its processor and tokenizer load as the classes vLLM-Omni
    instantiates and agree with fgrpo's, fgrpo's loader reads it as the tiny Edit model (same trajectories, bit for
    bit) and the adapter's processor encodes as the loader's does; the prompts come back from a request's form (text
    plus the image file's path) as they went, and the images are the same on every writing."""
    from PIL import Image
    from transformers import Qwen2Tokenizer, Qwen2VLProcessor

    path = save_tiny_edit_dir(root / "qwen_image_edit")
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == ADAPTERS["qwen_image_edit"].base_class == "QwenImageEditPipeline", index
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"], index
    assert all((path / sub).is_dir() for sub in EDIT_FOLDERS), sorted(p.name for p in path.iterdir())
    kwargs = FAMILY_KWARGS["qwen_image_edit"]
    edit = QwenImageEdit.from_pretrained(path, dtype=torch.float32, device="cpu", **kwargs)
    reference = tiny.tiny_qwen_image_edit(0, **kwargs)
    want_pixels = reference.processor.image_processor.to_dict()
    assert edit.processor.image_processor.to_dict() == want_pixels, edit.processor.image_processor.to_dict()
    # vLLM-Omni's reads: Qwen2VLProcessor from `processor`, Qwen2Tokenizer from `tokenizer`
    omni_processor = Qwen2VLProcessor.from_pretrained(str(path), subfolder="processor")
    omni_tokenizer = Qwen2Tokenizer.from_pretrained(str(path), subfolder="tokenizer")
    text = edit.processor.tokenizer(PROMPTS[0]).input_ids
    assert omni_tokenizer(PROMPTS[0]).input_ids == omni_processor.tokenizer(PROMPTS[0]).input_ids == text

    prompts = write_edit_prompts(root / "edit_images")
    again = write_edit_prompts(root / "edit_images_again")
    sizes = set()
    for i, (p, q) in enumerate(zip(prompts, again)):
        assert isinstance(p, ImagePrompt) and isinstance(q, ImagePrompt) and str(p) == PROMPTS[i], p
        image = Image.open(p.image)
        sizes.add(image.size)
        assert image.tobytes() == Image.open(q.image).tobytes(), (p.image, q.image)
        # what build_requests sends (the text, the file's absolute path) and request_prompt hands the worker's model
        back = request_prompt({"prompt": str(p), "multi_modal_data": {IMAGE_KEY: os.path.abspath(p.image)}})
        assert isinstance(back, ImagePrompt) and str(back) == str(p), back
        assert Path(back.image).samefile(p.image), (back.image, p.image)
    assert sizes == {EDIT_IMAGE_SIZE}, sizes
    # the VL processors of both sides give a condition image as many vision tokens
    first = Image.open(prompts[0].image).convert("RGB")  # pyright: ignore[reportAttributeAccessIssue]
    grids = [proc.image_processor(images=[first], return_tensors="pt")["image_grid_thw"]
             for proc in (omni_processor, edit.processor)]  # fmt: skip
    assert torch.equal(*grids), grids

    cfg = tiny_cfg(argparse.Namespace(size=64, steps=2))
    seeds = seeds_for(len(prompts))
    got = DiffusersEngine(as_flow_model(edit)).generate(prompts, seeds, cfg)
    want = DiffusersEngine(as_flow_model(reference)).generate(prompts, seeds, cfg)
    assert torch.equal(got.x_next, want.x_next) and torch.equal(got.log_prob, want.log_prob)
    assert torch.equal(got.images, want.images)
    latents = got.cond["image_latents"]
    assert all(not torch.equal(latents[0], z) for z in latents[1:])  # every condition image its own
    # the adapter's model on the loaded modules (diffusers' transformer in vLLM-Omni's place: encoding does not run
    # it), its VL processor read from the directory's `processor` folder as the worker reads it: the same conditioning
    scheduler = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
    pipeline: Any = SimpleNamespace(
        od_config=SimpleNamespace(model=str(path)), transformer=edit.transformer, vae=edit.vae,
        text_encoder=edit.text_encoder, tokenizer=edit.tokenizer, scheduler=SimpleNamespace(config=scheduler),
    )  # fmt: skip
    # the adapter reads `in_channels` as vLLM-Omni's transformer has it; diffusers' warns that it is a config field
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        adapted = edit_flow_model(pipeline, kwargs)
    assert adapted.condition_area == edit.condition_area == tiny.TINY_CONDITION_AREA
    mine, theirs = adapted.encode(prompts, negative_prompt=" "), edit.encode(prompts, negative_prompt=" ")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), sorted(mine)
    print(f"qwen_image_edit directory and condition images ok ({path})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default="qwen_image",
        choices=MODELS,
        help="family: qwen_image (every section), qwen_image_edit, sd3, zimage, flux2, flux2_dev, wan, bagel (parity "
        "only)",
    )
    ap.add_argument(
        "--model-dir",
        default="",
        help="zimage: a released Z-Image diffusers directory (default: a random released-size one under --out)",
    )
    ap.add_argument(
        "--sections",
        default="",
        help=f"comma-separated: {','.join(SECTIONS)} (default parity,lora,weights,sleep; parity for --model other "
        "than qwen_image)",
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
    ap.add_argument(
        "--wan-experts", type=int, default=1, choices=(1, 2), help="wan: 1 (TI2V-5B-like) or 2 (A14B)"
    )
    ap.add_argument(
        "--bagel-guidance", type=float, default=4.0, help="bagel: text guidance (BAGEL's default 4)"
    )
    ap.add_argument(
        "--bagel-tol", type=float, default=0.05, help="bagel: max relative gap of the final latents"
    )
    ap.add_argument("--cpu-selftest", action="store_true", help="check the helpers on the CPU (no vllm)")
    args = ap.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()] or (
        ["parity", "lora", "weights", "sleep"] if args.model == "qwen_image" else ["parity"]
    )
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections {','.join(unknown)}: not among {','.join(SECTIONS)}")
    if args.model != "qwen_image" and sections != ["parity"]:
        ap.error(
            f"--sections {','.join(sections)}: --model {args.model} runs parity only; pass --sections parity"
        )
    if args.model == "wan" and args.size % 32:
        ap.error(
            f"--size {args.size}: --model wan needs a multiple of 32 (VAE 16 x patch 2); e.g. --size 128"
        )
    top = 16 * BAGEL_TINY["max_latent_size"]  # VAE 8 x patch 2 pixels a grid cell
    if args.model == "bagel" and (args.size % 16 or args.size > top):
        ap.error(
            f"--size {args.size}: --model bagel needs a multiple of 16 up to {top} (its tiny grid of latent patches)"
        )
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
    for name in sections:
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
