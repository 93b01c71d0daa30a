"""A compact live line per step and a summary table at the end, with rich."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .._validate import check_int
from ._base import Sink, this_rank

__all__ = ["ConsoleSink"]

# (record key, short label, format)
_FIELDS = (("loss", "loss", ".4f"), ("grad_norm", "gnorm", ".3g"), ("log_z", "logZ", ".2f"),
           ("loss_ema_ratio", "ratio", ".2f"), ("nan_frac", "nan", ".2g"), ("lr", "lr", ".2e"))


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class _Summary:
    """Count, last, min, max and mean of one metric (non-finite values counted apart)."""

    def __init__(self) -> None:
        self.n = self.nonfinite = 0
        self.last = math.nan
        self.lo, self.hi, self.total = math.inf, -math.inf, 0.0

    def add(self, x: float) -> None:
        self.last = x
        if not math.isfinite(x):
            self.nonfinite += 1
            return
        self.n += 1
        self.lo, self.hi, self.total = min(self.lo, x), max(self.hi, x), self.total + x


class ConsoleSink(Sink):
    """One compact line per step: live in place on a terminal; elsewhere (logs, CI) printed every
    ``every`` steps and at every step whose action is not "continue". ``close()`` prints a table:
    last, min, max and mean of each metric, non-finite counts, and how often each action ran.
    Under torch.distributed only rank ``rank`` (default 0) prints; ``rank=None`` prints on every
    rank, each line headed by ``[rank r]``.
    """

    def __init__(self, *, console: Console | None = None, every: int = 10,
                 live: bool | None = None, defer: bool | None = None,
                 rank: int | None = 0) -> None:
        check_int(every, "ConsoleSink every", hint="print every that many steps")
        super().__init__(defer=defer, rank=rank)
        self.console = console or Console(highlight=False)
        self.every = every
        self.live = self.console.is_terminal if live is None else live
        self._head = f"[rank {this_rank(self.name)}] " if rank is None else ""
        self._live: Live | None = None
        self._stats: dict[str, _Summary] = {key: _Summary() for key, _, _ in _FIELDS}
        self._actions: Counter[str] = Counter()
        self._steps = 0
        self._first_step: int | None = None
        self._last_step: int | None = None

    @staticmethod
    def line(record: dict[str, Any], step: int) -> str:
        """The compact text of one record."""
        parts = [f"step {step:>7}"]
        for key, label, fmt in _FIELDS:
            x = _num(record.get(key))
            if x is not None:
                parts.append(f"{label} {x:{fmt}}")
        action = record.get("action", "continue")
        if action != "continue" or record.get("tier"):
            parts.append(f"tier {record.get('tier')} {action}")
        reasons = record.get("reasons") or []
        if reasons:
            parts.append("; ".join(map(str, reasons)))
        return " | ".join(parts)

    def _write(self, record: dict[str, Any], step: int) -> None:
        self._steps += 1
        self._first_step = step if self._first_step is None else self._first_step
        self._last_step = step
        for key, summary in self._stats.items():
            x = _num(record.get(key))
            if x is not None:
                summary.add(x)
        action = str(record.get("action", "continue"))
        self._actions[action] += 1
        text = self._head + self.line(record, step)
        if self.live:
            if self._live is None:
                self._live = Live(Text(text), console=self.console, refresh_per_second=4,
                                  transient=False)
                self._live.start()
            else:
                self._live.update(Text(text))
        elif step % self.every == 0 or action != "continue":
            self.console.print(text, markup=False)

    def summary_table(self) -> Table:
        """The end-of-run table."""
        table = Table(title=f"spikeguard: {self._steps} steps logged "
                            f"({self._first_step} to {self._last_step})")
        for col in ("metric", "last", "min", "max", "mean", "non-finite"):
            table.add_column(col, justify="left" if col == "metric" else "right")
        for key, _, fmt in _FIELDS:
            s = self._stats[key]
            if s.n == 0 and s.nonfinite == 0:
                continue
            cells = [f"{v:{fmt}}" if s.n else "-" for v in (s.lo, s.hi, s.total / max(s.n, 1))]
            table.add_row(key, f"{s.last:{fmt}}", *cells, str(s.nonfinite))
        table.caption = "actions: " + ", ".join(f"{a} {n}" for a, n in self._actions.most_common())
        return table

    def _close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._steps:
            self.console.print(self.summary_table())
