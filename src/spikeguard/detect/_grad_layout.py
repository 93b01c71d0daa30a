"""Where each gradient element lives: the local pieces a rank holds and how many ranks hold each.

Private helper of ``detect/gradnorm.py``. The global sum of squares is
``sum over ranks, over local pieces: sumsq(piece) / copies(piece)``, where ``copies`` is the
number of ranks that hold a bit-identical copy of that piece. Summed by one all-reduce over the
default group, every distinct element is then counted exactly once, whatever the mix of
FSDP/HSDP shards, TP shards, DDP replicas, pipeline stages and meshes. With the usual power-of-two
copy counts the division is exact in float64.

Copy counts, all computed on the host from metadata (never from device values):

- DTensor gradient on mesh M with placements P: the mesh dims whose placement is neither
  Replicate nor Partial hold different elements (Shard, and _StridedShard, which does not report
  ``is_shard()``); the others hold copies, so ``copies = M.size() / prod(sharded dim sizes) *
  world / (M.size() * pp)``. The last factor counts replicas of the whole mesh outside it (DDP
  around a TP mesh); with a per-stage mesh and ``pp_group`` it is 1.
- Partial dims: a Partial local is a summand, not a piece of the tensor, so its squares say
  nothing about the squares of the sum. Such a gradient is first redistributed to Replicate on
  those dims (one extra collective per such tensor, on every step it occurs) and the result is
  counted as replicated there. Clipping still scales the Partial locals themselves: scaling every
  summand by one scalar scales the sum.
- Plain tensor: replicated on every rank of the world, except that ``pp_group`` says the stages
  hold different tensors and ``tp_group`` says a manual tensor-parallel shard differs across
  it; ``copies = world / (pp * tp)``. A parameter with the Megatron attribute
  ``tensor_model_parallel = False`` is a TP duplicate (``copies = world / pp``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._dist import collective_device, group_size, world_size

__all__ = ["GradLayout", "collect"]


@dataclass
class GradLayout:
    """The local pieces of one rank's gradients, grouped by copy count."""

    world: int
    """World size of the default group."""
    pp: int
    """Pipeline stages (size of pp_group, 1 without it)."""
    pieces: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """copies -> local tensors whose squares enter the norm (Partial dims already reduced)."""
    to_scale: list[torch.Tensor] = field(default_factory=list)
    """Every local gradient tensor, as stored: what clipping multiplies in place."""
    numel_share: float = 0.0
    """sum of piece.numel() / copies: this rank's share of the unsharded element count."""
    plain: int = 0
    """How many plain (non-DTensor) gradients there are."""
    dtensors: int = 0
    """How many DTensor gradients there are."""

    def device(self) -> torch.device:
        """Where the reduction runs: the first piece's device, unless that is the CPU and the
        default group cannot reduce CPU tensors (NCCL alone, e.g. FSDP2 with CPU offload)."""
        device = next((t[0].device for t in self.pieces.values() if t), torch.device("cpu"))
        return collective_device(preferred=device) if self.world > 1 else device


def _copies(world: int, distinct: int, what: str) -> int:
    """``world / distinct`` copies of each piece, as an int; ValueError when it does not tile."""
    if world % distinct:
        raise ValueError(f"{what}: {distinct} distinct pieces do not tile a world of {world} "
                         f"ranks; pp_group and tp_group must be orthogonal groups that divide "
                         f"the world, and a DTensor mesh must not span pipeline stages")
    return world // distinct


def _dtensor_piece(grad: torch.Tensor, world: int, pp: int) -> tuple[torch.Tensor, int]:
    from torch.distributed.tensor import Replicate

    mesh, placements = grad.device_mesh, tuple(grad.placements)
    if any(p.is_partial() for p in placements):
        grad = grad.redistribute(mesh, [Replicate() if p.is_partial() else p for p in placements])
    sharded = math.prod(mesh.size(d) for d, p in enumerate(placements)
                        if not (p.is_replicate() or p.is_partial()))
    outside = world // mesh.size()
    if world % mesh.size() or outside % pp:
        raise ValueError(f"a DTensor gradient lives on a mesh of {mesh.size()} ranks, which with "
                         f"pp_group of {pp} ranks does not tile the world of {world}; the mesh "
                         f"of a stage's parameters must not span pipeline stages")
    copies = (mesh.size() // sharded) * (outside // pp)
    return grad.to_local(), copies


def collect(parameters: Iterable[torch.Tensor] | torch.Tensor, *, pp_group: dist.ProcessGroup | None,
            tp_group: dist.ProcessGroup | None) -> GradLayout:
    """Walk ``parameters`` once and group their local gradients by copy count (host only)."""
    from torch.distributed.tensor import DTensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    world = world_size()
    pp = group_size(pp_group, "pp_group")
    tp = group_size(tp_group, "tp_group")
    layout = GradLayout(world=world, pp=pp)
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            layout.dtensors += 1
            layout.to_scale.append(grad.to_local())
            local, copies = _dtensor_piece(grad, world, pp)
        else:
            layout.plain += 1
            layout.to_scale.append(grad)
            tp_sharded = tp if getattr(p, "tensor_model_parallel", True) else 1
            copies = _copies(world, pp * tp_sharded, "a plain gradient")
            local = grad
        layout.pieces.setdefault(copies, []).append(local)
        layout.numel_share += local.numel() / copies
    return layout
