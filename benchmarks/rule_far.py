"""Each detector rule's false alarms on recorded clean runs, and its delay on planted faults.

Host only (no training): ``SpikeDetector.update`` replays the recorded loss, grad norm, log Z and
update ratio of the clean runs that ``replay_clean.py`` reads (AdamW on the tiny and demo
reference GPTs, 60-1,000 steps, peak LR 1e-3 to 1e-2, warmup 20; the tiny model at 300 steps
under SGD with momentum, Adam with beta2 0.999, Adafactor and AdamW without warmup), with
``DetectorConfig.for_run(steps, vocab_size=256)``, the warmup given and not given.

The runs are split by seed: even seeds are the tuning half, odd seeds the held-out half
(tiny 0-9, demo 0-4, the other optimizers 0-3). Each rule's events (one per verdict that names
the rule's reason) count as false alarms: per 1,000 steps on which the rule could fire (the
armed steps; for the grad rule the steps from its quiet arming on, ``arm_quiet`` updates in a row
inside its bar counted from ``grad_arm_after`` kept updates; for the joint test with the whole
grad bar the armed steps before that; for the storm test the armed steps right after a
skip), and the average run length between them (those steps
over the alarms).

Detection delay: faults planted in the same recorded streams, at mid-run of the runs of 300 and
1,000 steps (where every rule is armed; the log Z rules arm once log Z is in control), and, for
the joint test before the grad rule arms, midway between the loss rules' arming and the step
where the run as recorded turns its grad rule on: the steps from the fault's first step to the first verdict that names each rule
and that the run as recorded does not have at that step (its own false alarms do not count).
"x1.3" multiplies that step's own loss, "+0.5 nats" adds to every loss from then on.

``--zoo`` replays the zoo's clean settings instead (``grad_tail.py --generate`` records them:
the tiny model under AdamW, SGD, Adafactor and Muon, at batch 4, on Python source and in a
4,096-id BPE, and the HF Llama; seeds 0-7, 300 steps), with the detector the zoo's guard has.

    PYTHONPATH=src:. python benchmarks/rule_far.py [--zoo] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import statistics
from collections.abc import Callable

from benchmarks.grad_tail import series
from benchmarks.replay_clean import clean_runs
from spikeguard.detector import DetectorConfig, SpikeDetector
from spikeguard.detector.rules import GradSpike, LossHalt, LossRatio, LossSpike
from spikeguard.detector.rules_log_z import LogZDrift, LogZJump, LogZRise
from spikeguard.detector.rules_tier2 import (
    LossElevated,
    RatioHeld,
    Recovery,
    SkipStorm,
    UpdateJump,
)
from spikeguard.record import StepMetrics

__all__ = ["main"]

VOCAB = 256  # both reference GPTs read bytes
SKIPS = ("grad", "loss", "joint", "joint, grad rule not armed", "after a skip", "loss/EMA skip")
"""The rules whose event keeps a step out of the histories (a Tier 1 skip)."""
ORDER = ("grad", "loss", "joint", "joint, grad rule not armed", "after a skip", "loss/EMA skip",
         "loss/EMA alert", "loss/EMA held", "elevated loss", "not recovered", "log Z rise",
         "log Z drift", "log Z jump", "update ratio", "skip storm", "skip fraction",
         "Tier 3 loss", "Tier 3 non-finite")


def _labels(c: DetectorConfig) -> dict[str, str]:
    """Each rule's reason string (as the verdict names it) -> the rule's label."""
    ls, lr, storm = LossSpike(c), LossRatio(c), SkipStorm(c)
    return {GradSpike(c).reason: "grad", ls.reason: "loss", ls.joint_reason: "joint",
            ls.early_reason: "joint, grad rule not armed", ls.storm_reason: "after a skip",
            lr.skip_reason: "loss/EMA skip",
            lr.alert_reason: "loss/EMA alert", RatioHeld(c).reason: "loss/EMA held",
            LossElevated(c).reason: "elevated loss", Recovery(c).reason: "not recovered",
            LogZRise(c).reason: "log Z rise", LogZDrift(c).reason: "log Z drift",
            LogZJump(c).reason: "log Z jump", UpdateJump(c).reason: "update ratio",
            storm.run_reason: "skip storm", storm.weights_reason: "skip storm",
            storm.frac_reason: "skip fraction", LossHalt(c).reason: "Tier 3 loss",
            "nan_frac > 0": "Tier 3 non-finite", "loss non-finite": "Tier 3 non-finite",
            "grad_norm non-finite": "Tier 3 non-finite"}


def _config(run: dict, warm_given: bool) -> DetectorConfig:
    warm = {"warmup_steps": run["warm"]} if warm_given else {}
    vocab = run.get("vocab", VOCAB)  # None: the field's default, as the zoo's guard has it
    if vocab is not None:
        warm["vocab_size"] = vocab
    return DetectorConfig.for_run(run["steps"], **warm, **OVERRIDES)


OVERRIDES: dict[str, float] = {}
"""DetectorConfig fields set on every replay (``--set``), e.g. {"log_z_jump_rate": 0.0}."""


def _replay(run: dict, warm_given: bool, series: dict | None = None) -> list[tuple]:
    """Per step: (step, the rule labels its verdict names, armed, grad rule armed, storm test
    on: right after a skip). A replay has no weights check: every skip counts as one it blamed
    on the batch (the most steps the storm test can judge), fewer than max_consecutive_skips
    in a row, as the guard's gate counts them."""
    c = _config(run, warm_given)
    labels, d, s = _labels(c), SpikeDetector(c), series or run["s"]
    out, skips = [], 0
    for t in range(run["steps"]):
        lz = s["log_z"][t]
        armed = d.armed
        after = armed and 0 < skips < c.max_consecutive_skips
        v = d.update(StepMetrics(step=t, loss=s["loss"][t], grad_norm=s["grad_norm"][t],
                                 log_z=math.nan if lz is None else lz),
                     update_ratio=s["update_ratio"][t], after_skip=after)
        skips = skips + 1 if v.skip else 0
        fired = {labels[r] for r in v.reasons if r in labels}
        out.append((t, fired, armed, armed and d._grad.on, after))  # grad: its quiet arming
    return out


