"""Losses that keep the softmax normalizer in range: cross-entropy with z-loss and log Z in one
pass, a chunked linear cross-entropy that never builds the [N, V] logits, and the router z-loss.

z-loss (PaLM): add alpha * (log Z)^2 per token, log Z = logsumexp of the logits. It leaves the
predicted distribution alone and pulls log Z toward 0, so exponentials stay in range in bf16.
alpha = 1e-4 is the default here (PaLM, OLMo 2); above 1e-3 it visibly hurts the loss.

Conventions shared by every function here:
- classes are the last dimension: logits [..., V], target [...] (integer class ids);
- math runs in max(fp32, input dtype): fp64 stays fp64, bf16/fp16 are upcast one chunk at a time,
  and the outputs come back in that compute dtype (fp32 for bf16 logits, unlike F.cross_entropy);
- "counted" tokens are those whose target is not ``ignore_index``; means are over counted tokens;
- ``reduction``: "mean" (default), "sum" over counted tokens, or "none" (per-token values, 0 at
  ignored tokens, to trace a spike to its sequences);
- ``per_sequence=True`` adds ``LossOutput.sequences``: each sequence's mean ce and log Z and its
  count of counted tokens (a sequence is one row of the target's last dimension), reduced from
  the per-token values the loss computes anyway: no extra pass over the logits;
- ``normalizer`` (with "mean"): divide the sums by this number or 0-d tensor instead of the local
  count. Pass the count of counted tokens across every micro-batch and rank of a step (as
  torchtitan does) and the per-micro-batch losses add up to the step's true mean. A normaliser
  of 0 (nothing counted anywhere) gives 0 outputs and 0 gradients;
- if every token is ignored, loss, ce, z_loss and log_z are all 0 and every gradient is 0
  (F.cross_entropy returns NaN there); a fully padded micro-batch adds nothing to an accumulated
  step instead of poisoning it;
- no host-device sync: the count of counted tokens stays a tensor. Target range (and a tensor
  normaliser's sign) is checked with a ValueError on CPU; on an accelerator the same check is an
  asynchronous device assert.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal, NamedTuple

import torch

from ._losses_autograd import (
    CrossEntropyFn,
    LinearCrossEntropyFn,
    LinearCrossEntropyTokensFn,
    compute_dtype,
)

__all__ = ["LossOutput", "SequenceStats", "cross_entropy", "linear_cross_entropy",
           "router_z_loss"]

_CHUNK_BYTES = 64 * 2**20
"""Default budget for one chunk of compute-dtype logits in linear_cross_entropy."""
_CE_CHUNK_BYTES_CPU = 16 * 2**20
"""cross_entropy's chunk on CPU: small enough to stay in cache and reuse malloc'd buffers."""
_Z_LOSS_WARN = 1e-3
Reduction = Literal["mean", "sum", "none"]


class SequenceStats(NamedTuple):
    """Per-sequence values of one loss call, detached, [S] in the compute dtype; a sequence is
    one row of the target's last dimension (target [B, T]: B sequences; 1-D: one sequence).
    ``ce`` and ``log_z`` are means over the sequence's counted tokens (0 where none counts),
    whatever the reduction; ``tokens`` is its count of counted tokens."""

    ce: torch.Tensor
    log_z: torch.Tensor
    tokens: torch.Tensor


class _LossTuple(NamedTuple):
    loss: torch.Tensor
    ce: torch.Tensor
    z_loss: torch.Tensor
    log_z: torch.Tensor


class LossOutput(_LossTuple):
    """What the losses return. ``loss`` is differentiable; the others are detached.

    With reduction "mean" (the default) all four are scalars: ``loss = ce + z_loss``, ``ce`` is
    the mean cross-entropy in nats, ``z_loss`` the weighted term alpha * mean(logZ^2), ``log_z``
    the mean log Z, all over counted tokens. With a ``normalizer`` all four are sums over counted
    tokens divided by it (so they add up across micro-batches and ranks to the global means).
    With "sum", loss, ce and z_loss are sums over counted tokens and log_z is still the mean.
    With "none" each has the target's shape, 0 at ignored positions: per-token loss (still
    differentiable), ce, alpha * logZ^2 and log Z.

    ``sequences`` holds the per-sequence values (SequenceStats) with ``per_sequence=True``, else
    None. It is an attribute, not a tuple element: iterating or unpacking a LossOutput gives the
    four values above, as it always has."""

    sequences: SequenceStats | None = None
    reduction: str = "mean"
    """How ``ce`` was reduced: "mean" (over this call's counted tokens), "sum", "normalized"
    (a sum over a ``normalizer``: a share of a larger mean) or "none". The guard takes each
    micro-batch's own mean and warns about the others."""

    def __new__(cls, loss: torch.Tensor, ce: torch.Tensor, z_loss: torch.Tensor,
                log_z: torch.Tensor, sequences: SequenceStats | None = None, *,
                reduction: str = "mean") -> LossOutput:
        self = super().__new__(cls, loss, ce, z_loss, log_z)
        if sequences is not None:
            self.sequences = sequences
        if reduction != "mean":
            self.reduction = reduction
        return self


def _check_z_loss(z_loss: float) -> float:
    if not isinstance(z_loss, (int, float)) or isinstance(z_loss, bool) or not math.isfinite(z_loss):
        raise ValueError(f"z_loss={z_loss!r} must be a finite float; PaLM uses 1e-4")
    if z_loss < 0:
        raise ValueError(f"z_loss={z_loss} is negative, which rewards a drifting log Z; "
                         "use 0 to turn it off or 1e-4 (PaLM)")
    if z_loss > _Z_LOSS_WARN:
        warnings.warn(f"z_loss={z_loss} is above {_Z_LOSS_WARN}, which visibly hurts the training "
                      "loss by over-constraining the logit scale; PaLM uses 1e-4", stacklevel=3)
    return float(z_loss)


def _check_softcap(softcap: float | None) -> float | None:
    if softcap is None:
        return None
    if not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap={softcap!r} must be a positive float or None "
                         "(Gemma 2 caps final logits at 30.0)")
    return float(softcap)


