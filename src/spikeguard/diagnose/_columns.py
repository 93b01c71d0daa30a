"""Column names and the one place a table of raw columns becomes a clean, step-ordered log.

Every reader hands ``assemble`` a dict of raw column name -> values (floats, numeric strings,
"NaN"/"Infinity" strings, or None for a missing cell). ``assemble`` recognises the common names,
applies ``--map col=metric``, merges rows that share a step, drops rows that carry neither loss
nor grad norm (evaluation rows), sorts by step and reports every repair it made as a warning.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["METRICS", "PRECISION", "Column", "assemble", "canonical", "choose", "column_len", "parse_map",
           "read_column", "to_floats"]

METRICS = ("loss", "grad_norm", "log_z", "nan_frac", "lr", "loss_ema_ratio", "grad_scale",
           "update_ratio", "spike_share", "attn_logit_bound", "attn_logit_p99", "skipped",
           "nan_iters", "scale_tried")
"""The metrics diagnose reads, named as in the metrics record (update_ratio .. attn_logit_p99
are the early-warning signals and the attention probe, recorded every few steps: missing
between); ``skipped`` and ``nan_iters`` are the updates a trainer's loss scaler skipped and the
NaN iterations it counted in the record's interval (Megatron's counters, DeepSpeed's OVERFLOW
lines); ``scale_tried`` the loss scale an overflow was attempted at (DeepSpeed's 'Attempted loss
scale')."""
PRECISION = ("grad_scale", "skipped", "nan_iters", "scale_tried")
"""Metrics that keep a row of their own: a record of skipped updates carries no loss."""

_TARGETS = ("step", *METRICS)

# normalised name -> (metric, rank); a lower rank wins when two columns name the same metric
_EXACT = {
    "step": ("step", 0), "global_step": ("step", 1), "iteration": ("step", 2), "iter": ("step", 2),
    "_step": ("step", 3),  # W&B's own row counter: used only when nothing better is there
    "loss": ("loss", 0), "training_loss": ("loss", 1), "lm_loss": ("loss", 2),
    "grad_norm": ("grad_norm", 0), "gradient_norm": ("grad_norm", 0), "gradnorm": ("grad_norm", 0),
    "global_grad_norm": ("grad_norm", 1), "grad_norm_total": ("grad_norm", 1),
    "log_z": ("log_z", 0), "logz": ("log_z", 0),
    "lr": ("lr", 0), "learning_rate": ("lr", 0),
    "nan_frac": ("nan_frac", 0), "loss_ema_ratio": ("loss_ema_ratio", 0),
    "grad_scale": ("grad_scale", 0), "loss_scale": ("grad_scale", 1),
    "update_ratio": ("update_ratio", 0), "spike_share": ("spike_share", 0),
    "skipped_iters": ("skipped", 0), "scaler_skips": ("skipped", 1),
    "nan_iters": ("nan_iters", 0), "nan_iterations": ("nan_iters", 0),
    "scale_tried": ("scale_tried", 0),
    "attn_logit_bound": ("attn_logit_bound", 0), "attn_logit_p99": ("attn_logit_p99", 0),
}
_PREFIXES = ("train/", "training/", "trainer/", "train_", "training_")
_WANDB_RUN = re.compile(r"^.+ - (?=\S)")  # W&B panel export: "<run name> - train/loss"


def _normal(name: str) -> str:
    n = _WANDB_RUN.sub("", name.strip()).lower().replace("-", "_").replace(" ", "_")
    return n


def canonical(name: str) -> tuple[str, int] | None:
    """``(metric, rank)`` for a recognised column name, else None.

    Recognised: the record's own names; ``train/`` / ``train_`` prefixes; Lightning's ``_step``
    suffix (never ``_epoch``, an epoch aggregate); ``lr-AdamW``-style names; W&B exports
    (``_step``, ``run - train/loss``, but not its ``__MIN`` / ``__MAX`` columns). ``val_loss``
    and ``eval_loss`` are not the training loss and stay unrecognised.
    """
    n = _normal(name)
    if n.endswith(("__min", "__max")):
        return None
    if n in _EXACT:
        return _EXACT[n]
    for p in _PREFIXES:
        if n.startswith(p) and n[len(p):] in _EXACT:
            metric, rank = _EXACT[n[len(p):]]
            return metric, rank + 1
    if n.endswith("_step") and n[:-5] in _EXACT:
        metric, rank = _EXACT[n[:-5]]
        return (metric, rank + 2) if metric != "step" else None
    for p in _PREFIXES:
        if n.startswith(p) and n.endswith("_step") and n[len(p):-5] in _EXACT:
            metric, rank = _EXACT[n[len(p):-5]]
            return (metric, rank + 3) if metric != "step" else None
    if n.startswith("lr_") or n.startswith("lr/"):
        return "lr", 2
    return None


def parse_map(items: Iterable[str]) -> dict[str, str]:
    """``["col=loss", "a=grad_norm,b=log_z"]`` -> {column: metric}; ValueError naming a bad pair."""
    out: dict[str, str] = {}
    for item in items:
        for pair in item.split(","):
            if not pair.strip():
                continue
            col, sep, metric = pair.rpartition("=")
            col, metric = col.strip(), metric.strip()
            if not sep or not col:
                raise ValueError(f"--map {pair!r}: write COLUMN=METRIC, e.g. --map "
                                 "'train/lm_loss=loss'")
            if metric not in _TARGETS:
                raise ValueError(f"--map {pair!r}: metric {metric!r} is not one of "
                                 f"{', '.join(_TARGETS)}")
            out[col] = metric
    return out


def choose(names: Sequence[str], mapping: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Which raw column feeds each metric: {metric: column}, plus notes on columns passed over."""
    missing = [c for c in mapping if c not in names]
    if missing:
        raise ValueError(f"--map names column(s) {missing} that the log does not have; its "
                         f"columns: {', '.join(names) or '(none)'}")
    chosen: dict[str, tuple[int, str]] = {}
    for metric in set(mapping.values()):
        cols = [c for c, m in mapping.items() if m == metric]
        chosen[metric] = (-1, cols[-1])
    for col in names:
        if col in mapping:
            continue
        hit = canonical(col)
        if hit is None:
            continue
        metric, rank = hit
        if metric not in chosen or rank < chosen[metric][0]:
            chosen[metric] = (rank, col)
    notes = []
    for col in names:
        hit = canonical(col)
        if hit and col not in mapping and chosen.get(hit[0], (0, col))[1] != col:
            notes.append(f"column {col!r} also looks like {hit[0]}; using "
                         f"{chosen[hit[0]][1]!r} (choose with --map {col}={hit[0]})")
    return {m: c for m, (_, c) in chosen.items()}, notes


def to_floats(values: Sequence[Any], *, exact: bool = True) -> tuple[np.ndarray, np.ndarray, int]:
    """(float64 values, missing mask, count of unreadable cells) for raw cells.

    None and "" are missing (NaN in the values); "NaN", "Infinity", "inf" and numbers are values.
    Anything else (text) counts as unreadable and is missing. ``exact=False`` counts every NaN
    as missing (cheaper; right for metrics whose NaN means "not measured", such as log Z).
    """
    try:
        arr = np.array(values, dtype=np.float64)
    except (ValueError, TypeError):
        arr = None
    if arr is not None and arr.ndim == 1:
        if not exact:
            return arr, np.isnan(arr), 0
        missing = np.zeros(len(arr), dtype=bool)
        nan = np.flatnonzero(np.isnan(arr))  # only NaN cells can be missing ones
        if len(nan):
            missing[nan] = [values[i] is None or values[i] == "" for i in nan.tolist()]
        return arr, missing, 0
    out = np.empty(len(values), dtype=np.float64)
    missing = np.zeros(len(values), dtype=bool)
    bad = 0
    for i, v in enumerate(values):
        try:
            out[i] = float(v) if v is not None and v != "" else math.nan
            missing[i] = v is None or v == ""
        except (ValueError, TypeError):
            out[i], missing[i] = math.nan, True
            bad += 1
    return out, missing, bad


Column = Sequence[Any] | tuple[np.ndarray, np.ndarray]
"""Raw cells, or cells already read by ``to_floats`` as (values, missing mask)."""


def read_column(col: Column) -> tuple[np.ndarray, np.ndarray, int]:
    """``to_floats`` unless the column was read already."""
    if isinstance(col, tuple) and len(col) == 2 and isinstance(col[0], np.ndarray):
        return col[0], col[1], 0
    return to_floats(col)


def column_len(col: Column) -> int:
    return len(col[0]) if isinstance(col, tuple) and len(col) == 2 and isinstance(
        col[0], np.ndarray) else len(col)


def _last_present(order: np.ndarray, starts: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """Per group of equal steps (sorted positions), the row of its last present value or -1."""
    pos = np.where(missing[order], -1, np.arange(len(order)))
    last = np.maximum.reduceat(pos, starts)
    return np.where(last >= 0, order[np.maximum(last, 0)], -1)


def assemble(raw: dict[str, Column], *, mapping: dict[str, str], where: str,
             warnings: list[str]) -> tuple[np.ndarray, dict[str, np.ndarray],
                                           dict[str, np.ndarray]]:
    """(steps, {metric: float64 values}, {metric: missing mask}) from raw columns of equal
    length, in step order. A missing cell is NaN in the values and True in its mask (a logged
    NaN is False there): nothing is filled in.

    Appends a sentence to ``warnings`` for each repair. Raises ValueError when nothing usable
    remains (no rows with a loss or a grad norm).
    """
    names = list(raw)
    chosen, notes = choose(names, mapping)
    warnings.extend(notes)
    n = column_len(next(iter(raw.values()))) if raw else 0
    cols: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for metric, col in chosen.items():
        vals, miss, bad = read_column(raw[col])
        if bad:
            warnings.append(f"{col}: {bad} cell(s) are not numbers; read as missing")
        cols[metric] = (vals, miss)
    if "loss" not in cols and "grad_norm" not in cols and not (set(PRECISION) & set(cols)):
        raise ValueError(f"{where}: no loss or grad norm column among {names or '(none)'}; "
                         "name them with --map COLUMN=loss --map COLUMN=grad_norm")
    if "step" in cols:
        svals, smiss = cols.pop("step")
        bad_step = smiss | ~np.isfinite(svals) | (svals != np.round(svals))
        if bad_step.any():
            warnings.append(f"{int(bad_step.sum())} row(s) without a whole-number step dropped")
        keep = ~bad_step
        steps = np.where(keep, svals, -1).astype(np.int64)
    else:
        warnings.append(f"{where}: no step column; rows are numbered from 0 (name one with "
                        "--map COLUMN=step)")
        steps, keep = np.arange(n, dtype=np.int64), np.ones(n, dtype=bool)
    order = np.flatnonzero(keep)
    s = steps[order]
    if len(s) > 1 and not np.all(np.diff(s) > 0):
        back = np.flatnonzero(np.diff(s) < 0)
        if len(back):
            i = int(back[0])
            warnings.append(f"steps are not in order ({len(back)} place(s); first: step "
                            f"{int(s[i + 1])} after {int(s[i])}): sorted by step")
        order = order[np.argsort(s, kind="stable")]
        s = steps[order]
    starts = np.flatnonzero(np.r_[True, np.diff(s) != 0]) if len(s) else np.zeros(0, np.int64)
    merged: dict[str, np.ndarray] = {}
    present: dict[str, np.ndarray] = {}
    for metric, (vals, miss) in cols.items():
        if len(starts) == len(s):
            rows = np.where(miss[order], -1, order)
        else:
            rows = _last_present(order, starts, miss)
            dup = np.add.reduceat((~miss[order]).astype(np.int64), starts) > 1
            if dup.any() and metric in ("loss", "grad_norm"):
                warnings.append(f"{int(dup.sum())} step(s) have more than one {metric} (first: "
                                f"step {int(s[starts[np.argmax(dup)]])}; a resumed or rolled-back "
                                "run?): the last value of each kept")
        present[metric] = rows >= 0
        merged[metric] = np.where(rows >= 0, vals[np.maximum(rows, 0)], np.nan)
    s = s[starts]
    core = [m for m in ("loss", "grad_norm") if m in merged]
    keepers = core + [m for m in PRECISION if m in merged]
    row_ok = np.logical_or.reduce([present[m] for m in keepers])
    if not row_ok.all():
        dropped = int((~row_ok).sum())
        if dropped and row_ok.any():
            warnings.append(f"{dropped} row(s) carry neither loss nor grad norm (evaluation or "
                            "other metrics): left out")
        s = s[row_ok]
        merged = {m: v[row_ok] for m, v in merged.items()}
        present = {m: p[row_ok] for m, p in present.items()}
    if not core and keepers:
        warnings.append(f"{Path(where).name}: no loss or grad norm in this log, only the loss "
                        "scaler's records: the precision findings are all diagnose can give")
    if len(s) == 0:
        raise ValueError(f"{where}: no rows with a loss or a grad norm")
    for m in core:
        holes = ~present[m]
        if holes.any():  # never filled: a blank is no evidence (NaN, with its ``missing`` mask)
            warnings.append(f"{m} missing at {int(holes.sum())} of {len(s)} step(s) (first: "
                            f"{int(s[np.argmax(holes)])}): left out of the evidence there")
    for m in ("loss", "grad_norm"):
        if m in merged:
            bad = ~np.isfinite(merged[m]) & present[m]
            if bad.any():
                warnings.append(f"{m} is NaN or inf at {int(bad.sum())} step(s) (first: step "
                                f"{int(s[np.argmax(bad)])}): each is a Tier 3 halt")
    for m in [m for m, p in present.items() if m not in core and not p.any()]:
        del merged[m]
        del present[m]
    return s, merged, {m: ~p for m, p in present.items()}
