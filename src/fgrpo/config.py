"""Config sections shared by the experiment files, and their validation.

An experiment file composes these into its own `Config` (with its own defaults) and tyro turns the
field docstrings into `--help`. Nothing here is mutated after parsing; derived values are properties.
`validate_config` refuses every bad value in one line naming the field, before anything is built; the settings
one algorithm cannot train with are that algorithm's own check (fgrpo.algorithms: `Algorithm.check`, and
`check_config`, which runs both).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Literal

from fgrpo.core.sde import Kind
from fgrpo.errors import ConfigError

TORCHAO_MISSING = (
    "model.fp8_rollout / model.fp8_train run torchao's float8 matmuls and torchao is missing; "
    "uv sync --extra fp8"
)


@dataclass(frozen=True)
class ModelConfig:
    kind: Literal[
        "qwen_image",
        "qwen_image_edit",
        "sd3",
        "flux",
        "zimage",
        "ltx2",
        "textbed",
        "tiny_qwen_image",
        "tiny_qwen_image_edit",
        "tiny_sd3",
        "tiny_flux",
        "tiny_zimage",
        "tiny_ltx2",
        "flux2",
        "tiny_flux2",
        "flux2_dev",
        "tiny_flux2_dev",
        "wan",
        "tiny_wan",
        "bagel",
        "tiny_bagel",
    ] = "qwen_image"
    """Which generator: real Qwen-Image / Qwen-Image-Edit / SD3.5 / FLUX.1-dev / FLUX.2 [klein] (flux2) / FLUX.2 [dev]
    (flux2_dev) / Z-Image / LTX-2 (text to audio-video), the pretrained tiny text renderer, or tiny random models. The
    edit kinds need prompts that name a condition image (.jsonl rows {"prompt": ..., "image": path})."""
    path: str = "Qwen/Qwen-Image"
    """Local diffusers directory or hub id (ignored by the tiny kinds; textbed: a checkpoint folder, '' = the bundled
    renderer, 'sd3' = the bundled SD3-architecture renderer)."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype of the transformer (FSDP2 param_dtype). Masters, latents and SDE math stay fp32."""
    lora: bool = True
    """Train LoRA adapters (True) or all transformer weights (False)."""
    lora_rank: int = 64
    """LoRA rank r."""
    lora_alpha: int = 128
    """LoRA alpha (the update is scaled by alpha / r)."""
    # The default kind's targets (models.registry's `lora_targets` of qwen_image; tests/models/test_registry.py
    # holds the two equal), spelled out so this module needs no model code.
    lora_targets: str = (
        "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,"
        "img_mlp.net.0.proj,img_mlp.net.2,txt_mlp.net.0.proj,txt_mlp.net.2"
    )
    """Comma-separated module names inside the transformer that get LoRA adapters."""
    gradient_checkpointing: bool = True
    """Recompute block activations in backward (less memory, ~30 % more compute)."""
    checkpoint_policy: Literal["full", "selective"] = "full"
    """With gradient_checkpointing, what backward recomputes: 'full' each block's whole forward, 'selective' only the
    pointwise ops (the outputs of matmuls and attention are kept: less compute than full, more memory; the same
    numbers)."""
    attention_backend: str = ""
    """diffusers attention backend name (e.g. 'native', '_native_cudnn', '_flash_3'); '' keeps the default. It reaches
    models whose attention goes through diffusers' dispatcher (Qwen-Image, LTX-2, FLUX), not diffusers' SD3, which
    calls torch SDPA itself (refused there). benchmarks/attention.py measures the choices."""
    init_lora: str = ""
    """Start from this LoRA instead of a fresh one: a directory (or .safetensors file) in the layout fgrpo exports
    and diffusers' `save_lora_weights` writes. Its rank, alpha and targets must match model.lora_*."""
    compile: bool = False
    """Regional torch.compile of the transformer blocks (1.32x the eager step on an H200) and torch.compile of the VAE
    decoder (fewer seconds per rollout; benchmarks/RESULTS.md measures both). With rollout_engine='vllm_omni' the
    engine compiles its own copy too (vLLM-Omni's torch.compile instead of its eager mode)."""
    exact_rollout: bool = True
    """With compile: run the rollout's SDE-window forwards through the training graph (autograd on, dropped at
    once), so the first update reproduces the rollout's log-probs exactly. Off, the compiled no-grad rollout and
    the training forward differ by ~1e-4 in log-prob and small clip ranges need grpo.old_log_prob='recompute'."""
    merged_rollout: bool = False
    """Rollout steps at which no sample of a micro-batch is inside its SDE window (their forwards make states, not
    trained log-probs) run each LoRA layer as one matmul with a merged bf16 copy of W + (alpha / r) B A, instead of
    the base matmul plus the adapter's two. The window's forwards keep the adapters, so the trained log-probs keep
    their bits; the other states differ from the unmerged forward's by rounding. Costs one bf16 copy of every
    adapted weight during the rollout. Needs model.lora, parallel.shard='adapters' and the diffusers engine."""
    fp8_rollout: bool = False
    """With merged_rollout: keep the merged copies as float8 (e4m3) and run those forwards as float8 matmuls, the
    activations quantized as they come (torchao's float8 tensors; `uv sync --extra fp8`). The window's forwards
    and training keep the adapters and their dtype, so the trained log-probs keep their bits. The float8 copy
    takes the bf16 copy's place (half its memory)."""
    fp8_train: bool = False
    """The frozen base matmul of every merged LoRA layer (model.merged_rollout's targets) as a float8 matmul in
    every forward and backward: the rollout's window, training, the recompute, validation (torchao's float8
    training linear; the adapters stay in the compute dtype). Rollout and training run the same layers, so the
    first update's gap stays 0; the policy is the float8 model (the exported LoRA is loaded into a bf16 base).
    With merged_rollout its merged forwards are float8 too, each quantizing its bf16 merged weight as it runs;
    with fp8_rollout as well, they run the copies quantized once at the merge instead."""
    fp8_scaling: Literal["rowwise", "tensorwise"] = "rowwise"
    """With fp8_rollout: the merged copies' float8 scales, one per weight row and per activation row, or one per
    tensor (no log-prob is taken from those forwards). fp8_train always scales per row: one scale per tensor would
    depend on the whole batch, and the recompute's batches hold other rows than the rollout's."""

    @property
    def merged_float8(self) -> Literal["off", "rowwise", "tensorwise"]:
        """How the merged rollout's copies are kept (`MergedLora`'s float8): 'off' in the model's dtype."""
        return self.fp8_scaling if self.fp8_rollout else "off"

    @property
    def lora_target_list(self) -> list[str]:
        return [t.strip() for t in self.lora_targets.split(",") if t.strip()]


