"""The one place diagnose touches the spike detector: its public names, and the Guard's rollback
rule restated without the checkpoint module (which needs torch; diagnose reads a CSV without it).

Everything else in ``spikeguard.diagnose`` imports the detector from here, so a move of the
detector is one line to change.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..detector.detector import DetectorConfig, SpikeDetector, Verdict

__all__ = ["DetectorConfig", "SpikeDetector", "Verdict", "rollback_target"]


def rollback_target(onset: int, checkpoints: int | Iterable[int]) -> int | None:
    """The checkpoint to restore for an anomaly first seen at step ``onset``: the newest at or
    before ``onset - 2`` (a checkpoint at step s holds the state after update s, and update
    ``onset - 1`` may itself be the cause), or None. ``checkpoints`` is the save interval (every
    k steps from k) or the steps that exist. The same rule as the Guard's
    (``CheckpointManager``'s ``rollback_target``; tests/test_diagnose.py compares the two)."""
    limit = onset - 2
    if isinstance(checkpoints, int):
        step = limit // checkpoints * checkpoints
        return step if step >= checkpoints else None
    return max((s for s in checkpoints if s <= limit), default=None)
