"""Find spikes in a metrics log with whole-array numpy passes (a million steps in well under a
second).

Two kinds. A loss spike, in the usual playbook's terms, is a rise of 0.1 nats or more over the
pre-spike level that persists for more than 50 steps; a single bad batch is an outlier:

* persistent: the loss (a centred median of 5 records, so one odd batch cannot make or break
  one) stands ``spike_nats`` above its pre-spike level for more than ``persist_steps`` steps.
  The pre-spike level at step t is the lowest 50-step mean loss over the prior ``band_steps``;
  once a spike starts its level is frozen, so a long spike is followed to its real end.
* single-step outliers: a grad norm above ``grad_k`` x its running median (block medians over
  the prior ``band_steps``), a loss more than ``outlier_mads`` robust deviations above its local
  median, or a non-finite loss, grad norm or nan_frac > 0.

Thresholds shared with the detector (``spike_nats``, ``grad_k``, ``arm_after``) are read from the
DetectorConfig, so a what-if flag moves both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ._detector import DetectorConfig
from .readers import MetricsLog

__all__ = ["FindConfig", "Found", "find_spikes", "prior_min", "records_for", "smooth"]


@dataclass(kw_only=True, frozen=True)
class FindConfig:
    """How diagnose finds spikes and measures their evidence (steps, scaled to records)."""

    persist_steps: int = 50
    """A loss spike persists for more than this many steps (the standard definition: 50)."""
    band_steps: int = 1000
    """Window of the pre-spike level, the running median and the evidence bands, in steps."""
    band_mads: float = 3.0
    """A metric 'moves' where it leaves its median +- this many MADs over the band window."""
    outlier_mads: float = 8.0
    """A single-step loss outlier stands this many robust deviations above its local median."""

    def __post_init__(self) -> None:
        from .._validate import check_int, check_positive

        check_int(self.persist_steps, "FindConfig.persist_steps", default=50)
        check_int(self.band_steps, "FindConfig.band_steps", minimum=10, default=1000)
        check_positive(self.band_mads, "FindConfig.band_mads", default=3.0)
        check_positive(self.outlier_mads, "FindConfig.outlier_mads", default=8.0)


@dataclass
class Found:
    """One stretch of a log that the search flagged, as positions into the log's arrays."""

    i0: int
    """First record of the stretch."""
    i1: int
    """Last record of the stretch (inclusive)."""
    kinds: set[str]
    """Any of "persistent", "grad_outlier", "loss_outlier", "nonfinite"."""
    pre_level: float = math.nan
    """The loss level before a persistent spike (NaN for outliers alone)."""


def records_for(steps: int, stride: int) -> int:
    """A window of ``steps`` steps as a count of records of a log with one every ``stride``."""
    return max(1, round(steps / max(1, stride)))


def ffill(x: np.ndarray) -> np.ndarray:
    """Non-finite entries replaced by the previous finite one (leading ones by the first)."""
    ok = np.isfinite(x)
    if ok.all() or not ok.any():
        return x if ok.all() else np.zeros_like(x)
    idx = np.where(ok, np.arange(len(x)), 0)
    np.maximum.accumulate(idx, out=idx)
    idx[: int(np.argmax(ok))] = int(np.argmax(ok))
    return x[idx]


def smooth(x: np.ndarray, k: int = 2) -> np.ndarray:
    """Centred running median over 2k+1 records (edges padded with the end values)."""
    if len(x) < 2 * k + 1:
        return x.copy()
    return np.median(sliding_window_view(np.pad(x, k, mode="edge"), 2 * k + 1), axis=1)


def trailing_mean(x: np.ndarray, w: int) -> np.ndarray:
    """Mean of x[max(0, t-w+1) .. t] for every t."""
    c = np.cumsum(np.r_[0.0, x])
    t = np.arange(1, len(x) + 1)
    lo = np.maximum(0, t - w)
    return (c[t] - c[lo]) / (t - lo)


def prior_min(x: np.ndarray, w: int) -> np.ndarray:
    """min(x[max(0, t-w) .. t-1]) for every t (+inf at t = 0): O(n), van Herk / Gil-Werman."""
    n = len(x)
    out = np.full(n, np.inf)
    if n < 2:
        return out
    w = max(1, min(w, n))
    head = np.minimum.accumulate(x)
    out[1:w + 1] = head[: min(w, n - 1)]
    if n > w:
        pad = (-n) % w
        blocks = np.r_[x, np.full(pad, np.inf)].reshape(-1, w)
        pre = np.minimum.accumulate(blocks, axis=1).ravel()
        suf = np.minimum.accumulate(blocks[:, ::-1], axis=1)[:, ::-1].ravel()
        i = np.arange(n - w)  # window x[i .. i+w-1] is the prior window of t = i + w
        out[w + 1:] = np.minimum(suf[i], pre[i + w - 1])[1:]
    return out