@dataclass(frozen=True)
class SamplingConfig:
    """How images are sampled during rollout (and how training recomputes the trained transitions)."""

    height: int = 512
    """Image height in pixels (a multiple of the model's latent patch size)."""
    width: int = 512
    """Image width in pixels (a multiple of the model's latent patch size)."""
    num_steps: int = 10
    """Number of denoising steps of the rollout."""
    guidance_scale: float = 4.0
    """CFG scale (true-CFG for Qwen-Image, plain CFG for SD3). 1.0 turns CFG off (one forward per step)."""
    negative_prompt: str | None = " "
    """Negative prompt for CFG; ignored when guidance_scale is 1.0."""
    sde_kind: Kind = "flow_sde"
    """Stochastic step used inside the SDE window (see fgrpo.core.sde.step_mean_std)."""
    noise_level: float = 1.2
    """Noise level of the SDE step (its meaning depends on sde_kind)."""
    window_size: int = 2
    """Number of consecutive stochastic (and trained) steps per sample."""
    window_range: tuple[int, int] = (0, 5)
    """Steps [lo, hi) from which each sample's window is drawn (start uniform in [lo, hi - window_size])."""
    micro_batch: int = 8
    """Samples per transformer forward during rollout (and training recomputation)."""
    unit_block: int = 0
    """Rows are grouped into micro-batches (by window start, rollout.engine.forward_units) within each run of this
    many consecutive rows; 0: the whole batch. Set by the algorithm to a trainer's share of the rollout, which
    differs from the batch only in the asynchronous mode (a rollout rank serving several trainers)."""
    ode_tail: Literal["euler", "dpmpp_2m"] = "euler"
    """Solver after the SDE window: Euler on the full grid, or MixGRPO-Flash's DPM-Solver++(2M) on a compressed
    grid (needs one window for the whole batch; without a window every step stays Euler)."""
    tail_compress: float = 1.0
    """dpmpp_2m tail: fraction in (0, 1] of the steps after the window that it keeps (core.schedule.compressed_tail;
    MixGRPO-Flash 0.4, Flash* 0.2, 1.0 keeps the model's grid)."""


