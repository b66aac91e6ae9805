"""The vLLM-Omni engine on the families beyond Qwen-Image (Qwen-Image-Edit, SD3.5, Z-Image, FLUX.2 [klein] and [dev],
Wan 2.2), against fakes of vLLM-Omni 0.30's pipelines of them.

The fakes hold the tiny random modules of fgrpo's builders behind what fgrpo touches of vllm-omni's classes (read
from vllm-omni 0.30.0's sources): `StableDiffusion3Pipeline` (transformer whose config fields are plain attributes
`patch_size`, `in_channels`, `joint_attention_dim`; `text_encoder`..`text_encoder_3`, `tokenizer`..`tokenizer_3`,
`vae`, `scheduler`), `ZImagePipeline` (transformer called positionally with no `return_dict`, returning
(samples, {}), `in_channels` an attribute; `text_encoder`, `tokenizer`, `vae`, `scheduler`), `Flux2KleinPipeline` and
`Flux2Pipeline` (transformer with diffusers' keywords and a config object of its own; [dev]'s text encoder vllm-omni's
Mistral encoder, keyword-only; `od_config.model`, whose model_index.json the adapter reads) and `Wan22Pipeline`
(`transformer`, `transformer_2` or None, each with a config object of its own; `text_encoder`, `tokenizer`, `vae`;
`od_config.model`, the checkpoint directory) and `QwenImageEditPipeline` (Qwen-Image's transformer, which takes
per-sample lists of image shapes, x_t's then the condition image's; `text_encoder`, `tokenizer`, `processor`, `vae`,
`scheduler`). The rest of the fake vLLM-Omni is test_vllm_omni.py's. The real vllm is
never imported.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_vllm_omni as base  # the fake vllm-omni surface of the Qwen-Image tests (tests/rollout on sys.path)
import torch
from PIL import Image
from test_vllm_omni import fake_vllm  # noqa: F401 - a fixture, used by name
from torch import nn

from fgrpo.config import SamplingConfig
from fgrpo.models import tiny
from fgrpo.models.base import FlowModel, ImagePrompt
from fgrpo.models.flux2 import Flux2
from fgrpo.models.qwen_image_edit import CONDITION_AREA, QwenImageEdit
from fgrpo.models.registry import FAMILIES, VLLM_OMNI_KINDS
from fgrpo.models.sd3 import SD3
from fgrpo.models.wan import Wan
from fgrpo.models.zimage import ZImage
from fgrpo.rollout import vllm_omni_pipeline as vop
from fgrpo.rollout.engine import DiffusersEngine

PROMPTS, SEEDS = base.PROMPTS, base.SEEDS


# ---------------------------------------------------------------------------------------------
# Fakes of vllm-omni 0.30's SD3 and Wan 2.2 pipelines
# ---------------------------------------------------------------------------------------------
class FakeOmniSD3Transformer(nn.Module):
    """vllm-omni's SD3Transformer2DModel: diffusers' keywords, its config fields as attributes, no `config`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        cfg: Any = inner.config
        self.patch_size, self.in_channels = cfg.patch_size, cfg.in_channels
        self.joint_attention_dim = cfg.joint_attention_dim

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, return_dict=True):
        assert not return_dict
        return self.inner(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            pooled_projections=pooled_projections,
            timestep=timestep,
            return_dict=False,
        )


class FakeStableDiffusion3Pipeline(nn.Module):
    def __init__(self, *, od_config: Any = None, prefix: str = ""):
        super().__init__()
        c = tiny.tiny_sd3_components(0)
        self.od_config = od_config
        self.transformer = FakeOmniSD3Transformer(c["transformer"])
        for k in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            setattr(self, k, c[k])
        self.tokenizer, self.tokenizer_2, self.tokenizer_3 = (
            c["tokenizer"],
            c["tokenizer_2"],
            c["tokenizer_3"],
        )
        self.scheduler = c["scheduler"]


