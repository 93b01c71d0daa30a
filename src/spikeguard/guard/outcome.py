"""One step's outcome as it passes through the guard's stages, and the record it becomes.

The stages (docs/design.md walks them) each take the step's ``StepOutcome`` and return it with
their part filled in: the device's reading (``reading.py``), the weights check
(``weights.py``), the detector's verdict (``detection.py``), attribution's finding
(``attribution.py``), the response's reply (``responses/``). ``update`` is the one field that
says what happened to the step's update, and only the step part (``step.Updater``) carries out
a change to it: a stage asks, the guard hands the request to the updater and sets ``update``
from its answer. ``record_keys`` gives the metrics record's keys beyond ``metrics_record``'s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ..detector.detector import Verdict
from ..record import Action, StepMetrics
from .reading import StepReading

__all__ = ["StepOutcome", "Update"]


class Update(str, enum.Enum):
    """What happened to the step's update, at the step (a rollback later undoes it with every
    update since its checkpoint: the record's ``action`` says so)."""

    APPLIED = "applied"
    """The optimizer stepped on it (clipped; a release after a check counts too)."""
    WITHHELD = "withheld"
    """The guard withheld it (a skip, or the halt of a non-finite step)."""
    DROPPED = "dropped"
    """Withheld, then the batch without its quarantined rows was re-run and that update applied."""
    OVERFLOW = "overflow"
    """The fp16 loss scaler skipped it on its own overflow (the guard withheld nothing)."""


@dataclass
class StepOutcome:
    """One step through the stages (module docstring). Typed fields; no stage writes a key
    another owns."""

    step: int
    reading: StepReading
    update: Update
    signals: dict[str, float] = field(default_factory=dict)
    """The probes' readings by name (their own record keys)."""
    metrics: StepMetrics | None = None
    verdict: Verdict | None = None
    action: Action = Action.CONTINUE
    """What the guard did (the record's ``action``)."""
    weights_check: Any = None
    """The weights check's ``WeightsCheck`` when the gate flagged the step on finite numbers."""
    cause: str | None = None
    """Why a flagged step was flagged: data, weights, transient or unknown (None: not asked)."""
    finding: Any = None
    """Attribution's ``Finding`` for a skip it explained."""
    would_do: Action | None = None
    """Under ``respond=False``: what the guard would have done (the record's ``verdict``)."""
    reply: Any = None
    """The response's ``Reply`` (Tier 2 and 3)."""
    update_bound: bool = False
    """Whether the update bound is on (the record then carries ``update_coef``)."""
    lr_factor: float = 1.0
    """The multiple of the scheduled LR the step's update used (``Updater.lr``)."""

    @property
    def blamed_skip(self) -> bool:
        """A skip whose batch the weights check blamed (its reference batch passed under the
        same weights), whatever else the step fired: the next step gets the storm test
        (``DeviceGate.after_skip``) while fewer than max_consecutive_skips came in a row."""
        check = self.weights_check
        return self.update is Update.WITHHELD and check is not None and check.weights is False

    @property
    def skipped(self) -> bool:
        """The record's ``skipped``: the guard withheld the update (at a loss-scaler overflow,
        whether the gate withheld it too: it does unless the guard only measures)."""
        if self.update is Update.OVERFLOW:
            return bool(self.reading.withheld)
        return self.update is Update.WITHHELD

    def record_keys(self) -> dict[str, Any]:
        """The record's keys after ``metrics_record``'s, in the order they are written."""
        r, rec = self.reading, {}
        rec["armed"], rec["skipped"], rec["clip_coef"] = r.armed, self.skipped, r.clip_coef
        if self.update_bound:
            rec["update_coef"] = r.update_coef
        if self.weights_check is not None:
            rec["weights_check"] = self.weights_check.record()
        if self.cause is not None and self.finding is None:  # the weights check's cause
            rec["cause"] = self.cause
        rec.update(self.signals)
        if self.finding is not None:  # attribution's cause, then its keys
            rec["cause"] = self.cause
            rec.update(self.finding.record())
        if self.would_do is not None:
            rec["verdict"] = self.would_do.value
        if self.reply is not None:
            rec.update(self.reply.record)
        return rec
