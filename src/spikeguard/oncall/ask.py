"""OnCall: the incident a Tier 2 opens, its page, and the answer every rank applies alike.

What the guard calls (``Guard(oncall=...)``; under ``tier2="ask"``, guard/responses/ask.py):

    oncall = OnCall(config, run_dir, run_id=..., layers=[...], plot=draw_png, ask=True)
    oncall.page(summary, step)     # a Tier 2 verdict, on every rank: open or extend the incident
    decision = oncall.poll(step)   # every step boundary, on every rank: None, or the same
                                   # Decision on every rank (rank 0 reads it and broadcasts)
    ...the guard applies it (responses/ask.py: answer)...
    oncall.applied(decision, step, what)   # incidents.jsonl, incident.json, config.json
    oncall.take_note()             # what the next metrics record carries under ``oncall``
    oncall.close(halted=...)       # the run's end -> (pages sent, pages unsent)

Rank 0 owns the files (answer.py) and the pager; the other ranks hold only whether an incident
waits for an answer, which they know because every rank sees the same verdicts. ``poll`` costs
nothing while no incident waits: no file read and no collective. While one waits, rank 0 reads
the answer file (a stat when there is none) and one ``broadcast_object_list`` carries the
decision, or None, to the other ranks. With no answer after ``answer_within_s`` seconds (rank 0's
clock, so the ranks cannot disagree), ``answer_default`` applies with ``by="timeout"``.

An incident is extended, not re-paged, by a Tier 2 while it waits or after ``continue``; after a
rollback a Tier 2 is a new incident. ``resolve_after`` steps without a Tier 2 after a decision
(or after the last alert, when pages are not answered) resolve it: PagerDuty gets ``resolve``
with the incident's dedup key.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import shlex
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import _dist
from .answer import Answer, answer_path, incident_path, oncall_dir, take_answer, write_json
from .config import OnCallConfig
from .pager import PageEvent, Pager
from .settings import SETTINGS, config_with

__all__ = ["Decision", "OnCall"]

log = logging.getLogger("spikeguard")


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What every rank applies at the step boundary ``poll`` returned it at."""

    incident: str
    action: str
    """rollback, continue or halt."""
    to: int | None = None
    skip_data: tuple[int, int] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    by: str = "person"
    """person, or timeout (the configured default)."""
    waited_s: float = 0.0


def _broadcast(decision: Decision | None) -> Decision | None:
    """Rank 0's decision on every rank: one broadcast of its JSON text (plain data)."""
    import torch.distributed as dist

    text = json.dumps(asdict(decision)) if decision is not None else None
    box = [text]
    device = _dist.collective_device()
    dist.broadcast_object_list(box, src=0, device=None if device.type == "cpu" else device)
    if box[0] is None:
        return None
    d = json.loads(box[0])
    d["skip_data"] = tuple(d["skip_data"]) if d["skip_data"] is not None else None
    return Decision(**d)


