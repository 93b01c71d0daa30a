import pytest
import torch
import torch.distributed as dist

from tests.dist import run_distributed


def _sum_ranks(rank: int, world_size: int, base: float) -> float:
    t = torch.tensor([base + rank], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def _boom(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    dist.barrier()


@pytest.mark.dist
def test_all_reduce_on_two_gloo_ranks():
    assert run_distributed(_sum_ranks, 2, 10.0) == [21.0, 21.0]


@pytest.mark.dist
def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RuntimeError, match="planted failure on rank 1"):
        run_distributed(_boom, 2, timeout=60)
