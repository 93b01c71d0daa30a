"""Adaptive clipping against the fixed threshold c = 1.0: held-out loss on clean and LR-fault
runs, every guard response off (the clipping alone).

Runs go through the detection benchmark's jobs and results file (``benchmarks/detection.py``:
``_job``, ``FAULT_SPECS``, resumable appends) on its ``unguarded`` arm, once per
``--clip-mode`` (fixed, zscore, adagc, spam; the fixed ceiling c = 1.0 stays on in every mode),
and once as ``bound``: the fixed mode with the update bound (``ClipConfig.update_bound`` = 3,
``guard/update_bound.py``), which bounds the applied update rather than the gradient.
Cells: tiny, 300 steps, clean at LR 3e-3 and 6e-3, and the LR fault (``lr@150:50:20``, x50 for
20 steps) at 3e-3. The table gives, per cell and mode, the held-out loss over the fixed mode's
on the same seed (median, mean and worst over seeds; met judged on the worst seed and on the
mean); the targets: no clean cell worse than 1.005x,
the LR fault at most 1.0x (at least as good as c = 1.0).

    PYTHONPATH=src:. nice -n 5 python benchmarks/clipping.py --seeds 0 1 2
    PYTHONPATH=src:. python benchmarks/clipping.py --table
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

from benchmarks.detection import (
    CLEAN,
    FAULT_SPECS,
    _append,
    _code_version,
    _job,
    _key,
    _repair,
    load_results,
)

__all__ = ["MODES", "jobs", "main", "run_mode", "table"]

MODES = ("fixed", "zscore", "adagc", "spam", "bound")
BOUND = 3.0
"""The update bound of the ``bound`` mode (``ClipConfig.update_bound``)."""
STEPS = 300
CELLS = (("clean", 3e-3), ("clean", 6e-3), ("lr", 3e-3))


def clip_config(mode: str) -> Any:
    """The ClipConfig of a benchmark mode."""
    from spikeguard.prevent.clipping import ClipConfig

    if mode == "bound":
        return ClipConfig(clip_mode="fixed", update_bound=BOUND)
    return ClipConfig(clip_mode=mode)


def jobs(seeds: list[int], modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    out = []
    for seed in seeds:
        for fault, lr in CELLS:
            for mode in modes:
                j = _job("clean" if fault == "clean" else "fault", "tiny", lr, STEPS, seed,
                         "unguarded")
                j.update(cell=f"clip/{fault}/lr{lr:g}/{mode}", mode=mode, fault=fault)
                if fault != "clean":
                    j.update(fault_spec=FAULT_SPECS[fault][0], fault_step=150)
                out.append(j)
    return out


def clean_matrix(seeds: list[int] | None = None) -> list[dict[str, Any]]:
    """The ``bound`` mode on every clean tiny cell of the detection matrix (4 LRs x 5 lengths x
    10 seeds). A run whose update is never bounded is the fixed run bit for bit (the bound
    then moves no weight: tests/test_update_bound.py), so these need no fixed twin: the count
    of bounded updates is the result."""
    lrs, lengths, n = CLEAN["tiny"]
    out = []
    for seed in seeds if seeds else range(n):
        for lr in lrs:
            for t in lengths:
                j = _job("clean", "tiny", lr, t, seed, "unguarded")
                j.update(cell=f"clip/clean-matrix/lr{lr:g}/T{t}/bound", mode="bound",
                         fault="clean-matrix")
                out.append(j)
    return out


def survey_table(lines: list[dict[str, Any]]) -> str:
    """Per clean cell: runs, runs with a bounded update, bounded updates in all."""
    rows = ["| cell | runs | runs with a bounded update | bounded updates | steps |",
            "|---|---|---|---|---|"]
    got = [d for d in lines if d.get("fault") == "clean-matrix"]
    for lr, steps in sorted({(d["lr"], d["steps"]) for d in got}):
        ds = [d for d in got if (d["lr"], d["steps"]) == (lr, steps)]
        rows.append(f"| {ds[0]['cell'].removesuffix('/bound')} | {len(ds)} | "
                    f"{sum(d['bounded_steps'] > 0 for d in ds)} | "
                    f"{sum(d['bounded_steps'] for d in ds)} | {sum(d['steps'] for d in ds)} |")
    return "\n".join(rows)


def run_mode(job: dict[str, Any]) -> dict[str, Any]:
    """Train ``job`` under its clip mode; the line has the held-out and final train loss."""
    import torch

    from spikeguard.guard import GuardConfig
    from spikeguard.train import TrainConfig, train

    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="sg-clip-")
    guard = GuardConfig(respond=False, clip=1.0, clipping=clip_config(job["mode"]))
    cfg = TrainConfig(model="tiny", steps=job["steps"], batch_size=job["batch_size"],
                      lr=job["lr"], seed=job["seed"], guard=guard,
                      inject=(job["fault_spec"],) if job.get("fault_spec") else (), out=out,
                      progress=False, plot=False)
    start = time.perf_counter()
    try:
        result = train(cfg, echo=False)
        with open(Path(out) / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f if line.strip()]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    coefs = [float(r["clip_coef"]) for r in records if r.get("clip_coef") is not None]
    line = dict(job)
    line.update(val_loss=result.val_loss, final_loss=result.losses[-1] if result.losses else None,
                max_loss=max(result.losses) if result.losses else None,
                clipped_steps=sum(c < 1.0 for c in coefs),
                bounded_steps=sum(float(r.get("update_coef", 1.0)) < 1.0 for r in records),
                wall_s=round(time.perf_counter() - start, 2), load=round(os.getloadavg()[0], 2))
    return line


def table(lines: list[dict[str, Any]]) -> str:
    base = {(d["fault"], d["lr"], d["seed"]): d["val_loss"] for d in lines if d["mode"] == "fixed"}
    rows = ["| cell | mode | held-out / fixed (median; mean; worst) | per seed | clipped steps "
            "(mean) | bounded updates (mean) | target | met (worst seed) | met (mean) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for fault, lr in CELLS:
        for mode in MODES:
            got = [d for d in lines if d["fault"] == fault and d["lr"] == lr and d["mode"] == mode]
            ratios = [d["val_loss"] / base[(fault, lr, d["seed"])] for d in got
                      if (fault, lr, d["seed"]) in base and math.isfinite(d["val_loss"])]
            if not ratios:
                continue
            limit = 1.005 if fault == "clean" else 1.0
            worst = max(ratios)
            clipped = statistics.mean(d["clipped_steps"] for d in got)
            bounded = statistics.mean(d.get("bounded_steps", 0) for d in got)
            mean = statistics.mean(ratios)
            met = "-" if mode == "fixed" else ("met" if worst <= limit else "NOT met")
            met_mean = "-" if mode == "fixed" else ("met" if mean <= limit else "NOT met")
            rows.append(f"| {fault} lr {lr:g} | {mode} | {statistics.median(ratios):.4f}; "
                        f"{mean:.4f}; {worst:.4f} | {', '.join(f'{r:.4f}' for r in ratios)} | "
                        f"{clipped:.0f} | {bounded:.0f} | <= {limit:g} | {met} | {met_mean} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", nargs="*", type=int,
                   help="default: 0 1 2 (with --clean-matrix: all 10)")
    p.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES),
                   help="the modes to run (fixed is every ratio's baseline)")
    p.add_argument("--results", type=Path, default=Path("benchmarks/results/clipping.jsonl"))
    p.add_argument("--table", action="store_true", help="only print the results file's table")
    p.add_argument("--clean-matrix", action="store_true",
                   help="the bound mode over every clean tiny cell of the detection matrix "
                        "(bounded updates per cell; default seeds: all 10)")
    args = p.parse_args(argv)
    if not args.table:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        _repair(args.results)
        done = {_key(d) for d in load_results(args.results)}
        selected = (clean_matrix(args.seeds) if args.clean_matrix
                    else jobs(args.seeds or [0, 1, 2], tuple(args.modes)))
        todo = [j for j in selected if _key(j) not in done]
        code = _code_version()
        for i, job in enumerate(todo, 1):
            line = run_mode(job)
            line["code"] = code
            _append(args.results, line)
            print(f"[{i}/{len(todo)}] {job['cell']} seed {job['seed']}: val "
                  f"{line['val_loss']:.4f}, {line['wall_s']} s", file=sys.stderr, flush=True)
    lines = load_results(args.results)
    print(survey_table(lines) if args.clean_matrix else table(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
