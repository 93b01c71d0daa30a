"""The autograd functions behind ``spikeguard.prevent.losses`` (private; inputs are checked there).

All walk the tokens in row chunks, so only one chunk of logits lives in the compute dtype at a time
(fp32 for bf16/fp16 inputs, the input dtype otherwise). One pass per chunk gives the log-softmax,
from which cross-entropy (-log p_target) and log Z (x_target - log p_target) fall out together; the
gradient needs softmax = exp(x - log Z), which uses the saved log Z instead of a second logsumexp.

Gradient of alpha * logZ^2 + CE with respect to the (capped) logit c_j of one token:
    softmax_j * (1 + 2 * alpha * logZ) - onehot_j
and with a softcap c = cap * tanh(x / cap) the chain rule adds a factor 1 - (c / cap)^2.

The backwards are hand-written and not themselves differentiable: each is marked
``strict_once_differentiable``, so a double backward raises torch's own once_differentiable error.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__: list[str] = []


def strict_once_differentiable(backward: Callable) -> Callable:
    """torch.autograd.function.once_differentiable that also catches the usual double backward.

    torch's decorator attaches its "trying to differentiate twice" error only when an incoming
    gradient requires grad. Under ``autograd.grad(loss, x, create_graph=True)`` the incoming
    gradient is a constant, so torch's version returns a gradient with no history: a later
    backward through it fails with an unrelated message, or, summed with other terms, silently
    contributes nothing. Whenever a graph is being built, the incoming gradients are passed as
    aliases that require grad (the backward runs under no_grad, so values are unchanged), and
    every output then carries torch's error node."""
    inner = once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            grads = tuple(g.detach().requires_grad_() if isinstance(g, torch.Tensor)
                          and g.dtype.is_floating_point else g for g in grads)
        return inner(ctx, *grads)

    return wrapper


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """max(fp32, dtype): fp64 stays fp64, bf16/fp16/fp32 compute in fp32."""
    return torch.promote_types(dtype, torch.float32)


def _capped(x: torch.Tensor, softcap: float | None, *, owned: bool) -> torch.Tensor:
    """cap * tanh(x / cap), in place when the caller owns ``x``."""
    if softcap is None:
        return x
    y = x.div_(softcap) if owned else x / softcap
    return y.tanh_().mul_(softcap)