class FakeOmniWanTransformer(nn.Module):
    """vllm-omni's WanTransformer3DModel: diffusers' keywords plus its own, a plain config object."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        cfg: Any = inner.config
        self.config = type(
            "Config", (), {"patch_size": tuple(cfg.patch_size), "in_channels": cfg.in_channels}
        )()

    def forward(
        self,
        hidden_states,
        timestep,
        encoder_hidden_states,
        encoder_hidden_states_image=None,
        intermediate_tensors=None,
        return_dict=True,
        attention_kwargs=None,
    ):
        assert not return_dict and encoder_hidden_states_image is None
        return self.inner(
            hidden_states=hidden_states,
            timestep=timestep,
            encoder_hidden_states=encoder_hidden_states,
            return_dict=False,
        )


class FakeWan22Pipeline(nn.Module):
    def __init__(self, *, od_config: Any = None, prefix: str = ""):
        super().__init__()
        self.od_config = od_config
        experts = (
            2 if json.loads((Path(od_config.model) / "model_index.json").read_text())["boundary_ratio"] else 1
        )
        c = tiny.tiny_wan_components(0, experts=experts)
        self.transformer = FakeOmniWanTransformer(c["transformer"])
        self.transformer_2 = (
            None if c["transformer_2"] is None else FakeOmniWanTransformer(c["transformer_2"])
        )
        self.vae, self.text_encoder, self.tokenizer = c["vae"], c["text_encoder"], c["tokenizer"]
        self.scheduler = types.SimpleNamespace(config={"flow_shift": 5.0})  # vllm-omni's own, unused by fgrpo


class FakeOmniZImageTransformer(nn.Module):
    """vllm-omni's ZImageTransformer2DModel: positional (latents, timestep, text) lists, no `return_dict`, output
    (samples, {}); `in_channels` and `dtype` plain attributes, no `config`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.in_channels = inner.config.in_channels  # pyright: ignore[reportAttributeAccessIssue]
        self.dtype = torch.float32
        self.calls: list[list[int]] = []

    def forward(self, x, t, cap_feats, patch_size=2, f_patch_size=1, ref_x=None, cap_feats_2=None):
        assert (patch_size, f_patch_size, ref_x, cap_feats_2) == (2, 1, None, None)
        # vllm-omni 0.30 masks no padding and rotates every item with item 0's positions: it is right only when the
        # captions pad to one length, and wrong without a word otherwise; the fake refuses such a batch instead
        padded = {-(-c.shape[0] // 32) for c in cap_feats}
        assert len(padded) == 1, f"captions of padded lengths {sorted(32 * n for n in padded)} in one call"
        self.calls.append([c.shape[0] for c in cap_feats])
        return self.inner(x, t, cap_feats, return_dict=False)[0], {}


class FakeZImagePipeline(nn.Module):
    supports_request_batch = False  # vllm-omni's; fgrpo's subclass batches requests

    def __init__(self, *, od_config: Any = None, prefix: str = ""):
        super().__init__()
        c = tiny.tiny_zimage_components(0)
        self.od_config = od_config
        self.transformer = FakeOmniZImageTransformer(c["transformer"])
        self.vae, self.text_encoder, self.tokenizer = c["vae"], c["text_encoder"], c["tokenizer"]
        self.scheduler = c["scheduler"]


class FakeOmniFlux2Transformer(nn.Module):
    """vllm-omni's Flux2Transformer2DModel (klein's and [dev]'s): diffusers' keywords, a plain config object."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        # vllm's parameters never require gradients; with them, torch's CPU kernels round [dev]'s guidance path
        # differently from the frozen in-process model's (3.6e-7), though it runs under inference_mode
        self.inner = inner.requires_grad_(False)
        cfg: Any = inner.config
        self.config = types.SimpleNamespace(
            patch_size=cfg.patch_size, in_channels=cfg.in_channels, guidance_embeds=cfg.guidance_embeds
        )

    def forward(
        self,
        hidden_states,
        encoder_hidden_states,
        timestep,
        img_ids,
        txt_ids,
        guidance=None,
        joint_attention_kwargs=None,
        return_dict=True,
    ):
        assert not return_dict
        return self.inner(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )


class FakeMistralEncoder(nn.Module):
    """vllm-omni's MistralEncoderModel: keyword call (input_ids, attention_mask, output_hidden_states, use_cache),
    an output with `hidden_states`; here around the tiny Mistral-3."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False, use_cache=False):
        out = self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=output_hidden_states,
            use_cache=use_cache,
        )
        return types.SimpleNamespace(hidden_states=out.hidden_states)


class FakeFlux2KleinPipeline(nn.Module):
    def __init__(self, *, od_config: Any = None, prefix: str = "", is_distilled: bool = False):
        super().__init__()
        c = tiny.tiny_flux2_components(0)
        self.od_config, self.is_distilled = od_config, is_distilled
        self.transformer = FakeOmniFlux2Transformer(c["transformer"])
        self.vae, self.text_encoder, self.tokenizer = c["vae"], c["text_encoder"], c["tokenizer"]
        self.scheduler = c["scheduler"]


class FakeFlux2Pipeline(nn.Module):
    def __init__(self, *, od_config: Any = None, prefix: str = ""):
        super().__init__()
        c = tiny.tiny_flux2_dev_components(0)
        self.od_config = od_config
        self.transformer = FakeOmniFlux2Transformer(c["transformer"])
        self.text_encoder = FakeMistralEncoder(c["text_encoder"])
        self.vae, self.tokenizer, self.scheduler = c["vae"], c["tokenizer"], c["scheduler"]


class FakeOmniEditTransformer(base.FakeOmniTransformer):
    """vllm-omni's QwenImageTransformer2DModel as QwenImageEditPipeline calls it: per sample a list of the images'
    (frames, h, w), x_t's then the condition image's, whose tokens fill the sequence; text RoPE sized by the padded
    text width."""

    def fills(self, shapes: list, seq_len: int) -> bool:
        return len(shapes) == 2 and sum(f * h * w for f, h, w in shapes) == seq_len

    def diffusers_shapes(self, img_shapes: list) -> list:
        return img_shapes  # diffusers' edit transformer takes the same per-sample lists


class FakeQwenImageEditPipeline(nn.Module):
    def __init__(self, *, od_config: Any = None, prefix: str = ""):
        super().__init__()
        c = tiny.tiny_qwen_image_edit_components(0)
        self.od_config = od_config
        self.transformer = FakeOmniEditTransformer(c["transformer"])
        self.vae, self.text_encoder, self.tokenizer = c["vae"], c["text_encoder"], c["tokenizer"]
        self.processor = None  # vllm-omni's own VL processor: the adapter builds fgrpo's from the checkpoint
        self.scheduler = c["scheduler"]


def edit_dir(root: Path) -> Path:
    """The `processor` folder of a diffusers Qwen-Image-Edit directory, which the adapter reads (the tiny edit model's
    image processor; the fake builds the other modules)."""
    tiny.tiny_qwen_image_edit_components(0)["processor"].image_processor.save_pretrained(root / "processor")
    return root


def edit_prompts(root: Path, texts=PROMPTS) -> list[str]:
    """One condition image file per prompt (all 64 x 48: one aspect ratio, as a batch needs)."""
    root.mkdir(parents=True, exist_ok=True)
    out: list[str] = []
    for i, text in enumerate(texts):
        image = Image.new("RGB", (64, 48), (30 + 50 * i, 180 - 40 * i, 90))
        image.paste((220, 40, 200), (6 * i, 8, 24 + 6 * i, 30))
        image.save(root / f"{i}.png")
        out.append(ImagePrompt(text, root / f"{i}.png"))
    return out


def flux2_dir(root: Path, kind: str, is_distilled: bool = False) -> Path:
    """The model_index.json of a diffusers FLUX.2 directory, which the adapter reads (the fake builds the modules)."""
    root.mkdir(parents=True, exist_ok=True)
    name = "Flux2Pipeline" if kind == "flux2_dev" else "Flux2KleinPipeline"
    (root / "model_index.json").write_text(json.dumps({"_class_name": name, "is_distilled": is_distilled}))
    return root


def wan_dir(root: Path, experts: int) -> Path:
    """The files of a diffusers Wan 2.2 directory that the adapter reads (the fake pipeline builds the modules)."""
    (root / "scheduler").mkdir(parents=True, exist_ok=True)
    index = {
        "_class_name": "WanPipeline",
        "boundary_ratio": tiny.TINY_WAN_BOUNDARY_RATIO if experts == 2 else None,
        "expand_timesteps": experts == 1,
    }
    (root / "model_index.json").write_text(json.dumps(index))
    sched = {"_class_name": "UniPCMultistepScheduler", "flow_shift": tiny.TINY_WAN_FLOW_SHIFT}
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(sched))
    return root


