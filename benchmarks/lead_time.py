"""Lead time: which early-warning signal crosses its threshold first, how many steps before the
loss peak, and how often it crosses on clean runs (false alarms per 1,000 steps).

Runs go through the detection benchmark's jobs and bookkeeping (``benchmarks/detection.py``:
``_job``, the fault specs, the resumable results file), on its ``unguarded`` arm (the same
defenses, every response off, so the fault runs its course) with every signal and the
attention-logit p99 recorded at every step. Each results line keeps the run's series (loss,
grad norm, log Z, the signals) rather than a summary, so thresholds can be re-scored without
re-running.

Faults (tiny model, LR 3e-3, 300 steps, at step 150): the detection matrix's ``lr`` (x50 for 20
steps) and ``logit-drift`` (0.05 a step), plus ``slow-drift`` (``logit-drift@150:0.01``) and
``lr-ramp`` (``lr-ramp@150:50:100``: the LR rising to 50x over 100 steps). Clean: the same model
at LR 1e-3, 3e-3 and 6e-3, 300 steps.

A signal *crosses* at step t when its value exceeds ``RULES``'s threshold against the median of
its previous ``WINDOW`` (32) readings (armed after 32 readings; a ratio, or for log Z a
difference). A faulted run has a loss peak when the largest loss in the 100 steps from the
fault is at least ``PEAK`` (1.2) times the median of the 16 losses before it; the lead is peak
minus the first crossing at or after the fault (``-`` when it crosses only after the peak, or
never). Beside it, the delay: the first crossing minus the fault's step, for every faulted run
(peak or not). ``--defenses none`` runs the faults without z-loss, QK-norm and clipping (the
same baseline as ``spikeguard train --defenses none``), where the slow faults do diverge.

    PYTHONPATH=src:. nice -n 5 python benchmarks/lead_time.py --seeds 0 1 2 3 4
    PYTHONPATH=src:. nice -n 5 python benchmarks/lead_time.py --defenses none --seeds 0 1 2
    PYTHONPATH=src:. python benchmarks/lead_time.py --table     # re-score the results file
    PYTHONPATH=src:. nice -n 5 python benchmarks/lead_time.py --model demo --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.detection import FAULT_SPECS, _job, load_results, run_jobs

__all__ = ["FAULTS", "RULES", "crossings", "jobs", "main", "run_series", "score"]

FAULT_AT, STEPS, LR = 150, 300, 3e-3
FAULTS = {"lr": FAULT_SPECS["lr"][0], "logit-drift": FAULT_SPECS["logit-drift"][0],
          "slow-drift": f"logit-drift@{FAULT_AT}:0.01", "lr-ramp": f"lr-ramp@{FAULT_AT}:50:100"}
CLEAN_LRS = (1e-3, 3e-3, 6e-3)
SERIES = ("loss", "grad_norm", "log_z", "update_ratio", "spike_share", "attn_logit_bound",
          "attn_logit_p99")
RULES: dict[str, tuple[str, float, float]] = {
    # signal -> (kind, threshold, floor): ratio: v > thr x median and v > floor; delta: v - median > thr
    "grad_norm": ("ratio", 3.0, 0.0),          # the detector's grad_k
    "log_z": ("delta", 1.0, 0.0),
    "update_ratio": ("ratio", 2.0, 0.0),       # Marin's "about 2x"
    "spike_share": ("ratio", 10.0, 1e-3),      # one element in 1,000 past 5,000 x v
    "attn_logit_bound": ("ratio", 1.5, 0.0),
    "attn_logit_p99": ("ratio", 1.5, 0.0),
}
WINDOW = 32
PEAK = 1.2
DEPART, DEPART_MEAN = 1.02, 5


def jobs(seeds: list[int], defenses: str = "all", model: str = "tiny") -> list[dict[str, Any]]:
    """The lead-time runs: every fault, then the clean cells, on the unguarded arm (with
    ``defenses="none"``: the faults only, with no defenses). Cells of a model other than tiny
    carry its name (``lead/demo/lr``)."""
    out, prefix = [], "lead" if model == "tiny" else f"lead/{model}"
    for seed in seeds:
        for name, spec in FAULTS.items():
            j = _job("fault", model, LR, STEPS, seed, "unguarded")
            j.update(cell=f"{prefix}/{name}", fault=name, fault_spec=spec, fault_step=FAULT_AT,
                     defenses=defenses)
            out.append(j)
        for lr in CLEAN_LRS if defenses == "all" else ():
            j = _job("clean", model, lr, STEPS, seed, "unguarded")
            j["cell"] = f"{prefix}/clean/lr{lr:g}"
            out.append(j)
    return out


def run_series(job: dict[str, Any]) -> dict[str, Any]:
    """Train ``job`` with every signal at every step; its line carries the per-step series."""
    import torch

    from spikeguard.guard import GuardConfig
    from spikeguard.measure.probes import ProbeConfig
    from spikeguard.measure.signals import SignalConfig
    from spikeguard.train import TrainConfig, train

    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="sg-lead-")
    probes = ProbeConfig() if job.get("light") else ProbeConfig(
        attn_logit_p99=True, attn_every=1, signals=SignalConfig(
            update_ratio_every=1, spike_share_every=1, logit_bound_every=1))
    cfg = TrainConfig(model=job["model"], steps=job["steps"], batch_size=job["batch_size"],
                      lr=job["lr"], seed=job["seed"], guard=GuardConfig(respond=False,
                                                                         probes=probes),
                      inject=(job["fault_spec"],) if job.get("fault_spec") else (), out=out,
                      progress=False, plot=False, defenses=job.get("defenses", "all"))
    start = time.perf_counter()
    try:
        result = train(cfg, echo=False)
        with open(Path(out) / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f if line.strip()]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    line = dict(job)
    line["series"] = {k: [_num(r.get(k)) for r in records] for k in SERIES}
    line["flagged"] = [r["step"] for r in records if r.get("verdict") not in (None, "continue")]
    line.update(val_loss=result.val_loss, wall_s=round(time.perf_counter() - start, 2),
                load=round(os.getloadavg()[0], 2))
    return line


def clean_matrix_jobs() -> list[dict[str, Any]]:
    """The detection benchmark's whole clean matrix (its ``unguarded`` arm), each run recording
    its series with the guard's default probes (``light``): the false alarms of each rule over
    every clean cell, not only the lead-time runs' three LRs at 300 steps."""
    from benchmarks.detection import matrix

    out = []
    for j in matrix("clean"):
        if j["arm"] == "unguarded":
            out.append({**j, "cell": "scan/" + j["cell"], "light": True})
    return out


