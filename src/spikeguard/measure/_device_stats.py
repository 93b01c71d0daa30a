"""The device twins of the running statistics (``DeviceRunningMedian``, ``DeviceEMA``): float64
tensor state, the flag taken as a tensor, no host sync; re-exported by ``measure.stats``."""

from __future__ import annotations

import math
from typing import Any

import torch

from .._validate import check_int, check_window

__all__ = ["DeviceEMA", "DeviceRunningMedian"]


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
        self.__init__(check_window(self, state), device=self.device)
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
