"""Read a run's metrics log, whatever wrote it, into one columnar ``MetricsLog``.

Formats: spikeguard's ``metrics.jsonl`` (read in run order, ``_runlog``); Hugging Face Trainer's
``trainer_state.json`` (``log_history``); Lightning's CSVLogger ``metrics.csv``; any CSV with common column names (or
``--map col=metric``); a W&B history CSV export; TensorBoard event files (``pip install
spikeguard[tb]``). A directory is searched for those files. Damaged input gives partial results
and a warning per repair: a cut-off last line, unreadable lines, rows out of order, repeated steps,
missing cells (left missing, never filled in); an empty file or a log without loss and grad norm
is a ValueError.

A JSONL log of a million steps reads in seconds: only the needed keys are pulled from each line
(``orjson`` when installed, ``pip install spikeguard[json]``), in chunks turned into numpy arrays.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ._columns import METRICS, Column, assemble, choose, column_len, read_column
from ._jsonl import read_jsonl as _read_jsonl
from ._runlog import read_run_config, run_order
from ._textlogs import TEXT_FORMATS, accepted_formats, read_text, sniff

__all__ = ["FORMATS", "MetricsLog", "read_log", "read_quarantine", "relaunch_chain", "subset"]

FORMATS = ("auto", "jsonl", "hf", "lightning", "csv", "wandb", "tensorboard", *TEXT_FORMATS)
"""Values of ``--format`` (the console formats of ``_textlogs`` are told by content)."""

_SNIFF_LINES = 400  # a console log's format is told from this many leading lines



@dataclass
class MetricsLog:
    """A metrics log as columns: one entry per step, steps strictly increasing.

    ``columns`` holds only the metrics the log has (names as in the metrics record); ``recorded``
    holds what the run itself decided, when the log says (spikeguard JSONL: ``tier``, and
    ``action`` as an index into ``spikeguard.record.ACTIONS``; -1 where unknown).
    """

    path: str
    """Where it was read from."""
    format: str
    """One of ``FORMATS`` (never "auto")."""
    steps: np.ndarray
    """int64 step numbers, strictly increasing."""
    columns: dict[str, np.ndarray]
    """float64 values by metric name; NaN / inf are real values."""
    warnings: list[str] = field(default_factory=list)
    """One sentence per repair made while reading."""
    recorded: dict[str, np.ndarray] = field(default_factory=dict)
    """The run's own verdicts, when logged."""
    missing: dict[str, np.ndarray] = field(default_factory=dict)
    """Per metric, True where the log has no value (the value there is NaN and is no evidence;
    a logged NaN is False here)."""
    events: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """A spikeguard log's records that did something (action not ``continue``), in run order,
    replays included: (record number, the record's ``_runlog.EVENT_KEYS``)."""
    replays: list[dict[str, Any]] = field(default_factory=list)
    """The stretches replayed after a rollback (``_runlog.run_order``), left out of the series."""
    run_config: dict[str, Any] | None = None
    """What the run's ``config.json`` beside the log says (``_runlog.read_run_config``)."""

    def __len__(self) -> int:
        return len(self.steps)

    @cached_property
    def stride(self) -> int:
        """Typical steps between records: 1 for a per-step log, N for one line every N steps."""
        if len(self.steps) < 2:
            return 1
        return max(1, int(np.median(np.diff(self.steps))))


_RELAUNCH = re.compile(r"^relaunch[-_]?(\d+)$")


def relaunch_chain(path: Path) -> list[Path]:
    """The metrics files of a run and its relaunches, oldest first: a rollback by relaunch
    (OLMo-core's ``relaunch_config``) saves to ``relaunch1``, ``relaunch2``, ... beside or
    inside the first run's folder, each with its own ``metrics.jsonl``. Given any one of them,
    the whole chain up to the newest; ``[path]`` when there is none."""
    folder = path.parent
    base = folder.parent if _RELAUNCH.match(folder.name) else folder
    first = base / path.name
    if not first.is_file():
        return [path]
    found = []
    for where in (base, base.parent):
        for d in where.iterdir() if where.is_dir() else []:
            m = _RELAUNCH.match(d.name)
            if m and (d / path.name).is_file() and d != base:
                found.append((int(m.group(1)), d / path.name))
    if not found:
        return [path]
    return [first, *(p for _, p in sorted(set(found)))]


