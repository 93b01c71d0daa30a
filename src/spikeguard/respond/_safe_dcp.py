"""A torch.distributed.checkpoint reader and load planner that never run code from the checkpoint.

Stock DCP (torch 2.13) unpickles ``.metadata`` with ``pickle.load`` and loads every non-tensor
entry with ``torch.load(weights_only=False)``: a checkpoint directory that someone else could
write is then a way to run their code in the training job. Here:

- ``.metadata`` goes through an unpickler whose ``find_class`` allows only the classes DCP itself
  writes (torch.distributed.checkpoint.metadata, filesystem._StorageInfo, torch.Size, torch
  dtypes, torch.serialization._get_layout, pathlib.PosixPath) and a few inert builtins;
- every storage entry must name a file of the checkpoint (no ``..``, no absolute path), lie
  within that file, and carry no stream transforms (spikeguard never writes any);
- a bytes entry, if one is left, loads with ``torch.load(weights_only=True)``.

Tensor entries already load with ``weights_only=True`` in DCP's own reader.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["SafeLoadPlanner", "SafeReader", "UnsafeCheckpointError", "safe_unpickle"]


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
    """FileSystemReader that reads metadata through the allowlist and checks every storage entry
    against ``files`` (name -> size in bytes; the integrity manifest's view of the directory)."""

    def __init__(self, path: str | pathlib.Path, files: dict[str, int]) -> None:
        super().__init__(path)
        self._files = dict(files)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(pathlib.Path(self.path) / name, "rb") as f:
            metadata = safe_unpickle(f.read())
        self._check(metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check(self, metadata: Metadata) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise UnsafeCheckpointError("checkpoint metadata has no storage table")
        for index, info in metadata.storage_data.items():
            if not isinstance(info, _StorageInfo):
                raise UnsafeCheckpointError(f"storage entry {index} is a {type(info).__name__}")
            rel = info.relative_path
            if not isinstance(rel, str) or rel not in self._files or "/" in rel or rel in (".", ".."):
                raise UnsafeCheckpointError(
                    f"storage entry {getattr(index, 'fqn', index)!r} points at {rel!r}, "
                    "which is not a file of this checkpoint")
            if not (isinstance(info.offset, int) and isinstance(info.length, int)
                    and 0 <= info.offset and 0 <= info.length
                    and info.offset + info.length <= self._files[rel]):
                raise UnsafeCheckpointError(
                    f"storage entry {getattr(index, 'fqn', index)!r} reads bytes "
                    f"[{info.offset}, {info.offset}+{info.length}) beyond {rel} "
                    f"({self._files[rel]} bytes)")
            if info.transform_descriptors:
                raise UnsafeCheckpointError(
                    f"storage entry {getattr(index, 'fqn', index)!r} asks for stream transforms "
                    f"{list(info.transform_descriptors)}; spikeguard never writes any")


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
