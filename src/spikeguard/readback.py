"""Device numbers read on the host one step late: the one helper the guard and the sinks share.

``Readback(tensors)`` flattens the tensors into float64 at once. Tensors on the CPU are copied
there (a snapshot: a later in-place edit does not reach it); the others are gathered on their
device and, on CUDA, copied into pinned host memory with ``non_blocking=True`` behind an event:
no host sync. ``values()`` waits for that event only (by the next step it has long completed)
and returns every element as a Python float, in the order given. On other accelerators the
copy happens in ``values()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Readback"]


class Readback:
    """Tensors on their way to the host (module docstring)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        flat = [t.detach().reshape(-1) for t in tensors]
        self.on_device = [t.device.type != "cpu" for t in flat]
        """Per tensor: whether it lives off the CPU (read at ``values()``)."""
        self.sizes = [t.numel() for t in flat]
        host = [t.to(torch.float64) for t, d in zip(flat, self.on_device) if not d]
        self._cpu = torch.cat(host) if host else None
        self._dev: torch.Tensor | None = None
        self._event: Any = None
        dev = [t for t, d in zip(flat, self.on_device) if d]
        if not dev:
            return
        device = dev[0].device
        vec = torch.cat([t.to(device=device, dtype=torch.float64) for t in dev])
        if device.type == "cuda":
            self._dev = torch.empty(vec.shape, dtype=torch.float64, pin_memory=True)
            self._dev.copy_(vec, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._dev = vec

    @property
    def any_on_device(self) -> bool:
        return any(self.on_device)

    def values(self) -> list[float]:
        """Every element of every tensor as a float, in order (waits for the copy's event)."""
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        streams = {False: iter(self._cpu.tolist() if self._cpu is not None else ()),
                   True: iter(self._dev.cpu().tolist() if self._dev is not None else ())}
        out: list[float] = []
        for d, n in zip(self.on_device, self.sizes):
            it = streams[d]
            out.extend(next(it) for _ in range(n))
        return out
