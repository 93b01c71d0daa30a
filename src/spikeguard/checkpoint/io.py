"""Checkpoint plumbing: the JSON sidecar codec, state-dict splitting, the integrity manifest.

The sidecar holds every non-tensor value (and small host tensors such as RNG states) as JSON
with a few tagged forms, so reading it back never unpickles anything:
``{"__tuple__": [...]}``, ``{"__float__": "nan"}``, ``{"__bytes__": b64}``,
``{"__tensor__": {"dtype", "shape", "b64"}}``, ``{"__ndarray__": {...}}``, and
``{"__dict__": [[key, value], ...]}`` for dicts whose keys are not all strings.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import gc
import json
import math
import os
import random
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .digest import DEFAULT_DIGEST
from .files import FileEntry, digest_bytes

__all__ = ["Stager", "collector_paused", "decode", "encode", "fsync_dir", "join", "model_optim",
           "quiet", "rng_state", "save_failure", "set_rng_state", "split", "write_json"]

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
_NP_DTYPES = frozenset({"float64", "float32", "float16", "int64", "int32", "int16", "int8",
                        "uint64", "uint32", "uint16", "uint8", "bool"})


def encode(obj: Any) -> Any:
    """Turn a state value into JSON-able data (tagged forms for tuples, tensors, bytes, ...)."""
    if obj is None or isinstance(obj, bool | str | int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"tensor dtype {t.dtype} cannot go into the JSON sidecar")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": {"dtype": name, "shape": list(t.shape),
                               "b64": base64.b64encode(raw).decode()}}
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        if a.dtype.name not in _NP_DTYPES:
            raise TypeError(f"array dtype {a.dtype} cannot go into the JSON sidecar")
        return {"__ndarray__": {"dtype": a.dtype.name, "shape": list(a.shape),
                                "b64": base64.b64encode(a.tobytes()).decode()}}
    if isinstance(obj, np.generic):
        return encode(obj.item())
    if isinstance(obj, bytes | bytearray):
        return {"__bytes__": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v) for v in obj]}
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v) for k, v in obj.items()}
        return {"__dict__": [[encode(k), encode(v)] for k, v in obj.items()]}
    raise TypeError(f"a {type(obj).__name__} cannot go into the JSON sidecar; state_dict() "
                    "must return plain data (numbers, strings, lists, dicts, tensors)")


def decode(obj: Any) -> Any:
    """Inverse of :func:`encode`; builds only plain data, tensors and arrays."""
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, val), = obj.items()
        if tag == "__float__":
            return float(val)
        if tag == "__tuple__":
            return tuple(decode(v) for v in val)
        if tag == "__bytes__":
            return base64.b64decode(val)
        if tag == "__dict__":
            return {_hashable(decode(k)): decode(v) for k, v in val}
        if tag == "__tensor__":
            raw = bytearray(base64.b64decode(val["b64"]))
            dtype = _DTYPES[val["dtype"]]
            if not raw:
                return torch.empty(val["shape"], dtype=dtype)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(val["shape"])
        if tag == "__ndarray__":
            if val["dtype"] not in _NP_DTYPES:
                raise ValueError(f"array dtype {val['dtype']!r} is not allowed in the sidecar")
            raw = base64.b64decode(val["b64"])
            return np.frombuffer(raw, dtype=val["dtype"]).reshape(val["shape"]).copy()
    return {k: decode(v) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list | tuple) else key


def split(tree: Any, path: tuple = ()) -> tuple[dict[str, Any], list]:
    """Split a nested state dict into tensors (flat dict keyed by the JSON of their path, for
    DCP) and the rest (a list of [path, value] pairs, for the sidecar). Dicts and lists are
    walked; any other value is a leaf."""
    tensors: dict[str, Any] = {}
    rest: list = []
    if isinstance(tree, dict) and tree and all(isinstance(k, str | int) for k in tree):
        for k, v in tree.items():
            t, r = split(v, (*path, k))
            tensors.update(t)
            rest.extend(r)
    elif isinstance(tree, list) and tree:
        for i, v in enumerate(tree):
            t, r = split(v, (*path, i))
            tensors.update(t)
            rest.extend(r)
    elif isinstance(tree, torch.Tensor):
        tensors[json.dumps(list(path))] = tree
    else:
        rest.append([list(path), tree])
    return tensors, rest


def join(tensors: dict[str, Any], rest: list) -> Any:
    """Rebuild the nested state dict that :func:`split` took apart."""
    leaves = [(json.loads(k), v) for k, v in tensors.items()] + [(p, v) for p, v in rest]
    if len(leaves) == 1 and leaves[0][0] == []:
        return leaves[0][1]
    root: dict = {}
    for path, value in leaves:
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    """Dicts whose keys are exactly 0..n-1 (ints) were lists."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def write_json(path: Path, obj: Any, algo: str = DEFAULT_DIGEST) -> FileEntry:
    """Write JSON, fsync it, and return its manifest entry (the bytes digested in memory with
    ``algo``)."""
    data = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return digest_bytes(data, algo)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU (and CUDA), ``random``, numpy's global."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cycle collector for one load or save (a context or a decorator). DCP
    builds tens of thousands of short-lived objects per call (metadata, plans, read items); a
    collection that runs while they are alive promotes them to the oldest generation, and
    enough promotions start a full collection of the whole process (every object torch and the
    model hold: 0.1-0.2 s on a busy CPU). Paused, they die by reference count and promote
    nothing. The previous setting is kept: a job that runs with the collector off (as large
    training jobs often do) keeps it off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence DCP's note that it runs in one process (that is the intent when no process
    group is initialised)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def model_optim(model: torch.nn.Module, optimizer: Any) -> tuple[dict, dict | None]:
    """DCP's state dicts of the model and (if given) the optimizer."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, optimizer)


def _new_stager() -> Any:
    gpu = torch.cuda.is_available()
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 9):
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return BlockingAsyncStager(cache_staged_state_dict=gpu)  # its cache pins memory
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=gpu))


class Stager:
    """A reusable DCP stager: DefaultStager (CPU buffers kept across saves, pinned and copied
    without blocking on a GPU) on torch >= 2.9, which added it; BlockingAsyncStager before.

    Some releases (2.11 among them) close DefaultStager's inner copier after every stage,
    which empties its copy table, so its next stage fails (``KeyError: <class 'type'>``) and
    nothing was cached anyway: such a spent stager is replaced before its next use."""

    def __init__(self) -> None:
        self._inner = _new_stager()  # one per manager: its buffers are reused save after save

    def _spent(self) -> bool:
        copier = getattr(self._inner, "_state_dict_stager", None)
        return copier is not None and not getattr(copier, "_deepcopy_dispatch", True)

    def stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        if self._spent():
            self._inner.close()
            self._inner = _new_stager()
        return self._inner.stage(tensors)

    def close(self) -> None:
        self._inner.close()


_FULL = {errno.ENOSPC: "ENOSPC", errno.EFBIG: "EFBIG", errno.EDQUOT: "EDQUOT"}


def save_failure(exc: BaseException) -> tuple[bool, str]:
    """(whether the disk is full, one line saying what failed) for an error of a save: an
    OSError, DCP's CheckpointException (every rank's errors as text) or a commit error.
    ENOSPC, EFBIG (a file size limit, RLIMIT_FSIZE) and EDQUOT are one condition: no room."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL:
            return True, f"{type(seen).__name__}: {seen}"
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    m = re.search(r"\[Errno (\d+)\][^\n]*", text)
    if m:
        return int(m.group(1)) in _FULL, f"OSError: {m.group(0).strip()}"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return False, f"{type(exc).__name__}: {lines[-1] if lines else ''}"
