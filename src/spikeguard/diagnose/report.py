"""A diagnosis as a terminal summary (rich), and as a report file (HTML or Markdown) with plots.

The HTML report is one self-contained file: every plot is a PNG embedded as a base64 data URI.
The Markdown report writes its PNGs into a folder beside it (``<name>_plots/``) and links them.
Both need matplotlib (``pip install spikeguard[plot]``).
"""

from __future__ import annotations

import base64
import html
import os
import time
from pathlib import Path
from typing import Any

from .triage import Diagnosis, Spike

__all__ = ["print_summary", "spike_rows", "whatif_rows", "write_report"]

SPIKE_COLUMNS = ("#", "start", "end", "tier", "action", "roll back to", "moved first",
                 "grad x median", "log Z rise", "recovery", "cause")


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def spike_rows(diag: Diagnosis, spikes: list[Spike] | None = None) -> list[list[str]]:
    """One row of ``SPIKE_COLUMNS`` per spike (``diag.spikes`` unless given)."""
    rows = []
    for k, s in enumerate(diag.spikes if spikes is None else spikes, 1):
        ev = s.evidence
        moved = ev.get("moved_first") or []
        first = (" = ".join(moved) + f" @ {ev['moved_at']:,}") if moved else "-"
        rec = ev.get("recovery_steps")
        recovery = (f"{rec:,} steps" if rec is not None else
                    "not recovered" if ev.get("recovered") is False else "-")
        if ev.get("nan"):
            recovery = f"NaN @ {ev['first_nonfinite_step']:,}"
        rows.append([str(k), f"{s.start:,}", f"{s.end:,}", str(s.tier), s.action,
                     _f(s.rollback_step, "{:,}"), first, _f(ev.get("grad_ratio"), "{:.1f}x"),
                     _f(ev.get("log_z_rise"), "{:+.2f}"), recovery, s.cause])
    return rows


def _steps(xs: list[int], n: int = 6) -> str:
    if not xs:
        return "none"
    shown = ", ".join(f"{x:,}" for x in xs[:n])
    return f"{len(xs)}: {shown}{' ...' if len(xs) > n else ''}"


def _rollbacks(rbs: list[dict[str, Any]], n: int = 3) -> str:
    if not rbs:
        return "none"
    parts = [f"{r['step']:,}" + (f" -> {r['to']:,}" if r.get("to") is not None else "")
             for r in rbs[:n]]
    return f"{len(rbs)}: {', '.join(parts)}{' ...' if len(rbs) > n else ''}"


def whatif_rows(diag: Diagnosis) -> tuple[list[str], list[list[str]]]:
    """(header, rows): skips, rollbacks, halts and alerts per configuration, side by side."""
    cols = [("replayed", diag.whatif)]
    if diag.compare is not None:
        changes = ", ".join(f"{k}={v}" for k, v in diag.compare["changes"].items())
        cols.append((f"compare: {changes}", diag.compare))
    if diag.recorded is not None:
        cols.append(("recorded by the run", diag.recorded))
    header = ["", *[name for name, _ in cols]]
    rows = [["skipped", *[_steps(w["skip"]) for _, w in cols]],
            ["dropped rows, update applied", *[_steps([d["step"] for d in w.get("drop", [])])
                                               for _, w in cols]],
            ["rolled back (step -> checkpoint)", *[_rollbacks(w["rollback"]) for _, w in cols]],
            ["halted", *[_steps(w["halt"]) for _, w in cols]],
            ["alerts", *[str(w["alerts"]) for _, w in cols]],
            ["updates the fp16 loss scaler skipped",
             *["-" if w.get("scaler_skips") is None else f"{w['scaler_skips']:,}"
               for _, w in cols]]]
    return header, rows


def _timing_line(diag: Diagnosis) -> str:
    return "time: " + ", ".join(f"{k} {v:.2f} s" for k, v in diag.timings.items())