def _read_history(found: Path, mapping: dict[str, str], warnings: list[str], json_loads: Any,
                  events: list[tuple[int, dict[str, Any]]]) -> tuple[dict[str, Column], Path]:
    """A spikeguard log's raw columns, its relaunches joined (``relaunch_chain``), and the
    path of the first run's file."""
    chain = relaunch_chain(found)
    if len(chain) == 1:
        return _read_jsonl(found, mapping, warnings, loads=json_loads, events=events), found
    joined = _joined(chain, warnings)
    try:
        return _read_jsonl(joined, mapping, warnings, loads=json_loads, events=events), chain[0]
    finally:
        joined.unlink()


def _joined(chain: list[Path], warnings: list[str]) -> Path:
    """One temporary file holding the records of ``chain`` in order (the caller removes it; a
    relaunch's records of the steps it replays win, as a resumed run's do)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".joined-", suffix=".jsonl")
    with os.fdopen(fd, "wb") as out:
        for p in chain:
            data = p.read_bytes()
            out.write(data if data.endswith(b"\n") or not data else data + b"\n")
    warnings.append("joined a run and its relaunches into one history: " + ", ".join(
        str(p.parent.name or p) for p in chain))
    return Path(tmp)


def subset(log: MetricsLog, keep: np.ndarray) -> MetricsLog:
    """The records of ``log`` where ``keep`` is True (the warnings list is shared)."""
    return MetricsLog(log.path, log.format, log.steps[keep],
                      {k: v[keep] for k, v in log.columns.items()}, log.warnings,
                      {k: v[keep] for k, v in log.recorded.items()},
                      {k: v[keep] for k, v in log.missing.items()}, log.events, log.replays,
                      log.run_config)


def _lines(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    """(line number, bytes, ends with a newline) for each non-blank line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield n, raw, raw.endswith(b"\n")


def _read_hf(path: Path) -> dict[str, list]:
    try:
        state = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc}); a Trainer state file is written "
                         "whole at each save, so take the one from an earlier checkpoint") from exc
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ValueError(f"{path}: no 'log_history' list: not a Trainer state file")
    # the closing summary (train_runtime, train_loss = mean over the run) is not a step's loss
    rows = [e for e in history if isinstance(e, dict) and "train_runtime" not in e]
    names: dict[str, None] = {}
    for e in rows:
        names.update(dict.fromkeys(e))
    return {k: [e.get(k) for e in rows] for k in names}


def _read_csv(path: Path, warnings: list[str]) -> dict[str, list]:
    text = path.read_text(errors="replace")
    if not text.strip():
        raise ValueError(f"{path}: the file is empty")
    try:
        dialect: Any = csv.Sniffer().sniff(text[:4096], delimiters=",;\t")
    except csv.Error:
        dialect = csv.excel
    reader = csv.reader(io.StringIO(text), dialect)
    header = next(reader)
    rows = [r for r in reader if any(c.strip() for c in r)]
    if rows and len(rows[-1]) < len(header) and not text.endswith("\n"):
        rows.pop()
        warnings.append(f"{path.name}: the last row was cut off: dropped")
    short = [i for i, r in enumerate(rows) if len(r) != len(header)]
    if short:
        warnings.append(f"{path.name}: {len(short)} row(s) have {len(rows[short[0]])} cells, not "
                        f"{len(header)} (first: row {short[0] + 2}): skipped")
        rows = [r for r in rows if len(r) == len(header)]
    return {h: [r[j] for r in rows] for j, h in enumerate(header)}


def _read_tensorboard(path: Path) -> dict[str, list]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as exc:
        raise ImportError("reading TensorBoard logs needs tensorboard: pip install "
                          "'spikeguard[tb]'") from exc
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    per_tag = {t: acc.Scalars(t) for t in acc.Tags().get("scalars", []) if t != "step"}
    steps = sorted({e.step for events in per_tag.values() for e in events})
    if not steps:
        raise ValueError(f"{path}: no scalar events")
    index = {s: i for i, s in enumerate(steps)}
    out: dict[str, list] = {"step": list(steps)}
    for tag, events in per_tag.items():
        col: list[Any] = [None] * len(steps)
        for e in events:  # a restarted run writes a step again: the later value wins
            col[index[e.step]] = e.value
        out[tag] = col
    return out


