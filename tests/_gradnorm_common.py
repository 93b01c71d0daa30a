"""Shared by the gradient-norm tests: the Toy model, its batch, the float64 reference of an
unsharded copy, and the helpers that shard, step and measure it on gloo ranks."""

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spikeguard as sg


class Toy(nn.Module):
    """LayerNorm, an MLP (colwise/rowwise under TP), a head with an odd first dim (5) and a
    one-element gain (an empty shard on the second FSDP rank)."""

    NUMEL = 16 + (8 * 16 + 16) + (16 * 8 + 8) + (5 * 8 + 5) + 1

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 5)
        self.gain = nn.Parameter(torch.ones(1))

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return h + self.down(torch.relu(self.up(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x)) * self.gain


def batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def _reference(model: nn.Module, max_norm: float | None = None) -> dict:
    """Float64 norm (and clipped full grads) of an unsharded copy on the whole batch."""
    ref = copy.deepcopy(model)
    x, y = batch()
    loss = F.cross_entropy(ref(x), y)
    loss.backward()
    grads = {n: p.grad.double() for n, p in ref.named_parameters()}
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    out = {"norm": norm, "loss": loss.item(), "grads": grads}
    if max_norm is not None:
        out["clipped"] = {n: g * min(1.0, max_norm / (norm + 1e-6)) for n, g in grads.items()}
    return out


def _full(g: torch.Tensor) -> torch.Tensor:
    return (g.full_tensor() if isinstance(g, DTensor) else g).double()


def _locals(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in model.parameters() if p.grad is not None]


def _gather(value: torch.Tensor) -> list[float]:
    """all_gather a 0-dim tensor; exact floats in rank order."""
    out = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(out, value.contiguous())
    return [float(v) for v in out]


def _step(model: nn.Module, rows: slice) -> torch.Tensor:
    x, y = batch()
    loss = F.cross_entropy(model(x[rows]), y[rows])
    loss.backward()
    return loss.detach()


def _ones_norm(model: nn.Module, **kw) -> float:
    for g in _locals(model):
        g.fill_(1.0)
    return float(sg.grad_stats(model.parameters(), **kw).norm)


def _measure(model: nn.Module, ref: dict, loss: torch.Tensor | None = None, **kw) -> dict:
    stats = sg.grad_stats(model.parameters(), extras=None if loss is None else loss.reshape(1),
                          **kw)
    return {"norm": _gather(stats.norm), "ref": ref["norm"], "numel": stats.numel,
            "extras": None if loss is None else float(stats.extras[0]), "ref_loss": ref["loss"]}


def _sharded(shard, rows: slice, **kw) -> tuple[nn.Module, dict, dict]:
    """Seeded Toy, its reference, ``shard(model)`` (may return a wrapper to run), one step on
    ``rows``, measured; also the reference's full grads clipped at 0.3."""
    torch.manual_seed(0)
    model = Toy()
    ref = _reference(model, max_norm=0.3)
    out = _measure(model, ref, _step(shard(model) or model, rows), **kw)
    out["placements"] = sorted({str(p.placements) for p in model.parameters()
                                if hasattr(p, "placements")})
    out["meshes"] = len({(p.device_mesh.mesh.tolist().__repr__(), p.device_mesh.mesh_dim_names)
                         for p in model.parameters() if hasattr(p, "device_mesh")})
    return model, out, ref["clipped"]


def _tp_plan() -> dict:
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}
