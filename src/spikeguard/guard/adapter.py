"""The guard's face to a framework that owns the loop (docs/adapters.md): the data protocol,
the decision a decide-only step returns, the guard's state for any checkpointer, the warning
category of silent misuse.

- ``DataSource`` / ``RowDropSource``: what ``Guard(data=...)`` must provide, as the guard uses
  it (``guard/ledger.py``); ``check_data`` refuses an object that lacks a member, naming it.
- ``Decision``: what ``guard.decide()`` returns to a framework that steps the optimizer itself.
- ``GuardState`` (``guard/stateful.py``): the guard's state as a ``torch.distributed.checkpoint``
  Stateful, for any checkpointer.
- ``GuardMisuseWarning``: the category of every warning about a loop that uses the guard in a
  way that silently defeats it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..detector.detector import Verdict
from ..record import Action

__all__ = ["DataSource", "Decision", "GuardMisuseWarning", "RowDropSource", "check_data",
           "check_decide"]


class GuardMisuseWarning(UserWarning):
    """The guard is used in a way that silently defeats it (a loss already scaled by a foreign
    GradScaler, a rollback that cannot leave data out, a loop that ignores ``step_index``, an
    LR it cannot read, a micro-batch loss of the wrong reduction). The message says the fix."""


@runtime_checkable
class DataSource(Protocol):
    """What ``Guard(data=...)`` must provide (a ``TokenStream`` and its ``loader()`` do).

    The guard reads ``position`` at every step to know which batches the step consumed; a Tier 2
    rollback calls ``skip(start, stop)`` for the batches of the anomaly; the checkpoint manager
    saves ``state_dict()`` and restores it with ``load_state_dict``. Optional: ``skip_ranges``
    (the ranges skipped so far, so a rollback never skips one twice) and ``rows_of(index)``
    (the full-batch row numbers batch ``index`` yields after drops).
    """

    @property
    def position(self) -> int:
        """Index of the next batch the loop will take (batches counted from 0, skips included)."""
        ...

    def skip(self, start: int, stop: int) -> None:
        """Never yield the batches ``start`` to ``stop`` (inclusive) from now on."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The position and skips (and whatever else makes the order reproducible)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``: the next batch is the one at the saved position."""
        ...


@runtime_checkable
class RowDropSource(DataSource, Protocol):
    """A DataSource that can also leave single rows of a batch out (``TokenStream``): a rollback
    whose skips were all data-caused drops only the quarantined rows instead of whole batches."""

    def drop(self, index: int, rows: list[int]) -> None:
        """Leave ``rows`` (full-batch row numbers) out of batch ``index`` whenever it is yielded."""
        ...


_MEMBERS = {"position": "an int property, the index of the next batch",
            "skip": "skip(start, stop), leaving out batches start..stop inclusive",
            "state_dict": "state_dict(), its position and skips",
            "load_state_dict": "load_state_dict(state)"}


def check_data(data: Any) -> None:
    """``data`` is None or a DataSource: a TypeError naming every missing member otherwise."""
    if data is None:
        return
    missing = [f"{name} ({what})" for name, what in _MEMBERS.items()
               if (not isinstance(getattr(data, name, None), int) if name == "position"
                   else not callable(getattr(data, name, None)))]
    if missing:
        raise TypeError(f"Guard(data=...): a {type(data).__name__} lacks {'; '.join(missing)}. "
                        "The guard reads data.position each step and a rollback calls "
                        "data.skip; pass a TokenStream (or its loader()), wrap your loader in "
                        "an object with those members (spikeguard.guard.DataSource), or pass "
                        "data=None (then no rollback can leave the bad batches out)")


@dataclass(frozen=True)
class Decision:
    """What ``guard.decide()`` returns: whether the framework should apply this step's update.

    With ``apply`` the framework calls its ``optimizer.step()`` on the gradients in place (the
    guard measured and clipped them) and steps its LR scheduler; without it, neither: the
    step's update is withheld and the schedule holds, as the guard's own step would. The
    framework zeroes the gradients before the next backward, as it does anyway.
    """

    apply: bool
    """Step the optimizer (and the LR scheduler) now; False: skip both."""
    step: int
    """The guard's number of the step decided (its ``step_index`` before the call)."""
    action: Action
    """What the guard did: continue, alert, skip, drop, rollback (the guard restored its
    checkpoint: do not step), halt is raised as TrainingHalted instead."""
    verdict: Verdict
    lr_factor: float = 1.0
    """The multiple of the scheduled LR this update should use (below 1 while a replay after the
    guard's own rollback ramps back up; 1 otherwise)."""

    @property
    def skip(self) -> bool:
        return not self.apply


def check_decide(read_lag: int, scaler: Any, scheduler: Any, checkpoints: Any,
                 bound: Any = None) -> None:
    """``guard.decide()``'s preconditions: a ValueError naming the one that fails."""
    if bound is not None and bound.active:
        raise ValueError("guard.decide() with ClipConfig(update_bound=...): the framework "
                         "steps its optimizer after the decision, so the guard never sees the "
                         "update it would bound; set update_bound=0 (the default) with "
                         "decide(), or train through guard.step()")
    if read_lag != 0 or scaler is not None or scheduler is not None:
        raise ValueError("guard.decide() needs GuardConfig(read_lag=0), no fp16 loss scaler "
                         "and Guard(scheduler=None): the framework steps its optimizer and "
                         "scheduler after the decision, so the guard must decide at once")
    from ..checkpoint.manager import CheckpointManager
    if isinstance(checkpoints, CheckpointManager):
        raise ValueError("guard.decide() with Guard(checkpoints=CheckpointManager(...)): the "
                         "guard would save inside decide(), before the framework applies the "
                         "update, so checkpoint s would hold the state after update s-1. Let the "
                         "framework checkpoint, with guard.stateful() among its states (or give "
                         "the guard a manager that writes after the framework's optimizer step, "
                         "as spikeguard.integrations.torchtitan does)")
