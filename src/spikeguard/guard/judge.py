"""The host side of one step: read its numbers, weigh a flagged one, let the detector judge.

``Judge.judge(p)`` reads a Pending step's read-back vector (the ``N_NUMBERS`` numbers of
``Updater.device_step``, then the probes' readings), asks the weights check (``weights.py``)
whether a flagged step stays withheld, builds the step's ``StepMetrics`` and gives it to the
``SpikeDetector`` and the Tier 2 history. It decides nothing the detector does not: it returns
the metrics, the verdict, the record's extra keys and whether the update was withheld.
"""

from __future__ import annotations

import logging
from typing import Any

from ..detector.detector import SpikeDetector, Verdict
from ..record import StepMetrics
from .step import Pending, Updater
from .summary import History

__all__ = ["N_NUMBERS", "Judge"]

log = logging.getLogger("spikeguard")

N_NUMBERS = 9
"""The step's numbers at the head of the read-back vector (see Updater.device_step)."""


class Judge:
    """Judges one step on the host (module docstring); built with the detector, the history,
    the weights check (or None) and the step part (for the loss scaler in use)."""

    def __init__(self, detector: SpikeDetector, history: History, weights: Any,
                 updater: Updater, *, respond: bool) -> None:
        self.detector, self.history, self.weights = detector, history, weights
        self.updater, self.respond = updater, respond
        self._warned_disagree = False

    def judge(self, p: Pending) -> tuple[StepMetrics, Verdict, dict[str, Any], bool]:
        """Read the step's numbers, weigh a flagged one and give them to the detector (and the
        history). Returns (metrics, verdict, record extras, whether the update was withheld)."""
        values = p.readback.values()
        loss, log_z, norm, _, armed, coef, scale, flag, bounded = values[:N_NUMBERS]
        skipped, check = (self.weights.weigh(p, values) if self.weights is not None
                          else (values[3] != 0.0, None))
        nan_frac: float | None = 0.0
        if not (norm == norm and abs(norm) != float("inf")):
            # the non-finite path of grad_stats: a host read, and a collective that every rank
            # makes alike (the norm they branch on is bit-identical)
            nan_frac = p.stats.nan_frac if p.grads_alive else None
        scaler = self.updater.precision.scaler
        m = StepMetrics(step=p.step, loss=loss, grad_norm=norm, log_z=log_z, nan_frac=nan_frac,
                        lr=p.lr, grad_scale=scale if scaler is not None else None)
        blind = check is None or check.weights is None  # released without a test of the weights
        signals = p.probes.decode(values[N_NUMBERS:]) if p.probes is not None else {}
        verdict = self.detector.update(m, released=self.respond and flag != 0.0 and not skipped,
                                       blind=blind, update_ratio=signals.get("update_ratio"))
        m.loss_ema_ratio = verdict.evidence.get("loss_ema_ratio")
        if (self.respond and verdict.tier <= 1 and verdict.skip != skipped
                and not self._warned_disagree):
            self._warned_disagree = True
            log.warning("spikeguard: device gate (%s) and host verdict (%s) disagree at step %d",
                        skipped, verdict.skip, p.step)
        self.history.add(p.step, loss, norm, log_z)
        extras: dict[str, Any] = {"armed": armed != 0.0, "skipped": skipped, "clip_coef": coef}
        if self.updater.bound.active:
            extras["update_coef"] = bounded
        if check is not None:
            extras["weights_check"] = check.record()
            if check.weights or not skipped:
                extras["cause"] = "weights" if check.weights else "unknown"
        extras.update(signals)
        return m, verdict, extras, skipped
