"""The pieces that put the guard into torchtitan's Trainer without importing torchtitan: the
optimizers as one optimizer (the inner ones' groups and LRs), the dataloader as a data source
with a position and skip ranges, the guard's state as a checkpointed Stateful, and torchtitan's
CheckpointManager behind the interface the guard rolls back through.

Each piece is duck-typed against what torchtitan 0.3.0 hands over (``OptimizersContainer``:
``.optimizers``; ``CheckpointManager``: ``states``, ``save``, ``load``; a ``StatefulDataLoader``),
so it is tested where torchtitan is installed and imported by ``integrations/torchtitan.py``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointInfo, retention
from ._incidents import Incident

__all__ = ["JsonState", "OptimizersView", "TitanBatches", "TitanCheckpoints", "scaled_lr"]


class OptimizersView(torch.optim.Optimizer):
    """torchtitan's ``OptimizersContainer`` as the one optimizer the guard is built with.

    The container's own ``param_groups`` is a single group without an ``lr`` (it calls
    ``Optimizer.__init__(all_params, {})``), so the guard would record no LR, and a replay's LR
    ramp and a reconfigure's ``lr_scale`` would change nothing; this view's groups are the inner
    optimizers' own, in order (the first group's LR is the one recorded). ``step()`` steps every
    inner optimizer; a ``found_inf`` the guard sets for one step (its skip gate, a 0-d tensor,
    with read_lag 1) goes to each of them, so fused Adam/AdamW leave params, moments and step
    counts untouched with no host read.
    """

    def __init__(self, container: Any) -> None:
        # no Optimizer.__init__: the inner optimizers own their groups and state
        inner = list(getattr(container, "optimizers", None) or [])
        if not inner:
            raise ValueError("OptimizersView needs torchtitan's OptimizersContainer (its "
                             f"'optimizers' list); got a {type(container).__name__}")
        self.container, self.inner = container, inner
        self.defaults = inner[0].defaults
        # step hooks (the guard's signals read the update through them) run around every inner
        # step at once: without Optimizer.__init__ torch would neither keep nor call them
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._step_supports_amp_scaling = all(
            getattr(o, "_step_supports_amp_scaling", False) for o in inner)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.inner for g in o.param_groups]

    @property
    def state(self) -> Any:  # type: ignore[override]
        merged: dict[Any, Any] = {}
        for o in self.inner:
            merged.update(o.state)
        return merged

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("OptimizersView.step takes no closure (torchtitan's container "
                             "takes none either)")
        found_inf = getattr(self, "found_inf", None)
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        for o in self.inner:
            if found_inf is not None:
                o.found_inf = found_inf
            try:
                o.step()
            finally:
                if found_inf is not None:
                    del o.found_inf
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.container.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.container.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.container.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"OptimizersView({[type(o).__name__ for o in self.inner]})"


@contextlib.contextmanager
def scaled_lr(optimizer: Any, factor: float) -> Iterator[None]:
    """Every group's LR times ``factor`` for one optimizer step (a replay after a rollback ramps
    back up), then as it was: the LR schedulers never see the change."""
    if factor == 1.0:
        yield
        return
    groups = optimizer.param_groups
    saved = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = g["lr"] * factor
    try:
        yield
    finally:
        for g, lr in zip(groups, saved):
            g["lr"] = lr


class TitanBatches:
    """torchtitan's dataloader as the guard's data source: ``position`` (the stream index of
    the next batch it yields, counting every batch drawn on this rank), ``skip(lo, hi)`` (leave
    those indices out: drawn and discarded), ``skip_ranges`` and a state.

    Iterate it in place of the dataloader. After a checkpoint load (resume or rollback) it
    starts a new iterator over the dataloader, which the load rewound (a ``StatefulDataLoader``
    resumes its next ``iter()`` from the state it was given).
    """

    def __init__(self, loader: Any, *, counters: Callable[[], dict[str, Any]] | None = None
                 ) -> None:
        self.loader = loader
        self.position = 0
        self.skip_ranges: list[tuple[int, int]] = []
        self._it: Iterator[Any] | None = None
        self.counters = counters
        """With read_lag 1: the trainer's own counters (its ``state_dict``), which
        ``state_dict`` then carries with the dataloader's state (for a checkpoint written a step
        late: torchtitan pickles the same dataloader state in its own checkpoints)."""

    def __iter__(self) -> TitanBatches:
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                self._it = iter(self.loader)
            batch = next(self._it)
            index, self.position = self.position, self.position + 1
            if not any(lo <= index <= hi for lo, hi in self.skip_ranges):
                return batch

    def skip(self, lo: int, hi: int) -> None:
        """Leave out the batches ``lo``..``hi`` (stream indices, inclusive) when reached."""
        if (lo, hi) not in self.skip_ranges:
            self.skip_ranges.append((int(lo), int(hi)))

    def state_dict(self) -> dict[str, Any]:
        """Position and skip ranges; with ``counters`` (read_lag 1) also the dataloader's state
        (pickled, base64) and the trainer's counters as they are now: the guard takes this at
        each step for a checkpoint of that step written during the next one."""
        state: dict[str, Any] = {"position": self.position,
                                 "skip_ranges": [list(r) for r in self.skip_ranges]}
        if self.counters is not None:
            state["loader"] = base64.b64encode(pickle.dumps(self.loader.state_dict())).decode()
            state["counters"] = dict(self.counters())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.skip_ranges = [(int(lo), int(hi)) for lo, hi in state["skip_ranges"]]
        self._it = None  # the dataloader was rewound with this state: iterate it anew


class _Frozen:
    """A Stateful that saves a state taken earlier (a checkpoint written a step late)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("a frozen state is only saved")


