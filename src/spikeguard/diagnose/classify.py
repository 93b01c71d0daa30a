"""Classify spikes by replaying the real SpikeDetector over the log, and say what to do.

The detector (``spikeguard.detector.detector.SpikeDetector``) is the one implementation of the
tiers: diagnose feeds it the log's records in step order and keeps every verdict that is not
CONTINUE. A found spike and the verdicts around it (each spanning its ``onset_step`` to its step)
merge into one event; its tier is the highest verdict tier in it, and its action the recommended
one: skip; roll back to the checkpoint the Guard would pick (``rollback_step``); add z-loss 1e-4
when log Z led; change precision after a non-finite step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..record import Action, StepMetrics
from ._detector import DetectorConfig, SpikeDetector, Verdict, rollback_target
from ._runlog import recorded_summary
from .readers import MetricsLog

__all__ = ["Event", "Replay", "events", "recorded_whatif", "replay", "replay_config",
           "rollback_step", "whatif"]


def rollback_step(onset: int, every: int | list[int] | None) -> int | None:
    """The step to roll back to for an anomaly that began at step ``onset``.

    With checkpoints every ``every`` steps: the Guard's rule,
    ``checkpoint.manager.rollback_target`` (the newest checkpoint at or before onset - 2, since
    update onset - 1 may itself be the cause; None when none exists). With ``every`` None (the
    interval unknown): onset - 2 itself, the newest step whose checkpoint would be safe.
    """
    if every is None:
        return onset - 2 if onset >= 2 else None
    if isinstance(every, list):  # the steps of the run's own checkpoints
        return rollback_target(onset, every)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"--ckpt-every={every!r} must be an integer >= 1 (the checkpoint "
                         "interval in steps, e.g. 1000)")
    return rollback_target(onset, every)


def _window_fields() -> tuple[str, ...]:
    """The DetectorConfig windows: the fields ``for_run`` scales with the run's length (learned
    from for_run itself; the arming delay, which has a floor, is not one of them)."""
    a, b = DetectorConfig.for_run(4), DetectorConfig.for_run(8)
    return tuple(f.name for f in dataclasses.fields(DetectorConfig)
                 if (getattr(a, f.name), getattr(b, f.name)) == (1, 2))


_MIN_EMA_RECORDS = 5  # a loss EMA over fewer records of a sparse log is one batch's loss


def replay_config(log: MetricsLog, **overrides: Any) -> DetectorConfig:
    """The detector configuration for replaying ``log``, windows in steps.

    A spikeguard run's own thresholds when its ``config.json`` sits beside the log; otherwise
    ``DetectorConfig.for_run`` over the steps the log covers, each window (which counts updates,
    one per record here) divided by the stride of a sparse log, the loss EMAs kept at 5 records
    at least. Where the log's record-to-record noise would make the short loss EMA move by more
    than a sixth of ``spike_nats`` (single-batch losses a few hundred steps apart; the noise
    measured before the first jump or non-finite value, ``spikes.quiet_noise``), ``spike_nats``
    and ``loss_onset_nats`` are raised to 6 standard errors of that EMA: a rise smaller than that
    cannot be told from noise in such a log (``Diagnosis.notes`` says so). Then ``overrides``
    (explicit flags) are applied.
    """
    run = log.run_config or {}
    if run.get("detector"):
        known = {f.name for f in dataclasses.fields(DetectorConfig)}
        cfg = {k: v for k, v in run["detector"].items() if k in known}
        cfg = DetectorConfig(**cfg).to_dict()
    else:
        n = max(4, len(log))
        # no quiet arming for the grad rule: a log from another trainer is read for every
        # grad-norm spike, early ones included (nothing is skipped on its account)
        cfg = DetectorConfig.for_run(n, grad_arm_quiet=0).to_dict()
        if log.stride > 1:
            full = DetectorConfig()
            for name in _window_fields():
                cfg[name] = max(1, min(round(getattr(full, name) / log.stride), n // 4))
            for name in ("loss_ema_steps", "recovery_ema_steps"):
                cfg[name] = max(cfg[name], min(_MIN_EMA_RECORDS, n // 4 or 1))
        if run.get("vocab_size"):
            cfg["vocab_size"] = run["vocab_size"]
        if "loss" in log.columns and "spike_nats" not in overrides:
            from .spikes import quiet_noise

            span = cfg["recovery_ema_steps"]
            nats = 6.0 * quiet_noise(log) / math.sqrt(2 * span - 1)
            if nats > cfg["spike_nats"]:
                scale = nats / cfg["spike_nats"]
                cfg["spike_nats"] = round(nats, 3)
                cfg["loss_onset_nats"] = round(cfg["loss_onset_nats"] * scale, 3)
    cfg.update(overrides)
    return DetectorConfig(**cfg)


@dataclass
class Replay:
    """What the detector decided over a whole log."""

    config: DetectorConfig
    """The thresholds replayed."""
    flagged: list[Verdict]
    """Every verdict whose action is not CONTINUE, in step order."""
    seconds: float
    """Wall time of the replay."""
    trace: dict[str, np.ndarray] = field(default_factory=dict)
    """Per record, when traced: the detector's grad_median, loss_ema_ratio and log_z_median."""


