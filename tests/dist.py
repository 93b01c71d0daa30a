"""The one helper that runs a function on N real torch.distributed ranks (gloo, CPU).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo
process group through a TCPStore that this process hosts on a port the OS picks (bound before
any rank starts, so two test runs can never race for one port), calls ``fn(rank, world_size, *args)`` in each and returns
the per-rank results (picklable values) in rank order. A failure on any rank raises with that
rank's traceback. ``fn`` must be a module-level function so spawn can import it.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed"]


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    # the store's server lives here, on a port the OS assigns; the ranks connect as clients
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if not queue.empty():
            rank, ok, value = queue.get()
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
        elif time.monotonic() > deadline:
            errors.append(f"timed out after {timeout:.0f}s with ranks {sorted(results)} done")
            break
        elif any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
            codes = [p.exitcode for p in procs]
            errors.append(f"a rank died without a result (exit codes {codes})")
            break
        else:
            time.sleep(0.02)
    for p in procs:
        p.join(timeout=5 if not errors else 0.5)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
