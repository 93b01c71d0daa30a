"""Respond: see shared/DESIGN.md."""
