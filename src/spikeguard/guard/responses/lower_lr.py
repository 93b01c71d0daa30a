"""Lower the LR for N steps on a Tier 2 verdict, then return to the schedule (off by default).

A Tier 2 verdict says the run did not recover by itself; the default alert pages and changes
nothing. With ``GuardConfig(lower_lr=LowerLrConfig(steps=N))`` the guard also multiplies the
scheduled LR by ``lr_multiple`` for the N steps after the verdict (the schedule itself runs on
untouched), through the step part's one LR multiplier (``lr_scale.py``), and the record says so
under ``lr_lowered``. A new verdict inside the stretch starts a new one, its multiplier on top.
This file and the ``GuardConfig.lower_lr`` field are the whole response: docs/design.md, "How to
add a response".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..._validate import check_int, check_positive
from ...record import Action
from ..lr_scale import Stretch
from .base import Incident, Reply, ResponseConfig

__all__ = ["LowerLr", "LowerLrConfig"]


@dataclass(kw_only=True, frozen=True)
class LowerLrConfig(ResponseConfig):
    """On a Tier 2 verdict, multiply the LR by ``lr_multiple`` for ``steps`` steps (0: off)."""

    steps: int = 0
    """How many steps after a Tier 2 verdict run at the lowered LR; 0 turns the response off."""
    lr_multiple: float = 0.5
    """The lower-LR response's multiple of the scheduled LR for its steps (0 < x <= 1)."""

    def __post_init__(self) -> None:
        check_int(self.steps, "LowerLrConfig.steps", minimum=0, default=0)
        check_positive(self.lr_multiple, "LowerLrConfig.lr_multiple", default=0.5)
        if self.lr_multiple > 1.0:
            raise ValueError(f"LowerLrConfig.lr_multiple={self.lr_multiple} must be <= 1: the "
                             "response lowers the LR (0.5 halves it)")

    @property
    def enabled(self) -> bool:
        return self.steps > 0

    def build(self) -> LowerLr:
        return LowerLr(self)


class LowerLr:
    """The response (module docstring)."""

    action = Action.ALERT
    """What it does to the step when it acts: an alert (the LR request rides beside it)."""

    def __init__(self, config: LowerLrConfig) -> None:
        self.config = config

    def respond(self, incident: Incident, control: Any) -> Reply:
        c, first = self.config, incident.next_step
        last = first + c.steps - 1
        return Reply(Action.ALERT, record={"lr_lowered": {"lr_multiple": c.lr_multiple,
                                                          "first": first, "last": last}},
                     lr=Stretch(first=first, last=last, scale=c.lr_multiple, kind="lower_lr"))
