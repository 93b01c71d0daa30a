"""Robust spread: how far a running statistic usually strays from one kept step to the next.

The Tier 1 rules compare a step with the run's own batch-to-batch variation instead of a fixed
multiple alone. A fixed ``grad_norm > 3 x median`` treats every run alike, but the spread of the
grad norm differs by an order of magnitude between a 2-layer model at batch 8 and a large model
at batch 1,000; a loss divided by a long EMA misses an outlier batch while the EMA still carries
the early, higher losses.

``Spread`` is a robust standard deviation of the step-to-step noise: 1.4826 x the running median
of |v_t - v_prev| over the kept steps (``v_prev`` the previous kept value), divided by sqrt(2)
(the difference of two independent draws has sqrt(2) times their spread). Differences, not
deviations from the running median: early in a run the grad norm and the loss fall fast and the
median lags them, so deviations from it measure the trend, not the noise (on the tiny model at
peak LR they widened the grad bar from 3x to 30-7,500x the median within 30 steps of warmup's
end, and every kept spike widened it further), while consecutive kept values move together with
the trend and differ only by the noise. The median, not a mean, so a handful of spikes cannot
inflate it as they would a variance.

``Spread`` is the host version; ``DeviceSpread`` is its device twin for the guard's gate: float64
tensors, the flag as a tensor, no host read, the same numbers on the same stream.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .._validate import check_int, check_window
from .stats import PyRunningMedian, _cstats, _rebuild

if TYPE_CHECKING:  # the device twin needs torch; the host detector (diagnose) must not
    import torch

__all__ = ["DIFF_SCALE", "MAD_SCALE", "DeviceSpread", "LogSpread", "PyLogSpread", "PySpread",
           "Spread", "log_value"]

MAD_SCALE = 1.4826
"""Median absolute deviation -> standard deviation, for a normal distribution."""

DIFF_SCALE = MAD_SCALE / math.sqrt(2.0)
"""Median |difference of two independent draws| -> the standard deviation of one draw."""

_isfinite, _log = math.isfinite, math.log


class _SpreadState:
    """``state_dict`` / ``load_state_dict`` / pickling of both Spread implementations."""

    __slots__ = ()

    def state_dict(self) -> dict[str, Any]:
        last = self.last
        return {"dev": {"window": self.window, "values": self.values()},
                "last": last if last == last else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_window(self, state["dev"])
        self._restore(state["dev"]["values"],
                      math.nan if state["last"] is None else float(state["last"]))

    def __reduce__(self) -> tuple:
        return _rebuild, (type(self), (self.window,), self.state_dict())


class PySpread(_SpreadState):
    """``Spread`` in pure Python (where the compiled statistics were not built); the same
    numbers bit for bit."""

    __slots__ = {"_dev": None, "last": "The previous kept value (NaN before the first).",
                 "value": "DIFF_SCALE x the median of the differences; NaN while empty (read it, "
                          "never set it).", "window": None}

    def __init__(self, window: int) -> None:
        self._dev = PyRunningMedian(window)
        self.window = window
        self.last = math.nan
        self.value = math.nan

    def __len__(self) -> int:
        return len(self._dev)

    def add(self, value: float) -> None:
        """Add one kept step's value (a non-finite value is left out and changes nothing)."""
        if value - value == 0.0:  # finite
            last = self.last
            if last == last:
                dev = self._dev
                dev.update(abs(value - last))
                self.value = DIFF_SCALE * dev.value
            self.last = value

    def values(self) -> list[float]:
        """The window's differences, oldest first."""
        return self._dev.values()

    def _restore(self, values: list[float], last: float) -> None:
        self._dev.load_state_dict({"window": self.window, "values": values})
        self.last = last
        self.value = DIFF_SCALE * self._dev.value


class PyLogSpread(PySpread):
    """``LogSpread`` in pure Python."""

    __slots__ = ()

    def add(self, value: float) -> None:
        """Add one kept step's value; its log enters (a value not positive and finite is left
        out and changes nothing)."""
        super().add(log_value(value))


if _cstats is not None:
    class Spread(_SpreadState, _cstats.SlidingSpread):
        """DIFF_SCALE x the running median of |v - previous kept v| (host); NaN while empty.
        ``value`` is kept up to date by ``add`` and is read-only. Compiled (``_cstats.c``);
        :class:`PySpread` where it was not built, with the same numbers bit for bit."""

        __slots__ = ()

        def __init__(self, window: int) -> None:
            check_int(window, "window")
            super().__init__(window, DIFF_SCALE)

    class LogSpread(_SpreadState, _cstats.SlidingSpread):
        """``Spread`` of log(v): ``add(v)`` takes the value itself (the grad norm), and a value
        not positive and finite is left out (``log_value``). Compiled; :class:`PyLogSpread`
        where it was not built."""

        __slots__ = ()

        def __init__(self, window: int) -> None:
            check_int(window, "window")
            super().__init__(window, DIFF_SCALE, log=True)
else:  # pragma: no cover - built without a C compiler
    Spread = PySpread  # type: ignore[misc]
    LogSpread = PyLogSpread  # type: ignore[misc]


class DeviceSpread:
    """``Spread`` on the device (module docstring)."""

    def __init__(self, window: int, *, device: torch.device | str | None = None) -> None:
        import torch

        from ._device_stats import DeviceRunningMedian

        self.dev = DeviceRunningMedian(window, device=device)
        self.last = torch.full((), math.nan, dtype=torch.float64, device=self.dev.device)

    @property
    def count(self) -> torch.Tensor:
        return self.dev.count

    def add(self, value: torch.Tensor, flagged: torch.Tensor) -> None:
        """Add the kept step's ``value`` (0-d float64) unless ``flagged``; a non-finite value
        is never kept (NaN while there is no previous kept value)."""
        import torch

        self.dev.update((value - self.last).abs(), flagged=flagged)
        keep = torch.isfinite(value) & ~flagged
        self.last = torch.where(keep, value, self.last)

    @property
    def value(self) -> torch.Tensor:
        return DIFF_SCALE * self.dev.value

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready, ``Spread.state_dict``'s format; a host read (for checkpoints)."""
        last = float(self.last)
        return {"dev": self.dev.state_dict(), "last": last if last == last else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dev.load_state_dict(state["dev"])
        self.last.fill_(math.nan if state["last"] is None else float(state["last"]))


def log_value(g: float) -> float:
    """log(g), NaN where g is not positive and finite (host): the grad rule's spread is of
    log grad norm."""
    if g > 0.0 and _isfinite(g):
        return _log(g)
    return math.nan