def _find(path: Path) -> tuple[Path, str]:
    if path.is_dir():
        for name, fmt in (("metrics.jsonl", "jsonl"), ("trainer_state.json", "hf"),
                          ("metrics.csv", "lightning")):
            if (path / name).is_file():
                return path / name, fmt
        if any(p.name.startswith("events.out.tfevents") for p in path.iterdir()):
            return path, "tensorboard"
        raise ValueError(f"{path}: found no metrics.jsonl, trainer_state.json, metrics.csv or "
                         "TensorBoard events.out.tfevents.* file in this directory")
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    name = path.name.lower()
    if name.startswith("events.out.tfevents"):
        return path, "tensorboard"
    if name.endswith(".jsonl"):
        return path, "jsonl"
    if name.endswith(".json"):
        return path, "hf"
    if name.endswith((".csv", ".tsv")):
        with open(path, errors="replace") as f:
            head = f.readline().lower()
        if "_step" in head.split(",") or "_runtime" in head or "__min" in head:
            return path, "wandb"
        if "epoch" in head and "step" in head:
            return path, "lightning"
        return path, "csv"
    with open(path, errors="replace") as f:
        lines = [line for _, line in zip(range(_SNIFF_LINES), f)]
    fmt = sniff(lines)
    if fmt is None:
        raise ValueError(f"{path}: not a format diagnose reads (it reads {accepted_formats()}); "
                         "pass --format, or export the metrics as a CSV")
    return path, fmt


def read_log(path: str | os.PathLike[str], *, fmt: str = "auto",
             mapping: dict[str, str] | None = None, json_loads: Any = None) -> MetricsLog:
    """Read ``path`` (a file or a run directory) into a :class:`MetricsLog`.

    ``fmt`` forces a format (``FORMATS``); ``mapping`` is {column: metric} for names diagnose
    does not recognise; ``json_loads`` replaces the JSON parser (tests compare the two).
    """
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is not one of {', '.join(FORMATS)}")
    p = Path(path)
    mapping = dict(mapping or {})
    found, guess = _find(p)
    fmt = guess if fmt == "auto" else fmt
    warnings: list[str] = []
    if found.is_file() and found.stat().st_size == 0:
        raise ValueError(f"{found}: the file is empty (the run wrote no records yet?)")
    recorded: dict[str, np.ndarray] = {}
    events: list[tuple[int, dict[str, Any]]] = []
    replays: list[dict[str, Any]] = []
    if fmt == "jsonl":
        raw, found = _read_history(found, mapping, warnings, json_loads, events)
        for k in ("tier", "action"):
            col = raw.pop(k)
            if not col[1].all():
                recorded[k] = col
        step_key = choose(list(raw), mapping)[0].get("step")
        if step_key is not None and (events or _goes_back(raw[step_key])):
            raw, recorded, events, replays = _in_run_order(raw, recorded, events, step_key,
                                                           warnings, found.name)
    elif fmt == "hf":
        raw = _read_hf(found)
    elif fmt == "tensorboard":
        raw = _read_tensorboard(found)
    elif fmt in TEXT_FORMATS:
        raw = read_text(found, fmt, warnings)
    else:
        raw = _read_csv(found, warnings)
    if not raw or not column_len(next(iter(raw.values()))):
        raise ValueError(f"{found}: no records")
    steps, cols, missing = assemble(raw, mapping=mapping, where=str(found), warnings=warnings)
    step_col = choose(list(raw), mapping)[0].get("step")
    recorded = _align(raw[step_col], recorded, steps) if recorded and step_col else {}
    for m in ("loss", "grad_norm", "log_z"):
        if m not in cols:
            what = {"loss": "the loss rules are off", "grad_norm": "the grad-norm rules are off",
                    "log_z": "the log Z rules are off and log Z drift cannot be seen"}[m]
            warnings.append(f"no {m} column: {what}")
    log = MetricsLog(str(found), fmt, steps, {m: cols[m] for m in METRICS if m in cols},
                     warnings, recorded, {m: missing[m] for m in METRICS if m in missing},
                     events, replays, read_run_config(found.parent) if fmt == "jsonl" else None)
    if log.stride > 1:
        warnings.append(f"sparse log: one record every ~{log.stride} steps; the windows are in "
                        f"steps, so a window holds 1/{log.stride} as many records, and a bad "
                        "step between two records cannot be seen")
    gaps = np.flatnonzero(np.diff(log.steps) > 3 * log.stride) if len(log) > 1 else []
    if len(gaps):
        g = int(gaps[0])
        warnings.append(f"{len(gaps)} gap(s) in the steps (first: {int(log.steps[g])} -> "
                        f"{int(log.steps[g + 1])}): nothing can be said about the steps between")
    return log