@dataclass(frozen=True)
class GRPOConfig:
    group_size: int = 16
    """G: images sampled per prompt; advantages are computed within these groups."""
    prompts_per_step: int = 32
    """P: prompts per training step (over all ranks). The step trains on P * G samples."""
    clip_range: float = 1e-5
    """PPO clip epsilon on the per-step likelihood ratio (flow_grpo's value for Qwen-Image is tiny)."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to [-adv_clip_max, adv_clip_max]."""
    adv_std: Literal["group", "global", "none"] = "global"
    """Normaliser of the advantages: per-group std, whole-batch std, or none."""
    optimizer_steps_per_step: int = 2
    """Mini-batches per training step (each ends with one optimizer step)."""
    inner_epochs: int = 1
    """Passes over the step's samples."""
    group_init_noise: bool = False
    """Samples of one group start from the same initial noise x_1, so their differences come only from the
    SDE window that the advantages credit (flow_grpo draws x_1 per sample). Pays off when x_1 makes much of
    a group's reward spread (`benchmarks/textbed_variance.py` measures it). In-process engine only."""
    train_micro_batch: int = 0
    """Samples per training forward; 0 = the rollout micro-batch (equal shapes keep old log-probs exact)."""
    old_log_prob: Literal["rollout", "recompute"] = "rollout"
    """'rollout' reuses the engine's log-probs (exact for the in-process engine); 'recompute' recomputes them
    with the trainer's kernels before the first update (needed when the engine's kernels differ, e.g. vLLM)."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference policy (LoRA disabled). 0 turns the extra forward off."""
    kl_kind: Literal["exact", "flow_grpo"] = "exact"
    """'exact' Gaussian KL of the transition, or flow_grpo's variant (omits the sqrt(sigma - sigma') factor)."""
    ratio_norm: bool = False
    """GRPO-Guard ratio normalisation in the clipped loss."""


@dataclass(frozen=True)
class AlgoConfig:
    name: Literal["grpo", "dppo", "mixgrpo", "nft", "awm"] = "grpo"
    """The update rule (fgrpo/algorithms.py): Flow-GRPO, Flow-DPPO, MixGRPO, DiffusionNFT or Advantage Weighted
    Matching. The grpo section's group, batch, clip, advantage-clip and KL fields apply to all of them."""
    dppo_tau: float = 1e-5
    """dppo: a transition's term is dropped once its KL to the rollout policy reaches tau (and grows)."""
    window_iters: int = 25
    """mixgrpo: training steps the shared SDE window stays at one position."""
    window_stride: int = 1
    """mixgrpo: steps the window moves each time (0 keeps it at sampling.window_range's start)."""
    window_roll_back: bool = True
    """mixgrpo: after its last position (the last step that keeps it whole) the window restarts at
    sampling.window_range's start (the reference scripts' --roll_back); False keeps it at the end."""
    window_in_range: bool = False
    """mixgrpo: slide only inside sampling.window_range, where Flow-GRPO draws its windows; False slides over
    every step but the last (the reference's range), whose low-noise steps have the sharpest log-probs."""
    train_steps: int = 2
    """nft/awm: K forward-process points per sample and step, one per stratum of the grid steps."""
    train_steps_lo: int = 0
    """nft/awm: first grid step whose sigma a training point may take."""
    train_steps_hi: int = 0
    """nft/awm: end (exclusive) of that range; 0 = sampling.num_steps."""
    sde_steps: tuple[int, int] = (0, 0)
    """nft/awm: grid steps [lo, hi) the rollout takes with the SDE step (sampling.sde_kind at
    sampling.noise_level), the ODE elsewhere; (0, 0) samples with the ODE throughout. AWM's reference samples with
    noise on t in [0.3, 0.9] (an SA-solver): (1, 8) on a 10-step grid."""
    nft_beta: float = 0.1
    """nft: how far the implicit positive/negative policies sit from the old one (the OCR recipe's 0.1)."""
    sample_from_ema: bool = True
    """nft: roll out with the EMA old policy (the reference) rather than the trained one."""
    nft_weighting: Literal["adaptive", "uniform"] = "adaptive"
    """nft: per-sample weight of the x0-space error (core.nft.nft_loss): the reference's adaptive 1 / mean|e|,
    which gives well-fitted samples full-size gradients, or one uniform weight. Where a group's better samples fit
    worse (the renderer's high-noise steps) the adaptive weight tips its net update away from the policy's own
    samples; uniform keeps it at 0 (RESULTS.md, fp-bias)."""
    ema_rate: float = 0.0075
    """nft: EMA decay ramp per optimizer step (core.ema.ema_decay; the OCR recipe's schedule)."""
    ema_max_decay: float = 0.999
    """nft: ceiling of the EMA decay."""
    ema_delay: int = 75
    """nft: optimizer steps during which the old policy is a plain copy (decay 0)."""
    awm_p: float = 0.25
    """awm: power of the generalised-Huber log-weight (core.awm.awm_log_weight). Below 1 a sample's pull scales
    with m^(p-1), its own error m to that power, which tips a group's net update where its better samples fit worse;
    1 weighs every sample alike (RESULTS.md, fp-bias)."""
    ema_kl_coef: float = 1.0
    """awm: weight of the KL to an EMA of the trained policy, mean((v - v_ema)^2) at every training point
    (the reference's ema_beta; the EMA follows the policy, so it damps each step, not a slow drift; 0 turns the
    EMA and its extra forward off)."""
    kl_ema_rate: float = 0.001
    """awm: ramp per optimizer step of that EMA's decay (core.ema.ema_decay, no delay; the reference's 'linear')."""
    kl_ema_max_decay: float = 0.3
    """awm: ceiling of that EMA's decay (the reference's kl_ema_decay)."""


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Max global grad norm; a step whose grad norm is not finite is skipped and counted."""
    warmup_steps: int = 0
    """Linear LR warm-up in optimizer steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR after warm-up: constant, or decaying (linear / cosine) to min_lr_ratio * lr at decay_steps."""
    decay_steps: int = 0
    """Optimizer step at which the decay ends; 0 = the run's last (num_steps * optimizer steps per step)."""
    min_lr_ratio: float = 0.0
    """Floor of the decay as a fraction of lr."""


