"""Synthetic metric streams (the worked scenarios) for tests, benchmarks and ``diagnose``, and
the detection-quality scoring of runs (``detection``: records in, numbers and targets out)."""

from . import detection, scenarios

__all__ = ["detection", "scenarios"]
