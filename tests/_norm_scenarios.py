"""Rank-side scenarios of tests/test_gradnorm_dist.py for the non-L2 norms of clip_grad_norm_
and the per-layer gradient norms of the probes (they run inside its 2-rank job)."""

import copy
import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import spikeguard as sg
from spikeguard.measure.probes import ProbeConfig, Probes
from tests._gradnorm_common import Toy, _full, _gather, _locals, _reference, _step, _tp_plan

NORM_TYPES = [1.0, 3.0, 0.5, math.inf, -math.inf, 0.0, -1.0]


def _torch_clip(grads: dict[str, torch.Tensor], max_norm: float, p: float) -> tuple[float, dict]:
    """torch's own clip_grad_norm_ on float64 copies of the unsharded gradients."""
    params = {}
    for name, g in grads.items():
        params[name] = nn.Parameter(torch.zeros_like(g))
        params[name].grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm, p)
    return float(norm), {n: q.grad for n, q in params.items()}


def _pnorm_checks(model: nn.Module, grads: dict[str, torch.Tensor]) -> dict:
    """For each norm type: every rank's norm, torch's on the unsharded float64 gradients, and
    the largest difference of the clipped full gradients from torch's clipped ones (relative);
    on the gradients as they are ("plain": ReLU leaves exact zeros, so -inf and p < 0 give 0)
    and on |g| + 0.01 ("shifted": no zeros)."""
    snapshot = [g.clone() for g in _locals(model)]
    out: dict = {"plain": {}, "shifted": {}}
    for kind, fn in (("plain", lambda t: t), ("shifted", lambda t: t.abs() + 0.01)):
        ref_grads = {n: fn(g) for n, g in grads.items()}
        for p in NORM_TYPES:
            ref_norm = float(torch.nn.utils.get_total_norm(list(ref_grads.values()), p))
            max_norm = 0.5 * ref_norm if 0 < ref_norm < math.inf else 1.0
            ref_norm, ref_clipped = _torch_clip(ref_grads, max_norm, p)
            for g, s in zip(_locals(model), snapshot):
                g.copy_(fn(s))
            norm = sg.clip_grad_norm_(model.parameters(), max_norm, p)
            err = max(float((_full(q.grad) - ref_clipped[n]).abs().max()
                            / ref_clipped[n].abs().max().clamp(min=1e-30))
                      for n, q in model.named_parameters())
            out[kind][p] = {"norm": _gather(norm), "ref": ref_norm, "err": err}
    # one NaN in one shard: every rank gets NaN for the norms torch gives NaN, and 0-norm's count
    for g, s in zip(_locals(model), snapshot):
        g.copy_(s)
    if dist.get_rank() == 1:
        model.down.weight.grad.to_local().view(-1)[0] = math.nan
    grads = {n: _full(q.grad) for n, q in model.named_parameters()}
    out["nan"] = {}
    for p in NORM_TYPES:
        norm = sg.clip_grad_norm_(model.parameters(), 1.0, p)
        out["nan"][p] = {"norm": _gather(norm),
                         "ref": float(torch.nn.utils.get_total_norm(list(grads.values()), p))}
    return out


def pnorms(rank: int, world: int) -> dict:
    """Every norm type torch supports, under FSDP2 (uneven shards, one empty) and under TP with
    plain replicated parameters beside DTensor ones."""
    torch.manual_seed(0)
    model = Toy()
    ref = _reference(model)
    fully_shard(model)
    _step(model, slice(4 * rank, 4 * rank + 4))
    out = {"fsdp": _pnorm_checks(model, ref["grads"])}
    torch.manual_seed(0)
    model = Toy()
    ref = _reference(model)
    parallelize_module(model, init_device_mesh("cpu", (world,)), _tp_plan())
    _step(model, slice(None))
    out["tp"] = _pnorm_checks(model, ref["grads"])
    return out


def _gpt_batch(step: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 256, (4, 17), generator=g)
    return idx[rows, :-1], idx[rows, 1:]


def probes(rank: int, world: int, lag_rank: int | None) -> dict:
    """Per-layer grad norms of a tiny GPT under FSDP2 (each block and the root sharded) for three
    steps with the probe every 2 steps; ``lag_rank`` sleeps before each probe step. The reference
    is a float64 unsharded copy on the whole batch; ``local`` is what each rank's shards alone
    give (the old, per-shard answer)."""
    torch.manual_seed(0)
    model = sg.GPT(sg.GPTConfig.tiny())
    ref = copy.deepcopy(model).double()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    probe = Probes(model, ProbeConfig(grad_norms_every=2, activation_max=False))
    rows = slice(2 * rank, 2 * rank + 2)
    out = {"records": [], "ref": [], "local": []}
    for step in range(3):
        model.zero_grad()
        ref.zero_grad()
        probe.start_step(step)
        x, y = _gpt_batch(step, rows)
        model.loss(model(x), y).loss.backward()
        if step % 2 == 0 and rank == lag_rank:
            time.sleep(1.0)
        out["records"].append({k: v for k, v in probe.collect().items()
                               if k.startswith("layer_grad_norm/")})
        x, y = _gpt_batch(step, slice(None))
        ref.loss(ref(x), y).loss.backward()
        sums: dict[str, float] = {}
        local: dict[str, float] = {}
        for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
            parts = name.split(".")  # blocks.<i>.* per block, else the top-level module
            key = "layer_grad_norm/" + (".".join(parts[:2]) if parts[0] == "blocks" else parts[0])
            sums[key] = sums.get(key, 0.0) + float(p.grad.square().sum())
            local[key] = local.get(key, 0.0) + float(q.grad.to_local().double().square().sum())
        out["ref"].append({k: math.sqrt(v) for k, v in sums.items()})
        out["local"].append({k: math.sqrt(v) for k, v in local.items()})
    probe.remove()
    return out
