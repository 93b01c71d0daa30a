"""The one place that knows about process groups: rank, world size, barrier, and which device a
collective on a group must use.

NCCL reduces only CUDA tensors, gloo reduces CPU tensors, and a mixed backend string such as
``"cpu:gloo,cuda:nccl"`` does both. Every collective spikeguard issues on a small host-side
value (a vote, a count) goes through :func:`all_reduce`, which places it on
:func:`collective_device` and brings the result back; gradient reductions run where the
gradients are unless the backend cannot reduce there. Without torch.distributed (or before
``init_process_group``) the world is one rank and every function is a local no-op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce", "all_true", "barrier", "collective_device", "group_size", "is_dist",
           "rank", "world_size"]


def is_dist() -> bool:
    """True when torch.distributed is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the default group when None); 0 without one."""
    return dist.get_rank(group) if is_dist() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (the default group when None); 1 without torch.distributed."""
    return dist.get_world_size(group) if is_dist() else 1


def group_size(group: dist.ProcessGroup | None, name: str) -> int:
    """Size of an optional user-given group (1 for None); ValueError when one is given but no
    process group has been initialised."""
    if group is None:
        return 1
    if not is_dist():
        raise ValueError(f"{name}={group!r} was given but torch.distributed is not initialized; "
                         f"call init_process_group first or pass {name}=None")
    return dist.get_world_size(group)


def _accelerator() -> torch.device:
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if acc is None:
        if not torch.cuda.is_available():
            raise RuntimeError("the process group's backend reduces only accelerator tensors, "
                               "but no accelerator is available in this process")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(acc.type, torch.accelerator.current_device_index())


def cpu_capable(backend: str) -> bool:
    """Whether a backend string (``dist.get_backend``) can reduce CPU tensors: gloo, mpi, or a
    mixed string that names a CPU backend (``"cpu:gloo,cuda:nccl"``)."""
    backend = backend.lower()
    if ":" in backend:
        return any(part.split(":", 1)[0].strip() == "cpu" for part in backend.split(","))
    return backend in ("gloo", "mpi")


def collective_device(group: dist.ProcessGroup | None = None, *,
                      preferred: torch.device | None = None) -> torch.device:
    """The device a collective on ``group`` must use.

    ``preferred`` (where the data already is) wins when the backend can reduce there: a CUDA
    tensor under NCCL or a mixed backend, a CPU tensor under gloo. Otherwise CPU for a
    CPU-capable backend, else the current accelerator (NCCL alone, e.g. FSDP2 with CPU offload
    holding CPU gradients). Without a process group: ``preferred`` or CPU.
    """
    if not is_dist():
        return preferred if preferred is not None else torch.device("cpu")
    on_cpu = cpu_capable(dist.get_backend(group))
    if preferred is not None and (preferred.type != "cpu" or on_cpu):
        return preferred
    return torch.device("cpu") if on_cpu else _accelerator()


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               group: dist.ProcessGroup | None = None, *, shortcut: bool = True) -> torch.Tensor:
    """All-reduce ``tensor`` over ``group`` on the device the backend needs; returns the result
    on ``tensor``'s device (in place when no move was needed). With ``shortcut`` a one-rank group
    issues no collective."""
    if not is_dist() or (shortcut and world_size(group) == 1):
        return tensor
    device = collective_device(group, preferred=tensor.device)
    work = tensor if tensor.device == device else tensor.to(device)
    dist.all_reduce(work, op=op, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_true(ok: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True only if every rank of ``group`` says ``ok``: agree before acting. One collective
    (none on one rank)."""
    if world_size(group) == 1:
        return bool(ok)
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    return int(all_reduce(flag, group=group)) == 0


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group``; nothing on one rank."""
    if world_size(group) > 1:
        dist.barrier(group=group)
