"""The reliability table: each fault's runs, how many survived, and what was lost.

A fault test wraps each run in ``table.run(row)``; the run counts its losses on the returned
object (``r.lost += n``) and sets ``r.held = False`` when a promise other than "nothing lost"
broke (a wrong tier, an unclear error). A run that raises counts as not survived. A run survived
when it raised nothing, every promise held and nothing was lost.

Lost, for every row alike: a checkpoint that was complete before the fault no longer loads; a
finished step's JSONL line missing or unparseable; a step repeated or skipped after resume beyond
the last checkpoint; a weight holding a NaN or Inf after the guard let the step through. Security
rows count a breach (a payload that ran, a byte served from outside the page's assets) as lost.

Tests elsewhere in the suite join the table by node id (``EXTERNAL``): a pass is one survived
run, a failure one run lost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["EXTERNAL", "ROWS", "Run", "Table"]

ROWS: tuple[str, ...] = (
    "kill in a sync save: after_shard",
    "kill in a sync save: before_commit",
    "kill in a sync save: after_manifest",
    "kill in a sync save: after_commit",
    "kill in an async save: after_shard",
    "kill in an async save: before_commit",
    "kill in an async save: after_manifest",
    "kill in an async save: after_commit",
    "disk full in a save (EFBIG), on_error=raise",
    "disk full in a save (EFBIG), on_error=warn",
    "rank killed mid-step, torchrun elastic restart",
    "metrics disk full (ENOSPC)",
    "metrics file size limit (EFBIG) mid-line",
    "metrics partial line left by a kill",
    "NaN in an activation",
    "inf in an activation",
    "NaN in a gradient",
    "inf in a gradient",
    "NaN loss",
    "inf loss",
    "1e6-sized gradient",
    "fp16 overflow",
    "bad input to every public name",
    "planted payload: DCP metadata",
    "planted payload: DCP bytes entry",
    "checkpoint entry pointing outside it",
    "sandbox binds 127.0.0.1 only",
    "sandbox serves nothing outside its assets",
)
"""Every row, in the order the table prints them."""

EXTERNAL: dict[str, str] = {
    "tests/test_checkpoint_integrity.py::test_payload_in_metadata_is_refused_and_never_runs":
        "planted payload: DCP metadata",
    "tests/test_checkpoint_integrity.py::test_payload_in_a_bytes_entry_is_refused_and_never_runs":
        "planted payload: DCP bytes entry",
    "tests/test_checkpoint_integrity.py::test_storage_entry_pointing_outside_the_checkpoint_is_refused":
        "checkpoint entry pointing outside it",
}
"""Existing tests elsewhere in the suite that are rows of this table (node id -> row)."""


@dataclass
class Run:
    """One run of a fault: what it lost and whether its other promises held."""

    row: str
    lost: int = 0
    held: bool = True


@dataclass
class _Row:
    runs: int = 0
    survived: int = 0
    lost: int = 0


class Table:
    """Counts per row over a pytest session."""

    def __init__(self) -> None:
        self.rows: dict[str, _Row] = {}

    def add(self, row: str, *, survived: bool, lost: int) -> None:
        if row not in ROWS:
            raise ValueError(f"{row!r} is not a row of the reliability table; add it to ROWS")
        r = self.rows.setdefault(row, _Row())
        r.runs += 1
        r.survived += int(survived and lost == 0)
        r.lost += lost

    @contextlib.contextmanager
    def run(self, row: str) -> Iterator[Run]:
        """One run of ``row``; an exception inside counts it as not survived (and propagates)."""
        r = Run(row)
        try:
            yield r
        except BaseException:
            self.add(row, survived=False, lost=r.lost)
            raise
        self.add(row, survived=r.held, lost=r.lost)

    def render(self, *, markdown: bool = False) -> str:
        """The table, rows in ROWS order (rows with no run are left out)."""
        body = [(name, self.rows[name]) for name in ROWS if name in self.rows]
        head = ("fault", "runs", "survived", "lost")
        cells = [(n, str(r.runs), str(r.survived), str(r.lost)) for n, r in body]
        if markdown:
            lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---:|"]
            lines += ["| " + " | ".join(c) + " |" for c in cells]
            return "\n".join(lines)
        width = max([len(head[0])] + [len(c[0]) for c in cells])
        fmt = f"{{:<{width}}}  {{:>5}}  {{:>8}}  {{:>4}}"
        return "\n".join([fmt.format(*head), *(fmt.format(*c) for c in cells)])
