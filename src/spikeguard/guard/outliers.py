"""Which rows of a batch stand out: robust z-scores of the per-sequence losses and log Z.

Attribution (``attribution.py``) quarantines the sequences of a skipped batch whose loss or log Z
scores above ``quarantine_z``; the median and MAD make the score robust to the outliers
themselves.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["outliers", "robust_z", "row_scores"]

_MIN_ROWS = 4
"""Fewer rows than this in a batch: no z-score means anything, nothing is quarantined."""
_MAD_SCALE = 1.4826     # MAD -> standard deviation for a normal distribution
_MEAN_AD_SCALE = 1.2533  # mean absolute deviation -> standard deviation (sqrt(pi / 2))


def robust_z(values: Sequence[float]) -> list[float]:
    """(x - median) / (1.4826 MAD) for each value, the median and MAD over the finite values.

    With a MAD of 0 (more than half the values equal) the scale is 1.2533 x the mean absolute
    deviation instead; when that is 0 too every finite value scores 0. A non-finite value
    scores +inf (it stands out whatever the others are)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return [math.inf] * len(values)
    med = statistics.median(finite)
    dev = [abs(v - med) for v in finite]
    scale = _MAD_SCALE * statistics.median(dev)
    if scale == 0.0:
        scale = _MEAN_AD_SCALE * sum(dev) / len(dev)
    return [math.inf if not math.isfinite(v) else 0.0 if scale == 0.0 else (v - med) / scale
            for v in values]


def row_scores(loss: Sequence[float], log_z: Sequence[float]) -> list[float]:
    """Each row's score: the larger of its loss's and its log Z's robust z-score in the batch."""
    return [max(a, b) for a, b in zip(robust_z(loss), robust_z(log_z))]


def outliers(rows: Sequence[dict[str, Any]], threshold: float) -> list[dict[str, Any]]:
    """The rows whose ``loss`` or ``log_z`` has a robust z-score above ``threshold``, each with
    ``z`` (the larger of its two scores); nothing for fewer than 4 rows.

    One-sided on purpose: a sequence with an unusually low loss has a small gradient (p - onehot
    is near 0) and a low log Z small logits, so neither can drive a spike, while ordinary text
    has a long low tail (tables, repeated characters) that a two-sided rule would quarantine."""
    if len(rows) < _MIN_ROWS:
        return []
    z = row_scores([r["loss"] for r in rows], [r["log_z"] for r in rows])
    return [{**r, "z": s} for r, s in zip(rows, z) if s > threshold]