@dataclass(frozen=True)
class DataConfig:
    train_prompts: str = "data/ocr/train.txt"
    """Training prompts: .txt (one per line, OCR target in double quotes) or .jsonl with a 'prompt' field.
    The special value 'textbed:train' / 'textbed:heldout' uses the bundled text-renderer words."""
    val_prompts: str = "data/ocr/test.txt"
    """Validation prompts, same formats."""
    val_num_prompts: int = 32
    """How many validation prompts (the first N) are sampled at each validation."""


@dataclass(frozen=True)
class RewardConfig:
    name: str = "ocr"
    """Reward spec for fgrpo.rewards.build_reward: a name ('ocr', 'jpeg_compressibility', ...) or a JSON spec
    (options, multi-reward lists; see fgrpo/rewards/factory.py)."""
    url: str = ""
    """If set, score through the HTTP reward service (python -m fgrpo.rewards.serve) at this URL instead."""
    workers: int = 0
    """Score in this many worker processes, each a slice of the batch (CPU OCR is the step's bottleneck on
    a fast GPU); 0 scores in the training process."""
    val_name: str = ""
    """Reward spec of the validation ('' = the training reward): a cheaper reward can train while validation
    keeps the reference one, so `val/` scores stay comparable across runs (e.g. OCR without the detector,
    '{"name": "ocr", "detect": false}', for training; the default OCR for validation). Scored locally, in
    `val_workers` processes."""
    val_workers: int = -1
    """Processes that score the validation (-1 = `workers`): e.g. 0 for a training reward on the GPU
    ('{"name": "ocr", "detect": false, "device": "cuda"}' scores in this process) with 15 for the CPU
    reader of `val_name`."""

    @property
    def spec(self) -> str | dict:
        return {"name": "http", "url": self.url} if self.url else self.name

    @property
    def val_spec(self) -> str | dict:
        return self.val_name or self.spec

    @property
    def is_ocr(self) -> bool:
        return "ocr" in self.name and not self.url

    @property
    def val_is_ocr(self) -> bool:
        return "ocr" in self.val_name if self.val_name else self.is_ocr


@dataclass(frozen=True)
class RunConfig:
    out_dir: str = "runs"
    """Runs are written to out_dir/exp_name."""
    wandb: Literal["online", "offline", "disabled"] = "offline"
    """wandb mode ('offline' writes locally and needs no key)."""
    log_images_every: int = 10
    """Save an image grid of the rollout every N steps (0 = never)."""
    val_every: int = 10
    """Validate (ODE sampling, fixed seeds) before every N-th step and after the last (0 = never)."""
    val_num_steps: int = 50
    """Denoising steps of validation sampling."""
    ckpt_every: int = 50
    """Checkpoint every N steps and at the end (0 = only at the end)."""
    keep_last: int = 3
    """Checkpoints kept on disk."""
    resume: str = ""
    """'' = fresh run; 'auto' = latest checkpoint of this run if any; or a checkpoint directory."""
    resume_from_other: bool = False
    """Let `resume` name a checkpoint of another run directory when this one already holds a run: this run's
    checkpoints from that step on move to stale_checkpoints/, its metrics rows to metrics.superseded.jsonl."""
    export_lora: bool = True
    """Write the LoRA as a PEFT/diffusers adapter at the end of the run."""
    overwrite: bool = False
    """Start a fresh run in a directory that already holds one: the old run is moved aside to
    `<exp_name>.old-<time>` (never deleted). Without it a fresh run refuses a used directory."""
    collapse_drop: float = 0.15
    """Stop the run (exit code 3) once `collapse_patience` validations in a row score more than this below the best
    validation so far (absolute, in val/reward_mean's units); `lora_best/` holds the best one's adapter. 0 = off."""
    collapse_patience: int = 2
    """Validations in a row below the best minus collapse_drop that stop the run."""
    max_bad_steps: int = 3
    """Stop with an error after this many consecutive training steps whose every optimizer step was skipped
    (non-finite gradients): such a run trains nothing."""


