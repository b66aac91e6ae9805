"""The vLLM-Omni engine against fake vllm / vllm_omni modules that follow the 0.30 interfaces.

The fakes mirror what fgrpo touches in the real packages (read from vllm-omni 0.30.0's sources):
`vllm_omni.__version__`, `vllm_omni.entrypoints.omni.Omni(**kwargs)` with `generate(prompts, sampling_params, *,
use_tqdm)` and `engine.collective_rpc(method, args=, kwargs=)`, `OmniDiffusionSamplingParams`,
`OmniTextPrompt` (a TypedDict), `DiffusionOutput(output=, to_cpu=)`, `DiffusionRequestBatch`, `QwenImagePipeline` (transformer with vllm-omni's forward
signature incl. `txt_seq_lens`, `encode_prompt`, `_decode_latents`, `scheduler.config`,
`vae_scale_factor`), `CustomPipelineWorkerExtension`, and `vllm.lora.request.LoRARequest`. The fake
Omni resolves the pipeline class by its qualified name, runs `forward` on request batches of
`max_num_seqs` under `inference_mode`, runs on each output the host-side post-processing that 0.30's registry picks
for the architecture name (the `model_class_name` passed, else the checkpoint's model_index.json `_class_name`),
written from the real functions (the tensor-only ones refuse the output envelope), formats the result as 0.30's
engine does (the payload's 'trajectory' into `multimodal_output`) and returns outputs in a shuffled order, as the
real one may. The real vllm is never imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import random
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from PIL import Image
from torch import nn

from fgrpo import algorithms
from fgrpo.config import GRPOConfig, SamplingConfig
from fgrpo.models.tiny import save_tiny_qwen_image, tiny_qwen_image, tiny_qwen_image_components
from fgrpo.recompute import recompute_log_probs
from fgrpo.rollout import vllm_omni_pipeline as vop
from fgrpo.rollout.engine import DiffusersEngine

CFG = SamplingConfig(
    height=32,
    width=48,
    num_steps=4,
    guidance_scale=2.5,
    negative_prompt=" ",
    sde_kind="flow_sde",
    noise_level=0.7,
    window_size=2,
    window_range=(0, 4),
    micro_batch=2,
)
PROMPTS = ['a sign that says "hi"', "a cat", 'a red square on a blue background that says "OPEN"', "a cat"]
SEEDS = [11, 12, 13, 12]


# ---------------------------------------------------------------------------------------------
# Fakes of the vllm-omni 0.30 surface
# ---------------------------------------------------------------------------------------------
class FakeOmniTransformer(nn.Module):
    """vllm-omni's QwenImageTransformer2DModel call signature around the tiny diffusers transformer.

    Same numbers as diffusers' (so the engine can be compared with the in-process one exactly), but the
    arguments only vllm-omni's version needs are required and checked.
    """

    def __init__(self, inner: QwenImageTransformer2DModel):
        super().__init__()
        self.inner = inner
        self.in_channels = inner.config.in_channels  # pyright: ignore[reportAttributeAccessIssue] - a FrozenDict: keys are attributes

    def forward(
        self,
        hidden_states,
        encoder_hidden_states=None,
        encoder_hidden_states_mask=None,
        timestep=None,
        img_shapes=None,
        txt_seq_lens=None,
        guidance=None,
        attention_kwargs=None,
        return_dict=True,
    ):
        B, S, _ = hidden_states.shape
        assert img_shapes is not None and encoder_hidden_states is not None  # required here (see above)
        assert len(img_shapes) == B and all(isinstance(s, list) and self.fills(s, S) for s in img_shapes)
        # vllm-omni: text RoPE sized by the padded text width
        assert txt_seq_lens == [encoder_hidden_states.shape[1]] * B
        return self.inner(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            encoder_hidden_states_mask=encoder_hidden_states_mask,
            timestep=timestep,
            img_shapes=self.diffusers_shapes(img_shapes),
            return_dict=False,
        )

    def fills(self, shapes: list, seq_len: int) -> bool:
        """One sample's list of (frames, h, w): x_t's, whose tokens are the whole sequence."""
        return shapes[0][1] * shapes[0][2] == seq_len

    def diffusers_shapes(self, img_shapes: list) -> list:
        """diffusers' text-to-image transformer takes one (frames, h, w) per sample."""
        return [s[0] for s in img_shapes]

    def load_weights(self, weights):
        params = dict(self.inner.named_parameters())
        names = set()
        for name, t in weights:
            params[name].data.copy_(t)
            names.add(name)
        return names


class FakeQwenImagePipeline(nn.Module):
    """What fgrpo uses of vllm-omni's QwenImagePipeline, holding the tiny random Qwen-Image modules."""

    supports_request_batch = True
    supports_step_execution = True

    def __init__(self, *, od_config: Any = None, prefix: str = ""):
        super().__init__()
        c = tiny_qwen_image_components(0)
        self.od_config = od_config
        self.transformer = FakeOmniTransformer(c["transformer"])
        self.vae = c["vae"]
        self.text_encoder = c["text_encoder"]
        self.tokenizer = c["tokenizer"]
        self.scheduler = c["scheduler"]
        self.device = torch.device("cpu")


@dataclass
class FakeDiffusionOutput:
    output: Any = None
    to_cpu: bool = False
    error: str | None = None


class FakeCustomPipelineWorkerExtension:
    def re_init_pipeline(self, custom_pipeline_args):  # pragma: no cover - interface only
        raise NotImplementedError


