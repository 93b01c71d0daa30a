"""Checkpoint files: opened only inside the checkpoint directory, hashed as they are written and
as they are read, each read once.

- :class:`CheckpointDir` holds a descriptor of one checkpoint directory (opened with
  ``O_NOFOLLOW``: a symlinked directory is refused) and opens files relative to it, by plain
  name only, never following a symlink and only regular files. Nothing the manifest, the DCP
  metadata or the file system says can make it read outside that directory.
- :class:`HashingStream` wraps a stream being written and hashes every byte on the way (in the
  thread that writes, i.e. the background writer under ``async_save``), one digest per entry
  DCP writes. A shard of several entries is listed in the manifest by a segment table
  (``<shard>.digests.json``: offset, length, digest of each entry, covering the whole file), so a
  rank reading a few entries of another rank's shard (DCP stores replicated state, such as
  AdamW's step counts, once for all ranks) hashes those entries, not the whole shard.
- :meth:`CheckpointDir.mapped` maps a file once; a thread hashes the segments the reader needs
  while the caller deserialises from the mapping, and :meth:`MappedFile.verify` compares the
  digests. Size is checked at open. (A file truncated by someone else *while* mapped raises
  SIGBUS, as with any memory-mapped load, e.g. ``torch.load(mmap=True)``.)
- :class:`IOStats` counts opens and bytes hashed per file, so tests and benchmarks can check
  that each file is read once and each byte hashed once.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
import stat
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .digest import DIGESTS

__all__ = ["CheckpointDir", "FileEntry", "HashingStream", "IOStats", "IntegrityError", "MappedFile",
           "Segment", "check_name", "covering", "digest_bytes", "parse_manifest", "parse_segments"]


def _new_hash(digest: str) -> Any:
    algo = digest.split(":", 1)[0]
    if algo not in DIGESTS:
        raise IntegrityError(f"digest {digest!r} names none of {sorted(DIGESTS)}")
    return DIGESTS[algo]()


def _finish(h: Any, algo: str) -> str:
    return f"{algo}:{h.hexdigest()}"


class IntegrityError(ValueError):
    """A checkpoint file does not match the manifest (missing, resized, corrupted, not a regular
    file, or a name that would leave the directory)."""


@dataclass(frozen=True)
class FileEntry:
    """One file as the manifest lists it: either its digest, or (a DCP shard with several
    entries) the name of its segment table, a listed file holding the digest of each byte range
    DCP wrote as one entry, so a reader hashes only the entries it reads."""

    size: int
    """Bytes."""
    digest: str | None = None
    """``"<algorithm>:<hex>"`` of the whole file (algorithms: :data:`DIGESTS`)."""
    segments: str | None = None
    """Name of its segment table (``<name>.digests.json``) when not hashed whole."""

    @staticmethod
    def from_json(e: dict[str, Any]) -> FileEntry:
        if "sha256" in e:  # spikeguard-checkpoint/1 (before self-describing digests)
            return FileEntry(int(e["size"]), f"sha256:{e['sha256']}")
        return FileEntry(int(e["size"]), e.get("digest"), e.get("segments"))

    def to_json(self) -> dict[str, Any]:
        if self.segments is not None:
            return {"size": self.size, "segments": self.segments}
        return {"size": self.size, "digest": self.digest}


Segment = tuple[int, int, str]
"""(offset, length, hex digest) of one byte range of a file."""


@dataclass
class IOStats:
    """Per-file counters of one save or restore on this rank (thread-safe)."""

    opened: Counter = field(default_factory=Counter)
    """name -> times the file was opened for reading."""
    hashed: Counter = field(default_factory=Counter)
    """name -> bytes hashed (written or read)."""
    read: Counter = field(default_factory=Counter)
    """name -> bytes handed to the loader (whole small files; the entries a load plan reads)."""
    threads: dict[str, str] = field(default_factory=dict)
    """name -> the thread that accounted for its hashing (the writer's, for written files)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, *, opened: int = 0, hashed: int = 0, read: int = 0) -> None:
        with self._lock:
            if opened:
                self.opened[name] += opened
            if read:
                self.read[name] += read
            if hashed:
                self.hashed[name] += hashed
                self.threads[name] = threading.current_thread().name

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            for table in (self.opened, self.hashed, self.read, self.threads):
                if old in table:
                    table[new] = table.pop(old)


def digest_bytes(data: bytes | bytearray | memoryview, algo: str) -> FileEntry:
    """The manifest entry of a buffer, digested with ``algo`` (a key of :data:`DIGESTS`)."""
    h = _new_hash(algo)
    h.update(data)
    return FileEntry(len(data), _finish(h, algo))


def check_name(name: Any) -> str:
    """A plain file name inside the directory: a non-empty str, no ``/`` or NUL, not ``.``/``..``."""
    if not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", ".."):
        raise IntegrityError(f"{name!r} is not a plain file name inside the checkpoint directory")
    return name


def parse_manifest(raw: bytes) -> dict[str, FileEntry]:
    """The ``files`` table of a MANIFEST.json, every name and entry validated."""
    try:
        out = {check_name(name): FileEntry.from_json(e)
               for name, e in json.loads(raw)["files"].items()}
    except IntegrityError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise IntegrityError(f"its manifest is unreadable ({type(e).__name__}: {e})") from e
    for name, e in out.items():
        table = out.get(e.segments) if isinstance(e.segments, str) else None
        plain = isinstance(e.digest, str) and e.digest.split(":")[0] in DIGESTS \
            and e.segments is None
        if e.size < 0 or not (plain or (e.digest is None and table is not None
                                        and table.segments is None)):
            raise IntegrityError(f"its manifest entry for {name} is malformed")
    return out


def parse_segments(raw: bytes, name: str, size: int) -> list[Segment]:
    """A segment table, checked to cover ``[0, size)`` of ``name`` contiguously."""
    try:
        table = json.loads(raw)
        segments = [(int(o), int(n), str(d)) for o, n, d in table["segments"]]
        ok = table["file"] == name
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"the segment table of {name} is unreadable ({e})") from e
    end = 0
    for offset, length, _ in segments:
        ok = ok and offset == end and length > 0
        end = offset + length
    if not ok or end != size:
        raise IntegrityError(f"the segment table of {name} does not cover its {size} bytes")
    return segments