def zoo_runs() -> list[dict]:
    """The zoo's clean, unguarded runs that ``grad_tail.py --generate`` recorded (eight settings,
    seeds 0-7, 300 steps, warmup 20), in the same form as ``clean_runs``; replayed with the
    detector the zoo's guard has (``for_run(steps)``, no vocabulary size given)."""
    return [{"name": f"zoo/{r['cell'].removeprefix('clean/')}/s{r['seed']}", "steps": r["steps"],
             "warm": r["warm"], "s": r["series"], "vocab": None} for r in series()]


def _half(run: dict) -> str:
    return "tuning" if int(run["name"].rsplit("/s", 1)[1]) % 2 == 0 else "held-out"


_CLEAN: dict[tuple[str, bool], list[tuple]] = {}


def _clean(run: dict, warm_given: bool) -> list[tuple]:
    """The replay of the run as recorded (cached: the delays compare with it)."""
    key = (run["name"], warm_given)
    if key not in _CLEAN:
        _CLEAN[key] = _replay(run, warm_given)
    return _CLEAN[key]


def far(runs: list[dict], warm_given: bool) -> dict:
    """{half: {"steps": {kind: n}, "alarms": Counter(label), "at": {label: [steps]}}} over the
    clean runs (``at``: the steps of the alarms)."""
    out = {h: {"steps": collections.Counter(), "alarms": collections.Counter(),
               "at": collections.defaultdict(list)} for h in ("tuning", "held-out")}
    for run in runs:
        h = out[_half(run)]
        for t, fired, armed, grad_on, after in _clean(run, warm_given):
            h["steps"]["armed"] += armed
            h["steps"]["after"] += after
            h["steps"]["grad"] += grad_on
            h["steps"]["early"] += armed and not grad_on
            for label in fired:
                h["alarms"][label] += 1
                h["at"][label].append(t)
    return out


def _steps_for(label: str) -> str:
    return {"grad": "grad", "joint": "grad", "joint, grad rule not armed": "early",
            "after a skip": "after"}.get(label, "armed")


