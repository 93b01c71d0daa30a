"""The save side's helpers of ``checkpoint.py``: one save's job, the ranks' agreement on a
write, and what a failed save says."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import _dist
from . import _ckpt_io as io
from ._ckpt_files import FileEntry, IOStats

__all__ = ["Job", "agree", "failure_message", "make_tmp"]


@dataclass
class Job:
    """One save from the moment its state is captured: what the writer thread needs."""

    step: int
    directory: Path
    side: Any
    """This rank's sidecar, already encoded for JSON."""
    info: dict
    records: dict[str, FileEntry] = field(default_factory=dict)
    """File name -> manifest entry, for the files this rank wrote."""
    stats: IOStats = field(default_factory=IOStats)

    @property
    def final(self) -> Path:
        return self.directory / f"step_{self.step:08d}"

    @property
    def tmp(self) -> Path:
        return self.directory / f".tmp-step_{self.step:08d}"


def agree(error: BaseException | None, group: Any) -> None:
    """Every rank goes on, or every rank raises (this rank's error, or a note of another's)."""
    if not _dist.all_true(error is None, group):
        raise error or RuntimeError("another rank could not write its part of the checkpoint")


def make_tmp(job: Job, group: Any) -> None:
    """Rank 0 makes the save's empty temporary directory; every rank waits for it (or raises
    with rank 0 when it could not be made)."""
    error = None
    if _dist.rank() == 0:
        try:
            job.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(job.tmp, ignore_errors=True)
            job.tmp.mkdir()
        except OSError as e:
            error = e
    agree(error, group)  # also the barrier: the directory exists


def failure_message(step: int, directory: Path, exc: BaseException, done: list[Any],
                    on_error: str) -> str:
    """One paragraph: what failed, whether the disk is full, what is intact (``done``: the
    committed checkpoints), what to do."""
    full, what = io.save_failure(exc)
    done = [c.step for c in done]
    msg = (f"the checkpoint at step {step} could not be saved in {directory} ({what})"
           + ("; the disk is full (or a quota or file size limit is reached)" if full else "")
           + "; its partial files were removed and "
           + (f"the checkpoint at step {done[-1]} is intact" if done else "no checkpoint exists"))
    if on_error == "raise":
        fix = "free space" if full else "fix the cause"
        return msg + (f"; {fix} and rerun to resume from it" if done else "") + \
            ", or use on_error='warn' to train on without saving"
    return msg + "; training goes on without it (on_error='warn') and the next save tries again"
