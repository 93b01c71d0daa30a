"""``GuardedOptimizer``: an optimizer whose ``step()`` is the guard's, for frameworks that only
call ``optimizer.step()`` (HF Trainer, Lightning)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .forensics import TrainingHalted

__all__ = ["GuardedOptimizer"]


class GuardedOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step()`` is ``guard.step()``: for frameworks that only call
    ``optimizer.step()`` (HF Trainer, Lightning). The loss reaches the guard through
    ``guard.accumulate(out)`` in the loss function; everything else is the wrapped optimizer's.

    ``defer_halt=True`` (what the framework integrations use): a halt does not raise out of
    ``step()``, whose caller is the framework's loop; it is kept in ``halted`` for a callback to
    stop the run the framework's way and raise it afterwards. A ``step()`` after a halt raises
    it: nothing trains past a halt."""

    def __init__(self, optimizer: torch.optim.Optimizer, guard: Any, *,
                 defer_halt: bool = False) -> None:
        # no Optimizer.__init__: the wrapped optimizer owns param_groups and state
        if getattr(guard, "optimizer", None) is not optimizer:
            raise ValueError(f"GuardedOptimizer(optimizer, guard): guard must be the Guard built "
                             f"with this optimizer (got a {type(guard).__name__} whose optimizer "
                             "is another); pass Guard(model, optimizer) and the same optimizer")
        self.optimizer, self.guard = optimizer, guard
        self.defaults = optimizer.defaults
        self.defer_halt = defer_halt
        self.halted: TrainingHalted | None = None
        """The halt that a deferred ``step()`` kept (None while the run is healthy)."""
        self.rerun: Callable[[], Any] | None = None
        """Re-runs the step's last forward and backward for the Tier 3 forensics
        (``guard.step(rerun=...)``); an integration that can replay the batch sets it. When
        unset, a ``step(closure)`` re-runs the closure (Lightning's: training_step + backward)."""
        self.reference = False
        """True when each micro-batch reached ``guard.accumulate`` with a closure that holds its
        own batch (HF Trainer's SpikeguardLoss): the step's re-run may then serve a later step's
        weights check; a closure that re-runs whatever batch is current may not."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if self.halted is not None:
            raise self.halted
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            # the closure re-runs the framework's current batch: no reference for a later step
            self.guard.step(rerun=self.rerun if self.rerun is not None else closure,
                            reference=self.reference)
        except TrainingHalted as halt:
            if not self.defer_halt:
                raise
            self.halted = halt
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"GuardedOptimizer({self.optimizer!r})"
