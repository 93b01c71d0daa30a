"""spikeguard's ``metrics.jsonl`` as raw columns, fast: one parse and one ``itemgetter`` a line
(``orjson`` when installed), in chunks turned into numpy arrays (``readers.read_log`` uses it)."""

from __future__ import annotations

import gc
import json
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np

from ..record import ACTIONS, SCHEMA
from ._columns import Column, choose, to_floats
from ._runlog import EVENT_KEYS

__all__ = ["read_jsonl"]

_DISCOVER = 1000  # JSONL keys are learned from this many leading records
_CHUNK = 65536


def _loads() -> Any:
    try:
        import orjson
    except ImportError:
        return json.loads
    return orjson.loads


def read_jsonl(path: Path, mapping: dict[str, str], warnings: list[str], *,
                loads: Any = None,
                events: list[tuple[int, dict[str, Any]]] | None = None) -> dict[str, Column]:
    """Raw columns of a JSONL log: the metric columns read by ``to_floats`` chunk by chunk, and
    the run's own ``tier`` / ``action`` (as ``ACTIONS`` indices) when present. Records whose
    action is not ``continue`` are appended to ``events`` as (record number, their EVENT_KEYS).

    The hot loop is one parse and one ``itemgetter`` per line (records that lack a key take the
    slower ``dict.get`` path); the cyclic garbage collector is paused meanwhile, since every
    parsed record is garbage at once and a collection would only walk the rows kept so far.
    """
    loads = loads or _loads()
    codes = {a: i for i, a in enumerate(ACTIONS)}
    bad: list[int] = []
    head: list[dict[str, Any]] = []
    keys: tuple[str, ...] = ()
    rows: list[tuple[Any, ...]] = []
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    exact: set[str | None] = set()
    cut = False
    nrec = 0
    quiet = (None, "continue")
    if events is None:
        events = []

    def flush() -> None:
        for k, col in zip(keys, zip(*rows)):
            if k == "action":
                vals = np.array([codes.get(v, -1) for v in col], dtype=np.float64)
                parts[k].append((vals, vals < 0))
            else:  # NaN vs missing matters for the loss, the grad norm and the step only
                vals, miss, _ = to_floats(col, exact=k in exact)
                parts[k].append((vals, miss))
        rows.clear()

    def start() -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for rec in head:
            seen.update(dict.fromkeys(rec))
            schema = rec.get("schema", SCHEMA)
            if not isinstance(schema, int) or schema > SCHEMA:
                raise ValueError(f"{path}: schema={schema!r} is newer than this spikeguard reads "
                                 f"(schema {SCHEMA}); upgrade spikeguard to read this log")
        chosen, _ = choose(list(seen), mapping)
        exact.update(chosen.get(m) for m in ("step", "loss", "grad_norm"))
        ks = tuple(dict.fromkeys([*chosen.values(), "tier", "action", "schema"]))
        for k in ks:
            parts[k] = []
        rows.extend(tuple(rec.get(k) for k in ks) for rec in head)
        return ks

    get: Any = None
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                try:
                    rec = loads(line)
                    if get is not None:
                        rows.append(get(rec))
                        nrec += 1
                        if rec.get("action") not in quiet:
                            events.append((nrec - 1, {k: rec.get(k) for k in EVENT_KEYS}))
                        if len(rows) >= _CHUNK:
                            flush()
                        continue
                except KeyError:
                    rows.append(tuple(rec.get(k) for k in keys))
                    nrec += 1
                    if rec.get("action") not in quiet:
                        events.append((nrec - 1, {k: rec.get(k) for k in EVENT_KEYS}))
                    continue
                except AttributeError:  # a JSON value that is not an object
                    bad.append(n)
                    continue
                except (ValueError, TypeError):
                    if not line.strip():
                        continue
                    if line.endswith(b"\n"):
                        bad.append(n)
                    else:
                        cut = True  # only the last line can lack its newline
                    continue
                if not isinstance(rec, dict):
                    bad.append(n)
                    continue
                head.append(rec)
                nrec += 1
                if rec.get("action") not in quiet:
                    events.append((nrec - 1, {k: rec.get(k) for k in EVENT_KEYS}))
                if len(head) >= _DISCOVER:
                    keys = start()
                    get = itemgetter(*keys)
        if get is None:
            if not head:
                raise ValueError(f"{path}: no JSON records"
                                 + (f" ({len(bad)} unreadable line(s))" if bad else ""))
            keys = start()
        flush()
    finally:
        if gc_was_on:
            gc.enable()
    if cut:
        warnings.append(f"{path.name}: the last line was cut off (a crash mid-write?): dropped")
    if bad:
        warnings.append(f"{path.name}: {len(bad)} line(s) are not JSON objects (first: line "
                        f"{bad[0]}): skipped")
    out = {k: (np.concatenate([v for v, _ in ps]), np.concatenate([m for _, m in ps]))
           for k, ps in parts.items()}
    schema = out.pop("schema")[0]
    if np.nanmax(schema, initial=SCHEMA) > SCHEMA:
        raise ValueError(f"{path}: schema={int(np.nanmax(schema))} is newer than this "
                         f"spikeguard reads (schema {SCHEMA}); upgrade spikeguard to read this log")
    return out
