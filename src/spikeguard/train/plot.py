"""``run.png``: the run at a glance. Four panels over the training step (loss, grad norm with its
running median and the 3x band, log Z, loss/EMA); each action of the guard a colour and a shape of
its own, drawn above the curves; the unarmed stretch (statistical rules not yet on) shaded; the
steps a rollback abandoned drawn dashed in grey beside their replay; a legend above the panels
naming only what happened.

Figures are drawn on matplotlib's Agg canvas directly (``matplotlib.figure.Figure``), never through
pyplot, so a plot neither needs a display nor changes the caller's backend.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from pathlib import Path
from typing import Any

__all__ = ["ACTION_STYLE", "DPI", "REPLAYED_COLOR", "UNARMED_COLOR", "draw_run", "final_path",
           "plot_run"]

ACTION_STYLE = {"skip": ("#e69f00", "v", "skip (Tier 1)"),
                "alert": ("#0072b2", "D", "alert (Tier 2)"),
                "rollback": ("#9b30d9", "s", "rollback (Tier 2)"),
                "halt": ("#d00000", "X", "halt (Tier 3)")}
"""Each action's colour, marker and legend label (orange, blue, purple, red: told apart in colour
and in shape)."""
UNARMED_COLOR = "#e4e4e4"
"""Shading of the steps before the statistical rules armed."""
DPI = 90
REPLAYED_COLOR = "#f3e6fb"
"""Shading of the steps a rollback sent training back over (they ran twice)."""
LINE, ABANDONED, MEDIAN, BAND = "#1f5f99", "#7f7f7f", "#000000", "#2ca02c"
_PANELS = (("loss", "loss (nats)"), ("grad_norm", "grad norm (pre-clip)"), ("log_z", "log Z"),
           ("loss_ema_ratio", "loss / EMA"))


def _num(r: dict[str, Any], key: str) -> float:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else math.nan


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """[start, stop) index ranges where ``flags`` is True."""
    out, start = [], None
    for i, f in enumerate([*flags, False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i))
            start = None
    return out


def final_path(records: list[dict[str, Any]]) -> list[bool]:
    """For each record (run order), whether it is the last record of its step: the path training
    kept. A rollback's abandoned steps (run again after it) are False."""
    last = {r["step"]: i for i, r in enumerate(records)}
    return [last[r["step"]] == i for i, r in enumerate(records)]


def draw_run(records: list[dict[str, Any]], *, title: str, skip_ratio: float = 2.0) -> Any:
    """The figure of ``plot_run`` (a ``matplotlib.figure.Figure`` at :data:`DPI`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig = Figure(figsize=(10, 10.5), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(_PANELS), 1, sharex=True)
    kept = final_path(records)
    path = [r for r, k in zip(records, kept) if k]
    steps = [r["step"] for r in path]
    unarmed = _runs([r.get("armed") is False for r in path])
    abandoned = _runs([not k for k in kept])
    handles: list[Any] = [Line2D([], [], color=LINE, lw=1.2, label="training (the path kept)")]
    if abandoned:
        handles.append(Line2D([], [], color=ABANDONED, lw=1.2, ls="--",
                              label="steps a rollback abandoned"))
    replayed = [(r["rollback_to"], r["step"]) for r in records
                if r.get("action") == "rollback" and isinstance(r.get("rollback_to"), int)]
    if replayed:
        handles.append(Patch(color=REPLAYED_COLOR, label="run again after a rollback"))
    for ax, (key, label) in zip(axes, _PANELS):
        for a, b in unarmed:
            ax.axvspan(steps[a] - 0.5, steps[b - 1] + 0.5, color=UNARMED_COLOR, lw=0, zorder=0)
        for lo, hi in replayed:
            ax.axvspan(lo + 0.5, hi + 0.5, color=REPLAYED_COLOR, lw=0, zorder=0)
        for a, b in abandoned:
            ax.plot([r["step"] for r in records[a:b]], [_num(r, key) for r in records[a:b]],
                    color=ABANDONED, lw=1.3, ls="--", zorder=1)
        ax.plot(steps, [_num(r, key) for r in path], color=LINE, lw=0.9, zorder=2)
        ax.set_ylabel(label)
    g = [_num(r, "grad_norm") for r in path]
    window: deque[float] = deque(maxlen=200)
    band = []
    for v in g:
        if math.isfinite(v):
            window.append(v)
        band.append(statistics.median(window) if window else math.nan)
    axes[1].plot(steps, band, lw=1.0, color=MEDIAN, zorder=2)
    axes[1].fill_between(steps, band, [3 * b for b in band], alpha=0.12, color=BAND, lw=0,
                         zorder=1)
    if any(v > 0 for v in g if math.isfinite(v)):
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

        axes[1].set_yscale("log")  # plain numbers at 1, 2, 5 x 10^k
        axes[1].yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axes[1].yaxis.set_major_formatter(ScalarFormatter())
        axes[1].yaxis.set_minor_formatter(NullFormatter())
    axes[3].axhline(skip_ratio, ls=":", color="gray", lw=0.9, zorder=1)
    handles += [Line2D([], [], color=MEDIAN, lw=1.0, label="running median"),
                Patch(color=BAND, alpha=0.2, lw=0, label="median .. 3x median"),
                Line2D([], [], color="gray", ls=":", label=f"skip ratio {skip_ratio:g}")]
    if unarmed:
        handles.append(Patch(color=UNARMED_COLOR, label="unarmed: only NaN/Inf and clipping act"))
    for action, (color, marker, name) in ACTION_STYLE.items():
        at = [r["step"] for r in records if r.get("action") == action]
        if not at:
            continue
        for ax in axes:
            for s in at:
                ax.axvline(s, color=color, lw=1.6, zorder=4)
            ax.plot(at, [1.0] * len(at), ls="", marker=marker, ms=10, color=color,
                    markeredgecolor="white", markeredgewidth=0.8, zorder=6,
                    transform=ax.get_xaxis_transform(), clip_on=False)
        handles.append(Line2D([], [], color=color, marker=marker, ms=9, lw=1.6,
                              markeredgecolor="white", label=f"{name}: {len(at)}"))
    axes[-1].set_xlabel("training step")
    last = max((r["step"] for r in records), default=0)
    axes[-1].set_xlim(-0.5, last + max(1.5, 0.01 * last))
    fig.suptitle(title, y=0.995)
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.975), ncol=4,
               fontsize=8, frameon=False)
    fig.subplots_adjust(top=0.9, bottom=0.05, left=0.09, right=0.98, hspace=0.1)
    return fig


def plot_run(records: list[dict[str, Any]], png: Path, *, title: str,
             skip_ratio: float = 2.0) -> Path | None:
    """Write the four panels of ``records`` (a metrics log, run order) to ``png``; None when
    matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    if not records:
        return None
    fig = draw_run(records, title=title, skip_ratio=skip_ratio)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=DPI)
    return png
