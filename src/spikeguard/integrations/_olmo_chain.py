"""OLMo-core's rollback as a chain of launches, with one record of healthy checkpoints.

OLMo-core's Trainer owns the data and the step count, so a rollback is a cancel and a relaunch:
a new Trainer that loads an older checkpoint and leaves the anomaly's steps out. Each launch
writes ``spikeguard_run.json`` in its save folder (``RunLedger``): every checkpoint of the run's
current timeline with its health (an alert in its window makes it unhealthy, as under the guard's
own CheckpointManager), across the original run and its relaunches; the Tier 2s relaunched so
far (``Incident``); this launch's ``load_path``, skipped steps, make-up steps and LR ramp; the
Tier 2 that stopped it, while no relaunch has been made of it; and ``relaunched_to``.

``relaunch_config`` makes the next launch from that record (in this process or a new one);
``next_config`` is the whole cross-job recipe: given the run's own TrainerConfig it returns the
launch to run now (the original, a relaunch in progress to resume, or a new relaunch). A
relaunch gets new callbacks: OLMo-core's ``TrainerConfig.replace`` shares the callback objects,
and the old CheckpointerCallback's list of saved paths would make it delete the first run's
checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from .. import _dist
from ..checkpoint.info import rollback_target
from ..guard.lr_scale import replay_scale
from ._incidents import Incident, lowers_lr, recurring

__all__ = ["LEDGER", "RunLedger", "fresh_callbacks", "next_config", "relaunch_config"]

LEDGER = "spikeguard_run.json"
"""The record's file name, in each launch's save folder."""
_FORMAT = "spikeguard-olmo-run/1"


@dataclasses.dataclass
class RunLedger:
    """The record of one launch (module docstring); ``read``/``write`` its JSON file."""

    folder: Path
    root: str = ""
    """The original run's save folder."""
    checkpoints: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """``{"step", "path", "healthy", "alerts"}`` of the current timeline, oldest first."""
    superseded: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Checkpoints of abandoned timelines (after a restored one): kept on disk, never a target."""
    incidents: list[Incident] = dataclasses.field(default_factory=list)
    launch: dict[str, Any] | None = None
    """A relaunch's ``load_path``, ``steps_to_skip``, ``made_up`` and ``lr_ramp``."""
    lr_scale: float = 0.5
    """GuardConfig.rollback_lr_scale of the run (the relaunch's replay LR)."""
    lr_keep: bool = False
    """GuardConfig.rollback_lr_keep of the run (a record written before it: False, the rule
    of then: a fault that came back on a relaunch halted)."""
    max_rollbacks: int = 3
    """GuardConfig.max_rollbacks of the run: the relaunches a chain may make."""
    tier2: dict[str, Any] | None = None
    """The Tier 2 summary this launch stopped at, for a relaunch (None: it did not)."""
    relaunched_to: str | None = None

    @classmethod
    def read(cls, folder: str | Path) -> RunLedger | None:
        path = Path(folder) / LEDGER
        if not path.is_file():
            return None
        d = json.loads(path.read_text())
        if d.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a spikeguard OLMo-core run record ({_FORMAT})")
        return cls(folder=Path(folder), root=d["root"], checkpoints=d["checkpoints"],
                   superseded=d["superseded"],
                   incidents=[Incident.from_dict(i) for i in d["incidents"]],
                   launch=d["launch"], lr_scale=float(d["lr_scale"]),
                   lr_keep=bool(d.get("lr_keep", False)),
                   max_rollbacks=int(d.get("max_rollbacks", 3)), tier2=d["tier2"],
                   relaunched_to=d["relaunched_to"])

    def write(self) -> None:
        """Rank 0 writes (atomically: a temporary file renamed); every rank holds the same."""
        if _dist.rank() != 0:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        doc = {"format": _FORMAT, "root": self.root, "checkpoints": self.checkpoints,
               "superseded": self.superseded,
               "incidents": [i.to_dict() for i in self.incidents], "launch": self.launch,
               "lr_scale": self.lr_scale, "lr_keep": self.lr_keep,
               "max_rollbacks": self.max_rollbacks, "tier2": self.tier2,
               "relaunched_to": self.relaunched_to}
        tmp = self.folder / f".{LEDGER}.tmp"
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, self.folder / LEDGER)

    def note(self, step: int, path: Path, alerts: list[str]) -> bool:
        """Add the checkpoint at ``path`` (step ``step``) once; True when it is new."""
        p = str(Path(path).resolve())
        if any(c["path"] == p for c in self.checkpoints):
            return False
        self.checkpoints.append({"step": int(step), "path": p, "healthy": not alerts,
                                 "alerts": list(alerts)})
        return True

    def stopped(self, onset: int) -> str | None:
        """None when a Tier 2 whose anomaly began at ``onset`` may be relaunched; else why not:
        "came back" (during the last relaunch's replay, and a relaunch would not keep the LR
        lower: ``lowers_lr``), or the relaunch budget (``max_rollbacks``) is spent."""
        last = recurring(self.incidents, onset)
        if last is not None and not lowers_lr(self.lr_keep, self.lr_scale):
            return "came back"
        if len(self.incidents) >= self.max_rollbacks:
            return (f"rollback budget of {self.max_rollbacks} exhausted (the relaunches so far "
                    f"restored steps {[i.restored for i in self.incidents]})")
        return None

    def target(self, onset: int) -> dict[str, Any] | None:
        """The newest healthy checkpoint at or before ``onset - 2`` still on disk."""
        healthy = [c for c in self.checkpoints if c["healthy"] and Path(c["path"]).is_dir()]
        step = rollback_target(onset, [c["step"] for c in healthy])
        return None if step is None else [c for c in healthy if c["step"] == step][-1]