def _check_target(target: torch.Tensor, name: str, lead: tuple[int, ...], n_classes: int,
                  device: torch.device, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened (safe target [N, 1] int64 with ignored -> 0, mask [N] bool)."""
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"target must be a tensor of class ids, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise ValueError(f"target dtype {target.dtype} must be an integer type (class ids, "
                         "torch.long); class probabilities are not supported")
    if tuple(target.shape) != lead:
        raise ValueError(f"target shape {tuple(target.shape)} must equal {name}.shape[:-1] = "
                         f"{lead}; flatten or slice them to match")
    if target.device != device:
        raise ValueError(f"target is on {target.device} but {name} is on {device}; "
                         "move them to one device")
    if not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index={ignore_index!r} must be an int (default -100)")
    t = target.reshape(-1).long()
    mask = t != ignore_index
    bad = mask & ((t < 0) | (t >= n_classes))
    if t.device.type == "cpu":
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"target[{i}] (flattened) = {int(t[i])} is outside [0, {n_classes}) "
                             f"and is not ignore_index={ignore_index}; check the vocabulary "
                             "size or the padding id")
    else:
        torch._assert_async(~bad.any(), f"target outside [0, {n_classes}) and not ignore_index")
    safe = torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))
    return safe.unsqueeze(1), mask


def _check_reduction(reduction: str, normalizer: float | torch.Tensor | None,
                     device: torch.device, dtype: torch.dtype) -> float | torch.Tensor | None:
    """Validate ``reduction`` and return 1 / normalizer (0 where it is 0), or None without one.

    A number stays a Python float and a tensor stays on its device: building a device tensor
    from a host number would be a copy that waits for the device."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} must be 'mean', 'sum' or 'none'")
    if normalizer is None:
        return None
    if reduction != "mean":
        raise ValueError(f"normalizer is used with reduction='mean' only (it replaces the count "
                         f"of counted tokens), got reduction={reduction!r}")
    if isinstance(normalizer, torch.Tensor):
        if normalizer.dim() != 0 or normalizer.dtype == torch.bool or normalizer.is_complex():
            raise ValueError(f"normalizer must be a 0-d real tensor (a token count), got shape "
                             f"{tuple(normalizer.shape)} and dtype {normalizer.dtype}")
        if normalizer.device != device:
            raise ValueError(f"normalizer is on {normalizer.device} but the loss inputs are on "
                             f"{device}; all-reduce the count on their device")
        n = normalizer.detach().to(dtype)
        bad = ~(n >= 0) | ~n.isfinite()
        if n.device.type == "cpu":
            if bool(bad):
                raise ValueError(f"normalizer={float(n)} must be a finite number >= 0 (the count "
                                 "of counted tokens across micro-batches and ranks)")
        else:
            torch._assert_async(~bad, "normalizer must be finite and >= 0")
        return torch.where(n > 0, n.reciprocal(), torch.zeros((), dtype=dtype, device=n.device))
    if (isinstance(normalizer, bool) or not isinstance(normalizer, (int, float))
            or not math.isfinite(normalizer) or normalizer < 0):
        raise ValueError(f"normalizer={normalizer!r} must be a finite number >= 0 or a 0-d "
                         "tensor (the count of counted tokens across micro-batches and ranks)")
    return 1.0 / normalizer if normalizer > 0 else 0.0