def block_median(x: np.ndarray, w: int) -> np.ndarray:
    """An O(n) stand-in for the running median of the prior ``w`` records: the median of the ten
    block medians (blocks of w/10) before each record's block; NaN in the first block."""
    n = len(x)
    b = max(1, w // 10)
    nb = n // b
    out = np.full(n, np.nan)
    if nb < 2:
        return out
    med = np.nanmedian(x[: nb * b].reshape(nb, b), axis=1)
    padded = np.r_[np.full(9, np.nan), med]
    ref = np.nanmedian(sliding_window_view(padded, 10), axis=1)  # ref[k]: blocks k-9..k
    per_block = np.r_[np.nan, ref[:-1]]                           # blocks before block k
    out[: nb * b] = np.repeat(per_block, b)
    out[nb * b:] = ref[-1]
    return out


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) index of each run of True."""
    d = np.diff(np.r_[0, mask.astype(np.int8), 0])
    return list(zip(np.flatnonzero(d == 1).tolist(), (np.flatnonzero(d == -1) - 1).tolist()))


def _persistent(log: MetricsLog, det: DetectorConfig, cfg: FindConfig) -> list[Found]:
    loss = log.columns.get("loss")
    if loss is None or len(loss) < 8:
        return []
    stride = log.stride
    n_persist = records_for(cfg.persist_steps, stride)
    w = records_for(cfg.band_steps, stride)
    lf = ffill(loss)
    sm = smooth(lf)
    base = prior_min(trailing_mean(lf, n_persist), w)
    base[: min(len(base), max(n_persist, 2))] = np.inf   # too little history for a level
    above = sm > base + det.spike_nats
    out: list[Found] = []
    end = -1
    for i0 in np.flatnonzero(above & ~np.r_[False, above[:-1]]).tolist():
        if i0 <= end:
            continue
        thr = base[i0] + det.spike_nats
        j = i0
        while True:  # follow the spike at its frozen level; dips shorter than n_persist bridge
            below = np.flatnonzero(sm[j:] <= thr)
            if not len(below):
                j = len(sm)
                break
            j += int(below[0])
            back = np.flatnonzero(sm[j: j + n_persist + 1] > thr)
            if not len(back):
                break
            j += int(back[0])
        end = j - 1
        if log.steps[end] - log.steps[i0] + stride > cfg.persist_steps:
            out.append(Found(i0, end, {"persistent"}, float(base[i0])))
    return out


def _outliers(log: MetricsLog, det: DetectorConfig, cfg: FindConfig) -> list[Found]:
    n = len(log)
    w = records_for(cfg.band_steps, log.stride)
    flags: dict[str, np.ndarray] = {}
    bad = np.zeros(n, dtype=bool)
    for m in ("loss", "grad_norm"):
        if m in log.columns:
            bad |= ~np.isfinite(log.columns[m])
    if "nan_frac" in log.columns:
        bad |= log.columns["nan_frac"] > 0  # NaN (a missing cell) compares False
    flags["nonfinite"] = bad
    armed = np.arange(n) >= det.arm_after
    g = log.columns.get("grad_norm")
    if g is not None:
        gf = np.where(np.isfinite(g), g, np.nan)
        flags["grad_outlier"] = armed & (gf > det.grad_k * block_median(gf, w))
    loss = log.columns.get("loss")
    if loss is not None:
        lf = ffill(loss)
        resid = lf - smooth(lf)
        scale = 1.4826 * float(np.median(np.abs(resid))) if len(resid) else 0.0
        floor = max(det.spike_nats, cfg.outlier_mads * scale)
        flags["loss_outlier"] = armed & (resid > floor)
    out = []
    for kind, mask in flags.items():
        out += [Found(a, b, {kind}) for a, b in _runs(mask)]
    return out


def find_spikes(log: MetricsLog, detector: DetectorConfig | None = None,
                config: FindConfig | None = None) -> list[Found]:
    """Every persistent spike and single-step outlier of ``log``, in step order; stretches that
    overlap or touch (adjacent records) are one. Two faults apart are two spikes, however close:
    each gets its own tier and rollback step."""
    det = detector or DetectorConfig()
    cfg = config or FindConfig()
    found = sorted(_persistent(log, det, cfg) + _outliers(log, det, cfg), key=lambda f: f.i0)
    merged: list[Found] = []
    for f in found:
        last = merged[-1] if merged else None
        if last is not None and f.i0 <= last.i1 + 1:
            last.i1 = max(last.i1, f.i1)
            last.kinds |= f.kinds
            if math.isnan(last.pre_level):
                last.pre_level = f.pre_level
        else:
            merged.append(f)
    return merged