_TRACE = ("grad_median", "loss_ema_ratio", "log_z_median")
_ORDER = ("step", "loss", "grad_norm", "log_z", "nan_frac", "loss_ema_ratio", "lr", "grad_scale")


def _by_name(*values: Any) -> StepMetrics:
    return StepMetrics(**dict(zip(_ORDER, values)))


def _step_metrics() -> Any:
    """StepMetrics built from positional arguments in ``_ORDER`` (the faster call), or by
    keyword should the dataclass's field order ever change."""
    if tuple(f.name for f in dataclasses.fields(StepMetrics))[: len(_ORDER)] == _ORDER:
        return StepMetrics
    return _by_name


def replay(log: MetricsLog, config: DetectorConfig, *, trace: bool = False) -> Replay:
    """Feed every record of ``log`` to a fresh ``SpikeDetector(config)``.

    A missing loss or grad norm column is fed as a constant 1.0 (its rules stay silent), a
    missing log Z as NaN and a missing nan_frac as 0; a missing cell of the loss or grad norm
    as the last finite value before it (never a logged NaN or inf: a blank is not a fault). An
    ``update_ratio`` column (the signals' reading) goes to the update-ratio rule. The loss scale
    is not fed: the records whose update the scaler skipped are left out before the replay
    (``precision.analyse``), so a non-finite value here is never a scaler's overflow.
    """
    n = len(log)
    cols = log.columns
    ones = [1.0] * n
    loss = _fed(log, "loss").tolist() if "loss" in cols else ones
    grad = _fed(log, "grad_norm").tolist() if "grad_norm" in cols else ones
    log_z = cols["log_z"].tolist() if "log_z" in cols else [math.nan] * n
    nf = np.nan_to_num(cols["nan_frac"], nan=0.0).tolist() if "nan_frac" in cols else [0.0] * n
    update = SpikeDetector(config).update
    make = _step_metrics()
    cont = Action.CONTINUE
    # no grad_scale: the scaler's skips are judged by ``precision`` and left out of the log
    # replayed, so every non-finite value the detector sees is a failure (a NaN loss above all)
    columns: list[Any] = [log.steps.tolist(), loss, grad, log_z, nf]
    metrics = map(make, *columns)  # C-level loops: no per-step unpacking
    if "update_ratio" in cols:  # the signals' reading (spikeguard's own logs): UpdateJump
        ratios = cols["update_ratio"].tolist()
        verdicts = map(lambda m, r: update(m, update_ratio=r), metrics, ratios)
    else:
        verdicts = map(update, metrics)
    # C doubles, not lists of float objects: keeping a million of the detector's floats alive
    # scatters the allocator's pools and slows the detector itself
    out: dict[str, array] = {k: array("d") for k in _TRACE} if trace else {}
    t0 = time.perf_counter()
    if trace:
        flagged: list[Verdict] = []
        gm, rt, zm = (out[k].append for k in _TRACE)
        nan = math.nan
        for v in verdicts:
            ev = v.evidence
            gm(ev.get("grad_median", nan))
            rt(ev.get("loss_ema_ratio", nan))
            zm(ev.get("log_z_median", nan))
            if v.action is not cont:
                flagged.append(v)
    else:
        flagged = [v for v in verdicts if v.action is not cont]
    seconds = time.perf_counter() - t0
    arrays = {k: np.frombuffer(v, dtype=np.float64).copy() for k, v in out.items()}
    return Replay(config, flagged, seconds, arrays)


