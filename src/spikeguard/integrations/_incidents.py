"""The rollbacks of one run, for the recurring-fault rule both framework integrations apply.

A rollback leaves the anomaly's data out and replays from a healthy checkpoint. When a Tier 2
comes back before the replay is back where the last one was detected, the new data did not
help: the fault is not in the data (a learning rate, the weights, an optimizer state, a
machine). When the next rollback would replay at a lower LR kept for good (``lowers_lr``: the
defaults), the integrations roll back again, as the guard's own rollback does, until the
budget (``max_rollbacks``) is spent: a run unstable at its LR is what that cures. Otherwise
another rollback would spend the budget on the same failure, and they halt with that reason
instead (``recurring``).

"Back where it was": the replay has trained as many updates past the restored checkpoint as the
run had when it detected the anomaly. Where the framework numbers its steps by batch (OLMo-core:
the skipped steps keep their numbers) that is step ``detection + skipped``; where the guard
numbers them by update (torchtitan under the guard's own rollback) it is ``detection``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Incident", "lowers_lr", "recurring", "recurring_report"]


@dataclass(frozen=True)
class Incident:
    """One Tier 2 that was rolled back (or relaunched)."""

    onset: int
    """The step the anomaly began (the Tier 2 summary's ``onset_step``)."""
    detection: int
    """The step the Tier 2 was raised."""
    restored: int
    """The step of the checkpoint the run went back to."""
    skipped: int = 0
    """Steps left out that keep their numbers (OLMo-core's ``steps_to_skip``); 0 where the
    replay numbers only the updates it makes."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Incident:
        return cls(onset=int(d["onset"]), detection=int(d["detection"]),
                   restored=int(d["restored"]), skipped=int(d.get("skipped", 0)))


def recurring(incidents: list[Incident], onset: int) -> Incident | None:
    """The last incident, when a Tier 2 whose anomaly began at ``onset`` came back during its
    replay (after its restored checkpoint, before the replay was back where it was detected);
    else None."""
    if not incidents:
        return None
    last = incidents[-1]
    return last if last.restored < onset <= last.detection + last.skipped else None


def lowers_lr(keep: bool, lr_scale: float) -> bool:
    """Whether a rollback after a fault that came back replays at a lower LR kept for good
    (``GuardConfig.rollback_lr_keep`` with a ``rollback_lr_scale`` below 1): the cure for a run
    unstable at its LR, which other data alone cannot give. Then a recurring fault is rolled
    back again (within ``max_rollbacks``) instead of halting the run."""
    return keep and lr_scale < 1.0


def recurring_report(step: int, onset: int, last: Incident, reasons: Any, *,
                     numbering: str = "", summary: dict[str, Any] | None = None) -> Any:
    """The HaltReport of a recurring fault: what came back, where, and why it is not the data."""
    from ..guard import HaltReport

    detail = (f"the fault came back on replay: a Tier 2 from step {onset}{numbering} after the "
              f"rollback to step {last.restored} that left out the data of steps "
              f"{last.onset}-{last.detection}, before the replay was back where that one was "
              "detected. Other data gave the same failure, so it is not the data (look at the "
              "learning rate, the weights and optimizer state, the machine); halting instead of "
              "spending the rollback budget on it")
    return HaltReport(step=step, reasons=tuple(reasons) or ("recurring fault",),
                      summary=summary, detail=detail)
