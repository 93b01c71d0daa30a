"""What a response acts through: the checkpoints, the batch ledger, the Tier 2 summary and the
rollback budget. ``RunControl`` owns the budget (``rollbacks`` against ``max_rollbacks``) and
the last replay; both are outside the timeline a rollback restores (``state_dict``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..summary import tier2_summary

__all__ = ["RunControl"]


class RunControl:
    """The tools of the responses (module docstring); built by the Guard with its parts."""

    def __init__(self, *, max_rollbacks: int, checkpoints: Any, ledger: Any, history: Any,
                 attribution: Any, model: Any, named_params: list, optimizer: Any,
                 on_alert: Callable[[dict[str, Any]], None] | None = None,
                 keep_on_rollback: Mapping[str, Any] | None = None) -> None:
        self.max_rollbacks = max_rollbacks
        self.checkpoints, self.ledger, self.history = checkpoints, ledger, history
        self.attribution, self.on_alert = attribution, on_alert
        self.model, self.named_params, self.optimizer = model, named_params, optimizer
        self.keep_on_rollback = dict(keep_on_rollback or {})
        self.rollbacks = 0
        """Rollbacks and reconfigured resumes so far."""
        self.replay: tuple[int, int, float] | None = None
        """(restored step, detection step, LR scale) of the last rollback."""
        self._summary: tuple[int, dict[str, Any]] | None = None

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

    def rollback_target(self, onset: int) -> int | None:
        """The newest healthy checkpoint that predates the update before the onset (the one
        rule, ``checkpoint.info.rollback_target``, applied to the healthy checkpoints)."""
        if self.checkpoints is None:
            return None
        from ...checkpoint.info import rollback_target

        return rollback_target(onset, [c.step for c in self.checkpoints.list() if c.healthy])

    def restore_before(self, onset: int) -> Any:
        """Restore the rollback target of ``onset`` (CheckpointError when there is none); the
        states in ``keep_on_rollback`` keep their present state. Returns its CheckpointInfo."""
        from ...checkpoint.info import CheckpointError

        target = self.rollback_target(onset)
        if target is None:
            raise CheckpointError(f"no healthy checkpoint at or before step {onset - 2} "
                                  f"(the update before the onset at {onset} may be the cause)")
        return self.restore(target)

    def restore(self, step: int) -> Any:
        """Restore the newest healthy checkpoint at or before ``step`` (CheckpointError when
        there is none); the states in ``keep_on_rollback`` keep their present state."""
        # state that lives outside the run's timeline (a fault injector: the world does not rewind)
        kept = {k: obj.state_dict() for k, obj in self.keep_on_rollback.items()}
        info = self.checkpoints.restore(at_or_before=step)
        for k, state in kept.items():
            self.keep_on_rollback[k].load_state_dict(state)
        return info

    def state_dict(self) -> dict[str, Any]:
        return {"rollbacks": self.rollbacks, "replay": self.replay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a rollback restores an older state: the budget already spent stays spent, and the last
        # replay is outside the timeline a rollback restores
        self.rollbacks = max(self.rollbacks, int(state["rollbacks"]))
        if self.replay is None and state.get("replay"):
            self.replay = tuple(state["replay"])