def _sequences(ce_t: torch.Tensor, lse_t: torch.Tensor, mask: torch.Tensor,
               lead: tuple[int, ...]) -> SequenceStats:
    """Per-sequence means from masked per-token ce and log Z (flat [N], 0 at ignored tokens)."""
    t = lead[-1] if lead else 1
    n = mask.reshape(-1, t).to(ce_t.dtype).sum(1)
    inv = 1.0 / n.clamp(min=1.0)
    return SequenceStats(ce_t.reshape(-1, t).sum(1) * inv, lse_t.reshape(-1, t).sum(1) * inv, n)


def _check_flag(value: bool, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")
    return value


def _chunk_rows(chunk_size: int | None, n_classes: int, dtype: torch.dtype, budget: int) -> int:
    if chunk_size is None:
        return max(1, budget // (n_classes * compute_dtype(dtype).itemsize))
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int (tokens per chunk) or "
                         "None to fit one chunk of logits in 64 MiB")
    return chunk_size


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    z_loss: float = 1e-4,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: Reduction = "mean",
    normalizer: float | torch.Tensor | None = None,
    per_sequence: bool = False,
) -> LossOutput:
    """Cross-entropy plus z-loss, returning log Z from the same pass.

    logits: [..., V] floating point; target: [...] integer class ids (or ``ignore_index``).
    ``loss = ce + z_loss * mean(logZ^2)`` over counted tokens. Note the default z_loss is 1e-4,
    not 0. With z_loss=0 and no softcap, ``ce``/``loss`` are F.cross_entropy's value up to
    rounding, not bit for bit (a logsumexp of its own sums in another order): within 2 ulp on
    float32 logits, 1e-14 on float64 (logits [64-512, 256-50k], scale 1-30, measured); the
    gradient is the same function, softmax - onehot over N, from its own kernel, equal up to
    rounding too (max abs difference 6e-10 to 6e-8 on those float32 logits, 1e-16 on float64),
    so a model trained with it follows F.cross_entropy's run only to rounding. With ``softcap``
    the logits are first mapped to softcap * tanh(logits / softcap), and log Z is the logsumexp of
    the capped logits. Gradient w.r.t. a (capped) logit: (p_j * (1 + 2 z_loss logZ) - y_j) / N,
    N the count of counted tokens (1 with "sum", ``normalizer`` when given). ``reduction`` and
    ``normalizer`` as in the module docstring; see LossOutput for the shapes; ``per_sequence``
    adds ``sequences`` (SequenceStats). The gradient has the logits' dtype; nothing syncs with
    the host (see the module docstring).
    """
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a floating-point tensor, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)}")
    if logits.dim() < 1:
        raise ValueError("logits must have a class dimension last: [..., V]")
    inv_norm = _check_reduction(reduction, normalizer, logits.device,
                                compute_dtype(logits.dtype))
    alpha, cap = _check_z_loss(z_loss), _check_softcap(softcap)
    per_sequence = _check_flag(per_sequence, "per_sequence")
    lead, v = tuple(logits.shape[:-1]), logits.shape[-1]
    tgt, mask = _check_target(target, "logits", lead, v, logits.device, ignore_index)
    budget = _CE_CHUNK_BYTES_CPU if logits.device.type == "cpu" else _CHUNK_BYTES
    rows = _chunk_rows(None, v, logits.dtype, budget)
    loss_t, lse_t, ce_t = CrossEntropyFn.apply(logits.reshape(-1, v).contiguous(), tgt, mask,
                                               alpha, cap, rows)
    seq = _sequences(ce_t, lse_t, mask, lead) if per_sequence else None
    if reduction == "none":
        return LossOutput(loss_t.view(lead), ce_t.view(lead), (alpha * lse_t.square()).view(lead),
                          lse_t.view(lead), seq, reduction="none")
    total = loss_t.sum()
    ce, z = ce_t.sum(), alpha * lse_t.square().sum()
    inv_n = 1.0 / mask.sum().clamp(min=1).to(total.dtype)
    log_z = lse_t.sum() * inv_n
    if reduction == "sum":
        return LossOutput(total, ce, z, log_z, seq, reduction="sum")
    if inv_norm is not None:
        return LossOutput(total * inv_norm, ce * inv_norm, z * inv_norm, lse_t.sum() * inv_norm,
                          seq, reduction="normalized")
    return LossOutput(total * inv_n, ce * inv_n, z * inv_n, log_z, seq)


