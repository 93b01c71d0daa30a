"""The one place that knows about process groups: rank, world size, barrier, and which device a
collective on a group must use.

NCCL reduces only CUDA tensors, gloo reduces CPU (and CUDA) tensors, and a mixed backend such as
``"cpu:gloo,cuda:nccl"`` routes each device to its own backend. Every collective spikeguard
issues on a small host-side value (a vote, a count) goes through :func:`all_reduce`, which
places it on :func:`collective_device` and brings the result back; gradient reductions run where
the gradients are unless the backend cannot reduce there. Without torch.distributed (or before
``init_process_group``) the world is one rank and every function is a local no-op.

The device choice reads the group's backend *config* (``dist.get_backend_config``), not its
name: ``init_process_group()`` without a backend reports the name ``"undefined"`` while its
config says which devices it serves (``"cpu:gloo"`` on a CPU build; on recent torch with a GPU,
``"cuda:nccl"`` only). Tested here on gloo ranks (CPU) and, in ``benchmarks/gpu_check.py``, on
a one-rank NCCL group with the one-rank shortcut off; several NCCL ranks are untested.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_reduce", "all_true", "backend_devices", "barrier", "collective_device",
           "collective_device_type", "cpu_capable", "gather_object", "group_size", "is_dist",
           "local_tensor", "new_cpu_group", "rank", "world_size"]

# device types each built-in backend reduces on (torch's Backend.backend_capability, kept here
# so the pure functions below need no process group)
_CAPABILITY = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "xccl": ("xpu",),
               "ucc": ("cpu", "cuda"), "mpi": ("cpu", "cuda")}


def is_dist() -> bool:
    """True when torch.distributed is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def local_tensor(t: Any) -> Any:
    """This rank's shard of a DTensor (``to_local()``); any other value as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


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


def backend_devices(backend: str) -> frozenset[str]:
    """Device types a backend string serves: a config such as ``"cpu:gloo,cuda:nccl"`` names
    them; a plain name (``"nccl"``, ``"gloo"``) uses torch's capability table. Unknown names
    give an empty set."""
    text = backend.strip().lower()
    if ":" in text:
        return frozenset(part.split(":", 1)[0].strip() for part in text.split(",") if part.strip())
    table = getattr(getattr(dist, "Backend", None), "backend_capability", None) or _CAPABILITY
    return frozenset(table.get(text, _CAPABILITY.get(text, ())))


def cpu_capable(backend: str) -> bool:
    """Whether a backend string can reduce CPU tensors: gloo, mpi, ucc, or a config that names a
    CPU backend (``"cpu:gloo,cuda:nccl"``)."""
    return "cpu" in backend_devices(backend)


def collective_device_type(backend: str, preferred: str | None = None) -> str:
    """Pure rule: the device type a collective under ``backend`` uses for data on ``preferred``.

    ``preferred`` (where the data already is) wins when the backend serves it (a CUDA tensor
    under NCCL, gloo or a mixed config; a CPU tensor under gloo or a mixed config); otherwise CPU
    when the backend serves CPU; otherwise its accelerator (``"nccl"`` -> ``"cuda"``). A backend
    nobody knows keeps ``preferred`` (or CPU)."""
    devices = backend_devices(backend)
    if not devices:
        return preferred or "cpu"
    if preferred in devices:
        return preferred
    return "cpu" if "cpu" in devices else sorted(devices)[0]


def _backend(group: dist.ProcessGroup | None) -> str:
    get_config = getattr(dist, "get_backend_config", None)
    return get_config(group) if get_config is not None else str(dist.get_backend(group))


def _accelerator(device_type: str, group: dist.ProcessGroup | None) -> torch.device:
    """The current device of ``device_type``: the group's bound device when
    ``init_process_group(device_id=...)`` set one, else that device module's current device."""
    bound = getattr(group or dist.group.WORLD, "bound_device_id", None)
    if bound is not None and bound.type == device_type:
        return bound
    module = getattr(torch, device_type, None)
    if module is None or not module.is_available():
        raise RuntimeError(f"the process group reduces only {device_type} tensors "
                           f"(backend {_backend(group)!r}), but no {device_type} device is "
                           "available in this process")
    return torch.device(device_type, module.current_device())


def collective_device(group: dist.ProcessGroup | None = None, *,
                      preferred: torch.device | None = None) -> torch.device:
    """The device a collective on ``group`` must use (:func:`collective_device_type` applied to
    the group's backend config): ``preferred`` when the backend serves it, else CPU when it can,
    else the current accelerator (NCCL alone, e.g. FSDP2 with CPU offload holding CPU
    gradients). Without a process group: ``preferred`` or CPU."""
    if not is_dist():
        return preferred if preferred is not None else torch.device("cpu")
    kind = collective_device_type(_backend(group), preferred.type if preferred else None)
    if preferred is not None and preferred.type == kind:
        return preferred
    return torch.device("cpu") if kind == "cpu" else _accelerator(kind, group)


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               group: dist.ProcessGroup | None = None, *, shortcut: bool = True) -> torch.Tensor:
    """All-reduce ``tensor`` over ``group`` on the device the backend needs; returns the result
    on ``tensor``'s device (in place when no move was needed). With ``shortcut`` a one-rank group
    issues no collective; without it the collective runs even on one rank (tests use that to
    exercise the device path)."""
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
    """Wait for every rank of ``group``; nothing on one rank. Under an accelerator-only backend
    the barrier runs on :func:`collective_device` (torch would otherwise guess a device)."""
    if world_size(group) == 1:
        return
    device = collective_device(group)
    if device.type == "cpu":
        dist.barrier(group=group)
    else:
        dist.barrier(group=group, device_ids=[device.index])


def gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Gather one picklable object per rank onto the group's first rank: the list in rank order
    there, None on the others; ``[obj]`` without a process group. Only for objects this job's
    own ranks produced (they are unpickled)."""
    if world_size(group) == 1:
        return [obj]
    dst = 0 if group is None else dist.get_global_rank(group, 0)
    out: list[Any] | None = [None] * world_size(group) if rank(group) == 0 else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def new_cpu_group() -> dist.ProcessGroup | None:
    """A new gloo group over the whole world, for collectives issued from a background thread
    (async checkpoints) so they never interleave with the training thread's collectives on the
    default group. Collective: every rank calls it. None without torch.distributed."""
    return dist.new_group(backend="gloo") if is_dist() else None
