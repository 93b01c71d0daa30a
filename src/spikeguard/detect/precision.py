"""Precision policies: bf16-mixed (the default), fp16-mixed with torch's GradScaler, fp32.

The rule under all three: compute may be 16-bit, but everything that accumulates over time stays
fp32 (master weights, AdamW moments, micro-batch gradient accumulation).

How the guard's skip merges with GradScaler's (fp16-mixed):

1. ``scaler.scale(loss).backward()``, then ``policy.unscale_(optimizer)``: the grads are now true
   gradients and the scaler has recorded, per device, whether any was inf/NaN (``found_inf``).
2. The guard measures those unscaled grads. A non-finite norm there *is* the scaler's overflow:
   the detector reports it as tier 0, SKIP, reason "scaler" (StepMetrics.grad_scale is set).
3. ``policy.step(optimizer, skip=guard_skip)``: with ``skip`` true the optimizer is never
   called, so params, moments and step count are untouched; otherwise ``scaler.step`` runs and
   itself skips on the recorded overflow (on fused AdamW through ``optimizer.found_inf``, which the
   scaler sets and deletes around its step, so the guard never writes that attribute itself).
4. ``scaler.update()`` runs in both cases and reads only the overflow recorded in step 1: the scale
   halves on a real overflow and never because the guard skipped for a spike.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["PrecisionPolicy", "bf16_supported"]

Kind = Literal["bf16-mixed", "fp16-mixed", "fp32"]


def bf16_supported(device: torch.device | str) -> bool:
    """bf16 autocast is used on CUDA, and on CPU only where oneDNN has bf16 kernels."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


@dataclass(kw_only=True, frozen=True)
class PrecisionPolicy:
    """Which dtypes compute, store and accumulate, and the loss scaler for fp16."""

    kind: Kind = "bf16-mixed"
    """bf16-mixed (default), fp16-mixed (dynamic loss scaling) or fp32."""
    device: str = "cpu"
    """Device type the model runs on ("cpu" or "cuda")."""
    init_scale: float = 2.0**16
    """fp16 only: GradScaler's starting scale (the seeds: about 2^15 to 2^20)."""
    growth_interval: int = 2000
    """fp16 only: clean steps before GradScaler doubles the scale."""

    def __post_init__(self) -> None:
        if self.kind not in ("bf16-mixed", "fp16-mixed", "fp32"):
            raise ValueError(f"PrecisionPolicy.kind={self.kind!r} must be 'bf16-mixed', "
                             f"'fp16-mixed' or 'fp32'")
        if not self.init_scale > 0:
            raise ValueError(f"PrecisionPolicy.init_scale={self.init_scale} must be positive")
        if self.growth_interval < 1:
            raise ValueError(f"PrecisionPolicy.growth_interval={self.growth_interval} must be >= 1")
        scaler = (torch.amp.GradScaler(self.device, init_scale=self.init_scale,
                                       growth_interval=self.growth_interval)
                  if self.kind == "fp16-mixed" else None)
        object.__setattr__(self, "_scaler", scaler)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in under autocast (fp32 when autocast is off)."""
        if self.kind == "fp16-mixed":
            return torch.float16
        if self.kind == "bf16-mixed" and bf16_supported(self.device):
            return torch.bfloat16
        return torch.float32

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """torch's GradScaler under fp16-mixed, else None."""
        return self._scaler  # type: ignore[attr-defined]

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward pass context: autocast to the compute dtype, or nothing under fp32."""
        dtype = self.compute_dtype
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=dtype)

    def fsdp_mp_policy(self):
        """FSDP2's MixedPrecisionPolicy: 16-bit params for compute, fp32 gradient reduction (and
        so fp32 accumulation of unsharded grads across micro-batches). None under fp32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.kind == "fp32":
            return None
        param_dtype = torch.float16 if self.kind == "fp16-mixed" else torch.bfloat16
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the scale under fp16, else as it is."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the grads by the scale in place (fp16); a no-op otherwise."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *, skip: bool = False) -> None:
        """Apply the update unless the guard skips; under fp16 the scaler also skips on its own
        overflow, and its scale is updated from the overflow alone (see the module docstring)."""
        if self.scaler is None:
            if not skip:
                optimizer.step()
            return
        if skip:
            # update() needs the overflow check that unscale_ records; make sure it ran
            # (private state: GradScaler has no public "was unscaled" query)
            from torch.amp.grad_scaler import OptState

            state = self.scaler._per_optimizer_states[id(optimizer)]
            if state["stage"] is OptState.READY:
                self.scaler.unscale_(optimizer)
        else:
            self.scaler.step(optimizer)
        self.scaler.update()

    def grad_scale(self) -> float | None:
        """The current loss scale (a host read) under fp16, else None."""
        return None if self.scaler is None else float(self.scaler.get_scale())

    def state_dict(self) -> dict:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
