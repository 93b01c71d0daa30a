"""The log Z jump on clean SGD runs: its pages with and without the bar of the run's own tail.

The zoo's clean SGD cell (tiny GPT, SGD with momentum 0.9, LR 0.1, batch 8, 300 steps, warmup
20 not given to ``for_run``) is recorded unguarded (``--generate``: the loss, grad norm, log Z
and update ratio of each step; seeds 4-219, none of which tuned a rule before) and replayed
through ``SpikeDetector`` with ``log_z_jump_rate`` at 0 (every jump against 1 nat, the rule
before), 1e-4 and 1e-3 (the default), and at 1e-3 with ``log_z_jump_heal`` 0 (the tail before
its excursions healed within 0.2 nats). Each replay counts the runs with a Tier 2 verdict and the
runs with a log Z jump. What the tail costs on a logit drift is in ``rule_far.py --set
log_z_jump_rate=0`` against ``rule_far.py`` (the planted +0.05 nats a step).

    PYTHONPATH=src:. python benchmarks/log_z_tail.py --generate   # 216 runs, about 20 min
    PYTHONPATH=src:. python benchmarks/log_z_tail.py
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from spikeguard.detector import DetectorConfig, SpikeDetector
from spikeguard.record import StepMetrics

RESULTS = Path(__file__).parent / "results" / "log_z_sgd_series.jsonl"
HALVES = {"tuning": range(4, 40), "second sign chosen": range(40, 76),
          "held-out": range(76, 112), "held-out from the heal": range(112, 220)}
"""Seeds 4-39 shaped the tail, 40-75 chose the second sign (the joint test's grad bar, not
grad_elevated x the median), 76-111 were recorded after both; 112-219 after
``log_z_jump_heal`` was chosen (on seeds 29 and 30)."""
KEYS = ("loss", "grad_norm", "log_z", "update_ratio")
JUMP = "log_z > median of last"


def _generate(path: Path, seeds: list[int]) -> None:
    from benchmarks.zoo import _job
    from benchmarks.zoo_run import run_one

    done = {json.loads(line)["seed"] for line in path.open()} if path.exists() else set()
    with path.open("a") as f:
        for seed in seeds:
            if seed in done:
                continue
            records: list = []
            line = run_one(_job("clean", "clean/sgd", "sgd", seed, "unguarded"), records)
            steps = [r for r in records if r.get("step") is not None and "loss" in r]
            series = {k: [None if r.get(k) is None else round(r[k], 6) for r in steps]
                      for k in KEYS}
            f.write(json.dumps({"seed": seed, "steps": line["steps"], "series": series}) + "\n")
            f.flush()
            print(f"seed {seed}: {len(steps)} steps, val {line['val_loss']:.4f}", flush=True)


def replay(run: dict, rate: float, heal: float | None = None) -> tuple[list[int], list[int]]:
    """(steps of the log Z jump's verdicts, steps of every Tier 2 verdict) of one replay;
    ``heal``: ``log_z_jump_heal`` (None: the default)."""
    extra = {} if heal is None else {"log_z_jump_heal": heal}
    d = SpikeDetector(DetectorConfig.for_run(run["steps"], log_z_jump_rate=rate, **extra))
    s, jumps, pages = run["series"], [], []
    for t in range(len(s["loss"])):
        lz = s["log_z"][t]
        v = d.update(StepMetrics(step=t, loss=s["loss"][t], grad_norm=s["grad_norm"][t],
                                 log_z=math.nan if lz is None else lz),
                     update_ratio=s["update_ratio"][t])
        if any(r.startswith(JUMP) for r in v.reasons):
            jumps.append(t)
        if v.tier >= 2:
            pages.append(t)
    return jumps, pages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--generate", action="store_true", help="record the runs first (resumable)")
    p.add_argument("--series", type=Path, default=RESULTS, help="the recorded runs (JSON lines)")
    p.add_argument("--seeds", type=int, nargs="+", default=[s for h in HALVES.values() for s in h],
                   help="the seeds --generate records (default 4-219)")
    args = p.parse_args(argv)
    if args.generate:
        _generate(args.series, args.seeds)
    if not args.series.exists():
        raise SystemExit(f"{args.series} not found: run with --generate first")
    runs = [json.loads(line) for line in args.series.open()]
    print(f"{len(runs)} clean SGD runs replayed\n")
    heal = DetectorConfig.log_z_jump_heal
    print("| seeds | log_z_jump_rate | log_z_jump_heal | runs paged (Tier 2) | runs with a log Z "
          "jump | where |")
    print("|---|---|---|---|---|---|")
    for half, seeds in HALVES.items():
        part = [r for r in runs if r["seed"] in seeds]
        if not part:
            continue
        for rate, h in ((0.0, heal), (1e-4, heal), (1e-3, 0.0), (1e-3, heal)):
            got = [(r["seed"], *replay(r, rate, h)) for r in part]
            paged = [(seed, pages[0]) for seed, _, pages in got if pages]
            jumped = [seed for seed, jumps, _ in got if jumps]
            where = ", ".join(f"seed {seed} step {t}" for seed, t in paged) or "-"
            print(f"| {seeds.start}-{seeds.stop - 1} ({half}) | {rate:g} | {h:g} | "
                  f"{len(paged)} / {len(part)} | {len(jumped)} / {len(part)} | {where} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
