"""spikeguard._dist: the device rule for each backend (pure), then the helpers on real gloo ranks.

NCCL cannot run here (no GPU): benchmarks/gpu_check.py runs the CUDA path on a one-rank NCCL
group; several NCCL ranks are untested.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from spikeguard import _dist
from tests.dist import run_distributed


@pytest.mark.parametrize(("backend", "preferred", "want"), [
    # NCCL reduces only CUDA tensors: a CPU vote goes to the GPU
    ("nccl", None, "cuda"), ("nccl", "cpu", "cuda"), ("nccl", "cuda", "cuda"),
    ("cuda:nccl", "cpu", "cuda"),  # what get_backend_config says for init_process_group("nccl")
    # gloo reduces CPU and CUDA tensors where they are
    ("gloo", None, "cpu"), ("gloo", "cpu", "cpu"), ("gloo", "cuda", "cuda"),
    ("cpu:gloo,cuda:gloo", "cuda", "cuda"),
    # mixed: each device to its own backend, no copies
    ("cpu:gloo,cuda:nccl", None, "cpu"), ("cpu:gloo,cuda:nccl", "cpu", "cpu"),
    ("cpu:gloo,cuda:nccl", "cuda", "cuda"), ("CPU:gloo, CUDA:nccl", "cuda", "cuda"),
    # CPU only: a CUDA tensor is reduced through the CPU
    ("cpu:gloo", "cuda", "cpu"),
    ("xccl", "cpu", "xpu"), ("ucc", "cpu", "cpu"), ("mpi", "cuda", "cuda"),
])
def test_collective_device_type_for_each_backend(backend, preferred, want):
    assert _dist.collective_device_type(backend, preferred) == want
    assert _dist.cpu_capable(backend) == ("cpu" in _dist.backend_devices(backend))


def test_backend_table_matches_torchs_own():
    # the fallback table must say what torch's Backend.backend_capability says
    for name, devices in dist.Backend.backend_capability.items():
        if name in _dist._CAPABILITY:
            assert set(_dist._CAPABILITY[name]) == set(devices), name
    assert _dist.backend_devices("undefined") == frozenset()
    assert _dist.collective_device_type("undefined", "cuda") == "cuda"
    assert _dist.collective_device_type("undefined") == "cpu"


def test_without_a_process_group_everything_is_local():
    assert not _dist.is_dist()
    t = torch.tensor([2.0])
    assert _dist.all_reduce(t, shortcut=False) is t and t.item() == 2.0
    assert _dist.all_true(True) and not _dist.all_true(False)
    assert _dist.gather_object({"x": 1}) == [{"x": 1}]
    assert _dist.collective_device() == torch.device("cpu")
    assert _dist.rank() == 0 and _dist.world_size() == 1 and _dist.new_cpu_group() is None
    _dist.barrier()


def _collectives(t: torch.Tensor, **kw) -> list[str]:
    """Names of the c10d collectives the profiler saw while all_reduce ran."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _dist.all_reduce(t, **kw)
    return [e.name for e in prof.events() if "all_reduce" in e.name or "allreduce" in e.name]


def test_default_backend_group_reduces_on_cpu():
    """init_process_group() without a backend reports the name "undefined"; its config is what
    decides: "cpu:gloo" on a CPU build keeps votes on the CPU. Where torch sees a GPU (the GPU
    machine's torch 2.11 makes the default config there CUDA alone), the vote goes to the GPU."""
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.get_backend() == "undefined"
        config = dist.get_backend_config()
        want = (torch.device("cpu") if "cpu" in config or not torch.cuda.is_available()
                else torch.device("cuda", torch.cuda.current_device()))
        assert _dist.collective_device() == want, config
        t = torch.tensor([5.0])
        assert _collectives(t, shortcut=True) == []
        assert _collectives(t, shortcut=False)  # the one-rank group really reduced
        assert t.item() == 5.0
        assert _dist.all_true(True) and not _dist.all_true(False)
        _dist.barrier()
    finally:
        dist.destroy_process_group()


def _on_ranks(rank: int, world_size: int, marker: str) -> dict:
    out: dict = {}
    x = torch.tensor([float(rank + 1)], dtype=torch.float64)
    y = _dist.all_reduce(x)
    out["sum"], out["in_place"] = y.item(), y is x
    out["max"] = _dist.all_reduce(torch.tensor([rank]), op=dist.ReduceOp.MAX).item()
    out["all_true"] = _dist.all_true(True)
    out["one_false"] = _dist.all_true(rank != 1)
    out["device"] = str(_dist.collective_device())
    # a one-rank group per rank (every rank creates every group, in the same order)
    singles = [dist.new_group([r]) for r in range(world_size)]
    mine = singles[rank]
    t = torch.tensor([10.0 + rank])
    out["single_shortcut"] = _collectives(t, group=mine, shortcut=True)
    out["single_reduced"] = bool(_collectives(t, group=mine, shortcut=False))
    out["single_value"] = t.item()
    # barrier: rank 0 writes the marker late; nobody passes the barrier before it exists
    if rank == 0:
        time.sleep(0.5)
        with open(marker, "w") as f:
            f.write("x")
    _dist.barrier()
    out["marker_seen"] = os.path.exists(marker)
    out["gathered"] = _dist.gather_object({"rank": rank, "sq": rank * rank})
    cpu = _dist.new_cpu_group()
    out["cpu_group"] = (dist.get_backend_config(cpu), _dist.world_size(cpu),
                        _dist.all_reduce(torch.tensor([1]), group=cpu).item())
    return out


@pytest.mark.dist
def test_helpers_on_three_gloo_ranks(tmp_path):
    world = 3
    results = run_distributed(_on_ranks, world, str(tmp_path / "marker"), timeout=180)
    for rank, r in enumerate(results):
        assert r["sum"] == 6.0 and r["in_place"] and r["max"] == 2
        assert r["all_true"] is True and r["one_false"] is False  # one rank's no is everyone's
        assert r["device"] == "cpu"
        assert r["single_shortcut"] == [] and r["single_reduced"] and r["single_value"] == 10 + rank
        assert r["marker_seen"]
        assert r["cpu_group"] == ("cpu:gloo,cuda:gloo", world, world)
    assert results[0]["gathered"] == [{"rank": r, "sq": r * r} for r in range(world)]
    assert results[1]["gathered"] is None and results[2]["gathered"] is None
