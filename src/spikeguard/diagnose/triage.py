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
from ._detector import DetectorConfig, rollback_target
from ._runlog import checkpoint_steps
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
from .precision import Finding, PrecisionReport, analyse
from .readers import MetricsLog, read_log, read_quarantine, subset
from .spikes import FindConfig, find_spikes, level_records, quiet_noise

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
    """Steps the detector would skip (Tier 1) in it; a rollback's own step is in its data range."""
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


_KIND_TIER = {"blowup": 3, "jump": 2}
"""Tiers the search gives by itself, whatever the detector's arming (a non-finite value is the
detector's own Tier 3, or Tier 0 for an fp16 overflow the scaler handled)."""
_KIND_ACTION = {3: Action.HALT.value, 2: Action.ROLLBACK.value}


def _g(x: float) -> str:
    return f"{x:.4g}"


def _cause(tier: int, reasons: list[str], ev: dict[str, Any], z_led: bool, kinds: set[str],
           grad_k: float) -> str:
    """The likely cause, in a sentence built only from the numbers it cites."""
    pre, peak = ev.get("pre_spike_loss"), ev.get("loss_peak")
    rose, rec = ev.get("loss_rose"), ev.get("recovery_steps")
    loss_txt = (f"loss {_g(pre)} (median before) -> {_g(peak)}" if pre is not None and
                peak is not None else None)
    ratio = ev.get("grad_ratio")
    grad_txt = (f"grad norm {ratio:,.0f}x its median" if ratio is not None and ratio >= 100
                else f"grad norm {ratio:.3g}x its median" if ratio is not None and ratio > grad_k
                else None)
    back = (f", back within {rec:,} step{'s' if rec != 1 else ''}" if rec is not None
            else ", not back by the end of the log" if rose else "")
    if tier == 3:
        if ev.get("nan"):
            return f"numerical failure: NaN/inf from step {ev['first_nonfinite_step']:,}"
        if "blowup" in kinds and loss_txt and pre:
            return f"blow-up: {loss_txt} ({peak / pre:.3g}x), far outside the model's range"
        return f"{loss_txt or 'the loss'} far above the model's range without a grad-norm spike"
    if tier == 2:
        if z_led:
            rise = ev.get("log_z_rise")
            return "logit drift: log Z rose first" + (f" ({rise:+.2f})" if rise is not None else "")
        if any(r.startswith("skips") for r in reasons):
            return "skip storm: " + (grad_txt or loss_txt or "repeated skips") + \
                " (a gradient explosion or a bad learning rate)"
        if "jump" in kinds and loss_txt and rose:
            return f"the loss jumped, {loss_txt}, and stayed up{back}"
        if "grad_norm" in ev.get("moved_first", []) and grad_txt:
            return f"gradient explosion: {grad_txt}, moving first" + (f"; {loss_txt}{back}"
                                                                    if rose else "")
        if rose and loss_txt:
            return f"the loss rose and stayed up, {loss_txt}{back}: damage to the weights or " \
                "optimizer state"
        return "the detector's Tier 2 rule: " + ", ".join(reasons[:2])
    if tier == 1:
        if rose and loss_txt:
            head = "a bad batch" if rec is not None else "large step(s)"
            return f"{head}: {loss_txt}{back}" + (f"; {grad_txt}" if grad_txt else "")
        if grad_txt:
            return f"a grad-norm outlier with an ordinary loss: {grad_txt}"
        return "the detector's Tier 1 rule: " + ", ".join(reasons[:2])
    if "small" in kinds and loss_txt:
        return f"a rise too small to matter: {loss_txt}, under spike_nats in absolute terms"
    if "recovered" in kinds and loss_txt:
        return (f"a one-step loss outlier, {loss_txt}, back at the next record (the update was "
                "applied and the loss shows no lasting harm)")
    if "scaler" in reasons:
        return "fp16 loss-scale overflow: GradScaler skipped the step"
    what = "; ".join(x for x in (f"{loss_txt}{back}" if rose and loss_txt else None, grad_txt)
                     if x)
    if "unarmed" in kinds:
        return ("before the detector was armed (too few updates of history to judge)"
                + (f": {what}" if what else ""))
    return "below the detector's thresholds" + (f": {what}" if what else "")


