"""Running statistics: a sliding-window median and a bias-corrected EMA, on the host and on the
device; a sliding-window minimum and an event window (host only, for the detector's rules).

The host versions (``RunningMedian``, ``EMA``) keep flagged steps out of their history simply by
not being updated with them. The device twins (``DeviceRunningMedian``, ``DeviceEMA``) hold their
state in float64 tensors and take the flag as a tensor, so the guard's gate can use them without a
host sync; fed the same stream they give bit-identical numbers to the host versions. All four have
``state_dict`` / ``load_state_dict`` (host and device state dicts are interchangeable): save, load,
continue equals never stopping; a state saved with another window is refused. The device twins live
in ``_device_stats`` (imported on first use: the host side needs no torch).

The host median, EMA and sliding minimum are compiled (``_cstats.c``, built at install; the
detector updates a dozen of them a step). Where no C compiler was found, their pure-Python twins
(``PyRunningMedian``, ``PyEMA``, ``PySlidingMin``) take their names: the same numbers bit for bit,
the same state dicts.
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

__all__ = ["COMPILED", "EMA", "DeviceEMA", "DeviceRunningMedian", "EventWindow", "PyEMA",
           "PyRunningMedian", "PySlidingMin", "RunningMedian", "SlidingMin"]



def _rebuild(cls: type, args: tuple, state: dict[str, Any]) -> Any:
    """Unpickle a statistic: a new one, its state loaded (the compiled types keep their numbers
    in C, which the default pickling would not see)."""
    stat = cls(*args)
    stat.load_state_dict(state)
    return stat


class _MedianState:
    """``state_dict`` / ``load_state_dict`` / pickling of both RunningMedian implementations: the
    window's values, oldest first (the state of either loads into the other)."""

    __slots__ = ()

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "values": self.values()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(check_window(self, state))
        for v in state["values"]:
            self.update(v)

    def __reduce__(self) -> tuple:
        return _rebuild, (type(self), (self.window,), self.state_dict())


class PyRunningMedian(_MedianState):
    """``RunningMedian`` in pure Python: a sorted copy of the window beside its FIFO.

    Where the compiled statistics were not built (no C compiler at install time), this is
    ``RunningMedian``; both give the same numbers bit for bit. Each update is a binary search
    and one insert (and, once full, one delete) in a sorted list: O(log window) comparisons and
    an O(window) move of pointers, all in C (``bisect``, ``list.insert``).
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


class _EMAState:
    """``state_dict`` / ``load_state_dict`` / pickling of both EMA implementations."""

    __slots__ = ()

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "m": self._m, "count": self.count, "decay": self._decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        alpha, count = float(state["alpha"]), int(state["count"])
        # state dicts saved before "decay" existed: recompute it
        decay = float(state.get("decay", (1.0 - alpha) ** count))
        self._restore(alpha, float(state["m"]), count, decay)

    def __reduce__(self) -> tuple:
        return _rebuild, (type(self), (self.alpha,), self.state_dict())


class PyEMA(_EMAState):
    """``EMA`` in pure Python (where the compiled statistics were not built); the same numbers."""

    __slots__ = {"_decay": None, "_m": None, "alpha": None, "count": None,
                 "value": "The bias-corrected average; NaN before the first update (read it, "
                          "never set it)."}

    def __init__(self, alpha: float = 1e-3) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1]; the detector uses 1/1000")
        self._restore(float(alpha), 0.0, 0, 1.0)

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

    def _restore(self, alpha: float, m: float, count: int, decay: float) -> None:
        self.alpha, self._m, self.count, self._decay = alpha, m, count, decay
        self.value = math.nan if count == 0 else m / (1.0 - decay)


class _MinState:
    """``state_dict`` / ``load_state_dict`` / pickling of both SlidingMin implementations."""

    __slots__ = ()

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "entries": self.entries()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_window(self, state)
        self._restore([(int(i), float(v), int(s)) for i, v, s in state["entries"]])

    def __reduce__(self) -> tuple:
        return _rebuild, (type(self), (self.window,), self.state_dict())


class PySlidingMin(_MinState):
    """``SlidingMin`` in pure Python (where the compiled statistics were not built)."""

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

    def entries(self) -> list[list]:
        """The deque's [i, value, step] entries, oldest first."""
        return [list(e) for e in self._q]

    def _restore(self, entries: list[tuple[int, float, int]]) -> None:
        self._q = deque(entries)


try:
    from . import _cstats
except ImportError:  # pragma: no cover - built without a C compiler: the pure-Python twins
    _cstats = None  # type: ignore[assignment]

COMPILED = _cstats is not None
"""Whether the host statistics are the compiled ones (``_cstats.c``); else the ``Py`` twins."""

if _cstats is not None:
    class RunningMedian(_MedianState, _cstats.SlidingMedian):
        """Median of the last ``window`` finite values, updated in O(log window).

        Compiled (``_cstats.c``: two heaps over a ring of slots); where it was not built,
        ``RunningMedian`` is :class:`PyRunningMedian`, with the same numbers bit for bit. With an
        even count the median is the mean of the two middle values (``statistics.median``).
        ``value`` is kept up to date by ``update`` and is read-only (a plain read: the detector
        reads each median once a step); ``update`` raises ValueError on a NaN or an infinity.
        """

        __slots__ = ()

        def __init__(self, window: int = 5000) -> None:
            check_int(window, "window")
            super().__init__(window)

    class EMA(_EMAState, _cstats.BiasCorrectedEMA):
        """Exponential moving average with bias correction: after t updates the value is
        m_t / (1 - (1 - alpha)^t) with m_t = (1 - alpha) m_{t-1} + alpha x_t and m_0 = 0.

        Read ``value`` before ``update`` to get EMA_{t-1} for the ratio at step t. The power
        (1 - alpha)^t is kept as a running product rather than a ``pow`` call, so the device twin
        (``DeviceEMA``) reproduces it bit for bit on any IEEE device (libm and CUDA ``pow`` may
        differ in the last place). Compiled; :class:`PyEMA` where it was not built.
        """

        __slots__ = ()

    class SlidingMin(_MinState, _cstats.SlidingMinimum):
        """Minimum of the values pushed in the last ``window`` pushes (a monotonic deque).

        Call ``min_before(i)`` with the index the next push will carry to read the minimum of
        pushes ``i - window .. i - 1``; then ``push(i, value, step)``. Compiled;
        :class:`PySlidingMin` where it was not built.
        """

        __slots__ = ()
else:  # pragma: no cover
    RunningMedian = PyRunningMedian  # type: ignore[misc]
    EMA = PyEMA  # type: ignore[misc]
    SlidingMin = PySlidingMin  # type: ignore[misc]


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
