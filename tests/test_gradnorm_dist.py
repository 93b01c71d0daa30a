"""The global norm on real gloo ranks: DDP, FSDP2, HSDP, TP, FSDP+TP, pipeline, several meshes.

Every scenario runs inside one 2-rank job and one 4-rank job (module fixtures: spawning ranks is
the expensive part); each test asserts on what the ranks returned. References are computed on
every rank from an unsharded copy of the same model and the whole batch, in float64.
"""

import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import spikeguard as sg
from spikeguard.measure.gradnorm import nonfinite_params
from tests._gradnorm_common import (
    Toy,
    _full,
    _gather,
    _locals,
    _measure,
    _ones_norm,
    _reference,
    _sharded,
    _tp_plan,
    batch,
)
from tests._norm_scenarios import NORM_TYPES, pnorms, probes
from tests.dist import run_distributed
from tests.test_gradnorm import no_host_reads

pytestmark = pytest.mark.dist


def _ddp(rank: int, world: int) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, out, _ = _sharded(nn.parallel.DistributedDataParallel, slice(4 * rank, 4 * rank + 4))
        out["ones"] = _ones_norm(model)
    out["warnings"] = [str(w.message) for w in caught if "treated as replicated" in str(w.message)]
    return out


def _fsdp(rank: int, world: int) -> dict:
    model, out, clipped = _sharded(fully_shard, slice(4 * rank, 4 * rank + 4))
    calls = []  # the healthy path: a spy around the real all_reduce counts collectives
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        with no_host_reads():
            sg.grad_stats(model.parameters(), extras=torch.ones(1)).clip_(1e9)
    finally:
        dist.all_reduce = real
    out["all_reduces"] = calls
    out["shapes"] = [tuple(g.shape) for g in _locals(model)]
    snapshot = [g.clone() for g in _locals(model)]
    # the bug: clip each rank by the norm of its local shard
    wrong = (0.3 / (torch.nn.utils.get_total_norm(_locals(model)) + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(_locals(model), wrong)
    out["wrong_coef"] = _gather(wrong)
    out["wrong_err"] = max(float((_full(p.grad) - clipped[n]).abs().max())
                           for n, p in model.named_parameters())
    for g, s in zip(_locals(model), snapshot):
        g.copy_(s)
    stats = sg.grad_stats(model.parameters())
    out["coef"] = _gather(stats.clip_(0.3))
    out["ours_err"] = max(float((_full(p.grad) - clipped[n]).abs().max())
                          for n, p in model.named_parameters())
    # one NaN in one element of one shard (rank 1's head.weight shard)
    for g, s in zip(_locals(model), snapshot):
        g.copy_(s)
    if rank == 1:
        model.head.weight.grad.to_local()[0, 0] = float("nan")
    before = [g.clone() for g in _locals(model)]
    stats = sg.grad_stats(model.parameters())
    stats.clip_(0.3)
    out["nan"] = {"norm": _gather(stats.norm), "nonfinite": stats.nonfinite,
                  "nan_frac": stats.nan_frac, "names": nonfinite_params(model.named_parameters()),
                  "untouched": all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                                   for a, b in zip(before, _locals(model)))}
    # finite 1e20 gradients: flagged, untouched, exact_norm() right
    gen = torch.Generator().manual_seed(10 + rank)
    for g in _locals(model):
        g.copy_(torch.rand(g.shape, generator=gen) * 1e20)
    before = [g.clone() for g in _locals(model)]
    norm = sg.clip_grad_norm_(model.parameters(), 0.3)
    stats = sg.grad_stats(model.parameters())
    full = [_full(p.grad) for p in model.parameters()]
    out["big"] = {"norm": float(norm), "nonfinite": stats.nonfinite,
                  "exact": _gather(stats.exact_norm()),
                  "ref": math.sqrt(sum(float(f.square().sum()) for f in full)),
                  "untouched": all(torch.equal(a, b) for a, b in zip(before, _locals(model)))}
    out["ones"] = _ones_norm(model)
    return out


def _tp(rank: int, world: int) -> dict:
    model, out, _ = _sharded(lambda m: parallelize_module(m, init_device_mesh("cpu", (world,)),
                                                       _tp_plan()), slice(None))
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out["torch_error"] = ""
    except RuntimeError as e:
        out["torch_error"] = str(e)
    out["ones"] = _ones_norm(model)
    return out


def _several_meshes(rank: int, world: int) -> dict:
    def shard(m: nn.Module) -> None:
        parallelize_module(m, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
                           _tp_plan())
        fully_shard(m.head, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))

    model, out, _ = _sharded(shard, slice(None))
    out["ones"] = _ones_norm(model)
    return out


