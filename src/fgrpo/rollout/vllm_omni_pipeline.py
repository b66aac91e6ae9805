"""The worker side of the vLLM-Omni engine: a Qwen-Image pipeline whose denoising loop is fgrpo's.

vllm-omni 0.30 lets a caller replace a model's pipeline class through
`Omni(..., custom_pipeline_args={"pipeline_class": "<module>.<qualname>"})`; its worker imports the
class by that name and calls `forward(req: DiffusionRequestBatch) -> list[DiffusionOutput]`, one output
per request, under `torch.inference_mode()`. We subclass its `QwenImagePipeline` to keep everything it
loads (text encoder, VAE, its fused-kernel transformer, its LoRA manager) and replace only `forward`:
the loop below goes through `fgrpo.policy.transition` (the kernel the trainer differentiates) and
`fgrpo.core` (schedule, sampling, log-prob), so the engine carries no second copy of the Flow-GRPO math.

Everything except the two classes at the bottom is plain torch and imports without vllm: the classes
are built on first attribute access (module `__getattr__`), which is exactly what vllm's
`resolve_obj_by_qualname` does (`import_module` then `getattr`).

Per-request data travels in the prompt's `additional_information` dict (vllm-omni keeps it on the
request; sampling params are shared by all prompts of one `Omni.generate` call): the sample's seed,
SDE window and index. The trajectory returns in the output envelope's `payload["trajectory"]`, which
vllm-omni passes through to `OmniRequestOutput.multimodal_output["trajectory"]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fgrpo import policy
from fgrpo.core import guidance, schedule, sde
from fgrpo.models.base import Cond
from fgrpo.rollout.base import SamplingConfig

if (
    TYPE_CHECKING
):  # the static check runs against vllm-omni 0.30's real classes; runtime never imports them here
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

# Keys shared with the engine (fgrpo.rollout.vllm_omni); the engine side imports them from here.
INFO_KEY = "fgrpo"  # prompt["additional_information"][INFO_KEY] = {"seed", "window", "index"}
CFG_KEY = "fgrpo_cfg"  # sampling_params.extra_args[CFG_KEY] = SamplingConfig fields
TRAJ_KEY = "trajectory"  # payload key that vllm-omni forwards to multimodal_output
COND_KEYS = ("prompt_embeds", "prompt_embeds_mask", "neg_prompt_embeds", "neg_prompt_embeds_mask")

PIPELINE_QUALNAME = f"{__name__}.FgrpoQwenImagePipeline"
WORKER_EXTENSION_QUALNAME = f"{__name__}.FgrpoWorkerExtension"

# Distinct streams per sample: the window draw must not reuse the bits of the initial noise.
_NOISE_STREAM, _WINDOW_STREAM = 0, 1
_MASK63 = (1 << 63) - 1


def sample_generator(seed: int, stream: int = _NOISE_STREAM) -> torch.Generator:
    """A CPU generator for one sample: results depend only on (seed, stream), never on batch layout.

    CPU so that the same seed draws the same noise on any device (a CUDA generator would not).
    """
    return torch.Generator(device="cpu").manual_seed((int(seed) * 1_000_003 + stream) & _MASK63)


def sample_window(seed: int, cfg: SamplingConfig) -> torch.Tensor:
    """The SDE window [W] int64 of one sample, drawn by fgrpo.core.schedule.sample_windows."""
    lo, hi = cfg.window_range
    gen = sample_generator(seed, _WINDOW_STREAM)
    return schedule.sample_windows(1, cfg.window_size, lo, hi, gen)[0].to(torch.int64)


def config_to_dict(cfg: SamplingConfig) -> dict[str, Any]:
    """SamplingConfig as plain JSON-able values (it crosses a process boundary inside extra_args)."""
    return {
        "height": cfg.height,
        "width": cfg.width,
        "num_steps": cfg.num_steps,
        "guidance_scale": cfg.guidance_scale,
        "negative_prompt": cfg.negative_prompt,
        "sde_kind": cfg.sde_kind,
        "noise_level": cfg.noise_level,
        "window_size": cfg.window_size,
        "window_range": list(cfg.window_range),
        "micro_batch": cfg.micro_batch,
    }


def config_from_dict(d: dict[str, Any]) -> SamplingConfig:
    d = dict(d)
    d["window_range"] = tuple(d["window_range"])
    return SamplingConfig(**d)


@dataclass
class Rollout:
    """What `rollout_loop` returns for a batch of B samples (fp32; W window steps)."""

    x0: torch.Tensor  # [B, *latent], the final clean latents
    x_t: torch.Tensor  # [B, W, *latent]
    x_next: torch.Tensor  # [B, W, *latent]
    log_prob: torch.Tensor  # [B, W]


def rollout_loop(
    model: Any,
    x: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Cond,
    cfg: SamplingConfig,
    windows: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> Rollout:
    """Integrate from x (noise at sigmas[0]) to sigmas[-1]: SDE steps inside each sample's window, ODE outside.

    Every step goes through `fgrpo.policy.transition`, splitting the batch into the rows whose window
    contains the step (stochastic) and the rest (Euler), so per-sample windows cost no extra forward.
    SDE noise for sample b comes from generators[b] in step order, so a sample's result does not
    depend on which other samples share its batch.

    Args:
        model: a FlowModel (only `velocity` is used, through `transition`).
        x: [B, *latent] initial noise. sigmas: [T + 1] fp32.
        cond: conditioning with [B] rows. windows: [B, W] int64 step indices (sorted).
        generators: B CPU generators, one per sample.
    Returns:
        Rollout with x0, x_t, x_next [B, W, *latent] and log_prob [B, W], all fp32.
    """
    B, W = windows.shape
    T = sigmas.numel() - 1
    device = x.device
    x = x.float()
    in_window_all = schedule.window_mask(windows, T).to(device)  # [B, T]
    windows_dev = windows.to(device)
    x_t = x.new_zeros((B, W, *x.shape[1:]))
    x_next = x.new_zeros((B, W, *x.shape[1:]))
    log_prob = x.new_zeros((B, W))
    sig = sigmas.to(device=device, dtype=torch.float32)
    for i in range(T):
        in_window = windows_dev == i  # [B, W]
        sde_rows = in_window_all[:, i]  # [B]
        new_x = torch.empty_like(x)
        for stochastic in (True, False):
            rows = torch.nonzero(sde_rows if stochastic else ~sde_rows).flatten()
            if rows.numel() == 0:
                continue
            sigma = sig[i].expand(rows.numel())
            sigma_next = sig[i + 1].expand(rows.numel())
            sub_cond = {k: v[rows] for k, v in cond.items()}
            mean, std = policy.transition(
                model, x[rows], sigma, sigma_next, sub_cond, cfg, stochastic=stochastic
            )
            if not stochastic:
                new_x[rows] = mean
                continue
            noise = torch.stack(
                [torch.randn(mean.shape[1:], generator=generators[int(b)]) for b in rows.tolist()]
            )
            xn = sde.sample(mean, std, noise.to(device=device, dtype=mean.dtype))
            lp = sde.log_prob(xn, mean, std)
            slot = in_window[rows].float().argmax(dim=1)  # which of the W window slots step i is
            x_t[rows, slot] = x[rows]
            x_next[rows, slot] = xn
            log_prob[rows, slot] = lp.float()
            new_x[rows] = xn
        x = new_x
    return Rollout(x0=x, x_t=x_t, x_next=x_next, log_prob=log_prob)


def pad_cond(conds: Sequence[Cond]) -> Cond:
    """Concatenate per-request conditioning whose text length differs: zero-pad embeds and masks.

    Padding is masked (mask 0), so the velocity of a padded row equals the unpadded one up to kernel
    rounding (diffusers and vllm-omni both right-pad prompts of one batch the same way).
    """
    out: Cond = {}
    for key in conds[0]:
        parts = [c[key] for c in conds]
        if parts[0].dim() >= 2:
            L = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, L - p.shape[1])) for p in parts]
        out[key] = torch.cat(parts)
    return out


class OmniQwenFlow:
    """FlowModel view of a vllm-omni QwenImagePipeline: velocity through its transformer, fgrpo's true-CFG.

    Only what the rollout loop needs: `velocity` and `sigmas`. img_shapes depend on the resolution,
    which the packed latent no longer carries, so the adapter is built per resolution.
    """

    def __init__(self, pipeline: QwenImagePipeline, height: int, width: int):
        self.pipeline = pipeline
        self.transformer: Any = pipeline.transformer  # nn.Module attributes type as Tensor | Module
        self.height, self.width = height, width
        self.patch = pipeline.vae_scale_factor * 2  # 8x VAE, then 2x2 packing

    def latent_shape(self, height: int, width: int) -> tuple[int, int]:
        return ((height // self.patch) * (width // self.patch), self.transformer.in_channels)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        # The shift constants come from the checkpoint's scheduler config (a tiny test model's may differ
        # from Qwen/Qwen-Image's), exactly as diffusers' pipeline would read them.
        scheduler: Any = self.pipeline.scheduler  # diffusers types from_pretrained's result loosely
        c = scheduler.config
        return schedule.qwen_image_sigmas(
            num_steps,
            self.latent_shape(height, width)[0],
            base_seq_len=c.get("base_image_seq_len", 256),
            max_seq_len=c.get("max_image_seq_len", 4096),
            base_shift=c.get("base_shift", 0.5),
            max_shift=c.get("max_shift", 1.15),
            shift_terminal=c.get("shift_terminal", None),
        )

    def _forward(
        self, x_t: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        B = x_t.shape[0]
        dtype = embeds.dtype
        img_shapes = [[(1, self.height // self.patch, self.width // self.patch)]] * B
        out = self.transformer(
            hidden_states=x_t.to(dtype),
            timestep=sigma.to(dtype),  # Qwen-Image's transformer takes t = sigma (diffusers divides by 1000)
            guidance=None,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            img_shapes=img_shapes,
            txt_seq_lens=[int(embeds.shape[1])] * B,  # vllm-omni sizes text RoPE by the padded width
            attention_kwargs={},
            return_dict=False,
        )
        return out[0].float()

    def velocity(
        self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Cond, *, guidance_scale: float
    ) -> torch.Tensor:
        v = self._forward(x_t, sigma, cond["prompt_embeds"], cond["prompt_embeds_mask"])
        if guidance_scale > 1.0 and "neg_prompt_embeds" in cond:
            v_neg = self._forward(x_t, sigma, cond["neg_prompt_embeds"], cond["neg_prompt_embeds_mask"])
            v = guidance.true_cfg(v, v_neg, guidance_scale)
        return v


def request_info(prompt: Any) -> dict[str, Any]:
    """The fgrpo per-sample record of one vllm-omni prompt; a clear error if the caller did not set it."""
    info = prompt.get("additional_information", {}).get(INFO_KEY) if isinstance(prompt, dict) else None
    if info is None:
        raise ValueError(
            "FgrpoQwenImagePipeline needs prompt['additional_information']['fgrpo'] (seed, window, index); "
            "drive it through fgrpo.rollout.vllm_omni.VllmOmniEngine"
        )
    return info


def run_batch(
    pipeline: Any, prompts: Sequence[Any], cfg: SamplingConfig
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Encode, denoise with fgrpo's loop and decode one request batch on the worker.

    Returns the decoded images [B, 3, H, W] in [-1, 1] (vllm-omni's own post-processing turns them
    into PIL) and one trajectory dict per request (fp32 CPU tensors).
    """
    infos = [request_info(p) for p in prompts]
    texts = [p["prompt"] for p in prompts]
    device = pipeline.device
    flow = OmniQwenFlow(pipeline, cfg.height, cfg.width)
    emb, mask = pipeline.encode_prompt(prompt=texts, max_sequence_length=pipeline.tokenizer_max_length)
    cond: Cond = {"prompt_embeds": emb, "prompt_embeds_mask": mask}
    if cfg.guidance_scale > 1.0:
        neg = [cfg.negative_prompt or ""] * len(texts)
        neg_emb, neg_mask = pipeline.encode_prompt(
            prompt=neg, max_sequence_length=pipeline.tokenizer_max_length, prompt_name="negative_prompt"
        )
        cond.update(neg_prompt_embeds=neg_emb, neg_prompt_embeds_mask=neg_mask)
    shape = flow.latent_shape(cfg.height, cfg.width)
    gens = [sample_generator(int(info["seed"])) for info in infos]
    x = torch.stack([torch.randn(shape, generator=g) for g in gens]).to(device)
    sigmas = flow.sigmas(cfg.num_steps, cfg.height, cfg.width)
    windows = torch.tensor([list(info["window"]) for info in infos], dtype=torch.int64)
    pipeline.transformer.do_true_cfg = "neg_prompt_embeds" in cond
    out = rollout_loop(flow, x, sigmas, cond, cfg, windows, gens)
    images = pipeline._decode_latents(out.x0.to(emb.dtype), cfg.height, cfg.width, output_type="pt").output
    trajs = []
    for b, info in enumerate(infos):
        traj: dict[str, Any] = {
            "index": int(info["index"]),
            "seed": int(info["seed"]),
            "window": windows[b].clone(),
            "timesteps": sigmas.float().cpu(),
            "x_t": out.x_t[b].cpu(),
            "x_next": out.x_next[b].cpu(),
            "log_probs": out.log_prob[b].cpu(),
        }
        for k, v in cond.items():
            traj[k] = (v[b].float() if v.is_floating_point() else v[b]).cpu()
        trajs.append(traj)
    return images, trajs


