"""The recorder: one metrics record per resolved step, to the sinks."""

from __future__ import annotations

from typing import Any

from ..record import Action, StepMetrics, metrics_record

__all__ = ["Recorder"]


class Recorder:
    """Turns a step's metrics, verdict, action and extras into the record the sinks get.

    ``records`` counts the records written (one per step; a checkpoint saves the count, so a
    resumed run can cut a metrics file back to the checkpoint)."""

    def __init__(self, sinks: Any) -> None:
        self.sinks = sinks
        self.records = 0

    def log(self, m: StepMetrics, verdict: Any, action: Action, extras: dict[str, Any]) -> None:
        self.records += 1
        if self.sinks is None:
            return
        rec = metrics_record(m, tier=verdict.tier, action=action, reasons=verdict.reasons)
        rec.update(extras)
        self.sinks.log(rec, m.step)

    def flush(self) -> None:
        if self.sinks is not None:
            self.sinks.flush()

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()
