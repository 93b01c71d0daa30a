"""Bounding the attention logits: soft-capping, QK-norm, and attention that honours a cap.

``softcap(x, cap) = cap * tanh(x / cap)`` squashes a logit into (-cap, cap) and passes small ones
almost unchanged; QK-norm normalises queries and keys so their dot product stays bounded. Gemma 2
uses the cap and OLMo 2 QK-norm; pick one of the two unless an ablation says otherwise, so
stacking them warns.

``attention`` never drops a cap: SDPA cannot apply one, so it serves only uncapped calls; a capped
call uses flex_attention's ``score_mod`` on CUDA and an eager fp32 path elsewhere (CPU flex has no
backward). The cap is applied to the scaled scores before the causal mask. Keys and values may
have fewer heads than the queries (grouped-query and multi-query attention): query head h reads
key/value head h // (H / H_kv), as SDPA's ``enable_gqa`` does.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ._losses_autograd import strict_once_differentiable

__all__ = [
    "QKNorm",
    "StackedLogitBoundsWarning",
    "attention",
    "check_logit_bounds",
    "check_softcap",
    "logit_p99",
    "softcap",
]


class StackedLogitBoundsWarning(UserWarning):
    """QK-norm and attention soft-capping are both on (usually one is enough: OLMo 2 uses QK-norm, Gemma 2 the cap)."""


def check_softcap(cap: float | None, name: str = "softcap") -> None:
    """ValueError unless ``cap`` is None or a positive finite number; ``name`` is the field."""
    if cap is None:
        return
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"{name}={cap!r} must be a positive finite number or None; "
                         f"Gemma 2 uses 50.0 for attention and 30.0 for the final logits")


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: any shape and dtype; output in (-cap, cap), gradient 1 - tanh^2."""
    check_softcap(cap, "cap")
    return _tanh_cap(x, cap)


def _tanh_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(x / cap)


def check_logit_bounds(*, qk_norm: bool, attn_softcap: float | None,
                       prefix: str = "") -> None:
    """Validate the attention cap; warn (StackedLogitBoundsWarning) when QK-norm is also on."""
    check_softcap(attn_softcap, prefix + "attn_softcap")
    if qk_norm and attn_softcap is not None:
        warnings.warn(f"QK-norm and attention soft-capping (attn_softcap={attn_softcap}) are both "
                      "on; they restrict the same logits twice and can over-constrain heads early "
                      "in training. Pick one unless you are ablating the combination.",
                      StackedLogitBoundsWarning, stacklevel=2)


