"""Detection quality: does the guard ever harm a healthy run, and does it catch real faults?

Every run goes through ``spikeguard.train.train`` (the real loop, checkpoints every 50 steps),
each in its own temporary run directory, read back (metrics.jsonl, config.json, the result)
and deleted. Three arms, paired on the same seed (so the same weights and batches):

- ``alert``: the guard with the default policy (Tier 2 alerts);
- ``rollback``: the same with ``GuardConfig(tier2="rollback")``;
- ``unguarded``: the same defenses (clipping 1.0, z-loss, QK-norm) with every response off
  (``GuardConfig(respond=False)``: the guard measures and records, nothing else).

Cells (the matrix of issue "Do no harm", item 5):

- clean, tiny (batch 8): peak LR 1e-3, 3e-3, 6e-3, 1e-2 x lengths 20, 60, 160, 300, 1000 x 10
  seeds; clean, demo (batch 16, the TrainConfig default): LR 3e-3, 6e-3 x lengths 20, 60, 160,
  300 x 5 seeds (28 cells, 240 seeded runs per arm, 720 runs);
- faulted at 300 steps, LR 3e-3, the fault at step 150 (tiny 5 seeds, demo 3): ``outlier@150``,
  ``storm@150:5``, ``nan@150`` (NaN gradient), ``nan-data@150`` (NaN from the data),
  ``lr@150:50:20`` and the sticky ``lr@150:50:20!``, ``logit-drift@150:0.05``, ``grad@150:10``,
  ``overflow@150`` (fp16 overflow; that cell runs ``--precision fp16-mixed`` on all three arms
  and is compared with the fp32 clean run). "final/clean" divides by the clean unguarded run of
  the same model, LR, length and seed;
- gap references, unguarded only, on the faulted cells' seeds: ``gap@150:1`` and ``gap@150:5``,
  clean runs whose stream never yields the batches the outlier and the storm overwrite (cells
  ``gap/<model>/outlier|storm``). "final/kept data" divides a guarded outlier or storm run by
  it: a skip that withholds exactly the bad updates (and makes them up) equals it bit for bit.

Scoring and targets: ``spikeguard.testing.detection`` (pure, torch-free).

Sizing. The matrix is 952 runs and 270,600 steps: tiny clean 600 runs / 184,800 steps, demo
clean 120 / 16,200, tiny faults 135 / 40,500 and gaps 10 / 3,000, demo faults 81 / 24,300 and
gaps 6 / 1,800. On a quiet 2-core
machine, one torch thread per run: tiny (batch 8) ~30 ms a step plus ~1.5 s start-up (300 steps
~9 s), fp16-mixed ~5x that (CPU autocast in fp16 is slow); demo (batch 16, the default, kept:
batch 8 would halve demo's share) ~370 ms a step (300 steps ~110 s). That is ~7.8 worker-hours,
~3.9 h of wall time with ``--workers 2`` (tiny ~2.4 worker-hours, demo ~5.4). On the machine
shared with other jobs (load 8-12) tiny ran 4-8x slower: see BENCHMARKS.md for the measured
wall times; ``--estimate`` prints the estimate of a selection from the results file's own
timings (a fit of start-up + per-step seconds per model and precision).

Results: one JSON line per (cell, arm, seed), a summary (no records), appended and fsynced by
the parent process; a rerun skips what is done, a crashed run is written as an ``error`` line
and retried, and a torn last line (a crash mid-write) is cut before appending.

    PYTHONPATH=src:. nice -n 5 python benchmarks/detection.py --matrix all --workers 2 \\
        --results benchmarks/results/detection.jsonl
    PYTHONPATH=src:. python benchmarks/detection.py --table \\
        --results benchmarks/results/detection_before.jsonl
    PYTHONPATH=src:. python benchmarks/detection.py --matrix clean --models tiny --lrs 3e-3 \\
        --lengths 300 --seeds 0 1 2 --arms alert unguarded --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from spikeguard.testing.detection import ARMS, FAULT_KINDS, format_table, score, summarize_run

__all__ = ["ARMS", "FAULT_SPECS", "load_results", "main", "matrix", "run_jobs", "run_one"]

BATCH = {"tiny": 8, "demo": 16}
CLEAN = {"tiny": ((1e-3, 3e-3, 6e-3, 1e-2), (20, 60, 160, 300, 1000), 10),
         "demo": ((3e-3, 6e-3), (20, 60, 160, 300), 5)}
FAULT_LR, FAULT_STEPS, FAULT_AT = 3e-3, 300, 150
FAULT_SEEDS = {"tiny": 5, "demo": 3}
FAULT_SPECS: dict[str, tuple[str, int]] = {   # name -> (--inject spec, steps it lasts)
    "outlier": (f"outlier@{FAULT_AT}", 1),
    "storm": (f"storm@{FAULT_AT}:5", 5),
    "nan-grad": (f"nan@{FAULT_AT}", 1),
    "nan-data": (f"nan-data@{FAULT_AT}", 1),
    "lr": (f"lr@{FAULT_AT}:50:20", 20),
    "lr-sticky": (f"lr@{FAULT_AT}:50:20!", 20),
    "logit-drift": (f"logit-drift@{FAULT_AT}:0.05", FAULT_STEPS - FAULT_AT),
    "grad-x10": (f"grad@{FAULT_AT}:10", 1),
    "fp16-overflow": (f"overflow@{FAULT_AT}", 1),
}
assert tuple(FAULT_SPECS) == FAULT_KINDS
LOST = {"outlier": f"gap@{FAULT_AT}:1", "storm": f"gap@{FAULT_AT}:5"}
"""The batches these faults replace: each gets a clean unguarded run whose stream skips them."""
SMOKE = (("tiny", 1e-3, 20), ("tiny", 3e-3, 20))


def _clean_id(model: str, lr: float, steps: int) -> str:
    return f"clean/{model}/lr{lr:g}/T{steps}"


def _job(kind: str, model: str, lr: float, steps: int, seed: int, arm: str,
         fault: str | None = None) -> dict[str, Any]:
    job = {"cell": _clean_id(model, lr, steps) if fault is None else f"{kind}/{model}/{fault}",
           "kind": kind, "model": model, "lr": lr, "steps": steps, "seed": seed, "arm": arm,
           "batch_size": BATCH[model], "clean_ref": _clean_id(model, lr, steps),
           "precision": "fp16-mixed" if fault == "fp16-overflow" else "fp32"}
    if fault is not None:
        spec, length = FAULT_SPECS[fault]
        job.update(fault=fault, fault_spec=LOST[fault] if kind == "gap" else spec,
                   fault_step=FAULT_AT, fault_len=length)
    return job


def matrix(which: str, seeds: list[int] | None = None) -> list[dict[str, Any]]:
    """Every job of ``which`` (clean|faults|smoke|all), in the order they are worth running:
    tiny clean at 3e-3/6e-3 up to 300 steps, tiny faults (seed by seed; fp16, the slowest,
    last), the rest of tiny clean, then demo. ``seeds``: these seeds in every cell instead of
    the matrix's own (e.g. more seeds of one cell)."""
    jobs: list[tuple[tuple, dict[str, Any]]] = []
    chosen = sorted(set(seeds)) if seeds else None
    if which == "smoke":
        return [_job("clean", m, lr, t, seed, arm) for m, lr, t in SMOKE
                for seed in chosen or [0] for arm in ARMS]
    if which in ("clean", "all"):
        for model, (lrs, lengths, seeds) in CLEAN.items():
            for lr in lrs:
                for t in lengths:
                    first = model == "tiny" and lr in (3e-3, 6e-3) and t <= 300
                    group = (0 if first else 2) if model == "tiny" else 3
                    for seed in range(seeds) if chosen is None else chosen:
                        for arm in ARMS:
                            jobs.append(((group, t > 300, t, lr, seed), _job(
                                "clean", model, lr, t, seed, arm)))
    if which in ("faults", "all"):
        for model, seeds in FAULT_SEEDS.items():
            for kind, fault in [("fault", f) for f in FAULT_SPECS] + [("gap", f) for f in LOST]:
                for seed in range(seeds) if chosen is None else chosen:
                    arms = ARMS if kind == "fault" else ("unguarded",)
                    for arm in arms:
                        # seed-major: every fault gets its first seeds before any its fifth
                        jobs.append(((1 if model == "tiny" else 4, fault == "fp16-overflow",
                                      seed, FAULT_KINDS.index(fault), kind == "gap"),
                                     _job(kind, model, FAULT_LR, FAULT_STEPS, seed, arm,
                                          fault)))
    if which not in ("clean", "faults", "all"):
        raise ValueError(f"--matrix {which!r}: use clean, faults, smoke or all")
    return [j for _, j in sorted(jobs, key=lambda kj: kj[0])]


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """Train ``job`` in a temporary directory (deleted after) and return its summary line."""
    import torch

    from spikeguard.guard import GuardConfig
    from spikeguard.prevent.clipping import ClipConfig
    from spikeguard.train import TrainConfig, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="sg-detection-")
    clipping = ClipConfig(update_bound=job.get("update_bound", 0.0))
    guard = GuardConfig(respond=False, clipping=clipping) if job["arm"] == "unguarded" else \
        GuardConfig(tier2=job["arm"], clipping=clipping)
    cfg = TrainConfig(model=job["model"], steps=job["steps"], batch_size=job["batch_size"],
                      lr=job["lr"], seed=job["seed"], guard=guard, precision=job["precision"],
                      inject=(job["fault_spec"],) if job.get("fault_spec") else (), out=out,
                      progress=False, plot=False)
    start, load = time.perf_counter(), os.getloadavg()[0]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = train(cfg, echo=False)
        path = Path(out)
        with open(path / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f if line.strip()]
        config = json.loads((path / "config.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
        torch.set_num_threads(threads)
    line = dict(job)
    line.update(summarize_run(records, val_loss=result.val_loss,
                              fault_step=job.get("fault_step")))
    line.update(applied=result.applied, result_rollbacks=result.rollbacks,
                result_halted=result.halted is not None, train_s=round(result.seconds, 3),
                wall_s=round(time.perf_counter() - start, 3), load=round(load, 2),
                run_precision=config["precision"], torch=torch.__version__,
                warnings=sorted({str(w.message)[:160] for w in caught}))
    return line


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def _key(line: dict[str, Any]) -> tuple[str, str, int]:
    return line["cell"], line["arm"], int(line["seed"])


def load_results(path: Path) -> list[dict[str, Any]]:
    """The finished lines of a results file (a torn or unreadable line is left out)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(d, dict) and "error" not in d:
            out.append(d)
    return out


def _repair(path: Path) -> None:
    """Cut a torn last line (a crash mid-write), so the next append starts a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def _append(path: Path, line: dict[str, Any]) -> None:
    data = (json.dumps(line, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def run_jobs(jobs: list[dict[str, Any]], results: Path, *, workers: int = 1,
             log: Any = sys.stderr, run: Any = None) -> list[dict[str, Any]]:
    """Run the jobs not yet in ``results``, appending a line per finished run; returns every
    finished line. ``workers`` > 1: a pool of spawned processes (one torch thread each).
    ``run``: what runs a job (a module-level function; default ``run_one``, a crash becoming an
    ``error`` line)."""
    run = run or _safe_run
    results.parent.mkdir(parents=True, exist_ok=True)
    _repair(results)
    done = {_key(d) for d in load_results(results)}
    todo = [j for j in jobs if _key(j) not in done]
    total_steps = sum(j["steps"] for j in todo)
    print(f"detection: {len(jobs)} runs selected, {len(jobs) - len(todo)} already in {results}, "
          f"{len(todo)} to run ({total_steps:,} steps) on {workers} worker(s)", file=log)
    code = _code_version()
    start, steps_done = time.perf_counter(), 0

    def finished(i: int, job: dict[str, Any], line: dict[str, Any]) -> None:
        nonlocal steps_done
        line["code"] = code
        _append(results, line)
        steps_done += job["steps"]
        elapsed = time.perf_counter() - start
        eta = elapsed / steps_done * (total_steps - steps_done) if steps_done else 0.0
        if "error" in line:
            what = f"ERROR {line['error'][:200]}"
        elif "skip_steps" not in line:  # another benchmark's line (lead_time's series)
            what = f"{line['wall_s']:.1f} s"
        else:
            val = line["val_loss"]
            what = (f"val {val:.4f}" if val is not None else "val -") + (
                f", {len(line['skip_steps'])} skips, {line['rollbacks']} rollbacks"
                f"{', HALT @' + str(line['halt']['step']) if line['halted'] else ''}, "
                f"{line['wall_s']:.1f} s")
        print(f"[{i}/{len(todo)}] {job['cell']} {job['arm']} seed {job['seed']}: {what} | "
              f"{elapsed:.0f} s elapsed, ~{eta:.0f} s left", file=log, flush=True)

    if workers <= 1:
        for i, job in enumerate(todo, 1):
            finished(i, job, run(job))
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                                 initializer=_init_worker) as pool:
            futures = {pool.submit(run, job): job for job in todo}
            for i, fut in enumerate(as_completed(futures), 1):
                finished(i, futures[fut], fut.result())
    return load_results(results)


def _safe_run(job: dict[str, Any]) -> dict[str, Any]:
    """run_one; a crashed run becomes an ``error`` line (retried on the next rerun)."""
    try:
        return run_one(job)
    except Exception as exc:
        return {**job, "error": f"{type(exc).__name__}: {exc}"}


def _code_version() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _select(jobs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    def keep(j: dict[str, Any]) -> bool:
        return ((not args.models or j["model"] in args.models)
                and (not args.lrs or any(abs(j["lr"] - lr) < 1e-12 for lr in args.lrs))
                and (not args.lengths or j["steps"] in args.lengths)
                and (args.seeds is None or j["seed"] in args.seeds)
                and (not args.faults or j.get("fault", "clean") in args.faults)
                and (not args.arms or j["arm"] in args.arms))
    return [j for j in jobs if keep(j)]


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares wall = a + b * steps (a: start-up, data, evaluation; b: per step)."""
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(w for _, w in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    if var == 0:
        return 0.0, my / mx
    b = sum((t - mx) * (w - my) for t, w in points) / var
    return max(0.0, my - b * mx), b


def estimate(jobs: list[dict[str, Any]], lines: list[dict[str, Any]], workers: int) -> str:
    """Wall time of ``jobs`` from the timings in the results file: per (model, precision) a
    fit of wall = start-up + steps x per-step (the quiet-machine sizing where none is there)."""
    points: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for d in lines:
        if d.get("wall_s") is not None:  # a reused line (below) has no timing of its own
            points.setdefault((d["model"], d["precision"]), []).append((d["steps"], d["wall_s"]))
    quiet = {"tiny": (1.5, 0.03), "demo": (3.0, 0.37)}
    total = 0.0
    for j in jobs:
        pts = points.get((j["model"], j["precision"]))
        a, b = _fit(pts) if pts else (quiet[j["model"]][0], quiet[j["model"]][1] * (
            5 if j["precision"] == "fp16-mixed" else 1))
        total += a + b * j["steps"]
    return (f"{len(jobs)} runs, {sum(j['steps'] for j in jobs):,} steps: ~{total / 3600:.2f} "
            f"worker-hours, ~{total / 3600 / max(1, workers):.2f} h of wall time on {workers} "
            f"worker(s)")


def compare(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    """Per (cell, arm) measured in both: halts, harmed, false skips/1k, caught, targets, before
    -> after (a Markdown table)."""
    old = {(c.cell, c.arm): c for c in score(before)}
    met = {True: "met", False: "NOT met", None: "?"}
    lines = ["| cell | arm | halts | harmed | false skips/1k | caught | targets |",
             "|---|---|---|---|---|---|---|"]
    for c in score(after):
        b = old.get((c.cell, c.arm))
        if b is None or c.arm == "unguarded":
            continue
        clean = c.kind == "clean"
        lines.append(f"| {c.cell} | {c.arm} | {b.halts}/{b.runs} -> {c.halts}/{c.runs} | "
                     + (f"{b.harmed} -> {c.harmed} | {b.false_skips_per_1k:.1f} -> "
                        f"{c.false_skips_per_1k:.1f} | - |" if clean else
                        f"- | - | {b.caught}/{b.runs} -> {c.caught}/{c.runs} |")
                     + f" {met[b.met]} -> {met[c.met]} |")
    return "\n".join(lines)


def with_bound(job: dict[str, Any], k: float) -> dict[str, Any]:
    """``job`` under the update bound k: its own cell (the model part tagged), the same clean
    reference (the clean run without the bound: what the bound should get back to)."""
    kind, model, rest = job["cell"].split("/", 2)
    return dict(job, update_bound=k, cell=f"{kind}/{model}+bound{k:g}/{rest}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--matrix", default="smoke", choices=("clean", "faults", "smoke", "all"))
    p.add_argument("--models", nargs="*", choices=tuple(BATCH))
    p.add_argument("--lrs", nargs="*", type=float)
    p.add_argument("--lengths", nargs="*", type=int)
    p.add_argument("--seeds", nargs="*", type=int,
                   help="seed numbers, in every selected cell (default: the matrix's)")
    p.add_argument("--faults", nargs="*", choices=("clean", *FAULT_KINDS))
    p.add_argument("--arms", nargs="*", choices=ARMS)
    p.add_argument("--results", type=Path, default=Path("benchmarks/results/detection.jsonl"))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--table", action="store_true", help="print the table of the results file")
    p.add_argument("--failed", action="store_true", help="the table shows failed cells only")
    p.add_argument("--estimate", action="store_true", help="print the selection's wall time")
    p.add_argument("--compare", type=Path, metavar="BEFORE",
                   help="with --table: each cell of --results beside the same cell in BEFORE")
    p.add_argument("--update-bound", type=float, default=0.0, metavar="K",
                   help="run every arm with ClipConfig.update_bound=K; the cells are named "
                        "<kind>/<model>+boundK/..., still judged against the plain clean runs")
    args = p.parse_args(argv)
    jobs = _select(matrix(args.matrix, args.seeds), args)
    if args.update_bound:
        jobs = [with_bound(j, args.update_bound) for j in jobs]
    if args.estimate:
        print(estimate(jobs, load_results(args.results), args.workers))
        return 0
    lines = load_results(args.results) if args.table else run_jobs(jobs, args.results,
                                                                   workers=args.workers)
    if args.compare is not None:
        print(compare(load_results(args.compare), lines))
        return 0
    print(format_table(score(lines), only_failed=args.failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
