"""The report's plots as PNG bytes (matplotlib, the ``plot`` extra, imported here only).

Figures are drawn on matplotlib's Agg canvas directly (``matplotlib.figure.Figure``), never
through pyplot, so writing a report neither needs a display nor changes the caller's backend.
Long logs are thinned to each bucket's minimum and maximum, so a single-step spike stays visible.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

__all__ = ["TIER_COLORS", "draw", "figures", "zoom_window"]

TIER_COLORS = {0: "#9e9e9e", 1: "#f4b400", 2: "#e8710a", 3: "#d93025"}
"""Shading of a spike by tier: grey (no action), amber (skip), orange (rollback), red (halt)."""

_POINTS = 2000  # buckets per line: about the pixel width of a wide figure


def _envelope(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = len(y)
    if n <= 2 * _POINTS:
        return x, y
    b = -(-n // _POINTS)
    pad = (-n) % b
    yy = np.r_[y, np.full(pad, np.nan)].reshape(-1, b)
    finite = np.where(np.isfinite(yy), yy, np.nan)
    full = np.isfinite(finite).any(axis=1)
    lo = np.where(full, np.nanargmin(np.where(full[:, None], finite, 0.0), axis=1), 0)
    hi = np.where(full, np.nanargmax(np.where(full[:, None], finite, 0.0), axis=1), 0)
    base = np.arange(len(yy)) * b
    idx = np.unique(np.minimum(np.r_[base + lo, base + hi], n - 1))
    return x[idx], y[idx]


def _png(fig: Any) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _shade(ax: Any, spikes: list[Any], lo: float | None = None, hi: float | None = None) -> None:
    for s in spikes:
        if (hi is not None and s.start > hi) or (lo is not None and s.end < lo):
            continue
        ax.axvspan(s.start, max(s.end, s.start + 1), color=TIER_COLORS[s.tier], alpha=0.25, lw=0)
        if s.rollback_step is not None:
            ax.axvline(s.rollback_step, color=TIER_COLORS[s.tier], ls="--", lw=1)


def _nonfinite(ax: Any, steps: np.ndarray, y: np.ndarray,
               missing: np.ndarray | None = None) -> None:
    """Cross the logged NaN / inf values (a missing cell is no value: never crossed)."""
    bad = ~np.isfinite(y) if missing is None else ~np.isfinite(y) & ~missing
    if bad.any():
        ax.plot(steps[bad], np.full(int(bad.sum()), 0.97), "x", color=TIER_COLORS[3], ms=8,
                transform=ax.get_xaxis_transform(), label="NaN / inf")


def _figure(title: str, rows: int = 1, height: float = 3.0) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    inches = height * rows
    fig = Figure(figsize=(11, inches))
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    # fixed margins (in inches), the legends in the right one: every plot of a report has its
    # data area at the same place and width, so their step axes line up
    fig.subplots_adjust(left=0.8 / 11, right=1 - 2.4 / 11, top=1 - 0.4 / inches,
                        bottom=0.55 / inches, hspace=0.12)
    fig.suptitle(title, fontsize=11)
    return fig, axes


def _series(ax: Any, steps: np.ndarray, y: np.ndarray, label: str, **kw: Any) -> None:
    x, yy = _envelope(steps, y)
    if np.isfinite(yy).sum() < 50:  # a few records, or values between gaps: each one shows
        kw = {"marker": "o", "ms": 3, **kw}
    ax.plot(x, yy, lw=0.8, label=label, **kw)


def _panel(ax: Any, name: str, diag: Any, sl: slice) -> None:
    log, trace, cfg = diag.log, diag.replay.trace, diag.replay.config
    steps = log.steps[sl]
    y = log.columns[name][sl]
    _series(ax, steps, y, name, color="#1a73e8")
    if name == "grad_norm" and "grad_median" in trace:
        med = trace["grad_median"][sl]
        x, m = _envelope(steps, med)
        ax.fill_between(x, m, cfg.grad_k * m, color="#34a853", alpha=0.15,
                        label=f"running median .. {cfg.grad_k:g}x (skip above)")
        ax.plot(x, m, color="#34a853", lw=1, label="running median")
        fin = y[np.isfinite(y)]
        if len(fin) and (fin > 0).all():  # a log axis needs a positive value to show
            ax.set_yscale("log")
    if name == "log_z" and "log_z_median" in trace:
        x, m = _envelope(steps, trace["log_z_median"][sl])
        ax.plot(x, m, color="#34a853", lw=1, label="running median")
        ax.plot(x, m + cfg.log_z_drift, color="#e8710a", lw=0.8, ls=":",
                label=f"median + {cfg.log_z_drift:g} (drift rule)")
    miss = log.missing.get(name)
    _nonfinite(ax, steps, y, None if miss is None else miss[sl])
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)
    if ax.get_yscale() == "log":  # plain numbers at 1, 2, 5 x 10^k
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())


def _ratio_panel(ax: Any, diag: Any, sl: slice) -> None:
    cfg = diag.replay.config
    steps = diag.log.steps[sl]
    _series(ax, steps, diag.replay.trace["loss_ema_ratio"][sl], "loss / EMA", color="#1a73e8")
    for level, color, what in ((cfg.alert_ratio, TIER_COLORS[1], "alert"),
                               (cfg.skip_ratio, TIER_COLORS[2], "skip"),
                               (cfg.tier2_ratio, TIER_COLORS[3], "Tier 2")):
        ax.axhline(level, color=color, lw=0.8, ls=":", label=f"{what} {level:g}")
    ax.set_ylabel("loss / EMA")
    ax.grid(alpha=0.3)


def _legend(ax: Any, fontsize: float = 8) -> None:
    """The legend beside the axes, never over the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0, fontsize=fontsize)