def print_summary(diag: Diagnosis, console: Any = None, *, advice: int = 10) -> None:
    """The terminal summary: what was read, the spikes table, advice, what-if, timings."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console(highlight=False, width=max(140, Console().width))
    log = diag.log
    con.print(f"[bold]{log.path}[/] ({log.format}): {len(log):,} records, steps "
              f"{int(log.steps[0]):,}-{int(log.steps[-1]):,}, metrics {', '.join(log.columns)}")
    for w in log.warnings:
        con.print(f"warning: {w}", style="yellow", markup=False)
    for n in diag.notes:
        con.print(f"note: {n}", markup=False)
    table = Table(title=f"{len(diag.spikes)} spike(s)", show_lines=False)
    for c in SPIKE_COLUMNS:
        table.add_column(c, overflow="fold")
    styles = {0: "dim", 1: "yellow", 2: "dark_orange", 3: "bold red"}
    for s, row in zip(diag.spikes, spike_rows(diag)):
        table.add_row(*row, style=styles[s.tier])
    con.print(table)
    for k, s in enumerate(diag.spikes, 1):
        if k > advice:
            con.print(f"... advice for {len(diag.spikes) - advice} more in --json / --report")
            break
        if s.advice:
            con.print(f"spike {k} (Tier {s.tier}): " + "; ".join(s.advice))
        for q in s.quarantine[:5]:
            con.print(f"    quarantined: {_quarantine_text(q)}")
    if diag.below:
        con.print(f"{len(diag.below)} Tier 0 entr{'y' if len(diag.below) == 1 else 'ies'} (below "
                  "every threshold, no action): " + _below_text(diag.below), markup=False)
    header, rows = whatif_rows(diag)
    wt = Table(title="what the detector would do")
    for c in header:
        wt.add_column(c, overflow="fold")
    for r in rows:
        wt.add_row(*r)
    con.print(wt)
    if diag.quarantine_unmatched:
        con.print(f"{len(diag.quarantine_unmatched)} quarantined sequence(s) outside any spike")
    con.print(_timing_line(diag))


def _below_text(below: list[Spike], n: int = 8) -> str:
    cut = "below the detector's thresholds: "
    parts = []
    for s in below[:n]:
        span = f"{s.start:,}" + (f"-{s.end:,}" if s.end != s.start else "")
        parts.append(f"{span} ({s.cause.removeprefix(cut)})")
    return "; ".join(parts) + (f"; ... {len(below) - n} more in --json" if len(below) > n else "")


def _quarantine_text(q: dict[str, Any]) -> str:
    keys = ("step", "stream_index", "rank", "row", "loss", "log_z", "z")
    return ", ".join(f"{k} {q[k]:.3g}" if isinstance(q.get(k), float) else f"{k} {q[k]}"
                     for k in keys if k in q)


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#202124}
table{border-collapse:collapse;margin:1em 0;font-size:14px}
td,th{border:1px solid #dadce0;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f1f3f4}.t1{background:#fef7e0}.t2{background:#feefe3}.t3{background:#fce8e6}
.warn{color:#b06000}figure{margin:1.5em 0}img{max-width:100%}figcaption{color:#5f6368}"""


