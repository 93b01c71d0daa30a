"""``spikeguard respond RUN_DIR rollback|continue|halt ...``: answer a running job's incident.

The answer is checked against the run directory first (answer.py); a refusal is one line on
stderr and exit status 2, with nothing written. An accepted answer is one atomic file the run
reads at its next step boundary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .answer import ACTIONS, Answer, AnswerError, parse_range, read_incident, write_answer
from .settings import SETTINGS, split_setting

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (spikeguard train --out)")
    p.add_argument("action", choices=ACTIONS, help="roll back, continue as is, or halt the run")
    p.add_argument("--incident", help="the incident answered (default: the run's open one; the "
                   "page's command names it, so an answer to an old page is refused)")
    p.add_argument("--to", type=int, metavar="STEP", help="rollback: the checkpoint to restore "
                   "(default: the page's suggested one)")
    p.add_argument("--skip-data", metavar="A:B", help="rollback: leave stream batches A..B out "
                   "of the replay (the page's data_range)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help=f"change a setting before going on (repeatable): {', '.join(SETTINGS)}")


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    try:
        if not run_dir.is_dir():
            raise AnswerError(f"{run_dir} is not a directory; give the run's --out directory")
        incident = args.incident
        if incident is None:
            current = read_incident(run_dir)
            incident = current.get("id") if current else ""
        settings = dict(split_setting(s) for s in args.set)
        if len(settings) != len(args.set):
            raise AnswerError("--set names a setting twice; give each once")
        answer = Answer(incident=str(incident), action=args.action, to=args.to,
                        skip_data=parse_range(args.skip_data) if args.skip_data else None,
                        settings=settings)
        path = write_answer(run_dir, answer)
    except (AnswerError, ValueError) as exc:
        print(f"spikeguard respond: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    what = args.action + (f" to step {answer.to}" if answer.to is not None else "")
    if answer.skip_data:
        what += f", skipping batches {answer.skip_data[0]}:{answer.skip_data[1]}"
    if answer.settings:
        what += ", " + ", ".join(f"{k}={v}" for k, v in answer.settings.items())
    print(f"spikeguard respond: answered incident {answer.incident}: {what} ({path}); the run "
          "applies it at its next step boundary")
    return 0
