"""Checkpoint costs on GPTConfig.bench(): restore vs a plain dcp.load, async vs sync save.

    PYTHONPATH=src:. python benchmarks/bench_checkpoint.py [--smoke] [--runs 11]

Prints (1) the median time of CheckpointManager.restore (manifest sha256 check, allowlisted
metadata, DCP load, set_state_dict, JSON sidecar) over a plain ``dcp.load`` of the same
checkpoint into the same tensors, with ``torch.load`` of a ``torch.save`` file for scale; and
(2) the time save() blocks the step with ``async_save=True`` over a synchronous save. Runs are
interleaved (A, B, C, A, B, C, ...) so machine noise hits every variant alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from spikeguard import GPT, CheckpointManager, GPTConfig
from spikeguard.respond import _ckpt_io

__all__ = ["main"]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _model(smoke: bool, device: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny() if smoke else GPTConfig.bench()).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 33), device=device)
    model.loss(model(x[:, :-1]), x[:, 1:]).loss.backward()
    opt.step()
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 runs")
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--device", default="cpu", help="cuda: async save blocks only for the copy")
    args = ap.parse_args()
    runs = 2 if args.smoke else args.runs
    warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
    torch.set_num_threads(1)
    model, opt = _model(args.smoke, args.device)
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sync = CheckpointManager(root / "sync", every=1, keep=2)
        path = sync.save(1, model=model, optimizer=opt)
        size = sum(p.stat().st_size for p in path.iterdir())
        tensors, _ = _ckpt_io.split(dict(zip(("model", "optim"), get_state_dict(model, opt))))
        torch.save(tensors, root / "plain.pt")
        restore, plain, tload = [], [], []
        for _ in range(runs):
            restore.append(_timed(lambda: sync.restore(model=model, optimizer=opt)))
            plain.append(_timed(lambda: dcp.load(tensors, checkpoint_id=path, no_dist=True)))
            tload.append(_timed(lambda: torch.load(root / "plain.pt", weights_only=True)))
        r, p, t = (statistics.median(v) * 1e3 for v in (restore, plain, tload))
        print(f"model {n_params / 1e6:.1f}M params, checkpoint {size / 2**20:.1f} MiB, {runs} runs")
        print(f"restore/dcp.load ratio {r / p:.2f} (target <= 2.0): restore {r:.1f} ms, "
              f"dcp.load {p:.1f} ms, torch.load {t:.1f} ms (scale)")

        asy = CheckpointManager(root / "async", every=1, keep=2, async_save=True)
        blocking_async, blocking_sync, total_async = [], [], []
        for i in range(runs):
            blocking_sync.append(_timed(lambda i=i: sync.save(2 + i, model=model, optimizer=opt)))
            start = time.perf_counter()
            asy.save(2 + i, model=model, optimizer=opt)
            blocking_async.append(time.perf_counter() - start)
            asy.wait()
            total_async.append(time.perf_counter() - start)
        a, s, ta = (statistics.median(v) * 1e3 for v in (blocking_async, blocking_sync, total_async))
        asy.close()
        print(f"async/sync blocking ratio {a / s:.3f} (target <= 0.2): async save blocks "
              f"{a:.1f} ms, sync save {s:.1f} ms, async until committed {ta:.1f} ms")


if __name__ == "__main__":
    main()
