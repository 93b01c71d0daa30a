"""Checkpoint costs on GPTConfig.bench() + AdamW: restore vs a plain dcp.load, async vs sync save.

    PYTHONPATH=src:. python benchmarks/bench_checkpoint.py [--smoke] [--runs 11] [--ranks 4] [--collector off]

Prints (1) the median time of CheckpointManager.restore (manifest, info, sidecar and metadata
read and hashed, allowlisted metadata, each shard mapped once and hashed while DCP's load plan
is served from it, set_state_dict, the JSON sidecar) over a plain ``dcp.load`` of the same
checkpoint into the same tensors, with ``torch.load`` of a ``torch.save`` file for scale (one
rank), and the bytes restore hashed per byte it read (entries of its load plan, whole small
files); (2) the time the training thread is held by a save with ``async_save=True`` (in save(),
which copies buffers and param_groups, plus the wait of the next step's optimizer.step() for
the writer thread's copy of the parameters and optimizer state, with a real training step
between them; the writer then hashes, writes and commits while "training" goes on) over a
synchronous save (write, hash as written, commit). Runs are interleaved (A, B, C, A, B, C, ...) so machine noise hits every
variant alike. With ``--ranks N`` (N > 1) the model is sharded with FSDP2 over N gloo
ranks on this machine (each rank writes and reads its own shard) and each run counts the
slowest rank. The time Python's cycle collector ran inside each arm is printed beside it: a
full collection walks every object of the process (0.1-0.2 s here) and falls in whichever arm
crosses its threshold; restore pauses the collector while it runs. ``--collector off`` measures
both arms with it off, as large jobs run (collecting by hand between steps).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

__all__ = ["main"]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _CollectorClock:
    """Seconds Python's cycle collector ran (gc.callbacks), to show where collections fall."""

    def __init__(self) -> None:
        self.total, self._start = 0.0, 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start

    def timed(self, fn, into: list) -> float:
        """_timed(fn); the collector's share of it is appended to ``into``."""
        before = self.total
        took = _timed(fn)
        into.append(self.total - before)
        return took


def _model(smoke: bool, device: str, world: int):
    from spikeguard import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny() if smoke else GPTConfig.bench()).to(device)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, device)
    return model, opt


