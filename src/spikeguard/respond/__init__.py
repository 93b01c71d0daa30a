"""Respond: decide and act on a step (continue, skip, roll back, halt); docs/design.md."""
