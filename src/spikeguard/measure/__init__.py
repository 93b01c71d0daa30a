"""Detect: measure each step at near-zero cost (docs/design.md, "Layers")."""