def _fed(log: MetricsLog, name: str) -> np.ndarray:
    """The column as the detector is fed it: missing cells hold the last finite value."""
    x = log.columns[name]
    miss = log.missing.get(name)
    if miss is None or not miss.any():
        return x
    from .spikes import ffill

    return np.where(miss, ffill(np.where(np.isfinite(x) & ~miss, x, np.nan)), x)


@dataclass
class Event:
    """One stretch of trouble: found spikes and the detector's verdicts that overlap it."""

    start: int
    """First step (the earliest onset)."""
    end: int
    """Last step."""
    found: list[Any] = field(default_factory=list)
    """The ``spikes.Found`` stretches in it."""
    verdicts: list[Verdict] = field(default_factory=list)
    """The detector's non-CONTINUE verdicts of Tier >= 1 in it."""
    advice: list[Verdict] = field(default_factory=list)
    """Tier 0 verdicts in it (z-loss advice, fp16 overflows)."""


def events(log: MetricsLog, found: list[Any], rep: Replay) -> list[Event]:
    """Merge found stretches and Tier >= 1 verdicts (a Tier 2 or 3 one spanning its onset to its
    step) into events where they overlap or touch (adjacent records); Tier 0 verdicts join the
    event whose span holds them."""
    items: list[tuple[int, int, Any]] = [(int(log.steps[f.i0]), int(log.steps[f.i1]), f)
                                         for f in found]
    # a Tier 1 verdict decides one step: spanning it back to its onset would merge outliers that
    # are apart (the loss back at its level between them); Tier 2 spans its onset
    items += [((min(v.step, v.onset_step) if v.tier >= 2 and v.onset_step is not None
                else v.step), v.step, v)
              for v in rep.flagged if v.tier >= 1]
    items.sort(key=lambda t: (t[0], t[1]))
    out: list[Event] = []
    for a, b, item in items:
        if not out or int(np.searchsorted(log.steps, a)) > \
                int(np.searchsorted(log.steps, out[-1].end, side="right")):
            out.append(Event(a, b))
        ev = out[-1]
        ev.end = max(ev.end, b)
        (ev.verdicts if isinstance(item, Verdict) else ev.found).append(item)
    zero = [v for v in rep.flagged if v.tier == 0]
    starts = np.array([e.start for e in out], dtype=np.int64)
    for v in zero:
        k = int(np.searchsorted(starts, v.step, side="right")) - 1
        if k >= 0 and v.step <= out[k].end:
            out[k].advice.append(v)
    return out


def whatif(rep: Replay, ckpt_every: int | None) -> dict[str, Any]:
    """The steps ``rep`` would have skipped, rolled back (and to where) and halted."""
    skip = [v.step for v in rep.flagged if v.action is Action.SKIP and v.tier >= 1]
    rollback = [{"step": v.step, "onset": v.onset_step,
                 "to": rollback_step(v.onset_step if v.onset_step is not None else v.step,
                                     ckpt_every)}
                for v in rep.flagged if v.tier == 2]  # under tier2="rollback"
    halt = [v.step for v in rep.flagged if v.action is Action.HALT]
    alerts = sum(1 for v in rep.flagged if v.action is Action.ALERT and v.tier != 2)
    scaler = sum(1 for v in rep.flagged if v.action is Action.SKIP and v.tier == 0)
    return {"skip": skip, "drop": [], "rollback": rollback, "halt": halt, "alerts": alerts,
            "scaler_skips": scaler, "seconds": rep.seconds}


def recorded_whatif(log: MetricsLog) -> dict[str, Any] | None:
    """What the run itself did, counted from a spikeguard log's records in run order (replays
    included; ``_runlog.recorded_summary``); None when the log has no ``action`` column."""
    if log.recorded.get("action") is None and not log.events:
        return None
    return recorded_summary(log.events)