@dataclass(frozen=True)
class ParallelConfig:
    rollout_ranks: int = 0
    """Ranks that only roll out (the last N ranks); the others train. 0 = every rank rolls out then trains
    (synchronous, colocated). N > 0: the rollout samples step k + max_staleness while the trainer updates on
    step k, and receives the trainer's weights after every update."""
    max_staleness: int = 1
    """Policy versions a sample may lag the trainer (versions count weight updates). The rollout samples step k
    with the weights of version k - max_staleness; a batch older than that is dropped and counted, never
    trained on. 0 reproduces the synchronous loop."""
    correction: Literal["none", "tis", "masked_is"] = "tis"
    """Off-policy correction of stale samples, whose old-policy log-probs the trainer recomputes: 'tis' weighs
    each entry's loss by min(pi_old / pi_behaviour, is_threshold), 'masked_is' zeroes entries whose ratio
    leaves [is_threshold_low, is_threshold], 'none' trains on them unweighted."""
    is_level: Literal["token", "sequence"] = "token"
    """Importance ratio per trained transition ('token') or per sample (the product over its window)."""
    is_threshold: float = 2.0
    """Upper bound of the importance weight (truncation or mask; verl's default 2.0)."""
    is_threshold_low: float = 0.0
    """masked_is: lower bound of the kept ratios; 0 = 1 / is_threshold."""
    is_log_ratio: Literal["mean", "sum"] = "sum"
    """Units of the importance log-ratio log(pi_old / pi_behaviour) of a transition. The recorded log-probs are
    per-element means over the latent (flow_grpo's convention): 'sum' multiplies their difference by the
    latent's element count D, the transition's true density ratio, which the thresholds then bound; 'mean'
    takes it as it is, the per-element geometric-mean ratio, which stays within ~1e-3 of 1 at staleness 1 and so
    corrects nothing (on the text renderer at staleness 1 it collapsed like no correction, RESULTS.md). The
    train/offpolicy/* statistics (gap, weights) are in the same units."""
    sp: int = 1
    """Ulysses sequence parallel degree: each sample's tokens are split over sp consecutive ranks, which share its
    prompt and seed (diffusers' context parallelism, Qwen-Image). Helps when one sample's activations, not the
    batch, fill a GPU (Qwen-Image at 1328²); the world size must be a multiple; 1 = off."""
    shard: Literal["full", "adapters"] = "full"
    """What FSDP2 shards: every transformer weight, or (LoRA only) just the adapters, with the frozen base
    replicated on every rank. 'adapters' never all-gathers or copies the base (full sharding does so for each
    block at every forward and backward, at world size 1 too) and holds one whole base per rank; same numbers."""

    def trainer_ranks(self, world_size: int) -> int:
        """Training ranks that hold distinct samples: all of them in the synchronous mode, one per SP group."""
        return (world_size - self.rollout_ranks) // self.sp


@dataclass(frozen=True)
class TrainConfig:
    """Everything the loop needs; experiment files build one of these."""

    exp_name: str = "run"
    """Run name (experiment files default it to their file stem)."""
    seed: int = 0
    """Seed of the data order, the rollout noise and the LoRA init."""
    num_steps: int = 1000
    """Training steps (one step = rollout of P*G images + optimizer_steps_per_step updates)."""
    device: str = "auto"
    """'auto' (cuda if available), 'cuda' or 'cpu'."""
    rollout_engine: Literal["diffusers", "vllm_omni"] = "diffusers"
    """Rollout engine: in-process diffusers (the trainer's own kernels) or vLLM-Omni (extra `vllm`; Qwen-Image
    + LoRA only; the window algorithms need grpo.old_log_prob='recompute' because its kernels differ from the
    trainer's)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def samples_per_step(self) -> int:
        return self.grpo.prompts_per_step * self.grpo.group_size

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps in the whole run (what the LR schedule counts)."""
        return self.num_steps * self.grpo.inner_epochs * self.grpo.optimizer_steps_per_step

    @property
    def lr_decay_steps(self) -> int:
        return self.optim.decay_steps or self.optimizer_steps


