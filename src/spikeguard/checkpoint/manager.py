"""Checkpoints that roll back safely: atomic, integrity-checked, health-tagged, never unpickled.

``CheckpointManager(directory, every=1000, keep=10)`` (defaults: every 1,000 steps, keep 10)
saves model and optimizer through torch.distributed.checkpoint (sharded under FSDP2, one file
per rank) and everything else as JSON: scheduler, scaler, data stream, detector and any other
object with ``state_dict``/``load_state_dict``, the optimizer's param_groups, and the RNG
states (torch CPU and CUDA, ``random``, numpy), one sidecar per rank. A checkpoint "at step s"
holds the state after update s.

Layout of ``directory/step_00000100/``: DCP's ``.metadata`` and ``__<rank>_0.distcp``,
``__<rank>_0.distcp.digests.json`` (the digest of each entry of that shard), ``rank<r>.json``
(sidecars), ``info.json`` (step, health, alerts, skip ranges, world size) and ``MANIFEST.json``
(size and digest, or segment table, of every other file). Each rank hashes the files it writes
as it writes them (in the background writer under ``async_save``); rank 0 gathers the digests
into the manifest. The digest is XXH3-128 by default (``digest="crc32"`` to catch every burst of
up to 32 bits for certain, ``"sha256"`` for a cryptographic one): corruption goes unseen with a
chance of 2^-128; it is no defence against someone who can write the directory, since they
could rewrite the manifest too. That defence is the loader's: the allowlist, ``weights_only`` and the path
checks below. Everything is written under ``.tmp-step_...``, fsynced, and renamed: a
directory without its manifest is never listed. Restore reads every file it needs once, from
inside the checkpoint directory only (no symlinks), and hashes what it reads as it reads it;
DCP metadata goes through an allowlist unpickler and bytes entries load with
``weights_only=True`` (see ``_safe_dcp``). A checkpoint failing a check is refused (a
:class:`CheckpointWarning`) and the previous healthy one is used.

torch.distributed.checkpoint is imported on first use, not by ``import spikeguard``.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch

from .. import _dist
from .._crash import crash_point
from .._validate import check_int
from . import io, retention
from .digest import DEFAULT_DIGEST, DIGESTS, Digest
from .files import CheckpointDir, IOStats
from .info import CheckpointError, CheckpointInfo, CheckpointWarning, rollback_target
from .load import INFO as _INFO
from .load import MANIFEST as _MANIFEST
from .load import Refused, load, verify_checkpoint
from .save import Job, Staging, agree, failure_message, interrupt_of, make_tmp, manifest

__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointManager", "CheckpointWarning",
           "rollback_target", "verify_checkpoint"]

_FORMAT = "spikeguard-checkpoint/2"


class CheckpointManager:
    """Save every ``every`` steps, keep the newest ``keep`` (never deleting the newest healthy
    one; while an incident is open, the ``keep`` newest healthy ones before it as well, counted
    apart: checkpoint/retention.py), restore the newest healthy checkpoint at or before a step.
    A replay after a rollback never overwrites a checkpoint: the first one of a step moves to
    ``superseded/``.

    Collective under torch.distributed: every rank calls save/restore with the same step.
    With ``async_save=True`` save() copies only the buffers and param_groups; a writer thread
    copies the parameters and optimizer state into reused CPU buffers (DCP's stager; the
    optimizer's next step() waits for that copy: change parameters only through it, or call
    ``staging.wait()`` first), runs ``dcp.save`` (each rank hashing what it writes) and the
    commit, its collectives on a gloo group of its own (never interleaved with training's;
    NCCL-only jobs work). The next save/restore or :meth:`wait` waits for it (and re-raises
    its error). ``io_stats``: this rank's opens and hashed bytes per file in the last save or
    restore (the listing's reads of ``info.json`` not counted).

    A failed save (a full disk: ENOSPC, EFBIG at a file size limit, EDQUOT; any write error)
    removes its partial files and leaves the committed ones; then ``on_error="raise"`` (default)
    raises :class:`CheckpointError` from save() (under ``async_save`` from the next
    save/restore/wait): the run stops, to resume from the last checkpoint once there is room.
    ``"warn"`` issues a :class:`CheckpointWarning` and trains on; the next save tries again
    (marked unhealthy when the failed one would have been: its window's alerts carry over).
    Raise is the default: a run that cannot checkpoint can neither resume nor roll back, and
    stopping costs at most ``every`` steps while a warning scrolls away as that cost grows.
    """

    def __init__(self, directory: str | Path, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                 scaler: Any = None, data: Any = None, states: Mapping[str, Any] | None = None,
                 every: int = 1000, keep: int = 10, async_save: bool = False,
                 digest: Digest = DEFAULT_DIGEST,
                 on_error: Literal["raise", "warn"] = "raise") -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"CheckpointManager directory={directory!r} must be a path")
        check_int(every, "CheckpointManager every", hint="1000 steps is usual")
        check_int(keep, "CheckpointManager keep", hint="10 is usual")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"CheckpointManager on_error={on_error!r} must be 'raise' (stop the "
                             "run when a save fails; the default) or 'warn' (train on without it)")
        if digest not in DIGESTS:
            raise ValueError(f"CheckpointManager digest={digest!r} is not one of "
                             f"{sorted(DIGESTS)}; xxh3 (the default) catches corruption at a "
                             "fraction of sha256's cost, sha256 suits manifests you sign")
        self.directory = Path(directory)
        self.every, self.keep, self.async_save, self.digest = every, keep, bool(async_save), digest
        self.on_error = on_error
        self.io_stats = IOStats()
        self._pending: Future[None] | None = None
        self._pending_job: Job | None = None
        self._carry: tuple[bool, list[str]] = (True, [])
        self.staging = Staging()  # .waited: seconds the last async save held the next step
        self._executor: ThreadPoolExecutor | None = None
        self._group: Any = None
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.states: dict[str, Any] = {}
        """The Stateful objects saved beside model and optimizer, by sidecar key."""
        self.register(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                      data=data, **dict(states or {}))

    def register(self, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **states: Any) -> None:
        """Add what ``save`` writes and ``restore`` loads: the model, the optimizer and Stateful
        objects (``state_dict`` / ``load_state_dict``) by name (``scheduler``, ``scaler``,
        ``data`` or any other). Registering the same object again is a no-op; another object
        under a taken name is a mistake and raises. None values are ignored."""
        for name, obj, have in (("model", model, self.model),
                                ("optimizer", optimizer, self.optimizer)):
            if obj is not None and have is not None and obj is not have:
                raise ValueError(f"CheckpointManager already saves another {name}; build one "
                                 f"manager per training run")
        self.model = model if model is not None else self.model
        self.optimizer = optimizer if optimizer is not None else self.optimizer
        for name, obj in states.items():
            if obj is None:
                continue
            if name in ("rest", "rng"):
                raise ValueError(f"CheckpointManager state name {name!r} is reserved; rename it")
            for method in ("state_dict", "load_state_dict"):
                if not callable(getattr(obj, method, None)):
                    raise TypeError(f"CheckpointManager state {name!r} ({type(obj).__name__}) "
                                    f"has no {method}(); give it state_dict/load_state_dict")
            if name in self.states and self.states[name] is not obj:
                raise ValueError(f"CheckpointManager already saves another {name!r}; rename "
                                 "this one")
            self.states[name] = obj

    # -- listing ------------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints (those with a manifest), oldest first. Symlinked directories
        are not checkpoints this manager wrote and are passed over."""
        out = []
        if not self.directory.is_dir():
            return out
        for d in sorted(self.directory.glob("step_*")):
            if d.is_symlink() or not d.is_dir():
                continue
            try:
                with CheckpointDir(d) as cd:
                    if _MANIFEST not in cd.names():
                        continue
                    info = json.loads(cd.read(_INFO, None, IOStats()))
                out.append(CheckpointInfo(
                    step=int(info["step"]), path=d, healthy=bool(info["healthy"]),
                    alerts=tuple(info.get("alerts", ())),
                    skip_ranges=tuple(tuple(r) for r in info.get("skip_ranges", ())),
                    meta=dict(info.get("meta", {}))))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # unreadable info: restore() would refuse it anyway
        return sorted(out, key=lambda c: c.step)

    def should_save(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    # -- save ---------------------------------------------------------------------------------
    def maybe_save(self, step: int, **kwargs: Any) -> Path | None:
        """save() when ``step`` is a multiple of ``every``; otherwise nothing."""
        return self.save(step, **kwargs) if self.should_save(step) else None

    @io.collector_paused()  # sync: the whole write; async: the part on the training thread
    def save(self, step: int, *, healthy: bool = True, alerts: list[str] | tuple[str, ...] = (),
             meta: dict | None = None, save_rng: bool = True,
             snapshot: Mapping[str, dict[str, Any]] | None = None) -> Path | None:
        """Save the registered states after update ``step``; returns its directory (None: it
        failed and ``on_error="warn"`` went on). ``healthy=False`` (or any ``alerts``) marks an
        alert in this checkpoint's window: restore() passes over it. ``snapshot`` gives state
        dicts taken earlier, written instead of a registered object's current state (the guard
        saves step t's data position one step late). Collective across ranks."""
        if self.model is None:
            raise ValueError("CheckpointManager.save: no model to save; build the manager with "
                             "CheckpointManager(directory, model=..., optimizer=...) or pass it "
                             "to a Guard, which registers its own")
        model, optimizer = self.model, self.optimizer
        unknown = set(snapshot or {}) - set(self.states)
        if unknown:
            raise ValueError(f"CheckpointManager.save snapshot names {sorted(unknown)}, which "
                             f"are not registered ({sorted(self.states)})")
        self.wait()
        msd, osd = io.model_optim(model, optimizer)
        tensors, rest = io.split({"model": msd, "optim": osd})
        side: dict[str, Any] = {"rest": rest}
        for name, obj in self.states.items():
            side[name] = snapshot[name] if snapshot and name in snapshot else obj.state_dict()
        if save_rng:
            side["rng"] = io.rng_state()
        skips = side["data"].get("skip_ranges", []) if "data" in side else []
        ok, carried = self._carry  # a failed save's window is part of this one's
        job = Job(step=step, directory=self.directory, side=io.encode(side), info={
            "format": _FORMAT, "step": step, "healthy": ok and bool(healthy) and not alerts,
            "alerts": [*carried, *alerts], "skip_ranges": [list(r) for r in skips],
            "world_size": _dist.world_size(), "meta": meta or {}})
        self.io_stats, self._carry = job.stats, (True, [])
        if not self.async_save:
            try:
                with io.quiet():
                    self._write(job, tensors, None)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                return self._failed(job, e)
            return job.final
        if self._executor is None:
            self._group = _dist.new_cpu_group()
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="spikeguard-checkpoint")
        now, later = self.staging.start(tensors, model, optimizer)
        self._pending = self._executor.submit(self._write, job, now, self._group, later)
        self._pending_job = job
        return job.final

    def _write(self, job: Job, tensors: dict, group: Any, later: dict | None = None) -> None:
        """After save() (in the writer thread under async_save, collectives on its own group):
        the rest of the staging, the sidecar, DCP's save through the hashing writer, commit."""
        import torch.distributed.checkpoint as dcp

        from .safe_reader import HashingWriter

        error = None
        try:
            tensors = tensors if later is None else self.staging.finish(tensors, later)
        except Exception as e:  # every rank learns of it at the agreement below
            error = e
        make_tmp(job, group)
        sidecar = f"rank{_dist.rank()}.json"
        try:
            if error is None:
                job.records[sidecar] = io.write_json(job.tmp / sidecar, job.side, self.digest)
        except OSError as e:
            error = e
        agree(error, group)
        job.stats.add(sidecar, hashed=job.records[sidecar].size)
        writer = HashingWriter(job.tmp, job.records, job.stats, self.digest)
        dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=not _dist.is_dist())
        crash_point("after_shard", job.step)  # tests only (SPIKEGUARD_TEST_CRASH)
        self._commit(job, group)

    def wait(self) -> None:
        """Block until a pending async save is committed (a failure: as ``on_error`` says)."""
        if self._pending is None:
            return
        fut, job, self._pending = self._pending, self._pending_job, None
        try:
            fut.result()
        except BaseException as e:
            self._failed(job, e)

    def _failed(self, job: Job, exc: BaseException) -> None:  # returns only under "warn"
        """A save failed on every rank alike (the ranks agree before and after each write). A
        Ctrl-C is no failure of the machine: it goes on as itself, also when DCP caught it
        inside its write and wrapped it in a CheckpointException."""
        stop = interrupt_of(exc)
        if _dist.rank() == 0:  # free what the failed save took; committed ones stay
            shutil.rmtree(job.tmp, ignore_errors=True)
        if stop is not None:
            raise stop
        msg = failure_message(job.step, self.directory, exc, self.list(), self.on_error)
        if self.on_error == "raise":
            raise CheckpointError(msg) from exc
        self._carry = (job.info["healthy"], job.info["alerts"])
        warnings.warn(msg, CheckpointWarning, stacklevel=4)

    def close(self) -> None:
        """Commit a pending async save; free the stager, the writer thread and the async group."""
        self.wait()
        self.staging.close()
        if self._executor is not None:
            self._executor.shutdown()
            if self._group is not None:
                import torch.distributed as dist

                dist.destroy_process_group(self._group)
        self._executor = self._group = None

    def _commit(self, job: Job, group: Any) -> None:
        gathered = _dist.gather_object({n: e.to_json() for n, e in job.records.items()}, group)
        error = None
        if gathered is not None:  # rank 0
            try:
                files = manifest(job, gathered, self.digest)
                crash_point("before_commit", job.step)
                io.write_json(job.tmp / _MANIFEST, {
                    "format": _FORMAT, "files": {n: e.to_json() for n, e in files.items()}})
                io.fsync_dir(job.tmp)
                crash_point("after_manifest", job.step)
                retention.set_aside(job.final)  # a replayed step: the first one stays
                job.tmp.rename(job.final)
                io.fsync_dir(self.directory)
                crash_point("after_commit", job.step)
                self._rotate()
            except (OSError, ValueError) as e:
                error = f"{type(e).__name__}: {e}"
        if not _dist.all_true(error is None, group):  # also the barrier: committed before anyone goes on
            raise CheckpointError(f"checkpoint {job.final} could not be committed: "
                                  f"{error or 'rank 0 failed (see its error)'}")

    def _rotate(self) -> None:
        for c in retention.stale(self.list(), self.keep):  # checkpoint/retention.py: the rule
            shutil.rmtree(c.path, ignore_errors=True)
        for stale in self.directory.glob(".tmp-step_*"):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)

    # -- restore ------------------------------------------------------------------------------
    @io.collector_paused()
    def restore(self, *, at_or_before: int | None = None, restore_rng: bool = True,
                also: Iterable[int] = ()) -> CheckpointInfo:
        """Load the newest healthy checkpoint at or before ``at_or_before`` (any step if None);
        the checkpoints at the steps ``also`` count as healthy (a rollback's: an alert in their
        window that healed before the onset).

        A checkpoint that fails its integrity or safety checks is refused with a
        CheckpointWarning and the previous healthy one is tried; CheckpointError if none is
        left. A refusal found while tensors stream in (a corrupted shard) may leave part of
        the refused values in ``model`` and ``optimizer`` until the older checkpoint
        overwrites them; after CheckpointError their state is undefined. Collective across
        ranks; all ranks agree on every refusal. Returns its info.
        """
        if self.model is None:
            raise ValueError("CheckpointManager.restore: no model to restore into; build the "
                             "manager with CheckpointManager(directory, model=..., ...)")
        self.wait()
        model, optimizer, objects = self.model, self.optimizer, self.states
        refusals: list[str] = []
        fresh = optimizer is not None and not optimizer.state  # DCP fills it to read its keys
        sound = set(also)
        for c in reversed(self.list()):
            if ((at_or_before is not None and c.step > at_or_before)
                    or not (c.healthy or c.step in sound)):
                continue
            self.io_stats = IOStats()
            try:
                load(c.path, c.step, c.healthy, model, optimizer, objects, restore_rng,
                     self.io_stats)
            except Refused as e:
                msg = f"checkpoint {c.path} refused: {e}; falling back to the previous healthy one"
                warnings.warn(msg, CheckpointWarning, stacklevel=3)  # past the decorator: the caller
                refusals.append(msg)
                continue
            return c
        if fresh:
            optimizer.state.clear()
        where = "" if at_or_before is None else f" at or before step {at_or_before}"
        raise CheckpointError(f"no healthy checkpoint{where} in {self.directory} could be restored"
                              + "".join(f"\n  {r}" for r in refusals))
