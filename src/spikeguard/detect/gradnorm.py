"""The global gradient norm, exact under DDP, FSDP2/HSDP, tensor and pipeline parallelism.

``grad_stats`` measures, ``clip_grad_norm_`` measures and clips (a drop-in for torch's). Both are
collectives when torch.distributed is initialized: every rank of the default group must call them
with its own parameters, in the same order relative to other collectives.

The healthy path costs one ``torch._foreach_norm`` per (copy count, device, dtype) group, a
float64 sum of the squared per-tensor norms, and ONE all-reduce (default group) of a small
float64 vector ``[sum of squares, element count share, *extras]``. It never reads a device value
on the host and never branches on one. See ``_grad_layout`` for how each local piece is weighted
so that every distinct element counts once (DTensor placements, plain tensors, pp_group, tp_group).
All ranks compute the norm from the same all-reduced bits, so they hold the same norm (tested
with gloo: gathered and compared exactly). A DTensor gradient with a Partial placement costs one
more collective (it is reduced before squaring; see ``_grad_layout``).

The non-finite path costs more, only when asked: the first read of ``nonfinite``, ``nan_frac`` or
``exact_norm()`` reads the norm on the host (a sync) and, only if it is not finite, counts
non-finite elements and recomputes overflowed tensors in float64 with one more all-reduce. The
norm is bit-identical on every rank, so every rank takes the same branch; with world size > 1
every rank must make that read.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ._grad_layout import GradLayout, collect

__all__ = ["GradStats", "clip_grad_norm_", "grad_stats"]

_F64 = torch.float64
_warned_plain_replicated = False


def _by_device_dtype(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), the unit a foreach kernel takes."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def _norms(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Per-tensor L2 norms in the order of ``tensors``, as one vector on ``device`` (float32 for
    16-bit and float32 gradients, float64 for float64 ones)."""
    groups = _by_device_dtype(tensors)
    out = []
    for idx in groups:
        low = tensors[idx[0]].dtype in (torch.float16, torch.bfloat16)
        norms = torch._foreach_norm([tensors[i] for i in idx], 2,
                                    dtype=torch.float32 if low else None)
        out.append(torch.stack(norms).to(device))
    if len(out) == 1:
        return out[0]
    order = [i for idx in groups for i in idx]
    dtype = _F64 if any(o.dtype == _F64 for o in out) else torch.float32
    flat = torch.cat([o.to(dtype) for o in out])
    return flat[torch.tensor(order, device=device).argsort()]


