"""The default sink, one JSON object per step in ``metrics.jsonl``, and its reader."""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import math
import os
from pathlib import Path
from typing import Any, Literal

from ..record import RECORD_KEYS, SCHEMA
from ._base import Sink, check_path, per_rank

__all__ = ["JsonlSink", "encode_record", "read_metrics"]

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_TEXT_KEYS = frozenset({"action", "reasons"})  # strings by nature: never decoded to floats
_FULL = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
"""A full disk, the file size limit (RLIMIT_FSIZE) and a quota: the same condition to a writer."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _jsonable(value.item())
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


def encode_record(record: dict[str, Any]) -> str:
    """One JSON line (no newline) for a host record: strict JSON, with non-finite floats as the
    strings "NaN", "Infinity", "-Infinity" (bare NaN tokens are not JSON)."""
    try:
        return json.dumps(record, allow_nan=False)
    except (ValueError, TypeError):
        return json.dumps(_jsonable(record), allow_nan=False)


def _decode(value: Any) -> Any:
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    return value


def _upgrade(rec: dict[str, Any], where: str) -> dict[str, Any]:
    """Bring a record of any schema so far to ``SCHEMA``: all ``RECORD_KEYS`` present."""
    schema = rec.get("schema", SCHEMA)  # no schema key: a plain JSONL log, read as the current one
    if not isinstance(schema, int) or schema > SCHEMA:
        raise ValueError(f"{where}: schema={schema!r} is newer than this spikeguard reads "
                         f"(schema {SCHEMA}); upgrade spikeguard to read this log")
    out = {k: (v if k in _TEXT_KEYS else _decode(v)) for k, v in rec.items()}
    defaults = {"schema": SCHEMA, "tier": 0, "action": "continue", "reasons": []}
    for key in RECORD_KEYS:
        out.setdefault(key, defaults.get(key))
    out["schema"] = SCHEMA
    return out


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a metrics JSONL file, oldest first, as dicts with all ``RECORD_KEYS``
    (missing ones filled: None, tier 0, action "continue", reasons []) and "NaN" / "Infinity" /
    "-Infinity" strings turned back into floats.

    A last line cut short by a crash is dropped; an unreadable line anywhere else raises
    ValueError naming the file and line.
    """
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    records = []
    last = max((i for i, raw in enumerate(lines) if raw.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            if i == last and i == len(lines) - 1:  # no newline after it: the writer was cut off
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record ({exc}); a metrics log has one "
                             "JSON object per line") from exc
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{i + 1}: expected a JSON object, got {type(rec).__name__}")
        records.append(_upgrade(rec, f"{path}:{i + 1}"))
    return records


def _drop_partial_line(fd: int) -> None:
    """Truncate a file after its last newline: a line cut by a crash would otherwise be glued to
    the next record appended."""
    end = os.lseek(fd, 0, os.SEEK_END)
    pos = end
    while pos > 0:
        start = max(0, pos - 65536)
        chunk = os.pread(fd, pos - start, start)
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            cut = start + nl + 1
            break
        pos = start
    else:
        cut = 0
    if cut != end:
        os.ftruncate(fd, cut)


def _line_end(fd: int, lines: int) -> int | None:
    """The offset just after the file's ``lines``-th newline; None when it holds fewer."""
    if lines <= 0:
        return 0
    pos, seen = 0, 0
    while True:
        chunk = os.pread(fd, 1 << 20, pos)
        if not chunk:
            return None
        count = chunk.count(b"\n")
        if seen + count >= lines:
            at = -1
            for _ in range(lines - seen):
                at = chunk.index(b"\n", at + 1)
            return pos + at + 1
        seen += count
        pos += len(chunk)


class JsonlSink(Sink):
    """Writes each record as one JSON line (``encode_record``) to ``path`` (parents created).

    Each line reaches the OS in a single unbuffered ``write`` as soon as the record is on the
    host, so a killed process loses at most the step still in flight (on a GPU the record of step
    t is written at t+1). ``mode="a"`` (default) appends, first dropping a line cut short by an
    earlier crash, and after ``Guard.resume()`` continues after the restored checkpoint's records
    (:meth:`resume`: the steps that run again are not written twice); ``"w"`` starts a new
    file. ``fsync=True`` also forces every line to disk (a
    machine crash, not only a process crash). The file opens at the first record, so a bad path
    is reported (``SinkDisabledWarning``) and never stops the run. A write that fails (a full
    disk: ENOSPC, EFBIG at the file size limit, EDQUOT) is cut back to the end of the last whole
    line, so the file never holds part of a record, and the sink is disabled with a warning
    saying so; in a :class:`Sinks` group the others go on and carry the condition in
    ``sink_errors``.

    Under torch.distributed only rank ``rank`` (default 0) writes: one file per job. With
    ``rank=None`` every rank writes its own file, and ``path`` must hold ``{rank}``
    (``"metrics-rank{rank}.jsonl"``).
    """

    def __init__(self, path: str | os.PathLike[str] = "metrics.jsonl", *,
                 mode: Literal["a", "w"] = "a", fsync: bool = False,
                 defer: bool | None = None, rank: int | None = 0) -> None:
        check_path(path, type(self).__name__, "path")
        if mode not in ("a", "w"):
            raise ValueError(f"mode={mode!r} must be 'a' (append) or 'w' (overwrite)")
        super().__init__(defer=defer, rank=rank)
        self.path = Path(per_rank(path, rank, self.name, "path"))
        self.mode = mode
        self.fsync = fsync
        self._fd: int | None = None

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # read access too, for _drop_partial_line's pread
        flags = os.O_RDWR | os.O_CREAT | (os.O_APPEND if self.mode == "a" else os.O_TRUNC)
        fd = os.open(self.path, flags, 0o644)
        if self.mode == "a" and self.path.is_file():
            _drop_partial_line(fd)
        return fd

    def _write(self, record: dict[str, Any], step: int) -> None:
        if "step" not in record:
            record = {"schema": record.get("schema", SCHEMA), "step": step, **record}
        if self._fd is None:
            self._fd = self._open()
        data = (encode_record(record) + "\n").encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(self._fd, data):]
            if self.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            # never leave part of a line behind: the file keeps whole records only
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            if exc.errno in _FULL:
                raise OSError(exc.errno, f"{exc.strerror}: {self.path} is on a full disk or at "
                              f"the file size limit; step {step} and later are not in it (the "
                              "lines before are whole)") from exc
            raise

    def resume(self, records: int) -> None:
        """Continue a resumed run: keep the first ``records`` lines (the records up to the
        checkpoint restored, ``guard.records``) and drop the later ones, whose steps run again,
        so each step keeps one line. ``Guard.resume()`` calls it; ``mode="w"`` starts over anyway."""
        if not self.active or self.disabled or self.closed or self.mode != "a":
            return
        try:
            self.flush()
            if self._fd is None:
                if not self.path.is_file():
                    return
                self._fd = self._open()
            cut = _line_end(self._fd, records)
            if cut is not None:
                os.ftruncate(self._fd, cut)
        except Exception as exc:
            self._fail(exc)

    def resume_at_step(self, step: int) -> None:
        """Continue at ``step`` where the record count is unknown (``Guard.start_at``: a
        framework resumed without the guard's state): keep the lines before the first record
        whose step is ``step`` or later, drop that one and the rest (their steps run again)."""
        if not self.active or self.disabled or self.closed or self.mode != "a":
            return
        if not self.path.is_file():
            return
        keep = 0
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    at = json.loads(line).get("step")
                except (ValueError, AttributeError):
                    break  # a cut line: resume() keeps whole lines only
                if isinstance(at, int) and at >= step:
                    break
                keep += 1
        self.resume(keep)

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
