"""The per-step health record: the numbers every rule of the detector reads."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["StepMetrics"]


@dataclass
class StepMetrics:
    """One training step's health numbers, as host floats.

    ``loss`` and ``log_z`` are averaged over data-parallel ranks (``grad_stats(extras=...)``);
    ``grad_norm`` is the pre-clip global norm; ``nan_frac`` is the fraction of gradient elements
    that are NaN or Inf. Fields after ``nan_frac`` are optional: the detector computes
    ``loss_ema_ratio`` from its own EMA when it is None, and ``grad_scale`` is set only under fp16
    loss scaling.
    """

    step: int
    loss: float
    grad_norm: float
    log_z: float = math.nan
    nan_frac: float = 0.0
    loss_ema_ratio: float | None = None
    lr: float | None = None
    grad_scale: float | None = None
    extras: dict[str, Any] | None = field(default=None)

    def to_dict(self) -> dict[str, Any]:
        """Flat dict: the record keys of shared/DESIGN.md, extras merged under their own names."""
        d = asdict(self)
        extras = d.pop("extras") or {}
        d.update(extras)
        return d