def _html_table(header: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = []
    for i, r in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>")
    return f"<table><tr>{h}</tr>{''.join(body)}</table>"


def _advice_items(spikes: list[Spike]) -> list[str]:
    out = []
    for k, s in enumerate(spikes, 1):
        text = f"Spike {k} (Tier {s.tier}, {s.cause}): " + ("; ".join(s.advice) or "no action")
        out.append(text)
        out += [f"  quarantined: {_quarantine_text(q)}" for q in s.quarantine]
    return out


def _html(diag: Diagnosis, plots: dict[str, tuple[str, bytes]]) -> str:
    log = diag.log
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>spikeguard diagnose: "
             f"{html.escape(Path(log.path).name)}</title><style>{_CSS}</style></head><body>",
             f"<h1>spikeguard diagnose</h1><p><code>{html.escape(log.path)}</code> "
             f"({html.escape(log.format)}): {len(log):,} records, steps {int(log.steps[0]):,}-"
             f"{int(log.steps[-1]):,}, one every {log.stride} step(s); checkpoints every "
             f"{diag.ckpt_every or 'unknown'} steps.</p>"]
    if log.warnings:
        parts.append("<ul>" + "".join(f"<li class='warn'>{html.escape(w)}</li>"
                                      for w in log.warnings) + "</ul>")
    if diag.notes:
        parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in diag.notes) + "</ul>")
    parts.append(f"<h2>{len(diag.spikes)} spike(s)</h2>")
    parts.append(_html_table(list(SPIKE_COLUMNS), spike_rows(diag),
                             [f"t{s.tier}" for s in diag.spikes]))
    parts.append("<ul>" + "".join(f"<li>{html.escape(a)}</li>" for a in
                                  _advice_items(diag.spikes)) + "</ul>")
    if diag.below:
        parts.append(f"<h2>{len(diag.below)} Tier 0 entries (no action)</h2>"
                     + _html_table(list(SPIKE_COLUMNS), spike_rows(diag, diag.below)))
    header, rows = whatif_rows(diag)
    parts.append("<h2>What the detector would do</h2>" + _html_table(header, rows))
    parts.append("<h2>Plots</h2>")
    for name, (caption, png) in plots.items():
        data = base64.b64encode(png).decode("ascii")
        parts.append(f"<figure id='{name}'><img alt='{html.escape(name)}' "
                     f"src='data:image/png;base64,{data}'><figcaption>{html.escape(caption)}"
                     "</figcaption></figure>")
    parts.append(f"<p>{html.escape(_timing_line(diag))}</p></body></html>")
    return "\n".join(parts)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    def cell(c: str) -> str:
        return c.replace("|", "\\|")

    lines = ["| " + " | ".join(cell(c) for c in header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _markdown(diag: Diagnosis, images: dict[str, tuple[str, str]]) -> str:
    log = diag.log
    out = ["# spikeguard diagnose", "",
           f"`{log.path}` ({log.format}): {len(log):,} records, steps {int(log.steps[0]):,}-"
           f"{int(log.steps[-1]):,}, one every {log.stride} step(s); checkpoints every "
           f"{diag.ckpt_every or 'unknown'} steps.", ""]
    out += [f"- warning: {w}" for w in log.warnings] + ([""] if log.warnings else [])
    out += [f"- note: {n}" for n in diag.notes] + ([""] if diag.notes else [])
    out += [f"## {len(diag.spikes)} spike(s)", "", _md_table(list(SPIKE_COLUMNS),
                                                             spike_rows(diag)), ""]
    out += [f"- {a}" for a in _advice_items(diag.spikes)] + [""]
    if diag.below:
        out += [f"## {len(diag.below)} Tier 0 entries (no action)", "",
                _md_table(list(SPIKE_COLUMNS), spike_rows(diag, diag.below)), ""]
    header, rows = whatif_rows(diag)
    out += ["## What the detector would do", "", _md_table(header, rows), "", "## Plots", ""]
    for name, (caption, rel) in images.items():
        out += [f"![{name}]({rel})", "", f"*{caption}*", ""]
    out.append(_timing_line(diag))
    return "\n".join(out) + "\n"


def write_report(diag: Diagnosis, path: str | os.PathLike[str]) -> Path:
    """Write ``path`` (.html / .htm: one file, plots embedded; .md: plots in ``<stem>_plots/``
    beside it). Adds the time taken to ``diag.timings["report"]``."""
    t0 = time.perf_counter()
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".html", ".htm", ".md"):
        raise ValueError(f"--report {p}: the name must end in .html or .md")
    try:
        import matplotlib  # noqa: F401  (the plot extra; _plots imports it only when drawing)

        from ._plots import figures
    except ImportError as exc:
        raise ImportError("the report's plots need matplotlib: pip install "
                          "'spikeguard[plot]'") from exc
    plots = figures(diag)
    p.parent.mkdir(parents=True, exist_ok=True)
    diag.timings["report"] = time.perf_counter() - t0  # shown in the file; updated below
    if suffix == ".md":
        folder = p.with_name(p.stem + "_plots")
        folder.mkdir(exist_ok=True)
        images = {}
        for name, (caption, png) in plots.items():
            (folder / f"{name}.png").write_bytes(png)
            images[name] = (caption, f"{folder.name}/{name}.png")
        p.write_text(_markdown(diag, images))
    else:
        p.write_text(_html(diag, plots))
    diag.timings["report"] = time.perf_counter() - t0
    return p