def _logsoftmax_stats(c: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_softmax(c), ce, log Z) for one chunk; tgt is [rows, 1] with valid class ids."""
    lsm = torch.log_softmax(c, dim=-1)
    lsm_t = lsm.gather(1, tgt).squeeze(1)
    return lsm, -lsm_t, c.gather(1, tgt).squeeze(1) - lsm_t


def _grad_from_softmax(p: torch.Tensor, c: torch.Tensor | None, tgt: torch.Tensor,
                       lse: torch.Tensor, scale: torch.Tensor, alpha: float, softcap: float | None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """d(loss)/d(raw logits) for one chunk from the softmax ``p`` (a scratch buffer, modified).

    scale: [rows] per-token weight, 0 at ignored tokens. ``c`` (the capped logits, consumed) is
    needed only with a softcap. Writes into ``out`` when given (one pass from the cached chunk
    into the big gradient), else into ``p``. Uses scale * k * (p - onehot / k), k = 1 + 2 alpha
    logZ, so the per-row factor is applied in the same pass as the write."""
    k = 1.0 + 2.0 * alpha * lse
    p.scatter_add_(1, tgt, -k.reciprocal().unsqueeze(1))
    if softcap is not None:
        p.mul_(c.div_(softcap).square_().neg_().add_(1.0))
    coef = (scale * k).unsqueeze(1)
    return p.mul_(coef) if out is None else torch.mul(p, coef, out=out)


def _chunk_grads(p: torch.Tensor, c: torch.Tensor, h: torch.Tensor, tgt: torch.Tensor,
                 lse: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, alpha: float,
                 softcap: float | None, dh: torch.Tensor | None, dw: torch.Tensor | None,
                 db: torch.Tensor | None) -> None:
    """One chunk of linear cross-entropy: write d/dhidden into ``dh`` (the chunk's rows) and add
    d/dweight, d/dbias into ``dw``, ``db``; p is the chunk's softmax (consumed), c its capped
    logits (consumed with a softcap)."""
    p = _grad_from_softmax(p, c, tgt, lse, scale, alpha, softcap)
    if dh is not None:
        torch.mm(p.to(h.dtype), weight, out=dh)
    if dw is not None:  # in the compute dtype: no [V, H] temporary, no rounding of p
        dw.addmm_(p.t(), h.to(dw.dtype))
    if db is not None:
        db.add_(p.sum(0))


class CrossEntropyFn(torch.autograd.Function):
    """Per-token (ce + alpha * logZ^2) * mask from logits [N, V]; also returns log Z and ce per
    token (masked, not differentiable). Backward scales by the incoming per-token gradient."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor, alpha: float,
                softcap: float | None, chunk_rows: int):
        n = logits.shape[0]
        cd = compute_dtype(logits.dtype)
        lse = torch.empty(n, dtype=cd, device=logits.device)
        ce = torch.empty(n, dtype=cd, device=logits.device)
        for s in range(0, n, chunk_rows):
            x = logits[s: s + chunk_rows]
            xc = x.to(cd)
            c = _capped(xc, softcap, owned=xc is not x)
            _, ce[s: s + chunk_rows], lse[s: s + chunk_rows] = _logsoftmax_stats(
                c, tgt[s: s + chunk_rows])
        ctx.save_for_backward(logits, tgt, mask, lse)
        ctx.alpha, ctx.softcap, ctx.chunk_rows = alpha, softcap, chunk_rows
        m = mask.to(cd)
        lse_out, ce_out = lse * m, ce * m
        loss = ce_out + alpha * lse_out.square()
        ctx.mark_non_differentiable(lse_out, ce_out)
        return loss, lse_out, ce_out

    @staticmethod
    @strict_once_differentiable
    def backward(ctx, g_loss, _g_lse, _g_ce):
        logits, tgt, mask, lse = ctx.saved_tensors
        alpha, softcap, rows = ctx.alpha, ctx.softcap, ctx.chunk_rows
        cd = lse.dtype
        scale = g_loss.to(cd) * mask.to(cd)
        if logits.dtype == cd and softcap is None:
            # Nothing to upcast or cap: three whole-tensor passes into the gradient itself, no
            # scratch memory, few kernel launches / parallel regions (chunking measured slower).
            grad = torch.sub(logits, lse.unsqueeze(1)).exp_()
            _grad_from_softmax(grad, None, tgt, lse, scale, alpha, None)
            return grad, None, None, None, None, None
        grad = torch.empty_like(logits)
        # One reused chunk buffer: the exp/scale passes stay in cache and the big gradient is
        # written once, by the last multiply.
        buf = torch.empty((min(rows, logits.shape[0]), logits.shape[1]), dtype=cd,
                          device=logits.device)
        for s in range(0, logits.shape[0], rows):
            sl = slice(s, s + rows)
            x, lse_c = logits[sl], lse[sl].unsqueeze(1)
            p = buf[: x.shape[0]]
            if softcap is None:
                c = None
                torch.sub(x, lse_c, out=p)
            else:
                c = _capped(x.to(cd, copy=True), softcap, owned=True)
                torch.sub(c, lse_c, out=p)
            _grad_from_softmax(p.exp_(), c, tgt[sl], lse[sl], scale[sl], alpha, softcap,
                               out=grad[sl])
        return grad, None, None, None, None, None


