"""The detect stage on the host: a step's reading to the SpikeDetector, its verdict back.

``Detection.judge(p, out)`` builds the step's ``StepMetrics`` from its ``StepReading`` (the
non-finite fraction only on the rare non-finite path), gives them to the ``SpikeDetector``
(telling it whether the weights check let a flagged update through) and to the Tier 2 history,
and fills in the outcome's metrics, verdict and the probes' signals. It decides nothing the
detector does not.
"""

from __future__ import annotations

import logging

from ..detector.detector import SpikeDetector
from ..record import StepMetrics
from .outcome import StepOutcome, Update
from .reading import Pending
from .summary import History

__all__ = ["Detection"]

log = logging.getLogger("spikeguard")


class Detection:
    """The detect stage (module docstring); built with the detector, the Tier 2 history and
    whether the guard responds (a flagged update let through is ``released`` only then)."""

    def __init__(self, detector: SpikeDetector, history: History, *, respond: bool) -> None:
        self.detector, self.history, self.respond = detector, history, respond
        self._warned_disagree = False

    def judge(self, p: Pending, out: StepOutcome, tail: list[float]) -> StepOutcome:
        """The verdict on step ``p`` (``tail``: the probes' numbers after the reading)."""
        r = out.reading
        norm = r.grad_norm
        nan_frac: float | None = 0.0
        if not (norm == norm and abs(norm) != float("inf")):
            # the non-finite path of grad_stats: a host read, and a collective that every rank
            # makes alike (the norm they branch on is bit-identical)
            nan_frac = p.stats.nan_frac if p.grads_alive else None
        m = StepMetrics(step=p.step, loss=r.loss, grad_norm=norm, log_z=r.log_z,
                        nan_frac=nan_frac, lr=p.lr,
                        grad_scale=r.grad_scale if r.grad_scale == r.grad_scale else None)  # NaN: none
        check = out.weights_check
        blind = check is None or check.weights is None  # released without a test of the weights
        skipped = out.update is Update.WITHHELD
        out.signals = p.probes.decode(tail) if p.probes is not None else {}
        verdict = self.detector.update(m, released=self.respond and r.flagged and not skipped,
                                       blind=blind, update_ratio=out.signals.get("update_ratio"),
                                       after_skip=p.after_skip)
        m.loss_ema_ratio = verdict.evidence.get("loss_ema_ratio")
        if (self.respond and verdict.tier <= 1 and verdict.skip != skipped
                and not p.held_before and not self._warned_disagree):
            self._warned_disagree = True
            log.warning("spikeguard: device gate (%s) and host verdict (%s) disagree at step %d",
                        skipped, verdict.skip, p.step)
        self.history.add(p.step, r.loss, norm, r.log_z)
        bound = out.signals.get("attn_logit_bound")  # every tenth step
        if bound is not None:
            self.history.add_bound(p.step, float(bound))
        out.metrics, out.verdict = m, verdict
        return out
