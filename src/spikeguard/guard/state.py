"""The guard's checkpointed state: every part's ``state_dict`` in one JSON-ready dict.

``PartsState`` is built with the parts that have state (the detector, the step part and its
device gate, the Tier 2 history, the batch ledger, attribution, the responder, the recorder)
and gathers or restores them; the Guard adds its step number. ``GuardState`` is that state as a
``torch.distributed.checkpoint`` Stateful for a checkpointer other than the guard's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["STATE_VERSION", "GuardState", "PartsState"]

STATE_VERSION = 2


@dataclass
class PartsState:
    """The parts whose state a checkpoint of the guard carries (module docstring)."""

    detector: Any
    updater: Any
    history: Any
    ledger: Any
    attribution: Any
    responder: Any
    recorder: Any
    probes: Any

    def continue_at(self, step: int, *, records: int | None = None,
                    at_step: bool = False) -> None:
        """The guard continues at ``step`` after a restore or a framework's resume: the data is
        measured from where it stands, the probes count from ``step``; the metrics file keeps
        its first ``records`` records, or (``at_step``) those before the first of step ``step``
        or later (no step written twice). ``records=None`` without ``at_step`` keeps them all
        (a rollback: the records stay in run order)."""
        self.ledger.resync()
        if self.probes is not None:
            self.probes.start_step(step)
        sinks = self.recorder.sinks
        if sinks is not None and at_step:
            sinks.resume_at_step(step)
        elif sinks is not None and records is not None:
            sinks.resume(records)

    def state_dict(self, step_index: int) -> dict[str, Any]:
        """JSON-ready: detector, device statistics, counters, recent batch ranges (syncs)."""
        return {"version": STATE_VERSION, "step_index": step_index,
                "applied": self.updater.applied, "withheld": self.updater.withheld,
                "rollbacks": self.responder.rollbacks,
                "records": self.recorder.records, "detector": self.detector.state_dict(),
                "gate": self.updater.gate.state_dict(), "history": self.history.state_dict(),
                "batches": self.ledger.state_dict(), "attribution": self.attribution.state_dict(),
                "lr_ramp": self.updater.lr_ramp, "replay": self.responder.replay,
                "clip": self.updater.state_dict(),
                "update_bound": self.updater.bound.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Restore every part; returns the step number the state was saved at."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"guard state version {state.get('version')!r} is not "
                             f"{STATE_VERSION}; it was saved by another spikeguard version")
        self.detector.load_state_dict(state["detector"])
        self.updater.gate.load_state_dict(state["gate"])
        self.history.load_state_dict(state["history"])
        self.attribution.load_state_dict(state.get("attribution"))
        self.updater.applied = int(state["applied"])
        self.updater.withheld = int(state.get("withheld", 0))  # older states lack it
        self.recorder.records = int(state["records"])
        # a rollback restores an older state: the budget already spent stays spent
        self.responder.rollbacks = max(self.responder.rollbacks, int(state["rollbacks"]))
        self.ledger.load_state_dict(state["batches"])
        self.updater.load_state(state)  # the replay's LR ramp, the clipping rule's statistics
        # like the budget, the last replay is outside the timeline a rollback restores
        if self.responder.replay is None and state.get("replay"):
            self.responder.replay = tuple(state["replay"])
        return int(state["step_index"])


class GuardState:
    """The guard's state (detector windows, device statistics, counters, recent batch ranges)
    as a ``torch.distributed.checkpoint`` Stateful: ``state_dict()`` is ``{"json": str}``, one
    Python object that DCP, torchtitan's and OLMo-core's checkpointers save as it is.

    ``load_state_dict`` restores the guard; when the guard has not stepped yet in this process
    (a resume) the metrics file also continues after the restored records, so no step is
    written twice; after steps (a rollback through the framework's checkpointer) the records
    stay, in run order, as after the guard's own rollback. Get one from ``guard.stateful()``.
    """

    def __init__(self, guard: Any) -> None:
        if not callable(getattr(guard, "state_dict", None)) or not hasattr(guard, "resumed"):
            raise TypeError(f"GuardState(guard) takes a spikeguard Guard, got "
                            f"{type(guard).__name__}")
        self.guard = guard

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps(self.guard.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        blob = state.get("json") if isinstance(state, dict) else None
        if not isinstance(blob, str):
            raise ValueError("GuardState.load_state_dict needs what GuardState.state_dict gave "
                             f"({{'json': str}}); got {type(state).__name__} "
                             f"{sorted(state) if isinstance(state, dict) else ''}")
        self.guard.load_state_dict(json.loads(blob))
        self.guard.resumed()
