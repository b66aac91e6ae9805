"""The worker side of the vLLM-Omni engine: vLLM-Omni's pipeline of a family whose `forward` is fgrpo's rollout.

vllm-omni 0.30 lets a caller replace a model's pipeline class through
`Omni(..., custom_pipeline_args={"pipeline_class": "<module>.<qualname>"})`; its worker imports the
class by that name and calls `forward(req: DiffusionRequestBatch) -> list[DiffusionOutput]`, one output
per request, under `torch.inference_mode()`. For each family in ADAPTERS we subclass vllm-omni's pipeline of
that family (Qwen-Image: `QwenImagePipeline`, Qwen-Image-Edit: `QwenImageEditPipeline`, SD3.5: `StableDiffusion3Pipeline`, FLUX.2 [klein] and [dev]:
`Flux2KleinPipeline` and `Flux2Pipeline`, Z-Image: `ZImagePipeline`, Wan 2.2: `Wan22Pipeline`) to keep everything it loads (text encoders, VAE, its fused-kernel transformer(s), its LoRA manager) and replace only
`forward`: it wraps those modules in fgrpo's own FlowModel of the family (the adapter's `wrap`) and runs fgrpo's
in-process engine (`fgrpo.rollout.engine.DiffusersEngine`) on them. So the prompt encoding, latent layout, CFG,
the schedule, the per-sample generators and SDE windows, `fgrpo.policy.transition` and the VAE decode are the very
code the in-process engine and the trainer run; only the transformer's kernels are vllm-omni's.

Everything except the classes built at the bottom imports without vllm: the classes are built on first
attribute access (module `__getattr__`), which is exactly what vllm's `resolve_obj_by_qualname` does
(`import_module`, then `getattr`).

Per-request data travels in the prompt's `additional_information` dict (vllm-omni keeps it on the
request; one sampling-params object serves all prompts of an `Omni.generate` call): the sample's seed
and index. An edit family's condition image rides where vllm-omni's own edit requests carry it, the prompt's
`multi_modal_data["image"]`: the file's path (the worker runs on this host), which becomes the worker's
`ImagePrompt` again, so fgrpo's model reads and encodes the very file the in-process engine would. The trajectory returns in the output envelope's `payload["trajectory"]`, which vllm-omni
passes through to `OmniRequestOutput.multimodal_output["trajectory"]`.

What travels back per sample (fp32 unless said; `latent` = the model's latent_shape, [16, H/8, W/8] for
Qwen-Image, 64 KiB per 256 px squared: 256 KiB at 512², 1 MiB at 1024²): the window's x_t and x_next
([W, *latent] each), its log-probs [W], the window's step indices, the sigmas [T + 1], the prompt embeddings
(and masks, pooled embeddings, the negative ones with CFG), the decoded pixels (uint8, as the in-process engine's
`images`: a family's own post-processing in vllm-omni, e.g. a video's, need not round-trip them), and only those
of the Trajectory's optional fields that the request names in `sampling_params.extra_args[KEEP_KEY]`, which the
trainer sets to what its algorithm reads (`Algorithm.rollout_fields`): `mean` [W, *latent] (Flow-DPPO's old
means, when it reuses the rollout's log-probs) and `x0` [*latent] (the clean latents DiffusionNFT and AWM train
on).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch
from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF
from torch import nn

from fgrpo.config import SamplingConfig
from fgrpo.models.base import Cond, FlowModel, ImagePrompt
from fgrpo.models.common import pad_to
from fgrpo.models.flux2 import DEV_TEXT_LAYERS, VARIANTS, Flux2
from fgrpo.models.qwen_image import QwenImage
from fgrpo.models.qwen_image_edit import QwenImageEdit
from fgrpo.models.qwen_vl import vl_processor
from fgrpo.models.sd3 import SD3
from fgrpo.models.wan import Wan
from fgrpo.models.zimage import ZImage
from fgrpo.rollout.base import Trajectory
from fgrpo.rollout.engine import DiffusersEngine

if (
    TYPE_CHECKING
):  # the static check runs against vllm-omni 0.30's real classes; runtime never imports them here
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline  # pyright: ignore[reportMissingImports] - the optional `vllm` extra

# Keys shared with the engine (fgrpo.rollout.vllm_omni); the engine side imports them from here.
INFO_KEY = "fgrpo"  # prompt["additional_information"][INFO_KEY] = {"seed", "index"}
CFG_KEY = "fgrpo_cfg"  # sampling_params.extra_args[CFG_KEY] = SamplingConfig fields
KEEP_KEY = "fgrpo_keep"  # sampling_params.extra_args[KEEP_KEY] = names of OPTIONAL_FIELDS to send back
TRAJ_KEY = "trajectory"  # payload key that vllm-omni forwards to multimodal_output
# sampling_params.extra_args[MODEL_KEY] = the family's model keywords (Wan: num_frames)
MODEL_KEY = "fgrpo_model"
PIXELS_KEY = "pixels"  # the decoded uint8 pixels inside each sample's trajectory dict
# prompt["multi_modal_data"][IMAGE_KEY] = an edit family's condition image (vllm-omni's own key for an input image)
IMAGE_KEY = "image"
# QwenImage.encode's keys, as (embeds, mask) pairs; the negative pair exists only with CFG. A conditioning key of
# another family (no mask: its prompts share one length) is stacked as it is (merge_cond).
COND_PAIRS = (("prompt_embeds", "prompt_mask"), ("neg_prompt_embeds", "neg_prompt_mask"))

PIPELINE_QUALNAME = f"{__name__}.FgrpoQwenImagePipeline"
WORKER_EXTENSION_QUALNAME = f"{__name__}.FgrpoWorkerExtension"
QWEN_IMAGE_PATCH = 2  # 2x2 latent packing; vllm-omni's pipeline hard-codes it as well
# The Trajectory's per-sample fields an engine may leave None ("mean", "x0"): sent only when asked for.
OPTIONAL_FIELDS = tuple(f.name for f in dataclasses.fields(Trajectory) if f.default is None)


def config_to_dict(cfg: SamplingConfig) -> dict[str, Any]:
    """SamplingConfig as plain JSON-able values (it crosses a process boundary inside extra_args). Every field
    travels: one left out would silently sample with its default on the worker (MixGRPO-Flash's tail as Euler)."""
    d = dataclasses.asdict(cfg)
    d["window_range"] = list(cfg.window_range)
    return d


def config_from_dict(d: dict[str, Any]) -> SamplingConfig:
    d = dict(d)
    d["window_range"] = tuple(d["window_range"])
    return SamplingConfig(**d)


def spec_from_dir(path: str | Path) -> QwenImage | None:
    """A weightless QwenImage (configs only) for latent_shape / sigmas / request checks on the host.

    None when `path` is not a local diffusers directory (the checks then run on the worker).
    """
    path = Path(path)
    try:
        t = json.loads((path / "transformer" / "config.json").read_text())
        v = json.loads((path / "vae" / "config.json").read_text())
        s = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
    except (OSError, ValueError):
        return None
    transformer: Any = SimpleNamespace(config=SimpleNamespace(**t))
    vae: Any = SimpleNamespace(temperal_downsample=v["temperal_downsample"], config=SimpleNamespace(**v))
    return QwenImage(transformer, vae, None, None, scheduler_config=s)


class OmniTransformer(nn.Module):
    """vllm-omni's Qwen-Image transformer behind diffusers' call signature, so QwenImage.velocity drives it.

    vllm-omni's forward also wants `txt_seq_lens` (it sizes the text RoPE table by the padded width, which
    is what diffusers derives from the embeddings' shape) and per-sample lists of frame shapes.
    """

    def __init__(self, transformer: Any):
        super().__init__()
        self.inner = transformer
        self.config = SimpleNamespace(patch_size=QWEN_IMAGE_PATCH, in_channels=int(transformer.in_channels))

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        img_shapes: list[Any],
        return_dict: bool = False,
    ) -> tuple[torch.Tensor]:
        """img_shapes: per sample, diffusers' RoPE shape of its image tokens: one (frames, h, w) (Qwen-Image) or a
        list of them, x_t's then the condition image's (Qwen-Image-Edit); vllm-omni takes a list per sample."""
        B = hidden_states.shape[0]
        out = self.inner(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            encoder_hidden_states_mask=encoder_hidden_states_mask,
            timestep=timestep,
            img_shapes=[[tuple(s)] if isinstance(s[0], int) else [tuple(t) for t in s] for s in img_shapes],
            txt_seq_lens=[int(encoder_hidden_states.shape[1])] * B,
            guidance=None,  # Qwen-Image has no guidance embedding; true CFG happens in QwenImage.velocity
            attention_kwargs={},
            return_dict=False,
        )
        return (out[0],)


