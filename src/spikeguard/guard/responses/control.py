"""What a response acts through: the checkpoints, the batch ledger, the Tier 2 summary and the
rollback budget. ``RunControl`` owns the budget (``rollbacks`` against ``max_rollbacks``) and
the last replay; both are outside the timeline a rollback restores (``state_dict``).

A checkpoint's health is judged against the onset of the trouble at hand. One saved with an
alert in its window (``healthy`` false) is still a rollback target for an onset at ``o`` when
that earlier anomaly healed: every step from its last alert ``a`` to ``o - 1`` was seen in this
process, none of them was flagged (each passed every rule, the loss rules' bars against the run's
own running median and spread included), and there are at least ``heal_steps`` of them (10:
the detector's own count of steps that make a persistent loss rise a Tier 2). The steps after
the checkpoint count too: the state it holds trained on without a flag up to the onset. A
checkpoint whose anomaly did not heal before the onset is truly damaged, and the next older kept
one is tried; with none left the response alerts and goes on, and the summary says "no
checkpoint precedes the onset".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..summary import tier2_summary

__all__ = ["RunControl"]


class RunControl:
    """The tools of the responses (module docstring); built by the Guard with its parts."""

    def __init__(self, *, max_rollbacks: int, checkpoints: Any, ledger: Any, history: Any,
                 attribution: Any, model: Any, named_params: list, optimizer: Any,
                 on_alert: Callable[[dict[str, Any]], None] | None = None,
                 keep_on_rollback: Mapping[str, Any] | None = None, heal_steps: int = 10,
                 probes: Any = None) -> None:
        self.max_rollbacks = max_rollbacks
        self.checkpoints, self.ledger, self.history = checkpoints, ledger, history
        self.attribution, self.on_alert = attribution, on_alert
        self.model, self.named_params, self.optimizer = model, named_params, optimizer
        self.keep_on_rollback = dict(keep_on_rollback or {})
        self.rollbacks = 0
        """Rollbacks and reconfigured resumes so far."""
        self.replay: tuple[int, int, float, float] | None = None
        """(restored step, detection step, LR scale, LR kept after the replay) of the last
        rollback (``responses/rollback.py``)."""
        self._summary: tuple[int, dict[str, Any]] | None = None
        self.heal_steps = heal_steps
        self.probes = probes
        self.qk_clip: float | None = None
        """The QK-Clip threshold a rollback turned on (GuardConfig.rollback_qk_clip), or None."""
        self.flagged: list[int] = []
        """Steps with a Tier 1 or higher verdict seen in this process, in order."""
        self.seen_from: int | None = None
        """The first step this process saw (flags before it are unknown)."""

    def saw(self, step: int, flagged: bool) -> None:
        """Step ``step`` was judged (the guard's record stage); ``flagged``: tier 1 or higher."""
        if self.seen_from is None:
            self.seen_from = step
        while self.flagged and self.flagged[-1] >= step:  # a replay after a rollback
            self.flagged.pop()
        if flagged:
            self.flagged.append(step)

    def healed(self, checkpoint: Any, onset: int) -> bool:
        """Whether the anomalies in ``checkpoint``'s window healed before ``onset`` (module
        docstring): judged from the steps this process saw."""
        steps = []
        for alert in checkpoint.alerts:
            head = str(alert).split(":", 1)[0].strip()
            if not head.isdigit():
                return False
            steps.append(int(head))
        if not steps or self.seen_from is None:
            return False
        last = max(steps)
        if last < self.seen_from or onset - 1 - last < self.heal_steps:
            return False
        return not any(last < s < onset for s in self.flagged)

    @property
    def budget_left(self) -> bool:
        return self.rollbacks < self.max_rollbacks

    def summary(self, incident: Any) -> dict[str, Any]:
        """The Tier 2 summary of ``incident`` (built once per step, whoever asks first)."""
        if self._summary is not None and self._summary[0] == incident.step:
            return self._summary[1]
        onset, step = incident.onset, incident.step
        summary = tier2_summary(self.history, step=step, reasons=incident.verdict.reasons,
                                onset=onset, data_range=self.ledger.data_range(onset, step),
                                rollback_to=self.rollback_target(onset))
        summary["skips"] = self.attribution.summary(onset, step)  # by cause: data or transient
        self._summary = (step, summary)
        return summary

    def _sound(self, onset: int) -> list[int]:
        """The steps of the checkpoints sound for ``onset``: healthy, or healed before it."""
        if self.checkpoints is None:
            return []
        return [c.step for c in self.checkpoints.list() if c.healthy or self.healed(c, onset)]

    def rollback_target(self, onset: int) -> int | None:
        """The newest sound checkpoint (healthy, or its anomaly healed before ``onset``) that
        predates the update before the onset (the one rule, ``checkpoint.info.rollback_target``)."""
        from ...checkpoint.info import rollback_target

        return rollback_target(onset, self._sound(onset))

    def restore_before(self, onset: int) -> Any:
        """Restore the rollback target of ``onset`` (CheckpointError when there is none); the
        states in ``keep_on_rollback`` keep their present state. Returns its CheckpointInfo."""
        from ...checkpoint.info import CheckpointError

        target = self.rollback_target(onset)
        if target is None:
            raise CheckpointError(f"no checkpoint precedes the onset: none sound at or before "
                                  f"step {onset - 2} (the update before the onset at {onset} "
                                  "may be the cause)")
        return self.restore(target, also=self._sound(onset))

    def restore(self, step: int, *, also: Iterable[int] = ()) -> Any:
        """Restore the newest healthy checkpoint at or before ``step`` (CheckpointError when
        there is none), the checkpoints at the steps ``also`` counting as healthy (an alert in
        their window that healed); the states in ``keep_on_rollback`` keep their present state."""
        # state that lives outside the run's timeline (a fault injector: the world does not rewind)
        kept = {k: obj.state_dict() for k, obj in self.keep_on_rollback.items()}
        info = self.checkpoints.restore(at_or_before=step, also=also)
        for k, state in kept.items():
            self.keep_on_rollback[k].load_state_dict(state)
        return info

    def state_dict(self) -> dict[str, Any]:
        return {"rollbacks": self.rollbacks, "replay": self.replay, "qk_clip": self.qk_clip}

    def qk_clip_on(self, tau: float) -> str | None:
        """Turn QK-Clip on at ``tau`` in the guard's signals (after every applied update from now
        on); returns why it could not be (no signals, no attention layout found), else None."""
        signals = getattr(self.probes, "signals", None)
        if signals is None or not signals._hooks or not signals.blocks:
            return ("QK-Clip needs the guard's signals (probes on, GuardConfig.signals) and an "
                    "attention layout they can find")
        signals.config = dataclasses.replace(signals.config, qk_clip=tau)
        self.qk_clip = tau
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a rollback restores an older state: the budget already spent stays spent, the last
        # replay and a QK-Clip a rollback turned on are outside the timeline a rollback restores
        if self.qk_clip is None and state.get("qk_clip") is not None:  # a resume
            self.qk_clip_on(float(state["qk_clip"]))
        self.rollbacks = max(self.rollbacks, int(state["rollbacks"]))
        if self.replay is None and state.get("replay"):
            r = state["replay"]  # saved before the kept LR existed: 3 entries, the LR back to 1
            self.replay = (int(r[0]), int(r[1]), float(r[2]), float(r[3]) if len(r) > 3 else 1.0)