# Max per-step |rollout - trainer| log-prob gap with regional compile and model.exact_rollout=False on an H200
# (RESULTS.md, "Compiled Flow-GRPO step"): the no-grad and the grad forward compile to different kernels.
COMPILED_LOGPROB_GAP = 1e-4


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def validate_config(cfg: TrainConfig, world_size: int) -> None:
    """Raise ConfigError (a ValueError) naming the field and the fix for any value the run cannot use; nothing is
    built yet. The checks that need the model family or model code are models.registry.check_config's."""
    g, s, o, r, m = cfg.grpo, cfg.sampling, cfg.optim, cfg.run, cfg.model
    _validate_exp_name(cfg.exp_name)
    # (holds, field, value, what it must be): plain range checks, each one line.
    ranges = [
        # torch.manual_seed takes [-2^63, 2^64), the seed mixer (rollout.seeds) signed 64-bit keys
        (0 <= cfg.seed < 2**63, "seed", cfg.seed, "in [0, 2^63)"),
        (cfg.num_steps >= 1, "num_steps", cfg.num_steps, ">= 1"),
        (g.group_size >= 2, "grpo.group_size", g.group_size, ">= 2 (GRPO compares samples of one prompt)"),
        (g.prompts_per_step >= 1, "grpo.prompts_per_step", g.prompts_per_step, ">= 1"),
        (g.clip_range > 0, "grpo.clip_range", g.clip_range, "> 0"),
        (g.adv_clip_max > 0, "grpo.adv_clip_max", g.adv_clip_max, "> 0"),
        (
            g.optimizer_steps_per_step >= 1,
            "grpo.optimizer_steps_per_step",
            g.optimizer_steps_per_step,
            ">= 1",
        ),
        (g.inner_epochs >= 1, "grpo.inner_epochs", g.inner_epochs, ">= 1"),
        (g.train_micro_batch >= 0, "grpo.train_micro_batch", g.train_micro_batch, ">= 0 (0 = the rollout's)"),
        (g.kl_coef >= 0, "grpo.kl_coef", g.kl_coef, ">= 0"),
        (s.micro_batch >= 1, "sampling.micro_batch", s.micro_batch, ">= 1"),
        (s.num_steps >= 1, "sampling.num_steps", s.num_steps, ">= 1"),
        (s.noise_level >= 0, "sampling.noise_level", s.noise_level, ">= 0"),
        (s.guidance_scale >= 1.0, "sampling.guidance_scale", s.guidance_scale, ">= 1 (1 = no CFG)"),
        (math.isfinite(o.lr) and o.lr > 0, "optim.lr", o.lr, "> 0"),
        (o.grad_clip > 0, "optim.grad_clip", o.grad_clip, "> 0 (a norm bound; inf turns clipping off)"),
        (o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, ">= 0"),
        (o.eps > 0, "optim.eps", o.eps, "> 0"),
        (all(0 <= b < 1 for b in o.betas), "optim.betas", o.betas, "in [0, 1)"),
        (o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, ">= 0"),
        (0.0 <= o.min_lr_ratio <= 1.0, "optim.min_lr_ratio", o.min_lr_ratio, "in [0, 1]"),
        (m.lora_rank >= 1 or not m.lora, "model.lora_rank", m.lora_rank, ">= 1"),
        (m.lora_alpha > 0 or not m.lora, "model.lora_alpha", m.lora_alpha, "> 0"),
        (cfg.data.val_num_prompts >= 1, "data.val_num_prompts", cfg.data.val_num_prompts, ">= 1"),
        (cfg.reward.workers >= 0, "reward.workers", cfg.reward.workers, ">= 0 (0 = in the training process)"),
        (
            cfg.reward.val_workers >= -1,
            "reward.val_workers",
            cfg.reward.val_workers,
            ">= 0, or -1 for reward.workers",
        ),
        (r.keep_last >= 1, "run.keep_last", r.keep_last, ">= 1"),
        (r.val_every >= 0, "run.val_every", r.val_every, ">= 0 (0 = never)"),
        (r.val_num_steps >= 1, "run.val_num_steps", r.val_num_steps, ">= 1"),
        (r.ckpt_every >= 0, "run.ckpt_every", r.ckpt_every, ">= 0 (0 = only at the end)"),
        (r.log_images_every >= 0, "run.log_images_every", r.log_images_every, ">= 0 (0 = never)"),
        (r.max_bad_steps >= 1, "run.max_bad_steps", r.max_bad_steps, ">= 1"),
        (r.collapse_drop >= 0, "run.collapse_drop", r.collapse_drop, ">= 0 (0 = off)"),
        (r.collapse_patience >= 1, "run.collapse_patience", r.collapse_patience, ">= 1"),
    ]
    for ok, name, value, want in ranges:
        if not ok:
            raise ConfigError(f"{name}={value}: must be {want}; pass {_flag(name)} with a valid value")
    _validate_parallel(cfg, world_size)
    trainers = cfg.parallel.trainer_ranks(world_size)
    n = cfg.samples_per_step
    if n % trainers:
        raise ConfigError(
            f"grpo.prompts_per_step*grpo.group_size={n} is not divisible by the {trainers} training ranks; "
            "change grpo.prompts_per_step or grpo.group_size"
        )
    local = n // trainers
    if local % g.optimizer_steps_per_step:
        raise ConfigError(
            f"grpo.optimizer_steps_per_step={g.optimizer_steps_per_step} does not divide the {local} samples "
            "per rank; pick a divisor"
        )
    if (
        m.compile
        and not m.exact_rollout
        and g.old_log_prob == "rollout"
        and g.clip_range < 10 * COMPILED_LOGPROB_GAP
    ):
        raise ConfigError(
            f"model.compile=True, model.exact_rollout=False with grpo.old_log_prob='rollout': the compiled no-grad "
            f"rollout and the training forward differ by up to ~{COMPILED_LOGPROB_GAP:g} in log-prob, not small "
            f"next to grpo.clip_range={g.clip_range:g}; drop --model.no-exact-rollout or add "
            "--grpo.old-log-prob recompute"
        )
    if g.kl_coef > 0 and not m.lora:
        raise ConfigError(
            "grpo.kl_coef>0 needs model.lora=True (the reference is the model with adapters off)"
        )
    if m.merged_rollout and not (
        m.lora and cfg.parallel.shard == "adapters" and cfg.rollout_engine == "diffusers"
    ):
        raise ConfigError(
            "model.merged_rollout merges the LoRA into a copy of the frozen base in this process: it needs "
            "model.lora=True, --parallel.shard adapters and rollout_engine='diffusers'; add them or drop "
            "--model.merged-rollout"
        )
    if m.fp8_rollout and not m.merged_rollout:
        raise ConfigError(
            "model.fp8_rollout quantizes the merged copies of model.merged_rollout, which is off; add "
            "--model.merged-rollout or drop --model.fp8-rollout"
        )
    if m.fp8_train and not m.lora:
        raise ConfigError(
            "model.fp8_train runs the frozen base of the LoRA layers in float8 and model.lora=False trains the "
            "base; add --model.lora or drop --model.fp8-train"
        )
    if m.fp8_scaling != "rowwise" and not m.fp8_rollout:
        raise ConfigError(
            f"model.fp8_scaling={m.fp8_scaling} scales the merged copies of model.fp8_rollout, which is off "
            "(model.fp8_train always scales per row); add --model.fp8-rollout or drop --model.fp8-scaling"
        )
    if (m.fp8_rollout or m.fp8_train) and importlib.util.find_spec("torchao") is None:
        raise ConfigError(TORCHAO_MISSING)
    if cfg.parallel.shard == "adapters" and not m.lora:
        raise ConfigError(
            "parallel.shard='adapters' replicates the frozen base and model.lora=False trains all of it; drop "
            "--parallel.shard"
        )
    if m.checkpoint_policy == "selective" and not m.gradient_checkpointing:
        raise ConfigError(
            "model.checkpoint_policy='selective' chooses what gradient checkpointing recomputes and "
            "model.gradient_checkpointing=False turns it off; drop one of the two flags"
        )
    if m.init_lora and not m.lora:
        raise ConfigError("model.init_lora needs model.lora=True; drop --model.init-lora or train LoRA")
    if o.schedule != "constant" and cfg.lr_decay_steps <= o.warmup_steps:
        raise ConfigError(
            f"optim.decay_steps={cfg.lr_decay_steps} (optimizer steps) must exceed optim.warmup_steps="
            f"{o.warmup_steps} for optim.schedule='{o.schedule}'; raise optim.decay_steps or num_steps"
        )
    if r.resume and r.overwrite:
        raise ConfigError("run.resume and run.overwrite contradict each other; pass one of them")
    if r.resume_from_other and r.resume in ("", "auto"):
        raise ConfigError(
            "run.resume_from_other needs --run.resume <checkpoint of another run>; drop --run.resume-from-other"
        )
    if cfg.rollout_engine == "vllm_omni":
        if not m.lora:  # (the families it runs: models.registry.check_config)
            raise ConfigError(
                "rollout_engine='vllm_omni' samples with the trainer's exported LoRA: it needs model.lora=True"
            )
        if g.group_init_noise:
            raise ConfigError(
                "grpo.group_init_noise is in-process only; drop --grpo.group-init-noise or use diffusers"
            )
        if world_size > 1:
            raise ConfigError(
                "rollout_engine='vllm_omni' is wired for one trainer process; use diffusers on N ranks"
            )


