"""Tier 2 ``ask`` (``GuardConfig(tier2="ask")``): page a person and go on training; their answer
is applied at a step boundary, the same on every rank (docs/on-call.md).

``Ask.respond`` (a Tier 2 verdict) pages the summary through the run's on-call loop
(``spikeguard.oncall.OnCall.page``: it opens an incident or extends the open one) and answers
ALERT: nothing changes until a person decides. ``answer(decision, control, ...)`` is what the
guard calls at the step boundary where ``OnCall.poll`` returned a decision (read on rank 0 and
broadcast): a rollback restores the chosen checkpoint (``RunControl.restore``), keeps the skip
ranges learned so far and leaves the answer's ``--skip-data`` out; an LR change is a Stretch for
good (the one LR mechanism); the settings a Reply cannot carry (z-loss, the clip, QK-Clip, a
layer's precision) are applied by ``oncall.apply.apply_settings``; a halt is a HaltReport.
"""

from __future__ import annotations

from typing import Any

from ...oncall.apply import apply_settings
from ...record import Action
from ..forensics import HaltReport
from ..lr_scale import Stretch
from .alert import page
from .base import Incident, Reply

__all__ = ["Ask", "answer", "check_oncall", "lr_stretch"]

_ACTIONS = {"rollback": Action.ROLLBACK, "continue": Action.CONTINUE, "halt": Action.HALT}


class Ask:
    """The ask response (module docstring): page through ``control.on_alert`` (the on-call
    loop's ``page``) and go on; the record says the run waits for an answer."""

    action = Action.ALERT
    """What it does to the step when it acts (``Policy.intended``)."""

    def respond(self, incident: Incident, control: Any) -> Reply:
        summary = control.summary(incident)
        page(incident, control, summary)
        return Reply(Action.ALERT, record={"summary": summary, "asked": True})


def check_oncall(config: Any, oncall: Any) -> Any:
    """``oncall`` for a Guard of ``config``: tier2="ask" needs one (ValueError naming the fix)."""
    if config.tier2 == "ask" and oncall is None:
        raise ValueError("GuardConfig(tier2='ask') needs Guard(oncall=spikeguard.oncall.OnCall("
                         "...)): the on-call loop that pages and reads the answer "
                         "(docs/on-call.md)")
    return oncall


def lr_stretch(settings: dict[str, Any], *, first: int, peak: float | None,
               in_force: float = 1.0) -> tuple[Stretch | None, float | None]:
    """The Stretch for an answer's ``lr`` (a new peak) or ``lr_scale`` (a factor), from step
    ``first`` for good, and the peak LR it leads to; ``in_force``: the factor earlier answers'
    stretches already apply (an ``lr`` is absolute: it replaces their effect)."""
    if "lr" in settings:
        if not peak:
            raise ValueError("--set lr needs an LR scheduler or optimizer LR to scale from")
        factor = float(settings["lr"]) / (peak * in_force)
    elif "lr_scale" in settings:
        factor = float(settings["lr_scale"])
    else:
        return None, None
    new_peak = peak * in_force * factor if peak else None
    return Stretch(first=first, last=None, scale=factor, kind="answer"), new_peak


def answer(decision: Any, control: Any, next_step: int, *, model: Any, updater: Any,
           probes: Any, peak: float | None) -> Reply:
    """The Reply that applies ``decision`` at the boundary before step ``next_step`` (module
    docstring); its ``record`` says what was done (``rollback_to``, ``skip_data``,
    ``settings``). ``peak``: the scheduled peak LR, for ``--set lr``."""
    done: dict[str, Any] = {}
    first = next_step
    if decision.action == "rollback":
        info = control.restore(decision.to)
        control.rollbacks += 1
        ledger = control.ledger
        ledger.reapply()  # earlier rollbacks' ranges and drops hold across this restore
        if decision.skip_data is not None and ledger.can_skip:
            ledger.skip(*decision.skip_data)
            done["skip_data"] = list(decision.skip_data)
        ledger.resync()
        done["rollback_to"] = first = info.step
        first += 1
    settings = dict(decision.settings)
    in_force = 1.0
    for s in updater.lr.stretches:
        if s.kind == "answer":
            in_force *= s.scale
    stretch, new_peak = lr_stretch(settings, first=first, peak=peak, in_force=in_force)
    applied = apply_settings(model, {k: v for k, v in settings.items()
                                     if k not in ("lr", "lr_scale")},
                             updater=updater, probes=probes)
    if new_peak is not None:
        applied["lr"] = new_peak
    if applied:
        done["settings"] = applied
    halt = None
    if decision.action == "halt":
        halt = HaltReport(step=next_step - 1, reasons=(
            f"on-call answer: halt (incident {decision.incident}, by {decision.by})",))
    return Reply(_ACTIONS[decision.action], record=done, lr=stretch, halt=halt)