def flow_model(pipeline: QwenImagePipeline, model_kwargs: Mapping[str, Any] | None = None) -> QwenImage:
    """fgrpo's QwenImage FlowModel on the modules vllm-omni loaded (shared, not copied)."""
    scheduler: Any = pipeline.scheduler  # diffusers types from_pretrained's result loosely
    transformer: Any = OmniTransformer(pipeline.transformer)
    return QwenImage(
        transformer,
        pipeline.vae,
        pipeline.text_encoder,
        pipeline.tokenizer,
        scheduler_config=scheduler.config,
        **(model_kwargs or {}),
    )


def edit_flow_model(pipeline: Any, model_kwargs: Mapping[str, Any] | None = None) -> QwenImageEdit:
    """fgrpo's QwenImageEdit on vllm-omni's QwenImageEditPipeline modules (Qwen2.5-VL, its tokenizer, the VAE,
    vllm-omni's transformer). The VL processor is fgrpo's, built from the checkpoint's `processor` folder as
    QwenImageEdit.from_pretrained builds it (transformers' PIL image processor), not vllm-omni's, whose image backend
    may resize the VL pixels with other rounding: the prompt encoding stays the trainer's."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(
        str(pipeline.od_config.model), subfolder="processor"
    )
    scheduler: Any = pipeline.scheduler
    return QwenImageEdit(
        OmniTransformer(pipeline.transformer),
        pipeline.vae,
        pipeline.text_encoder,
        pipeline.tokenizer,
        processor=vl_processor(image_processor, pipeline.tokenizer),
        scheduler_config=scheduler.config,
        **(model_kwargs or {}),
    )


class OmniConfigured(nn.Module):
    """A vllm-omni transformer whose forward already takes diffusers' keywords (SD3, Wan), with the `config` fields
    fgrpo's model reads: vllm-omni keeps them as plain attributes (SD3) or on a config object of its own (Wan)."""

    def __init__(self, transformer: Any, **config: Any):
        super().__init__()
        self.inner = transformer
        self.config = SimpleNamespace(**config)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def sd3_flow_model(pipeline: Any, model_kwargs: Mapping[str, Any] | None = None) -> SD3:
    """fgrpo's SD3 on vllm-omni's StableDiffusion3Pipeline modules: CLIP-L, CLIP-G, T5 and their tokenizers."""
    t = pipeline.transformer
    transformer: Any = OmniConfigured(
        t,
        patch_size=int(t.patch_size),
        in_channels=int(t.in_channels),
        joint_attention_dim=int(t.joint_attention_dim),
    )
    return SD3(
        transformer,
        pipeline.vae,
        [pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3],
        [pipeline.tokenizer, pipeline.tokenizer_2, pipeline.tokenizer_3],
        scheduler_config=pipeline.scheduler.config,
        **(model_kwargs or {}),
    )


