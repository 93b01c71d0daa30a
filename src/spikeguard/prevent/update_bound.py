"""The update bound's setting: bound each applied update against an EMA of its own size.

Gradient clipping cannot bound what Adam does with a wrong learning rate (Adam's step barely
depends on the gradient's scale), so the update itself is bounded: an update whose ratio to the
weights passes ``update_bound`` times an EMA of its own bounded values is moved back to that
bar. The mechanism, ``guard/update_bound.py`` (``UpdateBound``), sums the update and the weights
over any sharding with the gradient norm's helpers (``measure/gradnorm.py``, a layer above this
one), so it lives with the step part that applies it; its setting lives here, with its default
and its check, and ``ClipConfig`` (the clipping beside which it acts, ``--update-bound``)
extends it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UpdateBoundConfig"]


@dataclass(kw_only=True, frozen=True)
class UpdateBoundConfig:
    """The update bound (module docstring); its first ``ClipConfig.warmup`` applied steps only
    measure."""

    update_bound: float = 0.0
    """Bound each applied update, in every mode: an update whose RMS over the weights' passes
    this many times an EMA of its own is moved back to that bar (a learning rate far too high
    passes any gradient clip under Adam, whose step ignores the gradient's scale). 0: off; at
    3 no clean benchmark run was bounded. Keeps one copy of the weights."""
    update_beta: float = 0.98
    """update bound: EMA factor of the update ratio (a half-life of about 34 steps)."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not 0.0 < self.update_beta < 1.0:
            raise ValueError(f"{name}.update_beta={self.update_beta} must be in (0, 1) (an EMA "
                             f"factor; {UpdateBoundConfig.update_beta} is the default)")
        b = self.update_bound
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (b == 0 or b > 1):
            raise ValueError(f"{name}.update_bound={b!r} must be 0 (off) or a number above "
                             "1 (the multiple of the update ratio's EMA that bounds an update; "
                             "3 is a safe start)")
