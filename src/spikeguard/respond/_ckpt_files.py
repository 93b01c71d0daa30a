"""Checkpoint files: opened only inside the checkpoint directory, hashed as they are written and
as they are read, each read once.

- :class:`CheckpointDir` holds a descriptor of one checkpoint directory (opened with
  ``O_NOFOLLOW``: a symlinked directory is refused) and opens files relative to it, by plain
  name only, never following a symlink and only regular files. Nothing the manifest, the DCP
  metadata or the file system says can make it read outside that directory.
- :class:`HashingStream` wraps a stream being written and hashes every byte on the way (in the
  thread that writes, i.e. DCP's background writer under ``async_save``).
- :meth:`CheckpointDir.mapped` maps a file once; a thread hashes the whole mapping while the
  caller deserialises from it, and :meth:`MappedFile.verify` compares the digest with the
  manifest. Size is checked at open. (A file truncated by someone else *while* mapped raises
  SIGBUS, as with any memory-mapped load, e.g. ``torch.load(mmap=True)``.)
- :class:`IOStats` counts opens and bytes hashed per file, so tests and benchmarks can check
  that each file is read once and hashed once.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DIGEST", "CheckpointDir", "FileEntry", "HashingStream", "IOStats", "IntegrityError",
           "MappedFile", "check_name", "digest_bytes", "parse_manifest"]

DIGEST = "sha256"
"""The digest the manifest records for every file."""


def _new_hash() -> Any:
    return hashlib.sha256()


class IntegrityError(ValueError):
    """A checkpoint file does not match the manifest (missing, resized, corrupted, not a regular
    file, or a name that would leave the directory)."""


@dataclass(frozen=True)
class FileEntry:
    """One file as the manifest lists it."""

    size: int
    """Bytes."""
    digest: str
    """Hex digest (:data:`DIGEST`)."""

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, DIGEST: self.digest}


@dataclass
class IOStats:
    """Per-file counters of one save or restore on this rank (thread-safe)."""

    opened: Counter = field(default_factory=Counter)
    """name -> times the file was opened for reading."""
    hashed: Counter = field(default_factory=Counter)
    """name -> bytes hashed (written or read)."""
    threads: dict[str, str] = field(default_factory=dict)
    """name -> the thread that accounted for its hashing (the writer's, for written files)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, *, opened: int = 0, hashed: int = 0) -> None:
        with self._lock:
            if opened:
                self.opened[name] += opened
            if hashed:
                self.hashed[name] += hashed
                self.threads[name] = threading.current_thread().name

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            for table in (self.opened, self.hashed, self.threads):
                if old in table:
                    table[new] = table.pop(old)


def digest_bytes(data: bytes | bytearray | memoryview) -> FileEntry:
    """The manifest entry of a buffer."""
    h = _new_hash()
    h.update(data)
    return FileEntry(len(data), h.hexdigest())


def check_name(name: Any) -> str:
    """A plain file name inside the directory: a non-empty str, no ``/`` or NUL, not ``.``/``..``."""
    if not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", ".."):
        raise IntegrityError(f"{name!r} is not a plain file name inside the checkpoint directory")
    return name


def parse_manifest(raw: bytes) -> dict[str, FileEntry]:
    """The ``files`` table of a MANIFEST.json, every name and entry validated."""
    try:
        files = json.loads(raw)["files"]
        out = {check_name(name): FileEntry(int(e["size"]), str(e[DIGEST]))
               for name, e in files.items()}
    except IntegrityError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise IntegrityError(f"its manifest is unreadable ({type(e).__name__}: {e})") from e
    if any(e.size < 0 for e in out.values()):
        raise IntegrityError("its manifest lists a negative size")
    return out


class HashingStream:
    """A binary write stream that hashes what passes through it; ``entry`` once closed."""

    def __init__(self, raw: Any) -> None:
        self.raw, self._hash, self.size = raw, _new_hash(), 0
        self.entry: FileEntry | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = self.raw.write(view)
        self._hash.update(view)
        self.size += len(view)
        return n if n is not None else len(view)

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if self.entry is None:
            self.entry = FileEntry(self.size, self._hash.hexdigest())
        self.raw.close()

    def __enter__(self) -> HashingStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class MappedFile:
    """One checkpoint file mapped read-only; a thread hashes it while the caller reads ``view``."""

    def __init__(self, fd: int, name: str, want: FileEntry, stats: IOStats) -> None:
        self.name, self.want, self._stats = name, want, stats
        self._map: mmap.mmap | None = None
        try:
            if want.size:
                self._map = mmap.mmap(fd, want.size, access=mmap.ACCESS_READ)
                self.view = memoryview(self._map)
            else:
                self.view = memoryview(b"")
        except (OSError, ValueError):  # a file system without mmap: read it once into memory
            buf, got = bytearray(want.size), 0
            with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
                while got < want.size and (n := f.readinto(memoryview(buf)[got:])):
                    got += n
            if got != want.size:
                raise IntegrityError(f"{name} ended after {got} of {want.size} bytes") from None
            self.view = memoryview(buf)
        finally:
            os.close(fd)
        self._hash = _new_hash()
        self._thread = threading.Thread(target=self._hash.update, args=(self.view,), daemon=True,
                                        name=f"spikeguard-hash-{name}")
        self._thread.start()  # hashlib releases the GIL: this overlaps the caller's reads

    def verify(self) -> None:
        """Wait for the hash; IntegrityError when it differs from the manifest."""
        self._thread.join()
        self._stats.add(self.name, hashed=len(self.view))
        if self._hash.hexdigest() != self.want.digest:
            raise IntegrityError(f"{self.name} does not match its {DIGEST} in the manifest "
                                 "(corrupted)")

    def close(self) -> None:
        self._thread.join()
        self.view.release()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a slice still alive somewhere; the GC unmaps it
                pass

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class CheckpointDir:
    """A descriptor on one checkpoint directory; every file is opened relative to it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                               | os.O_CLOEXEC)
        except OSError as e:
            kind = "a symbolic link" if self.path.is_symlink() else "not an openable directory"
            raise IntegrityError(f"{self.path} is {kind} ({e.strerror}); refused") from e

    def names(self) -> set[str]:
        return set(os.listdir(self._fd))

    def open(self, name: str, want: FileEntry | None = None) -> int:
        """A read descriptor on regular file ``name`` of this directory (never via a symlink),
        its size checked against ``want``."""
        check_name(name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self._fd)
        except FileNotFoundError:
            raise IntegrityError(f"{name} is missing") from None
        except OSError as e:  # ELOOP: a symlink
            raise IntegrityError(f"{name} cannot be opened inside the checkpoint "
                                 f"({e.strerror}; symbolic links are refused)") from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise IntegrityError(f"{name} is not a regular file")
        if want is not None and st.st_size != want.size:
            os.close(fd)
            raise IntegrityError(f"{name} has {st.st_size} bytes, the manifest says {want.size} "
                                 "(truncated or overwritten)")
        return fd

    def read(self, name: str, want: FileEntry | None, stats: IOStats) -> bytes:
        """The whole file, read once; hashed and checked against ``want`` when given."""
        fd = self.open(name, want)
        stats.add(name, opened=1)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        if want is not None:
            got = digest_bytes(data)
            stats.add(name, hashed=got.size)
            if got != want:
                raise IntegrityError(f"{name} does not match its {DIGEST} in the manifest "
                                     "(corrupted)")
        return data

    def mapped(self, name: str, want: FileEntry, stats: IOStats) -> MappedFile:
        """Map ``name`` once and start hashing it (see :class:`MappedFile`)."""
        fd = self.open(name, want)
        stats.add(name, opened=1)
        return MappedFile(fd, name, want, stats)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
