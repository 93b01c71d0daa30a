"""Running statistics: a sliding-window median and a bias-corrected EMA, on the host and on the
device; a sliding-window minimum and an event window (host only, for the detector's rules).

The host versions (``RunningMedian``, ``EMA``) keep flagged steps out of their history simply by
not being updated with them. The device twins (``DeviceRunningMedian``, ``DeviceEMA``) hold their
state in float64 tensors and take the flag as a tensor, so the guard's gate can use them without a
host sync; fed the same stream they give bit-identical numbers to the host versions. All four have
``state_dict`` / ``load_state_dict`` (host and device state dicts are interchangeable): save, load,
continue equals never stopping; a state saved with another window is refused. The device twins live
in ``_device_stats`` (imported on first use: the host side needs no torch).
"""

from __future__ import annotations

import math
from bisect import bisect_left as _bisect_left
from bisect import insort as _insort
from collections import deque
from typing import TYPE_CHECKING, Any

from .._validate import check_int, check_window

if TYPE_CHECKING:
    from ._device_stats import DeviceEMA, DeviceRunningMedian

__all__ = ["EMA", "DeviceEMA", "DeviceRunningMedian", "EventWindow", "RunningMedian", "SlidingMin"]

_isfinite = math.isfinite


class RunningMedian:
    """Median of the last ``window`` values: a sorted copy of the window beside its FIFO.

    Each update is a binary search and one insert (and, once full, one delete) in a sorted
    list: O(log window) comparisons and an O(window) move of pointers, all in C (``bisect``,
    ``list.insert``), which for the detector's windows (32 to 5,000) is several times faster
    than two heaps with lazy deletion driven from Python. With an even count the median is the
    mean of the two middle values (``statistics.median``). ``value`` is kept up to date by
    ``update`` (a plain attribute: the detector reads each median once a step, and a property
    call there cost more than the median itself).
    """

    __slots__ = {"_fifo": None, "_mid": None, "_odd": None, "_sorted": None,
                 "value": "The median of the window; NaN while empty (read it, never set it).",
                 "window": None}

    def __init__(self, window: int = 5000) -> None:
        check_int(window, "window")
        self.window = window
        self._fifo: deque[float] = deque()
        self._sorted: list[float] = []
        self.value = math.nan
        # where the median sits once the window is full (the common case: no len() needed)
        self._mid, self._odd = window >> 1, window & 1

    def __len__(self) -> int:
        return len(self._fifo)

    def update(self, value: float) -> None:
        """Add a finite value; the oldest leaves once the window is full."""
        if type(value) is not float:
            value = float(value)
        if value - value != 0.0:  # inf - inf and NaN - NaN are NaN: not finite
            raise ValueError(f"RunningMedian.update({value}): only finite values belong in the history")
        srt, fifo = self._sorted, self._fifo
        fifo.append(value)
        if len(fifo) > self.window:  # full: the oldest leaves
            del srt[_bisect_left(srt, fifo.popleft())]
            _insort(srt, value)
            h = self._mid
            self.value = srt[h] if self._odd else (srt[h - 1] + srt[h]) / 2.0
            return
        _insort(srt, value)
        n = len(srt)
        h = n >> 1
        self.value = srt[h] if n & 1 else (srt[h - 1] + srt[h]) / 2.0

    def values(self) -> list[float]:
        """The window's values, oldest first."""
        return list(self._fifo)

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "values": self.values()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(check_window(self, state))
        for v in state["values"]:
            self.update(v)


class EMA:
    """Exponential moving average with bias correction: after t updates the value is
    m_t / (1 - (1 - alpha)^t) with m_t = (1 - alpha) m_{t-1} + alpha x_t and m_0 = 0.

    Read ``value`` before ``update`` to get EMA_{t-1} for the ratio at step t. The power
    (1 - alpha)^t is kept as a running product rather than a ``pow`` call, so the device twin
    (``DeviceEMA``) reproduces it bit for bit on any IEEE device (libm and CUDA ``pow`` may differ
    in the last place). ``value`` is kept up to date by ``update`` (a plain attribute, as in
    ``RunningMedian``).
    """

    __slots__ = {"_decay": None, "_m": None, "alpha": None, "count": None,
                 "value": "The bias-corrected average; NaN before the first update (read it, "
                          "never set it)."}

    def __init__(self, alpha: float = 1e-3) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1]; the detector uses 1/1000")
        self.alpha = alpha
        self._m = 0.0
        self._decay = 1.0  # (1 - alpha) ** count, as a running product
        self.count = 0
        self.value = math.nan

    def update(self, value: float) -> None:
        if type(value) is not float:
            value = float(value)
        if value - value != 0.0:  # not finite
            raise ValueError(f"EMA.update({value}): only finite values belong in the history")
        alpha = self.alpha
        m = self._m = (1.0 - alpha) * self._m + alpha * value
        decay = self._decay = self._decay * (1.0 - alpha)
        self.count += 1
        self.value = m / (1.0 - decay)

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "m": self._m, "count": self.count, "decay": self._decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha = float(state["alpha"])
        self._m = float(state["m"])
        self.count = int(state["count"])
        # state dicts saved before "decay" existed: recompute it
        self._decay = float(state.get("decay", (1.0 - self.alpha) ** self.count))
        self.value = math.nan if self.count == 0 else self._m / (1.0 - self._decay)


class SlidingMin:
    """Minimum of the values pushed in the last ``window`` pushes (a monotonic deque).

    Call ``min_before(i)`` with the index the next push will carry to read the minimum of
    pushes ``i - window .. i - 1``; then ``push(i, value, step)``.
    """

    __slots__ = ("_q", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self._q: deque[tuple[int, float, int]] = deque()

    def min_before(self, i: int) -> tuple[float, int | None]:
        """(minimum value, its step) over the window before push ``i``; (NaN, None) if empty."""
        q = self._q
        if not q:
            return math.nan, None
        lo = i - self.window
        first = q[0]
        while first[0] < lo:
            q.popleft()
            if not q:
                return math.nan, None
            first = q[0]
        return first[1], first[2]

    def push(self, i: int, value: float, step: int) -> None:
        q = self._q
        while q and q[-1][1] >= value:
            q.pop()
        q.append((i, value, step))

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "entries": [list(e) for e in self._q]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_window(self, state)
        self._q = deque((int(i), float(v), int(s)) for i, v, s in state["entries"])


class EventWindow:
    """Events (update index, step) within the last ``window`` updates."""

    __slots__ = ("_q", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self._q: deque[tuple[int, int]] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def add(self, i: int, step: int) -> None:
        self._q.append((i, step))

    def count(self, i: int) -> int:
        """Events among updates ``i - window + 1 .. i``."""
        q = self._q
        lo = i - self.window
        while q and q[0][0] <= lo:
            q.popleft()
        return len(q)

    def first_step(self) -> int | None:
        return self._q[0][1] if self._q else None

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "entries": [list(e) for e in self._q]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_window(self, state)
        self._q = deque((int(i), int(s)) for i, s in state["entries"])


def __getattr__(name: str) -> Any:
    # the device twins need torch; the host statistics (and the detector built on them) do not,
    # so ``spikeguard diagnose`` reads a log without importing torch
    if name in ("DeviceEMA", "DeviceRunningMedian"):
        from . import _device_stats

        return getattr(_device_stats, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
