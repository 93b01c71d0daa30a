"""A guarded run with checkpoints and a metrics file that resumes from its directory, for the
checkpoint faults (a kill inside a save, a full disk during one).

python -m tests.faults._ckpt_run OUT [--steps 30] [--every 10] [--async] [--on-error raise|warn]
                                     [--fsize BYTES --fsize-after STEP]

The reference GPT (GPTConfig.tiny()) trains on the Python docs corpus through the Guard, saving
every ``--every`` steps into OUT/ckpt (keep 3) and writing OUT/metrics.jsonl. When OUT/ckpt holds a
checkpoint the run resumes from it and cuts the metrics file back to the records it holds (as
``spikeguard train`` does); otherwise it starts the metrics over. ``--fsize`` sets RLIMIT_FSIZE
to BYTES after step ``--fsize-after`` (SIGXFSZ ignored: a write past it fails with EFBIG, as on a
full disk). At the end the weights and optimizer state go to OUT/final.pt (the limit lifted first).
SPIKEGUARD_TEST_CRASH kills the process at a point of a save (spikeguard._crash).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import spikeguard as sg
from spikeguard.checkpoint import CheckpointError

__all__ = ["run"]


def _cut(path: Path, keep: int) -> None:
    if path.exists():
        lines = path.read_bytes().splitlines(keepends=True)[:keep]
        path.write_bytes(b"".join(line if line.endswith(b"\n") else line + b"\n" for line in lines))


def run(out: Path, *, steps: int = 30, every: int = 10, async_save: bool = False,
        on_error: str = "raise", fsize: int | None = None, fsize_after: int = 0) -> int:
    """The run; returns the guard's step index at the end (``steps`` when it finished)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        cfg = sg.GPTConfig.tiny()
        model = sg.GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, sg.schedules.warmup_cosine(warmup_steps=5, total_steps=steps, min_ratio=0.1))
        data = sg.TokenStream.from_corpus("pydoc", batch_size=4, seq_len=cfg.seq_len, seed=0)
        mgr = sg.CheckpointManager(out / "ckpt", every=every, keep=3, async_save=async_save,
                                   on_error=on_error)
        metrics = out / "metrics.jsonl"
        guard = sg.Guard(model, opt, scheduler=sched, data=data, checkpoints=mgr,
                         sinks=[sg.JsonlSink(metrics)],
                         config=sg.GuardConfig(detector=sg.DetectorConfig.for_run(steps),
                                               read_lag=0))
        if mgr.list():
            info = guard.resume()
            _cut(metrics, guard.records)
            print(f"resumed from the checkpoint at step {info.step}", flush=True)
        else:
            metrics.unlink(missing_ok=True)
        try:
            while guard.step_index < steps:
                if fsize is not None and guard.step_index == fsize_after + 1:
                    mgr.wait()  # the save at fsize_after is complete (async: written behind)
                    _limit(fsize)
                x, y = next(data)
                o = model.loss(model(x), y)
                o.loss.backward()
                guard.step(o)
        finally:
            guard.close()
            mgr.close()
        if fsize is not None:
            _limit(None)
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, out / "final.pt")
        return guard.step_index
    finally:
        torch.set_num_threads(threads)


def _limit(fsize: int | None) -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if fsize is None else fsize, hard))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--on-error", default="raise")
    p.add_argument("--fsize", type=int)
    p.add_argument("--fsize-after", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    try:
        run(a.out, steps=a.steps, every=a.every, async_save=a.async_save, on_error=a.on_error,
            fsize=a.fsize, fsize_after=a.fsize_after)
    except CheckpointError as e:
        print(f"CheckpointError: {e}", file=sys.stderr)
        sys.exit(4)
