"""FP8 scale monitoring: per-linear amax history and the headroom of delayed scaling.

Delayed scaling picks step t's scale from the amax history of earlier steps:
s_t = fp8_max / (2^margin * max(history)). The value actually cast at step t has amax_t, so
the headroom is headroom_t = fp8_max / (amax_t * s_t) = 2^margin * max(history) / amax_t.
Headroom below 1 means the largest value overflows the format's range after scaling; below 0.5
(amax_t more than twice the rolling maximum at margin 0) the scale underestimates badly and the
monitor warns. Norms, the MoE router, embeddings and the LM head stay out of fp8
(:func:`fp8_eligible`).
"""

from __future__ import annotations

import math
import re
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .._validate import check_int

__all__ = ["FP8_MAX", "AmaxMonitor", "Fp8HeadroomWarning", "HeadroomEvent", "fp8_eligible"]

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}

# module names that stay in bf16/fp32 whatever their type
_KEEP_OUT = re.compile(r"(^|\.)(wte|wpe|embed\w*|lm_head|output|router|gate|\w*norm\w*|ln\w*)($|\.)")


class Fp8HeadroomWarning(UserWarning):
    """A tensor's amax jumped past what its delayed fp8 scale can hold."""


def fp8_eligible(name: str, module: nn.Module) -> bool:
    """True for the bulk matmuls that may run in fp8: nn.Linear layers that are not the embedding,
    the LM head, an MoE router or a norm, and whose dims are multiples of 16 (fp8 GEMM shapes).
    Usable as torchao's ``module_filter_fn(module, fqn)`` via ``lambda m, n: fp8_eligible(n, m)``."""
    if not isinstance(module, nn.Linear) or _KEEP_OUT.search(name):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


@dataclass
class HeadroomEvent:
    """One step of one tensor whose headroom fell below the warning threshold (``headroom`` 0
    for a NaN or inf amax; ``history_max`` NaN while the history is empty)."""

    step: int
    name: str
    amax: float
    history_max: float
    headroom: float


class AmaxMonitor:
    """Track amax per tensor name, and the headroom delayed scaling would have at each step.

    ``update(step, name, amax)`` returns headroom_t (inf while the history is empty; 0 for a NaN
    or inf amax) and then appends a finite amax_t to the history. :meth:`hook` attaches forward pre-hooks that feed the input
    amax of every fp8-eligible linear of a model (one device reduction per linear; the host read
    happens in :meth:`flush`, once per step).
    """

    def __init__(self, *, history_len: int = 16, margin: int = 0,
                 fmt: Literal["e4m3", "e5m2"] = "e4m3", warn_below: float = 0.5) -> None:
        check_int(history_len, "history_len", hint="16 is usual")
        check_int(margin, "margin", minimum=0, hint="0 is usual; each step of margin halves "
                  "the scale, a negative one would map amax past the fp8 maximum")
        if fmt not in FP8_MAX:
            raise ValueError(f"fmt={fmt!r} must be 'e4m3' (448) or 'e5m2' (57344)")
        if not 0 < warn_below <= 1:
            raise ValueError(f"warn_below={warn_below} must be in (0, 1]; 0.5 means amax > 2x the rolling max")
        self.history_len, self.margin, self.fmt, self.warn_below = history_len, margin, fmt, warn_below
        self.fp8_max = FP8_MAX[fmt]
        self._tracks: dict[str, deque] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self.events: list[HeadroomEvent] = []
        self.last: dict[str, dict[str, float]] = {}

    def scale(self, name: str) -> float:
        """The delayed scale s_t for the next step of ``name`` (1.0 with no history)."""
        hist = self._tracks.get(name)
        if not hist:
            return 1.0
        return self.fp8_max / (2.0**self.margin * max(hist))

    def update(self, step: int, name: str, amax: float) -> float:
        """Record amax_t for ``name``; returns headroom_t against the history before it.

        A non-finite amax (NaN or inf: the tensor itself holds NaN or inf) has zero headroom: it
        is an event and a warning whatever the history, and it stays out of the history."""
        amax = float(amax)
        hist = self._tracks.setdefault(name, deque(maxlen=self.history_len))
        history_max = max(hist) if hist else math.nan
        if not math.isfinite(amax):
            headroom, ratio = 0.0, amax / history_max if hist else math.nan
        elif hist and amax > 0:
            headroom = self.fp8_max / (amax * self.scale(name))
            ratio = amax / history_max
        else:
            headroom, ratio = math.inf, math.nan
        self.last[name] = {"headroom": headroom, "amax_over_history": ratio, "amax": amax}
        if headroom < self.warn_below:
            event = HeadroomEvent(step=step, name=name, amax=amax, history_max=history_max,
                                  headroom=headroom)
            self.events.append(event)
            if math.isfinite(amax):
                why = (f"amax {amax:.4g} is {ratio:.2f}x the rolling max {history_max:.4g}; "
                       f"the delayed scale underestimates it")
            else:
                why = f"amax is {amax}: the tensor holds non-finite values, nothing can scale it"
            warnings.warn(f"fp8 headroom {headroom:.3f} < {self.warn_below} at step {step} for "
                          f"{name}: {why}", Fp8HeadroomWarning, stacklevel=2)
        if math.isfinite(amax):
            hist.append(amax)
        return headroom

    def hook(self, model: nn.Module) -> list:
        """Record the input amax of every fp8-eligible linear on each forward; returns handles."""
        handles = []
        for name, module in model.named_modules():
            if fp8_eligible(name, module):
                def pre(mod, args, _name=name):
                    self._pending[_name] = args[0].detach().abs().amax()
                handles.append(module.register_forward_pre_hook(pre))
        return handles

    def flush(self, step: int) -> dict[str, float]:
        """Read the amaxes recorded since the last flush (one host sync) and update the histories.
        Returns the record fields: the minimum headroom and the maximum amax/history ratio."""
        if not self._pending:
            return {}
        names = list(self._pending)
        values = torch.stack([self._pending[n].float() for n in names]).tolist()
        self._pending.clear()
        heads = [self.update(step, n, v) for n, v in zip(names, values)]
        ratios = [self.last[n]["amax_over_history"] for n in names]
        finite = [r for r in ratios if not math.isnan(r)]
        return {"fp8_headroom_min": min(heads),
                "fp8_amax_ratio_max": max(finite) if finite else math.nan}

    def state_dict(self) -> dict:
        return {"history": {n: list(h) for n, h in self._tracks.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._tracks = {n: deque(h, maxlen=self.history_len) for n, h in state["history"].items()}