def _precision_advice(precision: str | None) -> str:
    """Advice after a non-finite value: precision advice only where the precision is known."""
    if precision == "fp16":
        return ("change precision before resuming (fp16 -> bf16, or fp32 for the layer that "
                "overflows) and find the first non-finite tensor")
    if precision is None:
        return ("find the first non-finite tensor (the halt report names it) and lower the "
                "learning rate or clip harder before resuming (the log does not say the "
                "precision, so no precision advice)")
    return (f"the run is {precision}, so not an fp16 overflow: find the first non-finite tensor "
            "(the halt report names it) and lower the learning rate or clip harder before resuming")


def _span(steps: np.ndarray, start: int) -> int:
    """The step after the record before ``start``: on a log written every N steps the update
    that started an event lies between the previous record and ``start``."""
    i = int(np.searchsorted(steps, start))
    return int(steps[i - 1]) + 1 if i > 0 else start


def _where(rb: int | None, ckpts: int | list[int] | None) -> str:
    if rb is None:
        return "the start of the run (no checkpoint predates the onset)"
    if isinstance(ckpts, list):
        return f"the checkpoint at step {rb:,} (the run's own)"
    if ckpts is not None:
        return f"the checkpoint at step {rb:,}"
    return f"a checkpoint at or before step {rb:,}"


def _rollback(onset: int, ckpts: int | list[int] | None) -> int | None:
    if isinstance(ckpts, list):
        return rollback_target(onset, ckpts)
    return rollback_step(onset, ckpts)


def _applied_and_harmless(log: MetricsLog, evd: dict[str, Any], reasons: list[str],
                          det: DetectorConfig, i0: int, i1: int) -> bool:
    """A one-record loss outlier in a log whose trainer applied every update (no guard
    recorded its actions), below the detector's skip ratio, with the loss back within the noise
    margin at the next logged record: the logged values show the batch did no lasting harm, so
    there is nothing left to do (Tier 0, listed with its size)."""
    if log.recorded or i1 != i0 or not reasons or any(not r.startswith("loss") for r in reasons):
        return False
    rec, peak = evd.get("recovery_steps"), evd.get("loss_ema_ratio_peak")
    nxt = int(log.steps[i1 + 1] - log.steps[i0]) if i1 + 1 < len(log) else None
    return (rec is not None and nxt is not None and rec <= nxt
            and (peak is None or peak < det.skip_ratio))


def _too_small(evd: dict[str, Any], reasons: list[str], det: DetectorConfig) -> bool:
    """A loss-only Tier 1 whose rise is under ``spike_nats`` in absolute terms: a relative
    jump on a loss near zero (0.001 -> 0.004) moves nothing that matters."""
    pre, peak = evd.get("pre_spike_loss"), evd.get("loss_peak")
    return bool(reasons and all(r.startswith("loss") for r in reasons) and pre is not None
                and peak is not None and peak - pre < det.spike_nats)


