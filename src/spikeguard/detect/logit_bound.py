"""An upper bound on every attention logit from the weights alone, and QK-Clip on top of it.

For a block ``x -> ln1 -> attn`` of the reference GPT (attention with a fused ``qkv`` and its
``cfg``): with QK-norm, ``scale * hd * max|g_q| * max|g_k|`` (a normalised vector of hd channels
has norm at most ``sqrt(hd) * max gain``); without it, ``scale * ||W_q^h||_F * ||W_k^h||_F * X^2``
with ``X = max|g| sqrt(d) + ||b||`` for ln1's gain g and bias b (the norm of a LayerNorm's
output) and the Frobenius norm bounding the spectral one. RoPE rotates and keeps norms; a cap
only lowers logits. Each max is a 32-norm (``max|g| <= ||g||_32``, at most ``n^(1/32)`` above
it): a sum, so it reduces over shards like the rest, and the bound stays an upper bound under
any sharding. The Frobenius step makes it loose without QK-norm (several times the largest
logit a random input reaches); with QK-norm it is the logit of two aligned, saturated vectors.

:func:`qk_clip_` (QK-Clip, Kimi K2) rescales a head's query and key weights by
``sqrt(tau / bound)`` each when its bound passes ``tau``, so the bound of every head is at most
``tau`` afterwards: rows of ``qkv.weight`` per head without QK-norm (a key head shared by a
group of query heads takes the group's smallest factor), the QK-norm gains with it (shared by
every head of the layer).

Sharding as in ``detect/signals.py``: local pieces weighted by their copy counts, the per-head
row sums placed at their global rows, ONE all-reduce of the float64 parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .._dist import world_size
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


@dataclass
class AttentionBlock:
    """One attention block whose logits the bound covers."""

    ln: nn.Module
    attn: nn.Module

    @property
    def width(self) -> int:
        """Entries of this block in :func:`bound_parts`."""
        cfg = self.attn.cfg
        return 4 + cfg.n_head + cfg.kv_heads


def attention_blocks(model: nn.Module) -> list[AttentionBlock]:
    """Blocks ``x -> ln1 -> attn`` of the reference GPT layout (attn with ``qkv`` and ``cfg``)."""
    found = []
    for m in model.modules():
        ln, attn = getattr(m, "ln1", None), getattr(m, "attn", None)
        if (isinstance(ln, nn.LayerNorm) and attn is not None and hasattr(attn, "qkv")
                and hasattr(attn, "cfg")):
            found.append(AttentionBlock(ln, attn))
    return found


def bound_parts(blocks: list[AttentionBlock], world: int, device: torch.device) -> torch.Tensor:
    """This rank's share of, per block: [sum |ln g|^P, ||ln b||^2, sum |g_q|^P, sum |g_k|^P,
    q rows' sums of squares per head, k rows' per kv head], float64 on ``device``."""
    parts = []
    for blk in blocks:
        cfg = blk.attn.cfg
        h, h_kv, hd = cfg.n_head, cfg.kv_heads, cfg.head_dim
        vec = torch.zeros(blk.width, dtype=_F64, device=device)
        g, c, _ = local_piece(blk.ln.weight.detach(), world)
        vec[0] += _psum(g).to(device) / c
        if blk.ln.bias is not None:
            b, c, _ = local_piece(blk.ln.bias.detach(), world)
            vec[1] += sumsq(b).to(device) / c
        qk = blk.attn.qk_norm
        if qk is not None:
            for slot, w in ((2, qk.q_weight), (3, qk.k_weight)):
                w, c, _ = local_piece(w.detach(), world)
                vec[slot] += _psum(w).to(device) / c
        else:
            w, c, offset = local_piece(blk.attn.qkv.weight.detach(), world)
            rows = torch.zeros(h * hd + 2 * h_kv * hd, dtype=_F64, device=device)
            if w.numel():
                rows[offset:offset + w.shape[0]] = torch.linalg.vector_norm(
                    w, dim=1, dtype=_F64 if w.dtype == _F64 else torch.float32
                ).to(device, _F64).square() / c
            vec[4:4 + h] = rows[:h * hd].view(h, hd).sum(1)
            vec[4 + h:] = rows[h * hd:h * hd + h_kv * hd].view(h_kv, hd).sum(1)
        parts.append(vec)
    return torch.cat(parts)


def bounds(blocks: list[AttentionBlock], sums: torch.Tensor) -> torch.Tensor:
    """[blocks * heads] float64 bounds from the all-reduced :func:`bound_parts`."""
    out, at = [], 0
    for blk in blocks:
        cfg = blk.attn.cfg
        h, h_kv, hd = cfg.n_head, cfg.kv_heads, cfg.head_dim
        vec = sums[at:at + blk.width]
        at += blk.width
        scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(hd)
        if blk.attn.qk_norm is not None:
            b = scale * hd * vec[2].pow(1 / _P) * vec[3].pow(1 / _P)
            out.append(b.expand(h))
        else:
            x = vec[0].pow(1 / _P) * math.sqrt(cfg.d_model) + vec[1].sqrt()
            q, k = vec[4:4 + h].sqrt(), vec[4 + h:].sqrt()
            out.append(scale * q * k.repeat_interleave(h // h_kv) * x.square())
    return torch.cat(out)


@torch.no_grad()
def qk_clip_(blocks: list[AttentionBlock], tau: float, device: torch.device) -> torch.Tensor:
    """Rescale the query and key weights of every head whose bound passes ``tau`` (module
    docstring); returns the bounds before, [blocks * heads]. One all-reduce, no host read."""
    world = world_size()
    sums = bound_parts(blocks, world, device)
    if world > 1:
        dist.all_reduce(sums)
    before = bounds(blocks, sums)
    gamma = (tau / before.clamp(min=1e-30)).clamp(max=1.0)  # 1 where the bound holds
    at = 0
    for blk in blocks:
        cfg = blk.attn.cfg
        h, h_kv, hd = cfg.n_head, cfg.kv_heads, cfg.head_dim
        g = gamma[at:at + h]
        at += h
        qk = blk.attn.qk_norm
        if qk is not None:  # gains shared by the heads: every head has the layer's bound
            for w in (qk.q_weight, qk.k_weight):
                local = local_piece(w.detach(), world)[0]
                local.mul_(g[0].sqrt().to(local.device, local.dtype))
            continue
        w, _, offset = local_piece(blk.attn.qkv.weight.detach(), world)
        if not w.numel():
            continue
        kv = g.view(h_kv, h // h_kv).amin(dim=1)  # a shared key head: its group's least factor
        # per-row factors: a q head's rows at sqrt(gamma), its k head's at sqrt(the group's
        # least gamma) (the product is at most gamma), the v rows at 1
        rows = torch.cat([g.sqrt().repeat_interleave(hd), kv.sqrt().repeat_interleave(hd),
                          torch.ones(h_kv * hd, dtype=_F64, device=g.device)])
        w.mul_(rows[offset:offset + w.shape[0]].to(w.device, w.dtype).unsqueeze(1))
    return before
