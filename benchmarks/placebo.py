"""Placebo skips: is a guarded run that ended worse than its unguarded twin worse than any run
with the same number of batches left out?

The zoo's natural instabilities (the tiny GPT at LR 1.0 without QK-norm or without z-loss) are
chaotic: one batch more or less moves where the run ends by several per cent either way. A
guarded run whose only difference from the unguarded run is a skipped batch or two can end worse
than it for that reason alone. This benchmark measures the band: for each guarded (alert arm)
run in the results files that skipped and ended away from its unguarded run, it trains the
unguarded run again with the same number of batches left out (one contiguous gap, the zoo's
``gap@S:k``) at a few other steps around the guard's first skip, and sets the guarded run's
final loss beside theirs (each a ratio to the unguarded run, same seed and batches otherwise).

A guarded run inside its placebo band cost what leaving out any batches at that time costs; one
worse than every placebo is the guard's doing.

    PYTHONPATH=src:. python benchmarks/placebo.py --results R1.jsonl [R2.jsonl ...] \\
        [--cells 'natural/*'] [--seeds 4 5 ...] [--offsets -10 -5 5 10 20] [--workers 2]
    PYTHONPATH=src:. python benchmarks/placebo.py --results ... --table

``--cells 'clean/*'`` weighs the clean cells' false skips the same way (``zoo_probe.py``'s
settings too). ``--results``: zoo results files holding the alert and unguarded arms (a later
file's run replaces an earlier one's, as ``zoo.py --table --over`` does). The placebo runs go to
``--out`` (resumable).
"""

from __future__ import annotations

import argparse
import fnmatch
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.detection import _key, load_results, run_jobs
from benchmarks.zoo import BASE, CLEAN, NATURAL, _job, _safe_run, setting
from benchmarks.zoo_probe import PROBES

OUT = Path(__file__).parent / "results" / "placebo.jsonl"
OFFSETS = (-10, -5, 5, 10, 20)
"""Where the placebo gaps start, in steps from the guard's first skip (a gap that would reach
before step 1 or past the run's end is left out)."""


def subjects(runs: list[dict[str, Any]], cells: list[str],
             seeds: list[int] | None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The (guarded alert run, unguarded run) pairs that skipped and ended away from each other,
    by cell and seed."""
    by = {_key(d): d for d in runs}
    out = []
    for (cell, arm, seed), g in sorted(by.items()):
        if arm != "alert" or not any(fnmatch.fnmatch(cell, c) for c in cells):
            continue
        if seeds is not None and seed not in seeds:
            continue
        u = by.get((cell, "unguarded", seed))
        if u is None or not g.get("skip_steps") or g.get("val_loss") is None:
            continue
        if g["val_loss"] != u["val_loss"]:
            out.append((g, u))
    return out


def placebo_jobs(g: dict[str, Any], offsets: tuple[int, ...]) -> list[dict[str, Any]]:
    """The unguarded run of ``g``'s cell and seed with ``len(skip_steps)`` batches left out at each
    offset from its first skip."""
    k, first, steps = len(g["skip_steps"]), g["skip_steps"][0], g["steps"]
    name = g["variant"]
    jobs = []
    for off in offsets:
        at = first + off
        if at < 1 or at + k > steps:
            continue
        base = _job(g["kind"], g["cell"], name, g["seed"], "unguarded", s=_setting(name))
        jobs.append({**base, "cell": f"placebo/{name}@{at}:{k}", "subject": g["cell"],
                     "fault_spec": f"gap@{at}:{k}", "placebo_at": at, "placebo_len": k})
    return jobs


def _setting(name: str) -> dict[str, Any]:
    """The zoo's setting ``name``, or a zoo_probe.py setting's."""
    if name in CLEAN or name in NATURAL:
        return setting(name)
    if name in PROBES:
        return {**BASE, **PROBES[name]}
    raise ValueError(f"no zoo or zoo_probe setting named {name!r}")


def table(pairs: list[tuple[dict[str, Any], dict[str, Any]]],
          placebos: list[dict[str, Any]]) -> str:
    """One row per guarded run: its ratio to the unguarded run, its placebos' ratios, and how
    many of them ended at or above the guarded run (the guard's rank in its band)."""
    rows = ["| cell | seed | skipped | guarded / unguarded | placebo gaps / unguarded | "
            "placebos at or above the guarded | verdict |", "|---|---|---|---|---|---|---|"]
    inside, guard_r, placebo_r = 0, [], []
    for g, u in pairs:
        ours = [p for p in placebos if p["subject"] == g["cell"] and p["seed"] == g["seed"]
                and p.get("val_loss") is not None]
        if not ours:
            continue
        ratio = g["val_loss"] / u["val_loss"]
        ps = sorted(p["val_loss"] / u["val_loss"] for p in ours)
        above = sum(r >= ratio for r in ps)
        within = ratio <= ps[-1]
        inside += within
        guard_r.append(ratio)
        placebo_r += ps
        rows.append(f"| {g['cell']} | {g['seed']} | {len(g['skip_steps'])} at "
                    f"{g['skip_steps'][0]} | {ratio:.4f}x | "
                    + " ".join(f"{r:.3f}" for r in ps)
                    + f" | {above} of {len(ps)} | "
                    + ("inside the band" if within else "worse than every placebo") + " |")
    if guard_r:
        rows.append("")
        rows.append(f"{inside} of {len(guard_r)} guarded runs at or under their worst placebo; "
                    f"mean ratio guarded {statistics.mean(guard_r):.4f}x, placebo "
                    f"{statistics.mean(placebo_r):.4f}x ({len(placebo_r)} placebo runs)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, nargs="+", required=True,
                   help="zoo results files with the alert and unguarded arms (later files win)")
    p.add_argument("--out", type=Path, default=OUT, help="the placebo runs' results file")
    p.add_argument("--cells", nargs="*", default=["natural/*"], help="cell names or patterns")
    p.add_argument("--seeds", nargs="*", type=int, help="only these seeds (default: all found)")
    p.add_argument("--offsets", nargs="*", type=int, default=list(OFFSETS))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--table", action="store_true", help="score what --out holds, run nothing")
    args = p.parse_args(argv)
    missing = [str(f) for f in args.results if not f.exists()]
    if missing:
        p.error(f"no such results file: {', '.join(missing)} (run benchmarks/zoo.py first)")
    runs = [d for f in args.results for d in load_results(f)]
    pairs = subjects(runs, args.cells, args.seeds)
    if not pairs:
        print("no guarded run in these files skipped and ended away from its unguarded run",
              file=sys.stderr)
        return 0
    if not args.table:
        jobs = [j for g, _ in pairs for j in placebo_jobs(g, tuple(args.offsets))]
        run_jobs(jobs, args.out, workers=args.workers, run=_safe_run)
    print(table(pairs, load_results(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