# ---- faults planted in the recorded streams ------------------------------------------------

def _scale(key: str, mult: float, length: int = 1) -> Callable:
    def plant(s: dict, t0: int) -> None:
        for t in range(t0, min(t0 + length, len(s[key]))):
            s[key][t] *= mult
    return plant


def _add(key: str, per_step: float = 0.0, level: float = 0.0) -> Callable:
    def plant(s: dict, t0: int) -> None:
        for t in range(t0, len(s[key])):
            if s[key][t] is not None:
                s[key][t] += level + per_step * (t - t0 + 1)
    return plant


def _both(*plants: Callable) -> Callable:
    def plant(s: dict, t0: int) -> None:
        for p in plants:
            p(s, t0)
    return plant


def _unrecovered(s: dict, t0: int) -> None:
    s["grad_norm"][t0] *= 10.0
    _add("loss", level=0.5)(s, t0 + 1)


def _faded_storm(s: dict, t0: int) -> None:
    """A storm whose later batches the model has begun to fit: grad norm x10 and loss x1.5,
    then two steps of grad norm x3 and loss x1.15 (inside the joint test's halves)."""
    _both(_scale("grad_norm", 10.0), _scale("loss", 1.5))(s, t0)
    for t in (t0 + 1, t0 + 2):
        _both(_scale("grad_norm", 3.0), _scale("loss", 1.15))(s, t)


def _set(key: str, value: float) -> Callable:
    def plant(s: dict, t0: int) -> None:
        s[key][t0] = value
    return plant


FAULTS: dict[str, Callable] = {
    "grad norm x10, one step": _scale("grad_norm", 10.0),
    "loss x1.6, one step": _scale("loss", 1.6),
    "grad norm x5, loss x1.3, one step": _both(_scale("grad_norm", 5.0), _scale("loss", 1.3)),
    "grad norm x10, loss x1.3, before the grad rule arms": _both(_scale("grad_norm", 10.0),
                                                                 _scale("loss", 1.3)),
    "a fading storm: grad norm x10, loss x1.5, then twice x3 and x1.15": _faded_storm,
    "loss x3 for 15 steps": _scale("loss", 3.0, 15),
    "grad norm x10 for 8 steps": _scale("grad_norm", 10.0, 8),
    "loss +0.5 nats from then on": _add("loss", level=0.5),
    "grad norm x10, then loss +0.5 nats": _unrecovered,
    "log Z +0.05 a step": _add("log_z", per_step=0.05),
    "update ratio x50 for 20 steps": _scale("update_ratio", 50.0, 20),
    "loss 12 nats, one step": _set("loss", 12.0),
    "grad norm NaN, one step": _set("grad_norm", math.nan),
}


def delays(runs: list[dict], warm_given: bool) -> dict:
    """{fault: {half: {"runs": n, "delay": {label: [steps from onset to its first verdict]}}}}."""
    out: dict = {}
    for name, plant in FAULTS.items():
        early = "before the grad rule" in name
        per = out[name] = {h: {"runs": 0, "delay": collections.defaultdict(list)}
                           for h in ("tuning", "held-out")}
        for run in runs:
            c = _config(run, warm_given)
            if early:  # midway between the loss rules' arming and the grad rule's, as recorded
                on = next((t for t, _, _, g, _ in _clean(run, warm_given) if g), run["steps"])
                t0 = (c.arm_after + on) // 2
                if not c.arm_after < t0 < on:
                    continue
            elif run["steps"] >= 300:
                t0 = run["steps"] // 2
            else:
                continue
            s = {k: list(v) for k, v in run["s"].items()}
            plant(s, t0)
            h = per[_half(run)]
            h["runs"] += 1
            first: dict[str, int] = {}
            clean = _clean(run, warm_given)
            for t, fired, *_ in _replay(run, warm_given, s)[t0:]:
                for label in fired - clean[t][1]:  # not a false alarm of the run as recorded
                    first.setdefault(label, t - t0)
            for label, d in first.items():
                h["delay"][label].append(d)
            if first:
                h["delay"]["any rule"].append(min(first.values()))
    return out


# ---- report ----------------------------------------------------------------------------------