def _validate_exp_name(name: str) -> None:
    """exp_name is one directory below run.out_dir: an empty or path-like name would make the run directory
    out_dir itself or a directory elsewhere, which `--run.overwrite` would then move with everything in it."""
    plain = name not in ("", ".", "..") and name.strip() == name and name.isprintable()
    if not plain or "/" in name or "\\" in name:
        raise ConfigError(
            f"exp_name {name!r} must be one plain directory name (not empty, '.' or '..', without '/', '\\', "
            "surrounding spaces or control characters): the run is written to run.out_dir/exp_name; pass "
            "--exp-name NAME"
        )


def _validate_sequence_parallel(cfg: TrainConfig, world_size: int) -> None:
    """Checks of --parallel.sp: the combinations not wired (models.registry.check_config: the families and token
    counts diffusers' equal Ulysses split takes)."""
    p, m = cfg.parallel, cfg.model
    if p.sp < 1 or world_size % p.sp:
        raise ConfigError(
            f"parallel.sp={p.sp} must be >= 1 and divide the world size {world_size} (torchrun --nproc-per-node); "
            "pass --parallel.sp with a divisor"
        )
    if p.rollout_ranks or cfg.rollout_engine != "diffusers" or m.compile:
        raise ConfigError(
            "parallel.sp>1 runs with the synchronous in-process rollout only; drop --parallel.rollout-ranks, "
            "--rollout-engine vllm_omni and --model.compile, or --parallel.sp"
        )