def _goes_back(col: Column) -> bool:
    vals, miss, _ = read_column(col)
    v = vals[~miss]
    return bool(len(v) > 1 and (np.diff(v) <= 0).any())


def _in_run_order(raw: dict[str, Column], recorded: dict[str, Column],
                  events: list[tuple[int, dict[str, Any]]], step_key: str, warnings: list[str],
                  name: str) -> tuple[dict[str, Column], dict[str, Column],
                                      list[tuple[int, dict[str, Any]]], list[dict[str, Any]]]:
    """The raw columns without the replayed rows, restarts renumbered (``_runlog.run_order``);
    the events' steps follow the renumbering."""
    vals, miss, _ = read_column(raw[step_key])
    keep, steps, replays = run_order(vals, miss, events, warnings, name)
    events = [(r, {**e, "step": int(steps[r]) if not miss[r] else e.get("step")})
              for r, e in events]
    raw = {**raw, step_key: (steps, miss)}
    if keep.all():
        return raw, recorded, events, replays

    def cut(col: Column) -> Column:
        v, m, _ = read_column(col)
        return v[keep], m[keep]

    return ({k: cut(c) for k, c in raw.items()}, {k: cut(c) for k, c in recorded.items()},
            events, replays)


def _align(step_col: Column, recorded: dict[str, Column],
           steps: np.ndarray) -> dict[str, np.ndarray]:
    """The run's recorded tier / action per kept step (-1 unknown; the last record of a step
    wins, as for the metrics)."""
    s, s_miss, _ = read_column(step_col)
    pos = np.searchsorted(steps, np.where(s_miss, -1, s))
    pos = np.minimum(pos, len(steps) - 1)
    ok = ~s_miss & (steps[pos] == s)
    rows = np.flatnonzero(ok)[::-1]                # newest first: np.unique keeps the first
    at, first = np.unique(pos[rows], return_index=True)
    out = {}
    for k, col in recorded.items():
        vals, miss, _ = read_column(col)
        v = np.where(miss, -1, vals)[rows[first]]
        arr = np.full(len(steps), -1, dtype=np.int8)
        arr[at] = v.astype(np.int8)
        out[k] = arr
    return out


_Q_ALIASES = {"step": "step", "stream_index": "stream_index", "index": "stream_index",
              "stream": "stream_index", "rank": "rank", "row": "row", "loss": "loss",
              "log_z": "log_z", "logz": "log_z", "z": "z", "z_score": "z", "zscore": "z"}


def read_quarantine(path: str | os.PathLike[str],
                    warnings: list[str] | None = None) -> list[dict[str, Any]]:
    """The sequences a run quarantined: ``quarantine.jsonl`` beside ``metrics.jsonl``, one JSON
    object per line with ``step``, ``stream_index``, ``rank``, ``row``, ``loss``, ``log_z`` and
    ``z`` (the robust z-score; ``z_score`` is read too). Lines without a step are skipped with a
    warning; a missing file gives [].
    """
    p = Path(path)
    if not p.is_file():
        return []
    out: list[dict[str, Any]] = []
    bad = 0
    for _, line, _ in _lines(p):
        try:
            rec = json.loads(line)
            item = {_Q_ALIASES[k.lower()]: v for k, v in rec.items() if k.lower() in _Q_ALIASES}
            item["step"] = int(item["step"])
        except (ValueError, KeyError, TypeError, AttributeError):
            bad += 1
            continue
        out.append(item)
    if bad and warnings is not None:
        warnings.append(f"{p.name}: {bad} line(s) without a readable step: skipped")
    return sorted(out, key=lambda r: r["step"])
