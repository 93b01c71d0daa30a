"""A torch.distributed.checkpoint reader and load planner that never run code from the checkpoint.

Stock DCP (torch 2.13) unpickles ``.metadata`` with ``pickle.load`` and loads every non-tensor
entry with ``torch.load(weights_only=False)``: a checkpoint directory that someone else could
write is then a way to run their code in the training job. Here:

- ``.metadata`` goes through an unpickler whose ``find_class`` allows only the classes DCP itself
  writes (torch.distributed.checkpoint.metadata, filesystem._StorageInfo, torch.Size, torch
  dtypes, torch.serialization._get_layout, pathlib.PosixPath) and a few inert builtins;
- every storage entry must name a file of the checkpoint (no ``..``, no absolute path), lie
  within that file, and carry no stream transforms (spikeguard never writes any);
- a bytes entry, if one is left, loads with ``torch.load(weights_only=True)``;
- files are opened only through a ``CheckpointDir`` (no symlinks, no name outside the
  directory), each file this rank reads is mapped once and hashed while it is deserialised, and
  tensor entries load with ``torch.load(weights_only=True)`` as in DCP's own reader.

:class:`HashingWriter` is DCP's FileSystemWriter with every written byte hashed on the way, so
each rank digests exactly the files it writes, in DCP's writer thread.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import threading
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .files import (
    CheckpointDir,
    FileEntry,
    HashingStream,
    IntegrityError,
    IOStats,
    covering,
    digest_bytes,
)
from .io import write_json

__all__ = ["HashingWriter", "IntegrityError", "SafeLoadPlanner", "SafeReader", "UnsafeCheckpointError",
           "safe_unpickle"]


class UnsafeCheckpointError(RuntimeError):
    """The checkpoint holds something a trusted DCP writer never produces (a refused class,
    a path outside the checkpoint, a pickled object)."""


_BUILTINS = frozenset({"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex",
                       "bool", "str", "bytes", "bytearray", "slice", "range"})
_DCP_METADATA = frozenset(name for name in dir(dcp_metadata)
                          if isinstance(getattr(dcp_metadata, name), type)
                          and getattr(dcp_metadata, name).__module__ == dcp_metadata.__name__)


def _allowed(module: str, name: str) -> Any:
    if module == "torch.distributed.checkpoint.metadata" and name in _DCP_METADATA:
        return getattr(dcp_metadata, name)
    if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
        return _StorageInfo
    if module == "torch" and name == "Size":
        return torch.Size
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    if module == "torch.serialization" and name == "_get_layout":
        return torch.serialization._get_layout
    if module == "pathlib" and name in ("PosixPath", "PurePosixPath"):
        return getattr(pathlib, name)
    if module == "builtins" and name in _BUILTINS:
        return __builtins__[name] if isinstance(__builtins__, dict) else getattr(__builtins__, name)
    return None


class _AllowlistUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed(module, name)
        if obj is None:
            raise UnsafeCheckpointError(
                f"checkpoint metadata asks for {module}.{name}, which DCP never writes; "
                "refusing to unpickle it (the file was tampered with or is not a DCP checkpoint)")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("checkpoint metadata uses pickle persistent ids; refused")


def safe_unpickle(data: bytes) -> Metadata:
    """Unpickle DCP ``.metadata`` bytes through the allowlist; returns the Metadata object."""
    try:
        obj = _AllowlistUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # malformed pickle: truncated, wrong opcodes, bad reduce arguments
        raise UnsafeCheckpointError(f"checkpoint metadata does not unpickle: {e!r}") from e
    if not isinstance(obj, Metadata):
        raise UnsafeCheckpointError(f"checkpoint metadata is a {type(obj).__name__}, not Metadata")
    return obj


class SafeReader(FileSystemReader):
    """A FileSystemReader that reads only through a :class:`CheckpointDir` and the manifest.

    :meth:`verify_metadata` reads ``.metadata`` once (size and digest checked), unpickles it
    through the allowlist and checks every storage entry against ``files`` (the manifest):
    DCP's own ``read_metadata`` call then gets that object back without a second read.
    :meth:`read_data` maps each file this rank's plan needs once; a thread hashes the whole
    file while the entries are deserialised from the mapping (``torch.load(weights_only=True)``)
    and copied into place, and the digest is checked before returning. A mismatch raises
    :class:`IntegrityError`: the destination tensors may then hold part of the refused data,
    which the caller overwrites by loading an older checkpoint or reports.
    """

    def __init__(self, directory: CheckpointDir, files: dict[str, FileEntry],
                 stats: IOStats) -> None:
        super().__init__(directory.path)
        self._dir, self._files, self._stats = directory, dict(files), stats
        self._metadata: Metadata | None = None

    def verify_metadata(self) -> Metadata:
        if ".metadata" not in self._files:
            raise UnsafeCheckpointError("its manifest lists no .metadata")
        metadata = safe_unpickle(self._dir.read(".metadata", self._files[".metadata"],
                                                self._stats))
        self._check(metadata)
        self._metadata = metadata
        return metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None or kwargs.get("rank") is not None:
            raise UnsafeCheckpointError("only the verified global .metadata is read")
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _check(self, metadata: Metadata) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise UnsafeCheckpointError("checkpoint metadata has no storage table")
        for index, info in metadata.storage_data.items():
            if not isinstance(info, _StorageInfo):
                raise UnsafeCheckpointError(f"storage entry {index} is a {type(info).__name__}")
            rel = info.relative_path
            if not isinstance(rel, str) or rel not in self._files:
                raise UnsafeCheckpointError(
                    f"storage entry {getattr(index, 'fqn', index)!r} points at {rel!r}, "
                    "which is not a file of this checkpoint")
            size = self._files[rel].size
            if not (isinstance(info.offset, int) and isinstance(info.length, int)
                    and 0 <= info.offset and 0 <= info.length
                    and info.offset + info.length <= size):
                raise UnsafeCheckpointError(
                    f"storage entry {getattr(index, 'fqn', index)!r} reads bytes "
                    f"[{info.offset}, {info.offset}+{info.length}) beyond {rel} ({size} bytes)")
            if info.transform_descriptors:
                raise UnsafeCheckpointError(
                    f"storage entry {getattr(index, 'fqn', index)!r} asks for stream transforms "
                    f"{list(info.transform_descriptors)}; spikeguard never writes any")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, dict[Any, list[ReadItem]]] = {}
        for req in plan.items:
            rel = self.storage_data[req.storage_index].relative_path
            per_file.setdefault(rel, {}).setdefault(req.storage_index, []).append(req)
        for rel, by_index in per_file.items():
            order = sorted(by_index, key=lambda i: self.storage_data[i].offset)
            needed = covering(self._dir.segments(rel, self._files, self._stats),
                              [(self.storage_data[i].offset, self.storage_data[i].length)
                               for i in order])
            with self._dir.mapped(rel, self._files[rel].size, needed, self._stats) as f:
                try:
                    for index in order:
                        info = self.storage_data[index]
                        self._serve(f.view, info, by_index[index], planner)
                        self._stats.add(rel, read=info.length)
                except Exception:
                    f.verify()  # corrupted bytes are the truer cause of a failed load
                    raise
                f.verify()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _serve(view: memoryview, info: _StorageInfo, reqs: list[ReadItem],
               planner: LoadPlanner) -> None:
        """Deserialise one storage entry once and hand it to every request that reads it."""
        with view[info.offset:info.offset + info.length] as piece:
            if reqs[0].type == LoadItemType.BYTE_IO:
                for req in reqs:
                    planner.load_bytes(req, io.BytesIO(bytes(piece)))
                return
            # buffered: torch.load's many small record reads come from one buffer fill; the
            # tensor bytes, larger than the buffer, go straight from the view into place
            tensor = torch.load(io.BufferedReader(_ViewFile(piece), 1 << 16),
                                map_location="cpu", weights_only=True)
        if not isinstance(tensor, torch.Tensor):
            raise UnsafeCheckpointError(f"tensor entry {reqs[0].storage_index.fqn!r} holds a "
                                        f"{type(tensor).__name__}")
        for req in reqs:
            part = tensor
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                if start or length != part.shape[dim]:
                    part = part.narrow(dim, start, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != part.size():
                raise UnsafeCheckpointError(
                    f"entry {req.storage_index.fqn!r} holds {tuple(part.shape)}, the state "
                    f"expects {tuple(target.shape)}")
            target.copy_(part)
            planner.commit_tensor(req, target)


class _ViewFile(io.RawIOBase):
    """A seekable read-only file over a memoryview (torch.load reads records with readinto)."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, len(self._view))[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), len(self._view) - self._pos))
        buf[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


class _HashingFileSystem(FileSystem):
    """DCP's FileSystem whose write streams hash what they write into ``records``: a file of one
    segment by its digest, a shard of several by a segment table written beside it."""

    def __init__(self, records: dict[str, FileEntry], stats: IOStats, algo: str) -> None:
        super().__init__()
        self._records, self._stats, self._algo = records, stats, algo
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = HashingStream(raw, self._algo)
            try:
                yield stream
            except BaseException as e:  # name the write error (a full disk), not its echo
                if stream.error is not None and stream.error is not e:
                    raise stream.error from e
                raise
            stream.close()
        path = pathlib.Path(path)
        entries = {path.name: digest_bytes(b"", self._algo)}
        if len(stream.segments) == 1:
            entries[path.name] = FileEntry(stream.size, stream.segments[0][2])
        elif stream.segments:
            table = f"{path.name}.digests.json"
            entries[table] = write_json(path.with_name(table), {
                "file": path.name, "segments": [list(seg) for seg in stream.segments]},
                self._algo)
            entries[path.name] = FileEntry(stream.size, segments=table)
            self._stats.add(table, hashed=entries[table].size)
        with self._lock:
            self._records.update(entries)
        self._stats.add(path.name, hashed=stream.size)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        old, new = pathlib.Path(path).name, pathlib.Path(new_path).name
        with self._lock:  # DCP writes .metadata.tmp (one segment: no table), then renames it
            if old in self._records:
                self._records[new] = self._records.pop(old)
        self._stats.rename(old, new)


class HashingWriter(FileSystemWriter):
    """DCP's FileSystemWriter (one file per rank, fsynced) that hashes every byte it writes, in
    the thread that writes it, into ``records`` (file name -> entry): this rank's shards, and
    ``.metadata`` on the coordinator."""

    def __init__(self, path: str | os.PathLike, records: dict[str, FileEntry], stats: IOStats,
                 algo: str) -> None:
        super().__init__(path, sync_files=True)
        self.fs = _HashingFileSystem(records, stats, algo)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose bytes entries load with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise UnsafeCheckpointError(
                f"bytes entry {read_item.dest_index.fqn!r} is not plain data "
                f"(weights_only load refused it: {type(e).__name__})") from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