def clean_alarms(lines: list[dict[str, Any]]) -> str:
    """Per clean cell of a ``--clean-matrix`` results file: steps and each rule's crossings."""
    cells: dict[str, dict[str, int]] = {}
    for d in lines:
        if d["kind"] != "clean":
            continue
        row = cells.setdefault(d["cell"], {"runs": 0, "steps": 0, **{k: 0 for k in RULES}})
        row["runs"] += 1
        row["steps"] += len(d["series"]["loss"])
        for sig, rule in RULES.items():
            values = d["series"].get(sig) or []
            if any(v is not None for v in values):
                row[sig] += len(crossings(values, rule))
    head = "| cell | runs | steps | " + " | ".join(RULES) + " |"
    out = [head, "|" + "---|" * (3 + len(RULES))]
    total = {"runs": 0, "steps": 0, **{k: 0 for k in RULES}}
    for cell in sorted(cells, key=lambda c: (c.split("/")[2], c)):
        row = cells[cell]
        for k in total:
            total[k] += row[k]
        out.append(f"| {cell.removeprefix('scan/')} | {row['runs']} | {row['steps']:,} | "
                   + " | ".join(str(row[k]) for k in RULES) + " |")
    out.append(f"| all | {total['runs']} | {total['steps']:,} | "
               + " | ".join(f"{total[k]} ({1000 * total[k] / max(total['steps'], 1):.2f}/1k)"
                            for k in RULES) + " |")
    return "\n".join(out)


def _num(v: Any) -> float | None:
    """A record's number (the sinks write non-finite ones as strings), to 5 significant digits."""
    if v is None:
        return None
    return float(f"{float(v):.5g}")


def crossings(values: list[float | None], rule: tuple[str, float, float]) -> list[int]:
    """Steps where ``values`` crosses ``rule`` against the median of its last WINDOW readings."""
    kind, thr, floor = rule
    seen: list[float] = []
    out = []
    for t, v in enumerate(values):
        if v is None or v != v:
            continue
        if len(seen) >= WINDOW:
            med = statistics.median(seen[-WINDOW:])
            hit = (v - med > thr) if kind == "delta" else (v > thr * med and v > floor)
            if hit:
                out.append(t)
        seen.append(v)
    return out


def departure(loss: list[float], clean: list[float], at: int, horizon: int = 100) -> int | None:
    """The first step from ``at`` (within ``horizon``) where the faulted run's loss, as a mean of
    its last DEPART_MEAN steps, is at least DEPART (1.02) times the clean run's on the same seed
    and batches: where the fault's damage shows in the loss. None when it never does."""
    for t in range(at, min(len(loss), len(clean), at + horizon)):
        lo = max(0, t - DEPART_MEAN + 1)
        f, c = loss[lo:t + 1], clean[lo:t + 1]
        if sum(f) >= DEPART * sum(c):
            return t
    return None


def _finite(values: list[float | None]) -> list[float]:
    return [(v if v is not None and v == v else math.inf) for v in values]


