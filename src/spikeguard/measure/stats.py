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

import heapq
import math
from collections import deque
from typing import TYPE_CHECKING, Any

from .._validate import check_int, check_window

if TYPE_CHECKING:
    from ._device_stats import DeviceEMA, DeviceRunningMedian

__all__ = ["EMA", "DeviceEMA", "DeviceRunningMedian", "EventWindow", "RunningMedian", "SlidingMin"]


class RunningMedian:
    """Median of the last ``window`` values, O(log window) per update.

    Two heaps (a max-heap of the lower half and a min-heap of the upper half) with lazy deletion:
    a value that leaves the window is marked dead and popped when it reaches a heap top. With an
    even count the median is the mean of the two middle values (``statistics.median``).
    """

    def __init__(self, window: int = 5000) -> None:
        check_int(window, "window")
        self.window = window
        self._fifo: deque[tuple[int, float]] = deque()
        self._low: list[tuple[float, int]] = []   # (-value, id): max-heap of the lower half
        self._high: list[tuple[float, int]] = []  # (value, id): min-heap of the upper half
        self._side: dict[int, bool] = {}          # id -> True when in the lower half
        self._dead: set[int] = set()
        self._n_low = 0
        self._n_high = 0
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._fifo)

    def _prune(self, heap: list[tuple[float, int]]) -> None:
        while heap and heap[0][1] in self._dead:
            self._dead.discard(heapq.heappop(heap)[1])

    def _rebalance(self) -> None:
        while self._n_low > self._n_high + 1:
            self._prune(self._low)
            neg, i = heapq.heappop(self._low)
            heapq.heappush(self._high, (-neg, i))
            self._side[i] = False
            self._n_low -= 1
            self._n_high += 1
        while self._n_high > self._n_low:
            self._prune(self._high)
            val, i = heapq.heappop(self._high)
            heapq.heappush(self._low, (-val, i))
            self._side[i] = True
            self._n_high -= 1
            self._n_low += 1
        self._prune(self._low)
        self._prune(self._high)

    def update(self, value: float) -> None:
        """Add a finite value; the oldest leaves once the window is full."""
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"RunningMedian.update({value}): only finite values belong in the history")
        i = self._next_id
        self._next_id += 1
        self._prune(self._low)
        if self._n_low == 0 or value <= -self._low[0][0]:
            heapq.heappush(self._low, (-value, i))
            self._side[i] = True
            self._n_low += 1
        else:
            heapq.heappush(self._high, (value, i))
            self._side[i] = False
            self._n_high += 1
        self._fifo.append((i, value))
        if len(self._fifo) > self.window:
            old, _ = self._fifo.popleft()
            if self._side.pop(old):
                self._n_low -= 1
            else:
                self._n_high -= 1
            self._dead.add(old)
        self._rebalance()
        if len(self._low) + len(self._high) > 2 * self.window + 64:
            self._compact()

    def _compact(self) -> None:
        # dead entries buried below the tops would otherwise accumulate without bound
        self._low = [e for e in self._low if e[1] not in self._dead]
        self._high = [e for e in self._high if e[1] not in self._dead]
        heapq.heapify(self._low)
        heapq.heapify(self._high)
        self._dead.clear()

    @property
    def value(self) -> float:
        """The median of the window; NaN while empty."""
        if not self._fifo:
            return math.nan
        if self._n_low > self._n_high:
            return -self._low[0][0]
        return (-self._low[0][0] + self._high[0][0]) / 2.0

    def values(self) -> list[float]:
        """The window's values, oldest first."""
        return [v for _, v in self._fifo]

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
    in the last place).
    """

    def __init__(self, alpha: float = 1e-3) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1]; the detector uses 1/1000")
        self.alpha = alpha
        self._m = 0.0
        self._decay = 1.0  # (1 - alpha) ** count, as a running product
        self.count = 0

    def update(self, value: float) -> None:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"EMA.update({value}): only finite values belong in the history")
        self._m = (1.0 - self.alpha) * self._m + self.alpha * value
        self._decay *= 1.0 - self.alpha
        self.count += 1

    @property
    def value(self) -> float:
        """The bias-corrected average; NaN before the first update."""
        if self.count == 0:
            return math.nan
        return self._m / (1.0 - self._decay)

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "m": self._m, "count": self.count, "decay": self._decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha = float(state["alpha"])
        self._m = float(state["m"])
        self.count = int(state["count"])
        # state dicts saved before "decay" existed: recompute it
        self._decay = float(state.get("decay", (1.0 - self.alpha) ** self.count))


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
        lo = i - self.window
        while q and q[0][0] < lo:
            q.popleft()
        if not q:
            return math.nan, None
        return q[0][1], q[0][2]

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
