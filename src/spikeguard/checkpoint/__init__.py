"""Checkpoints that roll back safely: the manager, the safe reader, files and digests."""

from .manager import (
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    CheckpointWarning,
    rollback_target,
    verify_checkpoint,
)

__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointManager", "CheckpointWarning",
           "rollback_target", "verify_checkpoint"]
