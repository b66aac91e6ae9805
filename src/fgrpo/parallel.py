"""Process group and FSDP2 sharding: the only place that knows about ranks and devices.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; a plain `python` run is a world of one with its own
in-memory process group, so the same loop (FSDP2 included) runs unchanged on a laptop.
"""

from __future__ import annotations

import gc
import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin
    from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def initialized() -> bool:
    """Whether a torch.distributed process group is up (a plain `python` run has one of size 1 after
    `init_distributed`)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the process group; 0 without one (or torchrun's RANK before it is joined)."""
    return dist.get_rank() if initialized() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """Ranks in the process group; 1 without one."""
    return dist.get_world_size() if initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of `group` (None = all ranks; no-op without a process group)."""
    if initialized():
        dist.barrier(group=group)


def init_distributed(device: str = "auto") -> Dist:
    """Join the torchrun process group if there is one (NCCL on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device(device)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        device_id = dev if dev.type == "cuda" else None
        if world_size > 1:
            dist.init_process_group(backend=backend, device_id=device_id)
        else:
            # A world of one still gets a process group, so FSDP2 (and its mixed precision) runs the same
            # code on a laptop as on 8 GPUs; an in-memory store needs no free port.
            # HashStore is public (torch.distributed's docs) but re-exported without being marked so.
            dist.init_process_group(
                backend=backend,
                store=dist.HashStore(),  # pyright: ignore[reportPrivateImportUsage]
                rank=0,
                world_size=1,
                device_id=device_id,
            )
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def shutdown(*objects_to_drop: object) -> None:
    """Leave the process group cleanly.

    Destroying the group while FSDP tensors or optimizer state are still alive aborts ~15 % of gloo
    runs; the caller drops its references first, we collect and barrier, then destroy.
    """
    global _sp_mesh
    del objects_to_drop
    _sp_mesh = None
    gc.collect()
    if initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_gather_cat(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate equal-shaped per-rank tensors along dim 0, in rank order (identity without a group).
    group: the ranks to gather over (a Split's side); None = all of them."""
    if not initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


@dataclass(frozen=True)
class Split:
    """Which ranks train and which roll out, and the process groups between them.

    Synchronous (rollout_ranks 0): every rank does both and every group is None (the default group).
    Asynchronous: ranks [0, T) train (rank 0, which logs and checkpoints, is a trainer), ranks [T, world) roll
    out. `group` is this rank's side (FSDP2 shards and rewards are gathered within it); `wire` is a gloo group
    over all ranks that carries samples and weights between the sides (CPU tensors: gloo's point-to-point
    sends return at once, so neither side waits for the other to post its receive; None = the default group,
    when that already is gloo).
    """

    trainer_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]
    group: dist.ProcessGroup | None = None
    wire: dist.ProcessGroup | None = field(default=None, repr=False)

    @property
    def is_async(self) -> bool:
        return self.trainer_ranks != self.rollout_ranks

    @property
    def trains(self) -> bool:
        return rank() in self.trainer_ranks

    @property
    def rolls_out(self) -> bool:
        return rank() in self.rollout_ranks

    def side_rank(self) -> int:
        """This rank's index within its side."""
        side = self.trainer_ranks if self.trains else self.rollout_ranks
        return side.index(rank())

    def data_size(self) -> int:
        """Shards the step's samples are cut into on this rank's side: its ranks over sp (the ranks of an SP group
        hold the same samples; sp is 1 in the asynchronous mode)."""
        return len(self.trainer_ranks if self.trains else self.rollout_ranks) // sp_size()

    def data_rank(self) -> int:
        """This rank's shard of the samples on its side (`dp_rank()` in the synchronous mode)."""
        return self.side_rank() // sp_size()

    def data_group(self) -> dist.ProcessGroup | None:
        """The ranks to gather per-sample results over: one per shard of this side (None = all ranks)."""
        return self.group if self.is_async else dp_group()

    def mesh(self, device: torch.device):
        """The DeviceMesh FSDP2 shards this rank's model over (None = all ranks, fully_shard's default)."""
        if self.group is None:
            return None
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(self.group, device.type)


def split(rollout_ranks: int) -> Split:
    """Cut the world into trainer and rollout ranks (collective: every rank calls it, in the same order)."""
    world = world_size()
    everyone = tuple(range(world))
    if rollout_ranks == 0:
        return Split(everyone, everyone)
    trainers, rollouts = everyone[: world - rollout_ranks], everyone[world - rollout_ranks :]
    # new_group is collective over the whole world, members or not.
    groups = [dist.new_group(list(trainers)), dist.new_group(list(rollouts))]
    wire = None if dist.get_backend() == "gloo" else dist.new_group(list(everyone), backend="gloo")
    mine = groups[0] if rank() in trainers else groups[1]
    # new_group answers a non-member with an int sentinel; each rank belongs to its own side and to the wire.
    assert isinstance(mine, dist.ProcessGroup) and (wire is None or isinstance(wire, dist.ProcessGroup))
    return Split(trainers, rollouts, mine, wire)


@dataclass
class Pending:
    """Point-to-point sends in flight; their buffers stay referenced until `wait()`."""

    works: list = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works.clear()
        self.buffers.clear()


def isend_object(obj: object, dst: int, pending: Pending, *, group=None, tag: int = 0) -> None:
    """Send a picklable object (CPU tensors inside) to global rank `dst` without waiting for it to arrive.

    torch.save's pickle, as a size then a byte tensor; `recv_object` on `dst` is its other half. The sends join
    `pending`, which must be waited on before the process group is destroyed.
    """
    raw = io.BytesIO()
    torch.save(obj, raw)
    data = torch.frombuffer(bytearray(raw.getbuffer()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    for t in (size, data):
        pending.works.append(dist.isend(t, dst, group=group, tag=tag))
        pending.buffers.append(t)


def recv_object(src: int, *, group=None, tag: int = 0) -> object:
    """Receive what `isend_object` sent from global rank `src` (blocks until it arrives)."""
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group, tag=tag)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src, group=group, tag=tag)
    # Our own payload (a Trajectory, metrics, tensors), not a file from elsewhere: full unpickling is safe.
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)


def isend_tensors(
    tensors: dict[str, torch.Tensor], dst: int, pending: Pending, *, group=None, tag: int = 0
) -> None:
    """Send named CPU tensors to global rank `dst` without pickling their data: their index (names, shapes,
    dtypes) through `isend_object`, then the tensors of each dtype end to end as one byte tensor (one copy,
    against pickling's several: for a 0.2 B-parameter LoRA the difference is seconds). `recv_tensors` on `dst`
    is its other half."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"isend_tensors sends CPU tensors; {name!r} is on {t.device}")
        by_dtype.setdefault(t.dtype, []).append(t)
    isend_object(
        [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()], dst, pending, group=group, tag=tag
    )
    for ts in by_dtype.values():
        flat = _end_to_end(ts)
        flat = (torch.cat([t.reshape(-1) for t in ts]) if flat is None else flat).view(torch.uint8)
        if flat.numel():
            pending.works.append(dist.isend(flat, dst, group=group, tag=tag))
            pending.buffers.append(flat)


def _end_to_end(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D tensor over the one storage that `ts` tile in order, from its start to its end, as contiguous views
    (async_mode.trainable_tensors lays them out so): sent as it is, without a copy. None when they do not."""
    storage, offset = ts[0].untyped_storage(), 0
    for t in ts:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != offset:
            return None
        if not t.is_contiguous():
            return None
        offset += t.numel()
    if offset * ts[0].element_size() != storage.nbytes():
        return None
    return ts[0].as_strided((offset,), (1,), 0)


def end_to_end(
    index: list[tuple[str, tuple[int, ...], torch.dtype]],
) -> tuple[dict[torch.dtype, torch.Tensor], dict[str, torch.Tensor]]:
    """New CPU buffers for the named tensors of `index` laid end to end, one per dtype (ordered by first
    appearance, as `isend_tensors` sends them), and each tensor's view into its buffer."""
    numel: dict[torch.dtype, int] = {}
    for _, shape, dtype in index:
        numel[dtype] = numel.get(dtype, 0) + math.prod(shape)
    flats = {dtype: torch.empty(n, dtype=dtype) for dtype, n in numel.items()}
    views, offset = {}, dict.fromkeys(numel, 0)
    for name, shape, dtype in index:
        n = math.prod(shape)
        views[name] = flats[dtype][offset[dtype] : offset[dtype] + n].view(shape)
        offset[dtype] += n
    return flats, views


def recv_tensors(src: int, *, group=None, tag: int = 0) -> dict[str, torch.Tensor]:
    """Receive what `isend_tensors` sent from global rank `src`: views of one CPU buffer per dtype."""
    index = recv_object(src, group=group, tag=tag)
    assert isinstance(index, list)
    flats, views = end_to_end(index)
    for flat in flats.values():
        if flat.numel():
            dist.recv(flat.view(torch.uint8), src, group=group, tag=tag)
    return views


# The dp x ring x ulysses DeviceMesh of `init_sequence_parallel` (None: no sequence parallelism, sp = 1).
_sp_mesh = None


def init_sequence_parallel(sp: int, device: torch.device) -> None:
    """Lay the ranks out as dp x sp (collective; after `init_distributed`, before the model is sharded).

    An SP group is `sp` consecutive ranks: they hold the same samples and split each sample's tokens
    (diffusers' Ulysses attention, `enable_sequence_parallel`). The mesh has diffusers' two context-parallel
    dimensions, ring (size 1) and ulysses (size sp), after the data-parallel one. sp = 1 leaves no mesh.
    """
    global _sp_mesh
    _sp_mesh = None
    if sp == 1:
        return
    if world_size() % sp:
        raise ValueError(f"parallel.sp={sp} must divide the world size {world_size()}; pass a divisor")
    from torch.distributed.device_mesh import init_device_mesh

    _sp_mesh = init_device_mesh(
        device.type, (world_size() // sp, 1, sp), mesh_dim_names=("dp", "ring", "ulysses")
    )


def sp_size() -> int:
    """Ranks that split one sample's sequence (1 without sequence parallelism)."""
    return 1 if _sp_mesh is None else _sp_mesh["ulysses"].size()


def dp_size() -> int:
    """Ranks that hold distinct samples: the world size over sp."""
    return world_size() // sp_size()


def dp_rank() -> int:
    """This rank's data shard: the ranks of one SP group share it (= `rank()` without sequence parallelism)."""
    return rank() // sp_size()


def dp_group() -> dist.ProcessGroup | None:
    """One rank of each SP group, this rank's among them: the ranks to gather per-sample results over
    (None = all ranks, fully_shard's and all_gather_cat's default, without sequence parallelism)."""
    return None if _sp_mesh is None else _sp_mesh["dp"].get_group()


def enable_sequence_parallel(transformer: ModelMixin) -> None:
    """Split the transformer's sequence over the SP group (diffusers' Ulysses context parallelism); no-op at sp 1.

    Call after `shard_transformer`, which shards over all ranks. Each rank's backward then yields the gradient
    of its own tokens only, so the SP group's sum is the full gradient of its samples: FSDP2 divides the
    reduce-scatter sum by the data-parallel size instead of its default, the world size.
    """
    if _sp_mesh is None:
        return
    # Public in diffusers' docs, re-exported lazily without being marked so.
    from diffusers import ContextParallelConfig  # pyright: ignore[reportPrivateImportUsage]
    from torch.distributed.fsdp import FSDPModule

    heads = getattr(transformer.config, "num_attention_heads", 0)
    if heads % sp_size():
        raise ValueError(
            f"parallel.sp={sp_size()} must divide the transformer's {heads} attention heads (Ulysses gives each "
            "rank whole heads); pass a divisor"
        )
    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=sp_size(), mesh=_sp_mesh))
    for m in transformer.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(float(dp_size()))
            # A divisor other than the group size is NCCL's PREMUL_SUM, which gloo lacks: sum, then divide.
            m.set_force_sum_reduction_for_comms(True)


