"""Robust spread: how far the values of a running statistic usually stray from their level.

The Tier 1 rules compare a step with the run's own batch-to-batch variation instead of a fixed
multiple alone. A fixed ``grad_norm > 3 x median`` treats every run alike, but the spread of the
grad norm differs by an order of magnitude between a 2-layer model at batch 8 and a large model
at batch 1,000, and it is widest early in a run, while the norm still falls and the median lags;
a loss divided by a long EMA misses an outlier batch while the EMA still carries the early, higher
losses. ``Spread`` is 1.4826 x the running median of the absolute deviations it is given (each
taken against the level its step was judged against), a robust estimate of a standard deviation:
a handful of outliers cannot inflate it, as they would a variance.

``Spread`` is the host version; ``DeviceSpread`` is its device twin for the guard's gate: float64
tensors, the flag as a tensor, no host read, the same numbers on the same stream.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .stats import RunningMedian

if TYPE_CHECKING:  # the device twin needs torch; the host detector (diagnose) must not
    import torch

__all__ = ["MAD_SCALE", "DeviceSpread", "Spread"]

MAD_SCALE = 1.4826
"""Median absolute deviation -> standard deviation, for a normal distribution."""


class Spread:
    """1.4826 x the running median of the deviations added (host); NaN while empty."""

    __slots__ = ("dev",)

    def __init__(self, window: int) -> None:
        self.dev = RunningMedian(window)

    def __len__(self) -> int:
        return len(self.dev)

    def add(self, deviation: float) -> None:
        """Add one kept step's absolute deviation from its level (a NaN is left out)."""
        if deviation == deviation:
            self.dev.update(deviation)

    @property
    def value(self) -> float:
        return MAD_SCALE * self.dev.value

    def state_dict(self) -> dict[str, Any]:
        return self.dev.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dev.load_state_dict(state)


class DeviceSpread:
    """``Spread`` on the device (module docstring)."""

    def __init__(self, window: int, *, device: torch.device | str | None = None) -> None:
        from ._device_stats import DeviceRunningMedian

        self.dev = DeviceRunningMedian(window, device=device)

    @property
    def count(self) -> torch.Tensor:
        return self.dev.count

    def add(self, deviation: torch.Tensor, flagged: torch.Tensor) -> None:
        """Add the deviation unless ``flagged`` (a NaN deviation is never kept)."""
        self.dev.update(deviation, flagged=flagged)

    @property
    def value(self) -> torch.Tensor:
        return MAD_SCALE * self.dev.value

    def state_dict(self) -> dict[str, Any]:
        return self.dev.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dev.load_state_dict(state)


def log_deviation(g: float, median: float) -> float:
    """|log(g / median)|, NaN where either is not positive and finite (host)."""
    if g > 0.0 and median > 0.0 and math.isfinite(g) and math.isfinite(median):
        return abs(math.log(g / median))
    return math.nan
