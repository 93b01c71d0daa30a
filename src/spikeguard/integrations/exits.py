"""The exit statuses of a guarded training script, alike on every stack.

``spikeguard train`` exits 3 when the guard halts the run; the framework integrations' documented
entry points (examples/olmo_core_train.py, examples/torchtitan_train.py) do the same through
``exit_status``, and add one status of their own: ``RELAUNCH``, "the run stopped for a rollback
that a new job must make" (OLMo-core's cancel at a Tier 2, whose relaunch is a new Trainer). A
job script or scheduler reruns the same command on ``RELAUNCH`` and stops on ``HALTED``:

    python train.py; status=$?
    while [ $status -eq 75 ]; do python train.py; status=$?; done   # 3: halted, read report.txt
"""

from __future__ import annotations

__all__ = ["DONE", "EXIT_STATUS", "HALTED", "RELAUNCH", "exit_status"]

DONE = 0
"""The run finished (or was already complete)."""
HALTED = 3
"""The guard halted the run (Tier 3, a storm, a recurring fault); ``report.txt`` says why."""
RELAUNCH = 75
"""The run stopped at a Tier 2 for a rollback a new job makes: run the same command again
(75 is sysexits.h's EX_TEMPFAIL, "try again later")."""

EXIT_STATUS = {DONE: "done", HALTED: "the guard halted the run; report.txt names why",
               RELAUNCH: "stopped for a rollback: run the same command again to make it"}
"""The statuses above, as a table (docs/adapters.md)."""


def exit_status(error: BaseException | None = None, *, relaunch: bool = False) -> int:
    """The status for a script's ``sys.exit``: ``HALTED`` when ``error`` is a TrainingHalted,
    ``RELAUNCH`` when the run stopped for a relaunch, else ``DONE``. Any other error is not
    this function's to map: re-raise it (Python exits 1 with its traceback)."""
    from ..guard import TrainingHalted

    if isinstance(error, TrainingHalted):
        return HALTED
    if error is not None:
        raise ValueError(f"exit_status maps a TrainingHalted, not a {type(error).__name__}; "
                         "re-raise other errors")
    return RELAUNCH if relaunch else DONE
