"""Kill-and-resume job for the token stream under torchrun: N gloo ranks x 2 DataLoader workers.

The job (``python -m torch.distributed.run --standalone --nproc-per-node N -m
tests._data_dist_job OUT ...``) trains the tiny reference GPT, sharded with FSDP2, on
``TokenStream.from_corpus`` built without rank or world size (both from torch.distributed) and
iterated through ``stream.loader(num_workers=2)``. Step s (from 0) consumes the s-th batch; the
checkpoint at step s holds the state after update s. Rank 0 logs one metrics record per step to
``OUT/metrics.jsonl``; every rank logs the batch it trained on (index, worker, digest) to
``OUT/batches-rank{rank}.jsonl``. With ``--hold-at H`` every rank takes batch H from the loader,
writes ``OUT/held-rank{rank}.json`` and waits to be killed; ``--resume`` restores the newest
checkpoint and goes on.

:func:`kill_and_resume` runs the job, SIGKILLs its whole process group (agent, ranks and
DataLoader workers) once every rank holds, reruns it with ``--resume`` and returns what
:func:`check` needs; :func:`check` raises AssertionError on any broken promise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["check", "kill_and_resume"]

ROOT = Path(__file__).resolve().parents[1]
STREAM = dict(batch_size=2, seq_len=64, seed=11)
WORKERS = 2


def digest(x: Any) -> str:
    return hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]


def _consistency_errors(TokenStream: Any, rank: int, world: int) -> list[str]:
    """The messages of a half-given rank, another rank's rank and a world size that does not
    divide the world's (each must raise)."""
    out = []
    for kwargs in ({"rank": rank}, {"rank": (rank + 1) % world, "world_size": world},
                   {"rank": 0, "world_size": world + 1}):
        try:
            TokenStream.from_corpus("pydoc", **STREAM, **kwargs)
        except ValueError as e:
            out.append(str(e))
    return out