@pytest.fixture
def fake_families(fake_vllm, monkeypatch):  # noqa: F811 - the fixture imported above
    models = "vllm_omni.diffusion.models"
    mods = {
        f"{models}.qwen_image.pipeline_qwen_image_edit": base._module(
            f"{models}.qwen_image.pipeline_qwen_image_edit", QwenImageEditPipeline=FakeQwenImageEditPipeline
        ),
        f"{models}.sd3": base._module(f"{models}.sd3"),
        f"{models}.sd3.pipeline_sd3": base._module(
            f"{models}.sd3.pipeline_sd3", StableDiffusion3Pipeline=FakeStableDiffusion3Pipeline
        ),
        f"{models}.z_image": base._module(f"{models}.z_image"),
        f"{models}.z_image.pipeline_z_image": base._module(
            f"{models}.z_image.pipeline_z_image", ZImagePipeline=FakeZImagePipeline
        ),
        f"{models}.flux2_klein": base._module(f"{models}.flux2_klein"),
        f"{models}.flux2_klein.pipeline_flux2_klein": base._module(
            f"{models}.flux2_klein.pipeline_flux2_klein", Flux2KleinPipeline=FakeFlux2KleinPipeline
        ),
        f"{models}.flux2": base._module(f"{models}.flux2"),
        f"{models}.flux2.pipeline_flux2": base._module(
            f"{models}.flux2.pipeline_flux2", Flux2Pipeline=FakeFlux2Pipeline
        ),
        f"{models}.wan2_2": base._module(f"{models}.wan2_2"),
        f"{models}.wan2_2.pipeline_wan2_2": base._module(
            f"{models}.wan2_2.pipeline_wan2_2", Wan22Pipeline=FakeWan22Pipeline
        ),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return fake_vllm


# (kind, fake base, fgrpo's class, model keywords, sampling size, in-process reference builder, experts)
SD3_CASE = (
    "sd3",
    FakeStableDiffusion3Pipeline,
    SD3,
    {"max_sequence_length": tiny.T5_MAX_LENGTH_TINY},
    (32, 48),
    1,
)
WAN_KW = {"num_frames": tiny.TINY_WAN_FRAMES, "max_sequence_length": tiny.TINY_WAN_TEXT_LENGTH}
FLUX2_TINY_LAYERS = list(tiny.FLUX2_TEXT_LAYERS_TINY)  # the real checkpoints' (9, 18, 27) / (10, 20, 30)
EDIT_KW = {"condition_area": tiny.TINY_CONDITION_AREA}
CASES = {
    "qwen_image_edit": ("qwen_image_edit", FakeQwenImageEditPipeline, QwenImageEdit, EDIT_KW, (32, 48), 1),
    "sd3": SD3_CASE,
    "zimage": ("zimage", FakeZImagePipeline, ZImage, {}, (32, 48), 1),
    "flux2": (
        "flux2",
        FakeFlux2KleinPipeline,
        Flux2,
        {"max_sequence_length": tiny.FLUX2_TEXT_LENGTH_TINY, "text_layers": FLUX2_TINY_LAYERS},
        (32, 48),
        1,
    ),
    "flux2_dev": (
        "flux2_dev",
        FakeFlux2Pipeline,
        Flux2,
        {"max_sequence_length": tiny.FLUX2_DEV_TEXT_LENGTH_TINY, "text_layers": FLUX2_TINY_LAYERS},
        (32, 48),
        1,
    ),
    "wan_ti2v": ("wan", FakeWan22Pipeline, Wan, WAN_KW, (32, 64), 1),
    "wan_a14b": ("wan", FakeWan22Pipeline, Wan, WAN_KW, (32, 64), 2),
}


def index_dir(root: Path, class_name: str) -> Path:
    """A model_index.json naming the diffusers pipeline class, which vllm-omni reads the architecture name from."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    return root


# the architecture each family's released diffusers checkpoint names in its model_index.json
CHECKPOINT_ARCH = {
    "qwen_image_edit": "QwenImageEditPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "zimage": "ZImagePipeline",
    "flux2": "Flux2KleinPipeline",
    "flux2_dev": "Flux2Pipeline",
    "wan": "WanPipeline",
}


def _model_dir(case: str, tmp_path: Path) -> Path:
    kind, *_, experts = CASES[case]
    if kind == "wan":
        return wan_dir(tmp_path / "ckpt", experts)
    if kind == "qwen_image_edit":
        return edit_dir(index_dir(tmp_path / "ckpt", CHECKPOINT_ARCH[kind]))
    if kind.startswith("flux2"):
        return flux2_dir(tmp_path / "ckpt", kind)
    return index_dir(tmp_path / "ckpt", CHECKPOINT_ARCH[kind])


# the tiny builders of the families whose model keywords pass as they are (Wan's takes its expert count)
TINY = {
    "qwen_image_edit": tiny.tiny_qwen_image_edit,
    "sd3": tiny.tiny_sd3,
    "zimage": tiny.tiny_zimage,
    "flux2": tiny.tiny_flux2,
    "flux2_dev": tiny.tiny_flux2_dev,
}


def _reference(case: str, cfg: SamplingConfig, prompts=PROMPTS, seeds=SEEDS):
    """The in-process engine on the family's tiny model from the same seed: what the vLLM-Omni engine must give."""
    kind, _, _, kwargs, _, experts = CASES[case]
    model = tiny.tiny_wan(0, experts=experts, **kwargs) if kind == "wan" else TINY[kind](0, **kwargs)
    return DiffusersEngine(vop.as_flow_model(model)).generate(prompts, seeds, cfg)


def _cfg(case: str) -> SamplingConfig:
    h, w = CASES[case][4]
    return dataclasses.replace(base.CFG, height=h, width=w)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_wraps_the_loaded_modules_in_the_familys_model(fake_families, tmp_path, case):
    kind, fake, model_cls, kwargs, *_ = CASES[case]
    adapter = vop.ADAPTERS[kind]
    cls = getattr(vop, adapter.pipeline_class)
    assert issubclass(cls, fake) and cls.__qualname__ == adapter.pipeline_class == f"Fgrpo{fake.__name__[4:]}"
    assert cls.__module__ == vop.__name__ and cls.supports_request_batch and not cls.supports_step_execution
    pipeline = cls(od_config=types.SimpleNamespace(model=str(_model_dir(case, tmp_path))))
    flow: Any = adapter.wrap(pipeline, kwargs)
    assert isinstance(flow, model_cls) and isinstance(vop.as_flow_model(flow), FlowModel)
    assert flow.transformer.inner is pipeline.transformer  # shared, not copied: LoRA and weight sync reach it
    if kind == "sd3":
        assert (
            flow.clips == (pipeline.text_encoder, pipeline.text_encoder_2)
            and flow.t5 is pipeline.text_encoder_3
        )
    elif kind == "qwen_image_edit":  # fgrpo's VL processor over vllm-omni's tokenizer
        assert flow.text_encoder is pipeline.text_encoder and flow.vae is pipeline.vae
        assert (
            flow.processor.tokenizer is pipeline.tokenizer and flow.condition_area == tiny.TINY_CONDITION_AREA
        )
    elif kind in ("zimage", "flux2", "flux2_dev"):
        assert flow.text_encoder is pipeline.text_encoder and flow.tokenizer is pipeline.tokenizer
        assert flow.vae is pipeline.vae
        if kind == "flux2":  # klein base: true CFG, Qwen3's template (no system turn)
            assert not flow.is_distilled and flow.system_message is None and flow.cfg_forwards == 2
        if kind == "flux2_dev":  # [dev]: guidance embedded, its system turn from diffusers
            assert flow.guidance_embeds and flow.system_message and flow.cfg_forwards == 1
    else:
        assert flow.text_encoder is pipeline.text_encoder and flow.num_frames == tiny.TINY_WAN_FRAMES
        assert (flow.transformer_2 is None) == (CASES[case][-1] == 1)
        assert flow.transformer_2 is None or flow.transformer_2.inner is pipeline.transformer_2
        assert flow.expand_timesteps == (CASES[case][-1] == 1) and flow.flow_shift == tiny.TINY_WAN_FLOW_SHIFT


@pytest.mark.parametrize("case", list(CASES))
def test_generate_equals_the_in_process_engine(fake_families, tmp_path, case):
    """Worker batches of 2 = the reference's micro-batches of 2: the same forwards, bit for bit, with the optional
    fields the trainer asks for, through the host-side post-processing vllm-omni 0.30 runs for the engine's
    architecture name (the fake Omni's, written from the real functions)."""
    kind, _, _, kwargs, *_ = CASES[case]
    engine = fake_families.VllmOmniEngine(
        str(_model_dir(case, tmp_path)),
        kind=kind,
        model_kwargs=kwargs,
        max_batch=2,
        work_dir=tmp_path / "work",
        keep=("x0",),
    )
    assert base.FakeOmni.instances[-1].kwargs["custom_pipeline_args"] == {
        "pipeline_class": vop.ADAPTERS[kind].qualname
    }
    cfg = _cfg(case)
    prompts = edit_prompts(tmp_path / "cond") if kind == "qwen_image_edit" else PROMPTS
    got, want = engine.generate(prompts, SEEDS, cfg), _reference(case, cfg, prompts)
    base._assert_same(got, want, exact=True)
    assert got.x0 is not None and want.x0 is not None and torch.equal(got.x0, want.x0.float())
    assert got.images.shape == want.images.shape and got.images.dtype == torch.uint8
    # the post-processing that ran: Qwen-Image's for the image families, the checkpoint's own for Wan
    omni = base.FakeOmni.instances[-1]
    arch = "WanPipeline" if kind == "wan" else "QwenImagePipeline"
    assert omni.model_class_name == arch and omni.post_process is base.POST_PROCESS[arch]


def test_a_tiny_kind_runs_its_familys_adapter(fake_families, tmp_path):
    engine = fake_families.VllmOmniEngine(str(tmp_path), kind="tiny_sd3", work_dir=tmp_path / "w")
    assert engine.adapter is vop.ADAPTERS["sd3"]


def test_the_engine_refuses_a_family_without_an_adapter(fake_families, tmp_path):
    for kind in ("flux", "bagel", "tiny_flux", "ltx2"):
        with pytest.raises(
            ValueError,
            match=r"^rollout_engine='vllm_omni' supports model.kind in \('qwen_image', 'qwen_image_edit', 'sd3', "
            r"'zimage', 'flux2', 'flux2_dev', 'wan'\), got "
            f"'{kind}'; use --rollout-engine diffusers$",
        ):
            fake_families.VllmOmniEngine(str(tmp_path), kind=kind, work_dir=tmp_path / "w")
    assert not base.FakeOmni.instances  # refused before vllm-omni starts
    assert VLLM_OMNI_KINDS == tuple(vop.ADAPTERS)  # the config check and the engine agree


def test_edit_requests_carry_the_condition_image_and_run_qwen_images_request_processing(
    fake_families, tmp_path
):
    """Each request names its sample's condition image file where vllm-omni's edit requests carry an input image; the
    engine asks for Qwen-Image's host-side request processing (the Edit checkpoint's post-processing would reject the
    output envelope); a request without fgrpo's fields (vllm-omni's warm-up: no image) samples with a blank one."""
    from fgrpo.rollout.vllm_omni import build_requests

    prompts = edit_prompts(tmp_path / "cond")
    requests, _ = build_requests(prompts, SEEDS, _cfg("qwen_image_edit"))
    assert [r["multi_modal_data"] for r in requests] == [
        {"image": str(tmp_path / "cond" / f"{i}.png")} for i in range(4)
    ]
    assert [r["prompt"] for r in requests] == PROMPTS and all(type(r["prompt"]) is str for r in requests)
    assert all("multi_modal_data" not in r for r in build_requests(PROMPTS, SEEDS, _cfg("sd3"))[0])
    fake_families.VllmOmniEngine(
        str(edit_dir(tmp_path / "ckpt")),
        kind="qwen_image_edit",
        model_kwargs=EDIT_KW,
        work_dir=tmp_path / "w",
    )
    omni = base.FakeOmni.instances[-1]
    assert omni.kwargs["model_class_name"] == "QwenImagePipeline"
    warmup = base.FakeSamplingParams(height=32, width=48, num_inference_steps=2, seed=0)
    (out,) = omni.pipeline.forward(base.FakeRequestBatch([base.FakeRequest("dummy run", warmup)]))
    folder = Path(omni.pipeline._fgrpo_images.name)
    blank = ImagePrompt("dummy run", folder / "plain_0.png")
    assert Image.open(blank.image).size == (48, 32) and not Image.open(blank.image).getbbox()  # all black
    cfg = dataclasses.replace(_cfg("qwen_image_edit"), num_steps=2, window_size=0, window_range=(0, 0))
    cfg = dataclasses.replace(cfg, guidance_scale=1.0, negative_prompt=None, micro_batch=1)
    # a plain request has no model keywords: the pipeline's condition area (1024²), not the tiny model's
    reference = tiny.tiny_qwen_image_edit(0, condition_area=CONDITION_AREA)
    want = DiffusersEngine(vop.as_flow_model(reference)).generate([blank], [0], cfg)
    assert torch.equal(out.output["payload"]["image"], vop.pixels_to_payload(want.images))
    omni.pipeline = omni.worker.model_runner.pipeline = None  # the fake engine's references to it
    gc.collect()
    assert not folder.exists()  # the blank images go with the pipeline, not left in the temporary folder


def test_wan_lora_names_and_the_two_expert_refusal(fake_families, tmp_path):
    from fgrpo.rollout.vllm_omni import vllm_omni_lora_names

    a = torch.randn(2, 8)
    state = {
        f"base_model.model.blocks.0.{m}.lora_A.weight": a
        for m in ("attn1.to_out.0", "attn2.to_q", "ffn.net.0.proj", "ffn.net.2")
    }
    cfg = {
        "r": 2,
        "lora_alpha": 4,
        "target_modules": ["attn1.to_out.0", "to_q", "ffn.net.0.proj", "ffn.net.2"],
    }
    renamed, new_cfg = vllm_omni_lora_names(state, cfg, vop.ADAPTERS["wan"].lora_renames)
    assert sorted(renamed) == [
        f"base_model.model.blocks.0.{m}.lora_A.weight"
        for m in ("attn1.to_out", "attn2.to_q", "ffn.net_0.proj", "ffn.net_2")
    ]
    assert new_cfg["target_modules"] == ["attn1.to_out", "ffn.net_0.proj", "ffn.net_2", "to_q"]
    one = fake_families.VllmOmniEngine(
        str(wan_dir(tmp_path / "ti2v", 1)), kind="wan", model_kwargs=WAN_KW, work_dir=tmp_path / "a"
    )
    assert one.update_lora(state, cfg).lora_int_id == 1
    two = fake_families.VllmOmniEngine(
        str(wan_dir(tmp_path / "a14b", 2)), kind="wan", model_kwargs=WAN_KW, work_dir=tmp_path / "b"
    )
    with pytest.raises(ValueError, match="two-expert Wan"):
        two.update_lora(state, cfg)
    with pytest.raises(ValueError, match=r"no readable model_index.json .* pass a local diffusers Wan 2.2"):
        fake_families.VllmOmniEngine(str(tmp_path / "none"), kind="wan", work_dir=tmp_path / "c")


# vllm-omni 0.30's LoRA-capable Linear layers of each transformer (block indices as "*"), read from its sources, and
# its fused layers' parts (the transformer's stacked_params_mapping, from which its LoRA manager maps a diffusers
# LoRA's per-part names onto the fused layer).
def _zimage_linears() -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for blocks in ("noise_refiner", "context_refiner", "layers"):
        out |= {
            f"{blocks}.*.attention.to_qkv": ("to_q", "to_k", "to_v"),
            f"{blocks}.*.attention.to_out.0": (),
            f"{blocks}.*.feed_forward.w13": ("w1", "w3"),
            f"{blocks}.*.feed_forward.w2": (),
        }
    return out


FLUX2_LINEARS = {
    "transformer_blocks.*.attn.to_qkv": ("to_q", "to_k", "to_v"),
    "transformer_blocks.*.attn.add_kv_proj": ("add_q_proj", "add_k_proj", "add_v_proj"),
    "transformer_blocks.*.attn.to_out.0": (),
    "transformer_blocks.*.attn.to_add_out": (),
    # linear_in: two output slices (SwiGLU's halves), one module in diffusers; the LoRA's B is split between them
    **{
        f"transformer_blocks.*.{ff}.{m}": ()
        for ff in ("ff", "ff_context")
        for m in ("linear_in", "linear_out")
    },
    "single_transformer_blocks.*.attn.to_qkv_mlp_proj": (),
    "single_transformer_blocks.*.attn.to_out": (),
}
# Qwen-Image's transformer (Qwen-Image-Edit's too): the joint block's fused q/k/v of each stream, the output projections
# as Linears (to_out not a ModuleList), the feed-forwards' net.0.proj and net.2 (net.1 a placeholder)
QWEN_IMAGE_LINEARS = {
    "transformer_blocks.*.attn.to_qkv": ("to_q", "to_k", "to_v"),
    "transformer_blocks.*.attn.add_kv_proj": ("add_q_proj", "add_k_proj", "add_v_proj"),
    "transformer_blocks.*.attn.to_out": (),
    "transformer_blocks.*.attn.to_add_out": (),
    **{
        f"transformer_blocks.*.{mlp}.{m}": ()
        for mlp in ("img_mlp", "txt_mlp")
        for m in ("net.0.proj", "net.2")
    },
}
OMNI_LINEARS = {
    "qwen_image_edit": QWEN_IMAGE_LINEARS,
    "zimage": _zimage_linears(),
    "flux2": FLUX2_LINEARS,
    "flux2_dev": FLUX2_LINEARS,
}


def _omni_accepts(kind: str, module: str) -> bool:
    """Whether vllm-omni's LoRA manager binds a LoRA on `module` (a transformer-relative name): one of its Linear
    layers, or a part of a fused one."""
    linears = OMNI_LINEARS[kind]
    stack, _, rest = module.partition(".")
    name = f"{stack}.*.{rest.partition('.')[2]}"  # the block index, not to_out's ".0"
    prefix, _, leaf = name.rpartition(".")
    return name in linears or any(
        fused.rpartition(".")[0] == prefix and leaf in parts for fused, parts in linears.items()
    )


@pytest.mark.parametrize("kind", ["qwen_image_edit", "zimage", "flux2", "flux2_dev"])
def test_lora_renames_map_every_trained_module(fake_families, kind):
    """fgrpo's LoRA on the family's tiny transformer (its recipe's targets), renamed by the adapter, lands on
    vllm-omni's layers only: none of its modules is left without a counterpart."""
    from fgrpo.models.lora import add_lora, lora_state_dict
    from fgrpo.rollout.vllm_omni import vllm_omni_lora_names

    targets = FAMILIES[kind].lora_targets
    transformer: Any = vop.as_flow_model(TINY[kind](0)).transformer
    add_lora(transformer, rank=2, alpha=4, target_modules=targets)
    state = lora_state_dict(transformer)
    cfg = {"r": 2, "lora_alpha": 4, "target_modules": list(targets)}
    renamed, new_cfg = vllm_omni_lora_names(state, cfg, vop.ADAPTERS[kind].lora_renames)
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in renamed})
    assert len(renamed) == len(state) and len(modules) == len(state) // 2
    assert {m.split(".")[0] for m in modules} == {b.split(".")[0] for b in OMNI_LINEARS[kind]}  # every stack
    assert [m for m in modules if not _omni_accepts(kind, m)] == []
    leaves = {n.rpartition(".")[2] for n in OMNI_LINEARS[kind]} | {
        p for v in OMNI_LINEARS[kind].values() for p in v
    }
    assert {t.rpartition(".")[2] for t in new_cfg["target_modules"]} <= leaves  # vllm's expected module check


