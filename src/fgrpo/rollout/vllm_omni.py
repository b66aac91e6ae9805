"""Rollout on vLLM-Omni: the same Trajectory as the in-process engine, from vllm-omni's transformer kernels.

`VllmOmniEngine` implements `fgrpo.rollout.base.RolloutEngine` on `vllm_omni.Omni` (0.30.x, the
optional extra `vllm`) for the families of `fgrpo.rollout.vllm_omni_pipeline.ADAPTERS` (Qwen-Image, Qwen-Image-Edit, SD3.5,
Z-Image, FLUX.2 [klein] and [dev], Wan 2.2). The denoising loop runs on vllm-omni's worker inside fgrpo's subclass of vllm-omni's pipeline of the
family (e.g. `FgrpoQwenImagePipeline`), which calls `fgrpo.policy.transition`, so
the schedule, the SDE window, the step mean/std, the sampling and the log-prob are fgrpo's. Only the
transformer's kernels are vllm-omni's; their rounding differs from the trainer's, so with this engine
the trainer recomputes old log-probs and logs the per-timestep |rollout - trainer| gap.

Weight sync after an optimizer step:
- LoRA: `update_lora(...)` writes a PEFT directory per weight version and points every later request at
  it through a LoRARequest with a NEW integer id (vllm-omni caches adapters by id: reusing an id
  would silently keep the old weights). vllm-omni keeps `max_cpu_loras` = 1 adapter by default, so
  loading version k + 1 evicts version k.
- Full weights: `update_weights(state_dict)` writes a safetensors file and asks the worker (through
  fgrpo's worker extension) to load it into the live transformer: vllm-omni 0.30 has no weight-update
  RPC of its own for diffusion workers.
`sleep()` / `wake()` free and restore the engine's GPU memory (needs `enable_sleep_mode=True`) when the
trainer shares the GPU.

vllm and vllm_omni are imported only here and in the pipeline module, lazily; `import fgrpo` never
needs them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from fgrpo.config import SamplingConfig
from fgrpo.models.base import ImagePrompt
from fgrpo.models.lora import write_adapter
from fgrpo.models.qwen_image import QwenImage
from fgrpo.models.registry import FAMILIES
from fgrpo.rollout.base import Trajectory
from fgrpo.rollout.engine import check_request
from fgrpo.rollout.seeds import sample_generator
from fgrpo.rollout.vllm_omni_pipeline import (
    ADAPTERS,
    CFG_KEY,
    IMAGE_KEY,
    INFO_KEY,
    KEEP_KEY,
    MODEL_KEY,
    OPTIONAL_FIELDS,
    PIXELS_KEY,
    TRAJ_KEY,
    WORKER_EXTENSION_QUALNAME,
    FamilyAdapter,
    as_flow_model,
    config_to_dict,
    merge_cond,
    spec_from_dir,
    wan_settings,
)

SUPPORTED_SERIES = "0.30"
INSTALL_HINT = "install the extra: `uv sync --extra vllm` (vllm==0.30.0, vllm-omni==0.30.0)"


class VllmOmniUnavailable(ImportError):
    """vllm-omni is missing, or not the supported 0.30.x series."""


def import_vllm_omni() -> ModuleType:
    """Import vllm_omni and check its version; a one-line error naming the fix otherwise."""
    try:
        import vllm_omni  # pyright: ignore[reportMissingImports] - the optional `vllm` extra
    except ImportError as e:
        raise VllmOmniUnavailable(f"the vLLM-Omni rollout engine needs vllm-omni: {INSTALL_HINT}") from e
    try:
        # vllm_omni imports without vllm (documentation builds) but cannot run.
        import vllm  # pyright: ignore[reportMissingImports] - the optional `vllm` extra
    except ImportError as e:
        raise VllmOmniUnavailable(f"vllm-omni is installed but vllm is not: {INSTALL_HINT}") from e
    for name, module in (("vllm-omni", vllm_omni), ("vllm", vllm)):
        version = str(getattr(module, "__version__", "unknown"))
        if version.split(".")[:2] != SUPPORTED_SERIES.split("."):
            raise VllmOmniUnavailable(
                f"{name} {version} is installed but fgrpo's engine supports {SUPPORTED_SERIES}.x only: {INSTALL_HINT}"
            )
    return vllm_omni


def check_keep(keep: Sequence[str]) -> tuple[str, ...]:
    """`keep` as a tuple, or a one-line error naming a field the worker cannot send."""
    unknown = sorted(set(keep) - set(OPTIONAL_FIELDS))
    if unknown:
        raise ValueError(f"keep={list(keep)}: {unknown} not among {OPTIONAL_FIELDS}; name only those")
    return tuple(keep)


def adapter_for(kind: str) -> FamilyAdapter:
    """The vLLM-Omni adapter of model.kind (a tiny kind: its real family's), or a one-line error naming the
    supported families."""
    family = next((k for k, f in FAMILIES.items() if f.tiny == kind), kind)
    if family not in ADAPTERS:
        raise ValueError(
            f"rollout_engine='vllm_omni' supports model.kind in {tuple(ADAPTERS)}, got {kind!r}; "
            "use --rollout-engine diffusers"
        )
    return ADAPTERS[family]


def build_requests(
    prompts: Sequence[str],
    seeds: Sequence[int],
    cfg: SamplingConfig,
    lora_request: Any = None,
    lora_scale: float = 1.0,
    spec: QwenImage | None = None,
    keep: Sequence[str] = (),
    model_kwargs: Mapping[str, Any] | None = None,
    output_type: str = "pil",
) -> tuple[list[Any], Any]:
    """vllm-omni prompts (one per sample, carrying its seed and index) and the shared sampling params.

    `Omni.generate` takes one sampling-params object per stage for all prompts, so everything that
    differs per sample rides in the prompt's `additional_information`. The worker draws the sample's
    window and noise from `fgrpo.rollout.seeds.sample_generator(seed)`, as the in-process engine does.
    With `spec` (the checkpoint's configs), every check of the in-process engine runs here first.
    keep: the Trajectory's optional fields (`mean`, `x0`) the worker sends back besides the window's.
    model_kwargs: the family's model keywords the worker builds its FlowModel with (Wan: num_frames).
    output_type: the requests' output_type (FamilyAdapter.output_type: what lets the family's post-processing on the
    host pass the output envelope on).
    A prompt that names its condition image (fgrpo.models.base.ImagePrompt, the Edit family's) sends the file's
    absolute path as the request's `multi_modal_data["image"]`; the worker reads the file.
    """
    check_keep(keep)
    if spec is not None:
        check_request(as_flow_model(spec), prompts, seeds, cfg)
    elif len(prompts) == 0 or len(prompts) != len(seeds):
        raise ValueError(
            f"got {len(prompts)} prompts and {len(seeds)} seeds; pass one seed per prompt (at least one)"
        )
    for seed in seeds:
        sample_generator(int(seed))  # the seed range check, before any engine work
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams, OmniTextPrompt  # pyright: ignore[reportMissingImports] - the optional `vllm` extra

    requests = []
    for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
        info = {"seed": int(seed), "index": i}
        req = OmniTextPrompt(prompt=str(prompt), additional_information={INFO_KEY: info})
        if isinstance(prompt, ImagePrompt):
            req["multi_modal_data"] = {IMAGE_KEY: os.path.abspath(prompt.image)}
        if cfg.guidance_scale > 1.0:
            req["negative_prompt"] = cfg.negative_prompt or ""
        requests.append(req)
    params = OmniDiffusionSamplingParams(
        height=cfg.height,
        width=cfg.width,
        num_inference_steps=cfg.num_steps,
        true_cfg_scale=cfg.guidance_scale,
        seed=int(seeds[0]),  # vllm-omni builds its own generator from this; our loop ignores it
        output_type=output_type,
        lora_request=lora_request,
        lora_scale=lora_scale,
        extra_args={CFG_KEY: config_to_dict(cfg), KEEP_KEY: list(keep), MODEL_KEY: dict(model_kwargs or {})},
    )
    return requests, params


def unpack_outputs(outputs: Sequence[Any], prompts: Sequence[str], seeds: Sequence[int]) -> Trajectory:
    """OmniRequestOutputs (any order) -> one Trajectory in the caller's sample order."""
    by_index: dict[int, dict[str, Any]] = {}
    for out in outputs:
        if getattr(out, "finished", True) is False:  # lifecycle/streaming notices carry no result
            continue
        if getattr(out, "error", None):
            raise RuntimeError(f"vllm-omni request {getattr(out, 'request_id', '?')} failed: {out.error}")
        traj = (out.multimodal_output or {}).get(TRAJ_KEY)
        if traj is None:
            raise RuntimeError(
                "vllm-omni returned no fgrpo trajectory: the engine is not running fgrpo's pipeline "
                "(check custom_pipeline_args)"
            )
        by_index[int(traj["index"])] = traj
    if sorted(by_index) != list(range(len(prompts))):
        raise RuntimeError(f"vllm-omni returned samples {sorted(by_index)} for {len(prompts)} requests")
    trajs = [by_index[i] for i in range(len(prompts))]
    for i, (t, seed) in enumerate(zip(trajs, seeds)):
        if int(t["seed"]) != int(seed):
            raise RuntimeError(f"sample {i}: engine used seed {t['seed']}, expected {seed}")
    # the optional fields the request asked for (build_requests' keep); the others stay None
    optional = {k: torch.stack([t[k] for t in trajs]).float() for k in OPTIONAL_FIELDS if k in trajs[0]}
    return Trajectory(
        prompts=list(prompts),
        seeds=torch.tensor([int(s) for s in seeds], dtype=torch.int64),
        sigmas=trajs[0]["timesteps"].float(),
        window=torch.stack([t["window"] for t in trajs]).to(torch.int64),
        x_t=torch.stack([t["x_t"] for t in trajs]).float(),
        x_next=torch.stack([t["x_next"] for t in trajs]).float(),
        log_prob=torch.stack([t["log_probs"] for t in trajs]).float(),
        cond=merge_cond([t["cond"] for t in trajs]),
        images=torch.stack([t[PIXELS_KEY] for t in trajs]),  # the in-process engine's uint8 decode
        **optional,
    )


def write_peft_dir(path: str | os.PathLike[str], state_dict: Mapping[str, torch.Tensor], config: Any) -> Path:
    """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) atomically, through
    the trainer's adapter writer (fgrpo.models.lora.write_adapter).

    state_dict: PEFT-named LoRA tensors (`peft.get_peft_model_state_dict(transformer)`, gathered to full
    tensors when sharded). config: a `peft.LoraConfig` or its dict.
    """
    bad = [k for k in state_dict if not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if bad:
        raise ValueError(
            f"LoRA state dict key {bad[0]!r} is not PEFT-named (*.lora_A.weight / *.lora_B.weight); "
            "pass peft.get_peft_model_state_dict(transformer)"
        )
    return write_adapter(path, dict(state_dict), config)


def vllm_omni_lora_names(
    state_dict: Mapping[str, torch.Tensor],
    config: Any,
    renames: Sequence[tuple[str, str]] = ADAPTERS["qwen_image"].lora_renames,
) -> tuple[dict[str, torch.Tensor], dict]:
    """A diffusers/PEFT LoRA renamed to vllm-omni's module names: (state_dict, config dict).

    renames: (diffusers module name, vllm-omni's) of the family (FamilyAdapter.lora_renames; default
    Qwen-Image's). vllm-omni's Qwen-Image block holds the attention output projection as `attn.to_out` (a
    Linear), where diffusers has `attn.to_out.0` (the Linear inside a ModuleList with a Dropout); its weight
    loader maps the name, its LoRA loader does not, and rejects `to_out.0` as an unknown module (seen on the
    GPU). The other targets (to_q/k/v, add_*_proj, to_add_out, img_mlp.net.0.proj, ...) have the same names.
    """
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)

    def rename(name: str) -> str:
        for old, new in renames:
            name = name.replace(f".{old}.", f".{new}.")
        return name

    def rename_target(t: str) -> str:
        for old, new in renames:
            if t == old or t.endswith("." + old):
                t = t[: -len(old)] + new
        return t

    targets = cfg.get("target_modules")
    if isinstance(targets, str):  # a regex: rewrite the literal module name inside it
        for old, new in renames:
            targets = targets.replace(old, new).replace(re.escape(old), new)
        cfg["target_modules"] = targets
    elif targets is not None:
        cfg["target_modules"] = sorted({rename_target(t) for t in targets})
    return {rename(k): v for k, v in state_dict.items()}, cfg


def _check_rpc(method: str, results: Sequence[Any]) -> list[Any]:
    """vllm-omni reports an unsupported or failed control RPC as a dict instead of raising."""
    flat: list[Any] = []
    for r in results:
        flat.extend(r if isinstance(r, list) else [r])
    for r in flat:
        if isinstance(r, dict) and (r.get("error") or r.get("supported") is False or r.get("todo")):
            raise RuntimeError(f"vllm-omni {method} failed: {r.get('error') or r}")
        status = getattr(r, "status", None)
        if status is not None and status != "SUCCESS":
            raise RuntimeError(f"vllm-omni {method} failed: {getattr(r, 'error_msg', r)}")
    return flat


class VllmOmniEngine:
    """RolloutEngine on vllm_omni.Omni for the families of ADAPTERS (diffusers layout, local directory).

    Args:
        model: local diffusers directory of the family's pipeline (or a hub id vllm-omni can fetch; Wan needs a
            local one, whose model_index.json and scheduler config its adapter reads).
        kind: fgrpo's model.kind (a tiny kind stands for its family): picks vllm-omni's pipeline to subclass and
            fgrpo's model to wrap its modules in; other kinds are refused.
        model_kwargs: the family's model keywords (`fgrpo.models.wan.wan_kwargs`: Wan's num_frames and
            guidance_scale_2), sent with every request; the worker builds its FlowModel with them.
        max_batch: requests per worker forward call (vllm-omni's max_num_seqs); inside one call the rows
            run in micro-batches of SamplingConfig.micro_batch, as in-process. A multiple of micro_batch
            keeps the forward shapes (and so the rounding) of the in-process engine.
        batch_wait_ms: how long the scheduler waits to fill a batch (request_batch_max_wait_ms).
        enforce_eager: False lets vllm-omni torch.compile the transformer.
        enable_sleep_mode: required for sleep()/wake() (vllm-omni's CuMem pool).
        dtype: the engine's weight dtype.
        work_dir: where LoRA versions and full-weight files are written (the worker reads them by path).
        omni_kwargs: any further `vllm_omni.Omni` keyword (e.g. diffusion_attention_backend="TORCH_SDPA").
        keep: the Trajectory's optional fields every rollout returns, in the in-process engine's shapes: `mean`
            ([B, W, *latent], the window's transition means) and `x0` ([B, *latent], the final latents); the
            trainer passes its algorithm's `rollout_fields()`. The others stay None, so they never cross the
            process boundary.
    """

    def __init__(
        self,
        model: str,
        *,
        kind: str = "qwen_image",
        model_kwargs: Mapping[str, Any] | None = None,
        max_batch: int = 8,
        batch_wait_ms: float = 20.0,
        enforce_eager: bool = True,
        enable_sleep_mode: bool = False,
        dtype: str = "bfloat16",
        work_dir: str | os.PathLike[str] | None = None,
        omni_kwargs: Mapping[str, Any] | None = None,
        keep: Sequence[str] = (),
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.adapter = adapter_for(kind)
        # The Wan adapter reads the directory's model_index.json and scheduler config on the worker: a path
        # without them fails here, before vLLM-Omni starts. With two experts, one LoRA request cannot sync both.
        self.two_experts = self.adapter.kind == "wan" and wan_settings(model)["boundary_ratio"] is not None
        self.model_kwargs = dict(model_kwargs or {})
        json.dumps(self.model_kwargs)  # they cross a process boundary inside extra_args: plain values only
        self.keep = check_keep(keep)
        import_vllm_omni()
        from vllm_omni.entrypoints.omni import Omni  # pyright: ignore[reportMissingImports] - the optional `vllm` extra

        self.work_dir = (
            Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="fgrpo-vllm-omni-"))
        )
        self.work_dir.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {
            "model": str(model),
            "custom_pipeline_args": {"pipeline_class": self.adapter.qualname},
            "worker_extension_cls": WORKER_EXTENSION_QUALNAME,
            "max_num_seqs": max_batch,
            "request_batch_max_wait_ms": batch_wait_ms,
            "enforce_eager": enforce_eager,
            "enable_sleep_mode": enable_sleep_mode,
            "dtype": dtype,
        }
        if self.adapter.request_arch is not None:
            kwargs["model_class_name"] = self.adapter.request_arch
        kwargs.update(omni_kwargs or {})
        self.sleep_enabled = enable_sleep_mode
        # the weights' torch dtype, which vLLM-Omni's LoRA manager casts adapters to ("auto": unknown here)
        named = getattr(torch, dtype, None)
        self.dtype = named if isinstance(named, torch.dtype) else None
        self.omni = Omni(**kwargs)
        # Configs of the resolved local directory (Omni downloads hub ids) for host-side request checks
        # (Qwen-Image's; another family's requests are checked on the worker, by the same check_request).
        self.path = str(getattr(self.omni, "model", model))
        self.spec = spec_from_dir(self.path) if self.adapter.kind == "qwen_image" else None
        self.lora_request: Any = None  # the adapter every later request uses; None = base weights
        self.lora_scale = 1.0
        self.weight_version = 0
        self.asleep = False

    # -- rollout ---------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str], seeds: Sequence[int], cfg: SamplingConfig) -> Trajectory:
        if self.asleep:
            raise RuntimeError("VllmOmniEngine.generate() while asleep: call wake() after the training step")
        requests, params = build_requests(
            prompts,
            seeds,
            cfg,
            self.lora_request,
            self.lora_scale,
            self.spec,
            self.keep,
            self.model_kwargs,
            self.adapter.output_type,
        )
        outputs = self.omni.generate(requests, params, use_tqdm=False)
        return unpack_outputs(list(outputs), prompts, seeds)

    # -- weight sync -----------------------------------------------------------------------------
    def update_lora(
        self,
        source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
        config: Any = None,
        *,
        scale: float = 1.0,
    ) -> Any:
        """Use new LoRA weights from the next generate() on; returns the LoRARequest.

        source: a PEFT adapter directory (e.g. the trainer's export), or a PEFT-named state dict with its
        `config` (peft.LoraConfig; the trainer's `models.lora.lora_file_tensors`). Either way the engine gets a
        fresh directory and a fresh adapter id, because vllm-omni would otherwise serve the cached adapter of the
        same id. Floating tensors are written in the engine's dtype: its LoRA manager casts them to it on
        loading (`Tensor.to`, before it scales B), so the engine computes the same and reads half the bytes of
        fp32 masters.
        """
        if self.two_experts:
            # one LoRARequest reaches one set of names; the trainer's second expert would not be synced
            raise ValueError(
                "update_lora: a two-expert Wan (T2V-A14B) cannot take one LoRA on vLLM-Omni here; "
                "use a one-expert Wan (TI2V-5B) or --rollout-engine diffusers"
            )
        if isinstance(source, Mapping):
            if config is None:
                raise ValueError("update_lora(state_dict) needs config= (the peft.LoraConfig of the adapter)")
        else:
            src = Path(source)
            if not (src / "adapter_config.json").is_file():
                raise ValueError(
                    f"update_lora: {src} is not a PEFT adapter directory (no adapter_config.json)"
                )
            from safetensors.torch import load_file

            source = load_file(str(src / "adapter_model.safetensors"))
            config = json.loads((src / "adapter_config.json").read_text())
        self.weight_version += 1
        v = self.weight_version
        dst = self.work_dir / f"lora_v{v:06d}"
        tensors, cfg = vllm_omni_lora_names(source, config, self.adapter.lora_renames)
        if self.dtype is not None:
            tensors = {k: t.to(self.dtype) if t.is_floating_point() else t for k, t in tensors.items()}
        write_peft_dir(dst, tensors, cfg)
        from vllm.lora.request import LoRARequest  # pyright: ignore[reportMissingImports] - the optional `vllm` extra

        self.lora_request = LoRARequest(lora_name=f"fgrpo_v{v}", lora_int_id=v, lora_path=str(dst))
        self.lora_scale = scale
        old = self.work_dir / f"lora_v{v - 2:06d}"  # keep the previous version: a request may still load it
        shutil.rmtree(old, ignore_errors=True)
        return self.lora_request

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Load full transformer weights (diffusers names, e.g. from the trainer's gathered state dict).

        Goes through a safetensors file on the local filesystem: the engine's worker runs on this host.
        Returns the number of parameters the worker loaded.
        """
        from safetensors.torch import save_file

        if self.asleep:
            raise RuntimeError("VllmOmniEngine.update_weights() while asleep: call wake() first")
        self.weight_version += 1
        path = self.work_dir / f"weights_v{self.weight_version:06d}.safetensors"
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}, str(path))
        try:
            results = _check_rpc(
                "fgrpo_load_transformer_weights",
                self.omni.engine.collective_rpc("fgrpo_load_transformer_weights", args=(str(path),)),
            )
        finally:
            path.unlink(missing_ok=True)
        return int(max((r for r in results if isinstance(r, int)), default=0))

    # -- sharing the GPU with the trainer ----------------------------------------------------------
    def sleep(self) -> None:
        """Offload weights to CPU (level 1) and free the engine's GPU memory until wake()."""
        if not self.sleep_enabled:
            raise RuntimeError("VllmOmniEngine.sleep() needs VllmOmniEngine(..., enable_sleep_mode=True)")
        if self.asleep:
            return
        _check_rpc("sleep", self.omni.engine.collective_rpc("sleep", args=(1,)))
        self.asleep = True

    def wake(self) -> None:
        if not self.asleep:
            return
        _check_rpc("wake_up", self.omni.engine.collective_rpc("wake_up", kwargs={"tags": None}))
        self.asleep = False

    def close(self) -> None:
        self.omni.close()