def _job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from spikeguard import GPT, GPTConfig, clip_grad_norm_
    from spikeguard.checkpoint.manager import CheckpointManager
    from spikeguard.data import TokenStream
    from spikeguard.record import StepMetrics, metrics_record
    from spikeguard.sinks import JsonlSink

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    data = TokenStream.from_corpus("pydoc", **STREAM)  # rank and world from torch.distributed
    errors = _consistency_errors(TokenStream, rank, world)
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = data.loader(num_workers=WORKERS, prefetch_factor=4)
    mgr = CheckpointManager(out / "ckpt", model=model, optimizer=opt, data=loader,
                            every=args.every, keep=2)
    metrics = JsonlSink(out / "metrics.jsonl")
    batches = JsonlSink(out / "batches-rank{rank}.jsonl", rank=None)
    start = 0
    if args.resume:
        start = mgr.restore().step + 1
    for step in range(start, args.steps):
        x, y = next(loader)
        seen = {"step": step, "index": data.position - 1, "worker": loader.last_worker,
                "digest": digest(x), "run": 2 if args.resume else 1,
                "rank": data.rank, "world_size": data.world_size, "refused": len(errors)}
        if step == args.hold_at:
            (out / f"held-rank{rank}.json").write_text(json.dumps(seen))
            # killed here, with the workers' prefetched batches unconsumed; torchrun may start
            # the ranks in a session of their own, out of the test's kill, so a rank whose agent
            # died leaves by itself (its DataLoader workers follow their parent out)
            agent = os.getppid()
            while os.getppid() == agent:
                time.sleep(0.2)
            os._exit(1)
        loss = model.loss(model(x), y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        metrics.log(metrics_record(StepMetrics(step=step, loss=float(mean) / world,
                                               grad_norm=float(norm))), step)
        batches.log(seen, step)
        mgr.maybe_save(step)
    loader.close()
    metrics.close()
    batches.close()
    dist.destroy_process_group()


def _launch(out: Path, world: int, steps: int, every: int, extra: list[str],
            env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "-m", "tests._data_dist_job", str(out),
           f"--steps={steps}", f"--every={every}", *extra]
    with open(out / f"torchrun{'-resume' if extra == ['--resume'] else ''}.log", "w") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def kill_and_resume(out: Path, *, world: int = 2, steps: int = 8, every: int = 3,
                    hold_at: int = 5, timeout: float = 240.0) -> dict[str, Any]:
    """Run the job, SIGKILL it while every rank holds batch ``hold_at``, resume it to the end.
    Returns the files' contents for :func:`check`."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    job = _launch(out, world, steps, every, [f"--hold-at={hold_at}"], env)
    held = [out / f"held-rank{r}.json" for r in range(world)]
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in held):
        if job.poll() is not None or time.monotonic() > deadline:
            os.killpg(job.pid, signal.SIGKILL)
            raise RuntimeError(f"the job ended or stalled before holding (exit {job.poll()}):\n"
                               + (out / "torchrun.log").read_text()[-3000:])
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)  # the agent, every rank and every DataLoader worker
    killed = job.wait()
    resumed = _launch(out, world, steps, every, ["--resume"], env)
    try:
        code = resumed.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(resumed.pid, signal.SIGKILL)
        raise
    if code != 0:
        raise RuntimeError(f"the resumed job failed (exit {code}):\n"
                           + (out / "torchrun-resume.log").read_text()[-3000:])
    from spikeguard.sinks import read_metrics

    return {"world": world, "steps": steps, "every": every, "hold_at": hold_at,
            "killed": killed, "held": [json.loads(p.read_text()) for p in held],
            "metrics": read_metrics(out / "metrics.jsonl"),
            "batches": [[json.loads(line) for line in
                         (out / f"batches-rank{r}.jsonl").read_text().splitlines()]
                        for r in range(world)]}


def check(res: dict[str, Any]) -> dict[str, Any]:
    """Every promise of the run, as assertions; returns a short summary."""
    from spikeguard.data import TokenStream

    world, steps, hold, every = res["world"], res["steps"], res["hold_at"], res["every"]
    ckpt = (hold - 1) // every * every  # the newest checkpoint before the kill
    assert res["killed"] == -signal.SIGKILL, res["killed"]
    pairs: dict[tuple[int, int], set[str]] = {}
    for rank, rows in enumerate(res["batches"]):
        ref = TokenStream.from_corpus("pydoc", **STREAM, rank=rank, world_size=world)
        run1 = [r for r in rows if r["run"] == 1]
        run2 = [r for r in rows if r["run"] == 2]
        assert all(r["rank"] == rank and r["world_size"] == world for r in rows)
        assert all(r["refused"] == 3 for r in rows)  # half-given and inconsistent rank/world
        # every batch is the stream's own batch `step` of this rank, from the expected worker
        assert [r["step"] for r in run1] == list(range(hold)), run1
        assert [r["step"] for r in run2] == list(range(ckpt + 1, steps)), run2
        held = res["held"][rank]
        for run, first in ((run1, 0), (run2, ckpt + 1)):
            for r in run:
                assert r["index"] == r["step"]
                assert r["digest"] == digest(ref.batch(r["index"])[0])
                assert r["worker"] == (r["step"] - first) % WORKERS
        assert held["index"] == hold and held["digest"] == digest(ref.batch(hold)[0])
        for r in run1:
            pairs.setdefault((rank, r["worker"]), set()).add(r["digest"])
        assert len({r["digest"] for r in run1}) == len(run1)
    # every (rank, worker) pair saw batches no other pair saw
    groups = list(pairs.values())
    assert len(groups) == world * WORKERS
    assert sum(map(len, groups)) == len(set().union(*groups))
    # one metrics.jsonl: one line per step and run, from rank 0 only
    m = res["metrics"]
    assert [r["step"] for r in m] == list(range(hold)) + list(range(ckpt + 1, steps)), m
    redo = {r["step"]: r["loss"] for r in m[hold:]}
    # the steps redone after the resume saw the same state and batches: the same mean loss
    assert all(redo[r["step"]] == r["loss"] for r in m[ckpt + 1: hold]), m
    return {"world": world, "workers": WORKERS, "steps": steps, "checkpoint": ckpt,
            "killed_at": hold, "resumed_at": ckpt + 1, "metrics_lines": len(m)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--hold-at", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    _job(ap.parse_args())


if __name__ == "__main__":
    main()
