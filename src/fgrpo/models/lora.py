"""A LoRA's whole life on a diffusers transformer: attach it (`add_lora`, `setup_trainable`), start from a file
(`load_lora_weights`, `check_lora_file`), switch it off for the reference policy (`adapters_disabled`), merge it
for the rollout (`MergedLora`), and write it out, in diffusers' layout (`export_lora`) or PEFT's
(`write_adapter`, what vLLM-Omni reads)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from fgrpo import files
from fgrpo.config import TORCHAO_MISSING
from fgrpo.errors import ConfigError, MissingFileError
from fgrpo.models.base import trained_transformers
from fgrpo.models.loading import configure_transformer
from fgrpo.models.qwen_image import QWEN_IMAGE_LORA_TARGETS
from fgrpo.parallel import barrier, is_dtensor, rank

if TYPE_CHECKING:
    from fgrpo.config import ModelConfig
    from fgrpo.models.base import FlowModel, Transformer

# How MergedLora keeps its merged copies: 'off' in the base weight's dtype, else float8 with this scaling.
Float8 = Literal["off", "rowwise", "tensorwise"]


def add_lora(
    transformer: Transformer,
    *,
    rank: int,
    alpha: int,
    target_modules: Sequence[str] = QWEN_IMAGE_LORA_TARGETS,
    init: bool | Literal["gaussian"] = "gaussian",
    adapter_name: str = "default",
) -> list[nn.Parameter]:
    """Attach a peft LoRA adapter in place (diffusers' add_adapter keeps the module's class); returns its params.

    Only the adapter is trainable afterwards. `init` is peft's init_lora_weights ("gaussian" and True make
    B = 0, so the model is unchanged until the first update; False makes A and B random).
    """
    from peft import LoraConfig

    if rank < 1:
        raise ConfigError(f"lora rank must be >= 1, got {rank}")
    if not target_modules:
        raise ConfigError("lora target_modules is empty; name at least one Linear inside the transformer")
    transformer.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=init)
    transformer.add_adapter(config, adapter_name=adapter_name)
    return [p for n, p in transformer.named_parameters() if "lora_" in n]


def setup_trainable(transformer: Transformer, mcfg: ModelConfig) -> list[nn.Parameter]:
    """Attach LoRA (from model.init_lora if given) or unfreeze everything. Trainable parameters become fp32
    masters whatever the base dtype: FSDP2 casts them to the compute dtype, AdamW updates them in fp32."""
    if mcfg.lora:
        params = add_lora(
            transformer, rank=mcfg.lora_rank, alpha=mcfg.lora_alpha, target_modules=mcfg.lora_target_list
        )
        if mcfg.init_lora:
            load_lora_weights(transformer, mcfg.init_lora, rank=mcfg.lora_rank, alpha=mcfg.lora_alpha)
    else:
        params = list(transformer.requires_grad_(True).parameters())
    for p in params:
        p.data = p.data.float()
    configure_transformer(
        transformer,
        gradient_checkpointing=mcfg.gradient_checkpointing,
        checkpoint_policy=mcfg.checkpoint_policy,
    )
    return params


def setup_trainable_model(model: FlowModel, mcfg: ModelConfig) -> list[nn.Parameter]:
    """`setup_trainable` on each of the model's trained transformers (models.base.trained_transformers), in order;
    with several, model.init_lora is a directory of one adapter each, `<init_lora>/<name>` (the layout `export_loras`
    writes for them). Returns all their trainable parameters."""
    named = trained_transformers(model)
    params: list[nn.Parameter] = []
    for name, transformer in named.items():
        own = mcfg
        if mcfg.init_lora and len(named) > 1:
            own = dataclasses.replace(mcfg, init_lora=str(Path(mcfg.init_lora) / name))
        params += setup_trainable(transformer, own)
    if mcfg.fp8_train:
        float8_base_model(model)
    return params


def float8_base_model(model: FlowModel) -> list[str]:
    """model.fp8_train's conversion: `float8_base_layers` on each trained transformer, over the model's merge
    targets, with rowwise scales (a row's scale depends on that row alone, so a training forward of other rows
    than the rollout's still reproduces its log-probs). Returns the converted layers' names."""
    targets = getattr(model, "merge_targets", ())
    return [
        n for t in trained_transformers(model).values() for n in float8_base_layers(t, targets, "rowwise")
    ]


def is_target(name: str, targets: Sequence[str]) -> bool:
    """Whether module `name` is one of `targets` or ends in "." + one of them; empty targets: every module."""
    return not targets or any(name == s or name.endswith("." + s) for s in targets)


def check_float8_shape(flag: str, name: str, shape: tuple[int, ...]) -> None:
    """A float8 matmul (torch._scaled_mm) needs both dims of the weight to be multiples of 16; `flag` names the
    option that asked for it (model.fp8_rollout / model.fp8_train), for the one-line error."""
    if shape[0] % 16 or shape[1] % 16:
        raise ConfigError(
            f"model.{flag}: '{name}' has weight shape {tuple(shape)}, not multiples of 16 as float8 matmuls "
            f"need; drop --model.{flag.replace('_', '-')}"
        )


def float8_base_layers(
    transformer: nn.Module, targets: Sequence[str], scaling: Literal["rowwise", "tensorwise"]
) -> list[str]:
    """The frozen base Linear of each LoRA layer named by `targets` (as `MergedLora`'s; empty: every LoRA layer)
    becomes torchao's float8 training linear with that scaling: its forward quantizes input and weight to e4m3 and
    runs one float8 matmul, its backward the input gradient as a float8 matmul too (the weight is frozen). The
    adapters stay as they are. Returns the converted layers' names."""
    try:
        from torchao.float8 import (  # pyright: ignore[reportMissingImports] - the optional `fp8` extra
            Float8LinearConfig,
            convert_to_float8_training,
        )
    except ImportError as e:
        raise ConfigError(TORCHAO_MISSING) from e
    from peft.tuners.lora import Linear as LoraLinear

    bases = {}
    for name, module in transformer.named_modules():
        if not isinstance(module, LoraLinear):
            continue
        if not is_target(name, targets):
            continue
        base: Any = module.get_base_layer()
        check_float8_shape("fp8_train", name, tuple(base.weight.shape))
        bases[id(base)] = name
    if not bases:
        raise ConfigError(f"model.fp8_train found no LoRA layer (targets {list(targets) or 'all'}); add LoRA")
    config = Float8LinearConfig.from_recipe_name(scaling)
    convert_to_float8_training(transformer, config=config, module_filter_fn=lambda m, _: id(m) in bases)
    return sorted(bases.values())


def lora_files(path: str | Path) -> list[Path]:
    """The adapters that model.init_lora names: itself, or, for a directory of per-transformer adapters (what
    `export_loras` writes for a model of several), each of its `transformer*` subdirectories."""
    p = Path(path)
    subdirs = (
        sorted(d for d in p.glob("transformer*") if (d / ADAPTER_WEIGHTS).is_file()) if p.is_dir() else []
    )
    return [p] if not subdirs or (p / ADAPTER_WEIGHTS).is_file() else subdirs


def _lora_file(path: str | Path) -> Path:
    p = Path(path)
    f = p / "adapter_model.safetensors" if p.is_dir() else p
    if not f.is_file():
        raise MissingFileError(
            f"model.init_lora: no LoRA at '{path}' (want a directory with adapter_model.safetensors, as fgrpo "
            "exports to runs/<exp_name>/lora, or a .safetensors file)"
        )
    return f


def _lora_header(f: Path) -> dict[str, Any]:
    """The LoraConfig that fgrpo's and diffusers' exports keep in the safetensors header ({} when absent)."""
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt") as fh:
            return json.loads((fh.metadata() or {}).get("lora_adapter_metadata", "{}"))
    except Exception as e:  # safetensors' own errors do not say which file
        raise ConfigError(f"model.init_lora: cannot read '{f}' as safetensors ({e})") from e


def _check_rank(f: Path, header: dict[str, Any], rank: int, alpha: int) -> None:
    saved_r, saved_alpha = header.get("transformer.r"), header.get("transformer.lora_alpha")
    if saved_r is not None and (saved_r != rank or saved_alpha != alpha):
        raise ConfigError(
            f"model.init_lora: '{f}' has rank {saved_r} / alpha {saved_alpha}, the model lora_rank {rank} / "
            f"lora_alpha {alpha}; pass --model.lora-rank {saved_r} --model.lora-alpha {saved_alpha}"
        )


def check_lora_file(path: str | Path, *, rank: int, alpha: int) -> Path:
    """What `load_lora_weights` can check without a model, from the file's header alone (validation runs it
    before the model is built): the adapter file is there, reads as safetensors, and has this rank and alpha.
    Returns the file."""
    f = _lora_file(path)
    _check_rank(f, _lora_header(f), rank, alpha)
    return f


def load_lora_weights(
    transformer: Transformer, path: str | Path, *, rank: int, alpha: int, adapter_name: str = "default"
) -> None:
    """Copy a diffusers-layout LoRA (keys `transformer.<module>.lora_A.weight`, the LoraConfig in the
    `lora_adapter_metadata` header) into the transformer's existing adapter, checking rank, alpha, targets,
    every shape and that every value is finite first (a NaN would make every update non-finite: each
    optimizer step skipped, the NaN adapter exported again). peft's `set_peft_model_state_dict` does the key
    mapping."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    f = check_lora_file(path, rank=rank, alpha=alpha)
    try:
        sd = {k.removeprefix("transformer."): v for k, v in load_file(str(f)).items()}
    except Exception as e:  # safetensors' own errors do not say which file
        raise ConfigError(f"model.init_lora: cannot read '{f}' as safetensors ({e})") from e
    own = {n: p for n, p in transformer.named_parameters() if f".{adapter_name}." in n and "lora_" in n}
    want = {n.replace(f".{adapter_name}.", "."): p for n, p in own.items()}
    missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or unexpected:
        raise ConfigError(
            f"model.init_lora: '{f}' does not fit the adapter (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "set model.lora_targets as for the run that wrote it"
        )
    for k, v in sd.items():
        if tuple(v.shape) != tuple(want[k].shape):
            raise ConfigError(
                f"model.init_lora: '{f}' {k} has shape {tuple(v.shape)}, the adapter {tuple(want[k].shape)}"
            )
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad = int((~torch.isfinite(v)).sum())
            raise ConfigError(
                f"model.init_lora: '{f}' tensor {k} holds {bad} non-finite value(s) (NaN or inf) of {v.numel()}; "
                "start from an adapter whose weights are finite (e.g. an earlier checkpoint's export)"
            )
    result = set_peft_model_state_dict(transformer, sd, adapter_name=adapter_name)
    if getattr(result, "unexpected_keys", None):
        raise ConfigError(f"model.init_lora: peft did not place {result.unexpected_keys[:3]} from '{f}'")


@contextlib.contextmanager
def adapters_disabled(*transformers: Transformer) -> Iterator[None]:
    """The reference policy for the KL: the same transformers with their LoRA adapters switched off."""
    for transformer in transformers:
        transformer.disable_adapters()
    try:
        yield
    finally:
        for transformer in transformers:
            transformer.enable_adapters()


class MergedLora:
    """bf16 copies of every LoRA layer's merged weight W + (alpha / r) B A, swapped in on demand.

    Inside `active()` each adapted Linear runs one matmul with its merged copy and its adapter is off, instead of
    the base matmul plus the adapter's two (whose output, as wide as the base layer's, is written and added
    once more). The copies are made once, from the weights as they are at construction (a rollout's weights do
    not change while it samples); on leaving, the original weight tensors and the adapters come back untouched,
    so forwards outside `active()` keep their bits. The merged forward differs from the unmerged one by rounding.

    targets: merge only the LoRA layers whose module name is one of these or ends in "." + one of them (a model's
    `merge_targets`: those whose inputs hold many tokens); empty: all of them.

    float8: 'off' keeps the copies in the base weight's dtype; 'rowwise' or 'tensorwise' keeps them as float8
    (e4m3, one scale per output row or per tensor) and runs the merged forwards as float8 matmuls whose
    activations are quantized as they arrive, with the same scaling (`float8_weight`). The float8 copy is made
    straight from the merge and is the only copy kept. A base that is no plain Linear (torchao's float8 training
    linear of model.fp8_train, whose forward quantizes its own bf16 weight) gives way inside `active()` to a plain
    Linear holding the float8 copy and the base's bias, so the copy is quantized once, not in every forward.

    Needs the frozen base as ordinary tensors (unsharded, or FSDP2 with `parallel.shard='adapters'`); sharded
    adapters are gathered for the merge (a collective: every rank of the mesh must build it). Plain LoRA only
    (no DoRA or other variant, no bias on B, no fan_in_fan_out). Memory: one copy of each adapted weight (bf16,
    or float8 and its scales).
    """

    def __init__(
        self,
        transformer: nn.Module,
        targets: Sequence[str] = (),
        *,
        float8: Float8 = "off",
    ):
        from peft.tuners.lora import Linear as LoraLinear
        from torch.distributed.tensor import DTensor

        def full(t: Any) -> torch.Tensor:
            return (t.full_tensor() if isinstance(t, DTensor) else t).detach()

        # (peft layer, its base weight's tensor, the merged copy); peft declares no attribute types, hence Any
        self.layers: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        # peft layer -> the plain Linear that stands in for its base inside active() (float8 over a non-Linear base)
        self.stand_ins: dict[int, nn.Linear] = {}
        for name, module in transformer.named_modules():
            if not isinstance(module, LoraLinear) or module.disable_adapters:
                continue
            if not is_target(name, targets):
                continue
            layer: Any = module
            weight = layer.get_base_layer().weight
            if isinstance(weight, DTensor):
                raise ConfigError(
                    f"model.merged_rollout: the base weight of '{name}' is sharded; add --parallel.shard adapters "
                    "(the frozen base whole on every rank) or drop --model.merged-rollout"
                )
            (adapter,) = layer.active_adapters
            if (
                adapter in layer.lora_variant
                or layer.fan_in_fan_out
                or layer.lora_B[adapter].bias is not None
            ):
                raise ConfigError(
                    f"model.merged_rollout merges plain LoRA; '{name}' has a variant, a bias or fan_in_fan_out"
                )
            a, b = full(layer.lora_A[adapter].weight), full(layer.lora_B[adapter].weight)
            merged = torch.addmm(full(weight).float(), b.float(), a.float(), alpha=layer.scaling[adapter])
            merged = merged.to(weight.dtype)
            if float8 != "off":
                # A tensor subclass cannot stand in for a Parameter's .data: active() swaps in this Parameter.
                merged = nn.Parameter(float8_weight(merged, float8, name), requires_grad=False)
                base = layer.get_base_layer()
                if type(base) is not nn.Linear:
                    stand_in = nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
                    stand_in.weight, stand_in.bias = merged, base.bias
                    self.stand_ins[id(layer)] = stand_in
            self.layers.append((layer, weight.data, merged))
        if not self.layers:
            raise ConfigError(
                f"model.merged_rollout found no LoRA layer to merge (targets {list(targets) or 'all'}); add LoRA "
                "or drop it"
            )

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Forwards inside run the merged copies with the adapters off. peft's switch also freezes the adapter;
        each parameter's requires_grad is put back at once, because FSDP2 fixes a unit's gradient dtypes at the
        model's first forward from the parameters that require grad then: a rollout whose first forward is a
        merged one would otherwise leave the LoRA's bf16 gradients unreduced to its fp32 masters (the first
        backward fails). A float8 copy comes in as the layer's weight Parameter (or with its stand-in Linear), the
        original Parameter object (and base module) goes back on leaving."""
        trainable = [[p.requires_grad for p in layer.parameters()] for layer, _, _ in self.layers]
        parameters = [layer.get_base_layer().weight for layer, _, _ in self.layers]
        bases = {id(layer): layer.base_layer for layer, _, _ in self.layers if id(layer) in self.stand_ins}
        for (layer, _, merged), flags in zip(self.layers, trainable, strict=True):
            if id(layer) in self.stand_ins:
                layer.base_layer = self.stand_ins[id(layer)]
            elif isinstance(merged, nn.Parameter):
                layer.get_base_layer().weight = merged
            else:
                layer.get_base_layer().weight.data = merged
            layer.enable_adapters(False)
            for p, flag in zip(layer.parameters(), flags, strict=True):
                p.requires_grad_(flag)
        try:
            yield
        finally:
            for (layer, original, _), parameter, flags in zip(
                self.layers, parameters, trainable, strict=True
            ):
                if id(layer) in bases:
                    layer.base_layer = bases[id(layer)]
                if layer.get_base_layer().weight is not parameter:  # a float8 copy was swapped in
                    layer.get_base_layer().weight = parameter
                parameter.data = original
                layer.enable_adapters(True)
                for p, flag in zip(layer.parameters(), flags, strict=True):
                    p.requires_grad_(flag)


def float8_weight(weight: torch.Tensor, scaling: Literal["rowwise", "tensorwise"], name: str) -> torch.Tensor:
    """A Linear weight `[out, in]` as torchao's `Float8Tensor`: e4m3 data with one scale per row (`rowwise`) or
    one for the tensor (`tensorwise`), which quantizes each input the same way as it arrives, so `F.linear` with
    it is one float8 matmul (torch._scaled_mm; for rows on an H100 or later, the mslk package's kernel where
    that is installed).

    What torchao's `Float8DynamicActivationFloat8WeightConfig` makes of a weight (fast accumulation, torchao's
    inference default), built directly: `quantize_` refuses any device but a recent GPU, and the same tensor
    runs on a CPU through torch._scaled_mm, which the tests use. name: the layer, for the error."""
    try:
        from torchao.quantization import (  # pyright: ignore[reportMissingImports] - the optional `fp8` extra
            Float8MMConfig,
            Float8Tensor,
            PerRow,
            PerTensor,
        )
        from torchao.quantization.quantize_.workflows import (  # pyright: ignore[reportMissingImports]
            QuantizeTensorToFloat8Kwargs,
        )
    except ImportError as e:
        raise ConfigError(TORCHAO_MISSING) from e
    check_float8_shape("fp8_rollout", name, tuple(weight.shape))
    granularity = PerRow() if scaling == "rowwise" else PerTensor()
    return Float8Tensor.from_hp(
        weight,
        float8_dtype=torch.float8_e4m3fn,
        granularity=granularity,
        mm_config=Float8MMConfig(use_fast_accum=True),
        act_quant_kwargs=QuantizeTensorToFloat8Kwargs(torch.float8_e4m3fn, granularity),
    )


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# Module names that wrappers insert into parameter names (activation checkpointing, torch.compile, FSDP1);
# `base_model.model.` of a PeftModel is a prefix, dropped on its own.
_WRAPPERS = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"}


def _peft_config(model: nn.Module, adapter_name: str):
    cfgs = getattr(model, "peft_config", None)
    if not cfgs or adapter_name not in cfgs:
        have = list(cfgs) if cfgs else []
        raise ValueError(
            f"export_lora: model has no LoRA adapter {adapter_name!r} (adapters: {have}); apply LoRA with "
            "transformer.add_adapter(LoraConfig(...)) or peft.get_peft_model before exporting"
        )
    return cfgs[adapter_name]


def _lora_config_dict(config: Any) -> dict[str, Any]:
    """A peft.LoraConfig (or its dict) as plain JSON data: sets sorted, enums as their values."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    cfg = {
        k: sorted(v) if isinstance(v, set) else (v.value if hasattr(v, "value") else v)
        for k, v in cfg.items()
    }
    return files.jsonable(cfg, "LoraConfig", allow_nan=False)


def lora_state_dict(model: nn.Module, *, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """Full (unsharded, CPU) LoRA tensors keyed as diffusers expects: `<module>.lora_A.weight`.

    Collective when torch.distributed is initialised; non-zero ranks get an empty dict.
    """
    from peft import get_peft_model_state_dict

    cfg = _peft_config(model, adapter_name)
    if getattr(cfg, "use_dora", False):
        raise ValueError(
            "export_lora: DoRA adapters are not loadable by diffusers; train with use_dora=False"
        )
    # PEFT picks (from its layers) and names (adapter name dropped) the adapter's tensors out of the
    # parameters themselves, possibly sharded, so only those are gathered, one at a time: a state dict
    # would gather the whole 20B base for a few MB of LoRA. Parameters, not the requires_grad ones: the
    # adapter may be frozen at export time.
    picked = get_peft_model_state_dict(
        model,
        state_dict=dict(model.named_parameters()),
        adapter_name=adapter_name,
        save_embedding_layers=False,
    )
    out = {}
    for key, p in picked.items():
        t = p.detach()
        if is_dtensor(t):  # FSDP2 DTensor shard -> full tensor (collective)
            t = t.full_tensor()
        if rank() == 0:
            key = ".".join(
                part for part in key.removeprefix("base_model.model.").split(".") if part not in _WRAPPERS
            )
            out[key] = t.cpu().contiguous()
    if rank() == 0 and not out:
        raise ValueError(f"export_lora: adapter {adapter_name!r} has no lora_A/lora_B parameters")
    return out


def lora_file_tensors(
    model: nn.Module, *, adapter_name: str = "default"
) -> tuple[dict[str, torch.Tensor], Any]:
    """What `export_lora` writes, held in memory: the adapter's full tensors under the keys of its file
    (`transformer.<module>.lora_A.weight`: diffusers' saver prefixes the component) and its peft config. For an
    engine that takes the adapter from memory (the vLLM-Omni engine's `update_lora`). Collective as
    `lora_state_dict`."""
    cfg = _peft_config(model, adapter_name)
    sd = lora_state_dict(model, adapter_name=adapter_name)
    return {f"transformer.{k}": v for k, v in sd.items()}, cfg


def export_lora(
    out_dir: str | os.PathLike,
    model: nn.Module,
    *,
    adapter_name: str = "default",
    group: dist.ProcessGroup | None = None,
    extra_json: dict[str, Any] | None = None,
) -> Path:
    """Write a LoRA adapter that diffusers loads: `pipe.load_lora_weights(out_dir)` (Qwen-Image, SD3)
    and `transformer.load_lora_adapter(out_dir, use_safetensors=True)` (diffusers 0.40's model-level
    loader only tries safetensors when told so, or given `weight_name="adapter_model.safetensors"`).

    Written by diffusers' own `save_lora_weights` (0.40): one safetensors file whose keys are
    `transformer.<module>.lora_A.weight` / `lora_B.weight` (no PEFT adapter name: a `default.` in a key
    makes diffusers treat the file as a foreign format), with the LoraConfig as JSON under the
    `lora_adapter_metadata` header key, every field prefixed `transformer.`, so rank, alpha and targets
    survive exactly. `adapter_config.json` is PEFT's plain config, for people and tools (and the
    vLLM-Omni engine's `update_lora`); diffusers reads the header. Keys are not PEFT's `base_model.model.`
    layout, so `PeftModel.from_pretrained` needs `load_lora_adapter` instead.
    Atomic (`files.atomic_dir`, as a checkpoint); collective when torch.distributed is initialised: over `group`
    (the ranks that hold the model's shards; None = all ranks), whose first rank must be rank 0. `extra_json` ({file name: object}) is
    written into the same directory before it is renamed into place, so it always describes this adapter.
    """
    cfg = _peft_config(model, adapter_name)
    sd = lora_state_dict(model, adapter_name=adapter_name)
    out = Path(out_dir)
    if rank() == 0:
        with files.atomic_dir(out) as tmp:
            _write_lora(tmp, sd, cfg)
            for name, obj in (extra_json or {}).items():
                files.write_json(tmp / name, obj)
    barrier(group)
    return out


def _write_lora(out: Path, sd: dict[str, torch.Tensor], cfg: Any) -> None:
    """`export_lora`'s two files in `out` (made here): the safetensors by diffusers' own saver, the config JSON."""
    from diffusers.loaders.lora_pipeline import QwenImageLoraLoaderMixin

    cfg_dict = _lora_config_dict(cfg)
    out.mkdir(parents=True, exist_ok=True)
    # A transformer-only file: SD3's loader reads the same layout (its saver writes the same keys).
    QwenImageLoraLoaderMixin.save_lora_weights(
        out,
        # diffusers annotates this read-only argument as an invariant dict of Module | Tensor.
        transformer_lora_layers=sd,  # pyright: ignore[reportArgumentType]
        weight_name=ADAPTER_WEIGHTS,
        transformer_lora_adapter_metadata=cfg_dict,
    )
    files.fsync_file(out / ADAPTER_WEIGHTS)
    files.write_json(out / ADAPTER_CONFIG, cfg_dict)


def export_loras(
    out_dir: str | os.PathLike,
    transformers: Mapping[str, nn.Module],
    *,
    group: dist.ProcessGroup | None = None,
    extra_json: dict[str, Any] | None = None,
    subdirs: bool | None = None,
) -> Path:
    """The LoRA of each of a model's trained transformers (models.base.trained_transformers), as `export_lora`
    writes one: one transformer straight into `out_dir`, several (or `subdirs=True`) each into `out_dir/<name>`
    (Wan 2.2 T2V-A14B: `transformer/`, `transformer_2/`), in one atomic directory with `extra_json` at its top.
    Collective as `export_lora`."""
    if not (subdirs if subdirs is not None else len(transformers) > 1):
        (only,) = transformers.values()
        return export_lora(out_dir, only, group=group, extra_json=extra_json)
    gathered = {name: (_peft_config(t, "default"), lora_state_dict(t)) for name, t in transformers.items()}
    out = Path(out_dir)
    if rank() == 0:
        with files.atomic_dir(out) as tmp:
            for name, (cfg, sd) in gathered.items():
                _write_lora(tmp / name, sd, cfg)
            for name, obj in (extra_json or {}).items():
                files.write_json(tmp / name, obj)
    barrier(group)
    return out


def write_adapter(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], config: Any) -> Path:
    """Write a PEFT adapter directory atomically: `adapter_model.safetensors` holding `tensors` under their
    names as given, and `adapter_config.json` from `config` (a peft.LoraConfig or its dict). Not collective:
    the caller holds full tensors."""
    out = Path(out_dir)
    cfg = _lora_config_dict(config)
    with files.atomic_dir(out) as tmp:
        files.write_tensors(tmp / ADAPTER_WEIGHTS, dict(tensors), metadata={"format": "pt"})
        files.write_json(tmp / ADAPTER_CONFIG, cfg)
    return out