def _check_linear(hidden: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[int, int]:
    """linear_cross_entropy's tensors: floating, [V, H] and [..., H], one dtype and device;
    returns (V, H)."""
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got shape {tuple(weight.shape)}")
    v, h = weight.shape
    if hidden.dim() < 1 or hidden.shape[-1] != h:
        raise ValueError(f"hidden shape {tuple(hidden.shape)} must end in H={h} (weight is "
                         f"{tuple(weight.shape)} = [V, H])")
    others = [("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    for name, t in others:
        if t.dtype != hidden.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from hidden dtype {hidden.dtype}; "
                             "cast them to one dtype (under torch.autocast the logits matmul "
                             "inside already runs in the autocast dtype, so the inputs may stay "
                             "in fp32)")
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}; "
                             "move them to one device")
    if bias is not None and tuple(bias.shape) != (v,):
        raise ValueError(f"bias shape {tuple(bias.shape)} must be ({v},) to match weight [V, H]")
    return v, h


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    z_loss: float = 1e-4,
    ignore_index: int = -100,
    softcap: float | None = None,
    chunk_size: int | None = None,
    reduction: Reduction = "mean",
    normalizer: float | torch.Tensor | None = None,
    per_sequence: bool = False,
) -> LossOutput:
    """``cross_entropy(hidden @ weight.T + bias, target, ...)`` without the [N, V] logits.

    hidden: [..., H]; weight: [V, H]; bias: [V] or None; target: [...] class ids. All floating
    tensors share one dtype and device. Tokens are processed ``chunk_size`` at a time (None: as
    many as fit one chunk of compute-dtype logits in 64 MiB); neither the full logits nor their
    gradient ever exist. With grad enabled, the gradients of hidden, weight and bias are computed
    during the forward pass (3 matmuls in all, like the unfused path) and held until backward:
    that costs one [V, H] buffer in the compute dtype plus one [N, H]. ``reduction`` and
    ``normalizer`` and ``per_sequence`` as in cross_entropy (the per-sequence sums are taken
    of per-token values the forward keeps anyway); with "none" the per-token weights arrive only in
    backward, so backward recomputes the logits chunk by chunk (one matmul more, no [V, H] or
    [N, H] buffer held between the passes). Outputs are in the compute dtype. The logits and
    hidden-gradient matmuls run in the input dtype; softmax math and the weight/bias gradients
    (matmul and the sum across chunks) in max(fp32, dtype). Under torch.autocast the logits
    matmul runs in the autocast dtype, as any F.linear does (the result equals this loss on
    inputs cast to that dtype); the gradient matmuls are not autocast.
    """
    v, h = _check_linear(hidden, weight, bias)
    inv_norm = _check_reduction(reduction, normalizer, hidden.device, compute_dtype(hidden.dtype))
    alpha, cap = _check_z_loss(z_loss), _check_softcap(softcap)
    per_sequence = _check_flag(per_sequence, "per_sequence")
    lead = tuple(hidden.shape[:-1])
    tgt, mask = _check_target(target, "hidden", lead, v, hidden.device, ignore_index)
    rows = _chunk_rows(chunk_size, v, hidden.dtype, _CHUNK_BYTES)
    h2 = hidden.reshape(-1, h)
    if reduction == "none":
        loss_t, lse_t, ce_t = LinearCrossEntropyTokensFn.apply(h2, weight, bias, tgt, mask, alpha,
                                                               cap, rows)
        return LossOutput(loss_t.view(lead), ce_t.view(lead), (alpha * lse_t.square()).view(lead),
                          lse_t.view(lead),
                          _sequences(ce_t, lse_t, mask, lead) if per_sequence else None,
                          reduction="none")
    kind = "sum" if reduction == "sum" else "mean" if inv_norm is None else "normalized"
    if reduction == "sum":
        inv_norm = 1.0
    if inv_norm is None:  # the default: the mean over this call's counted tokens
        out = LinearCrossEntropyFn.apply(h2, weight, bias, tgt, mask, alpha, cap, rows,
                                         torch.is_grad_enabled())
    else:
        out = LinearCrossEntropyFn.apply(h2, weight, bias, tgt, mask, alpha, cap, rows,
                                         torch.is_grad_enabled(), inv_norm, reduction == "sum")
    loss, ce, z_term, log_z, ce_m, lse_m = out
    return LossOutput(loss, ce, z_term, log_z,
                      _sequences(ce_m, lse_m, mask, lead) if per_sequence else None,
                      reduction=kind)


