"""The answer protocol: how a person's decision travels through the run directory.

Files under RUN_DIR/oncall/ (rank 0 of the run writes all but ``answer.json``):

- ``incident.json``: the open incident, or the last one: ``id``, ``step``, ``status`` (``open``,
  then ``decided``, then ``resolved``), the Tier 2 summary, the plot, the answer commands, the
  settings a ``--set`` may change and the run's layer names.
- ``answer.json``: a person's answer (``spikeguard respond``, or the watch page), written
  atomically (a temporary file, then ``os.replace``), so a shared file system across nodes is
  enough and the run never reads half a file. It names the incident it answers.
- ``incidents.jsonl``: every incident, answer, refusal and decision, one JSON line each.

``validate`` checks an answer against the run directory before anything is written: the
incident is the open one, ``--to`` names a healthy checkpoint at or before the incident,
``--skip-data`` is a range, every ``--set`` is a known setting with a well-formed value. It
raises AnswerError with one line that says the fix; the run reads the answer with the same
check, so an answer that went stale while it waited (its checkpoint rotated away) is refused
there too and the incident stays open.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .settings import parse_setting

__all__ = ["ACTIONS", "Answer", "AnswerError", "answer_path", "healthy_checkpoints",
           "incident_path", "oncall_dir", "read_incident", "take_answer", "validate",
           "write_answer", "write_json"]

ACTIONS = ("rollback", "continue", "halt")
"""What an answer may say."""


class AnswerError(ValueError):
    """An answer refused before the run is touched; the message is one line with the fix."""


@dataclass(kw_only=True)
class Answer:
    """A person's decision about incident ``incident``."""

    incident: str
    action: str
    to: int | None = None
    """rollback: the checkpoint step to restore (None: the page's suggested one)."""
    skip_data: tuple[int, int] | None = None
    """rollback: stream batch indices [A, B] to leave out of the replay."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Settings to change before going on (``--set``), already parsed."""
    by: str = "person"
    """person, or timeout when the configured default applied."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["skip_data"] = list(self.skip_data) if self.skip_data else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Answer:
        if not isinstance(d, dict):
            raise AnswerError("the answer file does not hold a JSON object; answer again with "
                              "spikeguard respond")
        unknown = set(d) - {"incident", "action", "to", "skip_data", "settings", "by"}
        if unknown:
            raise AnswerError(f"the answer has unknown fields {sorted(unknown)}; answer again "
                              "with spikeguard respond")
        skip = d.get("skip_data")
        try:
            return cls(incident=str(d["incident"]), action=str(d["action"]), to=d.get("to"),
                       skip_data=tuple(skip) if skip is not None else None,  # type: ignore[arg-type]
                       settings=dict(d.get("settings") or {}), by=str(d.get("by", "person")))
        except (KeyError, TypeError, ValueError) as exc:
            raise AnswerError(f"the answer is malformed ({exc}); answer again with spikeguard "
                              "respond") from None


def oncall_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "oncall"


def incident_path(run_dir: str | Path) -> Path:
    return oncall_dir(run_dir) / "incident.json"


def answer_path(run_dir: str | Path) -> Path:
    return oncall_dir(run_dir) / "answer.json"


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` atomically (a reader sees the old file or the new, never half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_incident(run_dir: str | Path) -> dict[str, Any] | None:
    """The current incident (open or not), or None when the run never had one."""
    path = incident_path(run_dir)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise AnswerError(f"{path} cannot be read ({exc}); is RUN_DIR a spikeguard run "
                          "directory?") from None


def healthy_checkpoints(run_dir: str | Path) -> list[int]:
    """Steps of the healthy checkpoints in RUN_DIR/checkpoints, oldest first."""
    from ..checkpoint import CheckpointManager

    return [c.step for c in CheckpointManager(Path(run_dir) / "checkpoints").list() if c.healthy]


def parse_range(text: str) -> tuple[int, int]:
    """'A:B' -> (A, B) with 0 <= A <= B, else AnswerError."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(text))
    if not m or int(m[1]) > int(m[2]):
        raise AnswerError(f"--skip-data {text!r} must be A:B, two batch indices with A <= B "
                          "(the page's data_range)")
    return int(m[1]), int(m[2])


