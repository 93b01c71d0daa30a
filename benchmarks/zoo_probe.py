"""Clean settings the zoo does not hold, on seeds no rule was tuned on: does the guard misfire?

The zoo varies one axis of its base setting at a time (tiny GPT, fused AdamW at 3e-3, fp32,
cosine, warmup 20 not given to ``for_run``, batch 8, 300 steps, pydoc as bytes). A user's run
differs on several at once. Each probe here pairs two of the zoo's axes, or moves the LR, the
length or the warmup, and runs on seeds 50 and 51 (the zoo's rules were tuned on seeds 0-1,
and its held-out seeds stop at 43). Each probe is the guard at its defaults (the alert arm)
beside the same run with responses off, scored with the zoo's clean-cell targets
(``zoo_score``): no halt, rollback or page; false skips at most 1 per 1,000 armed steps; held-out
loss at most 1.005x unguarded. Resumable; a tiny run takes 5-10 s, the Llama ones 10-20 s.

    PYTHONPATH=src:. python benchmarks/zoo_probe.py --workers 2 --results benchmarks/results/zoo_probe.jsonl
    PYTHONPATH=src:. python benchmarks/zoo_probe.py --table --results benchmarks/results/zoo_probe.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.detection import load_results, run_jobs
from benchmarks.zoo import BASE, _job, _safe_run, table

__all__ = ["PROBES", "SEEDS", "jobs", "main"]

PROBES: dict[str, dict[str, Any]] = {
    "llama+sgd": {"model": "llama", "optimizer": "sgd", "lr": 0.1},
    "llama+muon": {"model": "llama", "optimizer": "muon"},
    "llama+bf16": {"model": "llama", "precision": "bf16-mixed"},
    "llama+bpe": {"model": "llama", "tokenizer": "bpe"},
    "stdlib+bpe": {"corpus": "stdlib", "tokenizer": "bpe"},
    "sgd+wsd": {"optimizer": "sgd", "lr": 0.1, "schedule": "wsd"},
    "sgd+stdlib": {"optimizer": "sgd", "lr": 0.1, "corpus": "stdlib"},
    "muon+b32": {"optimizer": "muon", "batch": 32},
    "adafactor+bf16": {"optimizer": "adafactor", "lr": 1e-2, "precision": "bf16-mixed"},
    "adam-b2+constant+b4": {"optimizer": "adam-b2-0.999", "schedule": "constant", "batch": 4},
    "dropout+fp16": {"dropout": 0.1, "precision": "fp16-mixed"},
    "lr1e-2": {"lr": 1e-2},
    "lr1e-3+600": {"lr": 1e-3, "steps": 600},
    "warmup50": {"warmup": 50},
    "no-qk-norm": {"qk_norm": False},
    "no-z-loss": {"z_loss": 0.0},
}
"""Probe name -> its changes to the zoo's base setting."""
SEEDS = (50, 51)


def jobs(seeds: tuple[int, ...] = SEEDS) -> list[dict[str, Any]]:
    """Every probe run: the alert arm and the unguarded arm of each probe and seed."""
    return [_job("clean", f"clean/probe-{name}", name, seed, arm, s={**BASE, **change},
                 clean_ref=f"clean/probe-{name}")
            for seed in seeds for name, change in PROBES.items() for arm in ("alert", "unguarded")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=Path("benchmarks/results/zoo_probe.jsonl"))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS))
    p.add_argument("--table", action="store_true", help="score the results file, run nothing")
    p.add_argument("--failed", action="store_true", help="the table shows failed cells only")
    args = p.parse_args(argv)
    if args.table:
        lines = [d for d in load_results(args.results) if d["seed"] in args.seeds]
        print(table(lines, only_failed=args.failed))
        return 0
    run_jobs(jobs(tuple(args.seeds)), args.results, workers=args.workers, run=_safe_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
