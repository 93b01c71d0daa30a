"""The zoo: the guard on runs nobody tuned its rules to (issue 43, item 4).

Each run is a plain loop through the guard's public API (``benchmarks/zoo_run.py``) on a model,
optimizer, precision, schedule, batch size and dropout of its cell (``benchmarks/zoo_models.py``).
Every cell pairs the guard with the same run with responses off (arm ``unguarded``,
``GuardConfig(respond=False)``: same seed, same weights, same batches), as
``benchmarks/detection.py`` does, and is scored by the same code
(``spikeguard.testing.detection.score``, plus the zoo's targets in ``benchmarks/zoo_score.py``).

A designed set, not a cross product: each axis varied around one base. The base is the tiny
reference GPT (2 layers, d=64, T=64, QK-norm, z-loss 1e-4), fused AdamW at 3e-3 (betas 0.9/0.95,
weight decay 0.1), fp32, warmup 20 then cosine to 0.1, batch 8, dropout 0, 300 steps, clip 1.0,
``DetectorConfig.for_run(300)`` (the warmup not given, as README's loop writes it), checkpoints
every 25 steps (keep 5), the pydoc corpus as bytes.

- clean (arms alert, unguarded): the base; AdamW foreach; Adam beta2 0.999; SGD (momentum 0.9,
  LR 0.1); Adafactor (LR 1e-2); Muon (LR 3e-3, ``adjust_lr_fn="match_rms_adamw"``) with AdamW
  for embeddings and norms; HF LlamaForCausalLM; bf16-mixed; fp16-mixed (the scaler);
  WSD; constant after warmup; the warmup given to for_run; a 100-step warmup given; batch 4,
  32, 64; dropout 0.1; another corpus (``stdlib``: the standard library's Python source, as
  bytes) and another tokenizer (``bpe``: pydoc in a 4,096-id BPE);
- faults (arms alert, rollback, unguarded): outlier, storm of 5, NaN gradient, LR x50 for 20
  steps, the same sticky, logit drift 0.05, at five timings: ``warmup`` (step 10, inside the
  warmup), ``arming`` (2 steps after the earliest step the last rule can arm: step 52 on the
  base and with the warmup given, 122 with the 100-step warmup given; before the grad rule's
  quiet arming these were 32, 62 and 202), ``mid`` (150), ``cooldown`` (WSD, 10 steps
  into its cooldown: 254), ``last`` (288, in the last 5%). Outliers and storms also get their
  gap run (unguarded, the stream without the batches they replace). On the other axes, at
  ``mid``: the LR transient and the outlier for SGD, Adafactor, Muon, Adam beta2 0.999, Llama,
  bf16, fp16, stdlib and BPE; the LR transient at ``arming`` for Llama;
- natural instabilities (no injection; arms alert, rollback, unguarded), Wortsman et al. 2023's
  small-scale proxies on the tiny GPT at LR 1.0 (a 100-step warmup): ``attn-logit`` without
  QK-norm, ``output-logit`` without z-loss.

Halves: seeds 0 and 1 are the tuning half, 2 and 3 the held-out half (each result line carries
``half``); jobs run seed by seed in the order 0, 2, 1, 3, so a partial run covers every cell on
one seed of each half first. ``--table --half holdout`` scores the held-out half alone.

Sizing: one seed of the whole set is 237 runs, 71,100 steps (219 before the corpus and
tokenizer cells). A tiny fp32 run of 300 steps takes
~4-6 s on a quiet core (Llama and Muon ~1.5x, bf16 ~2x, fp16-mixed ~3x, batch 64 ~7x); on this
2-core machine shared with other jobs (load ~10) seed 0 took 68 min on one worker (a run 1-105 s,
median 16 s), so the four seeds are ~4.5 h there, ~1.5-2 h on a quiet machine with two workers.

    PYTHONPATH=src:. nice -n 10 python benchmarks/zoo.py --workers 1 \\
        --results benchmarks/results/zoo.jsonl
    PYTHONPATH=src:. python benchmarks/zoo.py --table --results benchmarks/results/zoo.jsonl
    PYTHONPATH=src:. python benchmarks/zoo.py --cells clean/sgd --seeds 0 --list
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path
from typing import Any

import spikeguard as sg
from benchmarks.detection import _key, load_results, run_jobs
from spikeguard.testing.detection import format_table

__all__ = ["CLEAN", "SEEDS", "cells", "main", "smoke", "table"]

BASE: dict[str, Any] = {
    "model": "tiny", "optimizer": "adamw-fused", "lr": 3e-3, "precision": "fp32",
    "schedule": "cosine", "warmup": 20, "warmup_given": False, "batch": 8, "dropout": 0.0,
    "steps": 300, "qk_norm": True, "z_loss": 1e-4, "corpus": "pydoc", "tokenizer": "bytes"}
CLEAN: dict[str, dict[str, Any]] = {
    "base": {}, "adamw-foreach": {"optimizer": "adamw-foreach"},
    "adam-b2-0.999": {"optimizer": "adam-b2-0.999"},
    "sgd": {"optimizer": "sgd", "lr": 0.1}, "adafactor": {"optimizer": "adafactor", "lr": 1e-2},
    "muon": {"optimizer": "muon", "lr": 3e-3}, "llama": {"model": "llama"},
    "bf16": {"precision": "bf16-mixed"}, "fp16": {"precision": "fp16-mixed"},
    "wsd": {"schedule": "wsd"}, "constant": {"schedule": "constant"},
    "warmup-given": {"warmup_given": True},
    "warmup100-given": {"warmup": 100, "warmup_given": True},
    "b4": {"batch": 4}, "b32": {"batch": 32}, "b64": {"batch": 64},
    "dropout0.1": {"dropout": 0.1}, "stdlib": {"corpus": "stdlib"},
    "bpe": {"tokenizer": "bpe"}}
"""Each clean cell: its changes to BASE."""
NATURAL: dict[str, dict[str, Any]] = {
    "attn-logit": {"qk_norm": False, "lr": 1.0, "warmup": 100},
    "output-logit": {"z_loss": 0.0, "lr": 1.0, "warmup": 100}}
FAULTS: dict[str, tuple[str, int]] = {   # name -> (--inject spec with {S}, steps it lasts)
    "outlier": ("outlier@{S}", 1), "storm": ("storm@{S}:5", 5), "nan-grad": ("nan@{S}", 1),
    "lr": ("lr@{S}:50:20", 20), "lr-sticky": ("lr@{S}:50:20!", 20),
    "logit-drift": ("logit-drift@{S}:0.05", 0)}
GAPS = {"outlier": "gap@{S}:1", "storm": "gap@{S}:5"}
ALL = tuple(FAULTS)
FAULT_SETS: list[tuple[str, str, tuple[str, ...]]] = [   # (clean cell, timing, faults)
    ("base", "warmup", ALL), ("base", "arming", ALL), ("base", "mid", ALL),
    ("wsd", "cooldown", ALL), ("base", "last", ALL), ("warmup-given", "arming", ALL),
    ("warmup100-given", "arming", ("lr", "outlier")), ("llama", "arming", ("lr",)),
    *[(v, "mid", ("lr", "outlier")) for v in ("sgd", "adafactor", "muon", "adam-b2-0.999",
                                              "llama", "bf16", "fp16", "stdlib", "bpe")]]
SEEDS = {"tune": (0, 1), "holdout": (2, 3)}
"""The default seeds; any other seed given with --seeds is held out too (nothing was tuned on
it): ``--cells clean/llama --seeds $(seq 2 39)`` measures a cell's false-skip rate on more
steps than two seeds' 540."""
SEED_ORDER = (0, 2, 1, 3)


