"""Process-group helpers: no-ops in a single process, collectives under ``torchrun``."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from .errors import UsageError

_initialized_here = False  # the default process group was created by init_distributed


def init_distributed() -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, device
    global _initialized_here
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
        _initialized_here = True
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def shutdown_distributed() -> None:
    """Destroy the process group ``init_distributed`` created (its threads must not outlive the run:
    left to the interpreter's exit, gloo can abort with "terminate called without an active exception")."""
    global _initialized_here
    if _initialized_here and dist.is_initialized():
        dist.destroy_process_group()
    _initialized_here = False


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def all_sum(x: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(x)
    return x


def agree(flag: bool, world: int, device) -> bool:
    """True on every rank when ``flag`` is true on any."""
    if world == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def from_rank0(fn: Callable[[], object], rank: int, world: int):
    """``fn()`` run on rank 0; its result, or its error, reaches every rank."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as exc:
            error = exc
    if world > 1:
        box = [result, None if error is None else (isinstance(error, UsageError), str(error))]
        dist.broadcast_object_list(box, src=0)
        result, remote = box
        if rank != 0 and remote is not None:
            is_usage, message = remote
            error = UsageError(message) if is_usage else RuntimeError(f"rank 0 failed: {message}")
    if error is not None:
        raise error
    return result
