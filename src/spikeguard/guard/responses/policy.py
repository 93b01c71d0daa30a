"""Which responses a verdict's tier gets: the detector says the tier and the reasons, the policy
says what is done about them (the detector's Tier 2 verdict is an ALERT whatever the policy).

Tier 2: ``GuardConfig.tier2``'s response (``alert``, the default, ``rollback`` or ``ask``), then every
response switched on by a ``ResponseConfig`` field of the GuardConfig for tier 2 (``lower_lr``).
Tier 3: the halt (with the reconfigure hook), then those for tier 3. The first Reply that is not
an alert (a rollback, a halt) ends the chain: the run it leaves is not the one the others were
asked about. ``respond`` returns the replies in order; the first one's action is the step's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from ...detector.detector import Verdict
from ...record import Action
from ..forensics import HaltReport
from .alert import Alert
from .ask import Ask
from .base import Incident, Reply, Response, ResponseConfig
from .halt import Halt
from .rollback import Rollback

__all__ = ["Policy"]


class Policy:
    """The responses of each tier (module docstring), built from a GuardConfig."""

    def __init__(self, config: Any, *,
                 reconfigure: Callable[[HaltReport], Mapping[str, Any] | None] | None = None
                 ) -> None:
        halt = Halt(reconfigure)
        first: Response = (
            Rollback(config.rollback_lr_scale, halt, keep=config.rollback_lr_keep,
                     qk_clip=config.detector.qk_advice_bound if config.rollback_qk_clip
                     else None)
            if config.tier2 == "rollback" else Ask() if config.tier2 == "ask" else Alert())
        self.tiers: dict[int, list[Response]] = {2: [first], 3: [halt]}
        for f in fields(config):
            value = getattr(config, f.name)
            if isinstance(value, ResponseConfig) and value.enabled:
                for tier in value.tiers:
                    self.tiers[tier].append(value.build())

    def intended(self, verdict: Verdict) -> Action:
        """What the tier's own response does to ``verdict`` (``would_do`` under
        ``respond=False``: ROLLBACK for Tier 2 under ``tier2="rollback"``, HALT for Tier 3);
        below Tier 2, the verdict's own action."""
        responses = self.tiers.get(verdict.tier)
        return responses[0].action if responses else verdict.action

    def respond(self, incident: Incident, control: Any) -> tuple[Reply, ...]:
        """The replies to a verdict of tier 2 or 3, in order (module docstring)."""
        replies: list[Reply] = []
        for response in self.tiers.get(incident.verdict.tier, ()):
            reply = response.respond(incident, control)
            if reply is None:
                continue
            replies.append(reply)
            if reply.action is not Action.ALERT:
                break
        return tuple(replies)
