"""``diagnose(path)``: read a log, find its spikes, replay the detector, and say what each was.

The result, a :class:`Diagnosis`, is what the terminal summary, ``--json`` and ``--report``
print. Each :class:`Spike` carries the tier, the recommended action and the evidence; a run's
``quarantine.jsonl`` (the sequences it set aside, one JSON object per line) is read from beside the
log when present and shown with the spike it belongs to.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..record import Action
from ._detector import DetectorConfig
from .classify import (
    Event,
    Replay,
    events,
    recorded_whatif,
    replay,
    replay_config,
    rollback_step,
    whatif,
)
from .evidence import evidence
from .readers import MetricsLog, read_log, read_quarantine
from .spikes import FindConfig, find_spikes

__all__ = ["Diagnosis", "Spike", "diagnose", "spike_from_event"]

Z_LOSS = 1e-4
"""The z-loss coefficient to add when log Z led (PaLM's 1e-4)."""


@dataclass
class Spike:
    """One event of a run, classified. ``to_dict`` is its ``--json`` form."""

    start: int
    """First step: the earliest onset (of the found spike or of a verdict)."""
    end: int
    """Last step of the excursion or of the verdicts."""
    tier: int
    """The highest tier the detector gave in it (0: the detector would not act)."""
    action: str
    """The top verdict's action: skip, rollback, halt, alert, or continue."""
    rollback_step: int | None
    """Tier >= 2: the checkpoint to restore (see ``rollback_step``)."""
    detected: int | None
    """The step of the first verdict at the top tier."""
    cause: str
    """The likely root cause, in a few words."""
    advice: list[str]
    """The recommended actions, in order."""
    reasons: list[str]
    """The detector's reasons, in order of first appearance."""
    skipped: list[int]
    """Steps the detector would skip in it."""
    kinds: list[str]
    """How the search found it: persistent, grad_outlier, loss_outlier, nonfinite, detector."""
    evidence: dict[str, Any]
    """The numbers: which metric moved first, grad ratio, log Z trend, recovery, NaN."""
    quarantine: list[dict[str, Any]] = field(default_factory=list)
    """Sequences the run quarantined at steps in this spike."""

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return _jsonable(x.item())
    return x


def _metric(reason: str) -> str:
    return reason.split(" ", 1)[0]


def _cause(tier: int, reasons: list[str], ev: dict[str, Any], z_led: bool) -> str:
    if tier == 3:
        return ("numerical failure (NaN or inf)" if ev.get("nan")
                else "loss far above the model's range without a grad-norm spike")
    if tier == 2:
        if z_led:
            return "logit drift: log Z rose first"
        if any(r.startswith("skips") for r in reasons):
            return "skip storm: gradient explosion or a bad learning rate"
        if "grad_norm" in ev.get("moved_first", []):
            return "gradient explosion"
        return "the loss did not recover: structural damage to the weights or optimizer state"
    if tier == 1:
        if ev.get("recovered") is False:
            return "large step(s); the loss had not recovered by the end of the log"
        return "data anomaly: a bad batch, the loss recovers"
    if "scaler" in reasons:
        return "fp16 loss-scale overflow: GradScaler skipped the step"
    return "below the detector's thresholds"


def spike_from_event(log: MetricsLog, ev: Event, rep: Replay, *, ckpt_every: int | None,
                     cfg: FindConfig) -> Spike:
    """Classify one event: tier and action from its verdicts, evidence from the log around it."""
    det = rep.config
    vs = ev.verdicts
    tier = max((v.tier for v in vs), default=0)
    top = next((v for v in vs if v.tier == tier), None)
    onsets = [v.onset_step for v in vs if v.onset_step is not None]
    found_start = min((int(log.steps[f.i0]) for f in ev.found), default=None)
    start = min([*onsets, *([found_start] if found_start is not None else []), ev.start])
    i0 = int(np.searchsorted(log.steps, start))
    i1 = int(np.searchsorted(log.steps, ev.end, side="right")) - 1
    pre = next((f.pre_level for f in ev.found if not math.isnan(f.pre_level)), math.nan)
    ratio = rep.trace.get("loss_ema_ratio")
    evd = evidence(log, i0, max(i0, i1), pre_level=pre, det=det, cfg=cfg, ratio=ratio)
    reasons = list(dict.fromkeys(r for v in [*vs, *ev.advice] for r in v.reasons))
    skipped = [v.step for v in vs if v.skip]
    z_led = (top is not None and bool(top.reasons) and _metric(top.reasons[0]) == "log_z") or \
        evd.get("moved_first") == ["log_z"]
    rb = rollback_step(start, ckpt_every) if tier >= 2 else None
    where = (f"the checkpoint at step {rb:,}" if ckpt_every is not None and rb is not None
             else f"a checkpoint at or before step {rb:,}" if rb is not None
             else "the start of the run (no checkpoint predates the onset)")
    advice: list[str] = []
    if tier == 1 and skipped:
        shown = ", ".join(f"{s:,}" for s in skipped[:5]) + (" ..." if len(skipped) > 5 else "")
        advice.append(f"skip the update at step {shown}; inspect that batch's data")
    elif tier == 1:
        advice.append("watch: the loss ratio passed the alert level; no skip needed")
    if tier >= 2:
        advice.append(f"roll back to {where}")
        if top is not None:
            span = f"step {start:,}" if top.step == start else f"steps {start:,}-{top.step:,}"
            advice.append(f"skip the data of {span}")
    if tier == 2 and z_led:
        advice.append(f"add z-loss {Z_LOSS:g} (or raise it) before resuming")
    if tier == 3:
        advice.append("change precision before resuming (fp16 -> bf16, or the failing layer "
                      "from fp8 back to bf16) and find the first non-finite tensor")
    if "add or raise z-loss" in reasons and not any("z-loss" in a for a in advice):
        advice.append(f"add z-loss {Z_LOSS:g}: log Z is above 12 and rising")
    kinds = sorted({k for f in ev.found for k in f.kinds} | ({"detector"} if vs else set()))
    return Spike(start=start, end=ev.end, tier=tier,
                 action=(top.action.value if top is not None else Action.CONTINUE.value),
                 rollback_step=rb, detected=top.step if top is not None else None,
                 cause=_cause(tier, reasons, evd, z_led), advice=advice, reasons=reasons,
                 skipped=skipped, kinds=kinds, evidence=evd)


@dataclass
class Diagnosis:
    """Everything ``spikeguard diagnose`` reports about one log."""

    log: MetricsLog
    spikes: list[Spike]
    replay: Replay
    whatif: dict[str, Any]
    """The primary configuration's skips, rollbacks and halts (``classify.whatif``)."""
    compare: dict[str, Any] | None
    """The same for the ``--compare`` configuration, with its ``changes``."""
    recorded: dict[str, Any] | None
    """What the run itself did, when its log says."""
    ckpt_every: int | None
    find: FindConfig
    quarantine_unmatched: list[dict[str, Any]]
    timings: dict[str, float]
    """Seconds: read, search, replay, classify, whatif (and report, once written)."""

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object: a ``spikes`` list and the context to read it."""
        log = self.log
        return _jsonable({
            "path": log.path, "format": log.format, "records": len(log),
            "steps": [int(log.steps[0]), int(log.steps[-1])], "stride": log.stride,
            "metrics": list(log.columns), "warnings": log.warnings,
            "ckpt_every": self.ckpt_every, "detector": self.replay.config.to_dict(),
            "find": asdict(self.find),
            "spikes": [s.to_dict() for s in self.spikes],
            "whatif": self.whatif, "compare": self.compare, "recorded": self.recorded,
            "quarantine_unmatched": self.quarantine_unmatched, "timings": self.timings,
        })


def diagnose(path: str | os.PathLike[str], *, fmt: str = "auto",
             mapping: dict[str, str] | None = None, detector: dict[str, Any] | None = None,
             compare: dict[str, Any] | None = None, ckpt_every: int | None = None,
             find: FindConfig | None = None, quarantine: str | os.PathLike[str] | None = None,
             trace: bool = True) -> Diagnosis:
    """Triage the metrics log at ``path``.

    ``detector``: DetectorConfig fields to override (the rest sized to the log by
    ``replay_config``); ``compare``: fields changed on top of those for a second replay, side by
    side; ``ckpt_every``: the run's checkpoint interval, for rollback steps; ``quarantine``: the
    quarantine file (default ``quarantine.jsonl`` beside the log); ``trace`` keeps the detector's
    running medians and loss ratio per step for the plots.
    """
    if ckpt_every is not None:
        rollback_step(2, ckpt_every)  # validates it
    find = find or FindConfig()
    t = {"read": time.perf_counter()}
    log = read_log(path, fmt=fmt, mapping=mapping)
    t["search"] = time.perf_counter()
    config = replay_config(log, **(detector or {}))
    found = find_spikes(log, config, find)
    t["replay"] = time.perf_counter()
    rep = replay(log, config, trace=trace)
    t["classify"] = time.perf_counter()
    evs = events(log, found, rep)
    spikes = [spike_from_event(log, e, rep, ckpt_every=ckpt_every, cfg=find) for e in evs]
    t["whatif"] = time.perf_counter()
    other = None
    if compare:
        alt = DetectorConfig(**{**config.to_dict(), **compare})
        other = whatif(replay(log, alt), ckpt_every)
        other["changes"] = dict(compare)
    t["end"] = time.perf_counter()
    names = list(t)
    timings = {names[i]: t[names[i + 1]] - t[names[i]] for i in range(len(names) - 1)}
    qpath = Path(quarantine) if quarantine else Path(log.path).parent / "quarantine.jsonl"
    unmatched = _attach(spikes, read_quarantine(qpath, log.warnings))
    return Diagnosis(log, spikes, rep, whatif(rep, ckpt_every), other, recorded_whatif(log),
                     ckpt_every, find, unmatched, timings)


def _attach(spikes: list[Spike], quarantined: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give each quarantined sequence to the spike whose span holds its step; return the rest."""
    rest = []
    for q in quarantined:
        home = next((s for s in spikes if s.start <= q["step"] <= s.end), None)
        (home.quarantine if home is not None else rest).append(q)
    return rest
