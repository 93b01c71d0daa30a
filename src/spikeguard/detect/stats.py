"""Running statistics on the host: a sliding-window median and a bias-corrected EMA.

Both keep flagged steps out of their history simply by not being updated with them. Both have
``state_dict`` / ``load_state_dict``: save, load, continue equals never stopping.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any

__all__ = ["EMA", "RunningMedian"]


class RunningMedian:
    """Median of the last ``window`` values, O(log window) per update.

    Two heaps (a max-heap of the lower half and a min-heap of the upper half) with lazy deletion:
    a value that leaves the window is marked dead and popped when it reaches a heap top. With an
    even count the median is the mean of the two middle values (``statistics.median``).
    """

    def __init__(self, window: int = 5000) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
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
        self.__init__(int(state["window"]))
        for v in state["values"]:
            self.update(v)


class EMA:
    """Exponential moving average with bias correction: after t updates the value is
    m_t / (1 - (1 - alpha)^t) with m_t = (1 - alpha) m_{t-1} + alpha x_t and m_0 = 0.

    Read ``value`` before ``update`` to get EMA_{t-1} for the ratio at step t.
    """

    def __init__(self, alpha: float = 1e-3) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1]; the seeds use 1/1000")
        self.alpha = alpha
        self._m = 0.0
        self.count = 0

    def update(self, value: float) -> None:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"EMA.update({value}): only finite values belong in the history")
        self._m = (1.0 - self.alpha) * self._m + self.alpha * value
        self.count += 1

    @property
    def value(self) -> float:
        """The bias-corrected average; NaN before the first update."""
        if self.count == 0:
            return math.nan
        return self._m / (1.0 - (1.0 - self.alpha) ** self.count)

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "m": self._m, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha = float(state["alpha"])
        self._m = float(state["m"])
        self.count = int(state["count"])
