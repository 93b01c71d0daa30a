"""QK-Clip (Kimi K2): after an update, rescale the query and key weights of every attention head
whose logit bound passes a threshold ``tau``, so that no head's bound is above ``tau``.

A head whose bound is ``b > tau`` gets ``gamma = tau / b``: its query rows and its key rows are
each multiplied by ``sqrt(gamma)`` (the product, the logit, by ``gamma``). A key head shared by a
group of query heads takes the group's smallest ``gamma`` (every query head reading it stays
under ``tau``); with QK-norm, the norm's gains are shared by every head of the layer and are
scaled instead, by the layer's factor. Every other row (the values of a fused ``qkv``) is left
as it is. The layers come from :func:`spikeguard.prevent.layout.find_attention`; the bounds are
computed by ``measure/logit_bound.py`` (the signals' reading, the same numbers), which calls
:func:`clip_heads_` from the optimizer's step post-hook (``measure/signals.py``).

Sharding: each rank scales the rows of its local piece, placed at their global rows (a DTensor
sharded along rows), so every rank applies the same factors to the rows it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._dist import local_tensor
from .._validate import check_positive
from .layout import AttentionLayout

__all__ = ["QKClipConfig", "clip_heads_"]

_F64 = torch.float64


@dataclass(kw_only=True, frozen=True)
class QKClipConfig:
    """QK-Clip's setting (module docstring); ``SignalConfig`` carries it (``--qk-clip``)."""

    qk_clip: float | None = None
    """QK-Clip: after each update, rescale the query and key weights of a head whose logit
    bound passes this (Kimi K2's tau: 100); None: off."""

    def __post_init__(self) -> None:
        if self.qk_clip is not None:
            check_positive(self.qk_clip, f"{type(self).__name__}.qk_clip", default=100.0,
                           hint="None turns QK-Clip off")


@torch.no_grad()
def clip_heads_(layouts: list[AttentionLayout], before: torch.Tensor, tau: float) -> None:
    """Rescale, in place, the query and key weights of every head whose bound in ``before``
    ([layers * heads] float64, one entry per query head in ``layouts``' order, the same on
    every rank) passes ``tau`` (module docstring). No host read."""
    gamma = (tau / before.clamp(min=1e-30)).clamp(max=1.0)  # 1 where the bound holds
    at = 0
    for lay in layouts:
        h, h_kv, hd = lay.n_head, lay.n_kv_head, lay.head_dim
        g = gamma[at:at + h]
        at += h
        if lay.qk_norm is not None:  # gains shared by the heads: every head has the layer's bound
            for w in lay.qk_norm:
                local = local_tensor(w.detach())
                local.mul_(g[0].sqrt().to(local.device, local.dtype))
            continue
        kv = g.view(h_kv, h // h_kv).amin(dim=1)  # a shared key head: its group's least factor
        # a q head's rows at sqrt(gamma), its k head's at sqrt(the group's least gamma) (the
        # product is at most gamma), every other row (v in a fused qkv) at 1
        _scale_rows_(lay.q_weight, lay.q_row, g.sqrt(), hd)
        _scale_rows_(lay.k_weight, lay.k_row, kv.sqrt(), hd)


def _local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's piece of ``t``, the global row its first row is)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), int(offset[0]) if offset else 0
    return t, 0


def _scale_rows_(weight: torch.Tensor, row: int, factors: torch.Tensor, hd: int) -> None:
    """Multiply rows ``row + i * hd`` onward of ``weight`` by ``factors[i]`` (this rank's piece)."""
    w, offset = _local_rows(weight.detach())
    if not w.numel():
        return
    per_row = torch.ones(max(offset + w.shape[0], row + factors.numel() * hd), dtype=_F64,
                         device=factors.device)
    per_row[row:row + factors.numel() * hd] = factors.repeat_interleave(hd)
    w.mul_(per_row[offset:offset + w.shape[0]].to(w.device, w.dtype).unsqueeze(1))
