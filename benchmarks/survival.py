"""The survival benchmark: the same faults with the defenses on and off, over several seeds.

For each seed: a clean run of each arm, then one run per fault type and arm.

- on: every default defense (z-loss, QK-norm, clip 1.0, the guard), ``--tier2 rollback``,
  checkpoints every 25 steps; a skip skips the whole batch;
- drop (only beside the seq fault): on plus ``--drop-sequences``: a skip the guard traces to the
  data re-runs the step without the quarantined sequences;
- off: ``--defenses none`` (no z-loss, no QK-norm, no clipping, the guard only records).

Faults (sizes chosen so that the off arm is really hurt; see BENCHMARKS.md):

- outlier: one random-byte batch at step 150;
- seq: one sequence of one repeated byte (row 3 of 8) in the batch of step 150;
- nan: a NaN in one gradient element at step 150;
- lr: the learning rate x 2000 for 20 steps from step 150 (at the peak LR 1e-3 used here, x 50
  and x 500 only hurt the unguarded tiny model by 25-38%: AdamW absorbs it);
- logit-drift: the head's input (so the logits) scaled by (1 + 2 (t - 150)) from step 150 on
  (0.05 and 0.5 only hurt the unguarded run by 1-23%: it learns to shrink its logits back).

A run "survives" when it ends without NaN and its final loss (mean of the last 20 steps) is within
2% of its arm's clean run; "diverged" when it ends in NaN or above 1.5x clean; a guarded nan run
must instead halt naming the parameter. Runs go two at a time in worker processes (one torch
thread each) and print a table per fault type.

    PYTHONPATH=src:. python benchmarks/survival.py                    # 5 seeds, tiny, 300 steps
    PYTHONPATH=src:. python benchmarks/survival.py --seeds 1 --steps 60 --smoke
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

__all__ = ["FAULTS", "main"]

FAULTS = {
    "outlier": "outlier@{s}",
    "seq": "seq@{s}:3:repeat",
    "nan": "nan@{s}:blocks.0.mlp.fc.weight",
    "lr": "lr@{s}:2000:20",
    "logit-drift": "logit-drift@{s}:2",
}


def _one(job: tuple) -> dict:
    arm, fault, seed, steps, model, root, faults, lr = job
    import torch

    from spikeguard.sinks import read_metrics
    from spikeguard.train import TrainConfig, train

    torch.set_num_threads(1)
    at = steps // 2
    cfg = TrainConfig(
        steps=steps, model=model, seed=seed, out=str(Path(root) / f"{arm}-{fault}-{seed}"),
        progress=False, plot=False, eval_batches=2, batch_size=8, ckpt_every=25, keep=20,
        lr=lr,
        defenses="none" if arm == "off" else "all",
        inject=(faults[fault].format(s=at),) if fault != "clean" else ())
    if arm in ("on", "drop"):
        import dataclasses

        attribution = dataclasses.replace(cfg.guard.attribution, drop_sequences=arm == "drop")
        cfg = dataclasses.replace(cfg, guard=dataclasses.replace(
            cfg.guard, tier2="rollback", attribution=attribution))
    t0 = time.perf_counter()
    r = train(cfg, echo=False)
    last = r.losses[-20:]
    final = statistics.fmean(last) if last and all(map(math.isfinite, last)) else math.nan
    return {"arm": arm, "fault": fault, "seed": seed, "final": final,
            "nan": not all(map(math.isfinite, r.losses[-5:])) if r.losses else True,
            "halted": r.halted.step if r.halted else None,
            "named": list(r.halted.nonfinite_params) if r.halted else [],
            "rollbacks": r.rollbacks, "seconds": time.perf_counter() - t0,
            "kept": [x["kept_rows"] for x in read_metrics(Path(cfg.out) / "metrics.jsonl")
                     if x.get("kept_rows") and x.get("skipped") is False]}


def _arms(fault: str) -> tuple[str, ...]:
    return ("on", "drop", "off") if fault in ("clean", "seq") else ("on", "off")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", default="tiny", choices=("tiny", "demo", "bench"))
    p.add_argument("--faults", nargs="*", default=list(FAULTS))
    p.add_argument("--lr", type=float, default=1e-3,
                   help="peak learning rate (train's 3e-3 is at the edge for the tiny model on 1 "
                        "thread; see BENCHMARKS.md)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--spec", action="append", default=[], metavar="FAULT=TEMPLATE",
                   help="another size for a fault, e.g. lr=lr@{s}:100:20 ({s} is the fault step)")
    p.add_argument("--smoke", action="store_true", help="one seed, short runs: checks it runs")
    args = p.parse_args(argv)
    for item in args.spec:
        name, sep, template = item.partition("=")
        if not sep or name not in FAULTS or "{s}" not in template:
            p.error(f"--spec {item!r}: expected FAULT=TEMPLATE with FAULT one of "
                    f"{', '.join(FAULTS)} and {{s}} in TEMPLATE")
        FAULTS[name] = template
    if args.smoke:
        args.seeds, args.steps = 1, min(args.steps, 60)
    root = tempfile.mkdtemp(prefix="survival_")
    jobs = [(arm, fault, seed, args.steps, args.model, root, dict(FAULTS), args.lr)
            for seed in range(args.seeds) for fault in ["clean", *args.faults]
            for arm in _arms(fault) if arm != "drop" or "seq" in args.faults]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        rows = pool.map(_one, jobs, chunksize=1)
    clean = {(r["arm"], r["seed"]): r["final"] for r in rows if r["fault"] == "clean"}
    print(f"\nsurvival: {args.model}, {args.steps} steps, {args.seeds} seeds, faults at step "
          f"{args.steps // 2}; {time.perf_counter() - t0:.0f} s")
    summary: dict = {}
    for fault in args.faults:
        print(f"\n{fault} ({FAULTS[fault].format(s=args.steps // 2)})")
        print(f"  {'arm':4s} {'seed':>4s} {'final':>8s} {'clean':>8s} {'ratio':>7s}  outcome")
        for arm in _arms(fault):
            outcomes = []
            for r in sorted((r for r in rows if r["fault"] == fault and r["arm"] == arm),
                            key=lambda r: r["seed"]):
                c = clean[(arm, r["seed"])]
                ratio = r["final"] / c if math.isfinite(r["final"]) else math.nan
                if r["halted"] is not None:
                    outcome = f"halted at {r['halted']} naming {r['named'] or 'nothing'}"
                elif r["nan"] or not math.isfinite(ratio):
                    outcome = "diverged (NaN)"
                elif ratio > 1.5:
                    outcome = "diverged (> 1.5x clean)"
                elif abs(ratio - 1) <= 0.02:
                    outcome = "survived (within 2%)"
                else:
                    outcome = f"hurt ({ratio - 1:+.1%})"
                outcome += f", {r['rollbacks']} rollback(s)" if r["rollbacks"] else ""
                outcome += "".join(f", kept {k}/{n} rows" for k, n in r["kept"])
                outcomes.append(outcome)
                print(f"  {arm:4s} {r['seed']:>4d} {r['final']:8.4f} {c:8.4f} {ratio:7.3f}  {outcome}")
            summary[(fault, arm)] = outcomes
            kinds = sorted({o.split(" (")[0].split(" at ")[0] for o in outcomes})
            print(f"  {arm}: " + ", ".join(f"{k} {sum(o.startswith(k) for o in outcomes)}/"
                                          f"{len(outcomes)}" for k in kinds))
    return summary


if __name__ == "__main__":
    main()
