"""The gradients in place, set aside while a step is re-run (attribution, the weights check)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GradsAside"]


class GradsAside:
    """Re-runs happen with the gradients in place set aside and the probes quiet; ``restore``
    puts both back. Under read_lag 1 the gradients in place are the next step's, taken at the
    weights before this step: when an update was applied meanwhile (a drop), they are stale, so
    ``restore(redo=...)`` re-runs the next step at the new weights instead (the caller's redo);
    without one they are restored, brought to the new loss scale."""

    def __init__(self, params: list[torch.Tensor], precision: Any, probes: Any) -> None:
        self.params, self.precision = params, precision
        self.grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        self.scale = precision.grad_scale()
        self._quiet = probes.quiet() if probes is not None else contextlib.nullcontext()
        self._quiet.__enter__()

    def restore(self, *, stale: bool, redo: Callable[[], None] | None = None) -> None:
        self._quiet.__exit__(None, None, None)
        if stale and redo is not None:
            for p in self.params:
                p.grad = None
            redo()
            return
        for p, grad in zip(self.params, self.grads):
            p.grad = grad
        new = self.precision.grad_scale()
        if stale and self.scale is not None and new != self.scale:
            live = [x for x in self.grads if x is not None]
            if live:
                torch._foreach_mul_(live, new / self.scale)  # powers of two: exact