def _clean(x: Any) -> Any:
    """JSON-safe: non-finite floats become None (a strict reader rejects NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def answer_commands(run_dir: Path, incident: str, summary: dict[str, Any]) -> dict[str, str]:
    """The exact commands that answer ``incident`` (rollback to the suggested checkpoint; with
    the summary's ``remedy_settings``, the same rollback applying them too)."""
    base = f"spikeguard respond {shlex.quote(str(run_dir))}"
    rollback = f"{base} rollback --incident {incident}"
    if summary.get("rollback_checkpoint") is not None:
        rollback += f" --to {summary['rollback_checkpoint']}"
    rng = summary.get("data_range")
    if rng:
        rollback += f" --skip-data {rng[0]}:{rng[1]}"
    out = {"rollback": rollback}
    if summary.get("remedy_settings"):  # the page's remedy, applied with the rollback
        out["rollback_with_remedy"] = rollback + "".join(
            f" --set {shlex.quote(s)}" for s in summary["remedy_settings"])
    return {**out, "continue": f"{base} continue --incident {incident}",
            "halt": f"{base} halt --incident {incident}"}


class OnCall:
    """Incidents, pages and answers of one run (module docstring). ``layers``: the model's
    module names (what ``--set precision.M`` may name); ``plot(path)`` draws the run's last
    window to ``path`` (it runs on the pager's thread); ``checkpoints()`` lists the healthy
    checkpoint steps (default: read RUN_DIR/checkpoints). ``max_rollbacks``: rollbacks by
    answers after which a default (nobody answered) that would roll back halts instead, as the
    guard's rollback budget does; a person's answer is never refused for it. ``ask``: an
    incident waits for an answer (``GuardConfig(tier2="ask")``); otherwise pages only."""

    def __init__(self, config: OnCallConfig, run_dir: str | Path, *, run_id: str = "",
                 layers: list[str] | None = None,
                 plot: Callable[[Path], Any] | None = None,
                 checkpoints: Callable[[], list[int]] | None = None,
                 max_rollbacks: int = 3, ask: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.ask = config, ask
        self.run_dir = Path(run_dir).resolve()
        self.run_id = run_id
        self.layers = list(layers or [])
        self.plot, self.clock = plot, clock
        self.rank, self.world = _dist.rank(), _dist.world_size()
        self._checkpoints = checkpoints
        self.max_rollbacks = max_rollbacks
        self.rollbacks = 0         # rollbacks applied through answers (the default's budget)
        self.pager = Pager(config, self.run_dir) if config.pages and self.rank == 0 else None
        self.incident: dict[str, Any] | None = None  # rank 0: the file's content
        self.open = False          # every rank: an incident not yet resolved
        self.waiting = False       # every rank: an incident waits for an answer (ask)
        self.after_rollback = False
        self.quiet = 0             # step boundaries since the last Tier 2
        self.deadline = math.inf
        self.opened_at = 0.0
        self.incidents = 0
        self._note: dict[str, Any] | None = None

    @staticmethod
    def start(run_dir: str | Path, *, resume: bool) -> None:
        """Rank 0, before the run: a fresh run clears the last run's incidents and pages; a
        resumed one marks an incident left open as abandoned (its answer would meet a run that
        no longer waits for it)."""
        run_dir = Path(run_dir)
        if not resume:
            shutil.rmtree(oncall_dir(run_dir), ignore_errors=True)
            (run_dir / "pages.jsonl").unlink(missing_ok=True)
            return
        try:
            inc = json.loads(incident_path(run_dir).read_text())
        except (OSError, ValueError):
            return
        if inc.get("status") == "open":
            inc.update(status="abandoned", resolved="the run restarted before an answer")
            write_json(incident_path(run_dir), inc)
        answer_path(run_dir).unlink(missing_ok=True)

    # -- what a Tier 2 response calls ---------------------------------------------------------
    def page(self, summary: dict[str, Any], step: int | None = None) -> None:
        """A Tier 2 verdict (every rank): open an incident and page, or extend the open one."""
        step = int(summary.get("step", step if step is not None else -1))
        self.quiet = 0
        if self.open and not self.after_rollback:
            if self.rank == 0 and self.incident is not None:
                self.incident["alerts"] = self.incident.get("alerts", 1) + 1
                self.incident["last_alert_step"] = step
                self._write_incident()
            return
        if self.open:  # a Tier 2 after a rollback: the old incident is over, this is new
            self._resolve("superseded by a new Tier 2 after the rollback")
        self.open, self.waiting, self.after_rollback = True, self.ask, False
        self.incidents += 1
        self.opened_at = self.clock()
        self.deadline = self.opened_at + self.config.answer_within_s
        if self.rank != 0:
            return
        ident = f"{step}-{secrets.token_hex(3)}"
        png = oncall_dir(self.run_dir) / f"incident-{ident}.png"
        summary = _clean(summary)
        page = {"incident": ident, "run_dir": str(self.run_dir), "host": socket.gethostname(),
                "summary": summary, "plot": str(png),
                "answers": answer_commands(self.run_dir, ident, summary),
                "watch": f"spikeguard watch {shlex.quote(str(self.run_dir))}",
                "ask": self.ask, "answer_within_s": self.config.answer_within_s,
                "answer_default": self.config.answer_default}
        self.incident = {"id": ident, "step": step, "status": "open", "opened": time.time(),
                         "alerts": 1, "page": page, "summary": summary, "plot": str(png),
                         "settings": list(SETTINGS),
                         "layers": self.layers, "refused": [], "pages": {}}
        self._write_incident()
        self._log({"event": "incident", "incident": ident, "step": step, "summary": summary})
        if self.pager is not None:
            draw = (lambda: self.plot(png)) if self.plot is not None else None
            self.pager.send(PageEvent(action="trigger", incident=ident,
                                      dedup_key=self._dedup(ident), page=page, before_send=draw))
        elif self.plot is not None:  # no pager: the watch page still shows it (off-thread)
            threading.Thread(target=self.plot, args=(png,), name="spikeguard-plot",
                             daemon=True).start()

    def poll(self, step: int) -> Decision | None:
        """At a step boundary, on every rank: the decision to apply now, the same on every rank,
        or None (module docstring)."""
        if not self.open:
            return None
        if not self.waiting:
            self.quiet += 1
            if self.quiet >= self.config.resolve_after:
                self._resolve("recovered: no Tier 2 for "
                              f"{self.config.resolve_after} steps")
            return None
        decision = self._read(step) if self.rank == 0 else None
        if self.world > 1:
            decision = _broadcast(decision)
        if decision is not None:
            self.waiting = False
            self.quiet = 0
        return decision

    def applied(self, decision: Decision, step: int, what: dict[str, Any]) -> None:
        """Record a decision applied at ``step``: incidents.jsonl, incident.json, config.json's
        ``oncall`` section (a resumed run keeps the settings) and the next metrics record."""
        self.after_rollback = decision.action == "rollback"
        self.rollbacks += self.after_rollback
        note = {"incident": decision.incident, "decision": decision.action, "by": decision.by,
                "waited_s": round(decision.waited_s, 3), **_clean(what)}
        self._note = note
        if decision.action == "halt":
            self.open = False
        if self.rank != 0:
            return
        if self.incident is not None:
            self.incident.update(status="decided" if decision.action != "halt" else "halted",
                                 decision={**note, "step": step})
            self._write_incident()
        self._log({"event": "decision", "step": step, **note})
        log.warning("spikeguard: on-call: incident %s answered %s (by %s) at step %d: %s",
                    decision.incident, decision.action, decision.by, step,
                    {k: v for k, v in note.items() if k not in ("incident", "decision", "by")})
        self._save_config(decision, step, what)
        if decision.action == "halt" and decision.by == "person":
            self._send_resolve(decision.incident)

    def take_note(self) -> dict[str, Any] | None:
        """What the next metrics record carries under ``oncall`` (once)."""
        note, self._note = self._note, None
        return note

    def close(self, *, halted: bool = False) -> tuple[int, int]:
        """End of the run: a decided incident is resolved unless the run halted, one still
        waiting is marked abandoned; pages still in flight get a few seconds, then what is left
        is kept as unsent. (sent, unsent)."""
        if self.open and not self.waiting and not halted:
            self._resolve("the run ended")
        elif self.waiting and self.rank == 0 and self.incident is not None:
            # nothing will read an answer now: respond refuses one instead of writing it
            self.incident.update(status="abandoned", resolved="the run ended before an answer")
            self._write_incident()
            self._log({"event": "abandoned", "incident": self.incident["id"]})
        self.open = self.waiting = False
        if self.pager is None:
            return 0, 0
        sent, unsent = self.pager.close(wait_s=min(5.0, self.config.page_timeout_s))
        if self.incident is not None:
            self.incident["pages"] = {"sent": sent, "unsent": unsent,
                                      "log": str(self.run_dir / "pages.jsonl")}
            self._write_incident()
        return sent, unsent

    # -- rank 0 -------------------------------------------------------------------------------
    def _read(self, step: int) -> Decision | None:
        inc = self.incident
        assert inc is not None
        answer, why = take_answer(self.run_dir, inc["id"], layers=self.layers,
                                  checkpoints=self._healthy)
        waited = self.clock() - self.opened_at
        if why is not None:
            inc["refused"].append({"step": step, "why": why})
            self._write_incident()
            self._log({"event": "refused", "incident": inc["id"], "step": step, "why": why})
            self._note = {"incident": inc["id"], "refused": why}
        if answer is None and self.clock() >= self.deadline:
            answer = self._default(inc, self._healthy())
        if answer is None:
            return None
        return Decision(incident=inc["id"], action=answer.action, to=answer.to,
                        skip_data=answer.skip_data, settings=dict(answer.settings),
                        by=answer.by, waited_s=waited)

    def _healthy(self) -> list[int]:
        if self._checkpoints is not None:
            return self._checkpoints()
        from .answer import healthy_checkpoints

        return healthy_checkpoints(self.run_dir)

    def _default(self, inc: dict[str, Any], steps: list[int]) -> Answer:
        action = self.config.answer_default
        to = inc["summary"].get("rollback_checkpoint")
        if action == "rollback" and self.rollbacks >= self.max_rollbacks:
            # the guard's own rule: a default that would roll back once more halts instead
            self._log({"event": "default", "incident": inc["id"], "why": f"rollback budget of "
                       f"{self.max_rollbacks} exhausted: halt instead"})
            action = "halt"
        elif action == "rollback" and (to is None or to not in steps):
            self._log({"event": "default", "incident": inc["id"], "why": f"no healthy "
                       f"checkpoint at the suggested step {to}: continue instead"})
            action = "continue"
        return Answer(incident=inc["id"], action=action,
                      to=to if action == "rollback" else None, by="timeout")

    def _resolve(self, why: str) -> None:
        self.open = self.waiting = False
        if self.rank != 0 or self.incident is None:
            return
        if self.incident.get("status") in ("resolved", "halted"):
            return
        self.incident.update(status="resolved", resolved=why)
        self._write_incident()
        self._log({"event": "resolved", "incident": self.incident["id"], "why": why})
        self._send_resolve(self.incident["id"])

    def _send_resolve(self, ident: str) -> None:
        if self.pager is not None:
            self.pager.send(PageEvent(action="resolve", incident=ident,
                                      dedup_key=self._dedup(ident),
                                      page={"incident": ident, "run_dir": str(self.run_dir)}))

    def _dedup(self, ident: str) -> str:
        return f"spikeguard/{self.run_id[:12] or self.run_dir.name}/{ident}"

    def _write_incident(self) -> None:
        if self.incident is not None:
            write_json(incident_path(self.run_dir), self.incident)

    def _log(self, line: dict[str, Any]) -> None:
        path = oncall_dir(self.run_dir) / "incidents.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(_clean({"time": time.time(), **line}), default=str) + "\n")

    def _save_config(self, decision: Decision, step: int, what: dict[str, Any]) -> None:
        path = self.run_dir / "config.json"
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        section = meta.setdefault("oncall", {"answers": [], "overrides": {}, "skip_data": []})
        section["answers"].append({"step": step, "incident": decision.incident,
                                   "action": decision.action, "by": decision.by,
                                   "to": decision.to, "skip_data": decision.skip_data,
                                   "settings": decision.settings})
        section["overrides"].update(what.get("settings", {}))
        if decision.skip_data is not None:
            section["skip_data"].append(list(decision.skip_data))
        config_with(meta.get("config"), what.get("settings", {}))
        write_json(path, meta)
