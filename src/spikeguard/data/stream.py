"""A resumable token stream that can skip a poisoned range of batches.

``TokenStream`` cuts a token array (a memory-mapped uint16 ``.bin`` file, or the default corpus
of :func:`spikeguard.data.load_corpus`) into non-overlapping windows of ``seq_len + 1`` tokens and
deals them out in a seeded random order, epoch after epoch. Batch ``b`` of rank ``r`` is a pure
function of (seed, b, r, world_size): the ranks see disjoint windows, and a stream resumed from
its state_dict yields exactly the batches it would have yielded. Rank and world size come from
torch.distributed unless given (give both to shard over a data-parallel group that is not the
whole world, e.g. under tensor parallelism).

Its state is JSON: ``position`` (index of the next batch), ``skip_ranges`` (inclusive batch
ranges never yielded) and ``dropped`` (rows left out of single batches). After a rollback to a
checkpoint taken at position c+1 with an anomaly whose batches ran from onset o to detection d,
``skip(o, d)`` makes the stream replay c+1..o-1 and continue at d+1; ``drop(b, rows)`` instead
replays batch b without the named rows (the guard's attribution names them).

To load batches in DataLoader worker processes, iterate :meth:`TokenStream.loader`: the workers
take turns at the stream's own order, so a rank receives exactly the batches it would receive
without workers, and the stream's position counts the batches handed to the caller, not those
the workers prefetched. A plain ``DataLoader(stream, batch_size=None)`` works without workers
only: workers cannot report back what was consumed, so that combination raises.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import _dist
from .._validate import check_int
from ._loader import StreamLoader

__all__ = ["TokenStream"]


def _world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size) of the data-parallel group: given, or torch.distributed's."""
    if (rank is None) != (world_size is None):
        raise ValueError(f"TokenStream rank={rank}, world_size={world_size}: give both (the "
                         "data-parallel rank and size) or neither (taken from torch.distributed)")
    if rank is None or world_size is None:
        launched = os.environ.get("WORLD_SIZE", "1")
        if not _dist.is_dist() and launched.isdigit() and int(launched) > 1:
            raise ValueError(f"TokenStream: this process was launched as one of WORLD_SIZE="
                             f"{launched} ranks but torch.distributed is not initialized, so "
                             "every rank would read the same batches; call "
                             "torch.distributed.init_process_group before building the stream, "
                             "or give rank= and world_size=")
        return _dist.rank(), _dist.world_size()
    check_int(world_size, "TokenStream world_size")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"TokenStream rank={rank!r} must be an integer in [0, world_size="
                         f"{world_size})")
    if _dist.is_dist():
        world, me = _dist.world_size(), _dist.rank()
        if world % world_size:
            raise ValueError(f"TokenStream world_size={world_size} does not divide the {world} "
                             "ranks of the process group; give the data-parallel size (the "
                             "world size over the tensor- and pipeline-parallel sizes), or "
                             "neither rank nor world_size")
        if world_size == world and rank != me:
            raise ValueError(f"TokenStream rank={rank} on global rank {me} of world_size="
                             f"{world}: with the whole world as the data-parallel group the "
                             "rank must be this process's rank; give neither rank nor "
                             "world_size to take both from torch.distributed")
    return rank, world_size


def _skipped_to(index: int, ranges: list[tuple[int, int]]) -> int:
    """The first batch index >= ``index`` outside every inclusive range."""
    moved = True
    while moved:
        moved = False
        for lo, hi in ranges:
            if lo <= index <= hi:
                index, moved = hi + 1, True
    return index


def _integer(dtype: Any) -> bool:
    """A numpy or torch integer dtype (bool is not one)."""
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return bool(np.issubdtype(dtype, np.integer))


