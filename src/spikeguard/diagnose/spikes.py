"""Find spikes in a metrics log with whole-array numpy passes (a million steps in well under a
second).

Three kinds, with windows in steps (turned into records by the log's stride):

* persistent: a rise of ``spike_nats`` or more over the pre-spike level that lasts more than
  ``persist_steps`` (the usual playbook's definition: 0.1 nats, 50 steps). The level before
  step t is the median of the records of the ``persist_steps`` before it, the level after it
  the median of those from t on, so one odd batch can neither make nor break a spike and the
  level follows an early loss drop. Where the log is too noisy to tell 0.1 nats (a sparse log
  of single-batch losses), the threshold is 3 standard errors of that difference, and
  ``noise`` says so. Once a spike starts its level is frozen, so a long one is followed to its
  real end.
* jump: the smoothed loss at least ``jump_ratio`` x (or ``jump_nats`` above) the level before
  it, and still there ``persist_steps`` later or at the end of the log: a spike whatever the
  detector's arming. A loss ``blowup_ratio`` x its level is a blow-up.
* single-step outliers: a grad norm above ``grad_k`` x the median of the records before it
  (3 of them at least), a loss more than ``outlier_mads`` robust deviations above its local
  median, or a non-finite loss, grad norm or nan_frac > 0. Missing cells are never evidence.

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

__all__ = ["FindConfig", "Found", "find_spikes", "level_records", "levels", "noise", "prior_median",
           "prior_min", "quiet_noise", "records_for", "smooth", "spike_threshold"]


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
    jump_ratio: float = 2.0
    """A loss this many times its level before, and staying there, is a spike (any arming)."""
    jump_nats: float = 2.0
    """... or this many nats above that level (for losses near zero or far above it)."""
    blowup_ratio: float = 100.0
    """A loss this many times its level is a blow-up (Tier 3): far outside the model's range."""

    def __post_init__(self) -> None:
        from .._validate import check_int, check_positive

        check_int(self.persist_steps, "FindConfig.persist_steps", default=50)
        check_int(self.band_steps, "FindConfig.band_steps", minimum=10, default=1000)
        check_positive(self.band_mads, "FindConfig.band_mads", default=3.0)
        check_positive(self.outlier_mads, "FindConfig.outlier_mads", default=8.0)
        check_positive(self.jump_nats, "FindConfig.jump_nats", default=2.0)
        for name, default in (("jump_ratio", 2.0), ("blowup_ratio", 100.0)):
            v = getattr(self, name)
            check_positive(v, f"FindConfig.{name}", default=default)
            if v <= 1.0:
                raise ValueError(f"FindConfig.{name}={v} must be > 1 (a multiple of the level "
                                 f"before; default {default})")


@dataclass
class Found:
    """One stretch of a log that the search flagged, as positions into the log's arrays."""

    i0: int
    """First record of the stretch."""
    i1: int
    """Last record of the stretch (inclusive)."""
    kinds: set[str]
    """Any of "persistent", "jump", "blowup", "grad_outlier", "loss_outlier", "nonfinite"."""
    pre_level: float = math.nan
    """The loss level before a persistent spike or a jump (NaN for outliers alone)."""


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


def noise(x: np.ndarray, ok: np.ndarray | None = None) -> float:
    """The record-to-record noise of ``x``: 1.4826 x the MAD of its first differences over
    sqrt(2) (robust to outliers and to a trend); 0 with fewer than 5 usable values."""
    v = x[np.isfinite(x) if ok is None else ok & np.isfinite(x)]
    d = np.diff(v)
    if len(d) < 4:
        return 0.0
    return 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2.0)


def quiet_noise(log: MetricsLog, cfg: FindConfig | None = None) -> float:
    """``noise`` of the loss measured outside the events: over the records before the first
    jump, blow-up or non-finite value (a first pass of ``_jumps`` with the default detector),
    when at least 6 records precede it; else over the whole log. Kept on the log: the replay's
    configuration and the search both ask."""
    cached = log.__dict__.get("_quiet_noise")
    if cached is not None:
        return cached
    value = _quiet_noise(log, cfg)
    log.__dict__["_quiet_noise"] = value
    return value


