"""Process-group set-up for torchrun (gloo on CPU, nccl on CUDA); a single process otherwise.

Every helper works unchanged in a single process, so training code calls them unconditionally.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device: str | None = None) -> DistInfo:
    """Join the torchrun process group (when launched by torchrun) and pick this rank's device.

    ``device``: ``"cpu"``, ``"cuda"`` or None (CUDA when available). On CUDA each rank takes
    ``cuda:LOCAL_RANK``.
    """
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if use_cuda and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but CUDA is not available; use device=cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda and local_rank >= (gpus := torch.cuda.device_count()):
        raise ValueError(
            f"this process is local rank {local_rank} but the machine has {gpus} CUDA device(s); start at most "
            f"{gpus} processes per node (torchrun --nproc_per_node={gpus}), or train on CPU with device=cpu"
        )
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if _launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev)
    return DistInfo(0, 1, 0, dev)


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (picklable objects)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers into ``module`` on every rank (in place)."""
    if not dist.is_initialized():
        return
    with torch.no_grad():
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=src)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place; returns it."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(value: int, device: torch.device) -> int:
    """The largest ``value`` over ranks."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], device=device, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def cleanup_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
