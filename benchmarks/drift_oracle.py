"""Can any response meet "not worse than unguarded" on a fault that does no harm? The zoo's logit
drift at arming, seed by seed, against the perfect response.

A rollback to a checkpoint before the onset ends the drift (``spikeguard.train.faults``), so the
best a response can do is the clean run of the same seed: the same batches, no drift. This
script reads a zoo results file that holds, for the same seeds, the clean cell's unguarded run
and the fault cell's unguarded, alert and rollback runs, and prints per seed the unguarded fault
run over clean (what the fault did), the rollback over clean and over unguarded, and the clean
run over the unguarded fault run: the **oracle**, the ratio a perfect response would score
against the target's 1.005x. Where the oracle is over 1.005x, the drift helped that run, and
every response that ends it is "worse than unguarded" there.

    PYTHONPATH=src:. python benchmarks/zoo.py --workers 1 --seeds $(seq 0 23) \\
        --cells 'fault/base@arming/logit-drift' clean/base --results R
    PYTHONPATH=src:. python benchmarks/drift_oracle.py --results R
"""

from __future__ import annotations

import argparse
import json
import statistics

from spikeguard.testing.detection import HARM_RATIO

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", required=True, help="a zoo results file (JSON lines)")
    ap.add_argument("--cell", default="fault/base@arming/logit-drift")
    ap.add_argument("--clean", default="clean/base")
    args = ap.parse_args(argv)
    runs = {}
    for line in open(args.results):
        r = json.loads(line)
        if r.get("val_loss") is not None:
            runs[(r["cell"], r["arm"], int(r["seed"]))] = r
    seeds = sorted(s for (c, a, s) in runs if c == args.cell and a == "rollback"
                   and (args.clean, "unguarded", s) in runs and (c, "unguarded", s) in runs)
    if not seeds:
        raise SystemExit(f"{args.results}: no seed with {args.cell} (unguarded, rollback) and "
                         f"{args.clean} (unguarded); run the zoo command in this docstring")
    print("| seed | rolled back at | unguarded/clean | rollback/clean | rollback/unguarded | "
          "oracle: clean/unguarded |")
    print("|---|---|---|---|---|---|")
    cols: dict[str, list[float]] = {"fault": [], "rb": [], "rbu": [], "oracle": []}
    for s in seeds:
        clean, ung = (runs[(args.clean, "unguarded", s)]["val_loss"],
                      runs[(args.cell, "unguarded", s)]["val_loss"])
        back = runs[(args.cell, "rollback", s)]
        rb, at = back["val_loss"], back["first_tier2"] if back["rollbacks"] else "-"
        row = {"fault": ung / clean, "rb": rb / clean, "rbu": rb / ung, "oracle": clean / ung}
        for k, v in row.items():
            cols[k].append(v)
        print(f"| {s} | {at} | {row['fault']:.4f} | {row['rb']:.4f} | {row['rbu']:.4f} | "
              f"{row['oracle']:.4f} |")
    n = len(seeds)
    print(f"\n{n} seeds. mean (sd): " + ", ".join(
        f"{k} {statistics.mean(v):.4f} ({statistics.stdev(v) if n > 1 else 0:.4f})"
        for k, v in cols.items()))
    print(f"over {HARM_RATIO}x unguarded: the rollback on {sum(v > HARM_RATIO for v in cols['rbu'])}"
          f" of {n} seeds, the oracle on {sum(v > HARM_RATIO for v in cols['oracle'])} of {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
