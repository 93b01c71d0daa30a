"""The batch ledger: which batches each step consumed, and what a rollback skips or drops.

The ledger reads the data source's ``position`` (a TokenStream's index of the next batch) at
every step and remembers, for the last ``history`` steps, the inclusive range of stream indices
the step consumed, so a Tier 2 onset can be turned into the batches to leave out. It is the one
part that tells the data source to ``skip`` a range or ``drop`` rows, and it keeps every range
and drop it applied (``skipped``, ``dropped``): a later policy can re-apply them after a restore
to an older checkpoint. A source without ``position`` (a plain iterator) gives no ranges.
"""

from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["BatchLedger"]

_HISTORY = 20_000
"""Steps whose consumed batch range the ledger remembers (a Tier 2 onset lies within them)."""


class BatchLedger:
    """Data position, the batches of recent steps, the skip ranges and drops applied."""

    def __init__(self, data: Any, history: int = _HISTORY) -> None:
        self.data = data
        self.batches: deque[tuple[int, int, int]] = deque(maxlen=history)
        """(step, first index, last index) of the batches each recent step consumed."""
        self.skipped: list[tuple[int, int]] = []
        """Every batch range this ledger made the source skip, in order."""
        self.dropped: dict[int, list[int]] = {}
        """Every batch index -> rows this ledger made the source drop."""
        self._pos = self.position()

    def position(self) -> int | None:
        pos = getattr(self.data, "position", None)
        return int(pos) if isinstance(pos, int) else None

    def consume(self, step: int) -> tuple[int, int] | None:
        """The range of stream indices step ``step`` consumed since the last call, recorded."""
        pos = self.position()
        if pos is None or self._pos is None:
            self._pos = pos
            return None
        span = (self._pos, pos - 1)
        self._pos = pos
        self.batches.append((step, *span))
        return span

    def resync(self) -> None:
        """After a restore moved the source: measure the next step from where it is now."""
        self._pos = self.position()

    def data_range(self, onset: int, detection: int) -> tuple[int, int] | None:
        """The stream indices consumed by steps onset..detection (None if unknown)."""
        spans = [(lo, hi) for s, lo, hi in self.batches if onset <= s <= detection and lo <= hi]
        if not spans:
            return None
        return min(lo for lo, _ in spans), max(hi for _, hi in spans)

    def snapshot(self) -> dict[str, Any] | None:
        """The source's state now (for a checkpoint written one step late), or None."""
        return self.data.state_dict() if hasattr(self.data, "state_dict") else None

    @property
    def can_skip(self) -> bool:
        return callable(getattr(self.data, "skip", None))

    @property
    def can_drop(self) -> bool:
        return callable(getattr(self.data, "drop", None))

    def skip(self, lo: int, hi: int) -> None:
        self.data.skip(lo, hi)
        self.skipped.append((lo, hi))

    def drop(self, drops: dict[int, list[int]]) -> None:
        for index, rows in drops.items():
            self.data.drop(index, rows)
            self.dropped.setdefault(index, []).extend(rows)

    def reapply(self) -> None:
        """After a restore to an older checkpoint: every range skipped and every row dropped so
        far holds again (they are what the run learned about its data, not state to restore;
        the source's own state came back as the checkpoint had it)."""
        ranges = {tuple(r) for r in getattr(self.data, "skip_ranges", ())}
        for lo, hi in self.skipped:
            if (lo, hi) not in ranges and self.can_skip:
                self.data.skip(lo, hi)
        if self.can_drop:
            for index, rows in self.dropped.items():
                self.data.drop(index, rows)

    def rows_of(self, index: int | None, n: int) -> list[int]:
        """The full-batch row numbers of the ``n`` rows batch ``index`` yielded."""
        rows_of = getattr(self.data, "rows_of", None)
        if index is not None and callable(rows_of):
            kept = rows_of(index)
            if len(kept) == n:
                return list(kept)
        return list(range(n))

    def state_dict(self) -> list[list[int]]:
        return [list(b) for b in self.batches]

    def load_state_dict(self, batches: list[list[int]]) -> None:
        self.batches = deque((tuple(int(x) for x in b) for b in batches),
                             maxlen=self.batches.maxlen)
