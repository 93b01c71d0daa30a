"""Learning-rate schedules: picklable callables ``step -> multiplier`` for LambdaLR."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["constant_with_warmup"]


@dataclass(frozen=True)
class constant_with_warmup:
    """Multiplier (s + 1) / W for s < W, then 1.0."""

    warmup_steps: int

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return 1.0
