"""The step's micro-batches: their losses, and a re-run of the whole step that means what it says.

``guard.accumulate(out, rerun=...)`` (or ``guard.step(out, rerun=...)`` for the last or only one)
hands over each micro-batch's loss and log Z (detached), its per-sequence values, and the closure
that re-runs its forward and backward. ``guard.autocast()`` notes the RNG state as each forward
starts, so a re-run forks the RNG to that state and dropout draws the same masks.

The step's re-run (attribution's "does the step reproduce?", the weights check's reference, a
halt's forensics) replays *every* micro-batch, each under its own RNG state, running only the
closures' forward and backward. Where that is impossible it is None and the cause of a skip is
``unknown``, never a guess: a step of several micro-batches of which one has no closure (the
gradient of the last alone is not the step's), or dropout active in a forward whose RNG state
was not noted (the masks would differ, and a re-run of a bad batch would look transient).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .adapter import GuardMisuseWarning
from .arguments import check_loss

__all__ = ["MicroBatches", "StepBatch"]


@dataclass
class StepBatch:
    """What ``MicroBatches.take`` gives the step."""

    loss: torch.Tensor
    """Mean loss of the micro-batches (0-d, float32, detached)."""
    log_z: torch.Tensor
    rows: tuple[Any, ...]
    """Each micro-batch's per-sequence values (LossOutput.sequences, or None)."""
    rerun: Callable[..., Any] | None
    """A faithful re-run of the whole step (module docstring), or None."""


def _dropout_active(model: nn.Module) -> bool:
    return model.training and any(
        isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _forked(state: tuple[torch.Tensor, torch.Tensor | None] | None,
            device: torch.device) -> Iterator[None]:
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class MicroBatches:
    """Collects one step's micro-batches (module docstring)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self._items: list[tuple[torch.Tensor, torch.Tensor, Any, Any, Any]] = []
        self._rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.rerunning = False
        """True inside a re-run: its forwards are not new micro-batches."""
        self._warned_reduction = False

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Micro-batch ``i`` so far: (loss, log Z, per-sequence values)."""
        return self._items[i][:3]

    def clear(self) -> None:
        self._items.clear()
        self._rng = None

    def forward_starts(self) -> None:
        """A forward is about to run (``guard.autocast()``): note the RNG state it starts from."""
        if not self.rerunning:
            self._rng = _rng_state(self.device)

    def add(self, out: Any, *, log_z: torch.Tensor | None = None,
            rerun: Callable[..., Any] | None = None) -> torch.Tensor:
        """One micro-batch (after its backward, or before: only detached values are kept):
        ``out`` a LossOutput (its ``ce`` and ``log_z``) or a 0-d loss; ``rerun`` re-runs its
        forward and backward. Returns the differentiable loss (``out.loss``, or ``out``)."""
        seq = getattr(out, "sequences", None)
        if hasattr(out, "ce") and hasattr(out, "log_z"):
            loss, log_z = out.ce, out.log_z if log_z is None else log_z
            self._check_reduction(getattr(out, "reduction", "mean"))
        else:
            loss = out
        check_loss(loss, self.device)
        loss = loss.detach().float().reshape(())
        z = (torch.full_like(loss, float("nan")) if log_z is None
             else log_z.detach().float().reshape(()).to(loss.device))
        self._items.append((loss, z, seq, rerun, self._rng))
        self._rng = None
        return out.loss if hasattr(out, "ce") and hasattr(out, "log_z") else out

    def _check_reduction(self, reduction: str) -> None:
        if reduction in ("mean", "none") or self._warned_reduction:  # "none": check_loss refuses
            return
        self._warned_reduction = True
        warnings.warn(f"the guard got a LossOutput with reduction {reduction!r}: its ce is a "
                      "sum, or a share of a mean over more tokens than this micro-batch's, but "
                      "the guard averages micro-batches and ranks, so it needs each "
                      "micro-batch's own mean; keep backpropagating out.loss and pass the "
                      "means: guard.accumulate(out.ce / n, log_z=out.log_z) for 'sum' (n: this "
                      "micro-batch's counted tokens), guard.accumulate(out.ce * k / n, log_z="
                      "out.log_z * k / n) for a normalizer k", GuardMisuseWarning, stacklevel=4)

    def redo(self, closure: Callable[..., Any]) -> None:
        """Replace this step's micro-batches by a re-run of ``closure`` (read_lag 1, after an
        update applied at the host made the gradients in place stale)."""
        self.clear()
        out = closure()
        for o in out if isinstance(out, (list, tuple)) and not hasattr(out, "log_z") else [out]:
            self.add(o)

    def take(self, rerun: Callable[..., Any] | None = None) -> StepBatch:
        """The step's mean loss and log Z, its rows and its re-run; ``rerun`` (given to
        ``guard.step``) belongs to the last micro-batch when it has none of its own."""
        items = list(self._items)
        self.clear()
        if rerun is not None and items[-1][3] is None:
            items[-1] = (*items[-1][:3], rerun, items[-1][4])
        losses, zs, rows, closures, states = zip(*items)
        faithful = all(c is not None for c in closures) and not (
            _dropout_active(self.model) and any(s is None for s in states))
        return StepBatch(torch.stack(losses).mean(), torch.stack(zs).mean(), rows,
                         self._replay(closures, states) if faithful else None)

    def _replay(self, closures: tuple[Callable[..., Any], ...],
                states: tuple[Any, ...]) -> Callable[..., Any]:
        if len(closures) == 1:
            one, state = closures[0], states[0]

            @functools.wraps(one)  # its signature: attribution asks whether it takes keep=
            def rerun_one(*args: Any, **kwargs: Any) -> Any:
                return self._run(one, state, *args, **kwargs)

            return rerun_one

        def rerun_all() -> list[Any]:
            return [self._run(c, s) for c, s in zip(closures, states)]

        return rerun_all

    def _run(self, closure: Callable[..., Any], state: Any, *args: Any, **kwargs: Any) -> Any:
        self.rerunning = True
        try:
            with _forked(state, self.device):
                return closure(*args, **kwargs)
        finally:
            self.rerunning = False
