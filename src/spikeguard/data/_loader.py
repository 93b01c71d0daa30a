"""TokenStream batches loaded by DataLoader worker processes, counted where they are consumed.

Worker ``w`` of ``n`` walks the stream's batch order from the position the loader started at
(skip ranges applied) and produces every n-th batch, starting with the w-th. torch's DataLoader
asks its workers in turn (worker 0, 1, ..., n-1, 0, ...) and returns their batches in that order
(``in_order=True``), so the caller receives the stream's own order: batch b of rank r stays a
pure function of (seed, b, r, world_size) whatever ``num_workers`` is. Each batch travels with
its index, and the main process sets the stream's position from it as the batch is handed to
the caller; what the workers prefetched beyond it is never counted.

When the stream's position or skip ranges change under the loader (``load_state_dict`` after a
restore, ``skip`` after a rollback), the prefetched batches belong to the old order: the loader
drops its workers and starts new ones at the stream's new position.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch

from .._validate import check_int

__all__ = ["StreamLoader"]

# DataLoader arguments the loader sets itself, and why a caller cannot
_OWNED = {
    "batch_size": "the stream makes whole batches (DataLoader batch_size is None)",
    "shuffle": "the stream's order is fixed by its seed",
    "sampler": "the stream's order is fixed by its seed",
    "batch_sampler": "the stream makes whole batches",
    "drop_last": "the stream makes whole batches",
    "collate_fn": "the stream's batches are already tensors",
    "in_order": "the batches must arrive in the stream's order",
    "persistent_workers": "workers are started once and restarted only when the stream's "
                          "state changes (a restore or a skip), which persistent workers would miss",
}


class _Shard(torch.utils.data.IterableDataset):
    """What each worker iterates: a frozen copy of the stream from one position."""

    def __init__(self, stream: Any) -> None:
        self.stream = copy.copy(stream)  # its own permutation cache; the state is frozen here
        self.stream.skip_ranges = list(stream.skip_ranges)

    def __iter__(self) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        s, k = self.stream, 0
        while True:
            index = s.next_index()
            s.position = index + 1
            if k % workers == worker:
                yield (index, worker, *s.batch(index))
            k += 1


class StreamLoader:
    """An endless iterator of (inputs, targets) from a :class:`TokenStream`, loaded by
    ``num_workers`` DataLoader worker processes (0: in this process).

    A rank receives exactly the batches, in the same order, that iterating the stream itself
    would give it, for any ``num_workers``. The stream's ``position`` advances as each batch is
    returned, so ``stream.state_dict()`` (saved by a checkpoint) is right however far the
    workers have prefetched. Restoring or skipping on the stream restarts the workers at the
    new position. The state protocol is the stream's (``state_dict``, ``load_state_dict``,
    ``skip``, ``index_of``, ``next_index``, ``position``), so the loader can stand wherever the
    stream would. ``last_worker`` is the worker that loaded the batch returned last. ``close()``
    stops the workers.
    """

    def __init__(self, stream: Any, *, num_workers: int = 0,
                 **dataloader_kwargs: Any) -> None:
        check_int(num_workers, "StreamLoader num_workers", minimum=0)
        for key in dataloader_kwargs.keys() & _OWNED.keys():
            raise ValueError(f"StreamLoader sets {key} itself ({_OWNED[key]}); leave it out")
        self.stream = stream
        self.num_workers = num_workers
        self.dataloader_kwargs = dataloader_kwargs
        self.last_worker: int | None = None
        self._it: Iterator[Any] | None = None
        self._expect: tuple[int, list[tuple[int, int]]] | None = None

    def _state(self) -> tuple[int, list[tuple[int, int]]]:
        return self.stream.position, list(self.stream.skip_ranges)

    def _start(self) -> None:
        self.close()
        loader = torch.utils.data.DataLoader(_Shard(self.stream), batch_size=None,
                                             num_workers=self.num_workers,
                                             **self.dataloader_kwargs)
        self._it = iter(loader)
        self._expect = self._state()

    def __iter__(self) -> StreamLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._it is None or self._state() != self._expect:
            self._start()  # first call, or the stream was restored or told to skip
        assert self._it is not None
        index, worker, inputs, targets = next(self._it)
        self.stream.position = int(index) + 1
        self.last_worker = int(worker)
        self._expect = self._state()
        return inputs, targets

    def close(self) -> None:
        """Stop the worker processes (a later ``next`` starts new ones). Safe to call twice."""
        # the DataLoader iterator stops its workers when collected, which CPython does as the
        # last reference goes, here
        self._it = None

    def __enter__(self) -> StreamLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the stream's state protocol ---------------------------------------------------------
    @property
    def position(self) -> int:
        """The stream's position: index of the next batch returned to the caller."""
        return self.stream.position

    def next_index(self) -> int:
        return self.stream.next_index()

    def skip(self, start: int, stop: int) -> None:
        self.stream.skip(start, stop)

    def index_of(self, count: int) -> int:
        return self.stream.index_of(count)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.stream.batch(index)

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
