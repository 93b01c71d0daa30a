"""Metric streams whose detector verdicts are recorded in tests/data/verdicts.json.

The recording pins the detector's behaviour step for step: a refactor of its rules must give the
same verdicts on every stream here (tests/test_detector_recorded.py compares). ``random_stream``
packs every kind of event a rule reacts to into 20,000 seeded steps: outliers, loss level shifts,
log Z ramps and jumps, skip storms, non-finite steps and fp16 overflows.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from spikeguard.detector.detector import DetectorConfig
from spikeguard.record import StepMetrics
from spikeguard.testing import scenarios as sc

# explicit windows (not DetectorConfig.for_run, whose arming may change on purpose)
SMALL = dict(arm_after=50, median_window=500, loss_ema_steps=200, recovery_ema_steps=20,
             recovery_steps=100, elevated_steps=150, log_z_rise_steps=100, skip_window=300,
             vocab_size=256)


def random_stream(seed: int = 0, n: int = 20_000) -> list[StepMetrics]:
    rng = np.random.default_rng(seed)
    loss = 4.0 + 1.5 * np.exp(-np.arange(n) / 3000.0)
    grad = np.full(n, 1.0)
    log_z = np.full(n, 6.0)
    scale: list[float | None] = [None] * n
    nan_frac = np.zeros(n)
    s = 300
    while s < n - 400:
        kind = rng.integers(0, 11)
        if kind == 0:    # single outlier in the grad norm
            grad[s] *= rng.uniform(3.5, 12.0)
        elif kind == 1:  # loss outlier
            loss[s] *= rng.uniform(1.6, 3.0)
        elif kind == 2:  # loss level shift that decays
            length = int(rng.integers(50, 700))
            loss[s:s + length] += rng.uniform(0.05, 0.6) * np.exp(-np.arange(length) / (length / 3))
        elif kind == 3:  # log Z ramp
            length = int(rng.integers(50, 400))
            log_z[s:s + length] += np.linspace(0.0, rng.uniform(1.0, 5.0), length)
            log_z[s + length:s + length + 200] += log_z[s + length - 1] - 6.0
        elif kind == 4:  # storm of elevated grad norms
            length = int(rng.integers(3, 15))
            grad[s:s + length] *= rng.uniform(3.5, 6.0)
        elif kind == 5:  # a non-finite step
            which = rng.integers(0, 3)
            if which == 0:
                nan_frac[s] = 1e-4
                grad[s] = math.nan
            elif which == 1:
                loss[s] = math.inf
            else:
                grad[s] = math.inf
        elif kind == 6:  # fp16 overflows, a run of them
            length = int(rng.integers(1, 13))
            for k in range(length):
                grad[s + k] = math.inf
                scale[s + k] = float(2.0 ** rng.integers(-2, 17))
        elif kind == 7:  # log Z jump (drift rule) with a big logit scale (z-loss advice)
            log_z[s:s + 300] += rng.uniform(2.0, 8.0)
        elif kind == 8:  # a large loss excursion (halt-loss rule needs vocab 256: ln 256 = 5.5)
            loss[s] = rng.uniform(9.0, 14.0)
        elif kind == 9:  # loss ratio above 2.5 for a dozen steps
            loss[s:s + int(rng.integers(8, 16))] *= rng.uniform(2.6, 3.2)
        else:            # a skipped outlier, then a loss that climbs and never comes back
            grad[s] *= 8.0
            loss[s:] += np.minimum(np.arange(n - s) / 30.0, 1.0) * rng.uniform(0.3, 0.6)
        s += int(rng.integers(60, 500))
    loss = loss + rng.normal(0.0, 0.02, n)
    grad = grad * np.exp(rng.normal(0.0, 0.2, n))
    log_z = log_z + rng.normal(0.0, 0.05, n)
    return [StepMetrics(step=i, loss=float(loss[i]), grad_norm=float(grad[i]),
                        log_z=float(log_z[i]), nan_frac=float(nan_frac[i]), grad_scale=scale[i])
            for i in range(n)]


@functools.cache
def streams() -> dict[str, tuple[list[StepMetrics], DetectorConfig]]:
    """name -> (metrics, config) for every recorded stream."""
    out: dict[str, tuple[list[StepMetrics], DetectorConfig]] = {}
    for seed in range(2):
        out[f"data_anomaly/{seed}"] = (sc.data_anomaly(seed).metrics, DetectorConfig())
        out[f"logit_drift/{seed}"] = (sc.logit_drift(seed).metrics, DetectorConfig())
        out[f"clean_run/{seed}"] = (sc.clean_run(seed).metrics, DetectorConfig())
        out[f"grad_storm/{seed}"] = (sc.grad_storm(seed).metrics, DetectorConfig())
        out[f"random/{seed}/default"] = (random_stream(seed), DetectorConfig(vocab_size=256))
        out[f"random/{seed}/small"] = (random_stream(seed), DetectorConfig(**SMALL))
    return out


def verdict_rows(verdicts) -> list[list]:
    """The non-CONTINUE verdicts as JSON rows [step, tier, action, reasons, onset, skip]."""
    return [[v.step, v.tier, v.action.value, list(v.reasons), v.onset_step, v.skip]
            for v in verdicts if v.action.value != "continue" or v.skip]


def record(path: str) -> None:
    """Write every stream's verdict rows to ``path`` (gzip JSON), the format test_recorded reads.
    Re-record only on purpose, and say in the commit which verdicts moved and why."""
    import gzip
    import json

    from spikeguard.detector.detector import SpikeDetector

    out = {}
    for name, (metrics, config) in sorted(streams().items()):
        detector = SpikeDetector(config)
        out[name] = {"n": len(metrics), "rows": verdict_rows(detector.update(m) for m in metrics)}
    with gzip.open(path, "wt") as f:
        json.dump(out, f)


if __name__ == "__main__":  # PYTHONPATH=src:. python -m tests.verdict_streams
    from pathlib import Path

    record(str(Path(__file__).parent / "data" / "verdicts.json.gz"))
