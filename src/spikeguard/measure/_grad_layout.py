"""Where each gradient element lives, and the local arithmetic on it.

Private helper of ``measure/gradnorm.py`` and ``measure/probes.py``: :func:`collect` walks the
parameters once and returns a :class:`GradLayout`, whose methods give this rank's share of a
global quantity (summed by the caller with ONE all-reduce over the default group) and scale the
gradients in place. The caller never touches the pieces itself.

The global sum of squares is ``sum over ranks, over local pieces: sumsq(piece) / copies(piece)``,
where ``copies`` is the number of ranks that hold a bit-identical copy of that piece. Summed over
the default group, every distinct element then counts exactly once, whatever the mix of
FSDP/HSDP shards, TP shards, DDP replicas, pipeline stages and meshes. With the usual
power-of-two copy counts the division is exact in float64. The same weighting serves any p-norm
(a sum of ``|x|^p``); the max-norm needs none (a max-reduce).

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
from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

from .._dist import collective_device, group_size, world_size

__all__ = ["GradLayout", "collect", "group_by_device_dtype", "tensor_norms"]

_F64 = torch.float64
_LOW = (torch.float16, torch.bfloat16)


def group_by_device_dtype(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), the unit a foreach kernel takes."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def _use_foreach(tensors: list[torch.Tensor], foreach: bool | None) -> bool:
    """torch's rule: None uses the foreach kernels where they exist; True insists on them."""
    device = tensors[0].device
    if foreach is None:
        return _has_foreach_support(tensors, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(f"foreach=True was given, but {device.type} tensors have no foreach "
                           f"kernels; pass foreach=None or False")
    return bool(foreach)


def tensor_norms(tensors: list[torch.Tensor], device: torch.device, p: float = 2.0,
           foreach: bool | None = None) -> torch.Tensor:
    """Per-tensor p-norms in the order of ``tensors``, as one vector on ``device`` (float32 for
    16-bit and float32 gradients, float64 for float64 ones)."""
    groups = group_by_device_dtype(tensors)
    out = []
    for idx in groups:
        group = [tensors[i] for i in idx]
        dtype = torch.float32 if group[0].dtype in _LOW else None
        if _use_foreach(group, foreach):
            norms = torch._foreach_norm(group, p, dtype=dtype)
        else:
            norms = [torch.linalg.vector_norm(t, p, dtype=dtype) for t in group]
        out.append(torch.stack(norms).to(device))
    if len(out) == 1:
        return out[0]
    order = [i for idx in groups for i in idx]
    dtype = _F64 if any(o.dtype == _F64 for o in out) else torch.float32
    flat = torch.cat([o.to(dtype) for o in out])
    return flat[torch.tensor(order, device=device).argsort()]


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
    shard_groups: list[tuple[torch.Tensor, tuple]] = field(default_factory=list)
    """(piece, the groups over which its shards differ): what ``nonzero_share`` sums over."""
    numel_share: float = 0.0
    """sum of piece.numel() / copies: this rank's share of the unsharded element count."""
    plain: int = 0
    """How many plain (non-DTensor) gradients there are."""
    dtensors: int = 0
    """How many DTensor gradients there are."""
    owners: dict[int, list[int]] = field(default_factory=dict)
    """copies -> for each piece, the index of its parameter among those walked (None grads
    counted): what maps a per-piece norm back to a parameter name."""
    walked: int = 0
    """How many parameters were walked (None grads counted): the length of a per-tensor vector."""
    scale_owner: list[int] = field(default_factory=list)
    """For each entry of ``to_scale``, the index of its parameter among those walked."""
    _norms: dict[int, torch.Tensor] | None = field(default=None, init=False, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the norm: float64 when any gradient is float64, else float32."""
        return _F64 if any(t.dtype == _F64 for t in self.to_scale) else torch.float32

    def device(self) -> torch.device:
        """Where the reduction runs: the first piece's device, unless that is the CPU and the
        default group cannot reduce CPU tensors (NCCL alone, e.g. FSDP2 with CPU offload)."""
        device = next((t[0].device for t in self.pieces.values() if t), torch.device("cpu"))
        return collective_device(preferred=device) if self.world > 1 else device

    def sumsq(self, device: torch.device, foreach: bool | None = None) -> torch.Tensor:
        """This rank's share of the global sum of squares: 0-dim float64 on ``device``, from one
        ``_foreach_norm`` per (copies, device, dtype) group. No host read. The per-tensor norms
        are kept for :meth:`nonfinite_sumsq`."""
        self._norms = {}
        parts = []
        for copies, tensors in self.pieces.items():
            self._norms[copies] = tensor_norms(tensors, device, foreach=foreach)
            parts.append(self._norms[copies].to(_F64).square().sum() / copies)
        return torch.stack(parts).sum() if parts else torch.zeros((), dtype=_F64, device=device)

    def tensor_sumsq(self, device: torch.device) -> torch.Tensor:
        """This rank's share of each walked parameter's global sum of squares, float64
        ``[walked]`` (0 for a None grad), from the norms :meth:`sumsq` kept; no host read."""
        assert self._norms is not None, "sumsq() first"
        out = torch.zeros(self.walked, dtype=_F64, device=device)
        for copies, norms in self._norms.items():
            idx = torch.tensor(self.owners[copies], dtype=torch.int64, device=device)
            out.index_add_(0, idx, norms.to(device, _F64).square() / copies)
        return out

    @torch.no_grad()
    def scale_each_(self, coefs: torch.Tensor) -> None:
        """Multiply each local gradient in place by ``coefs[i]`` of its parameter i."""
        for g, i in zip(self.to_scale, self.scale_owner):
            g.mul_(coefs[i].to(g.device))

    def finite_pieces(self) -> tuple[torch.Tensor | None, list[int]]:
        """(1-D bool tensor: whether each local piece's norm is finite, the piece's parameter
        index), from the norms :meth:`sumsq` kept; no host read. (None, []) without pieces."""
        assert self._norms is not None, "sumsq() first"
        if not self._norms:
            return None, []
        flags = torch.cat([torch.isfinite(self._norms[c]) for c in self.pieces])
        return flags, [i for c in self.pieces for i in self.owners[c]]

    def nonfinite_sumsq(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of (non-finite element count, sum of squares without float32
        overflow), both 0-dim float64, after :meth:`sumsq`. Each tensor whose float32 norm is
        inf but whose elements are finite is recomputed as ``amax^2 * ||g / amax||^2`` in
        float64. Host reads: one per copy group, plus the counts."""
        assert self._norms is not None, "sumsq() first"
        bad = torch.zeros((), dtype=_F64, device=device)
        sumsq = torch.zeros((), dtype=_F64, device=device)
        for copies, tensors in self.pieces.items():
            norms = self._norms[copies].to(_F64)  # in the order of tensors
            overflowed = torch.isinf(norms).tolist()
            for t, norm, over in zip(tensors, norms, overflowed):
                bad += (~torch.isfinite(t)).sum().to(device, _F64) / copies
                if over:
                    amax = t.detach().abs().amax().to(device, _F64)
                    ok = torch.isfinite(amax) & (amax > 0)
                    scale = torch.where(ok, amax, torch.ones_like(amax))
                    scaled = (t.detach().to(device, _F64) / scale).square().sum() * scale**2
                    norm_sq = torch.where(ok, scaled, norm.square())
                else:
                    norm_sq = norm.square()
                sumsq += norm_sq / copies
        return bad, sumsq

    def pnorm_share(self, p: float, device: torch.device,
                    foreach: bool | None = None) -> torch.Tensor:
        """This rank's share of ``sum |x|^p`` (finite p other than 0): torch's per-tensor
        p-norms raised to p in float64, weighted by copies; 0-dim float64. Empty pieces add 0."""
        parts = [torch.zeros((), dtype=_F64, device=device)]
        for copies, tensors in self.pieces.items():
            tensors = [t for t in tensors if t.numel()]
            if tensors:
                norms = tensor_norms(tensors, device, p, foreach).to(_F64)
                parts.append(norms.pow(p).sum() / copies)
        return torch.stack(parts).sum()

    def extreme(self, p: float, device: torch.device, foreach: bool | None = None) -> torch.Tensor:
        """Local max (p = inf) or min (p = -inf) of ``|x|``, 0-dim float64; NaN if any element
        is NaN; 0 or inf (the reduction's identity) when this rank holds no element."""
        found = [tensor_norms([t for t in ts if t.numel()], device, p, foreach)
                 for ts in self.pieces.values() if any(t.numel() for t in ts)]
        if not found:
            return torch.full((), 0.0 if p > 0 else math.inf, dtype=_F64, device=device)
        flat = torch.cat([f.to(_F64) for f in found])
        return flat.amax() if p > 0 else flat.amin()  # both propagate NaN

    def nonzero_share(self, device: torch.device) -> torch.Tensor:
        """This rank's share of torch's ``norm_type=0`` result, the number of gradient tensors
        holding a non-zero (or NaN) element: each piece's count is summed over the ranks that
        hold its other shards (one all-reduce per such group), and every tensor's 0/1 then sits
        on world / pp ranks. 0-dim float64."""
        counts = torch.stack([torch.count_nonzero(t).to(device, _F64)
                              for t, _ in self.shard_groups]) if self.shard_groups else None
        if counts is None:
            return torch.zeros((), dtype=_F64, device=device)
        by_groups: dict[tuple, list[int]] = {}
        for i, (_, groups) in enumerate(self.shard_groups):
            by_groups.setdefault(groups, []).append(i)
        for groups, idx in by_groups.items():  # first-seen order: the same on every rank
            for group in groups:
                part = counts[idx]
                dist.all_reduce(part, group=group.group() if isinstance(group, _MeshDim) else group)
                counts[idx] = part
        return (counts > 0).sum().to(_F64) * (self.pp / self.world)

    @torch.no_grad()
    def scale_(self, coef: torch.Tensor, foreach: bool | None = None) -> None:
        """Multiply every local gradient in place by the 0-dim ``coef``."""
        tensors = self.to_scale
        for idx in group_by_device_dtype(tensors):
            group = [tensors[i] for i in idx]
            c = coef.to(group[0].device)
            if _use_foreach(group, foreach):
                torch._foreach_mul_(group, c)
            else:
                for g in group:
                    g.mul_(c)


def _copies(world: int, distinct: int, what: str) -> int:
    """``world / distinct`` copies of each piece, as an int; ValueError when it does not tile."""
    if world % distinct:
        raise ValueError(f"{what}: {distinct} distinct pieces do not tile a world of {world} "
                         f"ranks; pp_group and tp_group must be orthogonal groups that divide "
                         f"the world, and a DTensor mesh must not span pipeline stages")
    return world // distinct


def _dtensor_piece(grad: torch.Tensor, world: int, pp: int) -> tuple[torch.Tensor, int, tuple]:
    from torch.distributed.tensor import Replicate

    mesh, placements = grad.device_mesh, tuple(grad.placements)
    if any(p.is_partial() for p in placements):
        grad = grad.redistribute(mesh, [Replicate() if p.is_partial() else p for p in placements])
    dims = tuple(d for d, p in enumerate(placements) if not (p.is_replicate() or p.is_partial()))
    sharded = math.prod(mesh.size(d) for d in dims)
    outside = world // mesh.size()
    if world % mesh.size() or outside % pp:
        raise ValueError(f"a DTensor gradient lives on a mesh of {mesh.size()} ranks, which with "
                         f"pp_group of {pp} ranks does not tile the world of {world}; the mesh "
                         f"of a stage's parameters must not span pipeline stages")
    copies = (mesh.size() // sharded) * (outside // pp)
    groups = tuple(_MeshDim(mesh, d) for d in dims if mesh.size(d) > 1)
    return grad.to_local(), copies, groups


@dataclass(frozen=True)
class _MeshDim:
    """One sharded dim of a device mesh, resolved to its process group only when needed."""

    mesh: object
    dim: int

    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.dim)


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
    if isinstance(parameters, (str, bytes)) or not hasattr(parameters, "__iter__"):
        raise TypeError(f"parameters must be a tensor or an iterable of tensors (e.g. "
                        f"model.parameters()), got {type(parameters).__name__}")
    for index, p in enumerate(parameters):
        layout.walked = index + 1
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameters[{index}] is a {type(p).__name__}, not a tensor; pass "
                            "model.parameters() or a list of tensors")
        grad = p.grad
        if grad is None:
            continue
        layout.scale_owner.append(index)
        if isinstance(grad, DTensor):
            layout.dtensors += 1
            layout.to_scale.append(grad.to_local())
            local, copies, groups = _dtensor_piece(grad, world, pp)
        else:
            layout.plain += 1
            layout.to_scale.append(grad)
            tp_sharded = tp if getattr(p, "tensor_model_parallel", True) else 1
            copies = _copies(world, pp * tp_sharded, "a plain gradient")
            local, groups = grad, ((tp_group,) if tp_sharded > 1 else ())
        layout.pieces.setdefault(copies, []).append(local)
        layout.owners.setdefault(copies, []).append(index)
        layout.shard_groups.append((local, groups))
        layout.numel_share += local.numel() / copies
    return layout
