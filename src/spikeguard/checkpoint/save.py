"""The save side's helpers of ``checkpoint.py``: one save's job, async staging, the ranks'
agreement on a write, and what a failed save says."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import _dist
from . import io
from .files import FileEntry, IOStats
from .load import INFO

__all__ = ["Job", "Staging", "agree", "failure_message", "interrupt_of", "make_tmp", "manifest"]


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


class Staging:
    """An async save's copy of the state, mostly off the training thread.

    What only ``optimizer.step()`` changes (the parameters and the optimizer's per-parameter
    state) is copied by the writer thread while training goes on; a step pre-hook on the
    optimizer makes its next ``step()`` wait until that copy is done. The rest (buffers, which
    a forward may change, and the optimizer's param_groups) is copied at save() on the training
    thread. Without a torch optimizer everything is copied at save(). ``waited`` is the time the
    training thread spent waiting in that hook since the last save (seconds)."""

    def __init__(self) -> None:
        self.stager: io.Stager | None = None
        self.waited = 0.0
        self._done = threading.Event()
        self._done.set()
        self._hooks: dict[int, Any] = {}
        self._device: int | None = None

    def start(self, tensors: dict[str, Any], model: Any, optimizer: Any) -> tuple[dict, dict]:
        """(the part staged now, the part left to :meth:`finish`); arms the optimizer's hook."""
        if self.stager is None:  # one stager: its CPU buffers are reused save after save
            self.stager = io.Stager()
        if not hasattr(optimizer, "register_step_pre_hook"):  # none given, or not torch's
            optimizer = None
        params = {_dist.local_tensor(p).data_ptr() for p in model.parameters()}
        now, later = {}, {}
        for key, t in tensors.items():
            where = json.loads(key)
            late = optimizer is not None and (
                where[:2] == ["optim", "state"] or
                (where[0] == "model" and _dist.local_tensor(t).data_ptr() in params))
            (later if late else now)[key] = t
        if optimizer is not None and id(optimizer) not in self._hooks:
            self._hooks[id(optimizer)] = optimizer.register_step_pre_hook(self._before_step)
        staged = self.stager.stage(now) if now else {}
        # the writer thread copies on this thread's GPU (a new thread starts on cuda:0)
        self._device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self.waited = 0.0
        if later:
            self._done.clear()
        return staged, later

    def finish(self, staged: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
        """In the writer thread: stage the rest; the training thread may step again after."""
        try:
            with torch.cuda.device(self._device) if self._device is not None else nullcontext():
                return {**staged, **self.stager.stage(later)} if later else staged
        finally:
            self._done.set()

    def _before_step(self, *_: Any) -> None:
        self.wait()

    def wait(self) -> None:
        """Until the copy of the parameters and optimizer state is done."""
        if not self._done.is_set():
            start = time.perf_counter()
            self._done.wait()
            self.waited += time.perf_counter() - start

    def close(self) -> None:
        self.wait()
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        if self.stager is not None:
            self.stager.close()
            self.stager = None


def manifest(job: Job, gathered: list[dict], digest: str) -> dict[str, FileEntry]:
    """Rank 0 at commit: every rank's records (as gathered) plus info.json, checked against the
    files present in the directory."""
    files: dict[str, FileEntry] = {}
    for r, recs in enumerate(gathered):
        for name, e in recs.items():
            entry = FileEntry.from_json(e)
            if files.setdefault(name, entry) != entry:
                raise ValueError(f"rank {r} wrote {name} with other contents than another rank")
    files[INFO] = io.write_json(job.tmp / INFO, job.info, digest)
    job.stats.add(INFO, hashed=files[INFO].size)
    present = set(os.listdir(job.tmp))
    if present != set(files):
        raise ValueError(f"files written but not hashed: {sorted(present - set(files))}; "
                         f"hashed but absent: {sorted(set(files) - present)} (is the "
                         "directory on a file system every rank shares?)")
    return files


def interrupt_of(exc: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or SystemExit that stopped a save: ``exc`` itself, one that DCP's
    CheckpointException carries for some rank (its ``failures``: rank -> (exception,
    traceback)), or one behind either (a Ctrl-C inside torch.save's zip writer surfaces as the
    RuntimeError its cleanup raises, "unexpected pos", with the interrupt as its context)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            return e
        todo += [e.__cause__, e.__context__]
        todo += [f[0] if isinstance(f, tuple) else f
                 for f in (getattr(e, "failures", None) or {}).values()]
    return None