class GradStats:
    """Global statistics of one step's gradients; every field is identical on every rank.

    ``norm``: 0-dim float32 tensor on the gradients' device, the L2 norm of the unsharded
    gradient (pre-clip); inf or NaN when any element is, or when the float32 per-tensor norms
    overflow (see ``exact_norm``). ``finite``: 0-dim bool tensor, ``isfinite(norm)``; False
    flags the step. ``extras``: the ``extras`` vector averaged over data-parallel ranks (None
    when none was given). ``numel``: elements of the unsharded model (reading it syncs).
    ``nonfinite``, ``nan_frac`` and ``exact_norm()``: the non-finite path (module docstring).
    The object holds references to the local gradients (for ``clip_`` and the non-finite path)
    until it is dropped.
    """

    def __init__(self, layout: GradLayout, norms: dict[int, torch.Tensor], vec: torch.Tensor,
                 extras_dtype: torch.dtype | None) -> None:
        self._layout = layout
        self._norms = norms
        self._vec = vec
        self._norm64 = vec[0].sqrt()
        self.norm: torch.Tensor = self._norm64.to(torch.float32)
        self.finite: torch.Tensor = torch.isfinite(self.norm)
        self.extras: torch.Tensor | None = None
        if extras_dtype is not None:
            self.extras = (vec[2:] / (layout.world // layout.pp)).to(extras_dtype)
        self._slow: tuple[float, torch.Tensor] | None = None
        self._numel = round(layout.numel_share) if layout.world == 1 else None

    @property
    def numel(self) -> int:
        """Elements of the unsharded model: an int (with world size > 1, a host read of one
        all-reduced scalar)."""
        if self._numel is None:
            self._numel = round(float(self._vec[1]))
        return self._numel

    @property
    def nonfinite(self) -> int:
        """Non-finite (NaN or +-Inf) gradient elements of the unsharded model (see class doc)."""
        return math.ceil(self._nonfinite_path()[0])

    @property
    def nan_frac(self) -> float:
        """nonfinite / numel, the record's nan_frac; any value > 0 is a Tier 3 halt."""
        return self.nonfinite / max(self.numel, 1)

    def exact_norm(self) -> torch.Tensor:
        """0-dim float64 norm without float32 overflow: ``norm`` itself when finite; otherwise each
        tensor whose float32 norm is inf but whose elements are finite is recomputed as
        ``amax * ||g / amax||`` in float64 (1e20 gradients give 1e20 * sqrt(numel), not inf).
        NaN or Inf elements still give NaN or inf. A sync; a collective when not finite."""
        return self._nonfinite_path()[1]

    def _nonfinite_path(self) -> tuple[float, torch.Tensor]:
        if self._slow is not None:
            return self._slow
        if bool(self.finite):  # the documented sync; the same answer on every rank
            self._slow = (0.0, self._norm64)
            return self._slow
        layout = self._layout
        device = self._vec.device
        bad = torch.zeros((), dtype=_F64, device=device)
        sumsq = torch.zeros((), dtype=_F64, device=device)
        for copies, tensors in layout.pieces.items():
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
        vec = torch.stack([bad, sumsq])
        if layout.world > 1:
            dist.all_reduce(vec)
        self._slow = (float(vec[0]), vec[1].sqrt())
        return self._slow

    @torch.no_grad()
    def clip_(self, max_norm: float) -> torch.Tensor:
        """Multiply every local gradient in place by ``min(1, max_norm / (norm + 1e-6))`` (torch's
        formula), one scalar for the whole model; a non-finite norm multiplies by exactly 1, so
        the gradients stay as they are. Returns the 0-dim float32 coefficient. No host sync."""
        _check_max_norm(max_norm)
        coef = (max_norm / (self.norm + 1e-6)).clamp(max=1.0)
        coef = torch.where(self.finite, coef, torch.ones_like(coef))
        tensors = self._layout.to_scale
        for idx in _by_device_dtype(tensors):
            group = [tensors[i] for i in idx]
            torch._foreach_mul_(group, coef.to(group[0].device))
        return coef


def _check_max_norm(max_norm: float) -> None:
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm={max_norm!r} must be a finite number > 0 (1.0 is "
                         f"the usual choice for LLM pre-training)")


def _warn_plain_replicated(layout: GradLayout, tp_group: dist.ProcessGroup | None) -> None:
    global _warned_plain_replicated
    if (layout.world > 1 and layout.dtensors == 0 and layout.plain and tp_group is None
            and not _warned_plain_replicated):
        _warned_plain_replicated = True
        warnings.warn(f"grad_stats: world size {layout.world} with no DTensor gradient and no "
                      f"tp_group, so plain gradients are treated as replicated (DDP: counted "
                      f"once). Manual tensor parallelism cannot be detected: pass tp_group= if "
                      f"your plain gradients are sharded.", UserWarning, stacklevel=3)


@torch.no_grad()
def grad_stats(parameters: Iterable[torch.Tensor] | torch.Tensor, *, pp_group: dist.ProcessGroup | None = None,
               tp_group: dist.ProcessGroup | None = None, extras: torch.Tensor | None = None) -> GradStats:
    """Global gradient statistics of ``parameters`` (their ``.grad``; None grads are skipped).

    ``pp_group``: the ranks holding the other pipeline stages; the sum runs over it.
    ``tp_group``: a manual (non-DTensor) tensor-parallel group; plain gradients are treated as
    sharded over it (parameters with ``tensor_model_parallel = False`` as duplicated). DTensor
    gradients ignore both: their placements say where they live.
    ``extras``: a 1-D tensor of per-rank scalars (e.g. loss and log Z), returned in
    ``GradStats.extras`` summed over the default group and divided by world / pp: the mean over
    data-parallel ranks when TP ranks pass equal values and, with pp_group, only one stage passes
    non-zero values (the others zeros of the same length). Every rank must pass the same length.

    One all-reduce over the default group when it has more than one rank; no host sync.
    """
    layout = collect(parameters, pp_group=pp_group, tp_group=tp_group)
    _warn_plain_replicated(layout, tp_group)
    if extras is not None and (not isinstance(extras, torch.Tensor) or extras.dim() != 1):
        shape = tuple(extras.shape) if isinstance(extras, torch.Tensor) else type(extras).__name__
        raise ValueError(f"extras={shape} must be a 1-D tensor of per-rank scalars, e.g. "
                         f"torch.stack([loss, log_z]).detach()")
    device = layout.device() if layout.pieces or extras is None else extras.device
    norms: dict[int, torch.Tensor] = {}
    parts = []
    for copies, tensors in layout.pieces.items():
        norms[copies] = _norms(tensors, device)
        parts.append(norms[copies].to(_F64).square().sum() / copies)
    sumsq = torch.stack(parts).sum() if parts else torch.zeros((), dtype=_F64, device=device)
    head = [sumsq.reshape(1), torch.full((1,), layout.numel_share, dtype=_F64, device=device)]
    if extras is not None:
        head.append(extras.detach().to(device, _F64))
    vec = torch.cat(head)
    if layout.world > 1:
        dist.all_reduce(vec)
    return GradStats(layout, norms, vec, None if extras is None else extras.dtype)


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, *,
                    pp_group: dist.ProcessGroup | None = None, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip the global gradient norm in place; returns the pre-clip norm (0-dim float32).

    A drop-in for ``torch.nn.utils.clip_grad_norm_`` (L2, foreach) that is also right under
    sharding: see ``grad_stats`` for the arguments and ``GradStats.clip_`` for the scaling. A
    non-finite norm leaves the gradients untouched; check ``torch.isfinite`` of the result (on
    the device) to skip the step.
    """
    _check_max_norm(max_norm)
    stats = grad_stats(parameters, pp_group=pp_group, tp_group=tp_group)
    stats.clip_(max_norm)
    return stats.norm
