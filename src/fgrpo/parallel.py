"""Process group and FSDP2 sharding: the only place that knows about ranks and devices.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; a plain `python` run is a world of one with its own
in-memory process group, so the same loop (FSDP2 included) runs unchanged on a laptop.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
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


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if initialized():
        dist.barrier()


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
    del objects_to_drop
    gc.collect()
    if initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_gather_cat(x: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped per-rank tensors along dim 0, in rank order (identity without a group)."""
    if not initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether `t` is an FSDP2 (DTensor) shard. Asked of the tensor's methods, so a run that never shards
    does not import torch.distributed.tensor (seconds)."""
    return hasattr(t, "full_tensor")


def shard_transformer(
    transformer: nn.Module,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None = torch.float32,
    block_attr: str = "transformer_blocks",
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2 in TorchTitan's pattern: fully_shard every transformer block, then the root.

    Parameters stay fp32 masters (sharded); `param_dtype` is what forward/backward compute in (bf16 on
    GPUs), `reduce_dtype` what gradients are reduced in (fp32, so small LoRA gradients don't round away).
    Call after LoRA is attached and before the optimizer is built.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = getattr(transformer, block_attr, None)
    if blocks is None:
        raise ValueError(
            f"shard_transformer: {type(transformer).__name__} has no '{block_attr}'; pass block_attr="
        )
    for block in blocks:
        fully_shard(block, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(transformer, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return transformer
