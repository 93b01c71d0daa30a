"""What a checkpoint is to its callers: its info, its errors, the rollback rule."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .._validate import check_int

__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointWarning",
           "rollback_target"]


class CheckpointError(RuntimeError):
    """No checkpoint could be restored (each refusal is listed), or one could not be committed."""


class CheckpointWarning(UserWarning):
    """A checkpoint was refused (integrity or safety check failed); an older one is used."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint as listed by the manager."""

    step: int
    """Training step whose post-update state it holds."""
    path: Path
    """Its directory."""
    healthy: bool
    """False when an alert was raised in its window (since the previous checkpoint)."""
    alerts: tuple[str, ...] = ()
    """The alerts raised in its window, as given to save()."""
    skip_ranges: tuple[tuple[int, int], ...] = ()
    """Data ranges [start, stop] (batch indices, inclusive) skipped so far by the data stream."""
    meta: dict = field(default_factory=dict)
    """Free-form JSON metadata given to save()."""


def rollback_target(onset: int, checkpoints: int | Iterable[int]) -> int | None:
    """The step of the checkpoint to roll back to for an anomaly first seen at step ``onset``:
    the newest checkpoint at or before ``onset - 2``, or None when there is none.

    A checkpoint at step s holds the state after update s, and the update at ``onset - 1`` may
    itself be the cause (a bad learning rate's first update looks normal in its own gradients),
    so the checkpoint at ``onset - 1`` is not safe. ``checkpoints`` is the interval of saves
    (every k steps from k) or the steps that exist. Every 1,000 steps: onset 57,182 -> 57,000;
    onset 57,001 -> 56,000."""
    limit = onset - 2
    if isinstance(checkpoints, int):
        check_int(checkpoints, "rollback_target checkpoints", hint="pass the save interval")
        step = limit // checkpoints * checkpoints
        return step if step >= checkpoints else None
    return max((s for s in checkpoints if s <= limit), default=None)
