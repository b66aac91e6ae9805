"""The vLLM-Omni engine against fake vllm / vllm_omni modules that follow the 0.30 interfaces.

The fakes mirror what fgrpo touches in the real packages (read from vllm-omni 0.30.0's sources):
`vllm_omni.__version__`, `vllm_omni.entrypoints.omni.Omni(**kwargs)` with `generate(prompts, sampling_params, *,
use_tqdm)` and `engine.collective_rpc(method, args=, kwargs=)`, `OmniDiffusionSamplingParams`,
`OmniTextPrompt` (a TypedDict), `DiffusionOutput(output=, to_cpu=)`, `DiffusionRequestBatch`, `QwenImagePipeline` (transformer with vllm-omni's forward
signature incl. `txt_seq_lens`, `encode_prompt`, `_decode_latents`, `scheduler.config`,
`vae_scale_factor`), `CustomPipelineWorkerExtension`, and `vllm.lora.request.LoRARequest`. The fake
Omni resolves the pipeline class by its qualified name, runs `forward` on request batches of
`max_num_seqs` under `inference_mode`, post-processes the output envelope into PIL images and returns
outputs in a shuffled order, as the real one may. The real vllm is never imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import random
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from PIL import Image
from torch import nn

from fgrpo import policy
from fgrpo.core import sde
from fgrpo.rollout import vllm_omni_pipeline as vop
from fgrpo.rollout.base import SamplingConfig

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
PROMPTS = ['a sign that says "hi"', "x", 'a longer prompt with "OPEN" written', "x"]
SEEDS = [11, 12, 13, 12]


# ---------------------------------------------------------------------------------------------
# Fakes of the vllm-omni 0.30 surface
# ---------------------------------------------------------------------------------------------
class FakeTransformer(nn.Module):
    """Row-independent toy velocity with vllm-omni's QwenImageTransformer2DModel.forward signature."""

    def __init__(self, in_channels: int = 8, text_dim: int = 4):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.in_channels = in_channels
        self.proj = nn.Parameter(torch.randn(in_channels, in_channels, generator=g) * 0.3)
        self.txt = nn.Parameter(torch.randn(text_dim, in_channels, generator=g))
        self.calls: list[dict[str, Any]] = []

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
        # What vllm-omni's transformer needs from a caller, checked like its RoPE/packing would.
        assert len(img_shapes) == B and all(f * h * w == S for ((f, h, w),) in img_shapes)
        assert txt_seq_lens == [encoder_hidden_states.shape[1]] * B
        assert timestep.shape == (B,)
        m = encoder_hidden_states_mask.to(hidden_states.dtype)[..., None]
        text = (encoder_hidden_states * m).sum(1) / m.sum(1)  # [B, D], padding-invariant
        out = (
            torch.tanh(hidden_states @ self.proj)
            + (text @ self.txt)[:, None, :] * (1 - timestep)[:, None, None]
        )
        self.calls.append({"B": B, "L": encoder_hidden_states.shape[1]})
        return (out,)

    def load_weights(self, weights):
        names = set()
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)
            names.add(name)
        return names


class FakeQwenImagePipeline(nn.Module):
    supports_request_batch = True
    supports_step_execution = True

    def __init__(self, *, od_config: Any = None, prefix: str = ""):
        super().__init__()
        self.od_config = od_config
        self.transformer = FakeTransformer()
        self.vae_scale_factor = 8
        self.tokenizer_max_length = 1024
        self.device = torch.device("cpu")
        self.scheduler = types.SimpleNamespace(
            config={
                "base_image_seq_len": 256,
                "max_image_seq_len": 4096,
                "base_shift": 0.5,
                "max_shift": 1.15,
            }
        )
        self.table = torch.randn(256, 4, generator=torch.Generator().manual_seed(1))

    def encode_prompt(self, prompt, num_images_per_prompt=1, prompt_embeds=None, prompt_embeds_mask=None,
                      max_sequence_length=1024, prompt_name="prompt"):  # fmt: skip
        ids = [list(p.encode()) or [0] for p in prompt]
        L = max(len(i) for i in ids)
        emb = torch.zeros(len(ids), L, 4)
        mask = torch.zeros(len(ids), L, dtype=torch.long)
        for b, i in enumerate(ids):
            emb[b, : len(i)] = self.table[torch.tensor(i)]
            mask[b, : len(i)] = 1
        return emb, mask

    def _decode_latents(self, latents, height, width, output_type="pil"):
        B = latents.shape[0]
        level = torch.tanh(latents.float().mean(dim=(1, 2)))  # [B]
        image = level[:, None, None, None].expand(B, 3, height, width).clone()
        return FakeDiffusionOutput(output=image)


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


