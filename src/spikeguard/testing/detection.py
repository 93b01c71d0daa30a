"""Detection-quality scoring: a run's metrics records in, per-cell numbers and targets out.

Pure Python (no torch), so ``benchmarks/detection.py``, ``spikeguard diagnose`` and the sandbox
can score runs alike. Two stages:

1. :func:`summarize_run` turns one run's records (the dicts of its ``metrics.jsonl``, in run
   order: a rollback's replayed steps appear again) and its held-out loss into a small summary
   dict (what a results file keeps per run).
2. :func:`score` groups summaries by (cell, arm), pairs each guarded run with the unguarded run
   of the same cell and seed (the same defenses, every response off) and with the clean
   unguarded run of the same seed (``clean_ref``), and checks the targets.

The rules (a defense is judged against doing nothing):

- a clean run is **harmed** when it halted, rolled back, or ended with a held-out loss above
  ``HARM_RATIO`` (1.005) times the unguarded arm's;
- a **false skip** is any skip or drop on a clean run (halt records excluded); the rate is per
  1,000 *armed* steps (records whose ``armed`` key is true), so warmup steps do not dilute it;
- a fault that replaces batches (outlier, storm) costs the guard those batches even when it
  skips every one: its guarded runs are also divided by a ``gap`` run (``kind`` "gap", cell
  ``gap/<model>/<fault>``: unguarded, clean, with the stream skipping the same batches), which
  a perfect skip equals bit for bit ("final/kept data"). Where the gap run is there, the target
  "final within 0.2% of clean" is judged against it: the clean run of a stream that holds bad
  batches is that stream without them, and the batches the benchmark's fault overwrote were
  never the guard's to keep (the gap run's own final/clean says what losing them costs any
  run; the table shows both ratios);
- a guarded faulted run is **worse than unguarded** when the unguarded run ended finite and the
  guarded one halted or ended above ``HARM_RATIO`` times it, except where the target asks for a
  halt (NaN faults; the sticky LR fault under rollback, which may also be withheld step by step).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ALERT_WITHIN", "ARMS", "FAULT_KINDS", "HARM_RATIO", "MAX_FALSE_SKIPS_PER_1K",
           "CellScore", "format_table", "overall", "score", "summarize_run"]

HARM_RATIO = 1.005
"""A guarded held-out loss above this times the unguarded arm's is harm."""
MAX_FALSE_SKIPS_PER_1K = 1.0
"""Target: false skips per 1,000 armed steps on clean runs."""
ALERT_WITHIN = 10
"""Target: a Tier 2 alert (with its summary) within this many steps of the first anomaly."""
OUTLIER_FINAL = 1.002
"""Target: after an outlier or a storm, the final loss within 0.2% of the clean run."""
LR_ROLLBACK_FINAL = 1.02
"""Target: after the LR transient under rollback, the final loss within 2% of the clean run."""

ARMS = ("alert", "rollback", "unguarded")
"""The arms: the default policy, tier2="rollback", and every response off (respond=False)."""
FAULT_KINDS = ("outlier", "storm", "nan-grad", "nan-data", "lr", "lr-sticky", "logit-drift",
               "grad-x10", "fp16-overflow")
