"""What ``spikeguard train`` shows while it runs: a progress bar, then a summary of what the guard
did (the picture of the run is ``plot.py``)."""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["ProgressSink", "summary_table"]


class ProgressSink:
    """A sink (``log(record, step)``) that drives a rich progress bar and counts the guard's
    actions. Shows loss, grad norm, log Z and tokens per second."""

    def __init__(self, console: Console, *, total: int, start: int, tokens_per_step: int,
                 bar: bool, print_every: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.console, self.tokens_per_step = console, tokens_per_step
        self.actions: Counter[str] = Counter()
        self.events: list[str] = []
        self.print_every = print_every
        self._times: deque[float] = deque(maxlen=20)
        self._progress = None
        if bar and console.is_terminal:
            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[status]}"), console=console,
                                      transient=False)
            self._task = self._progress.add_task("train", total=total, completed=start, status="")
            self._progress.start()
        self.last: dict[str, Any] = {}
        self.no_target: list[int] = []
        """Steps of a Tier 2 rollback that found no checkpoint before the onset (alerted)."""
        self.lr_kept: tuple[int, float] | None = None
        """(step, multiple) of the last rollback that kept the LR lower for good."""
        self.qk_clip: tuple[int, Any] | None = None
        """(step, threshold or why not) of the rollback that turned QK-Clip on
        (GuardConfig.rollback_qk_clip)."""

    def tokens_per_s(self) -> float:
        if len(self._times) < 2:
            return math.nan
        return self.tokens_per_step * (len(self._times) - 1) / (self._times[-1] - self._times[0])

    def log(self, record: dict[str, Any], step: int) -> None:
        self._times.append(time.perf_counter())
        self.last = record
        action = record.get("action", "continue")
        self.actions[action] += 1
        if record.get("rollback_failed"):
            self.no_target.append(step)
        if record.get("lr_kept") is not None:
            self.lr_kept = (step, float(record["lr_kept"]))
        if record.get("qk_clip") is not None:
            self.qk_clip = (step, record["qk_clip"])
        if action != "continue":
            reasons = "; ".join(record.get("reasons") or [])
            extra = f" -> step {record['rollback_to']}" if record.get("rollback_to") is not None else ""
            self.events.append(f"step {step}: {action}{extra} ({reasons})")
            self.console.print(f"  step {step}: [bold]{action}[/]{extra}  {reasons}")
        status = (f"loss {record.get('loss', math.nan):.3f}  |g| {record.get('grad_norm', math.nan):.3f}"
                  f"  logZ {record.get('log_z', math.nan):.2f}  {self.tokens_per_s():,.0f} tok/s")
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, status=status)
        elif (step + 1) % self.print_every == 0:
            self.console.print(f"step {step + 1:>6}  {status}")

    def extend(self, total: int) -> None:
        """The run grew to ``total`` steps (withheld updates made up)."""
        if self._progress is not None:
            self._progress.update(self._task, total=total)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def summary_table(progress: ProgressSink, *, applied: int, made_up: int, rollbacks: int,
                  val_loss: float, seconds: float, halted: bool) -> Table:
    """What the guard did over the run, one row a kind of action."""
    table = Table(title="what the guard did", show_header=True)
    table.add_column("")
    table.add_column("count", justify="right")
    table.add_row("steps run (replays after a rollback included)", f"{sum(progress.actions.values()):,}")
    table.add_row("updates applied", f"{applied:,}")
    if made_up:
        table.add_row("skipped batches made up (steps past --steps)", f"{made_up:,}")
    for action in ("skip", "alert", "rollback", "halt"):
        table.add_row(f"{action}s", f"{progress.actions.get(action, 0):,}")
    table.add_row("rollbacks used", f"{rollbacks}")
    if progress.no_target:
        steps = ", ".join(str(s) for s in progress.no_target[:5])
        more = f" (+{len(progress.no_target) - 5})" if len(progress.no_target) > 5 else ""
        table.add_row(f"rollbacks not made: no checkpoint precedes the onset (steps {steps}{more};"
                      " alerted, went on)", f"{len(progress.no_target)}")
    if progress.lr_kept is not None:
        step, kept = progress.lr_kept
        table.add_row(f"LR kept at this multiple of the schedule for good (the trouble came back "
                      f"after a rollback; step {step})", f"{kept:g}x")
    if progress.qk_clip is not None:
        step, tau = progress.qk_clip
        table.add_row(f"QK-Clip turned on by the rollback at step {step} (the page named the "
                      "attention logits)", f"{tau:g}" if isinstance(tau, float) else str(tau))
    table.add_row("held-out loss (nats)", "halted" if halted else f"{val_loss:.4f}")
    table.add_row("seconds", f"{seconds:,.1f}")
    return table