def wan_settings(path: str | Path) -> dict[str, Any]:
    """What fgrpo's Wan.from_pretrained takes from a diffusers Wan 2.2 directory besides the modules: the expert
    boundary and expand_timesteps (model_index.json) and the flow shift (the scheduler's config). Read from the
    files, not from vllm-omni's pipeline, whose values may come from its own engine arguments instead."""
    root = Path(path)
    try:
        index = json.loads((root / "model_index.json").read_text())
        sched = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"model path '{root}': no readable model_index.json and scheduler/scheduler_config.json; pass a local "
            "diffusers Wan 2.2 directory"
        ) from e
    return dict(
        boundary_ratio=index.get("boundary_ratio"),
        expand_timesteps=bool(index.get("expand_timesteps", False)),
        flow_shift=float(sched["flow_shift"]),
    )


def wan_flow_model(pipeline: Any, model_kwargs: Mapping[str, Any] | None = None) -> Wan:
    """fgrpo's Wan on vllm-omni's Wan22Pipeline modules: UMT5, the Wan VAE and one or two experts."""

    def expert(t: Any) -> Any:
        if t is None:
            return None
        return OmniConfigured(t, patch_size=tuple(t.config.patch_size), in_channels=int(t.config.in_channels))

    return Wan(
        expert(pipeline.transformer),
        pipeline.vae,
        pipeline.text_encoder,
        pipeline.tokenizer,
        transformer_2=expert(getattr(pipeline, "transformer_2", None)),
        **wan_settings(pipeline.od_config.model),
        **(model_kwargs or {}),
    )