def _event_advice(log: MetricsLog, tier: int, skipped: list[int], rb: int | None,
                  ckpt_every: int | list[int] | None, first_bad: int, end: int, z_led: bool,
                  reasons: list[str], precision: str | None) -> list[str]:
    """What to do about an event: only what applies to this run (its checkpoints, its
    precision, its z-loss)."""
    advice: list[str] = []
    if tier == 1 and skipped:
        shown = ", ".join(f"{s:,}" for s in skipped[:5]) + (" ..." if len(skipped) > 5 else "")
        advice.append(f"skip the update at step {shown}; inspect that batch's data")
    elif tier == 1:
        advice.append("watch: the loss ratio passed the alert level; no skip needed")
    if tier >= 2:
        advice.append(f"roll back to {_where(rb, ckpt_every)}")
        span = f"step {first_bad:,}" if end == first_bad else f"steps {first_bad:,}-{end:,}"
        advice.append(f"skip the data of {span}")
    z_on = (log.run_config or {}).get("z_loss")
    if tier == 2 and z_led:
        advice.append(f"z-loss is already on ({z_on:g}): lower the learning rate, or raise z-loss, "
                      "before resuming" if z_on else
                      f"add z-loss {Z_LOSS:g} (or raise it) before resuming")
    if tier == 3:
        advice.append(_precision_advice(precision))
    if "add or raise z-loss" in reasons and not any("z-loss" in a for a in advice) and not z_on:
        advice.append(f"add z-loss {Z_LOSS:g}: log Z is above 12 and rising")
    return advice


def spike_from_event(log: MetricsLog, ev: Event, rep: Replay, *,
                     ckpt_every: int | list[int] | None, cfg: FindConfig,
                     precision: str | None = None) -> Spike:
    """Classify one event: tier and action from its verdicts and what the search found (a jump
    that stays is Tier 2, a blow-up or a non-finite value Tier 3, whatever the arming),
    evidence from the logged values around it. ``ckpt_every`` is the checkpoint interval or the
    steps of the run's own checkpoints; ``precision`` the run's, when known."""
    det = rep.config
    vs = ev.verdicts
    kinds = {k for f in ev.found for k in f.kinds}
    vtier = max((v.tier for v in vs), default=0)
    ktier = max((_KIND_TIER.get(k, 0) for k in kinds), default=0)
    tier = max(vtier, ktier)
    top = next((v for v in vs if v.tier == tier), None)
    onsets = [v.onset_step for v in vs if v.onset_step is not None and v.tier >= 2]
    found_start = min((int(log.steps[f.i0]) for f in ev.found), default=None)
    start = min([*onsets, *([found_start] if found_start is not None else []), ev.start])
    i0 = int(np.searchsorted(log.steps, start))
    i1 = int(np.searchsorted(log.steps, ev.end, side="right")) - 1
    ratio = rep.trace.get("loss_ema_ratio")
    evd = evidence(log, i0, max(i0, i1), det=det, cfg=cfg, ratio=ratio,
                   grad_median=rep.trace.get("grad_median"))
    reasons = list(dict.fromkeys(r for v in [*vs, *ev.advice] for r in v.reasons))
    skipped = sorted(v.step for v in vs if v.skip and v.action is Action.SKIP)
    z_led = (top is not None and bool(top.reasons) and _metric(top.reasons[0]) == "log_z") or \
        evd.get("moved_first") == ["log_z"]
    if top is None and ktier:  # the search's own tier: the first record of that kind
        first = min(int(log.steps[f.i0]) for f in ev.found
                    if any(_KIND_TIER.get(k, 0) == ktier for k in f.kinds))
        detected, action = first, _KIND_ACTION[ktier]
        reasons = [*reasons, {"jump": "loss jumped and stayed", "blowup": "loss blow-up"}[
            max((k for k in kinds if k in _KIND_TIER), key=_KIND_TIER.get)]]
    else:
        detected = top.step if top is not None else None
        action = (Action.CONTINUE.value if top is None  # Tier 2: what tier2="rollback" does
                  else Action.ROLLBACK.value if top.tier == 2 else top.action.value)
    if tier == 1 and _applied_and_harmless(log, evd, reasons, det, i0, i1):
        tier, action, detected = 0, Action.CONTINUE.value, None
        kinds = kinds | {"recovered"}
    elif tier == 1 and _too_small(evd, reasons, det):
        tier, action, detected = 0, Action.CONTINUE.value, None
        kinds = kinds | {"small"}
    # on a log written every N steps the first bad update lies after the record before start
    first_bad = _span(log.steps, start)
    rb = _rollback(first_bad, ckpt_every) if tier >= 2 else None
    advice = _event_advice(log, tier, skipped, rb, ckpt_every, first_bad,
                           detected if detected is not None else ev.end, z_led, reasons,
                           precision)
    if tier == 0 and i0 < det.arm_after:
        kinds = kinds | {"unarmed"}
    kinds_out = sorted(kinds | ({"detector"} if vs else set()))
    return Spike(start=start, end=ev.end, tier=tier, action=action, rollback_step=rb,
                 detected=detected, cause=_cause(tier, reasons, evd, z_led, kinds, det.grad_k),
                 advice=advice, reasons=reasons, skipped=skipped, kinds=kinds_out, evidence=evd)


