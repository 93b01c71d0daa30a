"""The grad rule's false alarms cell by cell, and what a bar sized from the run's own tail would do.

Host only once the series exist. The grad rule's bar is median x max(``grad_k`` 3,
exp(``grad_z`` 6 x spread)), ``spread`` a robust standard deviation of the step-to-step change
of log grad norm. Where that spread is small the 3x floor is the bar, and the floor's false-alarm
rate is whatever the run's tail makes it. This script replays recorded clean, unguarded zoo runs
(``--generate`` trains them: the zoo's setting of each cell, responses off, the per-step loss,
grad norm, log Z and update ratio kept) through ``SpikeDetector`` and counts, per cell:

- **today**: armed steps on which the grad rule is on, and the steps it flags (per 1,000);
- **tail bar**: the same steps judged against a bar sized from the run's own history, causally
  (only steps before the one judged): over the last ``WINDOW`` kept steps the log of grad norm
  over its running median, ``r``; ``u`` its 90th percentile, ``beta`` the mean of ``r - u`` over
  the values above ``u`` (an exponential tail above ``u``, the peaks-over-threshold model with
  shape 0); the bar is ``u + beta x ln(share above u / P)``, the level that an exponential tail
  passes with probability ``P`` (1 in 1,000), and never under today's bar. Fitted once the
  history holds ``MIN_FIT`` values; today's bar alone before;
- **detection**: the share of armed steps on which a planted spike of 5x and 10x the step's own
  grad norm passes each bar (a garbage batch moves the grad norm 5-200x on these models).

Seeds 0-3 are the tuning half, 4-7 the held-out half; the table reports both.

    PYTHONPATH=src:. python benchmarks/grad_tail.py --generate   # ~10 min on 1 core
    PYTHONPATH=src:. python benchmarks/grad_tail.py
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import math
from pathlib import Path

from spikeguard.detector import DetectorConfig, SpikeDetector
from spikeguard.record import StepMetrics

__all__ = ["main", "series", "tail_bar"]

SERIES = Path(__file__).parent / "results" / "zoo_clean_series.jsonl"
CELLS = ("base", "sgd", "adafactor", "muon", "llama", "b4", "stdlib", "bpe")
SEEDS = tuple(range(8))
WINDOW, MIN_FIT, QUANTILE, P = 256, 60, 0.9, 1e-3


def tail_bar(history: list[float]) -> float:
    """The log bar an exponential tail above the 90th percentile of ``history`` (sorted log
    ratios) passes with probability P; -inf while too short to fit."""
    n = len(history)
    if n < MIN_FIT:
        return -math.inf
    k = int(QUANTILE * n)
    u, above = history[k], history[k + 1:]
    if not above:
        return u
    beta = sum(v - u for v in above) / len(above)
    return u + beta * math.log(len(above) / n / P)


def series() -> list[dict]:
    """The recorded runs, one per (cell, seed) (a later line replaces an earlier one)."""
    if not SERIES.exists():
        raise SystemExit(f"{SERIES} is missing: run benchmarks/grad_tail.py --generate first")
    return list({(r["cell"], r["seed"]): r for r in map(json.loads, open(SERIES))}.values())


def _generate() -> None:
    from benchmarks.zoo import cells
    from benchmarks.zoo_run import run_one

    done = set()
    if SERIES.exists():
        done = {(r["cell"], r["seed"]) for r in map(json.loads, open(SERIES))}
    with open(SERIES, "a") as out:
        for seed in SEEDS:
            for job in cells([seed]):
                name = job["cell"].removeprefix("clean/")
                if (job["kind"] != "clean" or job["arm"] != "unguarded" or name not in CELLS
                        or (job["cell"], seed) in done):
                    continue
                records: list = []
                run_one(job, records)
                keys = ("loss", "grad_norm", "log_z", "update_ratio")
                series = {k: [_round(r.get(k)) for r in records] for k in keys}
                out.write(json.dumps({"cell": job["cell"], "seed": seed, "steps": job["steps"],
                                      "warm": job["setting"]["warmup"], "series": series}) + "\n")
                out.flush()
                done.add((job["cell"], seed))
                print(f"{job['cell']} seed {seed}: {len(records)} steps", flush=True)


def _round(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(f"{v:.6g}")


def _replay(run: dict) -> dict[str, int]:
    """One run's counts: armed steps with the grad rule on, flags today and with the tail bar,
    and planted 5x/10x spikes caught by each."""
    d = SpikeDetector(DetectorConfig.for_run(run["steps"]))
    g_rule, s = d._rules["grad_spike"], run["series"]
    hist: list[float] = []
    order: collections.deque[float] = collections.deque()
    n = collections.Counter()
    for t in range(run["steps"]):
        g, lz, ur = s["grad_norm"][t], s["log_z"][t], s["update_ratio"][t]
        v = d.update(StepMetrics(step=t, loss=s["loss"][t], grad_norm=g,
                                 log_z=math.nan if lz is None else lz),
                     update_ratio=ur)
        med, limit = g_rule.med, g_rule.limit
        if not (med > 0 and limit == limit and g is not None):
            continue
        r = math.log(g / med) if g > 0 else -math.inf
        if d.armed and g_rule.on:
            bar = max(math.log(limit / med), tail_bar(hist))
            n["steps"] += 1
            n["today"] += g > limit
            n["tail"] += r > bar
            for k in (5, 10):
                n[f"today x{k}"] += k * g > limit
                n[f"tail x{k}"] += r + math.log(k) > bar
        if not v.skip and g > 0 and g_rule.on:  # kept steps once the rule is on
            bisect.insort(hist, r)
            order.append(r)
            if len(order) > WINDOW:
                hist.pop(bisect.bisect_left(hist, order.popleft()))
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--generate", action="store_true", help="train the missing series first")
    args = ap.parse_args(argv)
    if args.generate:
        _generate()
    per: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for run in series():
        half = "tuning" if run["seed"] < 4 else "held-out"
        per[(run["cell"], half)].update(_replay(run))
    print("| cell | half | grad-on steps | today /1k | tail bar /1k | x5 caught today | "
          "x5 tail | x10 today | x10 tail |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (cell, half), n in sorted(per.items()):
        m = n["steps"] or 1
        print(f"| {cell} | {half} | {n['steps']} | {1e3 * n['today'] / m:.1f} | "
              f"{1e3 * n['tail'] / m:.1f} | {n['today x5'] / m:.1%} | {n['tail x5'] / m:.1%} | "
              f"{n['today x10'] / m:.1%} | {n['tail x10'] / m:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
