"""Prevent: what the model, loss and optimizer do so that spikes are rare (docs/design.md)."""
