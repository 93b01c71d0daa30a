"""Precision policies: bf16-mixed, fp16-mixed with torch's GradScaler, fp32.

The rule under all three: compute may be 16-bit, but everything that accumulates over time stays
fp32 (master weights, AdamW moments, micro-batch gradient accumulation).

``PrecisionPolicy`` is the frozen config (what a run asks for). ``policy.runtime(model)`` builds a
``PrecisionRuntime`` on the model's device: the live side, which owns the autocast context and
the GradScaler and its state. The optimizer step with a skip gate is the guard's
(``spikeguard.guard.step.apply_update``), the one place an update is applied or withheld. The device always comes from
the model (or is given explicitly), so a CPU autocast can never wrap a CUDA model.

How a skip merges with GradScaler's own (fp16-mixed):

1. ``runtime.scale(loss).backward()``, then ``runtime.unscale_(optimizer)``: the grads are now
   true gradients and the scaler has recorded, per device, whether any was inf/NaN.
2. The guard measures those unscaled grads. A non-finite norm there *is* the scaler's overflow:
   the detector reports it as tier 0, SKIP, reason "scaler" (StepMetrics.grad_scale is set).
3. ``apply_update(runtime, optimizer, skip=gate)`` (spikeguard.guard.step): ``gate`` is a bool or a 0-d tensor (1 = skip).
   On an optimizer that takes ``found_inf`` (fused Adam/AdamW/SGD), the gate is OR-ed with the
   scaler's overflow into ``optimizer.found_inf`` for this one step: the fused kernel leaves
   params, moments and the step count untouched, with no host read. Any other optimizer reads the
   gate once on the host and is not called at all on a skip; otherwise ``scaler.step`` runs and
   skips on the overflow itself.
4. ``scaler.update()`` runs in every case and reads only the overflow recorded in step 1: the
   scale halves on a real overflow and never because the guard skipped for a spike.

Without a scaler (bf16-mixed, fp32) step 3 is the same gate without the overflow.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .._dist import local_tensor
from .._validate import check_int, check_positive

__all__ = ["PrecisionPolicy", "PrecisionRuntime", "bf16_supported"]

Kind = Literal["bf16-mixed", "fp16-mixed", "fp32"]


def bf16_supported(device: torch.device | str) -> bool:
    """bf16 autocast is used on CUDA, and on CPU only where oneDNN has bf16 kernels."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def _device_of(where: nn.Module | torch.device | str) -> torch.device:
    if isinstance(where, nn.Module):
        for p in where.parameters():
            return local_tensor(p).device
        raise ValueError("the model has no parameters to take a device from; pass the device")
    return torch.device(where)


@dataclass(kw_only=True, frozen=True)
class PrecisionPolicy:
    """Which dtypes compute, store and accumulate, and the loss scaler for fp16."""

    kind: Kind = "bf16-mixed"
    """bf16-mixed (default), fp16-mixed (dynamic loss scaling) or fp32."""
    init_scale: float = 2.0**16
    """fp16 only: GradScaler's starting scale (2^16, torch's default)."""
    growth_interval: int = 2000
    """fp16 only: clean steps before GradScaler doubles the scale."""

    def __post_init__(self) -> None:
        if self.kind not in ("bf16-mixed", "fp16-mixed", "fp32"):
            raise ValueError(f"PrecisionPolicy.kind={self.kind!r} must be 'bf16-mixed', "
                             f"'fp16-mixed' or 'fp32'")
        check_positive(self.init_scale, "PrecisionPolicy.init_scale", default=2.0**16)
        check_int(self.growth_interval, "PrecisionPolicy.growth_interval", default=2000)

    @classmethod
    def default_for(cls, device: torch.device | str) -> PrecisionPolicy:
        """bf16-mixed where bf16 autocast is fast (CUDA with bf16), fp32 elsewhere (CPU)."""
        device = torch.device(device)
        return cls(kind="bf16-mixed" if device.type == "cuda" and bf16_supported(device)
                   else "fp32")

    def compute_dtype(self, device: torch.device | str) -> torch.dtype:
        """The dtype matmuls run in under autocast on ``device`` (fp32 when autocast is off)."""
        if self.kind == "fp16-mixed":
            return torch.float16
        if self.kind == "bf16-mixed" and bf16_supported(device):
            return torch.bfloat16
        return torch.float32

    def fsdp_mp_policy(self):
        """FSDP2's MixedPrecisionPolicy: 16-bit params for compute, fp32 gradient reduction (and
        so fp32 accumulation of unsharded grads across micro-batches). None under fp32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.kind == "fp32":
            return None
        param_dtype = torch.float16 if self.kind == "fp16-mixed" else torch.bfloat16
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)

    def runtime(self, where: nn.Module | torch.device | str) -> PrecisionRuntime:
        """The live side of this policy on the device of ``where`` (a model or a device)."""
        return PrecisionRuntime(self, _device_of(where))


class PrecisionRuntime:
    """A policy on one device: autocast and the GradScaler (fp16).

    Build it with ``PrecisionPolicy.runtime(model)``. ``state_dict`` / ``load_state_dict`` hold
    the scaler's state (empty without one), so a checkpoint manager can save it as "scaler".
    """

    def __init__(self, policy: PrecisionPolicy, device: torch.device) -> None:
        self.policy = policy
        self.device = torch.device(device)
        self.compute_dtype = policy.compute_dtype(self.device)
        self.scaler: torch.amp.GradScaler | None = None
        if policy.kind == "fp16-mixed":
            self.scaler = torch.amp.GradScaler(self.device.type, init_scale=policy.init_scale,
                                               growth_interval=policy.growth_interval)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward pass context: autocast to the compute dtype, or nothing under fp32."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the scale under fp16, else as it is."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the grads by the scale in place (fp16; once per step); a no-op otherwise."""
        if self.scaler is not None and self._stage(optimizer) == "ready":
            self.scaler.unscale_(optimizer)

    def _stage(self, optimizer: torch.optim.Optimizer) -> str:
        # GradScaler has no public "was unscaled" query; its per-optimizer state says
        from torch.amp.grad_scaler import OptState

        stage = self.scaler._per_optimizer_states[id(optimizer)]["stage"]
        return {OptState.READY: "ready", OptState.UNSCALED: "unscaled"}.get(stage, "stepped")

    def overflow(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The scaler's own overflow flag for this step (0-d float32, 1.0 = inf/NaN found), after
        ``unscale_``; None without a scaler. No host read."""
        if self.scaler is None:
            return None
        self.unscale_(optimizer)
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        flags = [t.to(self.device, torch.float32) for t in found.values()]
        return torch.stack(flags).amax() if flags else torch.zeros((), device=self.device)

    def scale_tensor(self) -> torch.Tensor | None:
        """The current loss scale as a 0-d tensor on the device (no sync); None without fp16."""
        return None if self.scaler is None else self.scaler._get_scale_async()

    def grad_scale(self) -> float | None:
        """The current loss scale (a host read) under fp16, else None."""
        return None if self.scaler is None else float(self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