def validate(run_dir: str | Path, answer: Answer, *, layers: list[str] | None = None,
             checkpoints: list[int] | None = None) -> Answer:
    """``answer`` checked against the run directory (module docstring); AnswerError if not.
    Returns it with its settings parsed to values."""
    incident = read_incident(run_dir)
    if incident is None:
        raise AnswerError(f"{run_dir} has no incident to answer (no Tier 2 page yet); "
                          "spikeguard watch RUN_DIR shows the run's state")
    if answer.incident != incident.get("id"):
        raise AnswerError(f"the answer is to incident {answer.incident}, but the run's incident "
                          f"is {incident.get('id')} (status {incident.get('status')}); an answer "
                          "to an old incident is refused: read the latest page")
    if incident.get("status") != "open":
        d = incident.get("decision") or {}
        how = f" ({d.get('decision')} by {d.get('by')})" if d else ""
        raise AnswerError(f"incident {answer.incident} is already {incident.get('status')}"
                          f"{how}; nothing waits for an answer")
    if answer.action not in ACTIONS:
        raise AnswerError(f"answer {answer.action!r} is not one of {', '.join(ACTIONS)}")
    if answer.action != "rollback" and (answer.to is not None or answer.skip_data is not None):
        raise AnswerError(f"--to and --skip-data go with rollback, not {answer.action}")
    if answer.action == "halt" and answer.settings:
        raise AnswerError("--set goes with rollback or continue; a halt changes nothing")
    if answer.action == "rollback":
        steps = checkpoints if checkpoints is not None else healthy_checkpoints(run_dir)
        to = answer.to if answer.to is not None else incident.get("summary", {}).get(
            "rollback_checkpoint")
        if to is None:
            raise AnswerError(f"no checkpoint to roll back to: give --to STEP (healthy "
                              f"checkpoints: {steps or 'none'})")
        if isinstance(to, bool) or not isinstance(to, int) or to not in steps:
            raise AnswerError(f"--to {to}: no healthy checkpoint at that step; choose one of "
                              f"{steps or 'none (the run has saved none yet)'}")
        if to > int(incident["step"]):
            raise AnswerError(f"--to {to} is after the incident's step {incident['step']}; a "
                              f"rollback goes back (checkpoints: {steps})")
        answer.to = to
        if answer.skip_data is not None:
            answer.skip_data = parse_range(f"{answer.skip_data[0]}:{answer.skip_data[1]}")
    known = layers if layers is not None else incident.get("layers", [])
    answer.settings = dict(parse_setting(k, v, layers=known) for k, v in answer.settings.items())
    return answer


def write_answer(run_dir: str | Path, answer: Answer) -> Path:
    """Validate ``answer`` and write it atomically; AnswerError (nothing written) if refused."""
    validate(run_dir, answer)
    path = answer_path(run_dir)
    if path.exists():
        try:
            waiting = json.loads(path.read_text()).get("action", "?")
        except (OSError, ValueError):
            waiting = "?"
        raise AnswerError(f"an answer ({waiting}) to incident {answer.incident} is already "
                          "waiting for the run's next step; it is applied within one step")
    write_json(path, answer.to_dict())
    return path


def take_answer(run_dir: str | Path, incident: str, *, layers: list[str],
                checkpoints: list[int] | Callable[[], list[int]]
                ) -> tuple[Answer | None, str | None]:
    """Rank 0 at a step boundary: the waiting answer to ``incident`` (removed from the
    directory), validated again; (answer, None), (None, why it was refused) or (None, None).
    ``checkpoints`` (the healthy steps, or a callable listing them) is read only when an
    answer is there: a step with no answer costs one failed open."""
    path = answer_path(run_dir)
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return None, None
    path.unlink(missing_ok=True)
    if callable(checkpoints):
        checkpoints = checkpoints()
    try:
        answer = Answer.from_dict(json.loads(raw))
        if answer.incident != incident:
            raise AnswerError(f"the answer is to incident {answer.incident}, not the open "
                              f"incident {incident}; an answer to an old incident is refused")
        return validate(run_dir, answer, layers=layers, checkpoints=checkpoints), None
    except (AnswerError, ValueError) as exc:
        return None, str(exc).splitlines()[0]
