"""The global gradient norm, exact under DDP, FSDP2/HSDP, tensor and pipeline parallelism.

``grad_stats`` measures, ``clip_grad_norm_`` measures and clips (a drop-in for
``torch.nn.utils.clip_grad_norm_``). Both are collectives when torch.distributed is initialized:
every rank of the default group must call them with its own parameters, in the same order
relative to other collectives. ``nonfinite_params`` names the parameters whose local gradient
holds a NaN or Inf (for a halt report).

The healthy path costs one ``torch._foreach_norm`` per (copy count, device, dtype) group, a
float64 sum of the squared per-tensor norms, and ONE all-reduce (default group) of a small
float64 vector ``[sum of squares, element count share, *extras]``. It never reads a device value
on the host and never branches on one. ``_grad_layout`` says how each local piece is weighted
so that every distinct element counts once (DTensor placements, plain tensors, pp_group,
tp_group); this module only asks the layout for its share and reduces it.
All ranks compute the norm from the same all-reduced bits, so they hold the same norm (tested
with gloo: gathered and compared exactly). A DTensor gradient with a Partial placement costs one
more collective (it is reduced before squaring).

The non-finite path costs more, only when asked: the first read of ``nonfinite``, ``nan_frac`` or
``exact_norm()`` reads the norm on the host (a sync) and, only if it is not finite, counts
non-finite elements and recomputes overflowed tensors in float64 with one more all-reduce. The
norm is bit-identical on every rank, so every rank takes the same branch; with world size > 1
every rank must make that read.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .._dist import group_size, local_tensor, world_size
from ._grad_layout import (
    GradLayout,
    _copies,
    _dtensor_piece,
    collect,
    group_by_device_dtype,
    tensor_norms,
)

__all__ = ["GradStats", "clip_grad_norm_", "grad_stats", "group_by_device_dtype", "local_pieces",
           "nonfinite_params", "tensor_norms"]

_F64 = torch.float64
_warned_plain_replicated = False


class GradStats:
    """Global statistics of one step's gradients; every field is identical on every rank.

    ``norm``: 0-dim tensor on the gradients' device, the L2 norm of the unsharded gradient
    (pre-clip): float64 when any gradient is float64, float32 otherwise (16-bit gradients are
    measured in float32); inf or NaN when any element is, or when the float32 per-tensor norms
    overflow (see ``exact_norm``). ``finite``: 0-dim bool tensor, ``isfinite(norm)``; False
    flags the step. ``extras``: the ``extras`` vector averaged over data-parallel ranks (None
    when none was given). ``numel``: elements of the unsharded model (reading it syncs).
    ``nonfinite``, ``nan_frac`` and ``exact_norm()``: the non-finite path (module docstring).
    The object holds references to the local gradients (for ``clip_`` and the non-finite path)
    until it is dropped.
    """

    def __init__(self, layout: GradLayout, vec: torch.Tensor,
                 extras_dtype: torch.dtype | None, n_extras: int = 0,
                 per_tensor: bool = False) -> None:
        self._layout = layout
        self._vec = vec
        self._norm64 = vec[0].sqrt()
        self.norm: torch.Tensor = self._norm64.to(layout.dtype)
        self.finite: torch.Tensor = torch.isfinite(self.norm)
        self.extras: torch.Tensor | None = None
        if extras_dtype is not None:
            self.extras = (vec[2:2 + n_extras] / (layout.world // layout.pp)).to(extras_dtype)
        self.tensor_norms: torch.Tensor | None = None
        """With ``per_tensor``: each parameter's global gradient norm (``norm``'s dtype, 0 for
        a None grad), in the order given; else None."""
        if per_tensor:
            self.tensor_norms = vec[2 + n_extras:].sqrt().to(layout.dtype)
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
        vec = torch.stack(self._layout.nonfinite_sumsq(self._vec.device))
        if self._layout.world > 1:
            dist.all_reduce(vec)
        self._slow = (float(vec[0]), vec[1].sqrt())
        return self._slow

    def finite_pieces(self) -> tuple[torch.Tensor | None, list[int]]:
        """Which local gradients are finite, without reading the device: (a 1-D bool tensor,
        one entry per local gradient piece; the index of each piece's parameter in the iterable
        given to grad_stats). Small (one bool a tensor) and free of references to the gradients,
        so it can outlive them: the guard reads it a step later to name the culprits."""
        return self._layout.finite_pieces()

    def clip_(self, max_norm: float, *, foreach: bool | None = None) -> torch.Tensor:
        """Multiply every local gradient in place by ``min(1, max_norm / (norm + 1e-6))`` (torch's
        formula), one scalar for the whole model; a non-finite norm multiplies by exactly 1, so
        the gradients stay as they are. Returns the 0-dim coefficient (``norm``'s dtype). No
        host sync. ``foreach``: as in torch (None uses the foreach kernels where they exist)."""
        _check_max_norm(max_norm)
        return _clip(self._layout, self.norm, max_norm, foreach)

    def scale_(self, coef: torch.Tensor, *, foreach: bool | None = None) -> None:
        """Multiply every local gradient in place by the 0-d ``coef`` (no host sync)."""
        self._layout.scale_(coef, foreach)

    def scale_tensors_(self, coefs: torch.Tensor) -> None:
        """Multiply each parameter's local gradient in place by ``coefs[i]`` (a vector in the
        order of ``tensor_norms``); no host sync."""
        self._layout.scale_each_(coefs)


def _clip(layout: GradLayout, norm: torch.Tensor, max_norm: float,
          foreach: bool | None) -> torch.Tensor:
    with torch.no_grad():
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
        layout.scale_(coef, foreach)
    return coef


def _check_max_norm(max_norm: float) -> None:
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm={max_norm!r} must be a finite number > 0 (1.0 is the usual "
                         f"choice for LLM pre-training); to turn clipping off, do not call it")


def _warn_plain_replicated(layout: GradLayout, tp_group: dist.ProcessGroup | None) -> None:
    global _warned_plain_replicated
    if (layout.world > 1 and layout.dtensors == 0 and layout.plain and tp_group is None
            and not _warned_plain_replicated):
        _warned_plain_replicated = True
        warnings.warn(f"grad_stats: world size {layout.world} with no DTensor gradient and no "
                      f"tp_group, so plain gradients are treated as replicated (DDP: counted "
                      f"once). Manual tensor parallelism cannot be detected: pass tp_group= if "
                      f"your plain gradients are sharded.", UserWarning, stacklevel=4)


def _measure(parameters: Iterable[torch.Tensor] | torch.Tensor, pp_group: dist.ProcessGroup | None,
             tp_group: dist.ProcessGroup | None, extras: torch.Tensor | None,
             foreach: bool | None = None, per_tensor: bool = False) -> GradStats:
    layout = collect(parameters, pp_group=pp_group, tp_group=tp_group)
    _warn_plain_replicated(layout, tp_group)
    if extras is not None and (not isinstance(extras, torch.Tensor) or extras.dim() != 1):
        shape = tuple(extras.shape) if isinstance(extras, torch.Tensor) else type(extras).__name__
        raise ValueError(f"extras={shape} must be a 1-D tensor of per-rank scalars, e.g. "
                         f"torch.stack([loss, log_z]).detach()")
    with torch.no_grad():
        device = layout.device() if layout.pieces or extras is None else extras.device
        head = [layout.sumsq(device, foreach).reshape(1),
                torch.full((1,), layout.numel_share, dtype=_F64, device=device)]
        if extras is not None:
            head.append(extras.detach().to(device, _F64))
        if per_tensor:
            head.append(layout.tensor_sumsq(device))
        vec = torch.cat(head)
        if layout.world > 1:
            dist.all_reduce(vec)
    return GradStats(layout, vec, None if extras is None else extras.dtype,
                     0 if extras is None else extras.numel(), per_tensor)


def grad_stats(parameters: Iterable[torch.Tensor] | torch.Tensor, *, pp_group: dist.ProcessGroup | None = None,
               tp_group: dist.ProcessGroup | None = None, extras: torch.Tensor | None = None,
               per_tensor: bool = False) -> GradStats:
    """Global gradient statistics of ``parameters`` (their ``.grad``; None grads are skipped).

    ``pp_group``: the ranks holding the other pipeline stages; the sum runs over it.
    ``tp_group``: a manual (non-DTensor) tensor-parallel group; plain gradients are treated as
    sharded over it (parameters with ``tensor_model_parallel = False`` as duplicated). DTensor
    gradients ignore both: their placements say where they live.
    ``extras``: a 1-D tensor of per-rank scalars (e.g. loss and log Z), returned in
    ``GradStats.extras`` summed over the default group and divided by world / pp: the mean over
    data-parallel ranks when TP ranks pass equal values and, with pp_group, only one stage passes
    non-zero values (the others zeros of the same length). Every rank must pass the same length.

    ``per_tensor``: also each parameter's global norm (``GradStats.tensor_norms``), in the same
    all-reduce (one more float64 per parameter).

    One all-reduce over the default group when it has more than one rank; no host sync.
    """
    return _measure(parameters, pp_group, tp_group, extras, per_tensor=per_tensor)


def _norm_type(norm_type: float | str) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        p = math.nan
    if math.isnan(p):
        raise ValueError(f"norm_type={norm_type!r} must be a number or 'inf' (2.0 is the L2 "
                         f"norm, the usual choice)")
    return p


def _other_norm(layout: GradLayout, p: float, foreach: bool | None) -> torch.Tensor:
    """The global p-norm for p != 2: a sum of |x|^p weighted by copies, a max- or min-reduce
    for +-inf, torch's count of non-zero tensors for 0. One all-reduce (p = 0: one more per
    group of shards); 0 when no rank holds a gradient, as torch returns for an empty list."""
    device = layout.device()
    n = torch.full((), float(len(layout.to_scale)), dtype=_F64, device=device)
    with torch.no_grad():
        if math.isinf(p):
            m = layout.extreme(p, device, foreach)
            nan = torch.isnan(m).to(_F64)
            m = torch.where(nan > 0, torch.full_like(m, 0.0 if p > 0 else math.inf), m)
            sign = 1.0 if p > 0 else -1.0  # MIN of -flag is -1 when any rank saw a NaN
            vec = torch.stack([m, sign * nan, sign * n])
            op = dist.ReduceOp.MAX if p > 0 else dist.ReduceOp.MIN
        else:
            share = layout.nonzero_share(device) if p == 0 else layout.pnorm_share(p, device, foreach)
            vec, op = torch.stack([share, torch.zeros_like(n), n]), dist.ReduceOp.SUM
        if layout.world > 1:
            dist.all_reduce(vec, op=op)
        if math.isinf(p):
            total = vec[0]
        else:  # p = 0: a count, whole even when world / pp is not a power of two
            total = vec[0].round() if p == 0 else vec[0].pow(1.0 / p)
        total = torch.where(vec[1] != 0, torch.full_like(total, math.nan), total)
        total = torch.where(vec[2] != 0, total, torch.zeros_like(total))
    return total.to(layout.dtype)


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, *, pp_group: dist.ProcessGroup | None = None,
                    tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip the global gradient norm in place; returns the pre-clip norm (0-dim).

    A drop-in for ``torch.nn.utils.clip_grad_norm_`` with its signature and results, that is also
    right under sharding (DTensor placements, ``pp_group``, ``tp_group``: see ``grad_stats``):

    - ``norm_type=2`` (default) takes the fast path of ``grad_stats``: one foreach norm per
      group, one all-reduce, no host sync. Any other norm torch supports takes a slower exact
      path: a finite p (negative too) sums ``|x|^p`` over the shards in float64, ``inf`` and
      ``-inf`` are a max- and min-reduce, and ``0`` gives torch's result, the number of gradient
      tensors holding a non-zero element (one more collective per group of shards). Neither
      path reads a device value on the host.
    - The norm is float64 when any gradient is float64 (measured and clipped in float64),
      float32 otherwise; 16-bit gradients are measured in float32 (torch returns their norm in
      the gradients' dtype).
    - ``error_if_nonfinite=True`` reads the norm on the host and raises RuntimeError before
      clipping when it is NaN or inf (on every rank alike). ``foreach`` as in torch.
    - An empty generator of parameters warns as torch does; the norm is then 0.

    Deliberate differences from torch: ``max_norm`` must be a finite number > 0 (torch would
    flip the gradients' sign for a negative one and zero them for 0; to turn clipping off, do
    not call it), and a non-finite norm leaves the gradients unchanged (torch multiplies them by
    0 or NaN): check ``torch.isfinite`` of the result, on the device, to skip the step.
    """
    _check_max_norm(max_norm)
    p = _norm_type(norm_type)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    elif isinstance(parameters, types.GeneratorType):
        parameters = list(parameters)
        if not parameters:  # torch's warning, word for word, so that filters for it match ours
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.",
                          UserWarning, stacklevel=2)
    if p == 2.0:
        stats = _measure(parameters, pp_group, tp_group, None, foreach)
        layout, norm = stats._layout, stats.norm
    else:
        layout = collect(parameters, pp_group=pp_group, tp_group=tp_group)
        norm = _other_norm(layout, p, foreach)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(f"the total norm of order {p} of the gradients is non-finite "
                           f"({float(norm)}), so they cannot be clipped; with "
                           f"error_if_nonfinite=False the gradients are left unchanged")
    _clip(layout, norm, max_norm, foreach)
    return norm


