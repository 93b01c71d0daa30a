"""An upper bound on every attention logit from the weights alone, and QK-Clip on top of it.

For every attention layer ``x -> norm -> q, k`` that
:func:`spikeguard.prevent.layout.find_attention` finds (the reference GPT's blocks, a Hugging
Face Llama's layers, any module with an ``attention_layout()``; its AttentionLayout says where
each head's rows are): with QK-norm, ``scale * hd * max|g_q| * max|g_k|`` (a normalised vector
of hd channels has norm at most ``sqrt(hd) * max gain``); without it,
``scale * ||W_q^h||_F * ||W_k^h||_F * X^2`` with ``X = max|g| sqrt(d) + ||b||`` for the norm's
gain g and bias b (the norm of a LayerNorm's or RMSNorm's output) and the Frobenius norm
bounding the spectral one. RoPE rotates and keeps norms; a cap only lowers logits. Each max
is a 32-norm (``max|g| <= ||g||_32``, at most ``n^(1/32)`` above it): a sum, so it reduces
over shards like the rest, and the bound stays an upper bound under any sharding. The
Frobenius step makes it loose without QK-norm (several times the largest logit a random input
reaches); with QK-norm it is the logit of two aligned, saturated vectors.

:func:`qk_clip_` (QK-Clip, Kimi K2) reads these bounds and hands them to
:func:`spikeguard.prevent.qk_clip.clip_heads_`, which edits the weights: a head's query and key
weights by ``sqrt(tau / bound)`` each when its bound passes ``tau``, so the bound of every head is
at most ``tau`` afterwards.

Sharding as in ``measure/signals.py``: local pieces weighted by their copy counts, the per-head
row sums placed at their global rows, ONE all-reduce of the float64 parts.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from .._dist import world_size
from ..prevent.layout import AttentionLayout, find_attention
from ..prevent.qk_clip import clip_heads_
from ._grad_layout import _dtensor_piece

__all__ = ["AttentionBlock", "attention_blocks", "bound_parts", "bounds", "local_piece",
           "qk_clip_", "sumsq"]

_F64 = torch.float64
_P = 32.0  # the p of the p-norm that stands in for a max (see the module docstring)


def local_piece(t: torch.Tensor, world: int) -> tuple[torch.Tensor, int, int]:
    """(local piece, copies, global row offset of the piece) of a parameter-like tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local, copies, _ = _dtensor_piece(t, world, 1)
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return local, copies, int(offset[0]) if offset else 0
    return t, world, 0


def sumsq(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares, float32 (float64 for float64), as 0-d float64."""
    dtype = _F64 if t.dtype == _F64 else torch.float32
    return torch.linalg.vector_norm(t, dtype=dtype).to(_F64).square()


def _psum(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(_F64).abs().pow(_P).sum()


class AttentionBlock(Protocol):
    """One attention layer whose logits the bound covers (what :func:`attention_blocks` finds)."""

    def layout(self) -> AttentionLayout: ...


def _width(lay: AttentionLayout) -> int:
    """Entries of one layer in :func:`bound_parts`."""
    return 4 + lay.n_head + lay.n_kv_head


def attention_blocks(model: nn.Module, *, bound: bool = False,
                     qk_clip: bool = False) -> list[AttentionBlock]:
    """The attention layers of ``model`` (:func:`spikeguard.prevent.layout.find_attention`).
    None found while the bound (``bound``) or QK-Clip (``qk_clip``) is on: an
    AttentionNotFoundWarning naming the model's class, once per class and defense."""
    if qk_clip:
        return find_attention(model, what="QK-Clip", required=True,
                              off="SignalConfig(qk_clip=None)")
    return find_attention(model, what="the attention-logit bound", required=bound,
                          off="SignalConfig(logit_bound_every=0)")


def bound_parts(blocks: list[AttentionBlock], world: int, device: torch.device) -> torch.Tensor:
    """This rank's share of, per block: [sum |ln g|^P, ||ln b||^2, sum |g_q|^P, sum |g_k|^P,
    q rows' sums of squares per head, k rows' per kv head], float64 on ``device``."""
    parts = []
    for blk in blocks:
        lay = blk.layout()
        h, h_kv, hd = lay.n_head, lay.n_kv_head, lay.head_dim
        vec = torch.zeros(_width(lay), dtype=_F64, device=device)
        g, c, _ = local_piece(lay.norm_weight.detach(), world)
        vec[0] += _psum(g).to(device) / c
        if lay.norm_bias is not None:
            b, c, _ = local_piece(lay.norm_bias.detach(), world)
            vec[1] += sumsq(b).to(device) / c
        if lay.qk_norm is not None:
            for slot, w in zip((2, 3), lay.qk_norm):
                w, c, _ = local_piece(w.detach(), world)
                vec[slot] += _psum(w).to(device) / c
        else:
            vec[4:4 + h] = _head_sumsq(lay.q_weight, lay.q_row, h, hd, world, device)
            vec[4 + h:] = _head_sumsq(lay.k_weight, lay.k_row, h_kv, hd, world, device)
        parts.append(vec)
    return torch.cat(parts)


def _head_sumsq(weight: torch.Tensor, row: int, heads: int, hd: int, world: int,
                device: torch.device) -> torch.Tensor:
    """This rank's share of each head's sum of squares over its rows ``row + i * hd`` onward
    of ``weight`` (a local piece holds global rows from its offset on), [heads] float64."""
    w, c, offset = local_piece(weight.detach(), world)
    rows = torch.zeros(row + heads * hd, dtype=_F64, device=device)
    end = min(offset + w.shape[0], row + heads * hd) if w.numel() else offset
    if end > offset:
        rows[offset:end] = torch.linalg.vector_norm(
            w[:end - offset], dim=1, dtype=_F64 if w.dtype == _F64 else torch.float32
        ).to(device, _F64).square() / c
    return rows[row:].view(heads, hd).sum(1)


def bounds(blocks: list[AttentionBlock], sums: torch.Tensor) -> torch.Tensor:
    """[blocks * heads] float64 bounds from the all-reduced :func:`bound_parts`."""
    out, at = [], 0
    for blk in blocks:
        lay = blk.layout()
        h, h_kv, hd, scale = lay.n_head, lay.n_kv_head, lay.head_dim, lay.scale
        vec = sums[at:at + _width(lay)]
        at += _width(lay)
        if lay.qk_norm is not None:
            b = scale * hd * vec[2].pow(1 / _P) * vec[3].pow(1 / _P)
            out.append(b.expand(h))
        else:
            x = vec[0].pow(1 / _P) * math.sqrt(lay.d_model) + vec[1].sqrt()
            q, k = vec[4:4 + h].sqrt(), vec[4 + h:].sqrt()
            out.append(scale * q * k.repeat_interleave(h // h_kv) * x.square())
    return torch.cat(out)


@torch.no_grad()
def qk_clip_(blocks: list[AttentionBlock], tau: float, device: torch.device) -> torch.Tensor:
    """QK-Clip after an update: the bounds (one all-reduce, no host read), then
    :func:`spikeguard.prevent.qk_clip.clip_heads_` rescales every head above ``tau``; returns
    the bounds before, [blocks * heads]."""
    world = world_size()
    sums = bound_parts(blocks, world, device)
    if world > 1:
        dist.all_reduce(sums)
    before = bounds(blocks, sums)
    clip_heads_([blk.layout() for blk in blocks], before, tau)
    return before