class LinearCrossEntropyFn(torch.autograd.Function):
    """Mean over counted tokens of ce + alpha * logZ^2 for logits = hidden @ weight.T + bias,
    chunked over tokens. With grad enabled the gradients are computed in the forward pass (one
    matmul per chunk fewer than recomputing in backward) and only scaled in backward.

    ``inv_norm`` replaces 1 / (count of counted tokens) as the factor on the sums (1.0 for a
    sum, 1 / normalizer for a caller's normaliser); log Z takes the same factor unless
    ``log_z_mean``, which keeps it the mean over counted tokens.
    Returns (loss, ce, alpha * logZ^2 term, log Z), scalars in the compute dtype; only loss
    is differentiable."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tgt: torch.Tensor, mask: torch.Tensor, alpha: float, softcap: float | None,
                chunk_rows: int, grad_enabled: bool,
                inv_norm: torch.Tensor | float | None = None, log_z_mean: bool = True):
        n, dev, dtype = hidden.shape[0], hidden.device, hidden.dtype
        cd = compute_dtype(dtype)
        # needs_input_grad ignores torch.no_grad(), which the caller's grad_enabled reflects
        need_h, need_w, need_b = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        need_b = need_b and bias is not None
        need_any = need_h or need_w or need_b
        m = mask.to(cd)
        inv_count = 1.0 / m.sum().clamp(min=1.0)  # all tokens ignored: every output and grad is 0
        inv_n = inv_count if inv_norm is None else inv_norm
        lse = torch.empty(n, dtype=cd, device=dev)
        ce = torch.empty(n, dtype=cd, device=dev)
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=cd, device=dev) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=cd, device=dev) if need_b else None
        for s in range(0, n, chunk_rows):
            sl = slice(s, s + chunk_rows)
            h, t = hidden[sl], tgt[sl]
            c = F.linear(h, weight, bias).to(cd)  # fresh tensor: ours to modify in place
            c = _capped(c, softcap, owned=True)
            lsm, ce[sl], lse[sl] = _logsoftmax_stats(c, t)
            if need_any:
                _chunk_grads(lsm.exp_(), c, h, t, lse[sl], m[sl] * inv_n, weight, alpha, softcap,
                             None if dh is None else dh[sl], dw, db)
            del c, lsm  # free this chunk before the next one is allocated: peak is 2 chunks
        ctx.save_for_backward(
            dh, None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype))
        lse_sum = (lse * m).sum()
        ce_mean = (ce * m).sum() * inv_n
        z_term = alpha * (lse.square() * m).sum() * inv_n
        log_z = lse_sum * (inv_count if log_z_mean else inv_n)
        loss = ce_mean + z_term
        ctx.mark_non_differentiable(ce_mean, z_term, log_z)
        return loss, ce_mean, z_term, log_z

    @staticmethod
    @strict_once_differentiable
    def backward(ctx, g_loss, _g_ce, _g_z, _g_logz):
        dh, dw, db = ctx.saved_tensors

        def scaled(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t * g_loss.to(t.dtype)

        return scaled(dh), scaled(dw), scaled(db), None, None, None, None, None, None, None, None


class LinearCrossEntropyTokensFn(torch.autograd.Function):
    """Per-token (ce + alpha * logZ^2) * mask for logits = hidden @ weight.T + bias, with log Z
    and ce per token (masked, not differentiable), as CrossEntropyFn returns them.

    The upstream per-token weights are known only in backward, so the forward keeps log Z and
    nothing of size [N, V]; backward recomputes each chunk's logits (4 matmuls in all, one more
    than the mean path) under the autocast state the forward ran in."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tgt: torch.Tensor, mask: torch.Tensor, alpha: float, softcap: float | None,
                chunk_rows: int):
        n, dev = hidden.shape[0], hidden.device
        cd = compute_dtype(hidden.dtype)
        lse = torch.empty(n, dtype=cd, device=dev)
        ce = torch.empty(n, dtype=cd, device=dev)
        for s in range(0, n, chunk_rows):
            sl = slice(s, s + chunk_rows)
            c = _capped(F.linear(hidden[sl], weight, bias).to(cd), softcap, owned=True)
            _, ce[sl], lse[sl] = _logsoftmax_stats(c, tgt[sl])
            del c
        ctx.save_for_backward(hidden, weight, bias, tgt, mask, lse)
        ctx.alpha, ctx.softcap, ctx.chunk_rows = alpha, softcap, chunk_rows
        ctx.autocast = ((torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type))
                        if torch.amp.is_autocast_available(dev.type) else None)
        m = mask.to(cd)
        lse_out, ce_out = lse * m, ce * m
        ctx.mark_non_differentiable(lse_out, ce_out)
        return ce_out + alpha * lse_out.square(), lse_out, ce_out

    @staticmethod
    @strict_once_differentiable
    def backward(ctx, g_loss, _g_lse, _g_ce):
        hidden, weight, bias, tgt, mask, lse = ctx.saved_tensors
        alpha, softcap, rows = ctx.alpha, ctx.softcap, ctx.chunk_rows
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cd, dev = lse.dtype, hidden.device
        scale = g_loss.to(cd) * mask.to(cd)
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=cd, device=dev) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=cd, device=dev) if need_b else None
        # recompute the logits as the forward did: under autocast they were in its dtype
        autocast = (contextlib.nullcontext() if ctx.autocast is None else
                    torch.autocast(dev.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]))
        for s in range(0, hidden.shape[0], rows):
            sl = slice(s, s + rows)
            h, lse_c = hidden[sl], lse[sl]
            with autocast:
                c = F.linear(h, weight, bias)
            c = _capped(c.to(cd), softcap, owned=True)
            # the softmax from the saved log Z; in place when the capped logits are not needed
            p = (c.sub_(lse_c.unsqueeze(1)) if softcap is None
                 else torch.sub(c, lse_c.unsqueeze(1))).exp_()
            _chunk_grads(p, c, h, tgt[sl], lse_c, scale[sl], weight, alpha, softcap,
                         None if dh is None else dh[sl], dw, db)
            del c, p
        return (dh, None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None, None, None, None)
