"""Worked scenarios as metric streams, for tests, benchmarks and ``diagnose`` demos.

Each scenario is given by a handful of numbers (docs/design.md, "Worked scenarios"); a stream is the linear
interpolation between them (values hold before the first point and after the last) plus seeded
Gaussian noise: loss sigma 0.01 nats, log Z sigma 0.05, grad norm times lognormal(sigma 0.10-0.15).
Every stream is a list of :class:`StepMetrics` with one record per step, in step order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..record import StepMetrics

__all__ = ["Scenario", "clean_run", "data_anomaly", "grad_storm", "interpolate", "logit_drift"]

Points = Sequence[tuple[float, float]]

# Scenario 1 - data anomaly at step 42,100 (loss recovers over the next 400 steps)
DATA_ANOMALY_LOSS: Points = ((42_099, 2.41), (42_100, 2.89), (42_100 + 400 / 3, 2.72),
                             (42_100 + 800 / 3, 2.58), (42_500, 2.44))
DATA_ANOMALY_GRAD: Points = ((42_099, 1.1), (42_100, 7.3), (42_101, 1.1))
DATA_ANOMALY_LOG_Z: Points = ((42_100, 8.3),)

# Scenario 2 - logit drift: log Z 8.1 -> 15.2 over 1,500 steps, loss diverging from 58,200
# (no spacing is given for the five loss values: 100 steps apart here), grad norm
# "elevated but not extreme, 1.8-2.6"
LOGIT_DRIFT_LOG_Z: Points = ((57_000, 8.1), (57_500, 9.6), (58_000, 11.9), (58_500, 15.2))
LOGIT_DRIFT_LOSS: Points = ((58_200, 2.38), (58_300, 2.65), (58_400, 2.99), (58_500, 3.41),
                            (58_600, 3.88))
LOGIT_DRIFT_GRAD: Points = ((58_000, 1.1), (58_200, 1.8), (58_600, 2.6))


@dataclass(frozen=True)
class Scenario:
    """A named stream and what should happen to it."""

    name: str
    """Short name, e.g. ``"data_anomaly"``."""
    metrics: list[StepMetrics]
    """One record per step, in step order."""
    expect: dict[str, int] = field(default_factory=dict)
    """The expected answer, e.g. ``{"skip_step": 42100}`` or ``{"rollback_to": 57000}``."""
    checkpoint_every: int = 1000
    """The checkpoint interval of the scenario, in steps."""


def interpolate(points: Points, steps: np.ndarray) -> np.ndarray:
    """Piecewise-linear values at ``steps`` through ``points`` (x ascending), held at both ends."""
    xs = np.array([p[0] for p in points], dtype=np.float64)
    ys = np.array([p[1] for p in points], dtype=np.float64)
    return np.interp(steps.astype(np.float64), xs, ys)


def _records(steps: np.ndarray, loss: np.ndarray, grad: np.ndarray,
             log_z: np.ndarray) -> list[StepMetrics]:
    return [StepMetrics(step=s, loss=lo, grad_norm=g, log_z=z)
            for s, lo, g, z in zip(steps.tolist(), loss.tolist(), grad.tolist(), log_z.tolist())]


def _noisy(steps: np.ndarray, loss: np.ndarray, grad: np.ndarray, log_z: np.ndarray, seed: int,
           grad_sigma: float) -> list[StepMetrics]:
    rng = np.random.default_rng(seed)
    n = len(steps)
    loss = loss + rng.normal(0.0, 0.01, n)
    log_z = log_z + rng.normal(0.0, 0.05, n)
    grad = grad * np.exp(rng.normal(0.0, grad_sigma, n))
    return _records(steps, loss, grad, log_z)


def data_anomaly(seed: int = 0, *, start: int = 37_000, stop: int = 43_000) -> Scenario:
    """Scenario 1, a data anomaly: a single batch at step 42,100 with grad norm 7.3 (median 1.1) and loss
    2.41 -> 2.89, recovering 2.89 -> 2.72 -> 2.58 -> 2.44 over 400 steps; log Z 8.3.

    Expected: Tier 1 SKIP at 42,100 and nothing else skipped. Steps ``start .. stop - 1``.
    """
    steps = np.arange(start, stop)
    loss = interpolate(DATA_ANOMALY_LOSS, steps)
    grad = interpolate(DATA_ANOMALY_GRAD, steps)
    log_z = interpolate(DATA_ANOMALY_LOG_Z, steps)
    metrics = _noisy(steps, loss, grad, log_z, seed, grad_sigma=0.15)
    return Scenario(name="data_anomaly", metrics=metrics, expect={"skip_step": 42_100})


def logit_drift(seed: int = 0, *, start: int = 52_000, stop: int = 59_001) -> Scenario:
    """Scenario 2, logit drift: log Z 8.1 (57,000) -> 9.6 -> 11.9 -> 15.2 (58,500), loss 2.38 -> 3.88
    from 58,200, grad norm 1.1 -> 1.8-2.6.

    Expected: Tier 2 naming log Z by 59,000, rolling back to the checkpoint at 57,000.
    """
    steps = np.arange(start, stop)
    loss = interpolate(LOGIT_DRIFT_LOSS, steps)
    grad = interpolate(LOGIT_DRIFT_GRAD, steps)
    log_z = interpolate(LOGIT_DRIFT_LOG_Z, steps)
    metrics = _noisy(steps, loss, grad, log_z, seed, grad_sigma=0.10)
    return Scenario(name="logit_drift", metrics=metrics,
                    expect={"tier2_by": 59_000, "rollback_to": 57_000})


def clean_run(seed: int = 0, *, steps: int = 20_000) -> Scenario:
    """A healthy run: loss 2.2 + 3 exp(-s/1500) + N(0, 0.02); grad norm
    (0.9 + 2 exp(-s/800)) x lognormal(sigma 0.25); log Z 6 + N(0, 0.05).

    Expected: no ALERT, ROLLBACK or HALT; a SKIP only where a genuine 3x draw happens.
    """
    rng = np.random.default_rng(seed)
    s = np.arange(steps)
    loss = 2.2 + 3.0 * np.exp(-s / 1500) + rng.normal(0.0, 0.02, steps)
    grad = (0.9 + 2.0 * np.exp(-s / 800)) * np.exp(rng.normal(0.0, 0.25, steps))
    log_z = 6.0 + rng.normal(0.0, 0.05, steps)
    return Scenario(name="clean_run", metrics=_records(s, loss, grad, log_z))


def grad_storm(seed: int = 0, *, steps: int = 400, at: int = 300, factor: float = 4.0) -> Scenario:
    """Grad norm 1.0 x lognormal(0.10) until step ``at``, then permanently ``factor`` x that;
    loss 2.5, log Z 7 (noise as above). Expected: a skip storm (Tier 2) within 10 steps."""
    s = np.arange(steps)
    grad = np.where(s >= at, factor, 1.0)
    metrics = _noisy(s, np.full(steps, 2.5), grad, np.full(steps, 7.0), seed, grad_sigma=0.10)
    return Scenario(name="grad_storm", metrics=metrics, expect={"storm_from": at})