class JsonState:
    """An object's ``state_dict`` as one JSON string for torch.distributed.checkpoint (the
    guard's own is ``guard.stateful()``, the same form).

    DCP flattens nested dicts and lists into one key per leaf and loads into the structure the
    object has at load time, so a list that grew since the save (the guard's recent batch
    ranges) would load only its first entries; one string leaf loads whole. The state is the
    same on every rank (the guard decides from all-reduced numbers)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps(self.obj.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(json.loads(state["json"]))


_STEP_DIR = re.compile(r"^step-(\d+)$")


class TitanCheckpoints:
    """torchtitan's CheckpointManager behind the interface the guard saves and rolls back
    through (``register``, ``should_save``, ``save``, ``list``, ``restore``, ``wait``).

    With ``defer`` (``guard.decide()``, read_lag 0) ``save`` only notes the step: the trainer
    calls ``commit()`` once it has stepped the optimizers (or not), and torchtitan writes the
    checkpoint then; without (``guard.step()``, read_lag 1) ``save`` writes it. Step numbers: the guard
    counts from 0, torchtitan from 1, so the guard's step ``s`` is
    torchtitan's ``s + 1`` (its folder ``step-{s + 1}``). ``should_save`` is torchtitan's own
    rule (``interval``, the last step, ``enable_first_step_checkpoint``), so a checkpoint is
    written exactly where torchtitan would write it, by torchtitan. The guard's state, the data
    position and which checkpoints saw an alert go into the same checkpoint as Statefuls.
    ``on_restore(step)`` runs after each load (the trainer starts a new data iterator).
    Retention is spikeguard's rule at torchtitan's ``keep_latest_k`` (0 keeps all): the healthy
    checkpoints before an open incident are kept apart; a replay's checkpoint of a step written
    before moves the first one into ``superseded/`` (checkpoint/retention.py).
    """

    def __init__(self, checkpointer: Any, config: Any, *, steps: int, defer: bool,
                 on_restore: Callable[[int], None] | None = None) -> None:
        self.checkpointer, self.config, self.steps = checkpointer, config, steps
        self.defer, self.on_restore = defer, on_restore
        self.folder = Path(checkpointer.folder)
        self.alerts: dict[int, list[str]] = {}
        """The guard's step of each checkpoint saved -> the alerts raised in its window."""
        self.incidents: list[Incident] = []
        """The rollbacks so far (the recurring-fault rule; kept across restores)."""
        self.pending: int | None = None
        """The guard's step of a checkpoint asked for and not yet written (``commit``)."""
        # retention is spikeguard's (checkpoint/retention.py): torchtitan's keep_latest_k would
        # delete the healthy checkpoints before an incident while its own ones pile up
        self.keep = int(getattr(checkpointer, "keep_latest_k", 0) or 0)
        checkpointer.keep_latest_k = 0
        self.register(checkpoints=self)

    def register(self, **states: Any) -> None:
        """Add the guard's Statefuls to torchtitan's checkpoint; the model, optimizers and LR
        schedulers are torchtitan's own states already, so they are not added twice."""
        for name, obj in states.items():
            if obj is None or name in ("model", "optimizer", "scheduler"):
                continue
            if name == "scaler":
                raise ValueError("a loss scaler (fp16) is not supported under torchtitan; use "
                                 "its bf16 mixed precision (training.mixed_precision_param)")
            # the guard's own Stateful also continues its metrics file on a resume
            stateful = obj.stateful() if name == "guard" else JsonState(obj)
            self.checkpointer.states[f"spikeguard_{name}"] = stateful

    def should_save(self, step: int) -> bool:
        cfg, t = self.config, step + 1
        if not cfg.enable or cfg.load_only:
            return False
        return (t == 1 and cfg.enable_first_step_checkpoint) or t == self.steps or \
            t % cfg.interval == 0

    def save(self, step: int, *, alerts: list[str] | tuple[str, ...] = (),
             snapshot: Any = None, **_: Any) -> None:
        """Note the checkpoint of the guard's ``step`` (``defer``: ``commit`` writes it), or
        write it now. ``snapshot["data"]`` (read_lag 1: the step is written during the next one,
        whose batches are drawn already) is ``TitanBatches.state_dict()`` from the step itself:
        the dataloader, the data position and the trainer's counters are saved as they were
        then; the model, optimizers and LR schedulers are as the step left them."""
        self.alerts[step] = list(alerts)
        if self.defer:
            self.pending = step
            return
        data = snapshot.get("data") if snapshot else None
        if data is None or "loader" not in data:
            self._write(step)
            return
        states = self.checkpointer.states
        frozen = {"dataloader": pickle.loads(base64.b64decode(data["loader"])),
                  "spikeguard_data": {"json": json.dumps(data)},
                  "train_state": data["counters"]}
        live = {name: states[name] for name in frozen}
        states.update({name: _Frozen(state) for name, state in frozen.items()})
        try:
            self._write(step)
        finally:
            states.update(live)

    def _write(self, step: int) -> None:
        """torchtitan writes the checkpoint of the guard's ``step``; one of that step written
        before a rollback is set aside first (``superseded/``), never overwritten; then
        retention."""
        import torch.distributed as dist

        path = self.folder / f"step-{step + 1}"
        exists = path.exists()
        if dist.is_initialized():
            dist.barrier()  # every rank has looked before rank 0 moves it
        if exists:
            self.checkpointer.maybe_wait_for_saving()
            if not dist.is_initialized() or dist.get_rank() == 0:
                retention.set_aside(path)
            if dist.is_initialized():
                dist.barrier()  # moved before any rank writes into the folder
        self.checkpointer.save(step + 1, last_step=step + 1 == self.steps)
        if self.keep and (not dist.is_initialized() or dist.get_rank() == 0):
            import shutil

            for c in retention.stale(self.list(), self.keep):
                shutil.rmtree(c.path, ignore_errors=True)

    def commit(self) -> None:
        """Write the checkpoint ``save`` asked for, now that the trainer applied (or withheld)
        the step's update: ``guard.decide()`` saves before it returns, and a checkpoint of step
        ``s`` must hold the state after update ``s``."""
        if self.pending is None:
            return
        step, self.pending = self.pending, None
        self._write(step)

    def list(self) -> list[CheckpointInfo]:
        """The committed checkpoints in torchtitan's folder (a DCP ``.metadata`` present),
        oldest first, each at the guard's step, healthy unless an alert was raised in its
        window."""
        if not self.folder.is_dir():
            return []
        found = []
        for name in os.listdir(self.folder):
            m = _STEP_DIR.match(name)
            if m and (self.folder / name / ".metadata").is_file() and int(m.group(1)) > 0:
                step = int(m.group(1)) - 1
                alerts = tuple(self.alerts.get(step, ()))
                found.append(CheckpointInfo(step=step, path=self.folder / name,
                                            healthy=not alerts, alerts=alerts))
        return sorted(found, key=lambda c: c.step)

    def restore(self, at_or_before: int | None = None, also: Any = ()) -> CheckpointInfo:
        """Load the newest checkpoint at or before the guard's step ``at_or_before`` (the newest
        of all when None) through torchtitan's ``load``: model, optimizers, LR schedulers,
        dataloader, train state, and the guard's own states. ``also`` (the steps a rollback
        counts as healed) changes nothing here: every listed checkpoint is a candidate."""
        from ..checkpoint.info import CheckpointError

        infos = [c for c in self.list() if at_or_before is None or c.step <= at_or_before]
        if not infos:
            raise CheckpointError(f"no checkpoint at or before step {at_or_before} in "
                                  f"{self.folder}")
        info = infos[-1]
        self.checkpointer.maybe_wait_for_saving()  # an async save still in flight finishes first
        self.checkpointer.load(step=info.step + 1)
        if self.on_restore is not None:
            self.on_restore(info.step)
        return info

    def wait(self) -> None:
        self.checkpointer.maybe_wait_for_saving()

    def state_dict(self) -> dict[str, Any]:
        return {"alerts": {str(k): v for k, v in self.alerts.items()},
                "incidents": [i.to_dict() for i in self.incidents]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loaded = {int(k): list(v) for k, v in state["alerts"].items()}
        # a rollback loads an older list: what this run learned since stays
        self.alerts = {**loaded, **self.alerts}
        incidents = [Incident.from_dict(i) for i in state.get("incidents", [])]
        if len(incidents) > len(self.incidents):  # a resume; a rollback's list is older
            self.incidents = incidents
