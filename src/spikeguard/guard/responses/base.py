"""The response interface: what a response reads, what it answers, how a config turns it on.

A response is an object with ``respond(incident, control) -> Reply | None``: None lets the next
response of the tier answer (``policy.py`` runs them in order; the first Reply whose action is
not ALERT, such as a rollback or a halt, ends the chain, since the state it leaves is not the
one the others were asked about). A Reply says what the guard did (``action``), the keys it adds
to the step's record (``record``, written by that response alone) and what it asks of the step
part: ``lr`` (a ``Stretch`` of the LR multiplier: the one way a response changes the learning
rate) and ``precision`` (a precision kind to train on from now). A response never touches the
optimizer, the schedule or the update itself; the guard hands those requests to the updater.

A response is switched on by a ``ResponseConfig`` field of ``GuardConfig``: the policy builds
every response whose config ``enabled`` is true for the tiers in its ``tiers`` (``lower_lr.py``
is the example: one file, one config field).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ...detector.detector import Verdict
from ...record import Action, StepMetrics
from ..forensics import HaltReport
from ..lr_scale import Stretch

__all__ = ["Incident", "Reply", "Response", "ResponseConfig"]


@dataclass(frozen=True)
class Incident:
    """A Tier 2 or 3 verdict and the step it came at, as a response reads them."""

    pending: Any
    """The step on its way through the host side (``step.Pending``: its step, LR, re-run)."""
    verdict: Verdict
    next_step: int
    """The step the run would take next (a stretch of the LR starts there)."""

    @property
    def step(self) -> int:
        return self.pending.step

    @property
    def onset(self) -> int:
        v = self.verdict
        return v.onset_step if v.onset_step is not None else self.pending.step


@dataclass
class Reply:
    """What a response did and asks for (module docstring)."""

    action: Action
    record: dict[str, Any] = field(default_factory=dict)
    """This response's keys in the step's record (``summary``, ``rollback_to``, ...)."""
    lr: Stretch | None = None
    """Multiply the LR over a range of steps (``Updater.lr``)."""
    precision: str | None = None
    """Train on with this precision kind (a reconfigured resume)."""
    halt: HaltReport | None = None
    """Halt: the guard writes the record (with ``metrics``), then raises TrainingHalted."""
    metrics: StepMetrics | None = None
    """The record's numbers for a halt (the verdict's evidence)."""


@runtime_checkable
class Response(Protocol):
    """One response (module docstring)."""

    action: Action
    """What it does to the step when it acts (ALERT, ROLLBACK, HALT): what ``Policy.intended``
    reports for a tier whose own response it is, under ``respond=False``."""

    def respond(self, incident: Incident, control: Any) -> Reply | None:
        """Act on ``incident`` through ``control`` (``control.RunControl``); None: not mine."""
        ...


class ResponseConfig:
    """Base of a ``GuardConfig`` field that switches a response on (a frozen dataclass)."""

    tiers: tuple[int, ...] = (2,)
    """The tiers whose verdicts it answers (after the tier's own response)."""

    @property
    def enabled(self) -> bool:
        raise NotImplementedError

    def build(self) -> Response:
        raise NotImplementedError
