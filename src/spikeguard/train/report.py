"""What ``spikeguard train`` shows: a progress bar while it runs, a summary of what the guard did,
and a plot of the run (loss, grad norm with its median band, log Z, loss/EMA; skips, rollbacks
and halts marked)."""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["ProgressSink", "plot_run", "summary_table"]


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

    def tokens_per_s(self) -> float:
        if len(self._times) < 2:
            return math.nan
        return self.tokens_per_step * (len(self._times) - 1) / (self._times[-1] - self._times[0])

    def log(self, record: dict[str, Any], step: int) -> None:
        self._times.append(time.perf_counter())
        self.last = record
        action = record.get("action", "continue")
        self.actions[action] += 1
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

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def summary_table(progress: ProgressSink, *, steps: int, applied: int, rollbacks: int,
                  val_loss: float, seconds: float, halted: bool) -> Table:
    """What the guard did over the run, one row a kind of action."""
    table = Table(title="what the guard did", show_header=True)
    table.add_column("")
    table.add_column("count", justify="right")
    table.add_row("steps run (replays after a rollback included)", f"{sum(progress.actions.values()):,}")
    table.add_row("updates applied", f"{applied:,}")
    for action in ("skip", "alert", "rollback", "halt"):
        table.add_row(f"{action}s", f"{progress.actions.get(action, 0):,}")
    table.add_row("rollbacks used", f"{rollbacks}")
    table.add_row("held-out loss (nats)", "halted" if halted else f"{val_loss:.4f}")
    table.add_row("seconds", f"{seconds:,.1f}")
    return table


def plot_run(records: list[dict[str, Any]], png: Path, *, title: str) -> Path | None:
    """Four panels from the run's records; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = list(range(len(records)))  # record order: a rollback replays steps, time goes on
    def col(key: str) -> list[float]:
        return [r.get(key) if isinstance(r.get(key), (int, float)) else math.nan for r in records]

    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    axes[0].plot(steps, col("loss"), lw=0.8)
    axes[0].set_ylabel("loss (nats)")
    g = col("grad_norm")
    axes[1].plot(steps, g, lw=0.8)
    window, band = deque(maxlen=200), []
    for v in g:
        if math.isfinite(v):
            window.append(v)
        band.append(statistics.median(window) if window else math.nan)
    axes[1].plot(steps, band, lw=1.0, color="black", label="running median")
    axes[1].fill_between(steps, band, [3 * b for b in band], alpha=0.15, color="gray",
                         label="median .. 3x median")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("grad norm (pre-clip)")
    axes[1].legend(loc="upper right", fontsize=8)
    axes[2].plot(steps, col("log_z"), lw=0.8)
    axes[2].set_ylabel("log Z")
    axes[3].plot(steps, col("loss_ema_ratio"), lw=0.8)
    axes[3].axhline(2.0, ls="--", color="gray", lw=0.8)
    axes[3].set_ylabel("loss / EMA")
    axes[3].set_xlabel("step (in run order)")
    colors = {"skip": "orange", "rollback": "purple", "halt": "red", "alert": "gold"}
    for i, r in enumerate(records):
        c = colors.get(r.get("action"))
        if c:
            for ax in axes:
                ax.axvline(i, color=c, alpha=0.5, lw=1.0)
    handles = [plt.Line2D([], [], color=c, label=a) for a, c in colors.items()]
    axes[0].legend(handles=handles, loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png