def test_the_fakes_post_processing_follows_vllm_omnis(fake_vllm):  # noqa: F811 - the fixture imported above
    """What the fix rests on, as the fake Omni models it from vllm-omni 0.30's functions: the tensor-only image
    post-processors refuse the output envelope, Qwen-Image's keeps its trajectory and converts its image, Wan's
    reads a video's shape unless the request asks for latents."""
    image = torch.tensor([[[[-1.0, 1.0]], [[0.0, 1.0]], [[1.0, -1.0]]]])  # [1, 3, 1, 2]
    envelope = {"payload": {"image": image, "trajectory": {"index": 0}}, "metadata": {}}
    for arch in ("QwenImageEditPipeline", "StableDiffusion3Pipeline", "ZImagePipeline", "Flux2Pipeline"):
        with pytest.raises(ValueError, match="takes a torch.Tensor, got dict"):
            base.POST_PROCESS[arch](envelope)
    out = base.format_output("r", base.POST_PROCESS["QwenImagePipeline"](envelope))
    assert out.multimodal_output == {"trajectory": {"index": 0}}
    # (-1, 0, 1) -> (0, 127.5, 255) -> rounded to even: 128 for 127.5
    assert [np.asarray(p).tolist() for p in out.images] == [[[[0, 128, 255], [255, 255, 0]]]]
    video = {"payload": {"video": image[:, :, None], "trajectory": {"index": 1}}, "metadata": {}}
    latent, pil = base.FakeSamplingParams(output_type="latent"), base.FakeSamplingParams(output_type="pil")
    assert base.POST_PROCESS["WanPipeline"](video, sampling_params=latent) is video
    with pytest.raises(AttributeError, match="shape"):
        base.POST_PROCESS["WanPipeline"](video, sampling_params=pil)
    assert base.format_output("r", video).multimodal_output == {"trajectory": {"index": 1}}


