"""The run directory of ``spikeguard train``: checked before anything is built, started over with
``--fresh`` (saying what that removes), checkpointed at the interval and at the last step (so a
finished run reruns as finished), and trimmed back to the checkpoint a run resumes from."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from .. import _dist
from ..checkpoint import CheckpointManager
from .config import TrainConfig

__all__ = ["RunCheckpoints", "TrainInterrupted", "check_out", "cut_quarantine", "prepare_out",
           "resume_step"]

_RUN_FILES = ("metrics.jsonl", "quarantine.jsonl", "config.json", "run.png")


class TrainInterrupted(Exception):
    """Ctrl-C (SIGINT) stopped the run at ``step``; ``resume_from`` is the checkpoint a rerun of
    the same command resumes from (None: there is none yet, a rerun starts at step 0)."""

    def __init__(self, step: int, resume_from: int | None) -> None:
        self.step, self.resume_from = step, resume_from
        where = (f"resume from the checkpoint at step {resume_from}" if resume_from is not None
                 else "start over (no checkpoint was saved yet)")
        super().__init__(f"interrupted at step {step}; rerun the same command to {where}")


class RunCheckpoints(CheckpointManager):
    """A CheckpointManager that also saves after the run's last update (``last_step``), so a
    rerun of a finished run finds it finished instead of training the tail again."""

    def __init__(self, directory: str | Path, *, last_step: Callable[[], int],
                 **kwargs: Any) -> None:
        super().__init__(directory, **kwargs)
        self.last_step = last_step  # a callable: made-up skips move the run's end

    def should_save(self, step: int) -> bool:
        return super().should_save(step) or step == self.last_step()


def resume_step(manager: CheckpointManager | None) -> int | None:
    """The step of the newest healthy checkpoint (what a rerun resumes from), or None."""
    if manager is None:
        return None
    return max((c.step for c in manager.list() if c.healthy), default=None)


def check_out(out: Path) -> None:
    """ValueError naming ``--out`` and the fix when it is not a directory this process can write."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory; choose another --out (a "
                         f"directory, created when missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        if _dist.rank() == 0:
            probe = out / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
    except OSError as exc:
        why = {errno.EROFS: "is on a read-only file system", errno.EACCES: "is not writable",
               errno.EPERM: "is not writable", errno.ENOSPC: "is on a full disk"}.get(
                   exc.errno or 0, f"cannot be written ({exc.strerror or exc})")
        raise ValueError(f"--out {out} {why}; choose a writable --out") from None


def _describe_old_run(out: Path) -> list[str]:
    ckpts = sorted((out / "checkpoints").glob("step_*")) if (out / "checkpoints").is_dir() else []
    parts = []
    if ckpts:
        steps = [int(p.name.split("_")[1]) for p in ckpts if p.name.split("_")[1].isdigit()]
        span = f"steps {min(steps)}..{max(steps)}" if steps else "unreadable"
        parts.append(f"{len(ckpts)} checkpoint(s) ({span})")
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        lines = metrics.read_bytes().count(b"\n")
        parts.append(f"metrics.jsonl ({lines} records)")
    parts += [name for name in _RUN_FILES[1:] if (out / name).is_file()]
    return parts


def prepare_out(cfg: TrainConfig, out: Path, run_hash: str, console: Console) -> bool:
    """Returns whether to resume. Refuses a directory holding another config's run; under
    ``--fresh`` removes the earlier run and says what it removed."""
    meta = out / "config.json"
    ckpts = out / "checkpoints"
    if cfg.fresh and _dist.rank() == 0:
        old = _describe_old_run(out)
        if old:
            console.print(f"--fresh: removing the earlier run in {out}: {', '.join(old)}")
        shutil.rmtree(ckpts, ignore_errors=True)
        for name in _RUN_FILES:
            (out / name).unlink(missing_ok=True)
    _dist.barrier()
    if cfg.fresh or not meta.is_file():
        return False
    saved = json.loads(meta.read_text()).get("run_hash")
    has_ckpt = any(ckpts.glob("step_*/MANIFEST.json")) if ckpts.is_dir() else False
    if saved != run_hash and (has_ckpt or (out / "metrics.jsonl").exists()):
        raise ValueError(f"--out {out} holds a run of another config or data (hash "
                         f"{str(saved)[:12]} vs {run_hash[:12]}); pass --fresh to start over "
                         f"there or choose another --out")
    if not has_ckpt and _dist.rank() == 0:
        # an earlier attempt died before its first checkpoint: its steps run again from 0
        (out / "metrics.jsonl").unlink(missing_ok=True)
    return has_ckpt


def cut_quarantine(path: Path, last_step: int) -> None:
    """Keep the quarantine lines of steps up to ``last_step`` (the checkpoint being resumed)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line).get("step", -1) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)
