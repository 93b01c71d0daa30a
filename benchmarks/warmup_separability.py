"""Can any rule tell the zoo's garbage batches inside the warmup from a clean run's own noise?

The zoo's outlier and storm at the ``warmup`` timing (step 10 of a 20-step warmup, before any
rule is armed: ``arm_after`` is 30 kept updates for a 300-step run) are batches of random token
ids with the real targets. This puts each such fault step beside the warmup steps of the
recorded clean runs of ``replay_clean.py`` (AdamW on the tiny and demo GPTs, LR 1e-3 to 1e-2;
SGD, Adam beta2 0.999, Adafactor; 214 runs). Two features, both from the run's own history
before the step: the grad norm over the median of the grad norms so far, and the loss's
step-to-step change in robust spreads (the median absolute step change so far). The fault
step's pair is the most lenient joint bar on them that still catches it; the clean warmup steps
at least as far out on both are what that bar would fire on, per 1,000 steps: the false skips
any rule on these two numbers must pay to catch it (the zoo's target is at most 1). The loss
over its median is printed beside them, not counted: inside the warmup it sorts steps by how
early they come (the loss falls fastest at the start), not by what their batch holds.

    PYTHONPATH=src:. python benchmarks/warmup_separability.py [--seeds 0 2 3]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks import zoo
from benchmarks.replay_clean import clean_runs
from benchmarks.zoo_run import run_one

__all__ = ["features", "main"]

CELLS = ("fault/base@warmup/outlier", "fault/base@warmup/storm")


def features(grad: list[float], loss: list[float], t: int) -> tuple[float, float, float]:
    """(grad norm at ``t`` over the median before it, the loss's step change at ``t`` over the
    median absolute step change before it, the loss over the median of the 32 before it)."""
    steps = [abs(loss[i] - loss[i - 1]) for i in range(1, t)]
    spread = statistics.median(steps) or 1e-12
    return (grad[t] / statistics.median(grad[:t]), (loss[t] - loss[t - 1]) / spread,
            loss[t] / statistics.median(loss[max(0, t - 32):t]))


def _clean() -> list[tuple[float, float, float]]:
    """The features of every clean run's warmup steps (from the fifth on: a median needs a
    few steps)."""
    return [features(run["s"]["grad_norm"], run["s"]["loss"], t) for run in clean_runs()
            for t in range(4, min(run["warm"], run["steps"]))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 2, 3])
    args = p.parse_args(argv)
    clean = _clean()
    print(f"clean sample: {len(clean)} warmup steps of {len(clean_runs())} recorded runs")
    print("| cell | seed | step | grad / median | loss step (spreads) | loss / median | clean "
          "steps as far out on both grad and step | per 1,000 |")
    print("|---|---|---|---|---|---|---|---|")
    for cell in CELLS:
        for seed in args.seeds:
            job = next(j for j in zoo.cells([seed]) if j["cell"] == cell
                       and j["arm"] == "unguarded")
            records: list = []
            run_one(job, records)
            t = job["fault_step"]
            g, d, level = features([r["grad_norm"] for r in records],
                                   [r["loss"] for r in records], t)
            pool = clean
            n = sum(1 for cg, cd, _ in pool if cg >= g and cd >= d)
            print(f"| {cell} | {seed} | {t} | {g:.1f}x | {d:+.1f} | {level:.2f} | "
                  f"{n}/{len(pool)} | {1000 * n / len(pool):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
