"""The Tier 2 alert (the default): page with the summary and go on training."""

from __future__ import annotations

import logging
from typing import Any

from ...record import Action
from .base import Incident, Reply

__all__ = ["Alert"]

log = logging.getLogger("spikeguard")


class Alert:
    """``on_alert(summary)``, else a log line; the record carries the ``summary``."""

    action = Action.ALERT
    """What it does to the step when it acts (``Policy.intended``)."""

    def respond(self, incident: Incident, control: Any) -> Reply:
        summary = control.summary(incident)
        page(incident, control, summary)
        return Reply(Action.ALERT, record={"summary": summary})


def page(incident: Incident, control: Any, summary: dict[str, Any]) -> None:
    """Page through ``control.on_alert``, else a warning in the log."""
    if control.on_alert is not None:
        control.on_alert(summary)
    else:
        log.warning("spikeguard: Tier 2 at step %d: %s (rollback: %s)%s",
                    incident.step, "; ".join(incident.verdict.reasons), summary["rollback"],
                    remedy_lines(summary))


def remedy_lines(summary: dict[str, Any]) -> str:
    """The summary's remedies as lines to append to a log message ('' when there are none)."""
    return "".join(f"\n  remedy: {r}" for r in summary.get("remedies") or ())
