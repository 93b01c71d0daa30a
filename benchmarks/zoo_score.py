"""The zoo's scoring: ``spikeguard.testing.detection.score`` (the detection matrix's own rules
and targets, shared) plus the targets issue 43 adds for runs nobody tuned to.

Added on top of the shared targets:

- clean cells: **no Tier 2 page** (a Tier 2 alert with its summary) on the default policy; the
  shared rules count halts and rollbacks only, and a clean run's rollback arm would take
  exactly the alert arm's decisions up to its first Tier 2 event, so a page on the alert arm
  is the rollback the other arm would make;
- the LR transient (and the sticky one) on the default policy: **paged within ALERT_WITHIN (10)
  steps of the fault's onset**; the shared target counts from the first anomaly the guard
  flagged, which is the onset on the matrix's runs but can be far later (a fault in the
  warmup, before the rules arm, is first flagged when they do);
- the LR transient under rollback is held to "within 2% of clean" only where a checkpoint
  precedes the fault (the first is saved at step ``CKPT_EVERY``); before it the target is the
  shared "not worse than unguarded";
- natural instabilities (kind ``natural``, no injection): the guard pages (alert arm) or rolls
  back (rollback arm) at or before the step where the unguarded run's loss departs from its
  trend (``zoo_run.departure``), and under rollback ends below the unguarded run's held-out
  loss. A seed whose unguarded run never departs cannot be judged (the cell is not sized
  right on that seed).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from benchmarks.zoo_run import CKPT_EVERY
from spikeguard.testing.detection import ALERT_WITHIN, LR_ROLLBACK_FINAL, CellScore, score

__all__ = ["zoo_score"]


def zoo_score(lines: list[dict[str, Any]]) -> list[CellScore]:
    """Every (cell, arm) of the zoo's result lines, scored (see the module docstring)."""
    runs: dict[tuple[str, str, int], dict[str, Any]] = {}
    for s in lines:
        runs[(s["cell"], s["arm"], int(s["seed"]))] = s
    by_cell: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for (cell, arm, _), s in sorted(runs.items()):
        by_cell[(cell, arm)].append(s)
    cells = score([s for s in runs.values() if s["kind"] != "natural"])
    for c in cells:
        group = by_cell[(c.cell, c.arm)]
        if c.arm == "unguarded":
            continue
        if c.kind == "clean":
            c.targets["no tier 2 page"] = all(not s["alerts"] for s in group)
        elif c.cell.endswith(("/lr", "/lr-sticky")) and c.arm == "alert":
            c.targets[f"paged within {ALERT_WITHIN} steps of the onset"] = all(
                s["first_tier2"] is not None and s["first_tier2_action"] == "alert"
                and s["first_tier2"] - s["fault_step"] <= ALERT_WITHIN for s in group)
        elif c.cell.endswith("/lr") and c.arm == "rollback":
            if group and group[0]["fault_step"] <= CKPT_EVERY:
                c.targets.pop(f"final <= {LR_ROLLBACK_FINAL:g}x clean", None)
    natural = [_natural(cell, arm, group, runs) for (cell, arm), group in by_cell.items()
               if group[0]["kind"] == "natural"]
    return cells + natural


def _natural(cell: str, arm: str, group: list[dict[str, Any]],
             runs: dict[tuple[str, str, int], dict[str, Any]]) -> CellScore:
    c = CellScore(cell, arm, "natural")
    for s in group:
        c.runs += 1
        c.halts += s["halted"]
        c.rollbacks += s["rollbacks"] > 0
        if s.get("wall_s") is not None:
            c.wall_s.append(float(s["wall_s"]))
    if arm == "unguarded":
        return c
    before: list[bool | None] = []
    better: list[bool | None] = []
    for s in group:
        base = runs.get((cell, "unguarded", int(s["seed"])))
        depart = base.get("departure") if base else None
        if base is None or depart is None:
            before.append(None)
            better.append(None)
            continue
        want = "rollback" if arm == "rollback" else "alert"
        t2 = s["first_tier2"]
        ok = t2 is not None and s["first_tier2_action"] == want and t2 <= depart
        c.caught += ok
        before.append(ok)
        if s["val_loss"] is not None and base["val_loss"] is not None:
            c.over_unguarded.append(s["val_loss"] / base["val_loss"])
            better.append(s["val_loss"] < base["val_loss"])
        else:
            better.append(base["val_loss"] is None and s["val_loss"] is not None)
    verb = "rolls back" if arm == "rollback" else "pages"
    c.targets[f"{verb} before the unguarded loss departs"] = _all(before)
    if arm == "rollback":
        c.targets["ends better than unguarded"] = _all(better)
    return c


def _all(values: list[bool | None]) -> bool | None:
    if any(v is False for v in values):
        return False
    return None if not values or any(v is None for v in values) else True