class FakeOmni:
    instances: list[FakeOmni] = []

    def __init__(self, model: str, **kwargs):
        self.model = model
        self.kwargs = kwargs
        self.log: list[tuple] = []
        self.engine = FakeEngine(self)
        name = kwargs["custom_pipeline_args"]["pipeline_class"]
        module, qual = name.rsplit(".", 1)  # what vllm's resolve_obj_by_qualname does
        self.pipeline = getattr(importlib.import_module(module), qual)(od_config=None)
        ext_name = kwargs["worker_extension_cls"]
        ext = getattr(importlib.import_module(ext_name.rsplit(".", 1)[0]), ext_name.rsplit(".", 1)[1])
        self.worker = ext()
        self.worker.model_runner = types.SimpleNamespace(pipeline=self.pipeline)
        self.closed = False
        FakeOmni.instances.append(self)

    def generate(self, prompts, sampling_params_list=None, *, py_generator=False, use_tqdm=True):
        self.log.append(("generate", sampling_params_list.lora_request))
        requests = [FakeRequest(dict(p), dataclasses.replace(sampling_params_list)) for p in prompts]
        step = self.kwargs["max_num_seqs"]
        outs = []
        with torch.inference_mode():
            for s in range(0, len(requests), step):
                batch = FakeRequestBatch(requests[s : s + step])
                for j, o in enumerate(self.pipeline.forward(batch)):
                    payload = o.output["payload"]
                    img = ((payload["image"][0].permute(1, 2, 0) / 2 + 0.5).clamp(0, 1) * 255).round()
                    pil = Image.fromarray(img.to(torch.uint8).numpy())
                    outs.append(FakeRequestOutput(f"{s + j}_x", [pil], {"trajectory": payload["trajectory"]}))
        random.Random(len(outs)).shuffle(outs)
        return outs

    def close(self):
        self.closed = True


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


