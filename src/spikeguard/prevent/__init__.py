"""Prevent: see shared/DESIGN.md."""
