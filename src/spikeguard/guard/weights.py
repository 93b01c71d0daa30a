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
and puts them through the gate's own Tier 1 test against the histories as they are, with the
loss bars halved (``DeviceGate.reference_test``: a batch already trained on, under weights a
fault has moved, need not look as bad as a fresh outlier). A reference that passes with its
grad norm past the geometric midpoint of the median and the grad bar is no answer either way:
the next oldest batch is re-run too and its test decides. (Tiny, lr 1e-3, seed 0: fresh batches
at 3.9-4.4x the median grad norm for five steps, the reference at 2.9x, inside the full bar, so
four skips held the weights; the next oldest batch was at 6x. A healthy old batch passes the
midpoint in a few percent of checks, and the full bar well under 1%.) If the reference fails the
test, the weights are the cause: the guard lets the (clipped) update
through, records cause ``weights`` and alerts; otherwise the batch is the cause and the skip
stands. A storm of bad batches on healthy weights stays a storm of skips: the reference passes.

Why a batch from ``reference_age`` (16) kept steps back and not the last kept one: an update fits
the batch it was computed on, so the last batch looks healthy under weights that every fresh batch
finds sharp (seen on the tiny model at peak LR 3e-3: the last batch at 0.5x the median grad norm
while five fresh ones were at 7-40x; a batch 16 updates old was at 12x). A batch trained on once,
16 updates ago, is as good as a fresh one, and keeping it costs only its closure. The check costs
one forward and backward, only after the gate has flagged a step: never on a healthy step, and
it reads the host only where the step's numbers are read anyway.

The closures cannot be checkpointed: a run resumed from a checkpoint starts with none, and for
its first ``reference_age`` kept steps its reference is the oldest kept step since the resume
(a younger batch than the run that never stopped would have used; the record's
``weights_check`` names which).