class TokenStream(torch.utils.data.IterableDataset):
    """Batches of (inputs, targets), int64 [batch_size, seq_len], from a token array.

    Deterministic per (seed, rank, world_size); resumable; skips inclusive batch ranges.
    ``rank`` and ``world_size`` default to torch.distributed's (0 and 1 without a process
    group); a process launched by torchrun with more than one rank must initialise the process
    group first or give both.
    """

    def __init__(self, tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None) -> None:
        if not hasattr(tokens, "ndim") or not hasattr(tokens, "dtype"):
            raise TypeError(f"tokens must be a 1-D numpy array of token ids (np.memmap for a "
                            f".bin file), got {type(tokens).__name__}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if not _integer(tokens.dtype):
            raise ValueError(f"tokens must hold integer token ids, got dtype {tokens.dtype}; "
                             "tokenize the text first (e.g. uint16 ids)")
        check_int(batch_size, "TokenStream batch_size")
        check_int(seq_len, "TokenStream seq_len")
        rank, world_size = _world(rank, world_size)
        self.tokens = tokens
        self.batch_size, self.seq_len = batch_size, seq_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < batch_size * world_size:
            raise ValueError(f"corpus of {len(tokens)} tokens holds {self.n_windows} windows of "
                             f"{seq_len + 1}, fewer than one global batch of "
                             f"{batch_size * world_size}; use a shorter seq_len or batch_size")
        self.position = 0
        self.skip_ranges: list[tuple[int, int]] = []
        self.dropped: dict[int, list[int]] = {}
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @classmethod
    def from_bin(cls, path: str | Path, **kwargs: Any) -> TokenStream:
        """A stream over a tokenized corpus stored as raw uint16 (memory-mapped, not read)."""
        return cls(np.memmap(path, dtype=np.uint16, mode="r"), **kwargs)

    @classmethod
    def from_corpus(cls, name: str = "pydoc", *, split: str = "train", **kwargs: Any) -> TokenStream:
        """A stream over the default corpus of :func:`spikeguard.data.load_corpus` (byte tokens)."""
        from .corpus import load_corpus

        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} must be 'train' or 'val'")
        return cls(getattr(load_corpus(name), split), **kwargs)  # type: ignore[arg-type]

    def __getstate__(self) -> dict[str, Any]:
        # what a DataLoader worker started by spawn receives: a memory-mapped file travels as
        # its path (reopened there, never copied), and the permutation cache stays behind
        state = dict(self.__dict__, _perm_epoch=-1, _perm=np.empty(0, dtype=np.int64))
        tokens = self.tokens
        if isinstance(tokens, np.memmap) and tokens.filename is not None:
            state["tokens"] = ("memmap", tokens.filename, tokens.dtype.str, tokens.offset,
                               tokens.shape)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        tokens = state["tokens"]
        if isinstance(tokens, tuple) and tokens[0] == "memmap":
            _, filename, dtype, offset, shape = tokens
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r",
                                        offset=offset, shape=shape)
        self.__dict__.update(state)

    # -- addressing ---------------------------------------------------------------------------
    def _window_ids(self, batch: int) -> np.ndarray:
        """Global window ids of batch ``batch`` on this rank (epochs reshuffle)."""
        per_batch = self.batch_size * self.world_size
        first = batch * per_batch + self.rank * self.batch_size
        samples = np.arange(first, first + self.batch_size, dtype=np.int64)
        epochs, slots = np.divmod(samples, self.n_windows)
        out = np.empty(self.batch_size, dtype=np.int64)
        for e in np.unique(epochs):
            out[epochs == e] = self._permutation(int(e))[slots[epochs == e]]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``index`` of this rank regardless of position and skips (inputs, targets)."""
        starts = self._window_ids(index) * self.seq_len
        w = np.stack([np.asarray(self.tokens[s: s + self.seq_len + 1]) for s in starts])
        w = torch.from_numpy(w.astype(np.int64))
        if index in self.dropped:
            w = w[self.rows_of(index)]
        return w[:, :-1], w[:, 1:]

    def rows_of(self, index: int) -> list[int]:
        """The rows of batch ``index`` that ``batch`` yields, numbered as in the full batch."""
        gone = self.dropped.get(index, ())
        return [r for r in range(self.batch_size) if r not in gone]

    # -- iteration ----------------------------------------------------------------------------
    def next_index(self) -> int:
        """Index of the batch the next call to ``next`` returns."""
        return _skipped_to(self.position, self.skip_ranges)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.next_index()
        self.position = index + 1
        return self.batch(index)

    def __iter__(self) -> TokenStream:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            raise RuntimeError(
                f"TokenStream iterated in DataLoader worker {info.id} of {info.num_workers}: "
                "each worker holds its own copy, so the batches would repeat and the stream's "
                "saved position would stay where it was when the workers started; iterate "
                f"stream.loader(num_workers={info.num_workers}) instead, which shards the "
                "batches over the workers and counts the batches consumed")
        return self

    def loader(self, num_workers: int = 0, **dataloader_kwargs: Any) -> StreamLoader:
        """An iterator over this stream's batches loaded by ``num_workers`` DataLoader worker
        processes (see :class:`~spikeguard.data.StreamLoader`). Other keyword arguments go to
        ``torch.utils.data.DataLoader`` (``pin_memory``, ``prefetch_factor``,
        ``multiprocessing_context``, ``timeout``, ...)."""
        return StreamLoader(self, num_workers=num_workers, **dataloader_kwargs)

    def skip(self, start: int, stop: int) -> None:
        """Never yield batches ``start..stop`` (inclusive). Recorded in the state."""
        if not 0 <= start <= stop:
            raise ValueError(f"skip range [{start}, {stop}] must satisfy 0 <= start <= stop")
        self.skip_ranges.append((int(start), int(stop)))

    def drop(self, index: int, rows: list[int]) -> None:
        """Yield batch ``index`` without ``rows`` (its row numbers) from now on; dropping every
        row skips the batch. Recorded in the state."""
        bad = [r for r in rows if isinstance(r, bool) or not isinstance(r, int)
               or not 0 <= r < self.batch_size]
        if bad or isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"drop({index!r}, {rows!r}): the batch index must be an int >= 0 and "
                             f"the rows ints in [0, batch_size={self.batch_size})")
        self.dropped[index] = sorted(set(self.dropped.get(index, [])) | set(rows))
        if len(self.dropped[index]) == self.batch_size:
            self.skip(index, index)

    def index_of(self, count: int) -> int:
        """Index of the ``count``-th batch (0-based) yielded from position 0 under the current
        skip ranges: turns a step count into a batch index when ranges were skipped."""
        index = -1
        for _ in range(count + 1):
            index = _skipped_to(index + 1, self.skip_ranges)
        return index

    # -- state (torchdata StatefulDataLoader protocol) ----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able: position, skip ranges, dropped rows and the identity of the stream."""
        return {"position": self.position, "skip_ranges": [list(r) for r in self.skip_ranges],
                "dropped": {str(i): list(r) for i, r in self.dropped.items()},
                "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "batch_size": self.batch_size, "seq_len": self.seq_len,
                "n_tokens": len(self.tokens)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "rank", "world_size", "batch_size", "seq_len", "n_tokens"):
            mine = self.state_dict()[key]
            if key in state and state[key] != mine:
                raise ValueError(f"stream state has {key}={state[key]} but this stream has "
                                 f"{key}={mine}; build the stream as it was when saved (a "
                                 "stream resumes on the same number of data-parallel ranks)")
        self.position = int(state["position"])
        self.skip_ranges = [(int(a), int(b)) for a, b in state.get("skip_ranges", [])]
        self.dropped = {int(i): [int(r) for r in rows]
                        for i, rows in state.get("dropped", {}).items()}
