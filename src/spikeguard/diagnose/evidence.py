"""The evidence behind one spike, computed in a window around it (never over the whole log).

* which metric moved first: each metric's band is its median +- ``band_mads`` MADs over the
  ``band_steps`` before the spike's start (10 records at least); from the metric's largest
  excursion inside the spike, walk back while it stays out of its band (gaps of up to 3 records in the band are bridged, and
  the walk may go back into the band's own window, as a slow drift starts there): where that
  excursion began is where the metric moved.
  An excursion counts only when it is large (2 x band_mads MADs) or lasts 5 records, so noise
  touching a 3-MAD band does not. Equal steps are reported as a tie.
* grad norm over its median, the log Z trend (least-squares slope per 1,000 steps over the window,
  and the rise above the band's median), whether the loss rose (its peak more than
  ``spike_nats`` above the level just before), the recovery time (steps until the smoothed loss
  is back within ``spike_nats`` of that level; ``recovered`` is None when the loss never rose),
  and the first non-finite value.

Only logged values are evidence: a missing cell is neither a move nor a NaN.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._detector import DetectorConfig
from .readers import MetricsLog
from .spikes import FindConfig, level_records, records_for, smooth

__all__ = ["MOVERS", "band", "evidence", "first_move"]

MOVERS = ("loss", "grad_norm", "log_z")
"""The metrics whose first move is dated (upward moves: each of them rises before a spike)."""

_GAP = 3        # records inside the band that an excursion may bridge
_LASTING = 5    # records out of the band that make an excursion real whatever its size


def band(x: np.ndarray) -> tuple[float, float]:
    """(median, MAD) of the finite values of ``x``; (NaN, NaN) when there are fewer than 3."""
    x = x[np.isfinite(x)]
    if len(x) < 3:
        return math.nan, math.nan
    med = float(np.median(x))
    return med, float(np.median(np.abs(x - med)))


def first_move(x: np.ndarray, lo: int, hi: int, med: float, mad: float, mads: float) -> int | None:
    """Index where the upward excursion that peaks in x[lo..hi] began, or None if x stays within
    med + mads x MAD there (or the excursion is neither large nor lasting).

    ``x`` is the search window (its index 0 is the window's first record); the walk back may go
    below ``lo`` but not below 0.
    """
    if not math.isfinite(med) or hi < lo:
        return None
    scale = mad if mad > 0 else max(abs(med) * 1e-9, 1e-12)
    dev = (np.where(np.isfinite(x), x, np.inf) - med) / scale
    peak = lo + int(np.argmax(dev[lo: hi + 1]))
    if not dev[peak] > mads:
        return None
    out = dev > mads
    i, gap, first = peak, 0, peak
    while i > 0:
        i -= 1
        if out[i]:
            first, gap = i, 0
        else:
            gap += 1
            if gap > _GAP:
                break
    length = int(out[first: peak + 1].sum())
    if dev[peak] < 2 * mads and length < _LASTING:
        return None
    return first


def _slope_per_1k(steps: np.ndarray, y: np.ndarray) -> float | None:
    ok = np.isfinite(y)
    if ok.sum() < 3:
        return None
    s = steps[ok].astype(np.float64)
    return float(np.polyfit(s - s.mean(), y[ok], 1)[0] * 1000.0)


def _num(x: Any) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def evidence(log: MetricsLog, i0: int, i1: int, *, pre_level: float, det: DetectorConfig,
             cfg: FindConfig, ratio: np.ndarray | None = None) -> dict[str, Any]:
    """The evidence dict for the spike spanning records ``i0..i1`` (inclusive).

    ``ratio`` is the detector's own loss / EMA per record (from the replay), when known: its
    peak in the spike is reported.
    """
    w = max(10, records_for(cfg.band_steps, log.stride))  # a band of 10 records at least
    s0 = max(0, i0 - w)            # the band: the band_steps before the spike's start; the
    steps = log.steps              # walk back may enter it (the median and MAD are robust)
    series = log.columns
    exits: dict[str, int | None] = {}
    bands: dict[str, list[float | None]] = {}
    for m in MOVERS:
        x = series.get(m)
        if x is None:
            continue
        med, mad = band(x[s0:i0])
        miss = log.missing.get(m)
        if miss is not None and miss[s0: i1 + 1].any():  # a blank is in the band, not out of it
            x = x.copy()
            x[s0: i1 + 1][miss[s0: i1 + 1]] = med if math.isfinite(med) else -np.inf
        bands[m] = [_num(med), _num(mad)]
        k = first_move(x[s0: i1 + 1], i0 - s0, i1 - s0, med, mad, cfg.band_mads)
        exits[m] = None if k is None else int(steps[s0 + k])
    moved = [m for m, s in exits.items() if s is not None]
    first = min((exits[m] for m in moved), default=None)
    ev: dict[str, Any] = {
        "moved_first": [m for m in moved if exits[m] == first],
        "moved_at": first,
        "exits": exits,
        "bands": bands,
        "band_steps": [int(steps[s0]), int(steps[max(s0, i0 - 1)])],
    }
    if ratio is not None and np.isfinite(ratio[i0: i1 + 1]).any():
        ev["loss_ema_ratio_peak"] = float(np.nanmax(ratio[i0: i1 + 1]))
    g = log.columns.get("grad_norm")
    if g is not None:
        med = bands["grad_norm"][0]
        peak = float(np.nanmax(np.where(np.isfinite(g[i0: i1 + 1]), g[i0: i1 + 1], np.nan))) \
            if np.isfinite(g[i0: i1 + 1]).any() else math.nan
        ev["grad_norm_peak"] = _num(peak)
        ev["grad_median"] = med
        ev["grad_ratio"] = _num(peak / med) if med else None
    z = log.columns.get("log_z")
    if z is not None:
        zw = z[s0: i1 + 1]
        ev["log_z_trend_per_1k"] = _slope_per_1k(steps[s0: i1 + 1], zw)
        zmed = bands["log_z"][0]
        zpeak = float(np.nanmax(zw)) if np.isfinite(zw).any() else math.nan
        ev["log_z_peak"] = _num(zpeak)
        ev["log_z_rise"] = _num(zpeak - zmed) if zmed is not None else None
    loss = log.columns.get("loss")
    if loss is not None:
        ok = np.isfinite(loss) & ~log.missing.get("loss", np.zeros(len(loss), dtype=bool))
        inside = np.flatnonzero(ok[i0: i1 + 1]) + i0
        ev["loss_peak"] = float(loss[inside].max()) if len(inside) else None
        if not math.isfinite(pre_level):  # the level just before: it follows an early drop
            prior = np.flatnonzero(ok[:i0])[-level_records(cfg, log.stride):]
            pre_level = float(np.median(loss[prior])) if len(prior) else math.nan
        ev["pre_spike_loss"] = _num(pre_level)
        moved = (ev["loss_peak"] is not None and math.isfinite(pre_level)
                 and ev["loss_peak"] > pre_level + det.spike_nats)
        ev["loss_rose"] = bool(moved)
        rec = None
        if moved:  # steps from the start until the (smoothed, logged) loss is back near its level
            after = np.flatnonzero(ok[i0:]) + i0
            sm = smooth(loss[after])
            peak = int(np.argmax(sm[: len(inside)])) if len(inside) else 0
            back = np.flatnonzero(sm[peak:] <= pre_level + det.spike_nats)
            if len(back):
                rec = int(steps[after[peak + int(back[0])]] - steps[i0])
        ev["recovery_steps"] = rec
        ev["recovered"] = (rec is not None) if moved else None
    bad = np.zeros(i1 - i0 + 1, dtype=bool)
    for m in ("loss", "grad_norm"):
        if m in log.columns:
            logged = ~log.missing.get(m, np.zeros(len(log), dtype=bool))[i0: i1 + 1]
            bad |= ~np.isfinite(log.columns[m][i0: i1 + 1]) & logged
    if "nan_frac" in log.columns:
        bad |= log.columns["nan_frac"][i0: i1 + 1] > 0
    ev["nan"] = bool(bad.any())
    ev["first_nonfinite_step"] = int(steps[i0 + int(np.argmax(bad))]) if bad.any() else None
    return ev