@pytest.mark.parametrize("case", ["qwen_image_edit", "sd3", "zimage", "flux2", "flux2_dev", "wan_ti2v"])
def test_the_checkpoints_own_post_processing_would_refuse_the_envelope(
    fake_families, tmp_path, monkeypatch, case
):
    """Without the adapter's request_arch / output_type, vllm-omni 0.30 would post-process with the checkpoint's
    function, which refuses the envelope that carries the trajectory."""
    kind, _, _, kwargs, *_ = CASES[case]
    adapter = vop.ADAPTERS[kind]
    plain = dataclasses.replace(adapter, request_arch=None, output_type="pil")
    assert plain != adapter  # the fix is one of the two fields
    monkeypatch.setitem(vop.ADAPTERS, kind, plain)
    engine = fake_families.VllmOmniEngine(
        str(_model_dir(case, tmp_path)), kind=kind, model_kwargs=kwargs, max_batch=2, work_dir=tmp_path / "w"
    )
    assert base.FakeOmni.instances[-1].model_class_name == CHECKPOINT_ARCH[kind]
    prompts = edit_prompts(tmp_path / "cond") if kind == "qwen_image_edit" else PROMPTS
    cfg = dataclasses.replace(_cfg(case), num_steps=2, window_range=(0, 2))
    error = AttributeError if kind == "wan" else ValueError
    with pytest.raises(error, match="shape" if kind == "wan" else "takes a torch.Tensor, got dict"):
        engine.generate(prompts[:2], SEEDS[:2], cfg)


