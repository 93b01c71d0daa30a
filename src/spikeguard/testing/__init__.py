"""Synthetic metric streams (the worked scenarios) for tests, benchmarks and ``diagnose``."""

from . import scenarios

__all__ = ["scenarios"]
