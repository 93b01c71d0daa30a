"""Early-warning signals: update ratio, gradient-spike share, an attention-logit bound.

Three numbers that published large runs watch before a loss spike, each recorded every
``*_every`` steps (``SignalConfig``), on the device, with no host read of its own (the values
ride in the guard's read-back vector, like the probes'):

- ``update_ratio/<layer>``: RMS of the update the optimizer applied at this step over RMS of
  the weights before it, per layer group (``blocks.i``, ``wte``, ...), and ``update_ratio``,
  the largest. Taken from the weights themselves (a copy before ``optimizer.step()``, the
  difference after), so it holds for any optimizer and includes weight decay; a skipped step
  reads 0 (nothing was applied). Marin's 32B retrospective saw the Adam update norm rise about
  2x before the gradient norm and the loss did. Read every step from a strided sample (below).
- ``spike_share``: the share of gradient elements whose square exceeds ``spike_k`` (5,000) times
  the optimizer's second moment from the step before (``exp_avg_sq``, Adam's), SPAM's test
  (Huang et al., 2025). Measured on the gradient the optimizer takes (after clipping), in the
  optimizer's step pre-hook; elements without a second moment yet do not count. From the same
  sample.
- ``attn_logit_bound``: an upper bound on every attention logit of the next forward, from the
  weights alone (no attention pass), with its layer and the [layer][head] table
  (``measure/logit_bound.py`` derives it). With ``qk_clip`` set, QK-Clip (Kimi K2,
  ``prevent/qk_clip.py``) rescales the query and key weights of each head whose bound passes it
  after every update (an all-reduce a step), so the bound holds after each step.

The sample (``sample_stride``): blocks of 16 consecutive elements (a cache line of float32),
one block in every ``s`` along the flat index of the whole (unsharded) tensor, the tensor's
stride ``s`` lowered for small tensors and chosen so that the blocks' starts cross every column;
each tensor's sums are scaled by its stride. It is the same elements under any sharding, so a
sharded reading equals one process's; at stride 1 it is every element and the readings are
exact. Blocks, not single elements: a strided copy of one element in 61 reads a cache line for
each, and cost 2.7x as much for the same count.

Sharding (FSDP2, HSDP, TP through DTensor placements; plain tensors count as replicated, DDP):
each rank sums its local pieces weighted by how many ranks hold a copy (``_grad_layout``), and
the per-head row sums of ``qkv.weight`` are placed at their global rows; ONE all-reduce of one
float64 vector per signal step then gives every rank the same numbers. Per-tensor sums run in
float32 (float64 for float64 tensors) and combine in float64. Every rank must reach the signal
steps alike (they follow the step index).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._dist import collective_device, world_size
from .._validate import check_int, check_positive
from ..prevent.qk_clip import QKClipConfig
from ._grad_layout import tensor_norms
from .logit_bound import attention_blocks, bound_parts, bounds, local_piece, qk_clip_

__all__ = ["SignalConfig", "SignalValues", "Signals", "layer_of"]

_F64 = torch.float64


@dataclass(kw_only=True, frozen=True)
class SignalConfig(QKClipConfig):
    """Which early-warning signals are recorded, and how often (docs/design.md, "Signals"), and
    QK-Clip on the logit bound (``qk_clip``: its field, default and check are
    ``prevent.qk_clip.QKClipConfig``'s, which this config extends)."""

    update_ratio_every: int = 1
    """Steps between update-ratio readings (0: off). A reading copies the sampled weights once."""
    sample_stride: int = 64
    """The update ratio and the spike share read one element in this many of each tensor (a
    tensor keeps at least 1,024; 1: every element, exact)."""
    spike_share_every: int = 10
    """Steps between spike-share readings (0: off). A reading reads every gradient and second
    moment once."""
    spike_k: float = 5000.0
    """A gradient element is a spike when g^2 > spike_k x its second moment (SPAM's 5,000)."""
    logit_bound_every: int = 10
    """Steps between attention-logit bound readings (0: off); reads only the attention weights."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("update_ratio_every", "spike_share_every", "logit_bound_every"):
            check_int(getattr(self, name), f"SignalConfig.{name}", minimum=0,
                      default=getattr(type(self), name))
        check_int(self.sample_stride, "SignalConfig.sample_stride", minimum=1, default=64)
        check_positive(self.spike_k, "SignalConfig.spike_k", default=5000.0)


_MIN_SAMPLE = 1024
"""The sample keeps at least this many elements of a tensor (all of a smaller one)."""
BLOCK = 16
"""Consecutive elements per sampled block."""


def sample_stride(shape: tuple[int, ...], stride: int) -> int:
    """The stride of ``shape``'s sample (module docstring): at most ``stride``, at least
    ``_MIN_SAMPLE`` elements kept, and the period ``s x BLOCK`` sharing at most ``BLOCK`` with
    the last dim, so that the blocks' starts cross every column (a period that divides the row
    length would sample the same columns of every row)."""
    n, last = math.prod(shape), shape[-1] if shape else 1
    s = max(1, min(stride, n // _MIN_SAMPLE))
    while s > 1 and math.gcd(s * BLOCK, last) > BLOCK:
        s -= 1
    return s


def _sampler(p: torch.Tensor, local: torch.Tensor, stride: int) -> tuple[int, torch.Tensor | None]:
    """(stride, local flat indices) of the sampled elements of ``local``, ``p``'s local piece:
    blocks of BLOCK starting at multiples of stride x BLOCK in the whole of ``p``, up to its last
    whole period. None: a plain tensor (its sample is a view, ``_take``) or stride 1 (all)."""
    from torch.distributed.tensor import DTensor

    s = sample_stride(tuple(p.shape), stride)
    if s == 1 or not isinstance(p, DTensor):
        return s, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    period = s * BLOCK
    starts = torch.arange(0, p.numel() // period * period, period, device=local.device)
    rem = (starts[:, None] + torch.arange(BLOCK, device=local.device)).reshape(-1)
    flat = torch.zeros_like(rem)
    inside = torch.ones_like(rem, dtype=torch.bool)
    size = 1
    for d in reversed(range(p.dim())):  # the global index's coordinates, inside this piece?
        rel = rem % p.shape[d] - offset[d]
        rem = rem // p.shape[d]
        inside &= (rel >= 0) & (rel < shape[d])
        flat += rel * size
        size *= shape[d]
    return s, flat[inside]


def _take(t: torch.Tensor, how: tuple[int, torch.Tensor | None]) -> torch.Tensor:
    """The sample of ``t`` (a local piece): a view of a plain tensor's blocks, a gather of a
    DTensor piece's, or all of it at stride 1."""
    stride, index = how
    flat = t.reshape(-1)
    if index is not None:
        return flat.index_select(0, index)
    if stride == 1:
        return flat
    period = stride * BLOCK
    return flat[: flat.numel() // period * period].view(-1, stride, BLOCK)[:, 0, :]


def layer_of(name: str) -> str:
    """The block a parameter belongs to: the path up to its first numeric part, so the groups
    follow the model's stack of blocks whatever it is called (``blocks.3`` here,
    ``model.layers.3`` in an HF causal LM, ``transformer.h.3`` in GPT-2, behind any wrapper's
    prefix such as DDP's ``module.``); a parameter outside the blocks groups by its module's
    first two parts (``wte``, ``model.embed_tokens``, ``lm_head``)::

        'blocks.3.attn.qkv.weight' -> 'blocks.3'; 'wte.weight' -> 'wte'
        'model.layers.3.mlp.experts.7.w1' -> 'model.layers.3'; 'model.norm.weight' -> 'model.norm'
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1][:2]) if len(parts) > 1 else name


@dataclass
class SignalValues:
    """The signals of one step on their way to the host: ``vector`` (device) and the names that
    ``decode`` gives its numbers."""

    vector: torch.Tensor | None
    groups: list[str]
    spike: bool
    heads: tuple[int, int] | None

    @property
    def size(self) -> int:
        """How many numbers ``vector`` holds (they sit at the end of the probes' vector)."""
        return (len(self.groups) + int(self.spike)
                + (self.heads[0] * self.heads[1] if self.heads else 0))

    def decode(self, values: list[float]) -> dict[str, Any]:
        """The record entries from ``vector``'s values read on the host."""
        rec: dict[str, Any] = {}
        values = list(values)
        if self.groups:
            ratios = [values.pop(0) for _ in self.groups]
            rec["update_ratio"] = max(ratios)
            rec.update({f"update_ratio/{g}": r for g, r in zip(self.groups, ratios)})
        if self.spike:
            rec["spike_share"] = values.pop(0)
        if self.heads is not None:
            n_layers, n_heads = self.heads
            table = [[values.pop(0) for _ in range(n_heads)] for _ in range(n_layers)]
            best = max(range(n_layers), key=lambda i: max(table[i]))
            rec["attn_logit_bound"] = max(table[best])
            rec["attn_logit_bound_layer"] = best
            rec["attn_logit_bound_heads"] = table
        return rec


class Signals:
    """The signals of ``model`` trained by ``optimizer`` (hooks on its step). Call
    :meth:`start_step` before each step's forward and :meth:`gather` after its optimizer step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 config: SignalConfig | None = None) -> None:
        self.config = cfg = config or SignalConfig()
        self.model, self.optimizer = model, optimizer
        self.named = [(n, p) for n, p in model.named_parameters()]
        groups: dict[str, list[int]] = defaultdict(list)
        for i, (name, _) in enumerate(self.named):
            groups[layer_of(name)].append(i)
        self.groups = dict(groups)
        self.blocks = attention_blocks(model, bound=cfg.logit_bound_every > 0,
                                       qk_clip=cfg.qk_clip is not None)
        self._step = 0
        self._snapshot: list[torch.Tensor] | None = None
        self._update: torch.Tensor | None = None
        self._spike: torch.Tensor | None = None
        self._copies: torch.Tensor | None = None
        self._samples: list[tuple[int, torch.Tensor | None]] | None = None
        self._weight: list[float] = []
        """Each tensor's stride over its copy count: what its sampled sums are scaled by."""
        self._weights: torch.Tensor | None = None
        self._group_index: torch.Tensor | None = None
        self._order: torch.Tensor | None = None
        self._hooks = []
        self.paused = False
        """True while a re-run's update is applied (Probes.quiet): the step's readings stay."""
        if optimizer is not None and (cfg.update_ratio_every or cfg.spike_share_every
                                      or cfg.qk_clip is not None):
            self._hooks = [optimizer.register_step_pre_hook(self._pre),
                           optimizer.register_step_post_hook(self._post)]

    @staticmethod
    def _due(step: int, every: int) -> bool:
        return every > 0 and step % every == 0

    def start_step(self, step: int) -> None:
        """Arm the signals due at ``step``."""
        self._step = step
        self._snapshot = self._update = self._spike = None

    def steps_after_read(self) -> None:
        """The optimizer steps after the step's numbers are read (``guard.decide()``: the
        framework steps it itself), so the update ratio and the spike share, taken around that
        step, cannot ride in its read: they are not recorded at all, rather than recorded as 0.
        The logit bound (the weights alone) stays, and so does QK-Clip after each update."""
        if self.optimizer is None:
            return
        keep = self._hooks[1:] if self.config.qk_clip is not None else []
        for h in self._hooks:
            if h not in keep:
                h.remove()
        self._hooks, self.optimizer = keep, None
        self._snapshot = self._update = self._spike = None

    def remove(self) -> None:
        """Detach the optimizer hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- around optimizer.step() ---------------------------------------------------------------
    @torch.no_grad()
    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.paused:
            return
        world = world_size()
        if self._due(self._step, self.config.spike_share_every):
            self._spike = self.spike_counts(world)
        if self._due(self._step, self.config.update_ratio_every):
            self._snapshot = torch._foreach_mul(self._sampled_weights(world), 1.0)  # copies

    def _sample_plan(self, world: int) -> list[tuple[int, torch.Tensor | None]]:
        """Each parameter's sample (module docstring), made on first use."""
        if self._samples is None:
            pieces, copies = self._locals(world)
            self._samples = [_sampler(p.detach(), t, self.config.sample_stride)
                             for (_, p), t in zip(self.named, pieces)]
            self._weight = [s / c for (s, _), c in zip(self._samples, copies.tolist())]
        return self._samples

    def _sampled_weights(self, world: int) -> list[torch.Tensor]:
        """Every parameter's sampled weights (views where they can be)."""
        plan, pieces = self._sample_plan(world), self._locals(world)[0]
        return [_take(t, how) for t, how in zip(pieces, plan)]

    def _locals(self, world: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Every parameter's local piece, and their copy counts (float64, on the device)."""
        pieces = [local_piece(p.detach(), world) for _, p in self.named]
        if self._copies is None:
            self._copies = torch.tensor([c for _, c, _ in pieces], dtype=_F64,
                                        device=self._device())
        return [t for t, _, _ in pieces], self._copies

    @torch.no_grad()
    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.config.qk_clip is not None and self.blocks:  # after every applied update
            qk_clip_(self.blocks, self.config.qk_clip, self._device())
        if self._snapshot is None or self.paused:
            return
        dev, n = self._device(), len(self.groups)
        now = self._sampled_weights(world_size())
        moved = tensor_norms(torch._foreach_sub(now, self._snapshot), dev).to(_F64)
        before = tensor_norms(self._snapshot, dev).to(_F64)
        if self._group_index is None:
            self._group_index = torch.tensor([j for j, idx in enumerate(self.groups.values())
                                              for _ in idx], device=dev)
            self._order = torch.tensor([i for idx in self.groups.values() for i in idx],
                                       device=dev)
            self._weights = torch.tensor(self._weight, dtype=_F64, device=dev)
        w = self._weights
        sums = torch.zeros(2 * n, dtype=_F64, device=dev)
        sums.index_add_(0, self._group_index, (moved.square() * w)[self._order])
        sums.index_add_(0, self._group_index + n, (before.square() * w)[self._order])
        self._update, self._snapshot = sums, None

    def spike_counts(self, world: int) -> torch.Tensor:
        """This rank's share of [elements with g^2 > spike_k v, elements with a second moment]
        over the sample, each tensor's counts times its stride, float64 on the device; g the
        local gradient, v the optimizer's ``exp_avg_sq`` (a few foreach kernels:
        ``max(g^2 - k v, 0)``, then its count of non-zeros)."""
        dev = self._device()
        state = self.optimizer.state if self.optimizer is not None else {}
        plan = self._sample_plan(world)
        gs, vs, weights = [], [], []
        for i, (_, p) in enumerate(self.named):
            v = state.get(p, {}).get("exp_avg_sq") if p.grad is not None else None
            if v is None:  # no second moment before the optimizer's first step
                continue
            g = _take(local_piece(p.grad, world)[0], plan[i])
            v = _take(local_piece(v, world)[0], plan[i])
            if g.numel():
                gs.append(g if g.dtype == v.dtype else g.to(v.dtype))
                vs.append(v)
                weights.append(self._weight[i])
        if not gs:
            return torch.zeros(2, dtype=_F64, device=dev)
        excess = torch._foreach_addcmul(torch._foreach_mul(vs, -self.config.spike_k), gs, gs)
        torch._foreach_clamp_min_(excess, 0.0)
        w = torch.tensor(weights, dtype=_F64, device=dev)
        hits = (tensor_norms(excess, dev, 0.0).to(_F64) * w).sum()
        total = sum(g.numel() * k for g, k in zip(gs, weights))
        return torch.stack([hits, torch.full((), total, dtype=_F64, device=dev)])

    # -- the step's values ----------------------------------------------------------------------
    def _device(self) -> torch.device:
        dev = self.named[0][1].device if self.named else torch.device("cpu")
        return collective_device(preferred=dev) if world_size() > 1 else dev

    def gather(self) -> SignalValues:
        """The signals due at this step, on the device: one all-reduce when any is due (every
        rank must call it at the same steps), no host read."""
        cfg, world = self.config, world_size()
        ratio = self._update is not None or (self._due(self._step, cfg.update_ratio_every)
                                             and self.optimizer is not None)
        spike = self._spike is not None or (self._due(self._step, cfg.spike_share_every)
                                            and self.optimizer is not None)
        bound = bool(self.blocks) and self._due(self._step, cfg.logit_bound_every)
        n_heads = self.blocks[0].layout().n_head if bound else 0
        if not (ratio or spike or bound):
            return SignalValues(None, [], False, None)
        dev, n_groups = self._device(), len(self.groups)
        parts = []
        if ratio:  # a step the optimizer never took (a skip off the fused path) applied nothing
            parts.append(self._update if self._update is not None
                         else torch.zeros(2 * n_groups, dtype=_F64, device=dev))
        if spike:
            parts.append(self._spike if self._spike is not None
                         else torch.zeros(2, dtype=_F64, device=dev))
        if bound:
            parts.append(bound_parts(self.blocks, world, dev))
        vec = torch.cat([p.to(dev) for p in parts])
        if world > 1:
            dist.all_reduce(vec)
        out, at = [], 0
        if ratio:
            u, w = vec[:n_groups], vec[n_groups:2 * n_groups]
            out.append(torch.where(w > 0, (u / w.clamp(min=1e-300)).sqrt(), torch.zeros_like(u)))
            at = 2 * n_groups
        if spike:
            out.append((vec[at] / vec[at + 1].clamp(min=1.0)).reshape(1))
            at += 2
        if bound:
            out.append(bounds(self.blocks, vec[at:]))
        self._update = self._spike = None
        return SignalValues(torch.cat(out), list(self.groups) if ratio else [], spike,
                            (len(self.blocks), n_heads) if bound else None)
