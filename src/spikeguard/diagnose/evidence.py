"""The evidence behind one spike, computed in a window around it (never over the whole log).

* which metric moved first: each metric's band is its median +- ``band_mads`` MADs over the
  ``band_steps`` before the spike's start (10 records at least); from the metric's largest
  excursion inside the spike, walk back while it stays out of its band (gaps of up to 3 records in the band are bridged, and
  the walk may go back into the band's own window, as a slow drift starts there): where that
  excursion began is where the metric moved.
  An excursion counts only when it is large (2 x band_mads MADs) or lasts 5 records, so noise
  touching a 3-MAD band does not. Equal steps are reported as a tie. Only a move at or before
  the event's first record is "moved first" (a metric that left its band later followed).
* grad norm over its median, the log Z trend (least-squares slope per 1,000 steps over the window,
  and the rise above the band's median), whether the loss rose (its peak above the median of the
  logged values just before by more than max(spike_nats, 3 x their spread)), the recovery time
  (steps until a logged value is back within that margin; ``recovered`` is None when the loss
  never rose), and the first non-finite value.

Only logged values are evidence: a missing cell is neither a move nor a NaN.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._detector import DetectorConfig
from .readers import MetricsLog
from .spikes import FindConfig, level_records, noise, records_for

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


def _loss_evidence(log: MetricsLog, loss: np.ndarray, i0: int, i1: int, det: DetectorConfig,
                   cfg: FindConfig) -> dict[str, Any]:
    """The loss's part of the evidence, from logged values only.

    The level before is the median of the logged finite losses of the records just before the
    event (``level_records`` of them, the records of the event excluded); the noise is the robust
    spread of those same records; the loss rose when its peak inside the event stands above that
    level by more than max(spike_nats, 3 x noise); it is back at the first logged value after
    the peak within that margin of the level (never a smoothed value).
    """
    ok = np.isfinite(loss) & ~log.missing.get("loss", np.zeros(len(loss), dtype=bool))
    inside = np.flatnonzero(ok[i0: i1 + 1]) + i0
    out: dict[str, Any] = {"loss_peak": float(loss[inside].max()) if len(inside) else None}
    prior = np.flatnonzero(ok[:i0])[-level_records(cfg, log.stride):]
    pre = float(np.median(loss[prior])) if len(prior) else math.nan
    vals = loss[prior]
    sigma = noise(vals) if len(vals) >= 5 else (
        1.4826 * float(np.median(np.abs(vals - np.median(vals)))) if len(vals) >= 3 else 0.0)
    margin = max(det.spike_nats, 3.0 * sigma)
    out["pre_spike_loss"] = _num(pre)
    out["pre_spike_loss_from"] = (
        f"median of the {len(prior)} logged loss value(s) at steps {int(log.steps[prior[0]]):,}-"
        f"{int(log.steps[prior[-1]]):,}" if len(prior) else "no logged loss before the event")
    out["loss_noise"] = sigma
    out["loss_noise_from"] = ("robust spread of those values" if len(vals) >= 3 else
                              "fewer than 3 values before the event: not measured")
    out["loss_margin"] = margin
    rose = out["loss_peak"] is not None and math.isfinite(pre) and out["loss_peak"] > pre + margin
    out["loss_rose"] = bool(rose)
    rec = None
    if rose:
        peak = int(inside[int(np.argmax(loss[inside]))])
        after = np.flatnonzero(ok[peak + 1:] & (loss[peak + 1:] <= pre + margin)) + peak + 1
        if len(after):
            rec = int(log.steps[after[0]] - log.steps[i0])
    out["recovery_steps"] = rec
    out["recovered"] = (rec is not None) if rose else None
    return out


def evidence(log: MetricsLog, i0: int, i1: int, *, det: DetectorConfig,
             cfg: FindConfig, ratio: np.ndarray | None = None,
             grad_median: np.ndarray | None = None) -> dict[str, Any]:
    """The evidence dict for the spike spanning records ``i0..i1`` (inclusive).

    ``ratio`` is the detector's own loss / EMA per record (from the replay), when known: its
    peak in the spike is reported; ``grad_median`` the detector's running grad-norm median per
    record: the grad ratio is taken against it, so it agrees with the rule that fired. Every number is a logged value or names how it was derived
    (``pre_spike_loss_from``, ``loss_noise_from``).
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
    # "moved first" dates what started the event: a move at or before its first record
    moved = [m for m, s in exits.items() if s is not None and s <= int(steps[i0])]
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
        gw = np.where(np.isfinite(g[i0: i1 + 1]), g[i0: i1 + 1], np.nan)
        at = i0 + int(np.nanargmax(gw)) if np.isfinite(gw).any() else None
        peak = float(g[at]) if at is not None else math.nan
        ev["grad_norm_peak"] = _num(peak)
        ev["grad_median"] = med
        ev["grad_median_from"] = "median of the band before the event"
        # the detector's own running median at the peak, when the replay kept it: the ratio a
        # "grad_norm > 3x median" reason was judged on
        dmed = float(grad_median[at]) if grad_median is not None and at is not None else math.nan
        if math.isfinite(dmed) and dmed > 0:
            med = dmed
            ev["grad_median"] = dmed
            ev["grad_median_from"] = (f"the detector's running median at step "
                                      f"{int(steps[at]):,} (the one its rule compared)")
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
        ev.update(_loss_evidence(log, loss, i0, i1, det, cfg))
    bad = np.zeros(i1 - i0 + 1, dtype=bool)
    for m in ("loss", "grad_norm"):
        if m in log.columns:
            logged = ~log.missing.get(m, np.zeros(len(log), dtype=bool))[i0: i1 + 1]
            bad |= ~np.isfinite(log.columns[m][i0: i1 + 1]) & logged
    if "nan_frac" in log.columns:
        bad |= log.columns["nan_frac"][i0: i1 + 1] > 0
    if "nan_iters" in log.columns:
        bad |= log.columns["nan_iters"][i0: i1 + 1] > 0
    ev["nan"] = bool(bad.any())
    ev["first_nonfinite_step"] = int(steps[i0 + int(np.argmax(bad))]) if bad.any() else None
    return ev
