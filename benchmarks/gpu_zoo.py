"""The zoo's core cells on a GPU: the bench GPT in bf16, the guard beside the same run with
responses off (issue 43, "when a device is lent"); then the sync and cost check.

Cells (seed 0, the bench() GPT: 6 layers, d=384, T=256, batch 8, fused AdamW at 1e-3, warmup 20
then cosine to 0.1, bf16-mixed through ``PrecisionPolicy``, clip 1.0,
``DetectorConfig.for_run(steps)``, a checkpoint every 25 steps):

- ``clean``: alert and unguarded arms; the target: no page, no halt, no rollback, the held-out
  loss within 1.005x the unguarded arm;
- ``outlier``: a batch of random token ids at mid-run; skipped, and the run ends no worse than
  unguarded;
- ``lr``: the LR x50 for 20 steps from mid-run; alert, rollback and unguarded arms; paged within
  10 steps and ends no worse than unguarded, and under rollback within 2% of clean ("no worse"
  as the zoo scores it: within 1.005x, ``HARM_RATIO``).

Then ``gpu_check.guard_no_sync`` on the same device: guarded steps under
``torch.cuda.set_sync_debug_mode("error")`` (0 syncs outside the one-step-late read) and the
guard's share of a step beside a plain clip + step loop.

    PYTHONPATH=src:. python benchmarks/gpu_zoo.py [--steps 300] [--json PATH]
    PYTHONPATH=src:. python benchmarks/gpu_zoo.py --device cpu --smoke   # the script's own check

About 6 minutes on one H100/H200-class GPU at 300 steps (7 runs of the bench model, 2 evaluations
each); the device needs spikeguard's core dependencies (numpy, rich) beside its torch.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import spikeguard as sg
from benchmarks.zoo_run import _loop
from spikeguard.sinks import read_metrics
from spikeguard.testing.detection import HARM_RATIO
from spikeguard.train.data import load_train_data
from spikeguard.train.faults import Injector

__all__ = ["main", "run_cell"]

CKPT_EVERY = 25
CELLS = (("clean", None, ("alert", "unguarded")),
         ("outlier", "outlier@{mid}", ("alert", "unguarded")),
         ("lr", "lr@{mid}:50:20", ("alert", "rollback", "unguarded")))


@torch.no_grad()
def _evaluate(model: sg.GPT, tokens: Any, device: torch.device, seq: int,
              batches: int = 8, batch_size: int = 8) -> float:
    """Mean held-out cross-entropy over fixed windows (the same for every cell and arm)."""
    was = model.training
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    total = 0.0
    for _ in range(batches):
        starts = torch.randint(0, len(tokens) - seq - 1, (batch_size,), generator=gen)
        w = torch.from_numpy(np.stack([np.asarray(tokens[s:s + seq + 1], dtype=np.int64)
                                       for s in starts.tolist()])).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            total += float(model.loss(model(w[:, :-1]), w[:, 1:]).ce)
    model.train(was)
    return total / batches


class _OnDevice:
    """The stream's batches, moved to ``device`` (the zoo's loop reads ``next(stream)``; the
    guard keeps the stream itself, to skip and resync it)."""

    def __init__(self, stream: Any, device: torch.device) -> None:
        self.stream, self.device = stream, device

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(self.stream)
        return x.to(self.device), y.to(self.device)


def run_cell(fault: str | None, arm: str, *, steps: int, device: torch.device, smoke: bool,
             seed: int = 0) -> dict[str, Any]:
    """One run: returns its held-out loss, the guard's actions and the wall time. On the CPU
    with one thread (the zoo's setting: the sum order, so the run, does not depend on the
    machine's core count)."""
    if device.type == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _run(fault, arm, steps=steps, device=device, smoke=smoke, seed=seed)
        finally:
            torch.set_num_threads(threads)
    return _run(fault, arm, steps=steps, device=device, smoke=smoke, seed=seed)


def _run(fault: str | None, arm: str, *, steps: int, device: torch.device, smoke: bool,
         seed: int) -> dict[str, Any]:
    data = load_train_data(corpus="pydoc", data=None, tokenizer="bytes", vocab_size=None)
    torch.manual_seed(seed)
    cfg = (sg.GPTConfig.tiny(vocab_size=data.vocab_size) if smoke
           else sg.GPTConfig.bench(vocab_size=data.vocab_size))
    model = sg.GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=device.type == "cuda")
    warmup = min(20, steps // 5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, sg.schedules.warmup_cosine(
        warmup_steps=warmup, total_steps=steps, min_ratio=0.1))
    stream = sg.TokenStream(data.train, batch_size=8, seq_len=cfg.seq_len, seed=seed)
    injector = Injector((fault,) if fault else (), rank=0, only_rank=None,
                        vocab_size=data.vocab_size, seed=seed)
    detector = sg.DetectorConfig.for_run(steps)
    config = (sg.GuardConfig(detector=detector, clip=1.0, respond=False) if arm == "unguarded"
              else sg.GuardConfig(detector=detector, clip=1.0, tier2=arm))
    out = Path(tempfile.mkdtemp(prefix="sg-gpu-zoo-"))
    guard = sg.Guard(model, optimizer, config=config, scheduler=scheduler, data=stream,
                     precision=sg.PrecisionPolicy(kind="bf16-mixed"),
                     checkpoints=sg.CheckpointManager(out / "checkpoints", every=CKPT_EVERY,
                                                      keep=3),
                     sinks=[sg.JsonlSink(out / "metrics.jsonl")],
                     extra_state={"faults": injector}, keep_on_rollback=("faults",))
    start = time.perf_counter()
    _, halted = _loop(guard, model, optimizer, _OnDevice(stream, device), injector, steps)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    records = read_metrics(out / "metrics.jsonl")
    shutil.rmtree(out, ignore_errors=True)
    tier2 = [r["step"] for r in records if int(r.get("tier") or 0) == 2]
    return {"fault": fault, "arm": arm, "halted": halted,
            "val_loss": None if halted else _evaluate(model, data.val, device, cfg.seq_len),
            "skips": [r["step"] for r in records if r.get("skipped")],
            "tier2": tier2, "rollbacks": guard.rollbacks, "wall_s": round(wall, 1)}