def fresh_callbacks(callbacks: dict[str, Any] | None) -> dict[str, Any]:
    """New callback objects with the same settings: a dataclass callback (OLMo-core's own) is
    built again from its public fields, one with ``fresh()`` (SpikeguardCallback) makes its
    copy; any other is refused, since sharing it would carry the first run's bookkeeping."""
    out: dict[str, Any] = {}
    for name, cb in (callbacks or {}).items():
        if hasattr(cb, "fresh"):
            out[name] = cb.fresh()
        elif dataclasses.is_dataclass(cb):
            kw = {f.name: getattr(cb, f.name) for f in dataclasses.fields(cb)
                  if f.init and not f.name.startswith("_")}
            out[name] = type(cb)(**kw)
        else:
            raise ValueError(f"callback {name!r} ({type(cb).__name__}) is neither a dataclass "
                             "nor has fresh(): a relaunch cannot build its own copy; add it "
                             "to the relaunched Trainer with trainer.add_callback instead")
    return out


def _launch_config(config: Any, folder: Path, launch: dict[str, Any]) -> Any:
    from olmo_core.train import Duration, StepSkipRange
    from olmo_core.train.common import DurationUnit

    duration = config.max_duration
    if duration.unit == DurationUnit.steps:
        duration = Duration.steps(duration.value + launch["made_up"])
    skips = [StepSkipRange(start=a, stop=b) for a, b in launch["steps_to_skip"]]
    return config.replace(save_folder=str(folder), load_path=launch["load_path"],
                          steps_to_skip=skips, max_duration=duration,
                          callbacks=fresh_callbacks(config.callbacks))


