"""The guard's checkpointed state for any checkpointer, and the reader of older versions.

The guard's state is its parts' ``state_dict``s by name (``Guard.state_dict``) and its step
number. ``GuardState`` is that state as a ``torch.distributed.checkpoint`` Stateful for a
checkpointer other than the guard's own; ``upgrade`` reads a state of version 2 (the guard
before its parts owned their state), so a checkpoint written then still restores.
"""

from __future__ import annotations

import json
from typing import Any

from .lr_scale import stretches_v2

__all__ = ["STATE_VERSION", "GuardState", "upgrade"]

STATE_VERSION = 3


def upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A guard state of this version as it is; one of version 2 (the guard before its parts
    owned their state: counters and the replay's LR ramp at the top) by part names."""
    version = state.get("version")
    if version == STATE_VERSION:
        return state
    if version != 2:
        raise ValueError(f"guard state version {version!r} is not {STATE_VERSION} (or 2); it was "
                         "saved by another spikeguard version")
    return {"version": STATE_VERSION, "step_index": state["step_index"],
            "detector": state["detector"], "gate": state["gate"], "history": state["history"],
            "ledger": state["batches"], "attribution": state.get("attribution"),
            "updater": {"applied": state["applied"], "withheld": state.get("withheld", 0),
                        "lr": stretches_v2(state.get("lr_ramp")), "clip": state.get("clip"),
                        "update_bound": state.get("update_bound")},
            "responses": {"rollbacks": state["rollbacks"], "replay": state.get("replay")},
            "recorder": {"records": state["records"]}}


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