A reference that passes clears the weights only when nothing else has named them. Within
``suspect_window`` steps after a flag blamed on the weights with the loss up, or a Tier 2 page for
the logits (a log Z rule, the weights at fault twice), a passing reference does not make the batch
the cause: the step is released as the weights' (the check's ``suspect`` says why), unless its grad
norm is past the grad bar's multiple of the reference's. A grad-norm flag alone blamed on the
weights does not count (the clipped update repairs such a spike; after two at a warmup's end, a run
of repeated bytes 18 steps later was let through as the weights'). The zoo's output-logit proxy
(tiny, no z-loss, LR 1.0) under the default policy showed why: an old batch still passed under
weights whose log Z was climbing, the fresh batch was skipped 6-16 steps after a page for log Z or a
flag blamed on the weights, and the run ended worse than unguarded on 8 of 24 seeds (up to 1.20x); a
skip cannot repair the logits. Not under ``tier2="rollback"``: there the page rolls the weights
back, and releasing the flagged steps before it only changed where the replay started (the same
proxy's rollbacks, seeds 0-1: 0.826x and 0.984x their unguarded runs with the skips, 0.871x and
1.012x with the releases; seeds 4-23 no better).

Without a reference (the first kept step, or a loop that passes no ``rerun``) the cause is
``unknown``; then skipping stops after ``max_consecutive_skips`` withheld steps in a row (each
skip alone is harmless; many in a row on data the guard cannot test would only hold the weights
where they are).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..detector.detector import SpikeDetector

__all__ = ["Answer", "WeightsCheck", "WeightsProbe", "weights_reason"]

_INF = float("inf")


@dataclass(frozen=True)
class Answer:
    """What ``WeightsProbe.weigh`` says about one step."""

    check: WeightsCheck | None
    """The check, when the gate flagged the step on finite numbers."""
    fault: bool
    """The weights are at fault: the withheld update should go through."""
    kept: bool
    """An unflagged, applied step: the weights are healthy (a release of the following ends)."""


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
    second: dict[str, Any] | None = None
    """The second reference (``reference_step``, ``grad_norm``, ``loss``), asked when the first
    passed the gate but its grad norm was elevated; None when none was asked."""
    outsized: float | None = None
    """The flagged step's grad norm over the failing reference's, where it is past the grad
    bar's own multiple of the median: weights that fail an old batch at a few times the median
    do not explain a step a thousand times it (``weights`` is then False: the batch)."""
    suspect: str | None = None
    """Why the weights are at fault although the reference passed (a recent page or flag named
    them: module docstring); None otherwise."""

    def record(self) -> dict[str, Any]:
        """The record's ``weights_check`` entry."""
        return {"reference_step": self.reference_step, "grad_norm": self.grad_norm,
                "loss": self.loss, "weights": self.weights, "second": self.second,
                "outsized": self.outsized, "suspect": self.suspect}


def weights_reason(check: dict[str, Any], why: str | None = None) -> str:
    """The verdict's reason for a ``WeightsCheck.record()``; ``why``: why the step has no
    faithful re-run (``MicroBatches.why_not``), said when no check could run."""
    if check["weights"] is None:
        return f"weights: not checked ({why or 'no kept batch with rerun= to test with yet'})"
    fails, second = check["weights"], check.get("second")
    if check.get("outsized"):
        return (f"weights check: the batch of step {check['reference_step']} fails the gate "
                f"(grad norm {check['grad_norm']:.4g}, loss {check['loss']:.4g}), but this "
                f"step's grad norm is {check['outsized']:.4g}x that: the batch")
    also = "" if second is None else (
        f"; elevated, so the batch of step {second['reference_step']} was asked too (grad norm "
        f"{second['grad_norm']:.4g}, loss {second['loss']:.4g})")
    suspect = check.get("suspect")
    if suspect:
        also += f", but the weights are the suspect ({suspect})"
    fail = fails and second is None and not suspect
    return (f"weights check: the batch of step {check['reference_step']} "
            f"{'fails' if fail else 'passes'} the gate (grad norm "
            f"{check['grad_norm']:.4g}, loss {check['loss']:.4g}){also}: "
            f"{'the weights' if fails else 'the batch'}")


class WeightsProbe:
    """Remembers the closures of kept steps and answers weights-or-batch (module docstring).

    Built with the step part (``updater``: its measurement of a re-run's gradients, its gate's
    Tier 1 test, the gradients set aside for a re-run) and the probes (kept quiet in the re-run).
    It applies nothing: ``weigh`` returns its answer, and the guard hands it to the updater.
    ``detector``: the run's SpikeDetector (its storm length, ``loss_window`` and the reasons
    that name the weights); ``suspect`` False (under ``tier2="rollback"``): a passing reference
    always clears the weights."""

    def __init__(self, updater: Any, probes: Any, *, reference_age: int = 16,
                 detector: SpikeDetector | None = None, suspect: bool = True) -> None:
        self.updater, self.probes = updater, probes
        self.measure: Callable[..., Any] = updater.measure_rerun
        self.test: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            updater.gate.reference_test)
        self.elevated: Callable[[torch.Tensor], torch.Tensor] = updater.gate.reference_elevated
        self._refs: deque[tuple[int, Callable[..., Any]]] = deque(maxlen=reference_age)
        detector = detector if detector is not None else SpikeDetector()
        c = detector.config
        self.max_blind_skips = c.max_consecutive_skips
        self.blind = 0
        """Withheld steps in a row that could not be checked (no reference)."""
        self.suspect_window = c.loss_window if suspect else 0
        self.suspects = detector.weights_reasons
        """The Tier 2 reasons that name the weights (``SpikeDetector.weights_reasons``)."""
        self.suspect: tuple[int, str] | None = None
        """(step, why) of the last flag blamed on the weights or page for the logits."""

    def remember(self, step: int, rerun: Callable[..., Any] | None) -> None:
        """A kept (unflagged, applied) step: its closure may serve as a reference later."""
        self.blind = 0
        if rerun is not None:
            self._refs.append((step, rerun))

    def weigh(self, p: Any, reading: Any) -> Answer:
        """Weights or batch for step ``p`` (its ``StepReading``): the check when the gate flagged
        it on finite numbers, and whether the weights are at fault (then the withheld update
        should go through: ``Updater.weights_at_fault``). An unflagged applied step is remembered
        as a future reference, and says the weights are healthy."""
        if not reading.finite:
            return Answer(None, fault=False, kept=False)
        if not reading.flagged:
            if not reading.withheld:
                self.remember(p.step, p.rerun if p.reference else None)
                return Answer(None, fault=False, kept=True)
            return Answer(None, fault=False, kept=False)
        check = WeightsCheck(weights=None)
        if self._refs:
            aside = self.updater.set_aside(self.probes)
            try:
                check = self._suspected(p.step, self._sized(self.check(), reading.grad_norm),
                                        reading.grad_norm)
            finally:
                aside.restore(stale=False)
        fault = check.weights if check.weights is not None else (
            reading.withheld and self.blind_release())
        return Answer(check, fault=bool(fault), kept=False)

    def check(self) -> WeightsCheck:
        """Re-run the oldest remembered batch under the current weights and test it; when it
        passes with an elevated grad norm, the next oldest decides (module docstring)."""
        if not self._refs:
            return WeightsCheck(weights=None)
        step, loss, norm, g, fails = self._rerun(0)
        second = None
        if not fails and len(self._refs) > 1 and bool(self.elevated(g)):
            step2, loss2, norm2, _, fails = self._rerun(1)
            second = {"reference_step": step2, "grad_norm": norm2, "loss": loss2}
        return WeightsCheck(weights=fails, reference_step=step, grad_norm=norm, loss=loss,
                            second=second)

    def _sized(self, check: WeightsCheck, norm: float) -> WeightsCheck:
        """``check``, its "the weights" withdrawn when the flagged step's grad norm ``norm`` is
        past the grad bar's multiple (bar over median, the run's own noise) of the failing
        reference's: such a step is its batch, not the weights (tiny, a 1e6 gradient element at
        step 17: the oldest reference, the batch of step 0, failed the gate at 7.4, and the
        clipped 1e6 update went through as "the weights")."""
        if not check.weights:
            return check
        ref = check.second["grad_norm"] if check.second is not None else check.grad_norm
        mult = float(self.updater.gate.grad_multiple())
        ratio = norm / ref if ref > 0.0 else math.inf
        if not ratio > mult:
            return check
        return dataclasses.replace(check, weights=False, outsized=ratio)

    def judged(self, step: int, verdict: Any, cause: str | None) -> None:
        """Step ``step``'s verdict: a flag blamed on the weights with the loss up (a loss rule
        fired), or a Tier 2 page for the logits (a log Z rule, the weights at fault twice), makes
        the weights the suspect; a step at or before the last such one (a rollback went back past
        it) clears it. A grad-norm flag alone blamed on the weights does not: the clipped update
        is repairing such a spike (near the end of a warmup), and the weights are sound again."""
        if self.suspect is not None and step <= self.suspect[0]:
            self.suspect = None
        if cause == "weights" and verdict.tier == 1 and verdict.evidence.get("loss_flag"):
            self.suspect = (step, f"step {step}: a flag blamed on the weights, the loss up")
        elif verdict.tier == 2:
            named = [r for r in verdict.reasons if r.startswith(self.suspects)]
            if named:
                self.suspect = (step, f"step {step}: {named[0]}")

    def _suspected(self, step: int, check: WeightsCheck, norm: float) -> WeightsCheck:
        """``check`` with "the weights" when its reference passed within ``suspect_window``
        steps after the weights were named (module docstring), unless the flagged step's grad
        norm ``norm`` is past the grad bar's multiple of the reference's (its batch)."""
        at = self.suspect
        if check.weights is not False or check.outsized or at is None or not (
                0 < step - at[0] <= self.suspect_window):
            return check
        ref = check.second["grad_norm"] if check.second is not None else check.grad_norm
        if not norm <= float(self.updater.gate.grad_multiple()) * ref:
            return check
        return dataclasses.replace(check, weights=True, suspect=at[1])

    def _rerun(self, i: int) -> tuple[int, float, float, torch.Tensor, bool]:
        """Re-run remembered batch ``i`` (0: the oldest): its step, loss, grad norm (a float and
        a float64 tensor on the gate's side) and whether it fails ``reference_test``."""
        step, rerun = self._refs[i]
        loss, _, norm, stats = self.measure(rerun())
        dev = stats.norm.device
        g = torch.tensor(norm, dtype=torch.float64, device=dev)
        fails = bool(self.test(g, torch.tensor(loss, dtype=torch.float64, device=dev)))
        return step, loss, norm, g, fails

    def blind_release(self) -> bool:
        """Without a reference: count this withheld step; True once skipping should stop."""
        self.blind += 1
        return self.blind > self.max_blind_skips