"""The faulted cells' names (the benchmark maps each to an ``--inject`` spec)."""
_HALT_EXPECTED = {("nan-grad", "alert"), ("nan-grad", "rollback"), ("nan-data", "alert"),
                  ("nan-data", "rollback"), ("lr-sticky", "rollback")}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def summarize_run(records: Iterable[dict[str, Any]], *, val_loss: float | None,
                  fault_step: int | None = None) -> dict[str, Any]:
    """One run's summary from its metrics records (run order) and its held-out loss (None or
    NaN when it halted). ``fault_step``: where a planted fault fires (first anomaly at or after
    it, the first Tier 2 event after that)."""
    n = armed = armed_skips = scaler_skips = rollbacks = bounded = 0
    skip_steps: list[int] = []
    alerts: list[int] = []
    causes: Counter[str] = Counter()
    halt: dict[str, Any] | None = None
    first_anomaly = first_tier2 = None
    first_tier2_action = None
    for r in records:
        n += 1
        step, action = int(r["step"]), r.get("action", "continue")
        # a drop (the step applied without some rows) withholds data as a skip does
        skipped = (bool(r.get("skipped")) or action == "drop") and action != "halt"
        # an fp16 overflow: torch's GradScaler skipped the step, as it does in the same run
        # without the guard; not a skip the guard chose (still in skip_steps: an injected
        # overflow is caught by it)
        overflow = skipped and list(r.get("reasons") or ()) == ["scaler"]
        if r.get("armed"):
            armed += 1
            armed_skips += skipped and not overflow
            scaler_skips += overflow
        if skipped:
            skip_steps.append(step)
            causes[str(r.get("cause") or "none")] += 1
        if action == "rollback":
            rollbacks += 1
        bounded += float(r.get("update_coef", 1.0)) < 1.0  # --update-bound moved it back
        if action == "alert" and r.get("summary") is not None:
            alerts.append(step)
        if action == "halt" and halt is None:
            h = r.get("halt") or {}
            named = list(h.get("nonfinite_params") or [])[:3]
            named += [v for v in (h.get("first_forward"), h.get("first_backward")) if v]
            halt = {"step": step, "reasons": list(r.get("reasons") or []), "named": named,
                    "detail": h.get("detail", "")}
        if fault_step is not None and step >= fault_step:
            anomalous = (int(r.get("tier") or 0) >= 1 or skipped or action != "continue")
            if first_anomaly is None and anomalous:
                first_anomaly = step
            tier2 = action in ("rollback", "halt") or (action == "alert"
                                                        and r.get("summary") is not None)
            if first_tier2 is None and tier2:
                first_tier2, first_tier2_action = step, action
    return {"records": n, "armed_steps": armed, "armed_skips": armed_skips,
            "scaler_skips": scaler_skips, "skip_steps": skip_steps, "alerts": alerts,
            "rollbacks": rollbacks, "bounded": bounded,
            "causes": dict(causes), "halted": halt is not None, "halt": halt,
            "val_loss": val_loss if _finite(val_loss) else None,
            "first_anomaly": first_anomaly, "first_tier2": first_tier2,
            "first_tier2_action": first_tier2_action}


def _caught(s: dict[str, Any], max_rollbacks: int) -> bool:
    """Whether the guarded run ``s`` did what its fault asks for."""
    kind, step, length = s["fault"], s["fault_step"], s.get("fault_len", 1)
    skips = set(s["skip_steps"])
    if kind in ("outlier", "storm"):
        return all(t in skips for t in range(step, step + length)) and not s["halted"]
    if kind in ("nan-grad", "nan-data"):
        h = s["halt"]
        return h is not None and h["step"] == step and bool(h["named"])
    if kind == "lr-sticky" and s["arm"] == "rollback":
        # a fault that outlives every rollback: the guard either withholds each faulty update
        # (the LR jump seen before it is applied: nothing to roll back) or spends its rollback
        # budget and halts; what it must not do is let the faulty updates through
        withheld = all(t in skips for t in range(step, step + length)) and not s["halted"]
        return withheld or (s["halted"] and s["rollbacks"] >= max_rollbacks)
    if kind in ("lr", "lr-sticky"):
        a, t2 = s["first_anomaly"], s["first_tier2"]
        want = "rollback" if s["arm"] == "rollback" else "alert"
        return (a is not None and t2 is not None and s["first_tier2_action"] == want
                and t2 - a <= ALERT_WITHIN)
    if kind == "logit-drift":
        return s["first_tier2"] is not None
    if kind in ("grad-x10", "fp16-overflow"):
        return step in skips and not s["halted"]
    raise ValueError(f"unknown fault {kind!r}; expected one of {FAULT_KINDS}")