@dataclass
class FakeSamplingParams:
    """The OmniDiffusionSamplingParams fields fgrpo sets (same names and defaults as 0.30)."""

    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    true_cfg_scale: float | None = None
    seed: int | None = None
    output_type: str | None = None
    lora_request: Any = None
    lora_scale: float = 1.0
    extra_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        assert self.lora_path, "lora_path cannot be empty"


@dataclass
class FakeRequest:
    prompt: Any
    sampling_params: Any


class FakeRequestBatch:
    def __init__(self, requests):
        self.requests = requests

    @property
    def prompts(self):
        return [r.prompt for r in self.requests]

    @property
    def sampling_params_list(self):
        return [r.sampling_params for r in self.requests]


@dataclass
class FakeRequestOutput:
    request_id: str
    images: list
    multimodal_output: dict
    error: str | None = None


class FakeEngine:
    def __init__(self, owner):
        self.owner = owner
        self.rpc_results: dict[str, Any] = {}

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, stage_ids=None):
        self.owner.log.append(("rpc", method, args, kwargs))
        if method in self.rpc_results:
            return [self.rpc_results[method]]
        if method == "fgrpo_load_transformer_weights":
            return [self.owner.worker.fgrpo_load_transformer_weights(*args)]
        return [True]


def image_to_pil(images: Any) -> list[Image.Image]:
    """diffusers' VaeImageProcessor.postprocess as vllm-omni 0.30's image post-processors call it: a [B, 3, H, W]
    tensor in [-1, 1] becomes B PIL images; anything but a tensor is refused with a ValueError."""
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"the image processor takes a torch.Tensor, got {type(images).__name__}")
    pixels = ((images.permute(0, 2, 3, 1) / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return [Image.fromarray(p.numpy()) for p in pixels]


def qwen_image_post_process(images: Any) -> Any:
    """Qwen-Image's (pipeline_qwen_image.py:76-90): an output envelope keeps its payload, whose 'image' goes through
    the image processor; anything else goes through the image processor as it is."""
    if isinstance(images, dict) and isinstance(images.get("payload"), dict):
        payload = dict(images["payload"])
        if payload.get("image") is None:
            raise ValueError("Qwen-Image's post-processing needs payload['image']")
        payload["image"] = image_to_pil(payload["image"])
        return {"payload": payload, "metadata": images.get("metadata") or {}}
    return image_to_pil(images)


def wan_post_process(video: Any, sampling_params: Any = None) -> Any:
    """Wan 2.2's (pipeline_wan2_2.py:271-294, no frame interpolation or MP4 pre-encoding): a 'latent' request's output
    comes back as it is; any other is a [B, 3, F, H, W] video tensor, whose shape diffusers' VideoProcessor reads
    (a dict has none: AttributeError), each sample a list of frames."""
    if sampling_params is not None and sampling_params.output_type == "latent":
        return video
    frames = [image_to_pil(video[b].permute(1, 0, 2, 3)) for b in range(video.shape[0])]
    return {"payload": {"video": frames}, "metadata": {}}


# The post-processing vllm-omni 0.30 runs on the host for an architecture name (registry.py:634-704, the names of
# fgrpo's families); a name not listed has none (registry.py:849-857). SD3's and FLUX.2 [dev]'s return their input
# when the engine (not a request) was built with output_type='latent', which fgrpo never does.
POST_PROCESS: dict[str, Any] = {
    "QwenImagePipeline": qwen_image_post_process,
    "QwenImageEditPipeline": image_to_pil,
    "StableDiffusion3Pipeline": image_to_pil,
    "ZImagePipeline": image_to_pil,
    "Flux2KleinPipeline": image_to_pil,
    "Flux2Pipeline": image_to_pil,
    "WanPipeline": wan_post_process,
}


def format_output(request_id: str, data: Any) -> FakeRequestOutput:
    """The engine's formatting of a post-processed output (output_formatter.py:41-80, 256-270, 339-355): an envelope's
    payload or a plain dict as it is, anything else as payload {'output': ...}; the primary payload ('video', 'image',
    else 'output') becomes the images, and a payload 'trajectory' the multimodal output's."""
    if isinstance(data, dict) and isinstance(data.get("payload"), dict):
        payload = data["payload"]
    elif isinstance(data, dict):
        payload = data
    else:
        payload = {"output": data}
    primary = next((payload[k] for k in ("video", "image", "output") if k in payload), [])
    images = primary if isinstance(primary, list) else [primary]
    extra = {k: v for k, v in payload.items() if k in ("audio", "actions", "trajectory")}
    return FakeRequestOutput(request_id, images, extra)


class FakeOmni:
    instances: list[FakeOmni] = []

    def __init__(self, model: str, **kwargs):
        self.model = model
        self.kwargs = kwargs
        self.log: list[tuple] = []
        self.engine = FakeEngine(self)
        name = kwargs["custom_pipeline_args"]["pipeline_class"]
        module, qual = name.rsplit(".", 1)  # what vllm's resolve_obj_by_qualname does
        od_config = types.SimpleNamespace(model=model)  # the real one's, of which pipelines read `model`
        self.pipeline = getattr(importlib.import_module(module), qual)(od_config=od_config)
        # the architecture name: the caller's model_class_name, else the checkpoint's model_index.json _class_name
        # (OmniDiffusionConfig.enrich_config, data.py:1580-1581); the custom pipeline class plays no part in it
        self.model_class_name = kwargs.get("model_class_name") or self._index_class_name(model)
        self.post_process = POST_PROCESS.get(self.model_class_name or "")
        ext_name = kwargs["worker_extension_cls"]
        ext = getattr(importlib.import_module(ext_name.rsplit(".", 1)[0]), ext_name.rsplit(".", 1)[1])
        self.worker = ext()
        self.worker.model_runner = types.SimpleNamespace(pipeline=self.pipeline)
        self.closed = False
        FakeOmni.instances.append(self)

    def generate(self, prompts, sampling_params_list=None, *, py_generator=False, use_tqdm=True):
        assert sampling_params_list is not None  # fgrpo passes one
        self.log.append(("generate", sampling_params_list.lora_request))
        requests = [FakeRequest(dict(p), dataclasses.replace(sampling_params_list)) for p in prompts]
        step = self.kwargs["max_num_seqs"]
        outs = []
        with torch.inference_mode():
            for s in range(0, len(requests), step):
                batch = FakeRequestBatch(requests[s : s + step])
                for j, (o, r) in enumerate(zip(self.pipeline.forward(batch), batch.requests)):
                    data = o.output
                    if self.post_process is wan_post_process:  # the one that takes the request's params
                        data = wan_post_process(data, sampling_params=r.sampling_params)
                    elif self.post_process is not None:
                        data = self.post_process(data)
                    outs.append(format_output(f"{s + j}_x", data))
        random.Random(len(outs)).shuffle(outs)
        return outs

    @staticmethod
    def _index_class_name(model: str) -> str | None:
        try:
            return json.loads((Path(model) / "model_index.json").read_text()).get("_class_name")
        except (OSError, ValueError):
            return None

    def close(self):
        self.closed = True


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


@pytest.fixture
def fake_vllm(monkeypatch):
    mods = {
        "vllm": _module("vllm", __version__="0.30.0"),
        "vllm.lora": _module("vllm.lora"),
        "vllm.lora.request": _module("vllm.lora.request", LoRARequest=FakeLoRARequest),
        "vllm_omni": _module("vllm_omni", __version__="0.30.0", Omni=FakeOmni),
        "vllm_omni.inputs": _module("vllm_omni.inputs"),
        "vllm_omni.inputs.data": _module(
            "vllm_omni.inputs.data", OmniDiffusionSamplingParams=FakeSamplingParams, OmniTextPrompt=dict
        ),
        "vllm_omni.entrypoints": _module("vllm_omni.entrypoints"),
        "vllm_omni.entrypoints.omni": _module("vllm_omni.entrypoints.omni", Omni=FakeOmni),
        "vllm_omni.diffusion": _module("vllm_omni.diffusion"),
        "vllm_omni.diffusion.data": _module("vllm_omni.diffusion.data", DiffusionOutput=FakeDiffusionOutput),
        "vllm_omni.diffusion.models": _module("vllm_omni.diffusion.models"),
        "vllm_omni.diffusion.models.qwen_image": _module("vllm_omni.diffusion.models.qwen_image"),
        "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image": _module(
            "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image",
            QwenImagePipeline=FakeQwenImagePipeline,
        ),
        "vllm_omni.diffusion.worker": _module("vllm_omni.diffusion.worker"),
        "vllm_omni.diffusion.worker.diffusion_worker": _module(
            "vllm_omni.diffusion.worker.diffusion_worker",
            CustomPipelineWorkerExtension=FakeCustomPipelineWorkerExtension,
        ),
        "vllm_omni.diffusion.worker.request_batch": _module(
            "vllm_omni.diffusion.worker.request_batch", DiffusionRequestBatch=FakeRequestBatch
        ),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(vop, "_CLASSES", {})  # classes are built against whichever base is installed
    FakeOmni.instances.clear()
    from fgrpo.rollout import vllm_omni

    return vllm_omni


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_qwen_image(tmp_path_factory.mktemp("tiny_qwen_image"), seed=0)


@pytest.fixture
def engine(fake_vllm, tiny_dir, tmp_path):
    return fake_vllm.VllmOmniEngine(str(tiny_dir), max_batch=2, enable_sleep_mode=True, work_dir=tmp_path)


def _reference(cfg: SamplingConfig = CFG, prompts=PROMPTS, seeds=SEEDS, model=None):
    """The in-process engine on the same tiny weights: what the vLLM-Omni engine must reproduce."""
    return DiffusersEngine(model or tiny_qwen_image(0)).generate(prompts, seeds, cfg)


# ---------------------------------------------------------------------------------------------
# Errors: missing extra, wrong version, bad input
# ---------------------------------------------------------------------------------------------
def test_missing_extra_is_a_clear_error(monkeypatch):
    from fgrpo.rollout import vllm_omni

    monkeypatch.setitem(sys.modules, "vllm_omni", None)  # makes `import vllm_omni` raise ImportError
    with pytest.raises(vllm_omni.VllmOmniUnavailable, match="uv sync --extra vllm"):
        vllm_omni.VllmOmniEngine("/models/tiny")


def test_wrong_version_is_a_clear_error(fake_vllm, monkeypatch, tmp_path):
    monkeypatch.setattr(sys.modules["vllm_omni"], "__version__", "0.29.3")
    with pytest.raises(fake_vllm.VllmOmniUnavailable, match=r"0\.29\.3 is installed.*0\.30\.x"):
        fake_vllm.VllmOmniEngine("/models/tiny", work_dir=tmp_path)
    monkeypatch.setattr(sys.modules["vllm_omni"], "__version__", "0.30.2")
    fake_vllm.VllmOmniEngine("/models/tiny", work_dir=tmp_path)  # any 0.30.x patch release is accepted
    monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.31.0")
    with pytest.raises(fake_vllm.VllmOmniUnavailable, match=r"vllm 0\.31\.0 is installed"):
        fake_vllm.VllmOmniEngine("/models/tiny", work_dir=tmp_path)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(fake_vllm.VllmOmniUnavailable, match="vllm is not"):
        fake_vllm.VllmOmniEngine("/models/tiny", work_dir=tmp_path)


def test_importing_fgrpo_rollout_does_not_import_vllm():
    # No fake is installed outside the fixtures, and the project environment has no vllm: a module-level
    # import would have failed at collection; this also catches an import of an installed one.
    importlib.import_module("fgrpo.rollout.vllm_omni")
    assert not [m for m in sys.modules if m.split(".")[0] in ("vllm", "vllm_omni")]


def test_bad_input_fails_before_any_engine_work(engine):
    assert engine.spec is not None  # host-side checks read the checkpoint's configs
    with pytest.raises(ValueError, match="one seed per sample"):
        engine.generate(["a", "b"], [1], CFG)
    with pytest.raises(ValueError, match="height=40 is not a positive multiple of 16"):
        engine.generate(["a"], [1], dataclasses.replace(CFG, height=40))
    with pytest.raises(ValueError, match="window_range"):
        engine.generate(["a"], [1], dataclasses.replace(CFG, window_range=(0, 6)))
    with pytest.raises(ValueError, match="seed -1 must be in"):
        engine.generate(["a"], [-1], CFG)
    assert not [e for e in FakeOmni.instances[-1].log if e[0] == "generate"]


def test_pipeline_rejects_an_fgrpo_request_without_its_info(fake_vllm):
    cls = vop.FgrpoQwenImagePipeline
    sp = FakeSamplingParams(extra_args={vop.CFG_KEY: vop.config_to_dict(CFG)})
    with pytest.raises(ValueError, match="additional_information"):
        cls().forward(FakeRequestBatch([FakeRequest({"prompt": "a"}, sp)]))


def test_pipeline_serves_vllm_omnis_warmup_request(fake_vllm):
    """vllm-omni runs a dummy request through forward() at start-up: a plain prompt, no fgrpo fields."""
    sp = FakeSamplingParams(height=32, width=48, num_inference_steps=2, extra_args={"cfg_text_scale": 1.0})
    with torch.inference_mode():
        (out,) = vop.FgrpoQwenImagePipeline().forward(
            FakeRequestBatch([FakeRequest({"prompt": "dummy run"}, sp)])
        )
    assert set(out.output["payload"]) == {"image"} and out.output["payload"]["image"].shape == (1, 3, 32, 48)
    want = _reference(SamplingConfig(height=32, width=48, num_steps=2, guidance_scale=1.0, window_size=0,
                                      window_range=(0, 0)), ["dummy run"], [0])  # fmt: skip
    got = ((out.output["payload"]["image"] / 2 + 0.5) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(got, want.images)


# ---------------------------------------------------------------------------------------------
# Construction and request building
# ---------------------------------------------------------------------------------------------
def test_engine_passes_the_custom_pipeline_hook(engine):
    kw = FakeOmni.instances[-1].kwargs
    assert kw["custom_pipeline_args"] == {
        "pipeline_class": "fgrpo.rollout.vllm_omni_pipeline.FgrpoQwenImagePipeline"
    }
    assert kw["worker_extension_cls"] == "fgrpo.rollout.vllm_omni_pipeline.FgrpoWorkerExtension"
    assert kw["max_num_seqs"] == 2 and kw["enable_sleep_mode"] is True
    cls = vop.FgrpoQwenImagePipeline
    assert issubclass(cls, FakeQwenImagePipeline) and cls.__qualname__ == "FgrpoQwenImagePipeline"
    assert cls.supports_request_batch and not cls.supports_step_execution


@pytest.mark.parametrize("compile", [False, True])
def test_the_trainers_engine_follows_model_compile(fake_vllm, tiny_dir, tmp_path, monkeypatch, compile):
    """model.compile compiles vLLM-Omni's copy too (its torch.compile); without it the engine runs eager."""
    import tempfile

    from fgrpo.rollout.build import build_engine

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the engine's work directory
    build_engine(tiny_qwen_image(0), "vllm_omni", str(tiny_dir), compile=compile)
    kw = FakeOmni.instances[-1].kwargs
    assert kw["enforce_eager"] is (not compile) and kw["enable_sleep_mode"] is True


def test_build_requests_carries_per_sample_seed_and_index(fake_vllm):
    requests, params = fake_vllm.build_requests(PROMPTS, SEEDS, CFG)
    assert [r["prompt"] for r in requests] == PROMPTS
    assert all(r["negative_prompt"] == " " for r in requests)
    infos = [r["additional_information"][vop.INFO_KEY] for r in requests]
    assert infos == [{"seed": s, "index": i} for i, s in enumerate(SEEDS)]
    assert (params.height, params.width, params.num_inference_steps) == (32, 48, 4)
    assert params.true_cfg_scale == 2.5 and params.lora_request is None
    assert vop.config_from_dict(json.loads(json.dumps(params.extra_args[vop.CFG_KEY]))) == CFG
    no_cfg, _ = fake_vllm.build_requests(["p"], [1], dataclasses.replace(CFG, guidance_scale=1.0))
    assert "negative_prompt" not in no_cfg[0]


# ---------------------------------------------------------------------------------------------
# Trajectory: equal to the in-process engine's, in caller order; the trainer recomputes its log-probs
# ---------------------------------------------------------------------------------------------
def _assert_same(got, want, exact: bool):
    check = (
        (lambda a, b: torch.equal(a, b)) if exact else (lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-5))
    )
    assert got.prompts == want.prompts and torch.equal(got.seeds, want.seeds.cpu())
    for name in ("sigmas", "window", "x_t", "x_next", "log_prob"):
        w = getattr(want, name).cpu()
        assert check(getattr(got, name), w.float() if w.is_floating_point() else w), name
    # uint8 through vllm-omni's PIL post-processing: a value equal up to rounding may land one level over
    levels = (got.images.int() - want.images.int()).abs().max()
    assert levels == 0 if exact else levels <= 1
    assert set(got.cond) == set(want.cond)
    for k in want.cond:  # same tokens; padding may differ (worker batches pad to their own longest)
        L = want.cond[k].shape[1]
        assert check(got.cond[k][:, :L].to(want.cond[k].dtype), want.cond[k]), k
        assert not got.cond[k][:, L:].any(), k


def test_generate_equals_the_in_process_engine_and_the_trainer_recomputation(engine):
    got = engine.generate(PROMPTS, SEEDS, CFG)
    want = _reference()
    B, W = len(PROMPTS), CFG.window_size
    assert got.x_t.shape == (B, W, 4, 32 // 8, 48 // 8) and got.x_t.dtype == torch.float32
    assert got.log_prob.shape == (B, W) and got.window.dtype == torch.int64
    assert got.images.shape == (B, 32, 48, 3) and got.images.dtype == torch.uint8
    assert got.cond["prompt_embeds"].dtype == torch.float32 and got.cond["prompt_mask"].dtype == torch.bool
    # Worker batches of 2 requests = the reference's micro-batches of 2 rows: the same forwards, bit for bit.
    _assert_same(got, want, exact=True)
    # Samples 1 and 3 share prompt and seed although they ran in different worker batches. Their batches pad
    # the prompt to different lengths (the longest prompt of each), so the forwards have other shapes and the
    # bits may differ (they do on some CPUs): equal up to rounding, while different seeds differ outright.
    torch.testing.assert_close(got.x_next[1], got.x_next[3], rtol=1e-5, atol=1e-5)
    assert (got.x_next[0] - got.x_next[2]).abs().max() > 1e-2
    # The trainer's function on the trainer's model (in-process QwenImage, same weights and kernels here)
    # gives back the engine's log-probs: the ratio starts at exactly 1.
    assert torch.equal(recompute_log_probs(tiny_qwen_image(0), got, CFG), got.log_prob)


def test_results_do_not_depend_on_worker_batch_size(fake_vllm, tiny_dir, tmp_path):
    cfg = dataclasses.replace(CFG, guidance_scale=1.0)  # also covers the no-CFG path
    prompts, seeds = PROMPTS[:3], SEEDS[:3]
    a = fake_vllm.VllmOmniEngine(str(tiny_dir), max_batch=1, work_dir=tmp_path / "a").generate(
        prompts, seeds, cfg
    )
    want = _reference(cfg, prompts, seeds)
    _assert_same(a, want, exact=False)  # other forward shapes than the reference: equal up to rounding
    assert "neg_prompt_embeds" not in a.cond


def test_unpack_rejects_outputs_without_a_trajectory(fake_vllm):
    bad = [FakeRequestOutput("0_x", [Image.new("RGB", (16, 16))], {})]
    with pytest.raises(RuntimeError, match="custom_pipeline_args"):
        fake_vllm.unpack_outputs(bad, ["a"], [1])


# ---------------------------------------------------------------------------------------------
# Weight sync: LoRA versions with new ids, full weights through the worker extension
# ---------------------------------------------------------------------------------------------
def _lora_state(v: float) -> dict[str, torch.Tensor]:
    return {
        "base_model.model.transformer_blocks.0.attn.to_q.lora_A.weight": torch.full((2, 8), v),
        "base_model.model.transformer_blocks.0.attn.to_q.lora_B.weight": torch.full((8, 2), v),
    }


def test_lora_updates_get_new_adapter_ids_and_directories(engine, tmp_path):
    from safetensors.torch import load_file

    lora_cfg = {"r": 2, "lora_alpha": 4, "target_modules": {"to_q"}, "peft_type": "LORA"}
    reqs = [engine.update_lora(_lora_state(float(k)), lora_cfg) for k in (1, 2, 3)]
    assert [r.lora_int_id for r in reqs] == [1, 2, 3]  # never reused: vllm-omni caches adapters by id
    assert len({r.lora_name for r in reqs}) == 3 and len({r.lora_path for r in reqs}) == 3
    newest = reqs[-1].lora_path
    assert json.loads(open(f"{newest}/adapter_config.json").read())["target_modules"] == ["to_q"]
    assert torch.equal(
        load_file(f"{newest}/adapter_model.safetensors")[next(iter(_lora_state(0)))], torch.full((2, 8), 3.0)
    )
    assert not (tmp_path / "lora_v000001").exists() and (tmp_path / "lora_v000002").exists()  # keeps one back
    engine.generate(["p"], [1], CFG)
    assert FakeOmni.instances[-1].log[-1] == ("generate", reqs[-1])  # requests carry the newest adapter
    # an exported PEFT directory is copied under a fresh version too
    fresh = engine.update_lora(newest)
    assert fresh.lora_int_id == 4 and fresh.lora_path != newest


def test_lora_names_follow_vllm_omni_modules(engine, tmp_path):
    """vllm-omni names diffusers' attn.to_out.0 `attn.to_out`; its LoRA loader rejected `to_out.0` on the GPU."""
    from safetensors.torch import load_file

    from fgrpo.rollout.vllm_omni import vllm_omni_lora_names

    a, b = torch.randn(2, 8), torch.randn(8, 2)
    state = {
        "transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight": a,
        "transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight": b,
        "transformer.transformer_blocks.0.img_mlp.net.0.proj.lora_A.weight": a.clone(),
    }
    cfg = {
        "r": 2,
        "lora_alpha": 4,
        "target_modules": ["to_out.0", "to_q", "img_mlp.net.0.proj"],
        "peft_type": "LORA",
    }
    renamed, new_cfg = vllm_omni_lora_names(state, cfg)
    assert sorted(renamed) == [
        "transformer.transformer_blocks.0.attn.to_out.lora_A.weight",
        "transformer.transformer_blocks.0.attn.to_out.lora_B.weight",
        "transformer.transformer_blocks.0.img_mlp.net.0.proj.lora_A.weight",  # net.0 of the MLP is unchanged
    ]
    assert renamed["transformer.transformer_blocks.0.attn.to_out.lora_B.weight"] is b
    assert (
        new_cfg["target_modules"] == ["img_mlp.net.0.proj", "to_out", "to_q"]
        and cfg["target_modules"][0] == "to_out.0"
    )
    # both update paths (state dict, and the trainer's exported directory) hand the engine the renamed adapter
    req = engine.update_lora(state, cfg)
    assert "transformer.transformer_blocks.0.attn.to_out.lora_A.weight" in load_file(
        f"{req.lora_path}/adapter_model.safetensors"
    )
    exported = tmp_path / "export"
    exported.mkdir()
    from safetensors.torch import save_file

    save_file(state, str(exported / "adapter_model.safetensors"))
    (exported / "adapter_config.json").write_text(json.dumps(cfg))
    req = engine.update_lora(exported)
    assert (
        json.loads(open(f"{req.lora_path}/adapter_config.json").read())["target_modules"]
        == new_cfg["target_modules"]
    )
    assert torch.equal(
        load_file(f"{req.lora_path}/adapter_model.safetensors")[
            "transformer.transformer_blocks.0.attn.to_out.lora_B.weight"
        ],
        b.to(torch.bfloat16),  # written in the engine's dtype
    )


def test_the_trainers_lora_from_memory_equals_its_export_and_is_written_in_the_engines_dtype(
    engine, tmp_path
):
    """The trainer hands the engine its adapter from memory (`lora_file_tensors`: no file written and read back):
    the engine's directory equals the one the exported directory gives, key for key, value for value and config,
    and holds the fp32 masters cast to the engine's bf16, the cast its LoRA manager applies on loading."""
    from safetensors.torch import load_file

    from fgrpo.models.lora import ADAPTER_WEIGHTS, add_lora, export_lora, lora_file_tensors
    from fgrpo.rollout.vllm_omni import vllm_omni_lora_names

    transformer = tiny_qwen_image(0).transformer
    add_lora(transformer, rank=2, alpha=4, init=False)  # A and B random: no zero tensor hides a wrong key
    for p in transformer.parameters():
        p.data = p.data.float()  # the trainer's fp32 masters
    state, cfg = lora_file_tensors(transformer)
    exported = export_lora(tmp_path / "export", transformer)
    assert load_file(str(exported / ADAPTER_WEIGHTS)).keys() == state.keys()
    from_file, from_memory = engine.update_lora(exported), engine.update_lora(state, cfg)
    a, b = (load_file(f"{r.lora_path}/{ADAPTER_WEIGHTS}") for r in (from_file, from_memory))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith(".attn.to_out.lora_B.weight") for k in b)  # vLLM-Omni's names (to_out.0 renamed)
    assert {t.dtype for t in b.values()} == {torch.bfloat16}
    renamed, _ = vllm_omni_lora_names(state, cfg, engine.adapter.lora_renames)
    assert all(torch.equal(b[k], renamed[k].to(torch.bfloat16)) for k in b)
    assert (Path(from_file.lora_path) / "adapter_config.json").read_text() == (
        Path(from_memory.lora_path) / "adapter_config.json"
    ).read_text()


def test_lora_update_errors(engine, tmp_path):
    with pytest.raises(ValueError, match="needs config="):
        engine.update_lora(_lora_state(1.0))
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        engine.update_lora(tmp_path)
    raw = {
        "transformer_blocks.0.attn.to_q.lora_A.default.weight": torch.zeros(2, 8)
    }  # module.state_dict() naming
    with pytest.raises(ValueError, match="get_peft_model_state_dict"):
        engine.update_lora(raw, {"r": 2})


def test_full_weight_update_reaches_the_worker_transformer(engine):
    pipeline = FakeOmni.instances[-1].pipeline
    before = engine.generate(PROMPTS[:2], SEEDS[:2], CFG)
    reference = tiny_qwen_image(0)
    new = {k: v * 1.5 for k, v in reference.transformer.state_dict().items() if k.startswith("proj_out")}
    assert engine.update_weights(new) == len(new)
    assert torch.equal(pipeline.transformer.inner.proj_out.weight.detach(), new["proj_out.weight"])
    assert not list(engine.work_dir.glob("weights_*.safetensors"))  # the transfer file is removed
    after = engine.generate(PROMPTS[:2], SEEDS[:2], CFG)
    assert not torch.equal(before.x_next, after.x_next)
    reference.transformer.load_state_dict(new, strict=False)  # the same update in the trainer's model
    _assert_same(after, _reference(CFG, PROMPTS[:2], SEEDS[:2], reference), exact=True)


# ---------------------------------------------------------------------------------------------
# Sleep / wake around training
# ---------------------------------------------------------------------------------------------
def test_sleep_wake_ordering(engine):
    log = FakeOmni.instances[-1].log
    engine.generate(["p"], [1], CFG)
    engine.sleep()
    engine.sleep()  # idempotent: one RPC
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(["p"], [1], CFG)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.update_weights({"proj_out.bias": torch.zeros(16)})
    engine.wake()
    engine.wake()
    engine.generate(["p"], [1], CFG)
    assert [e[:2] if e[0] == "rpc" else e[0] for e in log] == [
        "generate",
        ("rpc", "sleep"),
        ("rpc", "wake_up"),
        "generate",
    ]
    assert log[1][2] == (1,)  # level 1: weights offloaded to CPU, restorable (level 2 cannot wake in 0.30)


def test_sleep_needs_sleep_mode_and_surfaces_rpc_errors(fake_vllm, tmp_path):
    plain = fake_vllm.VllmOmniEngine("m", work_dir=tmp_path / "a")
    with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
        plain.sleep()
    eng = fake_vllm.VllmOmniEngine("m", enable_sleep_mode=True, work_dir=tmp_path / "b")
    eng.omni.engine.rpc_results["sleep"] = {"supported": False, "error": "CuMem pool not active"}
    with pytest.raises(RuntimeError, match="CuMem pool not active"):
        eng.sleep()
    assert not eng.asleep
    eng.close()
    assert eng.omni.closed


def test_peft_dir_write_that_fails_leaves_the_previous_adapter_and_no_temp_dir(tmp_path, monkeypatch):
    """vLLM-Omni reads the adapter directory by path: a write cut short (disk full) must not leave a
    half-written adapter under its name, nor litter the work dir."""
    import safetensors.torch
    from safetensors.torch import load_file

    from fgrpo import files
    from fgrpo.rollout.vllm_omni import write_peft_dir

    cfg = {"r": 2, "lora_alpha": 4, "target_modules": ["to_q"], "peft_type": "LORA"}
    out = write_peft_dir(tmp_path / "lora", _lora_state(1.0), cfg)

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    monkeypatch.setattr(files, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_peft_dir(out, _lora_state(2.0), cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora"]
    key = next(iter(_lora_state(0.0)))
    assert torch.equal(load_file(out / "adapter_model.safetensors")[key], torch.full((2, 8), 1.0))
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 2


# ---------------------------------------------------------------------------------------------
# What each algorithm reads beyond the window: the optional fields, and a training step on the engine's rollouts
# ---------------------------------------------------------------------------------------------
def test_optional_fields_travel_when_asked_and_equal_the_in_process_engines(fake_vllm, tiny_dir, tmp_path):
    """Flow-DPPO's transition means and NFT/AWM's final latents: bit-equal where the forwards are (worker batches of
    the reference's micro-batch); an engine not asked for them returns None, as nothing else is sent."""
    both = fake_vllm.VllmOmniEngine(str(tiny_dir), max_batch=2, work_dir=tmp_path / "a", keep=("mean", "x0"))
    got, want = both.generate(PROMPTS, SEEDS, CFG), _reference()
    _assert_same(got, want, exact=True)
    assert got.mean is not None and want.mean is not None and got.x0 is not None and want.x0 is not None
    assert (
        got.mean.shape == (len(PROMPTS), CFG.window_size, 4, 32 // 8, 48 // 8)
        and got.mean.dtype == torch.float32
    )
    assert torch.equal(got.mean, want.mean) and torch.equal(got.x0, want.x0)
    plain = fake_vllm.VllmOmniEngine(str(tiny_dir), max_batch=2, work_dir=tmp_path / "b").generate(
        PROMPTS, SEEDS, CFG
    )
    assert plain.mean is None and plain.x0 is None
    with pytest.raises(ValueError, match=r"^keep=\['x_t'\]: \['x_t'\] not among \('mean', 'x0'\)"):
        fake_vllm.VllmOmniEngine(str(tiny_dir), work_dir=tmp_path / "c", keep=("x_t",))


@pytest.fixture
def tiny_on_vllm(monkeypatch):
    """The config check lets the tiny Qwen-Image stand in for the real one (whose directory the engine loads)."""
    from fgrpo.models import registry

    monkeypatch.setattr(registry, "VLLM_OMNI_KINDS", (*registry.VLLM_OMNI_KINDS, "tiny_qwen_image"))


def _algo_cfg(name: str, **base):
    """The tiny end-to-end config trained by `name` (preset values) on the vLLM-Omni engine."""
    from train_entry import Config

    from fgrpo.presets import with_algo

    cfg = with_algo(dataclasses.replace(Config(), **base), name, size="tiny")
    window = not algorithms.ALGORITHMS[cfg.algo.name].forward_process
    return dataclasses.replace(
        cfg,
        rollout_engine="vllm_omni",
        grpo=dataclasses.replace(cfg.grpo, old_log_prob="recompute" if window else "rollout"),
        algo=dataclasses.replace(cfg.algo, sample_from_ema=False),  # the engine holds theta (check_config)
    )


@pytest.mark.parametrize("name", ["nft", "awm", "mixgrpo-flash"])
def test_each_algorithms_rollout_equals_the_in_process_engines(
    fake_vllm, tiny_on_vllm, tiny_dir, tmp_path, name
):
    """The rollout an algorithm asks for (its SamplingConfig: NFT/AWM's ODE, MixGRPO-Flash's DPM-Solver++ tail) with
    the fields it reads (`rollout_fields`): the whole trajectory bit for bit, worker batches = micro-batches."""
    sampling = dataclasses.replace(CFG, num_steps=6, window_range=(0, 6))
    grpo = GRPOConfig(group_size=2, prompts_per_step=2, optimizer_steps_per_step=1, clip_range=0.2)
    cfg = _algo_cfg(name, sampling=sampling, grpo=grpo)
    algorithms.check_config(cfg, world_size=1)
    algo = algorithms.build(cfg, [])
    s, keep = algo.sampling(0), algo.rollout_fields()
    assert s.micro_batch == 2 and keep == (("x0",) if algo.forward_process else ())
    engine = fake_vllm.VllmOmniEngine(str(tiny_dir), max_batch=2, work_dir=tmp_path, keep=keep)
    got, want = engine.generate(PROMPTS, SEEDS, s), _reference(s)
    _assert_same(got, want, exact=True)
    for f in vop.OPTIONAL_FIELDS:
        value = getattr(got, f)
        assert (value is not None) == (f in keep), f
        assert value is None or torch.equal(value, getattr(want, f)), f


@pytest.mark.parametrize("name", ["dppo", "nft", "awm", "mixgrpo-flash"])
def test_each_algorithm_trains_on_the_engines_rollouts(fake_vllm, tiny_on_vllm, tmp_path, monkeypatch, name):
    """One training step through train(): rollout on the engine (woken, then slept), the update on its trajectory
    (moved to the trainer's device), the LoRA sent back from memory; the trajectory holds exactly the fields the
    update reads."""
    import tempfile

    import fgrpo.train as train_mod

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the engine's LoRA versions
    seen = []
    sources = []
    real_update = fake_vllm.VllmOmniEngine.update_lora
    monkeypatch.setattr(
        fake_vllm.VllmOmniEngine,
        "update_lora",
        lambda self, source, *a, **k: sources.append(source) or real_update(self, source, *a, **k),
    )
    real_rollout = train_mod.rollout
    monkeypatch.setattr(train_mod, "rollout", lambda *a, **k: seen.append(real_rollout(*a, **k)) or seen[-1])
    cfg = _algo_cfg(name)
    cfg = dataclasses.replace(
        cfg, num_steps=1, run=dataclasses.replace(cfg.run, out_dir=str(tmp_path / "runs"))
    )
    m = train_mod.train(cfg)
    assert m["train/skipped_steps"] == 0 and m["train/optimizer_steps"] == cfg.grpo.optimizer_steps_per_step
    assert all(torch.isfinite(torch.tensor(v)) for k, v in m.items() if k.startswith("train/"))
    (traj,) = seen
    forward_process = algorithms.ALGORITHMS[cfg.algo.name].forward_process
    assert [f for f in vop.OPTIONAL_FIELDS if getattr(traj, f) is not None] == (
        ["x0"] if forward_process else []
    )
    log = [e[0] if e[0] == "generate" else e[1] for e in FakeOmni.instances[-1].log]
    assert log == [
        "generate",
        "sleep",
    ]  # the rollout ran here (an engine starts awake; a LoRA sync is no RPC)
    assert len(sources) == 1 and isinstance(sources[0], dict)  # the LoRA synced from memory after the update


def test_train_step_times_each_engine_on_one_model_from_the_real_dir(
    fake_vllm, tmp_path, monkeypatch, capsys
):
    """benchmarks/train_step.py --rollout-engine diffusers,vllm_omni (the tiny model, the fake vLLM-Omni): the
    model is written to --real-dir once and both settings read it; the second setting rolls out on the engine
    (woken, then slept), sends it the LoRA after the update, recomputes the old log-probs inside the update (no
    separate recompute row), prints the LoRA's sync apart in its step lines, and closes it at the end."""
    import tempfile

    from fgrpo.scripts import load_script

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the engine's LoRA versions
    monkeypatch.syspath_prepend(str(bench))  # train_step's own imports (rollout, vllm_omni_check)
    train_step = load_script(bench / "train_step.py")
    real = tmp_path / "real"
    argv = ["train_step.py", "--tiny", "--rollout-engine", "diffusers,vllm_omni", "--real-dir", str(real)]
    argv += ["--iters", "1", "--prompts", "1", "--group", "2", "--opt-steps", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    train_step.main()
    out = capsys.readouterr().out
    assert (real / "qwen_image" / "model_index.json").is_file()  # written once, kept: --real-dir was given
    (omni,) = FakeOmni.instances
    assert omni.model == str(real / "qwen_image") and omni.closed
    # warm-up and timed step: each a rollout, then the engine sleeps; it wakes for the next, which samples the
    # LoRA synced after the update (an engine starts awake; a LoRA sync is no RPC). The first samples the adapter
    # the in-process setting trained, sent when the second Trainer was built over the same model.
    log = [e[1] if e[0] == "rpc" else e[0] for e in omni.log]
    assert log == ["generate", "sleep", "wake_up", "generate", "sleep"]
    assert omni.log[0][1].lora_int_id == 1 and omni.log[3][1].lora_int_id == 2
    tables = out.split("| phase | s |")[1:]
    assert [("rollout engine diffusers" in t, "rollout engine vllm_omni" in t) for t in tables] == [
        (True, False),
        (False, True),
    ]
    assert ["old log-prob (recompute only)" in t for t in tables] == [True, False]
    # the engine's step lines give the LoRA's sync apart (inside their train time); the in-process ones share it
    syncs = [float(v) for _, v in re.findall(r"train (\S+)s \(the LoRA's sync (\S+)s\)", out)]
    assert len(syncs) == 2 and all(v > 0 for v in syncs) and out.count("the LoRA's sync") == 2
    gap = re.findall(r"first-update log-prob gap (\S+)\)", out)
    # in-process: exact; the engine's log-probs against the update's recompute: the same fp32 policy, its LoRA
    # read back from the exported file, other batch shapes
    assert len(gap) == 2 and float(gap[0]) == 0.0 and float(gap[1]) < 1e-3
