"""Sliding windows for the detector: a windowed minimum and an event log (the windowed median
is spikeguard.detect.stats.RunningMedian).

All round-trip through plain lists (JSON-ready).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

__all__ = ["EventWindow", "SlidingMin"]


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
        self.window = int(state["window"])
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
        self.window = int(state["window"])
        self._q = deque((int(i), int(s)) for i, s in state["entries"])