@dataclass
class CellScore:
    """One (cell, arm) of the matrix, over its seeds."""

    cell: str
    arm: str
    kind: str
    runs: int = 0
    halts: int = 0
    rollbacks: int = 0
    harmed: int = 0
    unpaired: int = 0
    armed_steps: int = 0
    false_skips: int = 0
    caught: int = 0
    worse: int = 0
    final_over_clean: list[float] = field(default_factory=list)
    final_over_kept: list[float] = field(default_factory=list)
    """Guarded outlier/storm runs over the clean run without the batches the fault replaced."""
    kept_refs: int = 0
    over_unguarded: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    targets: dict[str, bool | None] = field(default_factory=dict)
    """Target -> met; None where it cannot be judged yet (no clean reference run)."""

    @property
    def false_skips_per_1k(self) -> float:
        return 1000.0 * self.false_skips / self.armed_steps if self.armed_steps else 0.0

    @property
    def met(self) -> bool | None:
        """False when a target is not met, True when all are; None when the cell has none (the
        unguarded arm) or one cannot be judged yet."""
        if any(v is False for v in self.targets.values()):
            return False
        return True if self.targets and all(self.targets.values()) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if _finite(a) and _finite(b) and b > 0 else None


def score(summaries: Iterable[dict[str, Any]], *, max_rollbacks: int = 3) -> list[CellScore]:
    """Score every (cell, arm). A summary carries ``cell``, ``kind`` (clean|fault), ``arm``
    (alert|rollback|unguarded), ``seed``, ``clean_ref`` (the clean cell of the same model, LR
    and length), for faults ``fault``/``fault_step``/``fault_len``, and summarize_run's keys.
    A later summary of the same (cell, arm, seed) replaces an earlier one."""
    runs: dict[tuple[str, str, int], dict[str, Any]] = {}
    for s in summaries:
        runs[(s["cell"], s["arm"], int(s["seed"]))] = s
    cells: dict[tuple[str, str], CellScore] = {}
    order: dict[str, tuple] = {}
    for (cell, arm, seed), s in sorted(runs.items()):
        c = cells.setdefault((cell, arm), CellScore(cell, arm, s["kind"]))
        fault = s.get("fault")
        order[cell] = (s["kind"] != "clean", s.get("model", ""), float(s.get("lr", 0)),
                       int(s.get("steps", 0)), FAULT_KINDS.index(fault) if fault in FAULT_KINDS
                       else -1, cell)
        c.runs += 1
        if _finite(s.get("wall_s")):
            c.wall_s.append(float(s["wall_s"]))
        c.halts += s["halted"]
        c.rollbacks += s["rollbacks"] > 0
        base = runs.get((cell, "unguarded", seed))
        clean = runs.get((s.get("clean_ref", cell), "unguarded", seed))
        r = _ratio(s["val_loss"], clean["val_loss"] if clean else None)
        if r is not None:
            c.final_over_clean.append(r)
        if arm == "unguarded":
            continue
        vs = _ratio(s["val_loss"], base["val_loss"] if base else None)
        if vs is not None:
            c.over_unguarded.append(vs)
        base_finite = base is not None and _finite(base["val_loss"])
        kept = runs.get((cell.replace("fault/", "gap/", 1), "unguarded", seed))
        if s["kind"] == "fault" and kept is not None:
            c.kept_refs += 1
            k = _ratio(s["val_loss"], kept["val_loss"])
            if k is not None:
                c.final_over_kept.append(k)
        if s["kind"] == "clean":
            c.armed_steps += s["armed_steps"]
            c.false_skips += s["armed_skips"]
            if s["halted"] or s["rollbacks"] > 0 or (vs is not None and vs > HARM_RATIO):
                c.harmed += 1
            elif base is None:
                c.unpaired += 1
            continue
        c.caught += _caught(s, max_rollbacks)
        if base is None:
            c.unpaired += 1
        elif (base_finite and (s["fault"], arm) not in _HALT_EXPECTED
              and (s["halted"] or (vs is not None and vs > HARM_RATIO))):
            c.worse += 1
    for c in cells.values():
        _targets(c)
    return sorted(cells.values(), key=lambda c: (order[c.cell], ARMS.index(c.arm)
                                                 if c.arm in ARMS else len(ARMS), c.arm))