_CLASSES: dict[str, type] = {}


def _build_classes() -> dict[str, type]:
    """Subclass vllm-omni's pipeline and worker extension (imports vllm_omni; the worker process calls this)."""
    if _CLASSES:
        return _CLASSES
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline
    from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

    class FgrpoQwenImagePipeline(QwenImagePipeline):
        """vllm-omni's Qwen-Image pipeline with fgrpo's Flow-GRPO rollout loop as `forward`."""

        supports_request_batch = True
        supports_step_execution = False  # our loop runs whole requests; no per-step scheduling

        def forward(self, req: DiffusionRequestBatch) -> list[DiffusionOutput]:
            cfg = config_from_dict(req.sampling_params_list[0].extra_args[CFG_KEY])
            self._guidance_scale = cfg.guidance_scale
            self._attention_kwargs = {}
            self._current_timestep = None
            self._interrupt = False
            images, trajs = run_batch(self, req.prompts, cfg)
            return [
                DiffusionOutput(
                    output={"payload": {"image": images[b : b + 1], TRAJ_KEY: traj}, "metadata": {}},
                    to_cpu=True,
                )
                for b, traj in enumerate(trajs)
            ]

    class FgrpoWorkerExtension(CustomPipelineWorkerExtension):
        """Adds full-weight sync to the diffusion worker (vllm-omni 0.30 has no weight-update RPC)."""

        model_runner: Any  # provided by the DiffusionWorker this extension is mixed into

        def fgrpo_load_transformer_weights(self, path: str) -> int:
            """Load a safetensors file of diffusers-named transformer weights into the live transformer."""
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
