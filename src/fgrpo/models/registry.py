"""The model families, one entry per `model.kind`: how to build it, the Linear layers its LoRA adapts, its pixel
multiple, whether it runs sequence parallel, its tiny random version and its recipe file. Everything that depends on
the family reads it here; a new family is its model file, one entry here and its experiment file (config.py's
`ModelConfig.kind` Literal lists the keys for tyro, and tests/models/test_registry.py holds the two equal)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fgrpo.config import ModelConfig, TrainConfig
from fgrpo.errors import ConfigError
from fgrpo.models import tiny
from fgrpo.models.bagel import BAGEL_LORA_TARGETS, Bagel
from fgrpo.models.base import FlowModel, trained_transformers
from fgrpo.models.flux import FLUX_LORA_TARGETS, Flux
from fgrpo.models.flux2 import FLUX2_LORA_TARGETS, Flux2, flux2_variant
from fgrpo.models.loading import check_attention_backend, compile_decoder, configure_transformer
from fgrpo.models.lora import check_lora_file, lora_files
from fgrpo.models.ltx2 import LTX2, LTX2_LORA_TARGETS, clip_kwargs
from fgrpo.models.qwen_image import QWEN_IMAGE_LORA_TARGETS, QwenImage
from fgrpo.models.qwen_image_edit import QwenImageEdit
from fgrpo.models.sd3 import SD3, SD3_LORA_TARGETS
from fgrpo.models.textbed import load_textbed
from fgrpo.models.wan import WAN_LORA_TARGETS, Wan, check_experts, wan_experts, wan_kwargs
from fgrpo.models.zimage import ZIMAGE_LORA_TARGETS, ZImage

# (model section, device, dtype, seed) -> the family's model, frozen (the seed draws a random model's weights)
Loader = Callable[[ModelConfig, "torch.device | str", torch.dtype, int], FlowModel]


@dataclass(frozen=True)
class Family:
    """What fgrpo needs to know of one model family."""

    load: Loader
    """Builds the model: from model.path (a real family), or random (a tiny one), or the bundled renderer."""
    lora_targets: tuple[str, ...]
    """The transformer's Linear layers its LoRA adapts (its recipe's model.lora_targets)."""
    pixel_multiple: int
    """Pixels per latent token side (VAE downsampling x transformer patch): sampling.height/width's multiple."""
    recipe: str
    """The experiment file (relative to the repository) whose `recipe` preset trains it, or whose `tiny` preset
    runs it (a tiny family)."""
    preset: str = "Config"
    """The name in the recipe file that builds the family's recipe config (FLUX.2 [dev] shares klein's file: `dev`)."""
    tiny: str = ""
    """model.kind of its tiny random version ('' = none: it is tiny itself)."""
    sequence_parallel: bool = False
    """Its transformer declares diffusers' context-parallel plan and its prompts are padded for it (parallel.sp)."""
    vllm_omni: bool = False
    """The vLLM-Omni rollout engine (rollout_engine='vllm_omni') samples it."""


def _pretrained(
    cls: type[QwenImage] | type[SD3] | type[Flux] | type[ZImage] | type[Bagel],
) -> Loader:
    return lambda mcfg, device, dtype, seed: cls.from_pretrained(mcfg.path, dtype=dtype, device=device)


def _flux2(variant: str) -> Loader:
    """FLUX.2's loader for kind `flux2` (klein) or `flux2_dev` (dev): the directory's pipeline class must agree."""

    def load(mcfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int) -> FlowModel:
        try:
            found = flux2_variant(mcfg.path)
        except ValueError as e:  # not a FLUX.2 pipeline directory
            raise ConfigError(f"model.path: {e}") from None
        if found != variant:
            kind = "flux2_dev" if found == "dev" else "flux2"
            raise ConfigError(
                f"model.path={mcfg.path!r} holds FLUX.2 [{found}], model.kind={mcfg.kind!r} wants [{variant}]; "
                f"use --model.kind {kind}"
            )
        return Flux2.from_pretrained(mcfg.path, dtype=dtype, device=device)

    return load


def _tiny(build: Callable[..., FlowModel]) -> Loader:
    return lambda mcfg, device, dtype, seed: build(seed=seed, device=device, dtype=dtype, **clip_kwargs(mcfg))