def setting(name: str) -> dict[str, Any]:
    return {**BASE, **(CLEAN[name] if name in CLEAN else NATURAL[name])}


def fault_step(s: dict[str, Any], timing: str) -> int:
    """The step where a fault of ``timing`` fires on setting ``s``."""
    steps = s["steps"]
    if timing == "warmup":
        return s["warmup"] // 2
    if timing == "arming":
        det = sg.DetectorConfig.for_run(steps, warmup_steps=s["warmup"] if s["warmup_given"]
                                        else None)
        # the earliest step the last rule can turn on: the grad rule counts arm_quiet quiet
        # updates from max(arm_after, grad_arm_after) on (post-warmup spikes push it later)
        return max(det.arm_after, det.grad_arm_after) + det.arm_quiet + 2
    if timing == "mid":
        return steps // 2
    if timing == "cooldown":
        if s["schedule"] != "wsd":
            raise ValueError("the cooldown timing needs the wsd schedule")
        return sg.schedules.wsd(warmup_steps=s["warmup"], total_steps=steps, decay_fraction=0.2,
                                min_ratio=0.1).decay_start + 10
    if timing == "last":
        return steps - 12
    raise ValueError(f"unknown timing {timing!r}")


def _job(kind: str, cell: str, name: str, seed: int, arm: str, *,
         s: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """One run's job dict; ``s`` a setting outside CLEAN and NATURAL (zoo_probe's), else
    ``setting(name)``; ``extra`` keys go last and win."""
    s = setting(name) if s is None else s
    return {"cell": cell, "kind": kind, "variant": name, "seed": seed, "arm": arm,
            "half": "tune" if seed in SEEDS["tune"] else "holdout", "setting": s,
            "model": s["model"], "steps": s["steps"], "lr": s["lr"], "precision": s["precision"],
            "clean_ref": f"clean/{name}", **extra}


def cells(seeds: list[int] | None = None) -> list[dict[str, Any]]:
    """Every zoo job, seed by seed (SEED_ORDER), within a seed the cheap and telling first."""
    jobs: list[tuple[tuple, dict[str, Any]]] = []
    order = [s for s in SEED_ORDER if seeds is None or s in seeds] + sorted(
        set(seeds or ()) - set(SEED_ORDER))
    for rank, seed in enumerate(order):
        def slow(name: str) -> bool:
            return name in ("fp16", "b64")
        for name in CLEAN:
            for arm in ("alert", "unguarded"):
                jobs.append(((rank, slow(name), 0), _job("clean", f"clean/{name}", name, seed,
                                                         arm)))
        for name, timing, faults in FAULT_SETS:
            s = setting(name)
            at = fault_step(s, timing)
            for fault in faults:
                spec, length = FAULTS[fault]
                cell = f"{name}@{timing}/{fault}"
                common = {"fault": fault, "timing": timing, "fault_step": at,
                          "fault_len": length or s["steps"] - at}
                for arm in ("alert", "rollback", "unguarded"):
                    jobs.append(((rank, slow(name), 1), _job(
                        "fault", f"fault/{cell}", name, seed, arm,
                        fault_spec=spec.format(S=at), **common)))
                if fault in GAPS:
                    jobs.append(((rank, slow(name), 1), _job(
                        "gap", f"gap/{cell}", name, seed, "unguarded",
                        fault_spec=GAPS[fault].format(S=at), **common)))
        for name in NATURAL:
            for arm in ("alert", "rollback", "unguarded"):
                jobs.append(((rank, False, 2), _job("natural", f"natural/{name}", name, seed, arm,
                                                    fault_step=0)))
    return [j for _, j in sorted(jobs, key=lambda kj: kj[0])]


SMOKE = {"steps": 60, "warmup": 5}
"""The CI smoke cells' changes: 60 steps, a 5-step warmup."""
SMOKE_FAULT = 55
"""The smoke outlier's step: after the grad rule's quiet arming (on from step 47 in the 60-step
base run: post-warmup spikes restart its count; in 40 steps it never turned on), since the
garbage batch moves the grad norm (27x), not the loss (1.04x the EMA)."""


def smoke() -> list[dict[str, Any]]:
    """A few tiny cells for CI (seed 0): the base clean and with an outlier at ``SMOKE_FAULT``
    (with its gap run), Muon and Llama clean; ``SMOKE["steps"]`` steps each."""
    jobs = []
    for name, arms in (("base", ("alert", "unguarded")), ("muon", ("alert", "unguarded")),
                       ("llama", ("alert",))):
        for arm in arms:
            jobs.append(_job("clean", f"clean/{name}", name, 0, arm))
    common = {"fault": "outlier", "timing": "smoke", "fault_step": SMOKE_FAULT,
              "fault_len": 1}
    jobs.append(_job("fault", "fault/base@smoke/outlier", "base", 0, "alert",
                     fault_spec=f"outlier@{SMOKE_FAULT}", **common))
    jobs.append(_job("gap", "gap/base@smoke/outlier", "base", 0, "unguarded",
                     fault_spec=f"gap@{SMOKE_FAULT}:1", **common))
    for j in jobs:
        j["setting"].update(SMOKE)
        j["steps"] = SMOKE["steps"]
        j["cell"] = j["cell"].replace("clean/", "clean/smoke-", 1)
        j["clean_ref"] = j["clean_ref"].replace("clean/", "clean/smoke-", 1)
    return jobs


def _safe_run(job: dict[str, Any]) -> dict[str, Any]:
    """zoo_run.run_one; a crashed run becomes an ``error`` line (retried on the next rerun)."""
    from benchmarks.zoo_run import run_one

    try:
        return run_one(job)
    except Exception as exc:
        return {**{k: v for k, v in job.items() if k != "setting"},
                "error": f"{type(exc).__name__}: {exc}"}


def table(lines: list[dict[str, Any]], *, only_failed: bool = False) -> str:
    from benchmarks.zoo_score import zoo_score

    return format_table(zoo_score(lines), only_failed=only_failed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=Path("benchmarks/results/zoo.jsonl"))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seeds", nargs="*", type=int, help="these seeds (default 0 2 1 3)")
    p.add_argument("--half", choices=tuple(SEEDS), help="only this half's seeds")
    p.add_argument("--cells", nargs="*", help="cell names or shell patterns (fault/base@mid/*)")
    p.add_argument("--arms", nargs="*", choices=("alert", "rollback", "unguarded"))
    p.add_argument("--list", action="store_true", help="print the selected jobs, run nothing")
    p.add_argument("--table", action="store_true", help="score the results file, run nothing")
    p.add_argument("--over", nargs="*", type=Path, default=[], metavar="FILE",
                   help="with --table: these results files' runs replace the same runs' "
                        "(cell, arm, seed) in --results, later files winning")
    p.add_argument("--failed", action="store_true", help="the table shows failed cells only")
    args = p.parse_args(argv)
    seeds = args.seeds if args.seeds is not None else (
        list(SEEDS[args.half]) if args.half else None)
    if args.table:
        runs = {_key(d): d for f in (args.results, *args.over) for d in load_results(f)}
        lines = [d for d in runs.values()
                 if (seeds is None or d["seed"] in seeds) and _chosen(d, args)]
        print(table(lines, only_failed=args.failed))
        return 0
    jobs = [j for j in cells(seeds) if _chosen(j, args)]
    if args.list:
        for j in jobs:
            print(j["cell"], j["arm"], j["seed"], j["half"], j.get("fault_spec", ""))
        print(f"{len(jobs)} runs, {sum(j['steps'] for j in jobs):,} steps")
        return 0
    run_jobs(jobs, args.results, workers=args.workers, run=_safe_run)
    return 0


def _chosen(j: dict[str, Any], args: argparse.Namespace) -> bool:
    """Whether the --cells and --arms filters keep ``j`` (a gap or clean reference run is kept
    with the fault cells it serves)."""
    if args.arms and j["arm"] not in args.arms:
        return False
    if not args.cells:
        return True
    names = {j["cell"], j["cell"].replace("gap/", "fault/", 1)}
    return any(fnmatch.fnmatchcase(n, pat) for n in names for pat in args.cells)


if __name__ == "__main__":
    sys.exit(main())