def zoom_window(start: int, end: int, band: int, span: int) -> tuple[int, int]:
    """Steps [lo, hi] of a spike's zoom: the spike with room before it (its evidence band) and
    after, but at most 4x its own width and an eighth of the log's ``span`` each side (at least
    10 steps), so the zoom of a short spike is a zoom, not the whole run."""
    width = end - start + 1
    pad = max(10, min(band, 4 * width, span // 8))
    return start - pad, end + max(5, pad // 2)


def _fired(spike: Any, log: Any) -> list[str]:
    """The logged signals a spike's rules fired on that the zoom would not show otherwise (the
    update ratio of the signals' UpdateJump rule; the loss scale of a precision finding)."""
    out = [m for m in ("update_ratio",)
           if m in log.columns and any(r.startswith(m) for r in spike.reasons)]
    if "precision" in spike.kinds and "grad_scale" in log.columns:
        out.append("grad_scale")  # the loss scale a precision finding is about
    return out


def figures(diag: Any, *, zooms: int = 6) -> dict[str, tuple[str, bytes]]:
    """{name: (caption, PNG bytes)}: loss, grad norm with its running-median band, log Z,
    loss / EMA, and a zoom on each of the first ``zooms`` spikes of the highest tiers."""
    return {name: (caption, _png(fig)) for name, (caption, fig) in draw(diag, zooms=zooms).items()}


def draw(diag: Any, *, zooms: int = 6) -> dict[str, tuple[str, Any]]:
    """The figures of :func:`figures`, as matplotlib Figures."""
    log, spikes = diag.log, diag.spikes
    everything = slice(0, len(log))
    out: dict[str, tuple[str, Any]] = {}
    names = [m for m in ("loss", "grad_norm", "log_z") if m in log.columns]
    captions = {
        "loss": "Training loss; spikes shaded by tier, dashed lines at rollback checkpoints.",
        "grad_norm": "Pre-clip grad norm with the detector's running median and its skip band.",
        "log_z": "log Z with its running median and the drift threshold.",
    }
    for name in names:
        fig, (ax,) = _figure(name.replace("_", " "))
        _panel(ax, name, diag, everything)
        _shade(ax, spikes)
        _legend(ax)
        ax.set_xlabel("step")
        out[name] = (captions[name], fig)
    if "loss_ema_ratio" in diag.replay.trace:
        fig, (ax,) = _figure("loss / EMA")
        _ratio_panel(ax, diag, everything)
        _shade(ax, spikes)
        _legend(ax)
        ax.set_xlabel("step")
        out["loss_ema_ratio"] = ("The loss over the detector's EMA, with the alert, skip and "
                                 "Tier 2 levels.", fig)
    ranked = sorted(range(len(spikes)), key=lambda k: (-spikes[k].tier, k))[:zooms]
    band = diag.find.band_steps
    for k in sorted(ranked):
        s = spikes[k]
        lo, hi = zoom_window(s.start, s.end, band, int(log.steps[-1] - log.steps[0]))
        sl = slice(int(np.searchsorted(log.steps, lo)), int(np.searchsorted(log.steps, hi, "right")))
        shown = [*names, *_fired(s, log)]
        if not shown:
            continue
        fig, axes = _figure(f"spike {k + 1}: steps {s.start:,}-{s.end:,}, Tier {s.tier} "
                            f"({s.action})", rows=len(shown), height=2.2)
        for ax, name in zip(axes, shown):
            _panel(ax, name, diag, sl)
            _shade(ax, [s], lo, hi)
            moved = s.evidence.get("exits", {}).get(name)
            if moved is not None:
                ax.axvline(moved, color="#202124", ls=":", lw=1, label=f"moved at {moved:,}")
            _legend(ax, fontsize=7)
        axes[-1].set_xlabel("step")
        out[f"spike{k + 1}"] = (f"Spike {k + 1} up close: {s.cause}.", fig)
    return out
