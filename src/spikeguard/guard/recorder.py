"""The recorder: one metrics record per resolved step, to the sinks."""

from __future__ import annotations

from typing import Any

from ..record import metrics_record
from .outcome import StepOutcome

__all__ = ["Recorder"]


class Recorder:
    """Turns a step's outcome into the record the sinks get.

    ``records`` counts the records written (one per step; a checkpoint saves the count, so a
    resumed run can cut a metrics file back to the checkpoint)."""

    def __init__(self, sinks: Any) -> None:
        self.sinks = sinks
        self.records = 0
        self.noted: dict[str, Any] | None = None
        """An on-call decision taken at the step boundary: the next record carries it."""

    def record(self, out: StepOutcome) -> None:
        """The record of one resolved step: ``metrics_record``'s keys, then the outcome's."""
        self.records += 1
        if self.sinks is None:
            return
        m, verdict = out.metrics, out.verdict
        rec = metrics_record(m, tier=verdict.tier, action=out.action, reasons=verdict.reasons)
        rec.update(out.record_keys())
        if self.noted is not None:  # what happened between the last step and this one
            rec["oncall"], self.noted = self.noted, None
        self.sinks.log(rec, m.step)

    def state_dict(self) -> dict[str, Any]:
        return {"records": self.records}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = int(state["records"])

    def flush(self) -> None:
        if self.sinks is not None:
            self.sinks.flush()

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()
