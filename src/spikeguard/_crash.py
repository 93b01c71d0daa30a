"""Test-only crash points: SIGKILL this process at a named point of a checkpoint save or a step.

The reliability suite (tests/faults) kills a run at deterministic points instead of after a
timer. Setting ``SPIKEGUARD_TEST_CRASH`` to one or more comma-separated ``POINT[@STEP][:RANK]``
makes :func:`crash_point` send SIGKILL to its own process when the point, the step (if given)
and the rank (if given) match; for example ``before_commit`` (every save),
``after_manifest@20`` (the save at step 20) or ``mid_step@25:1`` (rank 1, in the middle of step
25). Under torchrun's elastic agent it fires in the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0), so a restarted job runs through.

Points: ``after_shard`` (DCP's files written, nothing of ours committed), ``before_commit``
(every file written, no manifest yet), ``after_manifest`` (the manifest written, the directory
not yet renamed), ``after_commit`` (renamed: the checkpoint is complete), ``mid_step`` (after
the backward, before ``guard.step``). Unset, a call costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["ENV", "POINTS", "crash_point"]

ENV = "SPIKEGUARD_TEST_CRASH"
POINTS = ("after_shard", "before_commit", "after_manifest", "after_commit", "mid_step")


def _matches(spec: str, point: str, step: int | None) -> bool:
    name, _, rank = spec.strip().partition(":")
    name, _, at = name.partition("@")
    if name not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: {name!r} is not a crash point; use one of "
                         f"{', '.join(POINTS)}, optionally @STEP and :RANK")
    if name != point or (at and step != int(at)):
        return False
    return not rank or int(rank) == int(os.environ.get("RANK", "0"))


def crash_point(point: str, step: int | None = None) -> None:
    """SIGKILL this process when ``SPIKEGUARD_TEST_CRASH`` names ``point`` (see the module)."""
    specs = os.environ.get(ENV)
    if not specs or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if any(_matches(s, point, step) for s in specs.split(",") if s.strip()):
        os.kill(os.getpid(), signal.SIGKILL)
