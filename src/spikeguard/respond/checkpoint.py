"""Checkpoints that roll back safely: atomic, integrity-checked, health-tagged, never unpickled.

``CheckpointManager(directory, every=1000, keep=10)`` (defaults: every 1,000 steps, keep 10)
saves model and optimizer through torch.distributed.checkpoint (sharded under FSDP2, one file
per rank) and everything else as JSON: scheduler, scaler, data stream, detector and any other
object with ``state_dict``/``load_state_dict``, the optimizer's param_groups, and the RNG
states (torch CPU and CUDA, ``random``, numpy), one sidecar per rank. A checkpoint "at step s"
holds the state after update s.

Layout of ``directory/step_00000100/``: DCP's ``.metadata`` and ``__<rank>_0.distcp``,
``rank<r>.json`` (sidecars), ``info.json`` (step, health, alerts, skip ranges, world size) and
``MANIFEST.json`` (size and sha256 of every other file). Everything is written under
``.tmp-step_...``, fsynced, and renamed: a directory without its manifest is never listed.
Restore checks the manifest, reads DCP metadata through an allowlist unpickler and loads bytes
entries with ``weights_only=True`` (see ``_safe_dcp``); a checkpoint failing any check is
refused with a :class:`CheckpointWarning` and the previous healthy one is used.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from .. import _dist
from .._validate import check_int
from . import _ckpt_io as io
from ._safe_dcp import SafeLoadPlanner, SafeReader, UnsafeCheckpointError

__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointManager", "CheckpointWarning",
           "verify_checkpoint"]

_MANIFEST = "MANIFEST.json"
_INFO = "info.json"
_FORMAT = "spikeguard-checkpoint/1"


class CheckpointError(RuntimeError):
    """No checkpoint could be restored (each refusal is listed)."""


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


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence DCP's note that it runs in one process (that is the intent when no process
    group is initialised)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def _model_optim(model: torch.nn.Module, optimizer: Any) -> tuple[dict, dict | None]:
    if optimizer is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, optimizer)


class CheckpointManager:
    """Save every ``every`` steps, keep the newest ``keep`` (never deleting the newest healthy
    one), restore the newest healthy checkpoint at or before a step.

    Collective under torch.distributed: every rank calls save/restore with the same step.
    ``async_save=True`` uses ``dcp.async_save``: save() returns once the state is copied off
    the device; the files are written, hashed and committed in the background and the commit
    is awaited by the next save/restore or by :meth:`wait`.
    """

    def __init__(self, directory: str | Path, *, every: int = 1000, keep: int = 10,
                 async_save: bool = False) -> None:
        check_int(every, "CheckpointManager every", hint="1000 steps is usual")
        check_int(keep, "CheckpointManager keep", hint="10 is usual")
        self.directory = Path(directory)
        self.every, self.keep, self.async_save = every, keep, async_save
        self._pending: Any = None
        self._stager: Any = None

    # -- listing ------------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints (those with a manifest), oldest first."""
        out = []
        if not self.directory.is_dir():
            return out
        for d in sorted(self.directory.glob("step_*")):
            if not (d / _MANIFEST).is_file():
                continue
            try:
                info = json.loads((d / _INFO).read_text())
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

    def save(self, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             scheduler: Any = None, scaler: Any = None, data: Any = None,
             extra_state: dict[str, Any] | None = None, healthy: bool = True,
             alerts: list[str] | tuple[str, ...] = (), meta: dict | None = None,
             save_rng: bool = True) -> Path:
        """Save the state after update ``step``; returns the final directory.

        ``healthy=False`` (or any ``alerts``) marks that an alert was raised in this
        checkpoint's window; restore() then passes over it. Collective across ranks.
        """
        self.wait()
        healthy = bool(healthy) and not alerts
        final = self.directory / f"step_{step:08d}"
        tmp = self.directory / f".tmp-step_{step:08d}"
        if _dist.rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _dist.barrier()
        msd, osd = _model_optim(model, optimizer)
        tensors, rest = io.split({"model": msd, "optim": osd})
        side: dict[str, Any] = {"rest": rest}
        for name, obj in self._statefuls(scheduler, scaler, data, extra_state).items():
            side[name] = obj.state_dict()
        if save_rng:
            side["rng"] = io.rng_state()
        io.write_json(tmp / f"rank{_dist.rank()}.json", io.encode(side))
        skips = data.state_dict().get("skip_ranges", []) if data is not None else []
        info = {"format": _FORMAT, "step": step, "healthy": healthy, "alerts": list(alerts),
                "skip_ranges": [list(r) for r in skips], "world_size": _dist.world_size(),
                "meta": meta or {}}
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        if self.async_save:
            if self._stager is None:  # one stager: its CPU buffers are reused save after save
                gpu = torch.cuda.is_available()
                self._stager = DefaultStager(StagingOptions(
                    use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=False,
                    use_non_blocking_copy=gpu))
            with _quiet():
                fut = dcp.async_save(tensors, storage_writer=writer, async_stager=self._stager,
                                     no_dist=not _dist.is_dist())
            self._pending = (fut, tmp, final, info)
            return final
        with _quiet():
            dcp.save(tensors, storage_writer=writer, no_dist=not _dist.is_dist())
        self._commit(tmp, final, info)
        return final

    def wait(self) -> None:
        """Block until a pending async save is committed (re-raising its error, if any)."""
        if self._pending is None:
            return
        fut, tmp, final, info = self._pending
        self._pending = None
        fut.result()
        self._commit(tmp, final, info)

    def close(self) -> None:
        """Commit a pending async save and free the staging buffers."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _commit(self, tmp: Path, final: Path, info: dict) -> None:
        _dist.barrier()  # every rank's files are written
        if _dist.rank() == 0:
            io.write_json(tmp / _INFO, info)
            files = {p.name: {"size": p.stat().st_size, "sha256": io.hash_file(p)}
                     for p in sorted(tmp.iterdir()) if p.is_file()}
            io.write_json(tmp / _MANIFEST, {"format": _FORMAT, "files": files})
            io.fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            io.fsync_dir(self.directory)
            self._rotate()
        _dist.barrier()

    def _rotate(self) -> None:
        ckpts = self.list()
        healthy = [c for c in ckpts if c.healthy]
        protect = healthy[-1].step if healthy else None
        excess = len(ckpts) - self.keep
        for c in ckpts:
            if excess <= 0:
                break
            if c.step == protect:
                continue
            shutil.rmtree(c.path, ignore_errors=True)
            excess -= 1
        for stale in self.directory.glob(".tmp-step_*"):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)

    @staticmethod
    def _statefuls(scheduler: Any, scaler: Any, data: Any,
                   extra_state: dict[str, Any] | None) -> dict[str, Any]:
        named = {"scheduler": scheduler, "scaler": scaler, "data": data}
        for k, v in (extra_state or {}).items():
            if k in named or k in ("rest", "rng"):
                raise ValueError(f"extra_state key {k!r} is reserved; rename it")
            named[k] = v
        return {k: v for k, v in named.items() if v is not None}

    # -- restore ------------------------------------------------------------------------------
    def restore(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                scheduler: Any = None, scaler: Any = None, data: Any = None,
                extra_state: dict[str, Any] | None = None, at_or_before: int | None = None,
                restore_rng: bool = True) -> CheckpointInfo:
        """Load the newest healthy checkpoint at or before ``at_or_before`` (any step if None).

        A checkpoint that fails its integrity or safety checks is refused with a
        CheckpointWarning and the previous healthy one is tried; CheckpointError if none is
        left. Collective across ranks; all ranks agree on every refusal. Returns its info.
        """
        self.wait()
        refusals: list[str] = []
        for c in reversed(self.list()):
            if (at_or_before is not None and c.step > at_or_before) or not c.healthy:
                continue
            try:
                self._load(c, model, optimizer, self._statefuls(scheduler, scaler, data, extra_state),
                           restore_rng)
            except _Refused as e:
                msg = f"checkpoint {c.path} refused: {e}; falling back to the previous healthy one"
                warnings.warn(msg, CheckpointWarning, stacklevel=2)
                refusals.append(msg)
                continue
            return c
        where = "" if at_or_before is None else f" at or before step {at_or_before}"
        raise CheckpointError(f"no healthy checkpoint{where} in {self.directory} could be restored"
                              + "".join(f"\n  {r}" for r in refusals))

    def rollback(self, *, onset: int, detection: int, data: Any, **objects: Any) -> CheckpointInfo:
        """Roll back past an anomaly seen from step ``onset`` to step ``detection``.

        Restores the newest healthy checkpoint before ``onset`` (``at_or_before=onset - 1``),
        then makes ``data`` skip the batches of steps onset..detection, so the batches between
        the checkpoint and the onset are replayed. Steps count from 0 as in spikeguard.train:
        step s consumes the s-th batch the stream yields (``data.index_of(s)``). The range is
        kept in the data state and in every later checkpoint's info. Other keyword arguments
        go to :meth:`restore`.
        """
        if not 0 <= onset <= detection:
            raise ValueError(f"onset={onset}, detection={detection}: need 0 <= onset <= detection")
        index = getattr(data, "index_of", lambda s: s)
        lo, hi = index(onset), index(detection)  # under the skips the stream made so far
        info = self.restore(at_or_before=onset - 1, data=data, **objects)
        data.skip(lo, hi)
        return info

    def _load(self, c: CheckpointInfo, model: torch.nn.Module, optimizer: Any,
              statefuls: dict[str, Any], restore_rng: bool) -> None:
        local: str | None = None
        side: dict[str, Any] = {}
        try:
            sizes = verify_checkpoint(c.path)
            side = io.decode(json.loads((c.path / f"rank{_dist.rank()}.json").read_text()))
            missing = [k for k in [*statefuls, "rest"] if k not in side]
            if missing:
                local = f"it holds no state for {missing}"
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            local = str(e)
        if not _dist.all_true(local is None):
            raise _Refused(local or "another rank refused it")
        reader = SafeReader(c.path, sizes)
        try:
            reader.read_metadata()  # the allowlist and storage checks, before DCP reads it
        except UnsafeCheckpointError as e:
            local = str(e)
        if not _dist.all_true(local is None):
            raise _Refused(local or "another rank refused it")
        msd, osd = _model_optim(model, optimizer)
        tensors, _ = io.split({"model": msd, "optim": osd})
        try:
            with _quiet():
                dcp.load(tensors, storage_reader=reader, planner=SafeLoadPlanner(),
                         no_dist=not _dist.is_dist())
        except (Exception, CheckpointException) as e:  # DCP gathers per-rank failures to all
            raise _Refused(f"loading its tensors failed: {_short(e)}") from e
        state = io.join(tensors, side["rest"])
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        for name, obj in statefuls.items():
            obj.load_state_dict(side[name])
        if restore_rng and "rng" in side:
            io.set_rng_state(side["rng"])


class _Refused(Exception):
    pass


def _short(e: BaseException) -> str:
    text = str(e)
    for marker in ("UnsafeCheckpointError: ", "UnpicklingError: "):
        if marker in text:
            return marker + text.split(marker, 1)[1].strip().splitlines()[0]
    return f"{type(e).__name__}: {text.strip().splitlines()[-1] if text.strip() else ''}"


def verify_checkpoint(path: str | Path) -> dict[str, int]:
    """Check a checkpoint directory against its manifest: every listed file present with its
    size and sha256, no unlisted file. Returns name -> size; ValueError says what is wrong."""
    path = Path(path)
    try:
        manifest = json.loads((path / _MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"its manifest is unreadable ({e})") from e
    present = {p.name for p in path.iterdir()} - {_MANIFEST}
    if present - set(files):
        raise ValueError(f"files not in its manifest: {sorted(present - set(files))}")
    for name, want in files.items():
        p = path / name
        if "/" in name or not p.is_file():
            raise ValueError(f"{name} is missing")
        size = p.stat().st_size
        if size != want["size"]:
            raise ValueError(f"{name} has {size} bytes, the manifest says {want['size']} "
                             "(truncated or overwritten)")
        if io.hash_file(p) != want["sha256"]:
            raise ValueError(f"{name} does not match its sha256 in the manifest (corrupted)")
    return {name: want["size"] for name, want in files.items()}
