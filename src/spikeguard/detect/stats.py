"""Running statistics: a sliding-window median and a bias-corrected EMA, on the host and on the
device; a sliding-window minimum and an event window (host only, for the detector's rules).

The host versions (``RunningMedian``, ``EMA``) keep flagged steps out of their history simply by
not being updated with them. The device twins (``DeviceRunningMedian``, ``DeviceEMA``) hold their
state in float64 tensors and take the flag as a tensor, so the guard's gate can use them without a
host sync; fed the same stream they give bit-identical numbers to the host versions. All four have
``state_dict`` / ``load_state_dict`` (host and device state dicts are interchangeable): save, load,
continue equals never stopping; a state saved with another window is refused.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any

import torch

from .._validate import check_int

__all__ = ["EMA", "DeviceEMA", "DeviceRunningMedian", "EventWindow", "RunningMedian", "SlidingMin"]


def _window(obj: Any, state: dict[str, Any]) -> int:
    """``obj.window``; ValueError if ``state`` was saved with another (never a silent resize)."""
    if int(state["window"]) != obj.window:
        raise ValueError(f"{type(obj).__name__} state has window={state['window']} but this one "
                         f"has window={obj.window}: build it with the saved window to load it")
    return obj.window


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
        self.__init__(_window(self, state))
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
        _window(self, state)
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
        _window(self, state)
        self._q = deque((int(i), int(s)) for i, s in state["entries"])


def _scalar(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """A 0-d float64 tensor on ``device``; a tensor already there is cast on the device (no sync)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    # a fill kernel: torch.tensor(x, device=cuda) would be a blocking host-to-device copy
    return torch.full((), float(value), dtype=torch.float64, device=device)


def _kept(x: torch.Tensor, flagged: torch.Tensor | bool | None, device: torch.device) -> torch.Tensor:
    keep = torch.isfinite(x)
    if isinstance(flagged, torch.Tensor):
        keep = keep & ~flagged.to(device=device, dtype=torch.bool).reshape(())
    elif flagged:
        keep = torch.zeros((), dtype=torch.bool, device=device)
    return keep