def test_zimage_calls_vllm_omnis_transformer_once_per_padded_caption_length():
    """A CFG batch mixes caption lengths; vllm-omni's Z-Image transformer is right only for one padded length a
    call (the fake refuses more). The wrapper groups the items and restores their order: each output equals the
    diffusers transformer's on the whole batch (which masks the padding), and a batch of one group is one call."""
    c = tiny.tiny_zimage_components(0)
    model = c["transformer"]
    fake = FakeOmniZImageTransformer(model)
    wrapper = vop.OmniZImageTransformer(fake, in_channels=fake.in_channels)
    gen = torch.Generator().manual_seed(0)
    lengths = [10, 40, 20, 33]  # pad to 32, 64, 32, 64
    x = [torch.randn(4, 1, 8, 8, generator=gen) for _ in lengths]
    t = torch.tensor([0.1, 0.2, 0.3, 0.4])
    caps = [torch.randn(n, model.config.cap_feat_dim, generator=gen) for n in lengths]
    with torch.no_grad():
        got, extra = wrapper(x, t, caps)
        want = model(x, t, caps, return_dict=False)[0]
        alone = [model([x[i]], t[i : i + 1], [caps[i]], return_dict=False)[0][0] for i in range(4)]
    assert extra == {} and fake.calls == [[10, 20], [40, 33]]
    for g, w, a in zip(got, want, alone, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g, a, rtol=1e-5, atol=1e-5)
    fake.calls.clear()
    with torch.no_grad():
        same = wrapper(x[::2], t[::2], caps[::2])[0]
    assert fake.calls == [[10, 20]] and all(torch.equal(a, b) for a, b in zip(same, got[::2], strict=True))
    with pytest.raises(AssertionError, match="padded lengths"):
        fake(x, t, caps)  # the premise: the whole batch at once is refused