@pytest.fixture
def fake_vllm(monkeypatch):
    mods = {
        "vllm": _module("vllm"),
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


@pytest.fixture
def engine(fake_vllm, tmp_path):
    return fake_vllm.VllmOmniEngine("/models/tiny", max_batch=2, enable_sleep_mode=True, work_dir=tmp_path)


# ---------------------------------------------------------------------------------------------
# Errors: missing extra, wrong version, bad input
# ---------------------------------------------------------------------------------------------
def test_missing_extra_is_a_clear_error(monkeypatch):
    from fgrpo.rollout import vllm_omni

    monkeypatch.setitem(sys.modules, "vllm_omni", None)  # makes `import vllm_omni` raise ImportError
    with pytest.raises(vllm_omni.VllmOmniUnavailable, match="uv sync --extra vllm"):
        vllm_omni.VllmOmniEngine("/models/tiny")


def test_wrong_version_is_a_clear_error(fake_vllm, monkeypatch):
    monkeypatch.setattr(sys.modules["vllm_omni"], "__version__", "0.29.3")
    with pytest.raises(fake_vllm.VllmOmniUnavailable, match=r"0\.29\.3 is installed.*0\.30\.x"):
        fake_vllm.VllmOmniEngine("/models/tiny")
    monkeypatch.setattr(sys.modules["vllm_omni"], "__version__", "0.30.2")
    fake_vllm.VllmOmniEngine("/models/tiny")  # any 0.30.x patch release is accepted


def test_importing_fgrpo_rollout_does_not_import_vllm():
    # No fake is installed outside the fixtures, and the project environment has no vllm: a module-level
    # import would have failed at collection; this also catches an import of an installed one.
    importlib.import_module("fgrpo.rollout.vllm_omni")
    assert not [m for m in sys.modules if m.split(".")[0] in ("vllm", "vllm_omni")]


def test_bad_input_fails_before_any_engine_work(engine):
    with pytest.raises(ValueError, match="one seed per prompt"):
        engine.generate(["a", "b"], [1], CFG)
    with pytest.raises(ValueError, match="multiples of 16"):
        engine.generate(["a"], [1], dataclasses.replace(CFG, height=40))
    with pytest.raises(ValueError, match="window_range"):
        engine.generate(["a"], [1], dataclasses.replace(CFG, window_range=(0, 6)))
    assert not [e for e in FakeOmni.instances[-1].log if e[0] == "generate"]


def test_pipeline_rejects_a_request_without_fgrpo_info(fake_vllm):
    cls = vop.FgrpoQwenImagePipeline
    sp = FakeSamplingParams(extra_args={vop.CFG_KEY: vop.config_to_dict(CFG)})
    with pytest.raises(ValueError, match="additional_information"):
        cls().forward(FakeRequestBatch([FakeRequest({"prompt": "a"}, sp)]))


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


def test_build_requests_carries_per_sample_seed_window_and_index(fake_vllm):
    requests, params = fake_vllm.build_requests(PROMPTS, SEEDS, CFG)
    assert [r["prompt"] for r in requests] == PROMPTS
    assert all(r["negative_prompt"] == " " for r in requests)
    infos = [r["additional_information"][vop.INFO_KEY] for r in requests]
    assert [i["index"] for i in infos] == [0, 1, 2, 3] and [i["seed"] for i in infos] == SEEDS
    lo, hi = CFG.window_range
    for info in infos:
        w = info["window"]
        assert len(w) == CFG.window_size and lo <= w[0] and w[-1] < hi
        assert w == list(range(w[0], w[0] + CFG.window_size))
    assert infos[1]["window"] == infos[3]["window"]  # same seed, same window
    starts = {fake_vllm.build_requests(["p"], [s], CFG)[0][0]["additional_information"]["fgrpo"]["window"][0]
              for s in range(40)}  # fmt: skip
    assert starts == set(range(lo, hi - CFG.window_size + 1))  # the whole range is reachable
    assert (params.height, params.width, params.num_inference_steps) == (32, 48, 4)
    assert params.true_cfg_scale == 2.5 and params.lora_request is None
    assert vop.config_from_dict(json.loads(json.dumps(params.extra_args[vop.CFG_KEY]))) == CFG
    no_cfg, _ = fake_vllm.build_requests(["p"], [1], dataclasses.replace(CFG, guidance_scale=1.0))
    assert "negative_prompt" not in no_cfg[0]


# ---------------------------------------------------------------------------------------------
# Trajectory: unpacking, order, shapes, log-probs equal the trainer's recomputation
# ---------------------------------------------------------------------------------------------
def _recompute(pipeline, traj, cfg):
    """The trainer's side: transition_log_prob on the stored transitions, one window slot at a time."""
    flow = vop.OmniQwenFlow(pipeline, cfg.height, cfg.width)
    out = torch.empty_like(traj.log_prob)
    for w in range(traj.window.shape[1]):
        i = traj.window[:, w]
        lp, _, _ = policy.transition_log_prob(
            flow, traj.x_t[:, w], traj.x_next[:, w], traj.sigmas[i], traj.sigmas[i + 1], traj.cond, cfg
        )
        out[:, w] = lp
    return out


def test_generate_returns_a_trajectory_in_caller_order(engine):
    traj = engine.generate(PROMPTS, SEEDS, CFG)
    B, W, S, C = 4, CFG.window_size, (32 // 16) * (48 // 16), 8
    assert traj.prompts == PROMPTS and traj.seeds.tolist() == SEEDS
    assert traj.x_t.shape == traj.x_next.shape == (B, W, S, C) and traj.x_t.dtype == torch.float32
    assert traj.log_prob.shape == (B, W) and traj.window.shape == (B, W) and traj.window.dtype == torch.int64
    assert traj.sigmas.shape == (CFG.num_steps + 1,) and traj.sigmas[0] == 1 and traj.sigmas[-1] == 0
    assert traj.images.shape == (B, 32, 48, 3) and traj.images.dtype == torch.uint8
    L = max(len(p.encode()) for p in PROMPTS)  # padded to the longest prompt across worker batches
    assert traj.cond["prompt_embeds"].shape == (B, L, 4) and traj.cond["prompt_embeds"].dtype == torch.float32
    assert traj.cond["prompt_embeds_mask"].sum(1).tolist() == [len(p.encode()) for p in PROMPTS]
    assert set(traj.cond) == set(vop.COND_KEYS)
    # samples 1 and 3 share prompt and seed: identical although they ran in different worker batches
    assert torch.equal(traj.x_next[1], traj.x_next[3]) and torch.equal(traj.images[1], traj.images[3])
    assert not torch.equal(traj.x_next[0], traj.x_next[2])
    # the trainer's recomputation with unchanged weights gives back the rollout's log-prob
    assert torch.equal(_recompute(FakeOmni.instances[-1].pipeline, traj, CFG), traj.log_prob)
    assert torch.isfinite(traj.log_prob).all()


def test_results_do_not_depend_on_worker_batch_size(fake_vllm, tmp_path):
    a = fake_vllm.VllmOmniEngine("m", max_batch=1, work_dir=tmp_path / "a").generate(PROMPTS, SEEDS, CFG)
    b = fake_vllm.VllmOmniEngine("m", max_batch=4, work_dir=tmp_path / "b").generate(PROMPTS, SEEDS, CFG)
    for name in ("x_t", "x_next", "log_prob", "window", "images"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=1e-6)


def test_rollout_loop_matches_a_per_sample_reference_loop():
    """Vectorised loop (batch split by window membership) == one sample at a time, by hand."""
    model = types.SimpleNamespace(
        velocity=lambda x, sigma, cond, guidance_scale: torch.sin(3 * x) * cond["c"][:, None, None] - x
    )
    B, T = 5, 6
    cfg = dataclasses.replace(CFG, num_steps=T, window_range=(1, 5), window_size=2, noise_level=0.9)
    sigmas = torch.linspace(1.0, 0.0, T + 1)
    x0 = torch.randn(B, 3, 2, generator=torch.Generator().manual_seed(5))
    cond = {"c": torch.linspace(0.5, 1.5, B)}
    windows = torch.tensor([[1, 2], [3, 4], [2, 3], [1, 2], [3, 4]])
    out = vop.rollout_loop(model, x0, sigmas, cond, cfg, windows, [vop.sample_generator(s) for s in range(B)])
    for b in range(B):
        gen = vop.sample_generator(b)
        x = x0[b : b + 1]
        for i in range(T):
            sig, nxt = sigmas[i : i + 1], sigmas[i + 1 : i + 2]
            v = model.velocity(x, sig, {"c": cond["c"][b : b + 1]}, guidance_scale=1.0)
            if i in windows[b].tolist():
                mean, std = sde.step_mean_std(x, v, sig, nxt, noise_level=cfg.noise_level, kind=cfg.sde_kind)
                x_next = mean + std * torch.randn(x.shape[1:], generator=gen)[None]
                w = windows[b].tolist().index(i)
                assert torch.equal(out.x_t[b, w], x[0])
                torch.testing.assert_close(out.x_next[b, w], x_next[0], rtol=0, atol=1e-6)
                lp = sde.log_prob(out.x_next[b : b + 1, w], mean, std)
                torch.testing.assert_close(out.log_prob[b, w], lp[0], rtol=0, atol=1e-6)
                x = out.x_next[b : b + 1, w]
            else:
                x, _ = sde.step_mean_std(x, v, sig, nxt, noise_level=cfg.noise_level, kind="ode")
        torch.testing.assert_close(out.x0[b], x[0], rtol=0, atol=1e-5)


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


def test_lora_update_errors(engine, tmp_path):
    with pytest.raises(ValueError, match="needs config="):
        engine.update_lora(_lora_state(1.0))
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        engine.update_lora(tmp_path)


def test_full_weight_update_reaches_the_worker_transformer(engine):
    pipeline = FakeOmni.instances[-1].pipeline
    before = engine.generate(PROMPTS[:2], SEEDS[:2], CFG)
    new = {"proj": torch.eye(8) * 0.5, "txt": torch.zeros(4, 8)}
    assert engine.update_weights(new) == 2
    assert torch.equal(pipeline.transformer.proj.detach(), new["proj"])
    assert not list(engine.work_dir.glob("weights_*.safetensors"))  # the transfer file is removed
    after = engine.generate(PROMPTS[:2], SEEDS[:2], CFG)
    assert not torch.equal(before.x_next, after.x_next)


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
        engine.update_weights({"proj": torch.eye(8)})
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
