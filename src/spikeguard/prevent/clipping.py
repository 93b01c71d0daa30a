"""Adaptive gradient clipping, beside the fixed threshold (``GuardConfig.clip``).

``ClipConfig.clip_mode`` (``--clip-mode``) picks the rule; the fixed threshold, when set, stays
a ceiling on top of every mode (``--no-clip`` removes it):

- ``fixed``: ``min(1, clip / norm)``, one scalar for the model (torch's clip_grad_norm_).
- ``zscore``: the global norm against an EMA of its mean and variance (``zscore_alpha`` 0.97);
  a norm more than ``zscore_z`` (2.5) standard deviations above the mean is scaled down to
  ``mean + z std``, and the clipped norm is what enters the EMA (ZClip, Kumar et al., 2025).
  The first ``warmup`` kept steps only measure (plain mean and variance).
- ``adagc``: per tensor, ``||g_i||`` against ``lambda`` (1.05) times an EMA (beta 0.98) of its own
  clipped norms: a tensor above it is scaled down to it (AdaGC, Wang et al., 2025); the EMA
  starts as the mean of the first ``warmup`` kept steps.
- ``spam``: per element, a gradient whose square exceeds ``spam_k`` (5,000) times the
  optimizer's second moment is cut to ``sign(g) sqrt(spam_k v)``, and that element's first
  and second moments are reset to zero when the update is applied (SPAM, Huang et al., 2025).
  Element by element, so no collective; the fixed ceiling is computed from the norm measured
  before the cut (the cut only lowers it).

Every rule runs on the device without a host read, in float32 (float64 for float64 norms),
from numbers that are identical on every rank (the all-reduced global and per-tensor norms) or
purely local (SPAM's elements, whose moments live beside their shards), so a sharded run
clips exactly as one process does. Steps the gate withholds and non-finite norms never enter
the statistics. State (``state_dict``, JSON-ready: reading it syncs) travels with the guard's
checkpoints. A re-run without quarantined rows (attribution's drop) is clipped by the fixed
threshold alone and never enters the statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._dist import local_tensor
from .._validate import check_int, check_positive
from .update_bound import UpdateBoundConfig

__all__ = ["CLIP_MODES", "ClipConfig", "Clipper"]

CLIP_MODES = ("fixed", "zscore", "adagc", "spam")


@dataclass(kw_only=True, frozen=True)
class ClipConfig(UpdateBoundConfig):
    """How the guard clips the gradient, beside the fixed threshold (``GuardConfig.clip``), and
    the update bound beside it (``update_bound``, ``update_beta``: their fields, defaults and
    checks are ``prevent.update_bound.UpdateBoundConfig``'s, which this config extends)."""

    clip_mode: Literal["fixed", "zscore", "adagc", "spam"] = "fixed"
    """fixed (the threshold alone), zscore (the global norm's z-score), adagc (per-tensor EMA)
    or spam (per-element spikes against the second moment); the threshold stays a ceiling."""
    zscore_alpha: float = 0.97
    """zscore: EMA factor of the norm's mean and variance (ZClip's 0.97)."""
    zscore_z: float = 2.5
    """zscore: clip norms more than this many standard deviations above the mean (ZClip's 2.5)."""
    adagc_beta: float = 0.98
    """adagc: EMA factor of each tensor's clipped norm (AdaGC's 0.98)."""
    adagc_lambda: float = 1.05
    """adagc: a tensor's norm may exceed its EMA by this factor before it is clipped (1.05)."""
    spam_k: float = 5000.0
    """spam: an element is cut where g^2 > spam_k x its second moment (SPAM's 5,000)."""
    warmup: int = 25
    """zscore, adagc and the update bound: kept steps that only measure before the rule acts."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(f"ClipConfig.clip_mode={self.clip_mode!r} must be one of "
                             f"{', '.join(CLIP_MODES)}")
        for name in ("zscore_alpha", "adagc_beta"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ValueError(f"ClipConfig.{name}={value} must be in (0, 1) (an EMA factor; "
                                 f"{getattr(type(self), name)} is the default)")
        check_positive(self.zscore_z, "ClipConfig.zscore_z", default=2.5)
        check_positive(self.spam_k, "ClipConfig.spam_k", default=5000.0)
        if not self.adagc_lambda >= 1.0:
            raise ValueError(f"ClipConfig.adagc_lambda={self.adagc_lambda} must be >= 1 (a norm "
                             f"may exceed its EMA by this factor; AdaGC uses 1.05)")
        check_int(self.warmup, "ClipConfig.warmup", minimum=1, default=25)


class Clipper:
    """The clipping rule of one run over ``params`` (the guard's), with its device state.

    ``clip_(stats, optimizer, skip)`` takes the step's GradStats (global ``norm``; with
    ``per_tensor`` True, ``tensor_norms``), clips the gradients in place and returns the
    0-d coefficient of the global norm (clipped norm / norm; 1 when nothing was clipped).
    """

    def __init__(self, config: ClipConfig | None, max_norm: float | None,
                 params: list[torch.Tensor]) -> None:
        self.config = config or ClipConfig()
        self.mode = self.config.clip_mode
        self.max_norm, self.params = max_norm, params
        self._state: dict[str, torch.Tensor] = {}

    @property
    def per_tensor(self) -> bool:
        """Whether the rule needs each parameter's global gradient norm (one more entry per
        parameter in the step's all-reduce, no more collectives)."""
        return self.mode == "adagc"

    @property
    def active(self) -> bool:
        """Whether anything clips at all."""
        return self.mode != "fixed" or self.max_norm is not None

    def _get(self, name: str, like: torch.Tensor, shape: tuple[int, ...] = ()) -> torch.Tensor:
        t = self._state.get(name)
        if t is None or t.device != like.device:
            t = torch.zeros(shape, dtype=like.dtype, device=like.device) if t is None else t.to(like)
            self._state[name] = t
        return t

    def _ceiling(self, norm: torch.Tensor) -> torch.Tensor:
        if self.max_norm is None:
            return torch.ones_like(norm)
        return (self.max_norm / (norm + 1e-6)).clamp(max=1.0)

    @torch.no_grad()
    def clip_(self, stats: Any, optimizer: torch.optim.Optimizer,
              skip: torch.Tensor) -> torch.Tensor:
        """Clip the step's gradients in place (module docstring); returns the global coefficient.
        ``skip``: the 0-d gate of this step (a withheld update folds nothing into the state)."""
        norm = stats.norm
        finite = torch.isfinite(norm)
        keep = finite & ~skip.to(norm.device, torch.bool).reshape(())
        if self.mode == "zscore":
            coef = self._zscore(norm, keep)
        elif self.mode == "adagc":
            return self._adagc(stats, keep)
        else:
            if self.mode == "spam":
                self._spam(optimizer, keep)
            coef = self._ceiling(norm)
        coef = torch.where(finite, coef, torch.ones_like(coef))
        stats.scale_(coef)
        return coef

    def _zscore(self, norm: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        n, mean, var = (self._get(k, norm) for k in ("n", "mean", "var"))
        warm = n >= cfg.warmup
        thr = mean + cfg.zscore_z * var.clamp(min=0).sqrt()
        coef = torch.where(warm & (norm > thr), thr / (norm + 1e-6), torch.ones_like(norm))
        coef = torch.minimum(coef, self._ceiling(norm))
        x = torch.where(keep, norm * coef, mean)
        # warmup: the running mean and variance of the kept norms (a = n / (n + 1)); then their
        # EMA; both are var' = a (var + (1 - a) delta^2)
        a = torch.where(warm, torch.full_like(norm, cfg.zscore_alpha), n / (n + 1))
        delta = x - mean
        mean.copy_(torch.where(keep, mean + (1 - a) * delta, mean))
        var.copy_(torch.where(keep, a * (var + (1 - a) * delta * delta), var))
        n.add_(keep.to(n.dtype))
        return coef

    def _adagc(self, stats: Any, keep: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        norm, tn = stats.norm, stats.tensor_norms
        n = self._get("n", norm)
        gamma = self._get("gamma", tn, tuple(tn.shape))
        warm = n >= cfg.warmup
        limit = cfg.adagc_lambda * gamma
        s = torch.where(warm & (gamma > 0) & (tn > limit), limit / (tn + 1e-6), torch.ones_like(tn))
        clipped = (s * tn).square().sum().sqrt()
        ceiling = self._ceiling(clipped)
        coefs = s * ceiling
        finite = torch.isfinite(norm)
        coefs = torch.where(finite, coefs, torch.ones_like(coefs))
        stats.scale_tensors_(coefs)
        x = s * tn
        a = torch.where(warm, torch.full_like(norm, cfg.adagc_beta), n / (n + 1))
        gamma.copy_(torch.where(keep, a * gamma + (1 - a) * x, gamma))
        n.add_(keep.to(n.dtype))
        coef = torch.where(norm > 0, clipped * ceiling / (norm + 1e-30), torch.ones_like(norm))
        return torch.where(finite, coef, torch.ones_like(coef))

    def _spam(self, optimizer: torch.optim.Optimizer, keep: torch.Tensor) -> None:
        k = self.config.spam_k
        for p in self.params:
            st = optimizer.state.get(p)
            if p.grad is None or not st or "exp_avg_sq" not in st:
                continue
            g, v = local_tensor(p.grad), local_tensor(st["exp_avg_sq"])
            if not g.numel():
                continue
            limit = (k * v.float()).sqrt()
            fired = g.float().abs() > limit
            g.copy_(torch.where(fired, limit.copysign(g.float()), g.float()).to(g.dtype))
            reset = fired & keep.to(fired.device)
            for name in ("exp_avg", "exp_avg_sq"):
                if name in st:
                    m = local_tensor(st[name])
                    m.masked_fill_(reset, 0.0)

    def state_dict(self) -> dict[str, Any]:
        """The mode and its statistics as lists (a host read)."""
        dtype = next((str(v.dtype).removeprefix("torch.") for v in self._state.values()),
                     "float32")
        return {"mode": self.mode, "dtype": dtype,
                **{k: v.tolist() for k, v in self._state.items()}}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (None or another mode's state: start fresh)."""
        self._state = {}
        if not state or state.get("mode") != self.mode:
            return
        dtype = getattr(torch, state.get("dtype", "float32"))
        for k, v in state.items():
            if k not in ("mode", "dtype"):
                self._state[k] = torch.tensor(v, dtype=dtype)