def covering(segments: list[Segment], needed: list[tuple[int, int]]) -> list[Segment]:
    """The segments that overlap any needed (offset, length) range, each once, in order."""
    starts = [s[0] for s in segments]
    out: dict[int, Segment] = {}
    for offset, length in needed:
        i = max(0, bisect.bisect_right(starts, offset) - 1)
        while i < len(segments) and segments[i][0] < offset + max(length, 1):
            out[i] = segments[i]
            i += 1
    return [out[i] for i in sorted(out)]


class HashingStream:
    """A binary write stream that hashes what passes through it, one digest per segment: the
    bytes between two ``tell()`` calls (DCP asks for the offset before and after each entry it
    writes, so each entry is one segment). ``segments`` once closed; ``error``: the OSError
    of a failed write (torch.save's zip writer reports it only as a position mismatch)."""

    def __init__(self, raw: Any, algo: str) -> None:
        self.raw, self.algo, self.size, self._start = raw, algo, 0, 0
        self._hash: Any = None
        self.error: OSError | None = None
        self.segments: list[Segment] = []
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        try:
            n = self.raw.write(view)
        except OSError as e:
            self.error = e
            raise
        if self._hash is None:
            self._hash = _new_hash(self.algo)
        self._hash.update(view)
        self.size += len(view)
        return n if n is not None else len(view)

    def _cut(self) -> None:
        if self._hash is not None and self.size > self._start:
            self.segments.append((self._start, self.size - self._start,
                                  _finish(self._hash, self.algo)))
        self._hash, self._start = None, self.size

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        self._cut()
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self._cut()
            self.closed = True
        self.raw.close()

    def __enter__(self) -> HashingStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class MappedFile:
    """One checkpoint file mapped read-only; a thread hashes the given segments (the whole file,
    or the entries a load plan reads) while the caller reads ``view``."""

    def __init__(self, fd: int, name: str, size: int, segments: list[Segment],
                 stats: IOStats) -> None:
        self.name, self._stats, self._segments = name, stats, segments
        self._map: mmap.mmap | None = None
        try:
            if size:
                self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
                self.view = memoryview(self._map)
            else:
                self.view = memoryview(b"")
        except (OSError, ValueError):  # a file system without mmap: read it once into memory
            buf, got = bytearray(size), 0
            with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
                while got < size and (n := f.readinto(memoryview(buf)[got:])):
                    got += n
            if got != size:
                raise IntegrityError(f"{name} ended after {got} of {size} bytes") from None
            self.view = memoryview(buf)
        finally:
            os.close(fd)
        self._bad: list[int] = []
        self._thread = threading.Thread(target=self._hash_all, daemon=True,
                                        name=f"spikeguard-hash-{name}")
        self._thread.start()  # hashlib releases the GIL: this overlaps the caller's reads

    def _hash_all(self) -> None:
        for offset, length, want in self._segments:
            with self.view[offset:offset + length] as piece:
                h = _new_hash(want)
                h.update(piece)
            if _finish(h, want.split(":", 1)[0]) != want:
                self._bad.append(offset)

    def verify(self) -> None:
        """Wait for the hashes; IntegrityError when any differs from the manifest."""
        self._thread.join()
        self._stats.add(self.name, hashed=sum(s[1] for s in self._segments))
        if self._bad:
            where = "" if len(self._segments) == 1 else f" at byte {self._bad[0]}"
            raise IntegrityError(f"{self.name} does not match its digest in the manifest"
                                 f"{where} (corrupted)")

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
        stats.add(name, read=len(data))
        if want is not None:
            if want.digest is None:
                raise IntegrityError(f"{name} is listed with a segment table; a whole digest "
                                     "is expected")
            got = digest_bytes(data, want.digest.split(":", 1)[0])
            stats.add(name, hashed=got.size)
            if got.digest != want.digest:
                raise IntegrityError(f"{name} does not match its digest in the manifest "
                                     "(corrupted)")
        return data

    def segments(self, name: str, files: dict[str, FileEntry], stats: IOStats) -> list[Segment]:
        """The digested segments of ``name``: one for a file hashed whole, else its table
        (read once, itself checked against the manifest)."""
        want = files[name]
        if want.segments is None:
            return [(0, want.size, want.digest)] if want.size else []
        raw = self.read(want.segments, files[want.segments], stats)
        return parse_segments(raw, name, want.size)

    def mapped(self, name: str, size: int, segments: list[Segment], stats: IOStats) -> MappedFile:
        """Map ``name`` (of ``size`` bytes) once and start hashing ``segments`` of it."""
        fd = self.open(name, FileEntry(size))
        stats.add(name, opened=1)
        return MappedFile(fd, name, size, segments, stats)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