def _pipeline(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Toy()
    ref = _reference(model)
    x, y = batch()
    pp = dist.new_group([0, 1])
    if rank == 0:
        h = model.trunk(x)
        dist.send(h.detach(), 1)
        grad = torch.empty_like(h)
        dist.recv(grad, 1)
        h.backward(grad)
        params, loss = [*model.norm.parameters(), *model.up.parameters(),
                        *model.down.parameters()], torch.zeros(())
    else:
        h = torch.empty(x.shape[0], 8)
        dist.recv(h, 0)
        h.requires_grad_(True)
        loss = F.cross_entropy(model.head(h) * model.gain, y)
        loss.backward()
        dist.send(h.grad, 0)
        params, loss = [*model.head.parameters(), model.gain], loss.detach()
    model_view = nn.Module()
    model_view.params = nn.ParameterList(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the DDP test checks the warning
        out = _measure(model_view, ref, loss, pp_group=pp)
        out["ones"] = _ones_norm(model_view, pp_group=pp)
    return out


def _partial(rank: int, world: int) -> dict:
    """A Partial(sum) gradient: its norm is the norm of the sum, not of the summands."""
    mesh = init_device_mesh("cpu", (world,))
    p = nn.Parameter(distribute_tensor(torch.zeros(6), mesh, [Replicate()]))
    p.grad = DTensor.from_local(torch.arange(6.0) * (rank + 1), mesh, [Partial()])
    stats = sg.grad_stats([p])
    stats.clip_(1.0)
    summed = p.grad.full_tensor()
    return {"norm": float(stats.norm), "ref": float((torch.arange(6.0) * 3).norm()),
            "numel": stats.numel, "clipped": float(summed.norm())}


def _manual_tp(rank: int, world: int) -> dict:
    """Plain tensors sharded by hand over tp_group, plus a TP duplicate marked as such."""
    full = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    shard = nn.Parameter(torch.zeros(2, 3))
    shard.grad = full[2 * rank:2 * rank + 2].clone()
    dup = nn.Parameter(torch.zeros(3))
    dup.grad = torch.tensor([1.0, -2.0, 2.0])
    dup.tensor_model_parallel = False
    stats = sg.grad_stats([shard, dup], tp_group=dist.group.WORLD)
    return {"norm": _gather(stats.norm), "numel": stats.numel,
            "ref": math.sqrt(float(full.double().square().sum()) + 9.0)}


def _two_ranks(rank: int, world: int) -> dict:
    return {name: fn(rank, world) for name, fn in
            (("ddp", _ddp), ("fsdp", _fsdp), ("tp", _tp), ("meshes", _several_meshes),
             ("pp", _pipeline), ("partial", _partial), ("manual_tp", _manual_tp),
             ("norms", pnorms), ("probes", lambda r, w: probes(r, w, None)),
             ("probes_lag", lambda r, w: probes(r, w, 1)))}


def _four_ranks(rank: int, world: int) -> dict:
    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, out["hsdp"], _ = _sharded(lambda m: fully_shard(m, mesh=mesh),
                                  slice(2 * rank, 2 * rank + 2))
    out["hsdp"]["ones"] = _ones_norm(model)

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def fsdp_tp(m: nn.Module) -> None:
        parallelize_module(m, mesh2["tp"], _tp_plan())
        fully_shard(m, mesh=mesh2["dp"])

    dp = mesh2["dp"].get_local_rank()
    model, out["fsdp_tp"], _ = _sharded(fsdp_tp, slice(4 * dp, 4 * dp + 4))
    out["fsdp_tp"]["ones"] = _ones_norm(model)
    return out


@pytest.fixture(scope="module")
def two():
    return run_distributed(_two_ranks, 2)


@pytest.fixture(scope="module")
def four():
    return run_distributed(_four_ranks, 4)


def _check_exact(results: list[dict], world: int) -> None:
    """Bit-identical on every rank, 1e-6 from the single-process norm, sqrt(numel) for ones."""
    for r in results:
        assert len(r["norm"]) == world and len(set(r["norm"])) == 1, r["norm"]
        assert r["norm"][0] == pytest.approx(r["ref"], rel=1e-6)
        assert r["numel"] == Toy.NUMEL
        assert r["ones"] == float(torch.tensor(math.sqrt(Toy.NUMEL), dtype=torch.float32))
        if r["extras"] is not None:
            assert r["extras"] == pytest.approx(r["ref_loss"], rel=1e-6)


def test_ddp_two_ranks(two):
    _check_exact([r["ddp"] for r in two], 2)
    assert all(len(r["ddp"]["warnings"]) == 1 for r in two)  # warned once, not per call


def test_fsdp2_two_ranks_uneven_shards(two):
    _check_exact([r["fsdp"] for r in two], 2)
    assert [r["fsdp"]["shapes"][0] for r in two] == [(1,), (0,)]  # gain: one rank holds nothing
    assert [r["fsdp"]["shapes"][-1] for r in two] == [(3,), (2,)]  # head.bias: 5 rows over 2
    assert all(r["fsdp"]["all_reduces"] == [3] for r in two)  # one small all-reduce per step


def test_local_norm_clipping_is_the_bug(two):
    wrong, ours = two[0]["fsdp"]["wrong_coef"], two[0]["fsdp"]["coef"]
    assert wrong[0] < 1 and wrong[1] < 1 and abs(wrong[0] - wrong[1]) > 1e-3  # ranks disagree
    assert ours[0] == ours[1] < 1
    assert all(r["fsdp"]["wrong_err"] > 1e-3 for r in two)
    assert all(r["fsdp"]["ours_err"] < 1e-6 for r in two)


def test_one_nan_in_one_shard(two):
    for r in two:
        nan = r["fsdp"]["nan"]
        assert all(math.isnan(v) for v in nan["norm"])
        assert nan["nonfinite"] == 1 and nan["nan_frac"] == 1 / Toy.NUMEL
        assert nan["untouched"]
    assert [r["fsdp"]["nan"]["names"] for r in two] == [[], ["head.weight"]]  # the local shards


def test_finite_huge_grads_flagged_untouched_exact(two):
    for r in two:
        big = r["fsdp"]["big"]
        assert math.isinf(big["norm"]) and big["nonfinite"] == 0 and big["untouched"]
        assert big["exact"][0] == big["exact"][1] == pytest.approx(big["ref"], rel=1e-12)


def test_tensor_parallel_with_plain_layernorm(two):
    _check_exact([r["tp"] for r in two], 2)
    assert all("mixed torch.Tensor and DTensor" in r["tp"]["torch_error"] for r in two)


def test_several_meshes_in_one_model(two):
    _check_exact([r["meshes"] for r in two], 2)
    assert two[0]["meshes"]["meshes"] == 2
    assert len(two[0]["meshes"]["placements"]) == 3  # Shard(0), Shard(1), Shard(0) on dp


def test_pipeline_two_stages(two):
    _check_exact([r["pp"] for r in two], 2)


def test_partial_gradient_is_reduced_before_squaring(two):
    for r in two:
        p = r["partial"]
        assert p["norm"] == pytest.approx(p["ref"], rel=1e-6) and p["numel"] == 6
        assert p["clipped"] == pytest.approx(1.0, rel=1e-5)  # scaling the summands scales the sum


def test_manual_tp_group_sums_plain_shards(two):
    for r in two:
        m = r["manual_tp"]
        assert m["norm"][0] == m["norm"][1] == pytest.approx(m["ref"], rel=1e-6)
        assert m["numel"] == 12 + 3


@pytest.mark.slow
def test_hsdp_on_a_2x2_mesh(four):
    _check_exact([r["hsdp"] for r in four], 4)
    assert four[0]["hsdp"]["placements"] == ["(Replicate(), Shard(dim=0))"]


@pytest.mark.slow
def test_fsdp_plus_tp_on_a_2x2_mesh(four):
    _check_exact([r["fsdp_tp"] for r in four], 4)
    assert four[0]["fsdp_tp"]["meshes"] == 2  # 2-D (dp, tp) params and 1-D dp params


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
def test_every_norm_type_under_sharding_matches_torch_on_the_unsharded_grads(two, kind):
    for grads in ("plain", "shifted"):
        for p in NORM_TYPES:
            mine = [r["norms"][kind][grads][p] for r in two]
            assert mine[0]["norm"] == mine[1]["norm"] and len(set(mine[0]["norm"])) == 1, p
            assert mine[0]["norm"][0] == pytest.approx(mine[0]["ref"], rel=1e-5), (grads, p)
            assert all(m["err"] < 1e-5 for m in mine), (grads, p)  # clipped like torch's
    shifted = two[0]["norms"][kind]["shifted"]
    assert shifted[-math.inf]["norm"][0] > 0.009 and shifted[-1.0]["norm"][0] > 1e-5  # not 0
    assert two[0]["norms"][kind]["plain"][0.0]["norm"][0] == 9.0  # all 9 tensors hold a non-zero
    for p in NORM_TYPES:  # one NaN on rank 1: NaN where torch says NaN (p=0 counts it)
        nan = [r["norms"][kind]["nan"][p] for r in two]
        if math.isnan(nan[0]["ref"]):
            assert all(math.isnan(v) for m in nan for v in m["norm"]), p
        else:
            assert nan[0]["norm"] == nan[1]["norm"] == [nan[0]["ref"]] * 2, p


def test_layer_grad_norms_under_fsdp2_are_global_even_with_a_lagging_rank(two):
    for run in ("probes", "probes_lag"):
        r0, r1 = two[0][run], two[1][run]
        assert [bool(rec) for rec in r0["records"]] == [True, False, True]  # every 2 steps
        assert r0["records"] == r1["records"]  # the same floats on both ranks
        for step in (0, 2):
            rec, ref, local = r0["records"][step], r0["ref"][step], r0["local"][step]
            assert set(rec) == set(ref) and len(ref) == 5  # wte, wpe, blocks.0, blocks.1, ln_f
            for key in ref:
                assert rec[key] == pytest.approx(ref[key], rel=1e-5), key
            assert max(abs(local[k] / ref[k] - 1) for k in ref) > 0.05  # per-shard is wrong
    assert two[0]["probes"]["records"] == two[0]["probes_lag"]["records"]
