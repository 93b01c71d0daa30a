"""A spikeguard run's own log, read in run order: what the guard did, the replays after a
rollback, a restart that numbers its steps from 0 again, and the run's ``config.json``.

``metrics.jsonl`` is written in run order. After a Tier 2 rollback to the checkpoint at step c
the steps c+1 .. d (d the detection step) appear again: those replays are kept apart (the
analysed series keeps the first attempt, where the spike is), and the guard's decisions are
counted from every record, replays included. A step that goes back without a rollback before it
is a restart (a resumed job whose guard counts from 0 again): the later records are renumbered
to follow the earlier ones, and a warning says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["EVENT_KEYS", "checkpoint_steps", "is_drop", "read_run_config", "recorded_summary",
           "run_order"]

_CKPT = re.compile(r"^(?:step|checkpoint|ckpt|iter|global_step|epoch=\d+-step=)[-_=]?(\d+)"
                   r"(?:\.(?:pt|pth|ckpt|safetensors|distcp))?$", re.I)

EVENT_KEYS = ("step", "action", "tier", "reasons", "skipped", "rollback_to", "skip_range",
              "rollbacks", "kept_rows", "dropped_sequences", "quarantined", "cause")
"""What diagnose keeps of a record whose action is not ``continue``."""


def is_drop(e: dict[str, Any]) -> bool:
    """A step whose quarantined rows were dropped and whose update was applied without them:
    action ``drop``, or (before that action existed) ``skip`` with ``skipped`` false."""
    return e.get("action") == "drop" or (e.get("action") == "skip" and e.get("skipped") is False)


def run_order(steps: np.ndarray, missing: np.ndarray, events: list[tuple[int, dict[str, Any]]],
              warnings: list[str], name: str
              ) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """(rows to analyse, their steps, the replays) for the records of a run, in file order.

    ``steps`` and ``missing`` are the raw step column; ``events`` the (row, record) pairs of the
    records that did something. A replay is ``{"steps": [first, last], "records": n,
    "rollback_at": d, "to": c}``; its rows are left out of the analysed series.
    """
    n = len(steps)
    keep = ~missing
    out = steps.astype(np.float64).copy()
    by_row = dict(events)
    rollbacks = [r for r, e in events if e.get("action") == "rollback"]
    replays: list[dict[str, Any]] = []
    top = -np.inf  # the highest step seen so far (after renumbering)
    present = np.flatnonzero(~missing)
    first = out[present[0]] if len(present) else 0.0
    last_back = -1
    i = 0
    while i < n:
        if missing[i] or out[i] > top:
            top = max(top, out[i]) if not missing[i] else top
            i += 1
            continue
        before = [r for r in rollbacks if last_back < r < i]
        last_back = i
        if before:  # a replay after a rollback: the rows until the steps pass the detection step
            j = i
            while j < n and (missing[j] or out[j] <= top):
                j += 1
            rows = np.flatnonzero(~missing[i:j]) + i
            keep[i:j] = False
            det = by_row[before[-1]]
            replays.append({"steps": [int(out[rows[0]]), int(out[rows[-1]])],
                            "records": len(rows), "rollback_at": det.get("step"),
                            "to": det.get("rollback_to")})
            i = j
            continue
        if out[i] > first:  # resumed from a checkpoint: the later record of each step wins
            top = max(top, out[i])
            i += 1
            continue
        shift = top + 1 - out[i]  # a restart: the later records follow the earlier ones
        warnings.append(f"{name}: the steps start again at {int(out[i])} after {int(top)} "
                        f"(record {i + 1}) with no rollback before it (a resumed run?): read "
                        f"in run order, the steps from there on renumbered +{int(shift)}")
        out[i:] += shift
    return keep, out, replays


def checkpoint_steps(folder: Path) -> list[int]:
    """The steps of the checkpoints a run left beside its log: entries named ``step-125``,
    ``step125``, ``checkpoint-500`` (HF), ``iter_0001000`` (Megatron), ``ckpt_300`` ..., in the
    log's folder or its ``checkpoints`` / ``ckpt`` subfolder; [] when there are none."""
    steps: set[int] = set()
    for where in (folder, folder / "checkpoints", folder / "ckpt", folder / "checkpoint"):
        if not where.is_dir():
            continue
        try:
            names = [p.name for p in where.iterdir()]
        except OSError:
            continue
        for name in names:
            m = _CKPT.match(name)
            if m:
                steps.add(int(m.group(1)))
    return sorted(steps)


def read_run_config(folder: Path) -> dict[str, Any] | None:
    """What diagnose uses of the ``config.json`` that ``spikeguard train`` writes beside its log:
    ``ckpt_every``, ``precision`` (as resolved), ``tier2``, ``vocab_size``, ``detector`` (the
    run's thresholds); None when there is none or it is not spikeguard's."""
    p = folder / "config.json"
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text())
        cfg = doc["config"]
        guard = cfg.get("guard", {})
        return {"ckpt_every": cfg.get("ckpt_every"),
                "precision": doc.get("precision", cfg.get("precision")),
                "tier2": guard.get("tier2"), "vocab_size": (cfg.get("gpt") or {}).get("vocab_size"),
                "z_loss": (cfg.get("gpt") or {}).get("z_loss", cfg.get("z_loss")),
                "detector": dict(guard.get("detector") or {}), "path": str(p)}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def recorded_summary(events: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """What the run itself did, counted from its records in run order (replays included)."""
    recs = [e for _, e in events]

    def tier(e: dict[str, Any]) -> int:
        t = e.get("tier")
        return t if isinstance(t, int) else 0

    skip = [e["step"] for e in recs if e.get("action") == "skip" and not is_drop(e)
            and tier(e) >= 1]
    drop = [{"step": e["step"], "kept_rows": e.get("kept_rows")} for e in recs if is_drop(e)]
    rollback = [{"step": e["step"], "onset": None, "to": e.get("rollback_to"),
                 "skip_range": e.get("skip_range"),
                 "dropped_sequences": e.get("dropped_sequences")}
                for e in recs if e.get("action") == "rollback"]
    halt = [e["step"] for e in recs if e.get("action") == "halt"]
    alerts = sum(1 for e in recs if e.get("action") == "alert")
    scaler = sum(1 for e in recs if e.get("action") == "skip" and tier(e) == 0)
    return {"skip": skip, "drop": drop, "rollback": rollback, "halt": halt, "alerts": alerts,
            "scaler_skips": scaler, "seconds": None}