def router_z_loss(router_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(router_logits, -1)^2.

    router_logits: [..., n_experts]. mask: None (every token counts) or a bool / 0-1 integer
    tensor of shape router_logits.shape[:-1], True (1) at real tokens and False (0) at padding,
    as a tokenizer's attention_mask; the mean is then over real tokens only, padded rows are
    never read (a NaN there stays out of the loss and its gradient), and a fully padded batch
    gives 0 with zero gradients. Returns a differentiable scalar in max(fp32, dtype); the caller
    multiplies it by its coefficient (ST-MoE uses 1e-3). No host-device sync.
    """
    if not isinstance(router_logits, torch.Tensor) or not router_logits.dtype.is_floating_point:
        raise ValueError("router_logits must be a floating-point tensor [..., n_experts]")
    if router_logits.dim() < 1 or router_logits.shape[-1] == 0:
        raise ValueError(f"router_logits shape {tuple(router_logits.shape)} needs a non-empty "
                         "expert dimension last")
    x = router_logits.to(compute_dtype(router_logits.dtype))
    if mask is None:  # no tokens at all: 0, as a fully padded batch (a mean would be NaN)
        z2 = torch.logsumexp(x, dim=-1).square()
        return z2.mean() if z2.numel() else z2.sum()
    if not isinstance(mask, torch.Tensor) or mask.dtype.is_floating_point or mask.is_complex():
        raise ValueError(f"mask must be a bool or integer tensor (True/1 at real tokens), got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)}")
    if tuple(mask.shape) != tuple(router_logits.shape[:-1]):
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal router_logits.shape[:-1] = "
                         f"{tuple(router_logits.shape[:-1])}")
    if mask.device != router_logits.device:
        raise ValueError(f"mask is on {mask.device} but router_logits is on "
                         f"{router_logits.device}; move them to one device")
    keep = mask.bool()
    # zeros in padded rows, not a multiply by 0 afterwards: 0 * NaN would still be NaN
    x = torch.where(keep.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    m = keep.to(x.dtype)
    return (torch.logsumexp(x, dim=-1).square() * m).sum() / m.sum().clamp(min=1.0)