def _relaunch(config: Any, run: RunLedger, summary: dict[str, Any],
              save_folder: str | Path | None) -> Any:
    onset, detected = int(summary["onset_step"]), int(summary["step"])
    why = run.stopped(onset)
    if why == "came back":
        last = recurring(run.incidents, onset)
        raise ValueError(f"the Tier 2 from step {onset} came back during the replay of the "
                         f"rollback to step {last.restored}: not the data, so no relaunch "
                         "(the run halted with this reason; see its report.txt)")
    if why is not None:
        raise ValueError(f"no relaunch for the Tier 2 from step {onset}: {why}")
    target = run.target(onset)
    if target is None:
        found = sorted(c["step"] for c in run.checkpoints)
        raise ValueError(f"no healthy checkpoint at or before step {onset - 2} in the record "
                         f"{run.folder / LEDGER} (the anomaly began at {onset}; checkpoints "
                         f"{found}): nothing to roll back to")
    n = len(run.incidents) + 1
    folder = Path(save_folder) if save_folder is not None else Path(f"{run.root}-relaunch{n}")
    if folder.resolve() == run.folder.resolve():
        raise ValueError(f"save_folder={folder} is the canceled run's own: its newest "
                         "checkpoint would win over load_path; give a new folder")
    before = run.launch or {"steps_to_skip": [], "made_up": 0, "lr_ramp": None}
    restored = int(target["step"])
    ramp = before["lr_ramp"]  # (first, last, start[, settle]) of the last replay
    last = None if ramp is None else (int(ramp[0]) - 1, int(ramp[1]), float(ramp[2]),
                                      float(ramp[3]) if len(ramp) > 3 else 1.0)
    scale, settle = replay_scale(run.lr_scale, run.lr_keep, last, restored)
    launch = {"load_path": target["path"],
              "steps_to_skip": [*before["steps_to_skip"], [onset, detected + 1]],
              "made_up": before["made_up"] + detected + 1 - onset,
              "lr_ramp": [restored + 1, detected, scale, settle]}
    nxt = RunLedger(folder=folder, root=run.root,
                    checkpoints=[c for c in run.checkpoints if c["step"] <= restored],
                    superseded=[*run.superseded,
                                *(c for c in run.checkpoints if c["step"] > restored)],
                    incidents=[*run.incidents, Incident(onset=onset, detection=detected,
                                                        restored=restored,
                                                        skipped=detected + 1 - onset)],
                    launch=launch, lr_scale=run.lr_scale, lr_keep=run.lr_keep,
                    max_rollbacks=run.max_rollbacks)
    nxt.write()
    run.relaunched_to = str(folder.resolve())
    run.write()
    return _launch_config(config, folder, launch)


def _read(folder: str | Path) -> RunLedger:
    run = RunLedger.read(folder)
    if run is None:
        raise ValueError(f"no {LEDGER} in {folder}: the run was not guarded by "
                         "SpikeguardCallback, so nothing says which checkpoints are healthy")
    return run


def relaunch_config(config: Any, summary: dict[str, Any] | None = None, *,
                    save_folder: str | Path | None = None) -> Any:
    """The rollback as a relaunch of the launch that ``config`` (its TrainerConfig) ran: from
    the newest healthy checkpoint at or before ``onset - 2`` across the run and its earlier
    relaunches, the steps ``onset..detection`` of the Tier 2 ``summary`` (default: the one the
    launch stopped at, from its record) left out with the earlier ranges, as many steps added
    to ``max_duration`` (in steps) as are left out, the replay's LR ramping from
    ``rollback_lr_scale`` back to 1 by the detection step (after a Tier 2 that came back on the
    last replay: from a lower start, kept for good under ``rollback_lr_keep``, as the guard's
    own rollback does: ``guard.lr_scale.replay_scale``), new callbacks, and a new
    ``save_folder`` (default ``<original>-relaunch<n>``). ValueError when the Tier 2 recurred on
    a replay and the LR is not kept lower (the run halted instead), the relaunch budget
    (``max_rollbacks``) is spent, or no healthy checkpoint is old enough."""
    run = _read(config.save_folder)
    summary = summary if summary is not None else run.tier2
    if summary is None:
        raise ValueError(f"the launch in {config.save_folder} did not stop at a Tier 2: "
                         "nothing to relaunch")
    return _relaunch(config, run, summary, save_folder)


def next_config(config: Any) -> Any:
    """The launch to run now, for a job that is rerun after exit status 75 (``exits.RELAUNCH``):
    ``config`` (the run's own TrainerConfig, the same every time) when there is nothing to roll
    back; the newest relaunch when one was made (resumed from its own save folder); a new
    relaunch when the newest launch stopped at a Tier 2."""
    run = RunLedger.read(config.save_folder)
    if run is None:
        return config
    while run.relaunched_to is not None:
        run = _read(run.relaunched_to)
    if run.tier2 is not None:
        return _relaunch(config, run, run.tier2, None)
    if run.launch is None:
        return config
    return _launch_config(config, run.folder, run.launch)
