"""Detect: see shared/DESIGN.md."""
