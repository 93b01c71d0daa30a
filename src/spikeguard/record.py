"""The per-step health record, shared by detect, respond and the sinks.

``StepMetrics`` holds the numbers every rule of the detector reads; ``Action`` is what the
detector decides; ``metrics_record`` turns both into the flat dict the sinks write (one JSON
object per step in ``metrics.jsonl``; docs/design.md, "The metrics record", lists the keys).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["ACTIONS", "RECORD_KEYS", "SCHEMA", "Action", "StepMetrics", "metrics_record"]

SCHEMA = 1
"""Version of the metrics record; bump it (and teach ``read_metrics`` the old one) on any change
to the meaning of an existing key."""

RECORD_KEYS = ("schema", "step", "loss", "grad_norm", "log_z", "loss_ema_ratio", "nan_frac", "lr",
               "tier", "action", "reasons")
"""Keys every record carries, in the order they are written (None where unknown)."""



class Action(str, enum.Enum):
    """What to do with the step, and in a record what was done; the value is the metrics
    record's ``action`` string. DROP is never a verdict: it records that a skipped step's batch
    was re-run without its quarantined rows and that update applied (``skipped`` false)."""

    CONTINUE = "continue"
    ALERT = "alert"
    SKIP = "skip"
    ROLLBACK = "rollback"
    HALT = "halt"
    DROP = "drop"


ACTIONS = tuple(a.value for a in Action)
"""The values of the record's ``action``."""


@dataclass
class StepMetrics:
    """One training step's health numbers, as host floats.

    ``loss`` and ``log_z`` are averaged over data-parallel ranks (``grad_stats(extras=...)``);
    ``grad_norm`` is the pre-clip global norm; ``nan_frac`` is the fraction of gradient elements
    that are NaN or Inf. Fields after ``nan_frac`` are optional: the detector computes
    ``loss_ema_ratio`` from its own EMA when it is None, and ``grad_scale`` is set only under fp16
    loss scaling.
    """

    step: int
    loss: float
    grad_norm: float
    log_z: float = math.nan
    nan_frac: float = 0.0
    loss_ema_ratio: float | None = None
    lr: float | None = None
    grad_scale: float | None = None
    extras: dict[str, Any] | None = field(default=None)

    def to_dict(self) -> dict[str, Any]:
        """Flat dict: the record keys (``RECORD_KEYS``), extras merged under their own names."""
        # shallow on purpose: dataclasses.asdict would deep-copy (device) tensors
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        extras = d.pop("extras") or {}
        d.update(extras)
        return d


def metrics_record(metrics: StepMetrics, *, tier: Any = 0, action: Action | str = Action.CONTINUE,
                   reasons: Iterable[str] = ()) -> dict[str, Any]:
    """The metrics record of one step: ``RECORD_KEYS`` first (``schema`` = ``SCHEMA``), then
    ``grad_scale`` when set, then ``extras`` under their own names.

    ``tier``, ``action`` and ``reasons`` come from the detector's Verdict; until it runs they are
    0, CONTINUE and []. ``action`` may be an :class:`Action` or one of the strings ``ACTIONS``.
    Values may be 0-d tensors (device or not): the sinks read them off the device one step late,
    so building a record never syncs.
    """
    if not isinstance(metrics, StepMetrics):
        raise TypeError(f"metrics_record(metrics) takes a StepMetrics, got {type(metrics).__name__}")
    if isinstance(tier, int) and not 0 <= tier <= 3:
        raise ValueError(f"tier={tier!r} must be 0, 1, 2 or 3 (the verdict's tier)")
    if isinstance(action, enum.Enum):
        action = action.value
    if isinstance(action, str) and action not in ACTIONS:
        raise ValueError(f"action={action!r} is not one of {ACTIONS}")
    taken = set(RECORD_KEYS) | {f.name for f in fields(metrics)}
    for key in metrics.extras or {}:
        if key in taken:
            raise ValueError(f"extras key {key!r} collides with a record key; rename it")
    m = metrics.to_dict()
    rec: dict[str, Any] = {"schema": SCHEMA}
    for key in RECORD_KEYS[1:]:
        rec[key] = m.pop(key, None)
    rec["tier"], rec["action"], rec["reasons"] = tier, action, list(reasons)
    if m.pop("grad_scale", None) is not None:
        rec["grad_scale"] = metrics.grad_scale
    rec.update(m)
    return rec
