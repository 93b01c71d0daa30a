"""A bound on the applied update, beside gradient clipping (its setting:
``prevent/update_bound.py``'s ``UpdateBoundConfig``, which ``ClipConfig`` extends:
``ClipConfig.update_bound``); the step part (``guard/step.py``) applies it around every update
it applies. The mechanism sits here, not in ``prevent/``, because it sums the update over any
sharding with ``measure/gradnorm.py``'s helpers (a layer above ``prevent/``) and acts inside the
step part's update.

Gradient clipping cannot bound what Adam does with a wrong learning rate: Adam divides the
first moment by the root of the second, so its step barely depends on the gradient's scale,
and an LR 50x too high moves the weights 50x as far whatever the gradient clip says. The
quantity to bound is the update itself. With ``update_bound`` k > 0, the step part measures
the *update ratio* of every applied step, ``r = ||w_after - w_before|| / ||w_before||`` over the
whole (unsharded) model, and keeps an EMA (``update_beta``, 0.98) of its bounded values. When
``r`` passes ``k x EMA`` the weights are moved back along the update to that bar: ``w = w_before +
(k EMA / r) (w_after - w_before)``, the same direction, less far; the bounded value is what
enters the EMA, so a deliberate change of scale (a schedule that restarts) is followed at a
rate of ``beta + (1 - beta) k`` a step (1.04 at k = 3) rather than refused. The first
``ClipConfig.warmup`` applied steps only measure. The guard's own LR factor (a replay's ramp
after a rollback) is divided out of ``r`` before the test, so the ramp is never bounded; the
scheduled LR is not (the bound cannot tell a bad LR from a scheduled one, and a warmup or a
decay moves ``r`` by a few percent a step).

On the 240 clean runs of the detection benchmark (tiny at LR 1e-3 to 1e-2 for 20 to 1,000
steps, demo at 3e-3 and 6e-3) r never passed 3x its EMA (at most 1.3x where measured), so at
k = 3 a healthy run is the unbounded run bit for bit; an LR x50 for 20 steps passes it at
every faulty step (benchmarks/HISTORY.md, "Bounding the update").

Cost: one copy of this rank's weights (kept between steps: memory of one more copy of the
local shards), a difference, two per-tensor norms, a multiply and a subtract per step; one
all-reduce of two float64 numbers under torch.distributed. No host read: the bar, the test and
the correction are device tensors, the correction is applied on every step with weight 0 when
nothing is bounded (``w - 0 x delta`` is ``w`` exactly). Sharding: each rank sums its local
pieces' squares over the number of ranks that hold a copy (as the gradient norm does: FSDP2,
HSDP, DTensor TP, DDP replicas, ``pp_group``, ``tp_group``), so every rank holds the same r and
the same coefficient, equal to one process's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._dist import collective_device, world_size
from ..measure.gradnorm import group_by_device_dtype, local_pieces, tensor_norms

__all__ = ["UpdateBound"]

_F64 = torch.float64


class UpdateBound:
    """The update bound of one run over ``params`` (module docstring), state in ``state_dict``.

    ``before()`` copies the weights; ``after(skip, factor)`` measures the update the optimizer
    applied since, bounds it in place and returns the 0-d coefficient (1: not bounded)."""

    def __init__(self, k: float, beta: float, warmup: int, params: list[torch.Tensor], *,
                 pp_group: Any = None, tp_group: Any = None) -> None:
        self.k, self.beta, self.warmup = k, beta, warmup
        self.params, self.pp_group, self.tp_group = params, pp_group, tp_group
        self._pieces: list[torch.Tensor] | None = None
        self._inv_copies: torch.Tensor | None = None
        self._old: list[torch.Tensor] | None = None
        self._state: dict[str, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return self.k > 0

    def _local(self) -> list[torch.Tensor]:
        """Each parameter's local piece (a view of its storage, walked again at every step: a
        framework may swap a shard's storage between steps); 1 / its copy count beside."""
        pieces, copies = local_pieces(self.params, pp_group=self.pp_group, tp_group=self.tp_group)
        if self._inv_copies is None or len(self._inv_copies) != len(copies):
            self._inv_copies = torch.tensor([1.0 / c for c in copies], dtype=_F64)
        return pieces

    @staticmethod
    def _device(pieces: list[torch.Tensor]) -> torch.device:
        """Where the sums and the state live: the first local piece's device, or the default
        group's collective device when that cannot reduce it (as the gradient norm)."""
        dev = pieces[0].device if pieces else torch.device("cpu")
        return collective_device(preferred=dev) if world_size() > 1 else dev

    def _get(self, name: str, dev: torch.device) -> torch.Tensor:
        t = self._state.get(name)
        if t is None or t.device != dev:
            t = torch.zeros((), dtype=_F64, device=dev) if t is None else t.to(dev)
            self._state[name] = t
        return t

    @torch.no_grad()
    def before(self) -> None:
        """Copy the local weights (into buffers kept from the last step)."""
        self._pieces = pieces = self._local()
        old = self._old
        if old is None or [t.shape for t in old] != [t.shape for t in pieces] or any(
                o.dtype != t.dtype or o.device != t.device for o, t in zip(old, pieces)):
            self._old = [t.clone() for t in pieces]
        else:
            torch._foreach_copy_(old, pieces)

    def _sums(self, delta: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
        """[global sum of squares of the update, of the weights before], float64 on ``dev``."""
        if self._inv_copies.device != dev:  # once: the copy counts live beside the sums
            self._inv_copies = self._inv_copies.to(dev)
        inv = self._inv_copies
        moved = tensor_norms(delta, dev).to(_F64).square()
        before = tensor_norms(self._old, dev).to(_F64).square()
        vec = torch.stack([(moved * inv).sum(), (before * inv).sum()])
        if world_size() > 1:
            dist.all_reduce(vec)
        return vec

    @torch.no_grad()
    def after(self, skip: torch.Tensor | bool = False, factor: float = 1.0) -> torch.Tensor:
        """Bound the update applied since ``before()``; ``skip``: the step's gate (a withheld or
        an fp16-overflowed step moved nothing and folds nothing); ``factor``: the guard's own LR
        factor of this step, divided out. Returns the 0-d float64 coefficient."""
        pieces = self._pieces
        if pieces is None:
            raise RuntimeError("UpdateBound.after() without before(): nothing to measure")
        self._pieces = None
        if not pieces:
            return torch.ones((), dtype=_F64)
        dev = self._device(pieces)
        delta = torch._foreach_sub(pieces, self._old)
        moved, before = self._sums(delta, dev)
        ratio = torch.where(before > 0, (moved / before.clamp(min=1e-300)).sqrt() / factor,
                            torch.zeros_like(moved))
        n, ema = self._get("n", dev), self._get("ema", dev)
        bar = self.k * ema
        fire = (n >= self.warmup) & (ratio > bar) & torch.isfinite(ratio)
        coef = torch.where(fire, bar / ratio.clamp(min=1e-300), torch.ones_like(ratio))
        # w - (1 - coef) delta: w itself when coef is 1 (no host read, no branch)
        for idx in group_by_device_dtype(delta):
            d = [delta[i] for i in idx]
            torch._foreach_mul_(d, (1.0 - coef).to(d[0].device, d[0].dtype))
            torch._foreach_sub_([pieces[i] for i in idx], d)
        keep = (ratio > 0) & torch.isfinite(ratio)
        if isinstance(skip, torch.Tensor):
            keep = keep & ~skip.to(dev, torch.bool).reshape(())
        elif skip:  # a host bool: no tensor to build and copy to the device
            keep = torch.zeros_like(keep)
        a = torch.where(n >= self.warmup, torch.full_like(ema, self.beta), n / (n + 1))
        ema.copy_(torch.where(keep, a * ema + (1 - a) * ratio * coef, ema))
        n.add_(keep.to(n.dtype))
        return coef

    def state_dict(self) -> dict[str, Any]:
        """The applied steps measured and the EMA (floats: a host read)."""
        return {k: float(v) for k, v in self._state.items()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (None: start fresh)."""
        self._state = {}
        for k, v in (state or {}).items():
            if k not in ("n", "ema"):
                raise ValueError(f"update bound state has key {k!r}; expected n and ema")
            self._state[k] = torch.tensor(float(v), dtype=_F64)
