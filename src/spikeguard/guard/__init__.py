"""The Guard and its parts: one call per optimizer step (docs/design.md walks one step); the
adapter surface for frameworks that own the loop (docs/adapters.md)."""

from .adapter import DataSource, Decision, GuardMisuseWarning, RowDropSource
from .attribution import AttributionConfig
from .forensics import HaltReport, TrainingHalted
from .guard import Guard, GuardConfig
from .optimizer import GuardedOptimizer
from .responses import LowerLrConfig
from .stateful import GuardState

__all__ = ["AttributionConfig", "DataSource", "Decision", "Guard", "GuardConfig", "GuardMisuseWarning",
           "GuardState", "GuardedOptimizer", "HaltReport", "LowerLrConfig", "RowDropSource",
           "TrainingHalted"]