def _rate(n: int, steps: int) -> str:
    if not steps:
        return "-"
    if n == 0:
        return f"0 (<{3000 / steps:.2g})"  # 0 of N: under 3/N at 95%
    return f"{1000 * n / steps:.2f}"


def _arl(n: int, steps: int) -> str:
    if not steps:
        return "-"
    return f"{steps / n:,.0f}" if n else f">{steps / 3:,.0f}"


def _far_table(res: dict) -> list[str]:
    rows = ["| rule | tuning: alarms / steps | per 1,000 | held-out: alarms / steps | per 1,000 "
            "| held-out run length | at steps |", "|---|---|---|---|---|---|---|"]
    for label in ORDER:
        kind = _steps_for(label)
        cells = []
        for h in ("tuning", "held-out"):
            n, steps = res[h]["alarms"][label], res[h]["steps"][kind]
            cells += [f"{n} / {steps:,}", _rate(n, steps)]
        n, steps = res["held-out"]["alarms"][label], res["held-out"]["steps"][kind]
        at = res["tuning"]["at"].get(label, []) + res["held-out"]["at"].get(label, [])
        where = f"{min(at)}-{max(at)} (median {statistics.median(at):g})" if at else ""
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {_arl(n, steps)} | {where} |")
    return rows


def _delay_cell(h: dict, label: str) -> str:
    d = h["delay"].get(label, [])
    if not d:
        return f"0/{h['runs']}"
    return (f"{len(d)}/{h['runs']}: {statistics.median(d):g} ({min(d)}-{max(d)})")


def _delay_table(res: dict) -> list[str]:
    rows = ["| fault | rule | tuning: caught, median delay (range) | held-out |",
            "|---|---|---|---|"]
    for name, per in res.items():
        labels = sorted(set(per["tuning"]["delay"]) | set(per["held-out"]["delay"]),
                        key=lambda x: (x != "any rule",
                                       min(per["tuning"]["delay"].get(x, [1 << 30])
                                           + per["held-out"]["delay"].get(x, [1 << 30])),
                                       ORDER.index(x) if x in ORDER else -1))
        for label in labels or ["(none)"]:
            rows.append(f"| {name} | {label} | {_delay_cell(per['tuning'], label)} | "
                        f"{_delay_cell(per['held-out'], label)} |")
    return rows


def _overrides(pairs: list[str]) -> dict[str, float]:
    """``--set FIELD=VALUE`` pairs as DetectorConfig keywords (numbers; checked by the config)."""
    known = {f.name for f in dataclasses.fields(DetectorConfig)}
    out: dict[str, float] = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in known or not value:
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE with FIELD a DetectorConfig "
                             "field, e.g. --set log_z_jump_rate=0")
        out[name] = int(value) if value.lstrip("-").isdigit() else float(value)
    try:
        DetectorConfig(**out)  # a bad value is refused here, with the field named
    except ValueError as e:
        raise SystemExit(f"--set: {e}") from None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the counts and delays to this file")
    p.add_argument("--zoo", action="store_true",
                   help="replay the zoo's clean settings instead (grad_tail.py --generate)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a DetectorConfig field for every replay, e.g. log_z_jump_rate=0")
    args = p.parse_args(argv)
    OVERRIDES.clear()
    OVERRIDES.update(_overrides(args.set))
    runs = zoo_runs() if args.zoo else clean_runs()
    halves = collections.Counter(_half(r) for r in runs)
    print(f"{len(runs)} clean runs: {halves['tuning']} tuning (even seeds), "
          f"{halves['held-out']} held-out (odd seeds)")
    dump: dict = {}
    for warm_given in (True, False):
        res = far(runs, warm_given)
        lag = delays(runs, warm_given)
        dump[f"warmup_given={warm_given}"] = {"far": res, "delays": lag}
        print(f"\n## false alarms, warmup {'given' if warm_given else 'not given'} to for_run\n")
        print("\n".join(_far_table(res)))
        print(f"\n## detection delay (steps), warmup {'given' if warm_given else 'not given'}\n")
        print("\n".join(_delay_table(lag)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dump, f, indent=1, default=dict)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