def nonfinite_params(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the parameters whose gradient, as held on this rank, has a NaN or Inf element
    (a DTensor's local shard), in the order given; e.g. ``nonfinite_params(model.named_parameters())``.

    Local by design, and no collective: under sharding a rank lists only what its own shards
    show, so gather the lists across ranks (``dist.all_gather_object``) for a job-wide report.
    One host read (of per-tensor max |x|, one foreach kernel per device and dtype)."""
    names: list[str] = []
    grads: list[torch.Tensor] = []
    for name, p in named_parameters:
        g = p.grad
        if g is not None:
            g = local_tensor(g)
            if g.numel():
                names.append(name)
                grads.append(g)
    if not grads:
        return []
    amax = tensor_norms(grads, grads[0].device, math.inf)
    return [n for n, bad in zip(names, (~torch.isfinite(amax)).tolist()) if bad]


def local_pieces(tensors: Iterable[torch.Tensor], *, pp_group: dist.ProcessGroup | None = None,
                 tp_group: dist.ProcessGroup | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """Each parameter-like tensor's piece on this rank (a DTensor's local shard, a view of its
    storage; a plain tensor itself) and how many ranks hold a copy of that piece, by the
    gradient norm's rule (``_grad_layout``): summed over ranks, ``sumsq(piece) / copies``
    counts every element of the unsharded tensors once. Host only: metadata, no device read."""
    from torch.distributed.tensor import DTensor

    world = world_size()
    pp, tp = group_size(pp_group, "pp_group"), group_size(tp_group, "tp_group")
    pieces, copies = [], []
    for t in tensors:
        if isinstance(t, DTensor):
            local, n, _ = _dtensor_piece(t.detach(), world, pp)
        else:
            sharded = tp if getattr(t, "tensor_model_parallel", True) else 1
            local, n = t.detach(), _copies(world, pp * sharded, "a plain tensor")
        pieces.append(local)
        copies.append(n)
    return pieces, copies