def spike_from_finding(log: MetricsLog, f: Finding, *,
                       ckpt_every: int | list[int] | None) -> Spike:
    """A precision finding as a diagnosis entry: Tier 0 (the scaler's routine skips, counted)
    or Tier 3 (fp16 itself failed: halt, roll back, change precision)."""
    advice = list(f.advice)
    rb = None
    if f.tier == 3:
        rb = _rollback(_span(log.steps, f.start), ckpt_every)
        advice = ["halt", f"roll back to {_where(rb, ckpt_every)}", *advice]
    action = Action.HALT.value if f.tier == 3 else Action.CONTINUE.value
    return Spike(start=f.start, end=f.end, tier=f.tier, action=action, rollback_step=rb,
                 detected=f.start if f.tier == 3 else None, cause=f.cause, advice=advice,
                 reasons=[f.kind], skipped=[], kinds=["precision"], evidence=dict(f.evidence))


@dataclass
class Diagnosis:
    """Everything ``spikeguard diagnose`` reports about one log."""

    log: MetricsLog
    spikes: list[Spike]
    """Events the detector or the search gives Tier 1 or more: something to act on or watch."""
    replay: Replay
    whatif: dict[str, Any]
    """The primary configuration's skips, rollbacks and halts (``classify.whatif``)."""
    compare: dict[str, Any] | None
    """The same for the ``--compare`` configuration, with its ``changes``."""
    recorded: dict[str, Any] | None
    """What the run itself did, counted from its records (``_runlog.recorded_summary``)."""
    ckpt_every: int | None
    find: FindConfig
    quarantine_unmatched: list[dict[str, Any]]
    timings: dict[str, float]
    """Seconds: read, search, replay, classify, whatif (and report, once written)."""
    below: list[Spike] = field(default_factory=list)
    """Tier 0 entries, listed apart: outliers below every threshold, z-loss advice, fp16
    overflows the scaler handled."""
    notes: list[str] = field(default_factory=list)
    """What the log let diagnose see and what not (sparse records, noise, the run's config)."""
    precision: PrecisionReport | None = None
    """The precision, how it is known, the scaler's skips and fp16 failures (``precision``)."""
    checkpoints: list[int] | None = None
    """The steps of the run's own checkpoints found beside the log (rollback targets)."""

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object: a ``spikes`` list, the Tier 0 ``below`` list, and the context
        to read them."""
        log = self.log
        return _jsonable({
            "path": log.path, "format": log.format, "records": len(log),
            "steps": [int(log.steps[0]), int(log.steps[-1])], "stride": log.stride,
            "metrics": list(log.columns), "warnings": log.warnings, "notes": self.notes,
            "ckpt_every": self.ckpt_every, "checkpoints": self.checkpoints,
            "precision": self.precision.to_dict() if self.precision else None,
            "detector": self.replay.config.to_dict(),
            "find": asdict(self.find),
            "spikes": [s.to_dict() for s in self.spikes],
            "below": [s.to_dict() for s in self.below],
            "replays": log.replays,
            "whatif": self.whatif, "compare": self.compare, "recorded": self.recorded,
            "quarantine_unmatched": self.quarantine_unmatched, "timings": self.timings,
        })


def _notes(log: MetricsLog, config: DetectorConfig, find: FindConfig,
           prec: PrecisionReport | None = None, ckpts: list[int] | None = None) -> list[str]:
    out = []
    if prec is not None:
        out.append(f"precision: {prec.precision or 'unknown'} ({prec.source})" + (
            f"; the loss scaler skipped {prec.scaler_skips:,} update(s)"
            if prec.scaler_skips else ""))
    if ckpts:
        shown = ", ".join(f"{c:,}" for c in ckpts[-5:])
        out.append(f"the run's own checkpoints found beside the log ({len(ckpts)}; last: {shown}):"
                   " rollback targets are chosen among them")
    run = log.run_config
    if run:
        out.append(f"read the run's {Path(run['path']).name}: checkpoints every "
                   f"{run.get('ckpt_every')} steps, precision {run.get('precision')}, Tier 2 "
                   f"{run.get('tier2')}; replayed with the run's own detector thresholds")
    if log.stride > 1:
        n = level_records(find, log.stride)
        out.append(f"one record every {log.stride} steps: a persistent spike must last about "
                   f"{n * log.stride:,} steps ({n} records) to be told from a single batch; a "
                   "bad step between two records cannot be seen, so the steps in the advice "
                   "start after the record before each event (what the interval can tell)")
    if config.spike_nats > DetectorConfig().spike_nats and not run:
        sigma = quiet_noise(log, find) if "loss" in log.columns else math.nan
        out.append(f"the loss moves {sigma:.3g} nats from record to record (measured before the "
                   f"first jump or non-finite value): rises under "
                   f"{config.spike_nats:g} nats (6 standard errors of the "
                   f"{config.recovery_ema_steps}-record loss EMA, instead of 0.1) cannot be told "
                   "from noise here")
    if log.replays:
        out.append("replayed after a rollback (kept apart; the series shows the first "
                   "attempt): " + ", ".join(f"steps {r['steps'][0]:,}-{r['steps'][1]:,} after "
                                            f"the rollback at {r['rollback_at']}"
                                            for r in log.replays))
    return out


def diagnose(path: str | os.PathLike[str], *, fmt: str = "auto",
             mapping: dict[str, str] | None = None, detector: dict[str, Any] | None = None,
             compare: dict[str, Any] | None = None, ckpt_every: int | None = None,
             find: FindConfig | None = None, quarantine: str | os.PathLike[str] | None = None,
             trace: bool = True) -> Diagnosis:
    """Triage the metrics log at ``path``.

    ``detector``: DetectorConfig fields to override (the rest sized to the log by
    ``replay_config``); ``compare``: fields changed on top of those for a second replay, side by
    side; ``ckpt_every``: the run's checkpoint interval, for rollback steps (default: the run's
    ``config.json``, when it sits beside a spikeguard log); ``quarantine``: the quarantine file
    (default ``quarantine.jsonl`` beside the log); ``trace`` keeps the detector's running
    medians and loss ratio per step for the plots.
    """
    if ckpt_every is not None:
        rollback_step(2, ckpt_every)  # validates it
    find = find or FindConfig()
    t = {"read": time.perf_counter()}
    log = read_log(path, fmt=fmt, mapping=mapping)
    if ckpt_every is None and log.run_config and isinstance(log.run_config.get("ckpt_every"), int):
        ckpt_every = log.run_config["ckpt_every"]
    ckpts = checkpoint_steps(Path(log.path).parent)
    targets: int | list[int] | None = ckpts if ckpts else ckpt_every
    t["search"] = time.perf_counter()
    config = replay_config(log, **(detector or {}))
    prec = analyse(log, config)
    # the records whose update the scaler skipped changed nothing: the search and the replay
    # see the run as it was applied
    work = subset(log, ~prec.skip_mask) if prec.skip_mask.any() else log
    found = find_spikes(work, config, find) if len(work) else []
    t["replay"] = time.perf_counter()
    rep = replay(work, config, trace=trace)
    t["classify"] = time.perf_counter()
    evs = events(work, found, rep) if len(work) else []
    classified = [spike_from_event(work, e, rep, ckpt_every=targets, cfg=find,
                                   precision=prec.precision) for e in evs]
    classified += [spike_from_finding(log, f, ckpt_every=targets) for f in prec.findings]
    if work is not log:  # the plots draw the whole log: NaN at the records left out
        _widen(rep, ~prec.skip_mask)
    classified.sort(key=lambda sp: (sp.start, -sp.tier))
    t["whatif"] = time.perf_counter()
    other = None
    if compare:
        alt = DetectorConfig(**{**config.to_dict(), **compare})
        other = whatif(replay(work, alt), targets)
        other["changes"] = dict(compare)
        other["scaler_skips"] = prec.scaler_skips
    t["end"] = time.perf_counter()
    names = list(t)
    timings = {names[i]: t[names[i + 1]] - t[names[i]] for i in range(len(names) - 1)}
    qpath = Path(quarantine) if quarantine else Path(log.path).parent / "quarantine.jsonl"
    spikes = [s for s in classified if s.tier >= 1]
    below = [s for s in classified if s.tier == 0]
    unmatched = _attach(spikes + below, read_quarantine(qpath, log.warnings))
    what = _whatif(rep, targets, prec)
    return Diagnosis(log, spikes, rep, what, other, recorded_whatif(log), ckpt_every, find,
                     unmatched, timings, below,
                     _notes(log, config, find, prec, ckpts) + _differs(what, recorded_whatif(log)),
                     prec, ckpts or None)


def _differs(what: dict[str, Any], recorded: dict[str, Any] | None) -> list[str]:
    """A note where the replay would have acted otherwise than the run recorded, and why the
    two can differ: the run's record is what happened."""
    if recorded is None:
        return []
    diffs = []
    for key, name in (("skip", "skipped"), ("halt", "halted")):
        a, b = sorted(what[key]), sorted(recorded[key])
        if a != b:
            diffs.append(f"{name} {_few(a)} where the run {name} {_few(b)}")
    a = sorted(r["step"] for r in what["rollback"])
    b = sorted(r["step"] for r in recorded["rollback"])
    if a != b:
        diffs.append(f"rolled back at {_few(a)} where the run rolled back at {_few(b)}")
    if not diffs:
        return []
    return ["the replay differs from the run's own record: it " + "; ".join(diffs) + ". The "
            "run's guard also had what a log does not hold (re-runs of the batch, the weights "
            "check, its state across a resume, alerts it was set to give instead of acting), "
            f"so the record is what happened ({recorded['alerts']} alert(s) recorded)"]


