"""Learning-rate schedules: picklable callables ``step -> multiplier`` for LambdaLR.

Every schedule is a frozen dataclass, so it pickles, compares by value, and round-trips through
``LambdaLR.state_dict`` (which stores a callable object's ``__dict__``). Steps count from 0, as
LambdaLR's ``last_epoch`` does: step s is the multiplier used by the s-th optimizer update.
Note that ``LambdaLR.load_state_dict`` writes the saved fields into the schedule object the
scheduler holds, so give each scheduler its own schedule object.

- warmup: (s + 1) / W for s < W, so the last warmup step is at the peak 1.0;
- ``warmup_cosine``: a half cosine from 1.0 at s = W to ``min_ratio`` at s = T, held after T;
- ``wsd``: warmup, 1.0 (stable), then a decay (linear, cosine or 1-sqrt) over the last
  ``decay_fraction`` of the steps after warmup, reaching ``min_ratio`` at s = T, held after.

``extend(scheduler, total_steps=N)`` lengthens a WSD run in place while it is still stable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from .._validate import check_int

__all__ = ["constant_with_warmup", "extend", "warmup_cosine", "wsd"]


def _check_step(step: int) -> None:
    if step < 0:
        raise ValueError(f"step={step} must be >= 0 (LambdaLR counts from 0)")


def _check_common(warmup_steps: int, total_steps: int, min_ratio: float) -> None:
    check_int(warmup_steps, "warmup_steps", minimum=0)
    check_int(total_steps, "total_steps")
    if total_steps <= warmup_steps:
        raise ValueError(f"warmup_steps={warmup_steps} >= total_steps={total_steps}: nothing is "
                         f"left to decay; warm up over 1-3% of the run (e.g. "
                         f"{max(1, total_steps // 50)} steps)")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio={min_ratio} must be in [0, 1] (a fraction of the peak LR; "
                         f"0.1 or 0.0 are usual)")


def _warmup(step: int, warmup_steps: int) -> float:
    return (step + 1) / warmup_steps


@dataclass(kw_only=True, frozen=True)
class constant_with_warmup:
    """Multiplier (s + 1) / W for s < W, then 1.0."""

    warmup_steps: int

    def __post_init__(self) -> None:
        check_int(self.warmup_steps, "warmup_steps", minimum=0)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return 1.0


@dataclass(kw_only=True, frozen=True)
class warmup_cosine:
    """Linear warmup, then a half cosine from 1.0 down to ``min_ratio`` at ``total_steps``.

    For W <= s <= T with p = (s - W) / (T - W): min + (1 - min) (1 + cos(pi p)) / 2.
    """

    warmup_steps: int
    """Steps of linear warmup W; the multiplier reaches 1.0 at step W - 1."""
    total_steps: int
    """Step T at which the cosine reaches the floor; the floor is held afterwards."""
    min_ratio: float = 0.0
    """Floor as a fraction of the peak LR."""

    def __post_init__(self) -> None:
        _check_common(self.warmup_steps, self.total_steps, self.min_ratio)

    def __call__(self, step: int) -> float:
        _check_step(step)
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        if step >= self.total_steps:
            return self.min_ratio
        p = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


@dataclass(kw_only=True, frozen=True)
class wsd:
    """Warmup-stable-decay: warmup, hold 1.0, decay to ``min_ratio`` over the last stretch.

    The decay lasts D = round(decay_fraction * (T - W)) steps and starts at ``decay_start`` =
    T - D; with p = (s - decay_start) / D the multiplier is min + (1 - min) f(p), where f is
    1 - p (linear), (1 + cos(pi p)) / 2 (cosine) or 1 - sqrt(p) (1-sqrt).
    """

    warmup_steps: int
    """Steps of linear warmup W; the multiplier reaches 1.0 at step W - 1."""
    total_steps: int
    """Step T at which the decay reaches the floor; the floor is held afterwards."""
    decay_fraction: float = 0.2
    """Share of the post-warmup steps spent decaying, in (0, 1]; 0.1-0.2 is usual."""
    decay: Literal["linear", "cosine", "1-sqrt"] = "linear"
    """Shape of the decay."""
    min_ratio: float = 0.0
    """Floor as a fraction of the peak LR."""

    def __post_init__(self) -> None:
        _check_common(self.warmup_steps, self.total_steps, self.min_ratio)
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction={self.decay_fraction} must be in (0, 1] (the share "
                             f"of post-warmup steps spent decaying; 0.2 is usual)")
        if self.decay not in ("linear", "cosine", "1-sqrt"):
            raise ValueError(f"decay={self.decay!r} must be 'linear', 'cosine' or '1-sqrt'")
        if self.decay_steps < 1:
            raise ValueError(f"decay_fraction={self.decay_fraction} of "
                             f"{self.total_steps - self.warmup_steps} post-warmup steps leaves no "
                             f"decay step; raise decay_fraction or total_steps")

    @property
    def decay_steps(self) -> int:
        return round(self.decay_fraction * (self.total_steps - self.warmup_steps))

    @property
    def decay_start(self) -> int:
        """The step where the decay starts: its multiplier is still exactly 1.0 (p = 0); the
        first step below 1.0 is ``decay_start + 1`` (when min_ratio < 1)."""
        return self.total_steps - self.decay_steps

    def __call__(self, step: int) -> float:
        _check_step(step)
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        if step >= self.total_steps:
            return self.min_ratio
        if step < self.decay_start:
            return 1.0
        p = (step - self.decay_start) / self.decay_steps
        if self.decay == "linear":
            f = 1.0 - p
        elif self.decay == "cosine":
            f = 0.5 * (1.0 + math.cos(math.pi * p))
        else:
            f = 1.0 - math.sqrt(p)
        return self.min_ratio + (1.0 - self.min_ratio) * f


def extend(scheduler, *, total_steps: int) -> None:
    """Lengthen every WSD schedule of a LambdaLR to ``total_steps``, in place.

    Allowed only while the run is in its stable phase: every multiplier already used (steps
    0..scheduler.last_epoch) is unchanged and the decay moves later. Raises ValueError once the
    decay has begun, for a total that is not longer, or when the scheduler holds no ``wsd``.
    The new length is part of ``scheduler.state_dict()``.
    """
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None or not any(isinstance(fn, wsd) for fn in lambdas):
        raise ValueError("extend needs a torch.optim.lr_scheduler.LambdaLR built on "
                         "spikeguard.schedules.wsd; cosine and other schedules fix their length")
    step = scheduler.last_epoch
    new = list(lambdas)
    for i, fn in enumerate(lambdas):
        if not isinstance(fn, wsd):
            continue
        if total_steps <= fn.total_steps:
            raise ValueError(f"extend total_steps={total_steps} must exceed the current "
                             f"total_steps={fn.total_steps}")
        if step >= fn.decay_start:
            raise ValueError(f"the decay began at step {fn.decay_start} and the run is at step "
                             f"{step}; a WSD run can be extended only in its stable phase "
                             f"(restore a checkpoint from before step {fn.decay_start})")
        longer = replace(fn, total_steps=total_steps)
        if step >= longer.decay_start:
            raise ValueError(f"with total_steps={total_steps} the decay would start at step "
                             f"{longer.decay_start}, before the current step {step}")
        new[i] = longer
    scheduler.lr_lambdas[:] = new