def _step(model, opt, device: str) -> None:
    """One training step (batch 2 x 32): forward, backward, optimizer.step."""
    x = torch.randint(0, 256, (2, 33), device=device)
    model.loss(model(x[:, :-1]), x[:, 1:]).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _measure(rank: int, world: int, root: str, smoke: bool, runs: int, device: str,
             collector: bool = True) -> dict:
    """One rank's timings (seconds per run) and restore's I/O counts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from spikeguard import CheckpointManager
    from spikeguard.checkpoint import io as _ckpt_io

    warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
    torch.set_num_threads(1)
    if not collector:  # as large jobs run it (torchtitan's gc_freq, Megatron's --manual-gc)
        gc.collect()
        gc.disable()
    clock = _CollectorClock()
    model, opt = _model(smoke, device, world)
    out: dict = {"params": sum(p.numel() for p in model.parameters())}  # DTensor: global
    no_dist = world == 1
    sync = CheckpointManager(Path(root) / "sync", model=model, optimizer=opt, every=1, keep=2)
    path = sync.save(1)
    out["size"] = sum(p.stat().st_size for p in path.iterdir())
    tensors, _ = _ckpt_io.split(dict(zip(("model", "optim"), get_state_dict(model, opt))))
    plain_pt = Path(root) / "plain.pt"
    if world == 1:
        torch.save(tensors, plain_pt)
    out.update(restore=[], plain=[], tload=[], gc_restore=[], gc_plain=[])
    for _ in range(runs):
        out["restore"].append(clock.timed(lambda: sync.restore(),
                                          out["gc_restore"]))
        out["plain"].append(clock.timed(lambda: dcp.load(tensors, checkpoint_id=path,
                                                         no_dist=no_dist), out["gc_plain"]))
        if world == 1:
            out["tload"].append(_timed(lambda: torch.load(plain_pt, weights_only=True)))
    stats = sync.io_stats
    read = sum(n for name, n in stats.read.items() if name != "MANIFEST.json")
    out["hashed_per_byte"] = sum(stats.hashed.values()) / read
    out["hashed_mib"] = sum(stats.hashed.values()) / 2**20
    out["max_opens"] = max(stats.opened.values())

    asy = CheckpointManager(Path(root) / "async", model=model, optimizer=opt, every=1, keep=2,
                            async_save=True)
    out.update(block_sync=[], block_async=[], total_async=[], in_save=[], waited=[],
               step_plain=[], step_async=[])
    for i in range(runs + 1):  # the first async save allocates the staging buffers: dropped
        if i:
            out["block_sync"].append(_timed(lambda i=i: sync.save(10 + i)))
            out["step_plain"].append(_timed(lambda: _step(model, opt, device)))
        start = time.perf_counter()
        in_save = _timed(lambda i=i: asy.save(10 + i))
        # training goes on; its optimizer.step() waits for the copy
        step_async = _timed(lambda: _step(model, opt, device))
        waited = asy.staging.waited
        while not asy._pending.done():  # "training" until the background write is done
            time.sleep(0.002)
        if i:
            out["block_async"].append(in_save + waited)
            out["in_save"].append(in_save)
            out["waited"].append(waited)
            out["step_async"].append(step_async)
            out["total_async"].append(time.perf_counter() - start)
    asy.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 runs, for CI")
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--ranks", type=int, default=1, help="gloo ranks (FSDP2-sharded when > 1)")
    ap.add_argument("--device", default="cpu", help="cuda: async save blocks only for the copy")
    ap.add_argument("--collector", choices=("on", "off"), default="on",
                    help="Python's automatic cycle collection during the runs (off: as large "
                         "jobs run, collecting by hand)")
    args = ap.parse_args()
    collector = args.collector == "on"
    runs = 2 if args.smoke else args.runs
    with tempfile.TemporaryDirectory() as tmp:
        if args.ranks == 1:
            per_rank = [_measure(0, 1, tmp, args.smoke, runs, args.device, collector)]
        else:
            from tests.dist import run_distributed

            per_rank = run_distributed(_measure, args.ranks, tmp, args.smoke, runs, args.device,
                                       collector, timeout=3600)

    def med(key: str) -> float:  # per run the slowest rank, then the median over runs
        return statistics.median(max(r[key][i] for r in per_rank) for i in range(runs)) * 1e3

    first = per_rank[0]
    print(f"model {first['params'] / 1e6:.1f}M params, checkpoint {first['size'] / 2**20:.1f} MiB, "
          f"{args.ranks} rank(s), {runs} runs, cycle collector {args.collector}")
    r, p = med("restore"), med("plain")
    scale = f", torch.load {med('tload'):.1f} ms (scale)" if args.ranks == 1 else ""
    print(f"restore/dcp.load ratio {r / p:.3f} (target <= 1.3): restore {r:.1f} ms, "
          f"dcp.load {p:.1f} ms{scale}")
    print(f"  of which Python's cycle collector: restore {med('gc_restore'):.1f} ms, dcp.load "
          f"{med('gc_plain'):.1f} ms (median over runs of the slowest rank; restore pauses it)")
    hashed = max(x["hashed_per_byte"] for x in per_rank)
    opens = max(x["max_opens"] for x in per_rank)
    mib = ", ".join(f"{x['hashed_mib']:.1f}" for x in per_rank)
    print(f"restore hashed {hashed:.2f} bytes per byte it read, opened each file {opens}x "
          f"(worst rank); MiB hashed per rank: {mib}")
    a, s, t = med("block_async"), med("block_sync"), med("total_async")
    print(f"async/sync blocking ratio {a / s:.3f} (target <= 0.1): async save blocks {a:.1f} ms "
          f"(save() {med('in_save'):.1f} + the next optimizer.step waiting for the copy "
          f"{med('waited'):.1f}), sync save {s:.1f} ms (write + hash + commit), async until "
          f"committed {t:.1f} ms")
    print(f"the training step after an async save (the copy in flight) took {med('step_async'):.1f} "
          f"ms vs {med('step_plain'):.1f} ms after a sync save (its wait included)")


if __name__ == "__main__":
    main()
