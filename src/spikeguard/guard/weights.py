"""Weights or batch: the check that runs after the gate withholds a finite step.

A skip repairs a bad batch on healthy weights; it can never repair damaged weights. When an
ordinary update moves the weights somewhere sharp (near the end of warmup at a high peak LR, a
learning-rate fault), every new batch shows a large grad norm, and skipping each of them keeps
the weights exactly where they are: the skips become a storm, while the clipped update that the
unguarded run applies is the repair (it is back on its curve two steps later).

So before a flagged step stays skipped, the guard asks whether the anomaly persists on other data
with the same weights: it re-runs a *reference* batch (the batch of a kept step ``reference_age``
kept steps back, through that step's ``rerun`` closure) under the current weights, with the
step's gradients set aside, measures its grad norm and loss as the step's own (one all-reduce),
and puts them through the gate's own Tier 1 test against the histories as they are. If the
reference fails the test too, the weights are the cause: the guard lets the (clipped) update
through, records cause ``weights`` and alerts; otherwise the batch is the cause and the skip
stands. A storm of bad batches on healthy weights stays a storm of skips: the reference passes.

Why a batch from ``reference_age`` (16) kept steps back and not the last kept one: an update fits
the batch it was computed on, so the last batch looks healthy under weights that every fresh batch
finds sharp (seen on the tiny model at peak LR 3e-3: the last batch at 0.5x the median grad norm
while five fresh ones were at 7-40x; a batch 16 updates old was at 12x). A batch trained on once,
16 updates ago, is as good as a fresh one, and keeping it costs only its closure. The check costs
one forward and backward, only after the gate has flagged a step: never on a healthy step, and
it reads the host only where the step's numbers are read anyway.

Without a reference (the first kept step, or a loop that passes no ``rerun``) the cause is
``unknown``; then skipping stops after ``max_consecutive_skips`` withheld steps in a row (each
skip alone is harmless; many in a row on data the guard cannot test would only hold the weights
where they are).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["WeightsCheck", "WeightsProbe"]


@dataclass(frozen=True)
class WeightsCheck:
    """The answer for one flagged step."""

    weights: bool | None
    """True: the reference fails the gate too (the weights); False: it passes (the batch); None:
    no reference to test with."""
    reference_step: int | None = None
    grad_norm: float = float("nan")
    """The reference batch's grad norm under the current weights."""
    loss: float = float("nan")

    def record(self) -> dict[str, Any]:
        """The record's ``weights_check`` entry."""
        return {"reference_step": self.reference_step, "grad_norm": self.grad_norm,
                "loss": self.loss, "weights": self.weights}


class WeightsProbe:
    """Remembers the closures of kept steps and answers weights-or-batch (module docstring).

    ``measure(out)`` is the step part's measurement of a re-run's gradients (loss, log Z, norm,
    stats); ``test(norm, loss)`` the gate's Tier 1 test as a 0-d bool tensor. The caller sets the
    step's gradients aside around ``check``."""

    def __init__(self, *, measure: Callable[..., Any],
                 test: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 reference_age: int = 16, max_blind_skips: int = 5) -> None:
        self.measure, self.test = measure, test
        self._refs: deque[tuple[int, Callable[..., Any]]] = deque(maxlen=reference_age)
        self.max_blind_skips = max_blind_skips
        self.blind = 0
        """Withheld steps in a row that could not be checked (no reference)."""

    def remember(self, step: int, rerun: Callable[..., Any] | None) -> None:
        """A kept (unflagged, applied) step: its closure may serve as a reference later."""
        self.blind = 0
        if rerun is not None:
            self._refs.append((step, rerun))

    def forget(self) -> None:
        """A rollback: the closures belong to the timeline that was rolled back."""
        self._refs.clear()
        self.blind = 0

    @property
    def has_reference(self) -> bool:
        return bool(self._refs)

    def check(self) -> WeightsCheck:
        """Re-run the oldest remembered batch under the current weights and test it."""
        if not self._refs:
            return WeightsCheck(weights=None)
        step, rerun = self._refs[0]
        loss, _, norm, stats = self.measure(rerun())
        dev = stats.norm.device
        fails = self.test(torch.tensor(norm, dtype=torch.float64, device=dev),
                          torch.tensor(loss, dtype=torch.float64, device=dev))
        return WeightsCheck(weights=bool(fails), reference_step=step, grad_norm=norm, loss=loss)

    def blind_release(self) -> bool:
        """Without a reference: count this withheld step; True once skipping should stop."""
        self.blind += 1
        return self.blind > self.max_blind_skips