def _quiet_noise(log: MetricsLog, cfg: FindConfig | None) -> float:
    s = _series(log)
    if s is None:
        return noise(log.columns["loss"]) if "loss" in log.columns else 0.0
    lf, sm, ok = s
    sigma = noise(lf, ok)
    found = _jumps(log, DetectorConfig(), cfg or FindConfig(), (lf, sm, ok, sigma))
    logged_bad = ~np.isfinite(log.columns["loss"]) & ~log.missing.get(
        "loss", np.zeros(len(lf), dtype=bool))
    first = min([f.i0 for f in found] + [int(np.argmax(logged_bad)) if logged_bad.any()
                                         else len(lf)])
    return noise(lf[:first], ok[:first]) if first >= 6 and first < len(lf) else sigma


def level_records(cfg: FindConfig, stride: int) -> int:
    """Records in a level (the median-like mean before or after a step): ``persist_steps`` of
    them, at least 3 (on a sparse log a level of one record is one batch)."""
    return max(3, records_for(cfg.persist_steps, stride))


def _series(log: MetricsLog) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(finite-filled loss, its 5-record median, the present-and-finite mask), or None; kept on
    the log after the first call."""
    if "_series" not in log.__dict__:
        log.__dict__["_series"] = _make_series(log)
    return log.__dict__["_series"]


def _make_series(log: MetricsLog) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    loss = log.columns.get("loss")
    if loss is None or len(loss) < 4:
        return None
    ok = np.isfinite(loss)
    if "loss" in log.missing:
        ok &= ~log.missing["loss"]
    lf = ffill(np.where(ok, loss, np.nan))
    return lf, smooth(lf), ok


def levels(lf: np.ndarray, sm: np.ndarray, n: int, sigma: float, ok: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """(level before t, level from t on): means over the logged finite values among the ``n``
    records before t and from t (NaN where fewer than half of them are; before t, an eighth of
    the log's records suffice on a short log), of the loss with
    single-record highs capped at its 5-record median + 3 sigma (so one bad batch moves
    neither; a real rise moves the median, and so the cap, with it)."""
    xw = np.where(ok, np.minimum(lf, sm + 3.0 * sigma), 0.0)
    c = np.r_[0.0, np.cumsum(xw)]
    k = np.r_[0, np.cumsum(ok)]
    idx = np.arange(len(xw))
    # a log shorter than two levels (a handful of pasted rows) takes what it has: the shift
    # must then be confirmed by the records after it (``_jumps``: the median of those ahead)
    need = max(1, min(n // 2, int(k[-1]) // 8))
    lo = np.maximum(0, idx - n)
    cnt = k[idx] - k[lo]
    before = np.where(cnt >= need, (c[idx] - c[lo]) / np.maximum(1, cnt), np.nan)
    hi = np.minimum(len(xw), idx + n)
    cnt = k[hi] - k[idx]
    after = np.where(cnt >= max(1, n // 2), (c[hi] - c[idx]) / np.maximum(1, cnt), np.nan)
    return before, after


def spike_threshold(det: DetectorConfig, sigma: float, n: int) -> float:
    """The rise that makes a persistent spike: ``spike_nats``, or 3 standard errors of the
    difference of two levels of ``n`` records where the log is noisier than that."""
    return max(det.spike_nats, 3.0 * sigma * math.sqrt(2.0 / n))


_Series = tuple[np.ndarray, np.ndarray, np.ndarray, float]


def _persistent(log: MetricsLog, det: DetectorConfig, cfg: FindConfig,
                s: _Series | None) -> list[Found]:
    if s is None or len(s[0]) < 8:
        return []
    lf, sm, ok, sigma = s
    n = level_records(cfg, log.stride)
    thr = spike_threshold(det, sigma, n)
    before, after = levels(lf, sm, n, sigma, ok)
    with np.errstate(invalid="ignore"):
        up = ok & (after > before + thr)
    up[: min(len(up), n)] = False  # too little history for a level
    out: list[Found] = []
    end = -1
    for i0 in np.flatnonzero(up & ~np.r_[False, up[:-1]]).tolist():
        if i0 <= end:
            continue
        level = float(before[i0])
        first = np.flatnonzero(ok[i0:] & (sm[i0:] > level + thr))
        if not len(first):
            continue
        i0 += int(first[0])  # where the loss itself is up, not the window that sees it coming
        j = i0
        while j < len(after) and after[j] > level + thr:  # the level is frozen at the start
            j += 1
        tail = np.flatnonzero(sm[i0: min(len(sm), j + n)] > level + thr)
        end = i0 + int(tail[-1]) if len(tail) else i0
        if log.steps[end] - log.steps[i0] + log.stride > cfg.persist_steps:
            out.append(Found(i0, end, {"persistent"}, level))
    return out


def _jumps(log: MetricsLog, det: DetectorConfig, cfg: FindConfig,
           s: _Series | None) -> list[Found]:
    """Jumps that stay (confirmed by a later record) and blow-ups, whatever the arming."""
    if s is None:
        return []
    lf, sm, ok, sigma = s
    n = level_records(cfg, log.stride)
    before, _ = levels(lf, sm, n, sigma, ok)
    b = np.where(np.isfinite(before) & (before > 0), before, np.nan)
    with np.errstate(invalid="ignore"):
        bar = np.minimum(cfg.jump_ratio * b, b + cfg.jump_nats)
        cross = ok & (lf >= bar)
        blow = ok & (lf >= cfg.blowup_ratio * b)
    out: list[Found] = []
    end = -1
    for i0 in np.flatnonzero(cross).tolist():
        if i0 <= end:
            continue
        level, line = float(b[i0]), float(bar[i0])
        ahead = lf[i0: min(len(lf), i0 + n)]
        stays = len(ahead) >= 2 and float(np.median(ahead)) >= line
        if not (stays or blow[i0]):
            continue
        k = i0
        while k + 1 < len(lf) and sm[k + 1] >= level + (line - level) / 2:
            k += 1
        end = k
        out.append(Found(i0, k, {"blowup"} if blow[i0: k + 1].any() else {"jump"}, level))
    return out


def prior_median(x: np.ndarray, w: int) -> np.ndarray:
    """Median of the finite values among the ``w`` records before each one (NaN with fewer than
    3): exact on a short log, ``block_median`` on a long one."""
    n = len(x)
    if n >= 2 * max(1, w // 10) and n > 200:
        return block_median(x, w)
    out = np.full(n, np.nan)
    for i in range(3, n):
        prev = x[max(0, i - w): i]
        prev = prev[np.isfinite(prev)]
        if len(prev) >= 3:
            out[i] = float(np.median(prev))
    return out


def _outliers(log: MetricsLog, det: DetectorConfig, cfg: FindConfig,
              s: _Series | None) -> list[Found]:
    n = len(log)
    w = records_for(cfg.band_steps, log.stride)
    flags: dict[str, np.ndarray] = {}
    bad = np.zeros(n, dtype=bool)
    for m in ("loss", "grad_norm"):
        if m in log.columns:
            logged = ~log.missing.get(m, np.zeros(n, dtype=bool))
            bad |= ~np.isfinite(log.columns[m]) & logged
    if "nan_frac" in log.columns:
        bad |= log.columns["nan_frac"] > 0  # NaN (a missing cell) compares False
    if "nan_iters" in log.columns:  # the trainer's own count of NaN iterations (Megatron)
        bad |= log.columns["nan_iters"] > 0
    flags["nonfinite"] = bad
    g = log.columns.get("grad_norm")
    if g is not None:
        gf = np.where(np.isfinite(g), g, np.nan)
        with np.errstate(invalid="ignore"):
            flags["grad_outlier"] = gf > det.grad_k * prior_median(gf, w)
    if s is not None:
        lf, sm, ok, _ = s
        resid = lf - sm
        scale = 1.4826 * float(np.median(np.abs(resid[ok]))) if ok.any() else 0.0
        floor = max(det.spike_nats, cfg.outlier_mads * scale)
        early = np.arange(n) < level_records(cfg, log.stride)  # no local level yet
        flags["loss_outlier"] = ok & ~early & (resid > floor)
    out = []
    for kind, mask in flags.items():
        out += [Found(a, b, {kind}) for a, b in _runs(mask)]
    return out


def find_spikes(log: MetricsLog, detector: DetectorConfig | None = None,
                config: FindConfig | None = None) -> list[Found]:
    """Every persistent spike, jump, blow-up and single-step outlier of ``log``, in step order;
    stretches that overlap or touch (adjacent records) are one. Two faults apart are two spikes, however close:
    each gets its own tier and rollback step."""
    det = detector or DetectorConfig()
    cfg = config or FindConfig()
    s = _series(log)
    series = None if s is None else (*s, quiet_noise(log, cfg))
    found = sorted(_persistent(log, det, cfg, series) + _jumps(log, det, cfg, series)
                   + _outliers(log, det, cfg, series), key=lambda f: f.i0)
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