# Pixel multiples: Qwen-Image(-Edit), SD3, FLUX and Z-Image 8 x 2, as their tiny versions; LTX-2 32 x 1; the text renderer packs
# 4x4 pixel patches.
FAMILIES: dict[str, Family] = {
    "qwen_image": Family(
        _pretrained(QwenImage),
        QWEN_IMAGE_LORA_TARGETS,
        16,
        "experiments/qwen_image_ocr.py",
        tiny="tiny_qwen_image",
        sequence_parallel=True,
        vllm_omni=True,
    ),
    "qwen_image_edit": Family(
        _pretrained(QwenImageEdit),
        QWEN_IMAGE_LORA_TARGETS,
        16,
        "experiments/qwen_image_edit_ocr.py",
        tiny="tiny_qwen_image_edit",
        vllm_omni=True,
    ),
    "sd3": Family(
        _pretrained(SD3), SD3_LORA_TARGETS, 16, "experiments/sd35_ocr.py", tiny="tiny_sd3", vllm_omni=True
    ),
    "flux": Family(_pretrained(Flux), FLUX_LORA_TARGETS, 16, "experiments/flux_ocr.py", tiny="tiny_flux"),
    "zimage": Family(
        _pretrained(ZImage),
        ZIMAGE_LORA_TARGETS,
        16,
        "experiments/zimage_ocr.py",
        tiny="tiny_zimage",
        vllm_omni=True,
    ),
    "ltx2": Family(
        lambda mcfg, device, dtype, seed: LTX2.from_pretrained(
            mcfg.path, dtype=dtype, device=device, **clip_kwargs(mcfg)
        ),
        LTX2_LORA_TARGETS,
        32,
        "experiments/ltx2_ocr.py",
        tiny="tiny_ltx2",
    ),
    "textbed": Family(
        lambda mcfg, device, dtype, seed: load_textbed(mcfg.path or None, device=device, dtype=dtype),
        QWEN_IMAGE_LORA_TARGETS,  # model.path '' (the bundled Qwen-Image-architecture renderer); 'sd3': SD3's
        4,
        "experiments/qwen_image_ocr.py",
    ),
    "tiny_qwen_image": Family(
        _tiny(tiny.tiny_qwen_image),
        QWEN_IMAGE_LORA_TARGETS,
        16,
        "experiments/qwen_image_ocr.py",
        sequence_parallel=True,
    ),
    "tiny_qwen_image_edit": Family(
        _tiny(tiny.tiny_qwen_image_edit), QWEN_IMAGE_LORA_TARGETS, 16, "experiments/qwen_image_edit_ocr.py"
    ),
    "tiny_sd3": Family(_tiny(tiny.tiny_sd3), SD3_LORA_TARGETS, 16, "experiments/sd35_ocr.py"),
    "tiny_flux": Family(_tiny(tiny.tiny_flux), FLUX_LORA_TARGETS, 16, "experiments/flux_ocr.py"),
    "tiny_zimage": Family(_tiny(tiny.tiny_zimage), ZIMAGE_LORA_TARGETS, 16, "experiments/zimage_ocr.py"),
    "tiny_ltx2": Family(_tiny(tiny.tiny_ltx2), LTX2_LORA_TARGETS, 32, "experiments/ltx2_ocr.py"),
    "flux2": Family(
        _flux2("klein"), FLUX2_LORA_TARGETS, 16, "experiments/flux2_ocr.py", tiny="tiny_flux2", vllm_omni=True
    ),
    "tiny_flux2": Family(_tiny(tiny.tiny_flux2), FLUX2_LORA_TARGETS, 16, "experiments/flux2_ocr.py"),
    # FLUX.2 [dev]: klein's transformer architecture at 32B, so the same LoRA targets and pixel multiple
    "flux2_dev": Family(
        _flux2("dev"),
        FLUX2_LORA_TARGETS,
        16,
        "experiments/flux2_ocr.py",
        preset="dev",
        tiny="tiny_flux2_dev",
        vllm_omni=True,
    ),
    "tiny_flux2_dev": Family(_tiny(tiny.tiny_flux2_dev), FLUX2_LORA_TARGETS, 16, "experiments/flux2_ocr.py"),
    # 32: the TI2V-5B's (Wan 2.2 VAE 16 x patch 2), a multiple of the A14B's 16 (Wan 2.1 VAE 8 x 2)
    "wan": Family(
        lambda mcfg, device, dtype, seed: check_experts(
            mcfg, Wan.from_pretrained(mcfg.path, dtype=dtype, device=device, **wan_kwargs(mcfg))
        ),
        WAN_LORA_TARGETS,
        32,
        "experiments/wan_video_ocr.py",
        tiny="tiny_wan",
        vllm_omni=True,
    ),
    "tiny_wan": Family(
        lambda mcfg, device, dtype, seed: tiny.tiny_wan(
            seed=seed, device=device, dtype=dtype, experts=wan_experts(mcfg) or 1, **wan_kwargs(mcfg)
        ),
        WAN_LORA_TARGETS,
        32,
        "experiments/wan_video_ocr.py",
    ),
    "bagel": Family(
        _pretrained(Bagel), BAGEL_LORA_TARGETS, 16, "experiments/bagel_ocr.py", tiny="tiny_bagel"
    ),
    "tiny_bagel": Family(_tiny(tiny.tiny_bagel), BAGEL_LORA_TARGETS, 16, "experiments/bagel_ocr.py"),
}

