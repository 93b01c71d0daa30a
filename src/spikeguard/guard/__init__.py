"""The Guard and its parts: one call per optimizer step (docs/design.md walks one step)."""

from .attribution import AttributionConfig
from .forensics import HaltReport, TrainingHalted
from .guard import Guard, GuardConfig
from .optimizer import GuardedOptimizer

__all__ = ["AttributionConfig", "Guard", "GuardConfig", "GuardedOptimizer", "HaltReport",
           "TrainingHalted"]