def sequence_multiple(transformer: nn.Module) -> int:
    """What each token stream's length must be a multiple of for the transformer's context-parallel split
    (diffusers' even split; 1 when `enable_sequence_parallel` was not applied)."""
    config = getattr(transformer, "_parallel_config", None)
    cp = None if config is None else config.context_parallel_config
    return 1 if cp is None else cp.ulysses_degree * cp.ring_degree


def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether `t` is an FSDP2 (DTensor) shard. Asked of the tensor's methods, so a run that never shards
    does not import torch.distributed.tensor (seconds)."""
    return hasattr(t, "full_tensor")


def any_across_shards(flags: Sequence[bool], module: nn.Module) -> list[bool]:
    """Each flag OR-ed over the ranks that `module`'s FSDP2 parameters are sharded over (as given when it is not
    sharded, or over one rank). For a choice of which sharded modules to run that every rank of the mesh must make
    alike: an FSDP2 forward all-gathers and its backward reduce-scatters, collectives every rank has to join."""
    p = next((p for p in module.parameters() if is_dtensor(p)), None)
    if p is None or p.device_mesh.size() == 1:
        return list(flags)
    t = torch.tensor([int(f) for f in flags], device=p.to_local().device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=p.device_mesh.get_group())
    return [bool(v) for v in t.tolist()]


def shard_transformer(
    transformer: nn.Module,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None = torch.float32,
    block_attr: str | None = None,
    reshard_after_forward: bool = True,
    mesh=None,
    shard: Literal["full", "adapters"] = "full",
) -> nn.Module:
    """FSDP2 in TorchTitan's pattern: fully_shard every transformer block, then the root.

    Parameters stay fp32 masters (sharded); `param_dtype` is what forward/backward compute in (bf16 on
    GPUs), `reduce_dtype` what gradients are reduced in (fp32, so small LoRA gradients don't round away).
    Call after LoRA is attached and before the optimizer is built. mesh: the ranks to shard over
    (`Split.mesh`, one side of the asynchronous mode); None = all ranks.

    shard: "full" shards every parameter; "adapters" shards only the trainable ones (the LoRA) and leaves the
    frozen base an ordinary tensor on every rank (fully_shard's `ignored_params`). The base is then never
    all-gathered nor copied (full sharding gathers each block's base once per forward and once per backward,
    at world size 1 too, where the "gather" is a copy), at the price of one whole base per rank. The blocks
    and the root are the same FSDP units with the same policy, so the adapters' bf16 compute, fp32 masters
    and fp32 gradient reduction are unchanged and the numbers equal full sharding's bit for bit.

    block_attr: the attribute holding the blocks to shard one by one; None = the first of `transformer_blocks`,
    `layers` (Z-Image's main stack; its small refiner blocks go with the root) and `blocks` (Wan's) it has.

    Only the root casts its floating inputs to `param_dtype`; a block takes what the root hands it, as in the
    unsharded model (LTX-2's RoPE cos/sin stay fp32, as the model computes and applies them).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # A block's input cast would run in its forward but, before torch 2.13 (pytorch#159359), not in the gradient
    # checkpoint's recompute of it (diffusers checkpoints the FSDP block from outside its hooks): a floating input
    # the root does not already compute in param_dtype (LTX-2's fp32 RoPE; Qwen-Image's is complex, which FSDP
    # never casts) was bf16 in one and fp32 in the other, and backward raised a CheckpointError.
    block_mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    if block_attr is None:
        block_attr = next(
            (a for a in ("transformer_blocks", "layers", "blocks") if hasattr(transformer, a)),
            "transformer_blocks",
        )
    blocks = getattr(transformer, block_attr, None)
    if blocks is None:
        raise ValueError(
            f"shard_transformer: {type(transformer).__name__} has no '{block_attr}'; pass block_attr="
        )
    if shard not in ("full", "adapters"):
        raise ValueError(f"parallel.shard={shard!r}: use 'full' or 'adapters'")
    frozen = {p for p in transformer.parameters() if not p.requires_grad} if shard == "adapters" else set()
    if shard == "adapters" and len(frozen) == len(list(transformer.parameters())):
        raise ValueError(
            "parallel.shard='adapters' shards the trainable parameters and there are none; add LoRA"
        )
    for block in blocks:
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=block_mp,
            reshard_after_forward=reshard_after_forward,
            ignored_params=frozen,
        )
    fully_shard(
        transformer,
        mesh=mesh,
        mp_policy=mp,
        reshard_after_forward=reshard_after_forward,
        ignored_params=frozen,
    )
    # Methods a model calls besides forward (BAGEL's prompt KV) need FSDP's unshard hooks too.
    for module in (transformer, *blocks):
        for name in getattr(module, "fsdp_forward_methods", ()):
            register_fsdp_forward_method(module, name)
    return transformer