class DeviceRunningMedian:
    """``RunningMedian`` on the device: a float64 ring buffer of the last ``window`` kept values.

    ``update`` and ``value`` issue only device kernels (no ``.item()``, no branch on a device
    value), so a CUDA step is never stalled. A step is kept out of the history with the ``flagged``
    0-d bool tensor (``torch.where``, not ``if``); non-finite values are always kept out (the host
    version refuses them). Each ``value`` sorts the window once: O(w log w) work on the device,
    cached until the next ``update``. On the same stream it equals ``RunningMedian`` bit for bit.
    """

    def __init__(self, window: int = 5000, *, device: torch.device | str | None = None) -> None:
        check_int(window, "window")
        self.window = window
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._buf = torch.zeros(window, dtype=torch.float64, device=self.device)
        self._slot = torch.arange(window, device=self.device)
        self._pos = torch.zeros((), dtype=torch.int64, device=self.device)
        self._count = torch.zeros((), dtype=torch.int64, device=self.device)
        self._median: torch.Tensor | None = None

    @property
    def count(self) -> torch.Tensor:
        """Values in the window: 0-d int64 tensor on the device."""
        return self._count

    def update(self, value: torch.Tensor | float, flagged: torch.Tensor | bool | None = None
               ) -> torch.Tensor:
        """Append ``value`` unless ``flagged`` is true or the value is non-finite; the oldest
        value leaves once the window is full. Returns whether it was kept (0-d bool tensor)."""
        x = _scalar(value, self.device)
        keep = _kept(x, flagged, self.device)
        at = self._pos.reshape(1)
        old = self._buf.index_select(0, at)
        self._buf.index_copy_(0, at, torch.where(keep, x, old))
        self._pos = torch.where(keep, (self._pos + 1) % self.window, self._pos)
        self._count = torch.where(keep, (self._count + 1).clamp(max=self.window), self._count)
        self._median = None
        return keep

    @property
    def value(self) -> torch.Tensor:
        """The median of the window as a 0-d float64 tensor on the device; NaN while empty.
        With an even count it is the mean of the two middle values, as on the host."""
        if self._median is None:
            n = self._count
            # unfilled slots (count < window) sort to the end as +inf
            filled = torch.where(self._slot < n, self._buf, math.inf)
            s = torch.sort(filled).values
            lo = s.index_select(0, ((n - 1).clamp(min=0) // 2).reshape(1)).reshape(())
            hi = s.index_select(0, (n // 2).clamp(max=self.window - 1).reshape(1)).reshape(())
            med = torch.where(n % 2 == 1, hi, (lo + hi) / 2.0)
            self._median = torch.where(n > 0, med, math.nan)
        return self._median

    def exceeds(self, x: torch.Tensor | float, k: float, *, min_count: int = 1) -> torch.Tensor:
        """``x > k * median`` as a 0-d bool tensor, false while fewer than ``min_count`` values
        are in the window. Call it before ``update`` so step t compares with steps before t.
        A NaN ``x`` compares false and an infinite one true: the gate tests finiteness itself."""
        return (_scalar(x, self.device) > k * self.value) & (self._count >= min_count)

    def values(self) -> list[float]:
        """The window's values, oldest first. Syncs: for checkpoints and tests, not the step."""
        n, pos = int(self._count), int(self._pos)
        buf = self._buf.tolist()
        return buf[:n] if n < self.window else buf[pos:] + buf[:pos]

    def state_dict(self) -> dict[str, Any]:
        """The same format as ``RunningMedian.state_dict``; the two load each other's. Syncs."""
        return {"window": self.window, "values": self.values()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(_window(self, state), device=self.device)
        vals = [float(v) for v in state["values"]][-self.window:]
        self._buf[: len(vals)] = torch.tensor(vals, dtype=torch.float64)
        self._pos.fill_(len(vals) % self.window)
        self._count.fill_(len(vals))


class DeviceEMA:
    """``EMA`` on the device: float64 tensors for the average, the decay power and the count.

    ``update`` takes an optional ``flagged`` 0-d bool tensor and skips non-finite values, with
    ``torch.where`` only; ``value`` and ``ratio`` return 0-d tensors. Each arithmetic step is the
    host's, in the same order, so on the same stream the values are bit-identical.
    """

    def __init__(self, alpha: float = 1e-3, *, device: torch.device | str | None = None) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1]; the detector uses 1/1000")
        self.alpha = alpha
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._m = torch.zeros((), dtype=torch.float64, device=self.device)
        self._decay = torch.ones((), dtype=torch.float64, device=self.device)
        self._count = torch.zeros((), dtype=torch.int64, device=self.device)

    @property
    def count(self) -> torch.Tensor:
        """Updates kept so far: 0-d int64 tensor on the device."""
        return self._count

    def update(self, value: torch.Tensor | float, flagged: torch.Tensor | bool | None = None
               ) -> torch.Tensor:
        """Fold ``value`` in unless flagged or non-finite; returns whether it was kept."""
        x = _scalar(value, self.device)
        keep = _kept(x, flagged, self.device)
        # the host's expression, (1 - a) * m + a * x, one rounding per operation
        m = (1.0 - self.alpha) * self._m + self.alpha * x
        self._m = torch.where(keep, m, self._m)
        self._decay = torch.where(keep, self._decay * (1.0 - self.alpha), self._decay)
        self._count = self._count + keep.to(torch.int64)
        return keep

    @property
    def value(self) -> torch.Tensor:
        """The bias-corrected average (0-d float64); NaN before the first kept update."""
        return torch.where(self._count > 0, self._m / (1.0 - self._decay), math.nan)

    def ratio(self, x: torch.Tensor | float) -> torch.Tensor:
        """``x / EMA_{t-1}`` (0-d float64): call before ``update``. NaN before any history."""
        return _scalar(x, self.device) / self.value

    def state_dict(self) -> dict[str, Any]:
        """The same format as ``EMA.state_dict``; the two load each other's. Syncs."""
        return {"alpha": self.alpha, "m": float(self._m), "count": int(self._count),
                "decay": float(self._decay)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha = float(state["alpha"])
        count = int(state["count"])
        self._m.fill_(float(state["m"]))
        self._count.fill_(count)
        self._decay.fill_(float(state.get("decay", (1.0 - self.alpha) ** count)))
