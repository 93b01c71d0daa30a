"""Tier 3: halt with a report (the parameters with non-finite gradients, the first module whose
output or gradient went non-finite), or, when ``reconfigure(report)`` answers with changes,
resume from the last healthy checkpoint with them (``precision``, ``lr_scale``, ``z_loss``)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..._validate import check_positive
from ...record import Action, StepMetrics
from ..forensics import HaltReport, gather_names, nonfinite_params, trace_nonfinite
from ..lr_scale import Stretch
from .base import Incident, Reply

__all__ = ["Halt"]

log = logging.getLogger("spikeguard")


class Halt:
    """The Tier 3 response, and the halt a spent rollback budget ends in (module docstring)."""

    action = Action.HALT
    """What it does to the step when it acts (``Policy.intended``)."""

    def __init__(self, reconfigure: Callable[[HaltReport], Mapping[str, Any] | None] | None
                 = None) -> None:
        self.reconfigure = reconfigure

    def respond(self, incident: Incident, control: Any) -> Reply:
        return self.halt(incident, control)

    def halt(self, incident: Incident, control: Any, *, summary: dict[str, Any] | None = None,
             detail: str = "") -> Reply:
        """The report, then a reconfigured resume if the hook answers, else the halt."""
        p, verdict = incident.pending, incident.verdict
        report = HaltReport(step=p.step, reasons=verdict.reasons, summary=summary, detail=detail)
        named = control.named_params
        if p.grads_alive:
            report.nonfinite_params = nonfinite_params(named)
        elif p.finite is not None and p.finite[0] is not None:
            flags, owners = p.finite
            local = [named[i][0] for i, ok in zip(owners, flags.tolist()) if not ok]
            report.nonfinite_params = gather_names(local, named)
        if p.rerun is not None and verdict.tier >= 3:
            report.first_forward, report.first_backward = trace_nonfinite(control.model, p.rerun)
            report.traced = True
            if not report.nonfinite_params:  # the re-run rebuilt this step's gradients
                report.nonfinite_params = nonfinite_params(named)
            control.optimizer.zero_grad(set_to_none=True)
        resumed = self._try_reconfigure(incident, control, report)
        if resumed is not None:
            return resumed
        record: dict[str, Any] = {} if summary is None else {"summary": summary}
        record["halt"] = {k: v for k, v in report.to_dict().items() if k != "summary"}
        e = verdict.evidence
        metrics = StepMetrics(step=p.step, loss=e.get("loss", float("nan")),
                              grad_norm=e.get("grad_norm", float("nan")),
                              log_z=e.get("log_z", float("nan")), nan_frac=e.get("nan_frac", 0.0),
                              lr=p.lr, grad_scale=e.get("grad_scale"))
        return Reply(Action.HALT, record=record, halt=report, metrics=metrics)

    def _try_reconfigure(self, incident: Incident, control: Any,
                         report: HaltReport) -> Reply | None:
        if self.reconfigure is None or control.checkpoints is None:
            return None
        if not control.budget_left:
            report.detail = (report.detail + "; " if report.detail else "") + \
                "no reconfigure: rollback budget exhausted"
            return None
        changes = self.reconfigure(report)
        if not changes:
            return None
        try:
            info = control.restore_before(incident.onset)
        except Exception as e:
            report.detail = (report.detail + "; " if report.detail else "") + \
                f"reconfigure could not resume: {e}"
            return None
        control.rollbacks += 1
        reply = Reply(Action.ROLLBACK)
        applied = _changes(dict(changes), control.model, reply, first=info.step + 1)
        control.ledger.resync()
        reply.record.update(reconfigured=applied, rollback_to=info.step,
                            rollbacks=control.rollbacks, halt=report.to_dict())
        log.warning("spikeguard: halt at step %d answered by reconfigure %s; resuming from %d",
                    report.step, applied, info.step)
        return reply


def _changes(changes: dict[str, Any], model: Any, reply: Reply, *, first: int) -> dict[str, Any]:
    """Apply a reconfigure's changes: the precision and the LR as requests to the step part (in
    ``reply``), z-loss on the reference GPT's config. Returns what was applied."""
    applied: dict[str, Any] = {}
    for key, value in changes.items():
        if key == "precision":
            reply.precision = value
        elif key == "lr_scale":
            check_positive(value, "reconfigure lr_scale")
            reply.lr = Stretch(first=first, last=None, scale=float(value), kind="reconfigure")
        elif key == "z_loss":
            cfg = getattr(model, "cfg", None)
            if cfg is None or not hasattr(cfg, "z_loss"):
                raise ValueError("reconfigure z_loss needs a model with cfg.z_loss "
                                 "(the reference GPT); apply it in your own loss instead")
            model.cfg = dataclasses.replace(cfg, z_loss=float(value))
        else:
            raise ValueError(f"reconfigure returned {key!r}, which the guard cannot apply; "
                             "known: precision, lr_scale, z_loss")
        applied[key] = value
    return applied
