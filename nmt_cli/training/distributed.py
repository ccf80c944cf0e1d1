"""torchrun integration: read RANK / WORLD_SIZE / LOCAL_RANK, NCCL on CUDA, gloo on CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """Where this process sits among the training processes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: torch.device) -> DistContext:
    """Join the process group torchrun set up (no-op for a single process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    ctx = DistContext(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return ctx


def all_reduce(values: list[float] | torch.Tensor, ctx: DistContext, device: torch.device) -> list[float]:
    """Sum a few numbers — a list, or a float64 tensor on `device` — over all processes; read them on the
    host."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.float64, device=device)
    if ctx.enabled:
        dist.all_reduce(t)
    return t.tolist()


def gather_objects(obj, ctx: DistContext) -> list:
    """Every process's `obj`, in rank order (on every process)."""
    if not ctx.enabled:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, ctx: DistContext):
    """Rank 0's `obj`, on every process."""
    if not ctx.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown(ctx: DistContext) -> None:
    """Leave the process group once every process is done with it: a rank that tears down its connections while
    another still uses them can make that one abort (SIGABRT at the end of a run)."""
    if ctx.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
