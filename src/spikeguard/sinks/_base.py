"""What every sink shares: device values read one step late, failures reported and contained,
pending records flushed at exit, and the one rank that writes."""

from __future__ import annotations

import atexit
import os
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from .. import _dist
from ..readback import Readback

__all__ = ["Sink", "SinkDisabledWarning", "SinkLike", "Sinks", "check_path", "host_record"]


class SinkDisabledWarning(RuntimeWarning):
    """A sink raised; it is disabled for the rest of the run and training goes on."""


@runtime_checkable
class SinkLike(Protocol):
    """Anything with ``log(record, step)``; ``close()`` is called when present."""

    def log(self, record: dict[str, Any], step: int) -> None: ...


def _restore(value: float, dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return bool(value)
    if not (dtype.is_floating_point or dtype.is_complex):
        return int(value)
    return value


def _nest(flat: list[Any], shape: list[int]) -> list[Any]:
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step: (i + 1) * step], shape[1:]) for i in range(shape[0])]


class _Pending:
    """One record whose tensors are on their way to the host (a :class:`Readback` of them).

    ``resolve`` returns the record with each tensor replaced by a Python number (0-d) or a
    nested list; it waits only for step t's copy, long done by step t+1.
    """

    def __init__(self, record: dict[str, Any], step: int) -> None:
        self.record, self.step = record, step
        self.keys = [k for k, v in record.items() if isinstance(v, torch.Tensor)]
        tensors = [record[k] for k in self.keys]
        self.shapes = [t.shape for t in tensors]
        self.dtypes = [t.dtype for t in tensors]
        self.readback = Readback(tensors)
        self.on_device = self.readback.any_on_device

    def resolve(self) -> tuple[dict[str, Any], int]:
        if not self.keys:
            return self.record, self.step
        flat = iter(self.readback.values())
        out = dict(self.record)
        for key, shape, dtype in zip(self.keys, self.shapes, self.dtypes):
            chunk = [_restore(next(flat), dtype) for _ in range(shape.numel())]
            out[key] = chunk[0] if len(shape) == 0 else _nest(chunk, list(shape))
        return out, self.step


def host_record(record: dict[str, Any]) -> dict[str, Any]:
    """The record with every tensor read to the host now (syncs). For tests and one-off use."""
    return _Pending(record, 0).resolve()[0]


def this_rank(what: str) -> int:
    """This process's rank; ValueError when torchrun started several ranks but the process
    group does not exist yet (every rank would believe it is rank 0)."""
    launched = os.environ.get("WORLD_SIZE", "1")
    if not _dist.is_dist() and launched.isdigit() and int(launched) > 1:
        raise ValueError(f"{what}: this process was launched as one of WORLD_SIZE={launched} "
                         "ranks but torch.distributed is not initialized, so its rank is "
                         "unknown; create the sink after torch.distributed.init_process_group")
    return _dist.rank()


def _writes_here(rank: int | None, what: str) -> bool:
    """Whether a sink for ``rank`` (None: every rank) writes in this process."""
    if rank is None:
        return True
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{what} rank={rank!r} must be an integer >= 0 (the one rank that "
                         "writes; 0 is usual) or None (every rank, to per-rank paths)")
    world = _dist.world_size()
    if rank >= world:
        raise ValueError(f"{what} rank={rank}, but the job has {world} rank(s), so nothing "
                         "would be written; use rank=0")
    return this_rank(what) == rank


def check_path(target: Any, what: str, field: str) -> str:
    """``target`` as a str when it is a path (str or os.PathLike); TypeError naming it if not."""
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(f"{what} {field}={target!r} must be a path (str or os.PathLike)")
    return os.fspath(target)


def per_rank(target: Any, rank: int | None, what: str, field: str) -> str:
    """``target`` with ``{rank}`` replaced by this process's rank. With ``rank=None`` (every rank
    writes) the placeholder is required, so that ranks never share a file or a run."""
    target = check_path(target, what, field)
    if rank is None and "{rank}" not in target:
        raise ValueError(f"{what}(rank=None) writes on every rank, so {field}={target!r} must "
                         "hold a {rank} placeholder (e.g. 'metrics-rank{rank}.jsonl') to give "
                         "each rank its own; or use rank=0 (the default) for one per job")
    return target.replace("{rank}", str(this_rank(what)))


_OPEN: weakref.WeakSet[Sink] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # interpreter exit (normal, sys.exit or an uncaught exception): write what is pending
    for sink in list(_OPEN):
        sink.close()