def _targets(c: CellScore) -> None:
    if c.arm == "unguarded":
        return
    t = c.targets
    if c.kind == "clean":
        t["no halt"] = c.halts == 0
        t["no rollback"] = c.rollbacks == 0
        # a run without its unguarded pair cannot be judged harmless
        t["none harmed"] = False if c.harmed else None if c.unpaired else True
        t[f"false skips <= {MAX_FALSE_SKIPS_PER_1K:g}/1k"] = (
            c.false_skips_per_1k <= MAX_FALSE_SKIPS_PER_1K)
        return
    fault = c.cell.rsplit("/", 1)[-1]
    t["not worse than unguarded"] = c.worse == 0
    all_caught = c.caught == c.runs
    worst = max(c.final_over_clean) if c.final_over_clean else None

    def within(limit: float) -> bool | None:
        return None if worst is None or len(c.final_over_clean) < c.runs else worst <= limit
    if fault in ("outlier", "storm"):
        t["skipped on every seed"] = all_caught
        if c.kept_refs:  # the clean run of these data is the one without the bad batches
            t[f"final <= {OUTLIER_FINAL:g}x kept data"] = (
                None if len(c.final_over_kept) < c.runs
                else max(c.final_over_kept) <= OUTLIER_FINAL)
        else:
            t[f"final <= {OUTLIER_FINAL:g}x clean"] = within(OUTLIER_FINAL)
    elif fault in ("nan-grad", "nan-data"):
        t["halts at the step, naming the tensor"] = all_caught
    elif fault == "lr" and c.arm == "rollback":
        t[f"final <= {LR_ROLLBACK_FINAL:g}x clean"] = within(LR_ROLLBACK_FINAL)
    elif fault == "lr":
        t[f"tier 2 alert within {ALERT_WITHIN} steps"] = all_caught
        t["goes on"] = c.halts == 0
    elif fault == "lr-sticky" and c.arm == "rollback":
        t["withheld, or halts with the budget spent"] = all_caught


def overall(cells: Iterable[CellScore]) -> tuple[int, int]:
    """(guarded cells whose targets are all met, guarded cells with targets)."""
    judged = [c for c in cells if c.targets]
    return sum(c.met is True for c in judged), len(judged)


def _fmt(values: list[float]) -> str:
    return f"{max(values):.4f}" if values else "-"


def format_table(cells: list[CellScore], *, only_failed: bool = False) -> str:
    """A Markdown table, one row per (cell, arm): worst ratios, counts and targets."""
    head = ("| cell | arm | runs | halts | rollbacks | harmed | false skips/1k armed | caught "
            "| final/clean (max) | final/kept data (max) | vs unguarded (max) | wall/run s "
            "| targets |")
    lines = [head, "|" + "---|" * 13]
    for c in cells:
        if only_failed and c.met is not False:
            continue
        failed = [k for k, v in c.targets.items() if v is False]
        unknown = [k for k, v in c.targets.items() if v is None]
        verdict = ("-" if not c.targets else "met" if c.met
                   else "NOT met: " + ", ".join(failed) if failed
                   else "not judged yet: " + ", ".join(unknown) + " (a reference run missing)")
        clean = c.kind == "clean" and c.arm != "unguarded"
        lines.append(
            f"| {c.cell} | {c.arm} | {c.runs} | {c.halts} | {c.rollbacks} | "
            f"{c.harmed if clean else '-'} | "
            f"{f'{c.false_skips_per_1k:.1f} ({c.false_skips}/{c.armed_steps})' if clean else '-'}"
            f" | {f'{c.caught}/{c.runs}' if c.kind == 'fault' and c.arm != 'unguarded' else '-'}"
            f" | {_fmt(c.final_over_clean)} | {_fmt(c.final_over_kept)} | "
            f"{_fmt(c.over_unguarded)} | "
            f"{f'{statistics.median(c.wall_s):.1f}' if c.wall_s else '-'} | {verdict} |")
    met, judged = overall(cells)
    failed = sum(c.met is False for c in cells)
    lines.append("")
    lines.append(f"overall: {met}/{judged} guarded cells meet every target, {failed} do not, "
                 f"{judged - met - failed} not judged yet: targets "
                 + ("met" if met == judged and judged else "NOT met"))
    return "\n".join(lines)

