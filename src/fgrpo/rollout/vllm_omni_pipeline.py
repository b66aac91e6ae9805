"""The worker side of the vLLM-Omni engine: a Qwen-Image pipeline whose `forward` is fgrpo's rollout.

vllm-omni 0.30 lets a caller replace a model's pipeline class through
`Omni(..., custom_pipeline_args={"pipeline_class": "<module>.<qualname>"})`; its worker imports the
class by that name and calls `forward(req: DiffusionRequestBatch) -> list[DiffusionOutput]`, one output
per request, under `torch.inference_mode()`. We subclass its `QwenImagePipeline` to keep everything it
loads (text encoder, VAE, its fused-kernel transformer, its LoRA manager) and replace only `forward`:
it wraps those modules in fgrpo's own `QwenImage` FlowModel and runs fgrpo's in-process engine
(`fgrpo.rollout.engine.DiffusersEngine`) on them. So the prompt template, latent packing, true CFG, the
schedule, the per-sample generators and SDE windows, `fgrpo.policy.transition` and the VAE decode are
the very code the in-process engine and the trainer run; only the transformer's kernels are vllm-omni's.

Everything except the two classes at the bottom imports without vllm: the classes are built on first
attribute access (module `__getattr__`), which is exactly what vllm's `resolve_obj_by_qualname` does
(`import_module`, then `getattr`).

Per-request data travels in the prompt's `additional_information` dict (vllm-omni keeps it on the
request; one sampling-params object serves all prompts of an `Omni.generate` call): the sample's seed
and index. The trajectory returns in the output envelope's `payload["trajectory"]`, which vllm-omni
passes through to `OmniRequestOutput.multimodal_output["trajectory"]`.

What travels back per sample (fp32 unless said; `latent` = QwenImage.latent_shape, [16, H/8, W/8] for
Qwen-Image, 64 KiB per 256 px squared: 256 KiB at 512², 1 MiB at 1024²): the window's x_t and x_next
([W, *latent] each), its log-probs [W], the window's step indices, the sigmas [T + 1], the prompt embeddings
and masks (and the negative pair with CFG), and only those of the Trajectory's optional fields that the
request names in `sampling_params.extra_args[KEEP_KEY]`, which the trainer sets to what its algorithm reads
(`Algorithm.rollout_fields`): `mean` [W, *latent] (Flow-DPPO's old means, when it reuses the rollout's
log-probs) and `x0` [*latent] (the clean latents DiffusionNFT and AWM train on).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from fgrpo.config import SamplingConfig
from fgrpo.models.base import Cond, FlowModel
from fgrpo.models.common import pad_to
from fgrpo.models.qwen_image import QwenImage
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
# QwenImage.encode's keys, as (embeds, mask) pairs; the negative pair exists only with CFG.
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
        img_shapes: list[tuple[int, int, int]],
        return_dict: bool = False,
    ) -> tuple[torch.Tensor]:
        B = hidden_states.shape[0]
        out = self.inner(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            encoder_hidden_states_mask=encoder_hidden_states_mask,
            timestep=timestep,
            img_shapes=[[tuple(s)] for s in img_shapes],
            txt_seq_lens=[int(encoder_hidden_states.shape[1])] * B,
            guidance=None,  # Qwen-Image has no guidance embedding; true CFG happens in QwenImage.velocity
            attention_kwargs={},
            return_dict=False,
        )
        return (out[0],)


def flow_model(pipeline: QwenImagePipeline) -> QwenImage:
    """fgrpo's QwenImage FlowModel on the modules vllm-omni loaded (shared, not copied)."""
    scheduler: Any = pipeline.scheduler  # diffusers types from_pretrained's result loosely
    transformer: Any = OmniTransformer(pipeline.transformer)
    return QwenImage(
        transformer,
        pipeline.vae,
        pipeline.text_encoder,
        pipeline.tokenizer,
        scheduler_config=scheduler.config,
    )


def as_flow_model(model: QwenImage) -> FlowModel:
    """QwenImage is a FlowModel (tests check it at runtime); pyright cannot tell, because it does not
    see diffusers' QwenImageTransformer2DModel (QwenImage.transformer's annotation) as an nn.Module."""
    return cast(FlowModel, model)


def request_info(prompt: Any) -> dict[str, Any]:
    """The fgrpo per-sample record of one vllm-omni prompt; a clear error if the caller did not set it."""
    info = prompt.get("additional_information", {}).get(INFO_KEY) if isinstance(prompt, dict) else None
    if info is None:
        raise ValueError(
            "FgrpoQwenImagePipeline needs prompt['additional_information']['fgrpo'] (seed, index); "
            "drive it through fgrpo.rollout.vllm_omni.VllmOmniEngine"
        )
    return info