def wan_plain_kwargs(params: Any) -> dict[str, Any]:
    """A plain request's clip length (vllm-omni's own field), so its warm-up does not sample Wan's default 81."""
    frames = getattr(params, "num_frames", None)
    return {"num_frames": int(frames)} if isinstance(frames, int) else {}


def flux2_settings(path: str | Path, variant: str) -> dict[str, Any]:
    """What fgrpo's Flux2.from_pretrained takes from a diffusers FLUX.2 directory besides the modules, read from its
    model_index.json: klein's `is_distilled` (vllm-omni's Flux2KleinPipeline leaves its own at False whatever the
    checkpoint), or [dev]'s system message and text layers. A directory of the other variant is refused: the two
    adapters subclass different vllm-omni pipelines."""
    root = Path(path)
    try:
        index = json.loads((root / "model_index.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"model path '{root}': no readable model_index.json; pass a local diffusers FLUX.2 directory"
        ) from e
    found = VARIANTS.get(index.get("_class_name", ""))
    if found != variant:
        raise ValueError(
            f"model path '{root}' holds a {index.get('_class_name')}, the adapter wants FLUX.2 [{variant}]; use "
            f"kind {'flux2_dev' if found == 'dev' else 'flux2'}"
        )
    if variant == "klein":
        return {"is_distilled": bool(index.get("is_distilled", False))}
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return {"system_message": SYSTEM_MESSAGE, "text_layers": DEV_TEXT_LAYERS}


def flux2_wrap(variant: str) -> Callable[[Any, Mapping[str, Any]], Flux2]:
    """fgrpo's Flux2 on vllm-omni's Flux2KleinPipeline (variant 'klein': Qwen3 and its tokenizer) or Flux2Pipeline
    ('dev': vllm-omni's own Mistral encoder, whose forward takes HF's keywords and returns `hidden_states`, and the
    Pixtral processor). vllm-omni's FLUX.2 transformers take diffusers' keywords and keep the config fields fgrpo
    reads on a config object of their own."""

    def wrap(pipeline: Any, model_kwargs: Mapping[str, Any] | None = None) -> Flux2:
        t = pipeline.transformer
        transformer: Any = OmniConfigured(
            t, in_channels=int(t.config.in_channels), guidance_embeds=bool(t.config.guidance_embeds)
        )
        return Flux2(
            transformer,
            pipeline.vae,
            pipeline.text_encoder,
            pipeline.tokenizer,
            scheduler_config=pipeline.scheduler.config,
            **{**flux2_settings(pipeline.od_config.model, variant), **(model_kwargs or {})},
        )

    return wrap


class OmniZImageTransformer(OmniConfigured):
    """vllm-omni's Z-Image transformer: diffusers' positional call (per-sample latents, timestep, per-sample text) and
    the same output tuple, but no `return_dict` keyword, which ZImage passes; `in_channels` is a plain attribute.

    vllm-omni 0.30's forward is right only for a batch whose captions all pad to one length (a multiple of
    diffusers' SEQ_MULTI_OF tokens, vllm-omni's too): it passes no attention mask, so shorter items attend to the
    padding rows, and it rotates every item with item 0's positions. A CFG batch (prompts beside a short negative
    prompt) mixes lengths, so this wrapper calls it once per group of items of one padded caption length and image
    shape and puts the outputs back in order; a batch of one group is one call, as before."""

    def forward(
        self, x: list[torch.Tensor], t: torch.Tensor, cap_feats: list[torch.Tensor], return_dict: bool = False
    ) -> Any:
        assert not return_dict  # ZImage reads the tuple; vllm-omni's forward returns (samples, {}) only
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (xi, ci) in enumerate(zip(x, cap_feats, strict=True)):
            groups.setdefault((-(-ci.shape[0] // SEQ_MULTI_OF), *xi.shape), []).append(i)
        if len(groups) == 1:
            return self.inner(x, t, cap_feats)
        out: list[Any] = [None] * len(x)
        for idx in groups.values():
            ti = t if t.ndim == 0 else t[torch.tensor(idx, device=t.device)]
            samples = self.inner([x[i] for i in idx], ti, [cap_feats[i] for i in idx])[0]
            for i, sample in zip(idx, samples, strict=True):
                out[i] = sample
        return out, {}


def zimage_flow_model(pipeline: Any, model_kwargs: Mapping[str, Any] | None = None) -> ZImage:
    """fgrpo's ZImage on vllm-omni's ZImagePipeline modules: the Qwen3 causal LM (transformers' own class), its
    tokenizer, the VAE and vllm-omni's transformer."""
    t = pipeline.transformer
    return ZImage(
        cast(Any, OmniZImageTransformer(t, in_channels=int(t.in_channels))),
        pipeline.vae,
        pipeline.text_encoder,
        pipeline.tokenizer,
        scheduler_config=pipeline.scheduler.config,
        **(model_kwargs or {}),
    )


def as_flow_model(model: Any) -> FlowModel:
    """fgrpo's families are FlowModels (tests check it at runtime); pyright cannot tell, because it does not see
    diffusers' transformer classes (the families' `transformer` annotations) as nn.Modules."""
    return cast(FlowModel, model)


@dataclass(frozen=True)
class FamilyAdapter:
    """How one family runs on vllm-omni: the pipeline class of vllm-omni's to subclass, how its loaded modules
    become fgrpo's FlowModel of the family, and what differs at the boundary (output key, LoRA module names)."""

    kind: str
    """fgrpo's model.kind."""
    base_module: str
    base_class: str
    """vllm-omni's pipeline: `<base_module>.<base_class>`."""
    wrap: Callable[[Any, Mapping[str, Any]], Any]
    """(vllm-omni's pipeline, the family's model keywords) -> fgrpo's FlowModel on its modules."""
    output_key: str = "image"
    """The payload key vllm-omni's post-processing of this pipeline reads: 'image' ([B, 3, H, W]) or 'video'
    ([B, 3, F, H, W]), in [-1, 1]."""
    lora_renames: tuple[tuple[str, str], ...] = ()
    """(diffusers module name, vllm-omni's) where they differ; vllm-omni's LoRA loader knows only its own."""
    plain_kwargs: Callable[[Any], dict[str, Any]] = lambda params: {}
    """Model keywords of a request that is not fgrpo's (vllm-omni's warm-up), from its sampling params."""
    image_input: bool = False
    """The family edits a condition image: each request carries its file (prompt['multi_modal_data']['image'])."""
    request_arch: str | None = None
    """The vllm-omni architecture whose host-side request processing the engine runs (`Omni(model_class_name=...)`)
    when the checkpoint's own would reject fgrpo's requests or outputs; None: the checkpoint's (model_index.json's
    `_class_name`). vllm-omni 0.30 picks a request's pre-processing and the output's post-processing by this name
    alone; of the post-processors of fgrpo's families only Qwen-Image's reads the output envelope (payload['image']
    through its image processor, the trajectory passed on), the others take a bare tensor."""
    output_type: str = "pil"
    """The requests' `output_type`. 'latent' where it is the only way the family's post-processing passes the
    envelope on (Wan's returns its input unchanged for a 'latent' request); fgrpo's forward ignores the field."""

    @property
    def pipeline_class(self) -> str:
        return f"Fgrpo{self.base_class}"

    @property
    def qualname(self) -> str:
        return f"{__name__}.{self.pipeline_class}"


_MODELS = "vllm_omni.diffusion.models"
ADAPTERS: dict[str, FamilyAdapter] = {
    a.kind: a
    for a in (
        # vllm-omni names diffusers' attn.to_out.0 (a Linear in a ModuleList with a Dropout) `attn.to_out`
        FamilyAdapter(
            "qwen_image",
            f"{_MODELS}.qwen_image.pipeline_qwen_image",
            "QwenImagePipeline",
            flow_model,
            lora_renames=(("to_out.0", "to_out"),),
        ),
        # Qwen-Image-Edit: Qwen-Image's transformer (same LoRA names). vllm-omni's pre-processing of an Edit checkpoint
        # would resize each condition image to 1024² again and ship the pixels along, and its post-processing takes a
        # bare image tensor, not the output envelope that carries the trajectory: the engine runs Qwen-Image's request
        # processing instead (the envelope's reader), and fgrpo's model reads the condition image from its file
        FamilyAdapter(
            "qwen_image_edit",
            f"{_MODELS}.qwen_image.pipeline_qwen_image_edit",
            "QwenImageEditPipeline",
            edit_flow_model,
            lora_renames=(("to_out.0", "to_out"),),
            image_input=True,
            request_arch="QwenImagePipeline",
        ),
        # SD3, Z-Image and FLUX.2 [klein] / [dev]: their checkpoints' post-processing hands the output straight to an
        # image processor that takes a tensor only, and none of them has a pre-processing, nor has Qwen-Image; what
        # else vllm-omni 0.30 reads from the name (capability metadata, warm-up request) is the same or unused here
        # (klein's: reference images for the warm-up, which fgrpo's forward ignores), so they run Qwen-Image's.
        # vllm-omni's SD3 keeps to_out a ModuleList, so diffusers' names hold
        FamilyAdapter(
            "sd3",
            f"{_MODELS}.sd3.pipeline_sd3",
            "StableDiffusion3Pipeline",
            sd3_flow_model,
            request_arch="QwenImagePipeline",
        ),
        # Z-Image: to_out stays a ModuleList; to_q/k/v -> to_qkv and w1/w3 -> w13 are fused, and vllm-omni's LoRA
        # manager maps the diffusers names onto them (the transformer's stacked_params_mapping)
        FamilyAdapter(
            "zimage",
            f"{_MODELS}.z_image.pipeline_z_image",
            "ZImagePipeline",
            zimage_flow_model,
            request_arch="QwenImagePipeline",
        ),
        # FLUX.2: to_out of the joint blocks stays a ModuleList; to_q/k/v and add_q/k/v_proj fuse as Z-Image's do, and
        # the feed-forwards' linear_in (one Linear in diffusers, two output slices here) takes the LoRA's B split
        FamilyAdapter(
            "flux2",
            f"{_MODELS}.flux2_klein.pipeline_flux2_klein",
            "Flux2KleinPipeline",
            flux2_wrap("klein"),
            request_arch="QwenImagePipeline",
        ),
        FamilyAdapter(
            "flux2_dev",
            f"{_MODELS}.flux2.pipeline_flux2",
            "Flux2Pipeline",
            flux2_wrap("dev"),
            request_arch="QwenImagePipeline",
        ),
        # Wan keeps its checkpoint's name (WanPipeline: also its attention defaults and video output type); its
        # post-processing reads a video tensor's shape unless the request asks for latents, when it returns the
        # envelope as it is. Its pre-processing touches only image-to-video requests.
        # LoRA: to_out a Linear, and the feed-forward's net.0 / net.2 are attributes net_0 / net_2
        FamilyAdapter(
            "wan",
            f"{_MODELS}.wan2_2.pipeline_wan2_2",
            "Wan22Pipeline",
            wan_flow_model,
            output_key="video",
            output_type="latent",
            lora_renames=(
                ("to_out.0", "to_out"),
                ("ffn.net.0.proj", "ffn.net_0.proj"),
                ("ffn.net.2", "ffn.net_2"),
            ),
            plain_kwargs=wan_plain_kwargs,
        ),
    )
}
assert ADAPTERS["qwen_image"].qualname == PIPELINE_QUALNAME  # the name runs and tests already know


def request_info(prompt: Any) -> dict[str, Any]:
    """The fgrpo per-sample record of one vllm-omni prompt; a clear error if the caller did not set it."""
    info = prompt.get("additional_information", {}).get(INFO_KEY) if isinstance(prompt, dict) else None
    if info is None:
        raise ValueError(
            "fgrpo's vLLM-Omni pipeline needs prompt['additional_information']['fgrpo'] (seed, index); "
            "drive it through fgrpo.rollout.vllm_omni.VllmOmniEngine"
        )
    return info


def request_prompt(prompt: Any) -> str:
    """The prompt fgrpo's model encodes: the text, or with a condition image (multi_modal_data['image'], a file path)
    the ImagePrompt the caller's was."""
    image = (prompt.get("multi_modal_data") or {}).get(IMAGE_KEY)
    return ImagePrompt(prompt["prompt"], image) if isinstance(image, str) else prompt["prompt"]


def plain_prompts(prompts: Sequence[Any], height: int, width: int, image_dir: str | None) -> list[str]:
    """The prompts of a request that is not fgrpo's, for a family with a condition image: vllm-omni's own form gives
    the image as a path or a PIL image (written to `image_dir` for the model to read); its start-up warm-up of a
    non-edit architecture (request_arch) gives none, and gets the blank image vllm-omni's warm-up of the Edit
    pipeline would send."""
    from PIL import Image

    assert image_dir is not None
    out: list[str] = []
    for i, p in enumerate(prompts):
        text = p if isinstance(p, str) else (p.get("prompt") or "")
        image = None if isinstance(p, str) else (p.get("multi_modal_data") or {}).get(IMAGE_KEY)
        if isinstance(image, list):
            image = image[0]
        if not isinstance(image, str):
            path = Path(image_dir) / f"plain_{i}.png"
            (image if image is not None else Image.new("RGB", (width, height))).save(path)
            image = str(path)
        out.append(ImagePrompt(text, image))
    return out


def split_trajectory(
    traj: Trajectory, indices: Sequence[int], keep: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """One plain dict of CPU tensors per sample (what crosses vllm-omni's process boundary).

    Latents, log-probs, sigmas and conditioning travel in fp32 (masks as bool) and the pixels as uint8. keep: the
    optional fields (OPTIONAL_FIELDS) to send as well, each under its Trajectory name.
    """
    out = []
    for b, index in enumerate(indices):
        d: dict[str, Any] = {
            "index": int(index),
            "seed": int(traj.seeds[b]),
            "window": traj.window[b].cpu(),
            "timesteps": traj.sigmas.float().cpu(),  # vllm-omni also exposes this key as trajectory_timesteps
            "x_t": traj.x_t[b].float().cpu(),
            "x_next": traj.x_next[b].float().cpu(),
            "log_probs": traj.log_prob[b].float().cpu(),  # ... and this one as trajectory_log_probs
            PIXELS_KEY: traj.images[b].cpu(),
            "cond": {
                k: (v[b].float() if v.is_floating_point() else v[b]).cpu() for k, v in traj.cond.items()
            },
        }
        for name in keep:
            value = getattr(traj, name)
            assert value is not None, f"the in-process engine fills Trajectory.{name}"
            d[name] = value[b].float().cpu()
        out.append(d)
    return out


def merge_cond(per_sample: Sequence[Cond]) -> Cond:
    """Stack per-sample conditioning. Embeddings with a mask (Qwen-Image's text of different lengths): zero embeds
    and a False mask on the padding; any other key (pooled embeddings, fixed-length text) as it is."""
    out: Cond = {}
    paired: set[str] = set()
    for emb_key, mask_key in COND_PAIRS:
        if emb_key not in per_sample[0] or mask_key not in per_sample[0]:
            continue
        paired |= {emb_key, mask_key}
        L = max(c[emb_key].shape[0] for c in per_sample)
        pairs = [pad_to(c[emb_key][None], c[mask_key][None], L) for c in per_sample]
        out[emb_key] = torch.cat([e for e, _ in pairs])
        out[mask_key] = torch.cat([m for _, m in pairs]).bool()
    for k in per_sample[0]:
        if k not in paired:
            out[k] = torch.stack([c[k] for c in per_sample])
    return out


def plain_request(params: Any, prompts: Sequence[Any]) -> tuple[SamplingConfig, list[str], list[int]]:
    """A request that is not fgrpo's (vllm-omni's start-up warm-up, or a plain image request): ODE sampling.

    vllm-omni's own meaning of the fields: true_cfg_scale > 1 with a negative prompt turns CFG on.
    """
    texts = [p if isinstance(p, str) else (p.get("prompt") or "") for p in prompts]
    negative = next(
        (p.get("negative_prompt") for p in prompts if isinstance(p, dict) and p.get("negative_prompt")), None
    )
    scale = float(params.true_cfg_scale or 1.0)
    cfg = SamplingConfig(
        height=int(params.height or 512),
        width=int(params.width or 512),
        num_steps=int(params.num_inference_steps or 50),
        guidance_scale=scale if scale > 1.0 and negative is not None else 1.0,
        negative_prompt=negative,
        window_size=0,
        window_range=(0, 0),
        micro_batch=len(prompts),
    )
    return cfg, texts, [int(params.seed or 0)] * len(prompts)


def pixels_to_payload(images: torch.Tensor) -> torch.Tensor:
    """The in-process engine's uint8 pixels [B, ..., 3] as the [-1, 1] channel-first tensor vllm-omni's
    post-processing reads ([B, 3, H, W], a video [B, 3, F, H, W]); its uint8 conversion gives the pixels back."""
    return images.movedim(-1, 1).float() / 255 * 2 - 1


def run_batch(
    flow: FlowModel, prompts: Sequence[Any], cfg: SamplingConfig, keep: Sequence[str] = ()
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """One vllm-omni request batch through fgrpo's in-process engine.

    Returns the images for vllm-omni's post-processing (pixels_to_payload) and one trajectory per request, with
    the optional fields named in `keep`.
    """
    infos = [request_info(p) for p in prompts]
    texts = [request_prompt(p) for p in prompts]
    traj = DiffusersEngine(flow).generate(texts, [int(i["seed"]) for i in infos], cfg)
    return pixels_to_payload(traj.images), split_trajectory(traj, [int(i["index"]) for i in infos], keep)


def pipeline_forward(adapter: FamilyAdapter) -> Callable[[Any, Any], list[Any]]:
    """The `forward` of fgrpo's pipeline for `adapter`'s family (the same for every family)."""
    from vllm_omni.diffusion.data import DiffusionOutput  # pyright: ignore[reportMissingImports] - the optional `vllm` extra

    def forward(self: Any, req: Any) -> list[Any]:
        params = req.sampling_params_list[0]
        extra = params.extra_args or {}
        fgrpo_request = CFG_KEY in extra
        kwargs = dict(extra.get(MODEL_KEY) or {}) if fgrpo_request else adapter.plain_kwargs(params)
        key = json.dumps(kwargs, sort_keys=True)
        if self._fgrpo_flow is None or self._fgrpo_key != key:
            # built once per model keywords: its prompt cache then lives as long as the engine
            self._fgrpo_flow = as_flow_model(adapter.wrap(self, kwargs))
            self._fgrpo_key = key
        flow = self._fgrpo_flow
        if fgrpo_request:
            images, trajs = run_batch(
                flow, req.prompts, config_from_dict(extra[CFG_KEY]), extra.get(KEEP_KEY, ())
            )
            payloads = [{adapter.output_key: images[b : b + 1], TRAJ_KEY: t} for b, t in enumerate(trajs)]
        else:  # vllm-omni's start-up warm-up request (and any plain request): same model path, ODE
            cfg, texts, seeds = plain_request(params, req.prompts)
            if adapter.image_input:
                if self._fgrpo_images is None:  # removed with the pipeline, or when its process exits
                    self._fgrpo_images = tempfile.TemporaryDirectory(prefix="fgrpo-vllm-omni-images-")
                texts = plain_prompts(req.prompts, cfg.height, cfg.width, self._fgrpo_images.name)
            images = pixels_to_payload(DiffusersEngine(flow).generate(texts, seeds, cfg).images)
            payloads = [{adapter.output_key: images[b : b + 1]} for b in range(len(texts))]
        return [DiffusionOutput(output={"payload": p, "metadata": {}}, to_cpu=True) for p in payloads]

    return forward


_CLASSES: dict[str, type] = {}


def _build_pipeline(adapter: FamilyAdapter) -> type:
    """Subclass vllm-omni's pipeline of the family (imports vllm_omni; the worker process calls this)."""
    base: Any = getattr(importlib.import_module(adapter.base_module), adapter.base_class)
    return type(
        adapter.pipeline_class,
        (base,),
        {
            "__doc__": f"vllm-omni's {adapter.base_class} with fgrpo's rollout as `forward`.",
            "supports_request_batch": True,
            "supports_step_execution": False,  # fgrpo's loop runs whole requests; no per-step scheduling
            "_fgrpo_flow": None,
            "_fgrpo_key": None,
            "_fgrpo_images": None,
            "forward": pipeline_forward(adapter),
        },
    )


def _build_worker_extension() -> type:
    from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension  # pyright: ignore[reportMissingImports] - the optional `vllm` extra

    class FgrpoWorkerExtension(CustomPipelineWorkerExtension):
        """Adds full-weight sync to the diffusion worker (vllm-omni 0.30 has no weight-update RPC)."""

        model_runner: Any  # provided by the DiffusionWorker this extension is mixed into

        def fgrpo_load_transformer_weights(self, path: str) -> int:
            """Load a safetensors file of diffusers-named transformer weights into the live transformer.

            vllm-omni's `load_weights` maps diffusers names onto its fused layers (to_q/to_k/to_v -> to_qkv).
            """
            from safetensors.torch import load_file

            state = load_file(path)
            loaded = self.model_runner.pipeline.transformer.load_weights(state.items())
            return len(loaded)

    return FgrpoWorkerExtension


def _build_class(name: str) -> type:
    if name not in _CLASSES:
        if name == "FgrpoWorkerExtension":
            cls = _build_worker_extension()
        else:
            cls = _build_pipeline(next(a for a in ADAPTERS.values() if a.pipeline_class == name))
        # vllm resolves classes by "<module>.<qualname>"; make that name point here.
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__ = name
        _CLASSES[name] = cls
    return _CLASSES[name]


def __getattr__(name: str) -> type:
    if name == "FgrpoWorkerExtension" or any(a.pipeline_class == name for a in ADAPTERS.values()):
        return _build_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