def _verdict(kind: str, arm: str, line: dict[str, Any], base: dict[str, Any],
             clean: float, at: int) -> str:
    if line["halted"] or line["val_loss"] is None:
        return "halted"
    vs = line["val_loss"] / base["val_loss"]
    # "no worse than unguarded" as the zoo and the matrix score it: within HARM_RATIO (1.005)
    if kind == "clean":
        ok = not line["tier2"] and not line["rollbacks"] and vs <= HARM_RATIO
    elif kind == "outlier":
        ok = at in line["skips"] and vs <= HARM_RATIO
    elif arm == "rollback":  # withheld before it was applied, or rolled back
        ok = line["val_loss"] <= 1.02 * clean
    else:
        ok = any(at <= s <= at + 10 for s in line["tier2"]) and vs <= HARM_RATIO
    return "met" if ok else "NOT met"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="the tiny GPT for 60 steps (any device)")
    p.add_argument("--json", metavar="PATH", help="also write every run's line here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_zoo: no CUDA device here; run it with --device cpu --smoke to check the script")
        return 0
    device = torch.device(args.device)
    steps = 60 if args.smoke else args.steps
    mid = steps // 2
    print(f"gpu_zoo: {'tiny' if args.smoke else 'bench'} GPT, {steps} steps, bf16-mixed, on "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else device}, "
          f"torch {torch.__version__}", flush=True)
    lines: list[dict[str, Any]] = []
    clean = math.nan
    print("| cell | arm | held-out loss | vs unguarded | skips | Tier 2 at | rollbacks | wall s | "
          "target |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, spec, arms in CELLS:
        fault = spec.format(mid=mid) if spec else None
        got = {arm: run_cell(fault, arm, steps=steps, device=device, smoke=args.smoke)
               for arm in arms}
        base = got["unguarded"]
        if kind == "clean":
            clean = base["val_loss"]
        for arm, line in got.items():
            line["cell"] = kind
            line["target"] = "-" if arm == "unguarded" else _verdict(kind, arm, line, base,
                                                                     clean, mid)
            lines.append(line)
            vs = (line["val_loss"] / base["val_loss"]) if line["val_loss"] else math.nan
            target = line["target"]
            print(f"| {kind} | {arm} | {line['val_loss'] or float('nan'):.4f} | {vs:.4f} | "
                  f"{line['skips'][:5]} | {line['tier2'][:3]} | {line['rollbacks']} | "
                  f"{line['wall_s']} | {target} |", flush=True)
    if device.type == "cuda":
        from benchmarks.gpu_check import guard_no_sync

        ok, detail = guard_no_sync(smoke=args.smoke)
        print(f"guard_no_sync: {'passed' if ok else 'FAILED'}: {detail}")
    if args.json:
        Path(args.json).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