def split_trajectory(
    traj: Trajectory, indices: Sequence[int], keep: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """One plain dict of CPU tensors per sample (what crosses vllm-omni's process boundary).

    Latents, log-probs, sigmas and prompt embeddings travel in fp32; masks as bool. keep: the optional fields
    (OPTIONAL_FIELDS) to send as well, each under its Trajectory name.
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
        }
        for k, v in traj.cond.items():
            d[k] = (v[b].float() if v.is_floating_point() else v[b]).cpu()
        for name in keep:
            value = getattr(traj, name)
            assert value is not None, f"the in-process engine fills Trajectory.{name}"
            d[name] = value[b].float().cpu()
        out.append(d)
    return out


def merge_cond(per_sample: Sequence[Cond]) -> Cond:
    """Stack per-sample conditioning of different text lengths: zero embeds, False mask on the padding."""
    out: Cond = {}
    for emb_key, mask_key in COND_PAIRS:
        if emb_key not in per_sample[0]:
            continue
        L = max(c[emb_key].shape[0] for c in per_sample)
        pairs = [pad_to(c[emb_key][None], c[mask_key][None], L) for c in per_sample]
        out[emb_key] = torch.cat([e for e, _ in pairs])
        out[mask_key] = torch.cat([m for _, m in pairs]).bool()
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


def run_batch(
    flow: QwenImage, prompts: Sequence[Any], cfg: SamplingConfig, keep: Sequence[str] = ()
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """One vllm-omni request batch through fgrpo's in-process engine.

    Returns images [B, 3, H, W] in [-1, 1] (vllm-omni's Qwen-Image post-processing turns them into
    PIL; they are QwenImage.decode's uint8 pixels, mapped back exactly) and one trajectory per request,
    with the optional fields named in `keep`.
    """
    infos = [request_info(p) for p in prompts]
    texts = [p["prompt"] for p in prompts]
    traj = DiffusersEngine(as_flow_model(flow)).generate(texts, [int(i["seed"]) for i in infos], cfg)
    images = (
        traj.images.permute(0, 3, 1, 2).float() / 255 * 2 - 1
    )  # uint8 -> [-1, 1], inverted by postprocess
    return images, split_trajectory(traj, [int(i["index"]) for i in infos], keep)


_CLASSES: dict[str, type] = {}


def _build_classes() -> dict[str, type]:
    """Subclass vllm-omni's pipeline and worker extension (imports vllm_omni; the worker process calls this)."""
    if _CLASSES:
        return _CLASSES
    # vllm-omni is the optional `vllm` extra: without it these do not resolve (nor run).
    from vllm_omni.diffusion.data import DiffusionOutput  # pyright: ignore[reportMissingImports]
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline  # pyright: ignore[reportMissingImports]
    from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension  # pyright: ignore[reportMissingImports]
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch  # pyright: ignore[reportMissingImports]

    class FgrpoQwenImagePipeline(QwenImagePipeline):
        """vllm-omni's Qwen-Image pipeline with fgrpo's Flow-GRPO rollout as `forward`."""

        supports_request_batch = True
        supports_step_execution = False  # fgrpo's loop runs whole requests; no per-step scheduling
        _fgrpo_flow: QwenImage | None = None

        def forward(self, req: DiffusionRequestBatch) -> list[DiffusionOutput]:
            if self._fgrpo_flow is None:  # built once: its prompt cache then lives as long as the engine
                self._fgrpo_flow = flow_model(self)
            params = req.sampling_params_list[0]
            extra = params.extra_args or {}
            if CFG_KEY in extra:
                images, trajs = run_batch(
                    self._fgrpo_flow, req.prompts, config_from_dict(extra[CFG_KEY]), extra.get(KEEP_KEY, ())
                )
                payloads = [{"image": images[b : b + 1], TRAJ_KEY: t} for b, t in enumerate(trajs)]
            else:  # vllm-omni's start-up warm-up request (and any plain request): same model path, ODE
                cfg, texts, seeds = plain_request(params, req.prompts)
                u8 = DiffusersEngine(as_flow_model(self._fgrpo_flow)).generate(texts, seeds, cfg).images
                images = u8.permute(0, 3, 1, 2).float() / 255 * 2 - 1
                payloads = [{"image": images[b : b + 1]} for b in range(len(texts))]
            return [DiffusionOutput(output={"payload": p, "metadata": {}}, to_cpu=True) for p in payloads]

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

    for cls in (FgrpoQwenImagePipeline, FgrpoWorkerExtension):
        # vllm resolves classes by "<module>.<qualname>"; make that name point here.
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        _CLASSES[cls.__name__] = cls
    return _CLASSES


def __getattr__(name: str) -> type:
    if name in ("FgrpoQwenImagePipeline", "FgrpoWorkerExtension"):
        return _build_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