SEQUENCE_PARALLEL_KINDS = tuple(k for k, f in FAMILIES.items() if f.sequence_parallel)
VLLM_OMNI_KINDS = tuple(k for k, f in FAMILIES.items() if f.vllm_omni)


def build_model(mcfg: ModelConfig, device: torch.device, seed: int) -> FlowModel:
    """The generator named by model.kind, on `device`, frozen; `models.lora.setup_trainable` makes parameters
    trainable. The attention backend and regional compile are applied here since they do not change the numbers'
    meaning."""
    dtype = torch.bfloat16 if mcfg.dtype == "bf16" else torch.float32
    model = FAMILIES[mcfg.kind].load(mcfg, device, dtype, seed)
    for transformer in trained_transformers(model).values():
        configure_transformer(
            transformer, attention_backend=mcfg.attention_backend, compile_blocks=mcfg.compile
        )
    if mcfg.compile:
        compile_decoder(model)
    return model


def build_tiny(kind: str, seed: int = 0) -> FlowModel:
    """The tiny random version of family `kind` (itself if it is tiny), fp32 on the CPU."""
    tiny_kind = FAMILIES[kind].tiny or kind
    return FAMILIES[tiny_kind].load(ModelConfig(kind=tiny_kind), "cpu", torch.float32, seed)  # pyright: ignore[reportArgumentType]


def check_config(cfg: TrainConfig) -> None:
    """The checks of a run's config that need the model family or model code, each a one-line ConfigError naming the
    field (config.validate_config makes the others; run both before building anything): the resolution is a
    multiple of the family's pixel multiple; parallel.sp > 1 and the vLLM-Omni engine run only families that
    support them (sp: with a token count it divides); the attention backend exists here; model.init_lora's file
    is there with this rank and alpha."""
    m, s, p = cfg.model, cfg.sampling, cfg.parallel
    multiple = FAMILIES[m.kind].pixel_multiple
    for name, px in (("sampling.height", s.height), ("sampling.width", s.width)):
        if px < multiple or px % multiple:
            raise ConfigError(
                f"{name}={px}: model.kind={m.kind!r} needs a positive multiple of {multiple} pixels "
                f"(VAE x patch); e.g. --{name.replace('_', '-')} {max(multiple, round(px / multiple) * multiple)}"
            )
    if p.sp != 1:
        if m.kind not in SEQUENCE_PARALLEL_KINDS:
            raise ConfigError(
                f"parallel.sp>1 supports model.kind in {SEQUENCE_PARALLEL_KINDS}; drop --parallel.sp"
            )
        tokens = (s.height // multiple) * (s.width // multiple)
        if tokens % p.sp:
            up = -(-s.height // (multiple * p.sp)) * multiple * p.sp  # height tokens a multiple of sp
            raise ConfigError(
                f"sampling.height x width = {s.height}x{s.width} gives {tokens} image tokens, not divisible by "
                f"parallel.sp={p.sp} (diffusers' Ulysses splits them evenly; its uneven split has no backward); "
                f"e.g. --sampling.height {up}"
            )
    if cfg.rollout_engine == "vllm_omni" and m.kind not in VLLM_OMNI_KINDS:
        raise ConfigError(
            f"rollout_engine='vllm_omni' supports model.kind in {VLLM_OMNI_KINDS}; use --rollout-engine diffusers"
        )
    check_attention_backend(m.attention_backend, "model.attention_backend")
    if m.init_lora:
        for path in lora_files(m.init_lora):
            check_lora_file(path, rank=m.lora_rank, alpha=m.lora_alpha)