def _validate_parallel(cfg: TrainConfig, world_size: int) -> None:
    """Checks of the parallel section (the asynchronous mode's split and correction)."""
    p, g, s = cfg.parallel, cfg.grpo, cfg.sampling
    for ok, name, value, want in (
        (p.rollout_ranks >= 0, "parallel.rollout_ranks", p.rollout_ranks, ">= 0 (0 = synchronous)"),
        (p.max_staleness >= 0, "parallel.max_staleness", p.max_staleness, ">= 0"),
        (p.is_threshold > 0, "parallel.is_threshold", p.is_threshold, "> 0"),
        (
            0 <= p.is_threshold_low <= p.is_threshold,
            "parallel.is_threshold_low",
            p.is_threshold_low,
            f"in [0, parallel.is_threshold={p.is_threshold}] (0 = 1 / is_threshold)",
        ),
        (p.is_log_ratio in ("mean", "sum"), "parallel.is_log_ratio", p.is_log_ratio, "'mean' or 'sum'"),
    ):
        if not ok:
            raise ConfigError(f"{name}={value}: must be {want}; pass {_flag(name)} with a valid value")
    if p.sp != 1:
        _validate_sequence_parallel(cfg, world_size)
    R = p.rollout_ranks
    if R == 0:
        return
    T = world_size - R
    if T < 1:
        raise ConfigError(
            f"parallel.rollout_ranks={R} leaves no training rank of the {world_size}; pass a value below "
            f"{world_size} (torchrun --nproc-per-node sets the world size)"
        )
    if T % R:
        raise ConfigError(
            f"parallel.rollout_ranks={R} must divide the {T} training ranks (each trainer's samples come from "
            "one rollout rank); e.g. 1 + 1, 1 + 3, 2 + 6 of 8"
        )
    n_train = cfg.samples_per_step // T if cfg.samples_per_step % T == 0 else 0
    if T > R and n_train and n_train % s.micro_batch:
        raise ConfigError(
            f"sampling.micro_batch={s.micro_batch} must divide the {n_train} samples of a training rank, so its "
            "forwards see the rollout's micro-batches (exact old log-probs); pick a divisor"
        )
    if cfg.rollout_engine != "diffusers":
        raise ConfigError(
            f"rollout_engine={cfg.rollout_engine!r} has no asynchronous mode yet; drop --parallel.rollout-ranks"
        )
    if g.old_log_prob != "rollout":
        raise ConfigError(
            "parallel.rollout_ranks>0 recomputes the old log-probs of stale batches itself; drop "
            "--grpo.old-log-prob"
        )
