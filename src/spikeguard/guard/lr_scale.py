"""The one mechanism that changes the learning rate on the guard's behalf: multipliers of the
scheduled LR over ranges of steps, owned by the step part (``Updater.lr``).

A ``Stretch`` multiplies the LR of steps ``first`` to ``last`` (None: for good) by ``scale``,
or, with ``ramp``, by ``scale`` rising linearly to ``settle`` at ``last + 1`` and staying at
``settle`` after (1, the default: back to the schedule). A rollback's replay is a ramp
(``GuardConfig.rollback_lr_scale``, replacing the last replay's; after a repeated rollback it
settles below 1: ``responses/rollback.py``), a reconfigured resume a stretch for good, the
lower-LR response (``responses/lower_lr.py``) a flat stretch of N steps.
The factor of a step is the product of the stretches that cover it. It is applied around the
optimizer step only (``Updater``): the scheduler never sees it, and under ``guard.decide()`` the
framework gets it as ``Decision.lr_factor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LrScale", "Stretch", "replay_scale", "stretches_v2"]


@dataclass(frozen=True)
class Stretch:
    """One multiplier of the scheduled LR over a range of steps (module docstring)."""

    first: int
    """The first step it covers."""
    last: int | None
    """The last step it covers; None: every step from ``first`` on."""
    scale: float
    """The multiplier (at ``first``, for a ramp)."""
    ramp: bool = False
    """Rise linearly from ``scale`` at ``first`` to ``settle`` at ``last + 1`` (needs ``last``)."""
    kind: str = "scale"
    """Who asked: a new stretch of kind ``replay`` replaces the previous replay's."""
    settle: float = 1.0
    """A ramp's multiplier from ``last + 1`` on, for good (1: back to the schedule)."""

    def factor(self, step: int) -> float:
        if step < self.first:
            return 1.0
        if self.last is not None and step > self.last:
            return self.settle if self.ramp else 1.0
        if not self.ramp or self.last is None:
            return self.scale
        return self.scale + (self.settle - self.scale) * (step - self.first) / (
            self.last - self.first + 1)


class LrScale:
    """The stretches in force (module docstring); state in ``state_dict``."""

    def __init__(self) -> None:
        self.stretches: list[Stretch] = []

    def add(self, stretch: Stretch) -> None:
        """Put ``stretch`` in force (a ``replay`` replaces the previous ``replay``)."""
        if stretch.kind == "replay":
            self.stretches = [s for s in self.stretches if s.kind != "replay"]
        self.stretches.append(stretch)

    def factor(self, step: int) -> float:
        """The multiplier of the scheduled LR at ``step`` (1 outside every stretch)."""
        f = 1.0
        for s in self.stretches:
            f *= s.factor(step)
        return f

    def state_dict(self) -> list[dict[str, Any]]:
        return [{"first": s.first, "last": s.last, "scale": s.scale, "ramp": s.ramp,
                 "kind": s.kind, "settle": s.settle} for s in self.stretches]

    def load_state_dict(self, state: list[dict[str, Any]] | None) -> None:
        self.stretches = [Stretch(first=int(s["first"]),
                                  last=None if s["last"] is None else int(s["last"]),
                                  scale=float(s["scale"]), ramp=bool(s["ramp"]),
                                  kind=str(s["kind"]),
                                  settle=float(s.get("settle", 1.0))) for s in state or ()]


def stretches_v2(ramp: Any) -> list[dict[str, Any]]:
    """A version-2 guard state's ``lr_ramp`` ((first, last, scale) of a replay, or None) as
    ``LrScale.state_dict()`` gives it."""
    if not ramp:
        return []
    return [{"first": int(ramp[0]), "last": int(ramp[1]), "scale": float(ramp[2]), "ramp": True,
             "kind": "replay"}]


def replay_scale(lr_scale: float, keep: bool, last: tuple[int, int, float, float] | None,
                 restored: int) -> tuple[float, float]:
    """(the LR multiple a rollback's replay starts at, the multiple it settles at for good),
    for a rollback to step ``restored`` whose last replay was ``last`` = (its restored step,
    its detection step, its start, its settle), None before any. A rollback that lands in the
    stretch the last one replayed, or as far past its end as it was long, met the same trouble
    once the LR was back: it starts at ``lr_scale`` times the last start (and below the LR kept
    so far) and, with ``keep`` (``GuardConfig.rollback_lr_keep``), stays there for good; any
    other starts at ``lr_scale`` times the LR kept so far and ramps back to it. One rule for the
    guard's own rollback and OLMo-core's relaunch."""
    kept = last[3] if last is not None else 1.0
    if last is not None and restored <= last[1] + (last[1] - last[0]):
        scale = min(lr_scale * last[2], lr_scale * kept)
        if keep:
            kept = scale
        return scale, kept
    return lr_scale * kept, kept