class Sink:
    """Base of the built-in sinks. Subclasses write one host record in ``_write`` and release
    resources in ``_close``.

    ``rank`` (default 0) is the one rank of a torch.distributed job that writes; on every other
    rank the sink is inactive (``active`` False): it opens nothing and its methods do nothing.
    ``rank=None`` writes on every rank, to a file, directory or run whose name holds a
    ``{rank}`` placeholder (required). Without a process group the process is rank 0.

    ``log(record, step)`` never syncs and never raises: tensors on a device are copied off
    asynchronously and the record is written at the next ``log`` (or ``flush``/``close``), so
    step t may be written at t+1; records with no device tensors are written at once unless
    ``defer=True``. An exception inside the sink is reported once as a ``SinkDisabledWarning``,
    kept in ``self.error``, and disables the sink. Open sinks are closed at interpreter exit.
    """

    def __init__(self, *, defer: bool | None = None, rank: int | None = 0) -> None:
        self.rank = rank
        self.active = _writes_here(rank, self.name)
        self.defer = defer
        self.disabled = False
        self.closed = False
        self.error: BaseException | None = None
        self._pending: _Pending | None = None
        if self.active:
            _OPEN.add(self)

    @property
    def name(self) -> str:
        return type(self).__name__

    def _write(self, record: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        pass

    def _fail(self, exc: BaseException) -> None:
        self.disabled, self.error, self._pending = True, exc, None
        warnings.warn(f"{self.name} failed and is disabled for the rest of the run; training "
                      f"continues. {type(exc).__name__}: {exc}", SinkDisabledWarning, stacklevel=3)
        try:
            self._close()
        except Exception:  # the sink is already broken; its report above is the one that matters
            pass

    def log(self, record: dict[str, Any], step: int) -> None:
        """Queue ``record`` (values may be tensors) for step ``step``; see the class docstring."""
        if self.disabled or self.closed or not self.active:
            return
        try:
            pending = _Pending(record, step)
            previous, self._pending = self._pending, None
            if previous is not None:
                self._write(*previous.resolve())
            if pending.on_device if self.defer is None else self.defer:
                self._pending = pending
            else:
                self._write(*pending.resolve())
        except Exception as exc:
            self._fail(exc)

    def resume(self, records: int) -> None:
        """A resumed run continues after the ``records``-th record (``Guard.resume()`` calls
        this): a sink whose output holds later records drops them (JsonlSink); others ignore it."""

    def resume_at_step(self, step: int) -> None:
        """A resumed run continues at ``step`` without a record count (``Guard.start_at``): a
        sink whose output holds records of ``step`` or later drops them; others ignore it."""

    def flush(self) -> None:
        """Write the pending record now (waits for its device copy)."""
        if self._pending is None or self.disabled:
            return
        pending, self._pending = self._pending, None
        try:
            self._write(*pending.resolve())
        except Exception as exc:
            self._fail(exc)

    def close(self) -> None:
        """Flush and release; further ``log`` calls are ignored. Safe to call twice."""
        if self.closed:
            return
        self.flush()
        self.closed = True
        _OPEN.discard(self)
        if not self.disabled and self.active:
            try:
                self._close()
            except Exception as exc:
                self._fail(exc)


class Sinks(Sink):
    """Several sinks behind one: reads device values once, then hands each sink a host record.

    Any object with ``log(record, step)`` may be in the list (``close()`` is called when
    present). One that raises, or a built-in sink that disables itself (a full disk), is reported
    with a ``SinkDisabledWarning`` and dropped; the others and the run go on, and every record
    they get from the one it failed on carries ``sink_errors``: ``{sink name: "ErrorType:
    message"}``. Each member decides on which rank it writes; on a rank where every built-in
    member is inactive, the group is inactive too and reads nothing off the device. The guard
    wraps its sinks in this.
    """

    def __init__(self, sinks: Iterable[SinkLike], *, defer: bool | None = None) -> None:
        super().__init__(defer=defer, rank=None)
        self.sinks = list(sinks)
        for s in self.sinks:
            if not callable(getattr(s, "log", None)):
                raise ValueError(f"sink {s!r} has no log(record, step) method")
        self.failed: dict[str, BaseException] = {}
        self.active = any(getattr(s, "active", True) for s in self.sinks)
        if not self.active:
            _OPEN.discard(self)

    def _drop(self, sink: Any, exc: BaseException, *, warn: bool = True) -> None:
        self.sinks = [s for s in self.sinks if s is not sink]
        self.failed[type(sink).__name__] = exc
        if warn:  # a built-in sink that disabled itself has already said so
            warnings.warn(f"sink {type(sink).__name__} failed and is disabled for the rest of the "
                          f"run; training continues. {type(exc).__name__}: {exc}",
                          SinkDisabledWarning, stacklevel=4)

    def _write(self, record: dict[str, Any], step: int) -> None:
        for sink in list(self.sinks):
            try:
                sink.log(self._noted(record), step)
            except Exception as exc:
                self._drop(sink, exc)
                continue
            if getattr(sink, "disabled", False) is True:
                self._drop(sink, getattr(sink, "error", None) or RuntimeError("disabled"),
                           warn=False)

    def _noted(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record, with ``sink_errors`` once a sink has failed (the sinks that still work
        say which ones no longer do, from the record that failed on)."""
        if not self.failed:
            return record
        return {**record, "sink_errors": {name: f"{type(e).__name__}: {e}"
                                          for name, e in self.failed.items()}}

    def flush(self) -> None:
        """Write the pending record, then flush every member that can (each writes what it
        holds), so that what was logged is in the files."""
        super().flush()
        self._each("flush")

    def resume(self, records: int) -> None:
        """Pass a resume on to every member that has ``resume(records)``."""
        self._each("resume", records)

    def resume_at_step(self, step: int) -> None:
        """Pass a resume at ``step`` on to every member that has ``resume_at_step(step)``."""
        self._each("resume_at_step", step)

    def _each(self, method: str, *args: Any) -> None:
        """Call ``method(*args)`` on every member that has it; a member that raises is dropped."""
        for sink in list(self.sinks):
            call = getattr(sink, method, None)
            if call is None:
                continue
            try:
                call(*args)
            except Exception as exc:
                self._drop(sink, exc)

    def _close(self) -> None:
        for sink in list(self.sinks):
            close = getattr(sink, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception as exc:
                self._drop(sink, exc)
