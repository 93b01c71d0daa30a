"""The Tier 2 rollback (``GuardConfig(tier2="rollback")``): restore the newest healthy checkpoint
before the onset, leave the anomaly's batches out (or only their quarantined rows), and replay
at a reduced LR ramping back to 1 by the detection step; within a budget, past which it halts.
A rollback to a step inside the stretch the last one replayed, or as many steps past its end as
that replay was long, means the same trouble came back once the LR was back. It replays at
``rollback_lr_scale`` times the last replay's start (0.25x), and with
``GuardConfig.rollback_lr_keep`` (the default) it keeps that LR for good instead of ramping back
(0.25x, then 0.125x: a run unstable at its LR is not saved by replaying it at that LR, which
OPT-175B's logbook also found, Zhang et al. 2022, section 2.5); the record and the summary table
say so.
With nothing sound to go back to (``control.py``: healthy, or its anomaly healed before the
onset) it alerts, training goes on (a halt would lose the run), and the record and the summary
say that no checkpoint precedes the onset. An incident whose update was withheld before it was
applied (its LR jumped: ``guard/lr_jump.py``) left the weights as they were: it pages, and
nothing is rolled back (unless the jump follows updates at a risen LR that did reach them).
With ``GuardConfig.rollback_qk_clip`` (the default), a rollback whose page names the attention
logits (``guard/remedies.py``) also turns QK-Clip on for the replay and after: the weights it
goes back to already hold the grown query and key weights, and a lower LR does not shrink them.
"""

from __future__ import annotations

import logging
from typing import Any

from ...record import Action
from ..lr_scale import Stretch, replay_scale
from ..remedies import ATTENTION
from .alert import page, remedy_lines
from .base import Incident, Reply
from .halt import Halt

__all__ = ["Rollback"]

log = logging.getLogger("spikeguard")


class Rollback:
    """The rollback response (module docstring); ``lr_scale`` is the replay's starting LR
    multiple (``GuardConfig.rollback_lr_scale``); ``halt`` answers once the budget is spent;
    ``keep``: ``GuardConfig.rollback_lr_keep``."""

    action = Action.ROLLBACK
    """What it does to the step when it acts (``Policy.intended``)."""

    def __init__(self, lr_scale: float, halt: Halt, *, keep: bool,
                 qk_clip: float | None = None) -> None:
        self.lr_scale, self.halt, self.keep = lr_scale, halt, keep
        self.qk_clip = qk_clip
        """GuardConfig.rollback_qk_clip: the threshold to turn QK-Clip on at when the page names
        the attention logits (None: never)."""

    def respond(self, incident: Incident, control: Any) -> Reply:
        from ...checkpoint.info import CheckpointError

        summary = control.summary(incident)
        if not control.budget_left:
            return self.halt.halt(incident, control, summary=summary,
                                  detail=f"rollback budget of {control.max_rollbacks} exhausted")
        pending = incident.pending
        if getattr(pending, "lr_jump", None) is not None and pending.lr_onset is None:
            why = "the update was withheld before it was applied (its LR jumped): the weights " \
                  "are as they were"
            # the page says what was done, not the checkpoint a rollback would have taken
            summary["rollback"] = f"not needed: {why}"
            page(incident, control, summary)
            return Reply(Action.ALERT, record={"summary": summary, "rollback_not_needed": why})
        onset, step, ledger = incident.onset, incident.step, control.ledger
        skip = ledger.data_range(onset, step)
        # before the restore, which takes the attribution history back to the checkpoint
        drops = control.attribution.range_drops(onset, step) if ledger.can_drop else None
        try:
            info = control.restore_before(onset)
        except CheckpointError as e:
            log.warning("spikeguard: Tier 2 at step %d: cannot roll back (%s); alerting and "
                        "going on", step, e)
            if summary["rollback_checkpoint"] is not None:  # it was found, but not restored
                summary["rollback"] = f"failed ({e}); training goes on"
            page(incident, control, summary)
            return Reply(Action.ALERT, record={"summary": summary, "rollback_failed": str(e)})
        control.rollbacks += 1
        ledger.reapply()  # earlier rollbacks' ranges and drops hold across this restore
        record: dict[str, Any] = {"summary": summary}
        if drops is not None:  # only the quarantined sequences of the range, not the range
            ledger.drop(drops)
            skip = None
            record["dropped_sequences"] = {str(i): r for i, r in drops.items()}
        if skip is not None and ledger.can_skip:
            ledger.skip(*skip)
        ledger.resync()
        scale, kept = self._replay_scale(control, info.step, step)
        record.update(rollback_to=info.step, skip_range=list(skip) if skip else None,
                      rollbacks=control.rollbacks, replay_lr_scale=scale)
        if kept != 1.0:
            record["lr_kept"] = kept
        self._remedy(control, summary, record)
        log.warning("spikeguard: Tier 2 at step %d: rolled back to step %d, skipping batches "
                    "%s%s", step, info.step, skip, remedy_lines(summary))
        return Reply(Action.ROLLBACK, record=record,
                     lr=Stretch(first=info.step + 1, last=step, scale=scale, ramp=True,
                                kind="replay", settle=kept))

    def _remedy(self, control: Any, summary: dict[str, Any], record: dict[str, Any]) -> None:
        """GuardConfig.rollback_qk_clip: turn QK-Clip on when the page names the attention
        logits and it is not on yet (the record's ``qk_clip``: the threshold, or why not)."""
        if self.qk_clip is None or control.qk_clip is not None or not any(
                r.startswith(ATTENTION) for r in summary.get("remedies") or ()):
            return
        why = control.qk_clip_on(self.qk_clip)
        record["qk_clip"] = self.qk_clip if why is None else f"not turned on: {why}"
        log.warning("spikeguard: QK-Clip %s", f"on at {self.qk_clip:g} from the replay on"
                    if why is None else record["qk_clip"])

    def _replay_scale(self, control: Any, restored: int, detection: int) -> tuple[float, float]:
        """(the LR scale this replay starts at, the LR multiple it settles at for good):
        ``lr_scale.replay_scale``; remembered for the next rollback."""
        scale, kept = replay_scale(self.lr_scale, self.keep, control.replay, restored)
        control.replay = (restored, detection, scale, kept)
        return scale, kept
