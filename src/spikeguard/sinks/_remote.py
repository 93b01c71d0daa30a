"""Sinks for TensorBoard (extra ``tb``) and Weights & Biases (extra ``wandb``)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from ._base import Sink, check_path, per_rank

__all__ = ["TensorBoardSink", "WandbSink"]

_SKIP = frozenset({"schema", "step"})


def _require(module: str, what: str, extra: str) -> None:
    """A missing extra is a set-up mistake: say so at once, on every rank (found, not imported:
    the ranks that do not write never pay for the import)."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{what} needs {module}: pip install 'spikeguard[{extra}]'")


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers (bools as 0/1), without schema and step; None and text dropped."""
    out = {}
    for key, value in record.items():
        if key in _SKIP or value is None or isinstance(value, (str, list, dict)):
            continue
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
    return out


class TensorBoardSink(Sink):
    """Each number of the record as a TensorBoard scalar under ``prefix + key`` at ``step``
    (NaN and inf kept, as TensorBoard stores them); the reasons of a flagged step as text.
    Uses ``torch.utils.tensorboard.SummaryWriter``; needs ``pip install spikeguard[tb]``.
    Under torch.distributed only rank ``rank`` (default 0) opens a writer; ``rank=None`` opens
    one on every rank, in a ``log_dir`` that must hold ``{rank}`` (``"tb/rank{rank}"``).
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, prefix: str = "",
                 defer: bool | None = None, rank: int | None = 0) -> None:
        check_path(log_dir, "TensorBoardSink", "log_dir")
        super().__init__(defer=defer, rank=rank)  # bad arguments are named before a missing extra
        _require("tensorboard", "TensorBoardSink", "tb")
        self.log_dir = per_rank(log_dir, rank, self.name, "log_dir")
        self.prefix = prefix
        self._writer: Any = None
        if not self.active:
            return
        from torch.utils.tensorboard import SummaryWriter

        try:
            self._writer = SummaryWriter(self.log_dir)
        except Exception as exc:
            self._fail(exc)

    def _write(self, record: dict[str, Any], step: int) -> None:
        for key, value in _scalars(record).items():
            self._writer.add_scalar(self.prefix + key, value, step)
        reasons = record.get("reasons") or []
        if reasons:
            self._writer.add_text(self.prefix + "reasons", "\n".join(map(str, reasons)), step)

    def _close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()


class WandbSink(Sink):
    """Each record as one ``run.log`` call: the numbers, the action and the joined reasons, with
    the training step as the metric ``step`` (so a rollback that repeats steps is kept, not
    dropped as out of order).

    Pass a ``run`` you started, or let the sink call ``wandb.init(project=..., **init_kwargs)``
    (e.g. ``mode="offline", dir=...``) and ``run.finish()`` at close. An init that fails (no
    network, no login) is reported with a ``SinkDisabledWarning`` and disables the sink only.
    Needs ``pip install spikeguard[wandb]``.

    Under torch.distributed only rank ``rank`` (default 0) starts a run: one run per job.
    ``rank=None`` starts one run per rank, and ``name`` must hold ``{rank}`` (``name=
    "exp-rank{rank}", group="exp"``; ``{rank}`` in ``id`` and ``dir`` is replaced too); a
    ``run`` passed in is used on every rank as given.
    """

    def __init__(self, *, run: Any = None, project: str = "spikeguard",
                 defer: bool | None = None, rank: int | None = 0, **init_kwargs: Any) -> None:
        super().__init__(defer=defer, rank=rank)  # bad arguments are named before a missing extra
        _require("wandb", "WandbSink", "wandb")
        if run is None:
            if rank is None or isinstance(init_kwargs.get("name"), str):
                init_kwargs["name"] = per_rank(init_kwargs.get("name") or "", rank, self.name,
                                               "name")
            for key in ("id", "dir"):
                if isinstance(init_kwargs.get(key), str):
                    init_kwargs[key] = per_rank(init_kwargs[key], 0, self.name, key)
        self._owns = run is None
        self.run: Any = run
        self._defined: set[str] = set()
        if not self.active:
            self.run = None
            return
        import wandb

        try:
            if self.run is None:
                self.run = wandb.init(project=project, **init_kwargs)
            self.run.define_metric("step")
        except Exception as exc:
            self._fail(exc)

    def _write(self, record: dict[str, Any], step: int) -> None:
        data: dict[str, Any] = {"step": step, **_scalars(record)}
        if isinstance(record.get("action"), str):
            data["action"] = record["action"]
        reasons = record.get("reasons") or []
        if reasons:
            data["reasons"] = "; ".join(map(str, reasons))
        for key in data.keys() - self._defined - {"step"}:
            # per key, not "*": a run the user passed in keeps its other metrics as they were
            self.run.define_metric(key, step_metric="step")
            self._defined.add(key)
        self.run.log(data)

    def _close(self) -> None:
        if self._owns and self.run is not None:
            run, self.run = self.run, None
            run.finish()
