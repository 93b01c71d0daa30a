"""The Tier 2 summary: what a person needs to decide about a rollback, from host history.

``History`` keeps the last ``window`` steps' (step, loss, grad_norm, log_z) as host floats (they
are read for the record anyway, so keeping them costs nothing on the device), and the last
``window`` readings of the attention-logit bound (every tenth step, from the guard's signals)
with the run's first. ``tier2_summary`` turns it into a plain dict: the log Z trend over the
window, grad-norm percentiles, the attention-logit bound, the data range around the onset, the
suggested rollback checkpoint and the remedies (``remedies.py``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from .remedies import remedies, remedy_settings

__all__ = ["History", "tier2_summary"]


class History:
    """The last ``window`` steps as (step, loss, grad_norm, log_z) host floats, the last
    ``window`` attention-logit bound readings and the run's first; ``config`` (a DetectorConfig,
    or None for no remedies) sizes the remedies."""

    def __init__(self, window: int, config: Any = None) -> None:
        self.rows: deque[tuple[int, float, float, float]] = deque(maxlen=window)
        self.bounds: deque[tuple[int, float]] = deque(maxlen=window)
        self.first_bound: tuple[int, float] | None = None
        self.config = config

    def add(self, step: int, loss: float, grad_norm: float, log_z: float) -> None:
        self.rows.append((step, loss, grad_norm, log_z))

    def add_bound(self, step: int, bound: float) -> None:
        """An attention-logit bound reading (the signals' ``attn_logit_bound``) at ``step``; a
        non-finite one is left out (non-finite weights are the halt rule's)."""
        if not math.isfinite(bound):
            return
        while self.bounds and self.bounds[-1][0] >= step:  # a replay after a rollback
            self.bounds.pop()
        self.bounds.append((step, bound))
        if self.first_bound is None:
            self.first_bound = (step, bound)

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.rows.maxlen, "rows": [list(r) for r in self.rows],
                "bounds": [list(b) for b in self.bounds],
                "first_bound": None if self.first_bound is None else list(self.first_bound)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A state of this version, or one saved before the bounds were kept (none then)."""
        window = int(state["window"])
        self.rows = deque(((int(s), float(a), float(b), float(c)) for s, a, b, c in state["rows"]),
                          maxlen=window)
        self.bounds = deque(((int(s), float(b)) for s, b in state.get("bounds", ())),
                            maxlen=window)
        first = state.get("first_bound")
        self.first_bound = None if first is None else (int(first[0]), float(first[1]))


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (NaN with fewer than two points)."""
    if len(xs) < 2:
        return math.nan
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return math.nan if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def tier2_summary(history: History, *, step: int, reasons: tuple[str, ...], onset: int,
                  data_range: tuple[int, int] | None, rollback_to: int | None) -> dict[str, Any]:
    """A JSON-ready summary of a Tier 2 verdict (see the module docstring)."""
    rows = [r for r in history.rows if r[0] <= step]
    z = [(s, lz) for s, _, _, lz in rows if math.isfinite(lz)]
    norms = sorted(g for _, _, g, _ in rows if math.isfinite(g))
    before = [lo for s, lo, _, _ in rows if s < onset and math.isfinite(lo)]
    bounds = [b for b in history.bounds if b[0] <= step]
    lines = [] if history.config is None else remedies(reasons, bounds, history.first_bound,
                                                       history.config)
    return {
        "step": step,
        "onset_step": onset,
        "reasons": list(reasons),
        "window_steps": [rows[0][0], rows[-1][0]] if rows else None,
        "log_z": {
            "first": z[0][1] if z else math.nan,
            "last": z[-1][1] if z else math.nan,
            "slope_per_1k_steps": 1000.0 * _slope([float(s) for s, _ in z], [v for _, v in z]),
        },
        "grad_norm_percentiles": {f"p{int(q * 100)}": _percentile(norms, q)
                                  for q in (0.5, 0.9, 0.99, 1.0)},
        "loss_before_onset": sum(before[-50:]) / len(before[-50:]) if before else math.nan,
        "attn_logit_bound": None if not bounds else {
            "first": list(history.first_bound or bounds[0]), "last": list(bounds[-1]),
            "max": list(max(bounds, key=lambda b: b[1]))},
        "data_range": list(data_range) if data_range is not None else None,
        "rollback_checkpoint": rollback_to,
        "rollback": (f"to the checkpoint of step {rollback_to}" if rollback_to is not None
                     else "no checkpoint precedes the onset"),
        "remedies": lines,
        "remedy_settings": remedy_settings(lines, history.config) if lines else [],
    }
