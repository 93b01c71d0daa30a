"""What a log says about its precision: the loss scaler's skips, and when fp16 itself failed.

Read from any log that carries it: a loss-scale column (``grad_scale``), a skipped-update counter
(Megatron's ``number of skipped iterations``, one per DeepSpeed ``OVERFLOW`` line: ``skipped``),
the NaN-iteration counter (``nan_iters``), and, in a Hugging Face log, a non-finite grad norm with a
finite loss on a step whose learning rate did not advance while the schedule was moving (or
stands at exactly 0): the scaler skipped ``optimizer.step()`` and with it the scheduler.

* A scaler skip leaves the loss finite and the weights untouched: Tier 0, counted. Skips from the
  log's first record on are the scaler calibrating its scale at start-up.
* A non-finite loss is a non-finite forward, never a scaler skip (the replay gives it Tier 3).
* A precision failure, Tier 3: a loss scale below the detector's ``min_grad_scale`` (1), a skip
  the scaler could not answer by lowering the scale (already at its minimum), ``max_scaler_skips``
  (10) skipped records in a row outside start-up, or one run of consecutive skips that takes the
  scale down by more than ``2**COLLAPSE_HALVINGS`` from where it stood before the run. The advice:
  bf16, or fp32 for the layer that overflows.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ._detector import DetectorConfig
from .readers import MetricsLog

__all__ = ["COLLAPSE_HALVINGS", "STARTUP_UPDATES", "Finding", "PrecisionReport", "analyse", "precision_of"]

STARTUP_UPDATES = 64
"""Skips from the log's first record count as start-up calibration only within this many
updates of the start: from Megatron's initial loss scale 2**32 the scaler reaches 1 after 32
halvings, 64 with its hysteresis of 2; a log that opens later opens mid-run."""

COLLAPSE_HALVINGS = 4
"""A run of consecutive skips that lowers the scale by more than 2**this is a collapse. A dynamic
scaler halves its scale once per overflow and doubles it back after 1,000-2,000 clean steps
(torch's GradScaler growth_interval 2000; Megatron's and DeepSpeed's loss_scale_window 1000), so
outside start-up a healthy fp16 run overflows once and goes on at half the scale (twice with
Megatron's hysteresis of 2). Four halvings more than that in one run mean the gradients grew
16x past what fp16 held a moment before: the overflow is in the model, not in the scale."""

_AROUND = 3  # records each side that show whether the LR schedule is moving

_BF16_ADVICE = ("switch to bf16 (same exponent range as fp32, no loss scale), or keep the layer "
                "that overflows in fp32")


@dataclass
class Finding:
    """One precision event of the log, as positions and steps."""

    start: int
    end: int
    tier: int
    kind: str
    """calibration, scaler_skips, collapse, at_minimum, scale_below_1, overflow_run."""
    cause: str
    advice: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class PrecisionReport:
    """What the log says about precision (``Diagnosis.precision``)."""

    precision: str | None
    """fp16 / bf16 / fp32 when known, else None."""
    source: str
    """How it is known (the run's config, a logged loss scale, ...), or why it is not."""
    scaler_skips: int | None
    """Updates the loss scaler skipped, counted from the log (None: the log cannot tell)."""
    skip_mask: np.ndarray
    """Per record: its update was wholly skipped by the scaler (left out of the replay and the
    search: a skipped update changed nothing, and its non-finite gradient is the scaler's)."""
    findings: list[Finding]

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "source": self.source,
                "scaler_skips": self.scaler_skips,
                "findings": [{"start": f.start, "end": f.end, "tier": f.tier, "kind": f.kind,
                              "cause": f.cause, "advice": f.advice} for f in self.findings]}


def _col(log: MetricsLog, name: str) -> np.ndarray | None:
    x = log.columns.get(name)
    if x is None:
        return None
    miss = log.missing.get(name)
    return np.where(miss, np.nan, x) if miss is not None else x


def _bad(log: MetricsLog, name: str) -> np.ndarray:
    """Logged non-finite values of ``name`` (a missing cell is not one)."""
    x = log.columns.get(name)
    if x is None:
        return np.zeros(len(log), dtype=bool)
    return ~np.isfinite(x) & ~log.missing.get(name, np.zeros(len(log), dtype=bool))


def _hf_skips(log: MetricsLog) -> np.ndarray:
    """Records where a non-finite grad norm meets a finite loss and a stalled learning rate."""
    n = len(log)
    out = np.zeros(n, dtype=bool)
    g, lr = _col(log, "grad_norm"), _col(log, "lr")
    if g is None or lr is None:
        return out
    finite_loss = ~_bad(log, "loss")
    bad_g = _bad(log, "grad_norm")
    prev = np.r_[np.nan, lr[:-1]]
    # the schedule is moving where the LR is not one value over the records around
    win = sliding_window_view(np.r_[np.full(_AROUND, np.nan), lr, np.full(_AROUND, np.nan)],
                              2 * _AROUND + 1)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows
        moving = np.nanmax(win, axis=1) > np.nanmin(win, axis=1)
        stalled = lr == prev
        zero = lr == 0.0
    return bad_g & finite_loss & ((stalled & moving) | zero)


def _scaled_skips(log: MetricsLog) -> np.ndarray:
    """A log with a loss-scale column (spikeguard's own, a CSV): a non-finite grad norm with a
    finite loss is the scaler's overflow."""
    n = len(log)
    scale = _col(log, "grad_scale")
    if scale is None or "grad_norm" not in log.columns or "skipped" in log.columns:
        return np.zeros(n, dtype=bool)  # a trainer's own skip counter is the better witness
    fin = scale[np.isfinite(scale)]
    if not len(fin) or (fin == 1.0).all():
        return np.zeros(n, dtype=bool)  # a scale that stays 1: no dynamic scaler (bf16, fp32)
    return _bad(log, "grad_norm") & ~_bad(log, "loss") & np.isfinite(scale)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    d = np.diff(np.r_[0, mask.astype(np.int8), 0])
    return list(zip(np.flatnonzero(d == 1).tolist(), (np.flatnonzero(d == -1) - 1).tolist()))


def precision_of(log: MetricsLog, skips: int) -> tuple[str | None, str]:
    """(precision, how it is known) from the run's config, else from the log itself."""
    run = log.run_config or {}
    p = run.get("precision")
    if isinstance(p, str) and p not in ("auto", ""):
        name = "bf16" if "bf16" in p else "fp16" if "16" in p else "fp32" if "32" in p else p
        return name, f"the run's {run.get('path', 'config')}"
    scale = _col(log, "grad_scale")
    if scale is not None and np.isfinite(scale).any() and (scale[np.isfinite(scale)] != 1).any():
        return "fp16", "a dynamic loss scale is logged"
    if skips:
        return "fp16", "the loss scaler skipped updates"
    if scale is not None:
        return None, "the logged loss scale stays 1.0 (bf16 or fp32; the log does not say which)"
    return None, "the log does not say"


def _step(log: MetricsLog, i: int) -> int:
    return int(log.steps[i])


def _judge_run(c: DetectorConfig, span: tuple[int, int], k: int, records: int, before: float,
               low: float, stuck: bool, calib: bool, learning: bool,
               ev: dict[str, Any]) -> Finding:
    """One run of consecutive skip records as a finding (the rules of the module docstring)."""
    where = f"step{'s' if span[0] != span[1] else ''} {span[0]:,}" + \
        (f"-{span[1]:,}" if span[1] != span[0] else "")
    known = math.isfinite(before) and math.isfinite(low)
    if math.isfinite(low) and low < c.min_grad_scale:
        return Finding(*span, 3, "scale_below_1",
                       f"fp16 precision failure: loss scale {low:g} < {c.min_grad_scale:g} at "
                       f"{where}: the gradients overflow fp16 even unscaled", [_BF16_ADVICE], ev)
    if stuck:
        return Finding(*span, 3, "at_minimum",
                       f"fp16 precision failure: {k} overflow(s) at {where} with the loss scale "
                       f"already at its minimum ({low:g}): lowering it cannot help",
                       [_BF16_ADVICE], ev)
    if calib and not learning:
        return Finding(*span, 0, "calibration",
                       f"fp16 loss scaler: every logged update skipped ({k}, {where}): the run "
                       "is not learning", [_BF16_ADVICE], ev)
    if calib:
        drop = f", scale {before:g} -> {low:g}" if known else ""
        return Finding(*span, 0, "calibration", f"the loss scaler calibrating at start-up: {k} "
                       f"update(s) skipped at {where}{drop}", [], ev)
    if records >= c.max_scaler_skips:
        return Finding(*span, 3, "overflow_run",
                       f"fp16 precision failure: {records} records in a row with skipped "
                       f"updates ({k}) at {where} (>= max_scaler_skips {c.max_scaler_skips})",
                       [_BF16_ADVICE], ev)
    if known and low > 0 and before / low > 2 ** COLLAPSE_HALVINGS:
        return Finding(*span, 3, "collapse",
                       f"fp16 precision failure: the loss scale collapsed {before:g} -> {low:g} "
                       f"({before / low:,.0f}x, more than 2^{COLLAPSE_HALVINGS}) in {k} skipped "
                       f"update(s) at {where}", [_BF16_ADVICE], ev)
    drop = f"; scale {before:g} -> {low:g}" if known and low < before else ""
    return Finding(*span, 0, "scaler_skips",
                   f"fp16 loss-scale overflow: GradScaler skipped {k} update(s) at {where}{drop} "
                   "(the loss stayed finite)", [], ev)


def analyse(log: MetricsLog, config: DetectorConfig | None = None) -> PrecisionReport:
    """The precision report of ``log``; ``config`` gives min_grad_scale and max_scaler_skips."""
    c = config or DetectorConfig()
    n = len(log)
    skipped = _col(log, "skipped")
    counted = np.nan_to_num(skipped, nan=0.0) if skipped is not None else np.zeros(n)
    inferred = _hf_skips(log) | _scaled_skips(log)
    skip_cnt = counted > 0
    skip_rec = skip_cnt | inferred
    total = int(counted.sum()) + int((inferred & ~skip_cnt).sum())
    has_counter = skipped is not None or bool(inferred.any())
    precision, source = precision_of(log, total)
    scale = _col(log, "grad_scale")
    tried = _col(log, "scale_tried")
    findings: list[Finding] = []
    runs = _runs(skip_rec)
    calib_end = runs[0][1] if runs and runs[0][0] == 0 and \
        int(log.steps[0]) <= STARTUP_UPDATES else -1
    applied = ~skip_rec & (np.isfinite(scale) if scale is not None else False)
    for a, b in runs:
        k = int(counted[a: b + 1].sum()) + int((inferred[a: b + 1] & ~skip_cnt[a: b + 1]).sum())
        s_run = scale[a: b + 1] if scale is not None else np.array([])
        s_run = s_run[np.isfinite(s_run)]
        t_run = tried[a: b + 1] if tried is not None else np.array([])
        t_run = t_run[np.isfinite(t_run)]
        low = float(s_run.min()) if len(s_run) else math.nan
        lo = max(calib_end + 1, a - 50)  # the scale the run held before, after start-up
        before_vals = scale[lo:a][applied[lo:a]] if scale is not None and a > lo else []
        before = (float(np.median(before_vals)) if len(before_vals)
                  else float(t_run.max()) if len(t_run) else float(s_run.max()) if len(s_run)
                  else math.nan)
        span = (_step(log, a), _step(log, b))
        ev = {"skipped": k, "scale_before": before if math.isfinite(before) else None,
              "scale_lowest": low if math.isfinite(low) else None, "records": b - a + 1}
        stuck = bool(len(t_run) and len(s_run) and float(t_run.min()) <= low <= c.min_grad_scale)
        calib = a == 0 and b == calib_end
        learning = not (calib and b == n - 1 and {"grad_norm", "loss"} <= set(log.columns))
        findings.append(_judge_run(c, span, k, b - a + 1, before, low, stuck, calib, learning, ev))
    g = log.columns.get("grad_norm")
    no_grad = ~np.isfinite(g) if g is not None else log.missing.get("loss", np.ones(n, bool))
    whole = (inferred | (skip_cnt & no_grad)) & ~_bad(log, "loss")  # a NaN loss stays: Tier 3
    return PrecisionReport(precision, source, total if has_counter else None, whole, findings)