class QKNorm(nn.Module):
    """Normalise queries and keys over the head dim: ``q, k = qknorm(q, k)``.

    ``kind="rms"`` (RMSNorm) or ``"layer"`` (LayerNorm without bias); one learned gain per
    channel for q and one for k, shared by all heads, initialised to 1. Inputs [..., head_dim]
    of any float dtype; the norm runs in fp32 and returns the input dtype.
    """

    def __init__(self, head_dim: int, kind: Literal["rms", "layer"] = "rms", eps: float = 1e-6) -> None:
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"QKNorm head_dim={head_dim!r} must be a positive integer")
        if kind not in ("rms", "layer"):
            raise ValueError(f"QKNorm kind={kind!r} must be 'rms' or 'layer'")
        if not eps > 0:
            raise ValueError(f"QKNorm eps={eps!r} must be positive (1e-6 is typical)")
        self.head_dim, self.kind, self.eps = head_dim, kind, float(eps)
        self.q_weight = nn.Parameter(torch.ones(head_dim))
        self.k_weight = nn.Parameter(torch.ones(head_dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.q_weight)
        nn.init.ones_(self.k_weight)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, kind={self.kind!r}, eps={self.eps}"

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"QKNorm expects a last dim of head_dim={self.head_dim}, "
                             f"got shape {tuple(x.shape)}")
        shape, w = (self.head_dim,), weight.float()
        if self.kind == "rms":
            y = F.rms_norm(x.float(), shape, w, self.eps)
        else:
            y = F.layer_norm(x.float(), shape, w, None, self.eps)
        return y.to(x.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._norm(q, self.q_weight), self._norm(k, self.k_weight)


_CHUNK_BYTES = 2 << 20  # one chunk's [heads, T, S] fp32 scores: about an L2 cache


class _EagerAttention(torch.autograd.Function):
    """fp32 attention with an optional cap fused into a hand-written backward.

    The cap uses cap * tanh(u / cap) = 2 cap * sigmoid(2 u / cap) - cap: softmax ignores the
    constant, sigmoid is several times faster than tanh on CPU, and the cap's derivative
    1 - tanh^2 is 4 sig (1 - sig). The price: the capped scores carry an absolute error of about
    1e-7 * cap (sig is rounded near 0.5), 5e-6 at cap 50, far below bf16's rounding of the same
    scores. Works through the heads in cache-sized chunks. Saves q, k, v, the probabilities p and
    (capped) sig; nothing else of size T x S.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, cap: float | None, scale: float, groups: int):
        # q: [n, groups * T, D], the queries of every head that shares one key/value head
        # stacked along time; k, v: [n, S, D]. One bmm then serves the whole group, and the
        # gradients of k and v sum over the group inside the backward bmm (no repeated copies).
        n, t, s_len = q.shape[0], q.shape[1], k.shape[1]
        chunk = max(1, _CHUNK_BYTES // (4 * t * s_len))
        # fold the cap's 2/cap into the query scale: a [.., T, D] multiply, not a [.., T, S] one
        qs = q * (2.0 * scale / cap if cap else scale)
        kt = k.transpose(1, 2)
        mask = _causal_mask(t // groups, s_len, groups, q.device) if causal else None
        probs, sigs, outs = [], [], []
        for lo in range(0, n, chunk):
            s = torch.bmm(qs[lo:lo + chunk], kt[lo:lo + chunk])
            # cap first, mask second: a capped -inf would be the finite -cap, and every masked
            # key would get a little weight (Gemma 2 caps the raw scores for the same reason)
            if cap:
                sig = s.sigmoid_()
                sigs.append(sig)
                s = sig * (2.0 * cap)
            if mask is not None:
                s.masked_fill_(mask, float("-inf"))
            p = torch.softmax(s, dim=-1)
            probs.append(p)
            outs.append(torch.bmm(p, v[lo:lo + chunk]))
        ctx.save_for_backward(q, k, v, *probs, *sigs)
        ctx.cap, ctx.scale, ctx.chunk, ctx.n_chunks = cap, scale, chunk, len(probs)
        return torch.cat(outs)

    @staticmethod
    @strict_once_differentiable
    def backward(ctx, dout):
        q, k, v, *rest = ctx.saved_tensors
        probs, sigs = rest[:ctx.n_chunks], rest[ctx.n_chunks:]
        # 1 - tanh^2 = 4 sig (1 - sig); the 4 joins the scale
        scale, c = ctx.scale * (4.0 if ctx.cap else 1.0), ctx.chunk
        dqs, dks, dvs = [], [], []
        for i, lo in enumerate(range(0, q.shape[0], c)):
            p, g = probs[i], dout[lo:lo + c]
            dvs.append(torch.bmm(p.transpose(1, 2), g))
            dp = torch.bmm(g, v[lo:lo + c].transpose(1, 2))
            ds = torch._softmax_backward_data(dp, p, -1, p.dtype)
            if ctx.cap:
                ds.mul_(torch.addcmul(sigs[i], sigs[i], sigs[i], value=-1.0))
            dqs.append(torch.bmm(ds, k[lo:lo + c]).mul_(scale))
            dks.append(torch.bmm(ds.transpose(1, 2), q[lo:lo + c]).mul_(scale))
        return torch.cat(dqs), torch.cat(dks), torch.cat(dvs), None, None, None, None


@functools.lru_cache(maxsize=16)
def _causal_mask(q_len: int, kv_len: int, groups: int, device: torch.device) -> torch.Tensor:
    # True where masked: top-left aligned like SDPA's is_causal (key j visible to query i if j <= i),
    # tiled once per query head of a group (the rows are groups x q_len)
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).triu_(1)
    return mask if groups == 1 else mask.repeat(groups, 1)


def _eager(q, k, v, causal: bool, cap: float | None, scale: float) -> torch.Tensor:
    b, h, t, _ = q.shape
    h_kv = k.shape[1]
    # [B, H_kv * G, T, D] -> [B * H_kv, G * T, D]: a view, since head h reads kv head h // G
    q3 = q.float().reshape(b * h_kv, (h // h_kv) * t, q.shape[3])
    k3, v3 = (x.float().reshape(b * h_kv, x.shape[2], x.shape[3]) for x in (k, v))
    # the hand-written backward works on the fp32 tensors it saved: autocast must not re-cast the
    # bmms inside (a bf16 score matrix would lose the cap's small derivatives near +-cap)
    with torch.autocast(q.device.type, enabled=False):
        out = _EagerAttention.apply(q3, k3, v3, causal, cap, scale, h // h_kv)
    return out.view(b, h, t, v.shape[-1]).to(q.dtype)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=16)
def _flex_causal_block_mask(q_len: int, kv_len: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return create_block_mask(causal_mod, None, None, q_len, kv_len, device=device)


@functools.lru_cache(maxsize=16)
def _cap_score_mod(cap: float):
    # one function object per cap value, so torch.compile does not retrace on every call
    def cap_mod(score, b, h, q_idx, kv_idx):
        # flex scales before score_mod and masks after it: the cap sits before the mask
        return cap * torch.tanh(score / cap)

    return cap_mod


def _flex(q, k, v, causal: bool, cap: float | None, scale: float) -> torch.Tensor:
    mask = _flex_causal_block_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
    mod = None if cap is None else _cap_score_mod(cap)
    return _compiled_flex()(q, k, v, score_mod=mod, block_mask=mask, scale=scale,
                            enable_gqa=q.shape[1] != k.shape[1])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              softcap: float | None = None, scale: float | None = None,
              backend: Literal["auto", "sdpa", "eager", "flex"] = "auto") -> torch.Tensor:
    """Scaled dot-product attention whose scores may be soft-capped.

    q: [B, H, T, D], k: [B, H_kv, S, D], v: [B, H_kv, S, Dv], one dtype; returns [B, H, T, Dv] in
    it. H_kv divides H: H_kv = H is multi-head, 1 < H_kv < H grouped-query, H_kv = 1 multi-query
    attention; query head h attends with key/value head h // (H / H_kv) (SDPA's ``enable_gqa``).
    Scores ``s = scale * q k^T`` (scale defaults to 1/sqrt(D)), then ``softcap * tanh(s /
    softcap)``, then the causal mask (top-left aligned, as SDPA's ``is_causal``), then softmax.
    ``backend="auto"``: SDPA without a cap; with a cap, compiled flex_attention on CUDA and an
    eager fp32 path (own autograd) elsewhere. Asking for ``"sdpa"`` with a cap is an error.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D [batch, heads, time, dim] q, k, v; got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype.is_floating_point and k.dtype == q.dtype and v.dtype == q.dtype):
        raise ValueError(f"attention needs q, k, v of one floating-point dtype; got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"attention needs q, k, v on one device; got {q.device}, {k.device}, "
                         f"{v.device}")
    check_softcap(softcap, "softcap")
    if backend not in ("auto", "sdpa", "eager", "flex"):
        raise ValueError(f"attention backend={backend!r} must be 'auto', 'sdpa', 'eager' or 'flex'")
    if not (q.shape[0] == k.shape[0] and k.shape[:3] == v.shape[:3] and q.shape[3] == k.shape[3]
            and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0):
        raise ValueError(f"attention shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}; expected [B, H, T, D], [B, H_kv, S, D], "
                         "[B, H_kv, S, Dv] with H_kv dividing H (H_kv = H: multi-head, "
                         "H_kv = 1: multi-query)")
    gqa = q.shape[1] != k.shape[1]
    if backend == "auto":
        if softcap is None:
            backend = "sdpa"
        else:
            backend = "flex" if q.device.type == "cuda" else "eager"
    if backend == "sdpa":
        if softcap is not None:
            raise ValueError(f"SDPA cannot apply softcap={softcap}; use backend='auto' (flex on "
                             "CUDA, eager elsewhere) or drop the cap")
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                  enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if backend == "flex":
        if q.device.type != "cuda":
            raise ValueError(f"backend='flex' trains only on CUDA (flex_attention has no backward "
                             f"on {q.device.type}); use backend='auto' or 'eager'")
        return _flex(q, k, v, causal, None if softcap is None else float(softcap), scale)
    return _eager(q, k, v, causal, softcap, scale)


@torch.no_grad()
def logit_p99(q: torch.Tensor, k: torch.Tensor, *, causal: bool = True, scale: float | None = None,
              softcap: float | None = None, sample: int = 16384,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Per-head 99th percentile of |pre-softmax logit| from a sample of (query, key) pairs.

    q: [B, H, T, D], k: [B, H_kv, S, D] (H_kv divides H, as in ``attention``). Draws ``sample``
    visible (batch, query, key) triples uniformly (with replacement; all of them, exactly, when
    there are no more than ``sample``), shared by every head, and returns a float32 [H] tensor on q's device: the value at 0-based
    rank ceil(0.99 (n - 1)) of the sorted |logits|, as torch.quantile(interpolation="higher").
    Logits are ``scale * q.k`` before any cap, or after ``softcap`` when one is given. No host
    sync; never builds the T x S matrix (torch.quantile refuses inputs over 16M elements).
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"logit_p99 expects 4-D q, k; got {tuple(q.shape)}, {tuple(k.shape)}")
    if not (q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3] and k.shape[1] > 0
            and q.shape[1] % k.shape[1] == 0):
        raise ValueError(f"logit_p99 shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}; "
                         "expected [B, H, T, D] and [B, H_kv, S, D] with H_kv dividing H")
    if sample < 1:
        raise ValueError(f"logit_p99 sample={sample} must be >= 1")
    check_softcap(softcap, "softcap")
    b, h, t, d = q.shape
    h_kv, s_len = k.shape[1], k.shape[-2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # visible pairs per sequence: row i sees keys 0..min(i, S-1) when causal
    rows = torch.arange(t, dtype=torch.int64)
    per_row = (rows + 1).clamp(max=s_len) if causal else torch.full((t,), s_len, dtype=torch.int64)
    offsets = torch.cumsum(per_row, 0)
    pairs = int(offsets[-1])
    n_total = b * pairs
    if n_total <= sample:
        flat = torch.arange(n_total, dtype=torch.int64)
    else:
        flat = torch.randint(0, n_total, (sample,), generator=generator, dtype=torch.int64)
    bi, within = flat // pairs, flat % pairs
    qi = torch.searchsorted(offsets, within, right=True)
    kj = within - (offsets[qi] - per_row[qi])
    bi, qi, kj = (x.to(q.device) for x in (bi, qi, kj))
    chunks = []
    for lo in range(0, len(flat), 4096):
        sl = slice(lo, lo + 4096)
        qs = q[bi[sl], :, qi[sl], :].float()  # [n, H, D]
        ks = k[bi[sl], :, kj[sl], :].float()  # [n, H_kv, D]
        if h_kv == h:
            chunks.append(torch.einsum("nhd,nhd->hn", qs, ks))
        else:  # query head h reads key head h // G
            qg = qs.view(-1, h_kv, h // h_kv, d)
            chunks.append(torch.einsum("nkgd,nkd->kgn", qg, ks).reshape(h, -1))
    logits = torch.cat(chunks, dim=1).mul_(scale)
    if softcap is not None:
        logits = _tanh_cap(logits, softcap)
    n = logits.shape[1]
    rank = (99 * (n - 1) + 99) // 100  # ceil(0.99 (n - 1)), 0-based
    return logits.abs_().kthvalue(rank + 1, dim=1).values
