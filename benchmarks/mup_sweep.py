"""muP learning-rate transfer: where the best learning rate sits at widths 64, 128 and 256.

For each parametrization (muP: ``init="mup"`` with :func:`spikeguard.prevent.mup.mup_param_groups`;
standard: ``init="standard"`` with one AdamW group), each width, each learning rate on a 2x grid
and each seed, it trains the reference GPT (untied embeddings, fixed head_dim: width grows by
adding heads) on the default corpus and scores the run by the mean of its last 20 training
losses (a diverged run scores inf). The best learning rate of a width is the argmin over the grid
of that score averaged over the seeds. Target: the standard parametrization's best learning rate
moves >= 2 grid steps from the narrowest to the widest width, muP's <= 1.

    PYTHONPATH=src:. nice -n 10 python benchmarks/mup_sweep.py [--workers 2] [--results F] [--smoke]

``--results F`` appends each finished run to the JSON-lines file F and skips the runs already
in it, so an interrupted sweep resumes where it stopped (CPU runs are deterministic).

Never in CI except ``--smoke`` (a couple of steps, 2 widths, 2 learning rates), whose table a
test parses. One torch thread per worker process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

import torch

__all__ = ["Run", "best_lrs", "main", "train_one"]

PARAMS = ("mup", "standard")


@dataclass(frozen=True)
class Run:
    """One training run of the sweep."""

    param: str
    width: int
    lr: float
    seed: int
    steps: int
    batch_size: int
    seq_len: int
    n_layer: int
    head_dim: int
    warmup: int
    last: int


def train_one(run: Run) -> tuple[Run, float, float]:
    """Train one model; returns (run, mean of the last ``run.last`` losses, seconds)."""
    torch.set_num_threads(1)
    from spikeguard.data import TokenStream, load_corpus
    from spikeguard.model import GPT, GPTConfig
    from spikeguard.prevent.mup import mup_param_groups
    from spikeguard.prevent.schedules import warmup_cosine

    torch.manual_seed(run.seed)
    cfg = GPTConfig(vocab_size=256, n_layer=run.n_layer, n_head=run.width // run.head_dim,
                    d_model=run.width, seq_len=run.seq_len, tie_embeddings=False, init=run.param)
    model = GPT(cfg)
    groups = (mup_param_groups(model, lr=run.lr, weight_decay=0.1) if run.param == "mup"
              else [{"params": list(model.parameters()), "lr": run.lr, "weight_decay": 0.1}])
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(warmup_steps=run.warmup, total_steps=run.steps, min_ratio=0.1))
    stream = TokenStream(load_corpus("pydoc").train, batch_size=run.batch_size,
                         seq_len=run.seq_len, seed=run.seed)
    losses: list[float] = []
    start = time.perf_counter()
    for _ in range(run.steps):
        x, y = next(stream)
        loss = model.loss(model(x), y).loss
        value = float(loss.detach())
        losses.append(value)
        if not math.isfinite(value):
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    tail = losses[-run.last:]
    score = sum(tail) / len(tail) if len(losses) == run.steps and all(map(math.isfinite, tail)) \
        else math.inf
    return run, score, time.perf_counter() - start


def best_lrs(scores: dict[tuple[str, int, float, int], float], param: str, widths: list[int],
             lrs: list[float], seeds: list[int]) -> dict[int, int]:
    """Grid index of the best learning rate per width: argmin of the seed-mean score."""
    out = {}
    for w in widths:
        means = [sum(scores[(param, w, lr, s)] for s in seeds) / len(seeds) for lr in lrs]
        out[w] = min(range(len(lrs)), key=lambda i: means[i])
    return out


def _fmt(v: float) -> str:
    return "inf" if not math.isfinite(v) else f"{v:.4f}"


def print_table(scores, widths, lrs, seeds) -> dict[str, int]:
    """Per-seed scores, the best learning rate per width and the grid shift, per parametrization.

    Lines a parser reads: ``row PARAM WIDTH LR s0,s1,...`` and ``best PARAM WIDTH LR INDEX`` and
    ``shift PARAM STEPS``."""
    shifts = {}
    for param in PARAMS:
        print(f"\n{param}: mean of the last losses, per seed ({', '.join(map(str, seeds))})")
        print("width  " + "  ".join(f"{lr:>13.3e}" for lr in lrs))
        for w in widths:
            cells = ["/".join(_fmt(scores[(param, w, lr, s)]) for s in seeds) for lr in lrs]
            print(f"{w:<5}  " + "  ".join(f"{c:>13}" for c in cells))
        best = best_lrs(scores, param, widths, lrs, seeds)
        for w in widths:
            for lr in lrs:
                vals = ",".join(_fmt(scores[(param, w, lr, s)]) for s in seeds)
                print(f"row {param} {w} {lr:.6e} {vals}")
        for w in widths:
            print(f"best {param} {w} {lrs[best[w]]:.6e} {best[w]}")
        shifts[param] = abs(best[widths[-1]] - best[widths[0]])
        print(f"shift {param} {shifts[param]}")
    return shifts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="64,128,256")
    p.add_argument("--lr-exponents", default="-13:-4", help="base-2 exponents lo:hi, inclusive")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--last", type=int, default=20, help="losses averaged for the score")
    p.add_argument("--workers", type=int, default=2, help="processes, one torch thread each")
    p.add_argument("--results", help="JSON-lines file: finished runs are appended and reused")
    p.add_argument("--smoke", action="store_true", help="2 steps, 2 widths, 2 LRs, 1 worker")
    args = p.parse_args(argv)
    if args.smoke:
        args.widths, args.lr_exponents, args.seeds = "32,64", "-8:-7", "0,1"
        args.steps, args.last, args.workers, args.batch_size, args.seq_len = 2, 1, 1, 2, 16
        args.head_dim = 16
    widths = [int(w) for w in args.widths.split(",")]
    lo, hi = (int(e) for e in args.lr_exponents.split(":"))
    lrs = [2.0 ** e for e in range(lo, hi + 1)]
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = [Run(param=param, width=w, lr=lr, seed=s, steps=args.steps, batch_size=args.batch_size,
                seq_len=args.seq_len, n_layer=args.n_layer, head_dim=args.head_dim,
                warmup=max(1, args.steps // 10) if args.steps > 1 else 0, last=args.last)
            for w in sorted(widths) for param in PARAMS for lr in lrs for s in seeds]
    done = {}
    if args.results and os.path.exists(args.results):
        with open(args.results) as f:
            for line in f:
                row = json.loads(line)
                done[Run(**{k: row[k] for k in Run.__dataclass_fields__})] = float(row["score"])
    print(f"{len(runs)} runs: widths {widths}, lr 2^{lo}..2^{hi}, seeds {seeds}, {args.steps} "
          f"steps of {args.batch_size}x{args.seq_len} tokens, {args.n_layer} layers, head_dim "
          f"{args.head_dim}, {args.workers} worker(s); load average {os.getloadavg()[0]:.1f}",
          flush=True)
    start = time.perf_counter()
    scores: dict[tuple[str, int, float, int], float] = {}

    def record(result: tuple[Run, float, float], reused: bool = False) -> None:
        run, score, seconds = result
        scores[(run.param, run.width, run.lr, run.seed)] = score
        print(f"run {run.param} width {run.width} lr {run.lr:.3e} seed {run.seed}: "
              f"{_fmt(score)} ({'from ' + args.results if reused else f'{seconds:.0f} s'})",
              flush=True)
        if args.results and not reused:
            with open(args.results, "a") as f:
                f.write(json.dumps(dataclasses.asdict(run) | {"score": score}) + "\n")

    for run in runs:
        if run in done:
            record((run, done[run], 0.0), reused=True)
    todo = [run for run in runs if run not in done]
    if args.workers == 1:
        for run in todo:
            record(train_one(run))
    else:
        with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
            for result in pool.map(train_one, todo):
                record(result)
    shifts = print_table(scores, widths, lrs, seeds)
    print(f"\ntarget: standard shifts >= 2 grid steps ({shifts['standard']}), muP <= 1 "
          f"({shifts['mup']}); {time.perf_counter() - start:.0f} s, load average "
          f"{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