def _few(steps: list[int], n: int = 5) -> str:
    if not steps:
        return "nothing"
    return ", ".join(f"{s:,}" for s in steps[:n]) + (f" (+{len(steps) - n})" if len(steps) > n
                                                     else "")


def _whatif(rep: Replay, targets: int | list[int] | None,
            prec: PrecisionReport) -> dict[str, Any]:
    """``classify.whatif`` with the precision report's count of scaler skips and halts."""
    what = whatif(rep, targets)
    if prec.scaler_skips is not None:
        what["scaler_skips"] = prec.scaler_skips
    what["halt"] = sorted({*what["halt"], *(f.start for f in prec.findings if f.tier == 3)})
    return what


def _widen(rep: Replay, kept: np.ndarray) -> None:
    """The replay's per-record traces spread back over the whole log (NaN where ``kept`` is
    False: the records the scaler skipped, left out of the replay)."""
    at = np.flatnonzero(kept)
    for k, v in rep.trace.items():
        full = np.full(len(kept), np.nan)
        full[at] = v
        rep.trace[k] = full


def _attach(spikes: list[Spike], quarantined: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give each quarantined sequence to the spike whose span holds its step; return the rest."""
    rest = []
    for q in quarantined:
        home = next((s for s in spikes if s.start <= q["step"] <= s.end), None)
        (home.quarantine if home is not None else rest).append(q)
    return rest
