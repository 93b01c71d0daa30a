"""Which checkpoints retention may delete, and where a replay puts the one it would overwrite.

One rule for every stack (spikeguard's CheckpointManager, torchtitan's and OLMo-core's folders
through the integrations): keep the newest ``keep``, never the newest healthy one, and, while an
incident is open, the ``keep`` newest healthy checkpoints from before it as well, counted apart
from the ``keep`` (a rollback, or a person, needs one from before the onset; the incident's own
checkpoints must not push it out). An incident opens at the first unhealthy checkpoint (an alert
in its window) and closes once ``keep`` healthy checkpoints follow its last unhealthy one: the
retention window then holds only checkpoints written after it.

A rollback replays steps whose checkpoints exist already; the replay's checkpoint of such a
step must not overwrite the one written the first time (it may be the evidence of what went
wrong, or the only copy of a state a person wants back): ``set_aside`` moves it into
``superseded/`` beside the checkpoints, under a name no checkpoint listing matches.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

__all__ = ["SUPERSEDED", "Listed", "protected", "set_aside", "stale"]

SUPERSEDED = "superseded"
"""The folder, beside the checkpoints, that holds the ones a replay would have overwritten."""


class Listed(Protocol):
    """What retention reads of a checkpoint (``CheckpointInfo`` has both)."""

    step: int
    healthy: bool


def _open_incident(ckpts: Sequence[Listed], keep: int) -> int | None:
    """The index of the first unhealthy checkpoint of the incident still open, or None."""
    start, clean = None, 0
    for i, c in enumerate(ckpts):
        if not c.healthy:
            start = i if start is None else start
            clean = 0
        elif start is not None:
            clean += 1
            if clean >= keep:
                start, clean = None, 0
    return start


def protected(checkpoints: Sequence[Listed], keep: int) -> list[Listed]:
    """The healthy checkpoints kept apart from ``keep`` because an incident is open: the
    ``keep`` newest written before its first unhealthy checkpoint (none when no incident is
    open). ``checkpoints`` in any order."""
    ckpts = sorted(checkpoints, key=lambda c: c.step)
    start = _open_incident(ckpts, keep)
    if start is None:
        return []
    return [c for c in ckpts[:start] if c.healthy][-keep:]


def stale(checkpoints: Sequence[Listed], keep: int) -> list[Listed]:
    """The checkpoints retention deletes, oldest first: all but the newest ``keep``, never the
    newest healthy one, never one ``protected`` keeps."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be at least 1")
    ckpts = sorted(checkpoints, key=lambda c: c.step)
    healthy = [c for c in ckpts if c.healthy]
    newest = healthy[-1] if healthy else None
    apart = {id(c) for c in protected(ckpts, keep)}
    rest = [c for c in ckpts if id(c) not in apart]
    excess, out = len(rest) - keep, []
    for c in rest:
        if excess <= 0:
            break
        if c is not newest:
            out.append(c)
            excess -= 1
    return out


def set_aside(path: str | os.PathLike[str]) -> Path | None:
    """Move the checkpoint folder ``path`` into ``superseded/`` beside it (``name.1``,
    ``name.2``, ... : a step replayed twice keeps both); returns where it went, None when
    there was nothing at ``path``. Call it on one rank, before the replay writes ``path``."""
    path = Path(path)
    if not path.exists():
        return None
    folder = path.parent / SUPERSEDED
    folder.mkdir(exist_ok=True)
    n = 1
    while (folder / f"{path.name}.{n}").exists():
        n += 1
    dest = folder / f"{path.name}.{n}"
    os.replace(path, dest)
    return dest