def score(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per signal: lead per fault before the loss peak and before the loss departs from the
    paired clean run (median over seeds and the list), the delay after the fault, and clean
    false alarms. A faulted run's pair is the clean run of its model and seed at its LR."""
    table: dict[str, Any] = {}
    signals = [*RULES, "guard"]
    clean = {(d["model"], d["seed"], d["lr"]): _finite(d["series"]["loss"]) for d in lines
             if d["kind"] == "clean" and d.get("defenses", "all") == "all"}
    for sig in signals:
        row: dict[str, Any] = {"leads": {}, "departs": {}, "delays": {}, "false_alarms": 0,
                               "clean_steps": 0}
        for d in lines:
            s = d["series"]
            if sig == "guard":
                cross = d["flagged"]
            elif all(v is None for v in s.get(sig, [None])):
                continue
            else:
                cross = crossings(s[sig], RULES[sig])
            if d["kind"] == "clean":
                row["false_alarms"] += len(cross)
                row["clean_steps"] += len(s["loss"])
                continue
            loss = _finite(s["loss"])
            at = d["fault_step"]
            end = min(len(loss), at + 100)
            peak = max(range(at, end), key=loss.__getitem__)
            before = statistics.median(loss[at - 16:at])
            first = next((c for c in cross if c >= at), None)
            row["delays"].setdefault(d["fault"], []).append(None if first is None else first - at)
            pair = clean.get((d["model"], d["seed"], d["lr"]))
            if pair is not None and d.get("defenses", "all") == "all":
                dep = departure(loss, pair, at)
                lead = (None if first is None or dep is None or first > dep else dep - first)
                row["departs"].setdefault(d["fault"], []).append(
                    "no departure" if dep is None else lead)
            if loss[peak] < PEAK * before:  # no loss event to lead
                row["leads"].setdefault(d["fault"], []).append("no peak")
                continue
            first = next((c for c in cross if at <= c <= peak), None)
            row["leads"].setdefault(d["fault"], []).append(None if first is None else peak - first)
        table[sig] = row
    return table


def _cell(values: list[Any]) -> str:
    """'median (per seed)': '-' for no crossing, 'np' for a run without a loss peak, 'nd' for
    one whose loss never departs from its clean pair."""
    got = [x for x in values if isinstance(x, int)]
    med = statistics.median(got) if got and len(got) > len(values) / 2 else None
    per = ",".join({"no peak": "np", "no departure": "nd", None: "-"}.get(x, str(x))
                   for x in values)
    return f"{'-' if med is None else f'{med:g}'} ({per})"


def format_table(table: dict[str, Any], lead: str = "leads") -> str:
    """Per signal and fault: lead before the loss peak (``lead="departs"``: before the loss
    departs from its clean pair) and delay after the fault (median over seeds, then each seed),
    and the clean runs' false alarms."""
    faults = list(FAULTS)
    name = "lead" if lead == "leads" else "lead to departure"
    head = ("| signal | rule | " + " | ".join(f"{f}: {name}; delay" for f in faults)
            + " | clean false alarms / 1k steps |")
    lines = [head, "|" + "---|" * (3 + len(faults))]
    for sig, row in table.items():
        rule = RULES.get(sig)
        rtext = ("tier >= 1 verdict" if rule is None else
                 (f"> median + {rule[1]:g}" if rule[0] == "delta" else f"> {rule[1]:g}x median"
                  + (f", > {rule[2]:g}" if rule[2] else "")))
        cells = [f"{_cell(row[lead].get(f, []))}; {_cell(row['delays'].get(f, []))}"
                 for f in faults]
        fa = (f"{1000 * row['false_alarms'] / row['clean_steps']:.1f}" if row["clean_steps"]
              else "-")
        lines.append(f"| {sig} | {rtext} | " + " | ".join(cells) + f" | {fa} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    p.add_argument("--defenses", choices=("all", "none"), default="all",
                   help="none: the faults without z-loss, QK-norm and clipping")
    p.add_argument("--results", type=Path, default=None,
                   help="default benchmarks/results/lead_time.jsonl (lead_time_none.jsonl "
                        "with --defenses none)")
    p.add_argument("--model", choices=("tiny", "demo"), default="tiny",
                   help="demo: the results file gets a _demo suffix")
    p.add_argument("--table", action="store_true", help="only score the results file")
    p.add_argument("--clean-matrix", action="store_true",
                   help="run (or score) the detection benchmark's whole clean matrix with the "
                        "default probes: each rule's false alarms per cell")
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args(argv)
    if args.clean_matrix:
        return _clean_matrix(args)
    if args.results is None:
        suffix = ("" if args.defenses == "all" else "_none") + (
            "" if args.model == "tiny" else f"_{args.model}")
        args.results = Path(f"benchmarks/results/lead_time{suffix}.jsonl")
    if not args.table:
        run_jobs(jobs(args.seeds, args.defenses, args.model), args.results,
                 workers=args.workers, run=run_series)
    lines = [d for d in load_results(args.results) if "series" in d]
    table = score(lines)
    print(format_table(table))
    if any(row["departs"] for row in table.values()):
        print(f"\nLead before the loss departs from the clean run of the same seed (its "
              f"{DEPART_MEAN}-step mean >= {DEPART:g}x the clean one's):\n")
        print(format_table(table, "departs"))
    return 0


def _clean_matrix(args: argparse.Namespace) -> int:
    results = args.results or Path("benchmarks/results/lead_time_clean_matrix.jsonl")
    if not args.table:
        run_jobs(clean_matrix_jobs(), results, workers=args.workers, run=run_series)
    print(clean_alarms([d for d in load_results(results) if "series" in d]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
