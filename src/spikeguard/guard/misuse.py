"""Warnings for a loop that uses the guard in a way that silently defeats it.

Each is a ``GuardMisuseWarning`` with the numbers behind it and the fix, issued once per guard:

- **a foreign GradScaler**: the loop still calls ``scaler.scale(loss).backward()`` with its own
  ``torch.amp.GradScaler``, so the gradients the guard measures are multiplied by the scale
  (65,536 at the start) and every norm and threshold is off by that factor. A large norm alone
  cannot tell a scaled gradient from a real spike, so the norm only triggers the check: on the
  first step whose norm is above ``_SUSPECT_NORM`` (or not finite) the guard looks once for a
  live, enabled GradScaler that no spikeguard precision runtime owns whose scale is set (it has scaled a loss). That
  is reliable (the scaler says so itself) and costs one walk of the live objects, once.
- **a rollback without data=**: ``tier2="rollback"`` with no data source cannot leave the bad
  batches out, so the replay draws them again (or the same random ones).
- **a loop that does not follow step_index**: after a rollback the guard's ``step_index`` went
  back; a loop that counts its own iterations never replays those steps and ends early (and an
  LR schedule by iteration runs ahead). The guard notes whether ``step_index`` was read between
  the rollback and the next step.

- **a scheduler stepped twice**: ``Guard(scheduler=...)`` steps the LR schedule once per applied
  update; a loop that keeps its own ``scheduler.step()`` runs the schedule twice as fast. The
  guard steps it at most once per ``guard.step``, so when ``scheduler.last_epoch`` moved by two
  or more between two calls, someone else stepped it.
- **a gradient clipped before the guard**: ``clip_grad_norm_`` (or ``accelerator.clip_grad_norm_``)
  kept before ``guard.step`` hides every spike: the norm the guard measures is the clip value.
  Unclipped norms never agree to 1e-4 five steps in a row; clipped ones do, so the guard warns
  after ``_CLIPPED_RUN`` positive norms in a row within ``_CLIPPED_RTOL`` of each other.

The other two live where the value is read: an LR the guard cannot find (``step.Updater``,
recorded as None) and a micro-batch loss whose reduction is not the micro-batch's own mean
(``micro.MicroBatches``).
"""

from __future__ import annotations

import gc
import math
import warnings
from typing import Any

import torch

from ..measure.precision import PrecisionRuntime
from .adapter import GuardMisuseWarning

__all__ = ["MisuseWatch", "foreign_scaler"]

_SUSPECT_NORM = 1e3
"""A global gradient norm above this (unclipped) makes the guard look for a foreign GradScaler:
unscaled gradients of a model at a sane LR are orders of magnitude below it, scaled ones (x 2^16
at the start) are above it."""


def foreign_scaler() -> torch.amp.GradScaler | None:
    """A live, enabled ``torch.amp.GradScaler`` that no spikeguard precision runtime owns and
    that has scaled a loss (its scale is set), or None. Collects garbage first (a dropped
    scaler caught in a reference cycle is not in use), then walks the live objects once (tens of
    milliseconds to a few tenths of a second in a large process)."""
    gc.collect()
    scalers, owned = [], set()
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that reads __class__, which some proxies warn about
        if issubclass(kind, torch.amp.GradScaler):
            scalers.append(obj)
        elif issubclass(kind, PrecisionRuntime) and obj.scaler is not None:
            owned.add(id(obj.scaler))
    for s in scalers:
        if id(s) not in owned and s.is_enabled() and getattr(s, "_scale", None) is not None:
            return s
    return None


_CLIPPED_RUN = 5
"""Steps in a row whose measured norms agree within ``_CLIPPED_RTOL``: the gradient was clipped
before the guard measured it (natural norms move by far more than 1e-4 from step to step)."""
_CLIPPED_RTOL = 1e-4


class MisuseWatch:
    """The guard's once-only misuse warnings (module docstring), built with the config and the
    data source."""

    def __init__(self, config: Any, data: Any, scheduler: Any = None) -> None:
        self.scheduler = scheduler
        self._epoch: int | None = None  # the scheduler's last_epoch as the last step began
        self._warned_schedule = self._warned_clipped = False
        self._norms: list[float] = []
        self.index_read = True
        """Whether the loop read ``guard.step_index`` since the last rollback."""
        self._rollback: tuple[int, int] | None = None
        self._scanned = False
        if config.tier2 == "rollback" and data is None and config.respond:
            warnings.warn("GuardConfig(tier2='rollback') without Guard(data=...): a rollback "
                          "restores the checkpoint but cannot leave the anomaly's batches out, so "
                          "the replay draws them (or the same random ones) again; pass the data "
                          "source (a TokenStream, or anything with position, skip, state_dict "
                          "and load_state_dict: spikeguard.DataSource)", GuardMisuseWarning,
                          stacklevel=3)

    def rolled_back(self, detected: int, restored: int) -> None:
        """A rollback at step ``detected`` set the guard back to step ``restored``."""
        self._rollback = (detected, restored)
        self.index_read = False

    def before_step(self) -> None:
        """A new step starts: after a rollback, the loop should have read ``step_index``; the
        schedule moved by at most the guard's own one step since the last call."""
        self._check_schedule()
        if self._rollback is None:
            return
        (detected, restored), self._rollback = self._rollback, None
        if not self.index_read:
            warnings.warn(f"the guard rolled back at step {detected} to step {restored}, but the "
                          "loop has not read guard.step_index since: a loop that counts its own "
                          f"iterations skips the {detected + 1 - restored} replayed steps and "
                          "ends early, and an LR schedule by iteration runs ahead; drive the "
                          "loop by the guard (while guard.step_index < max_steps: ...)",
                          GuardMisuseWarning, stacklevel=3)

    def _check_schedule(self) -> None:
        epoch = getattr(self.scheduler, "last_epoch", None)
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            return
        last, self._epoch = self._epoch, epoch
        if last is None or self._warned_schedule or epoch - last < 2:
            return
        self._warned_schedule = True
        warnings.warn(f"the LR scheduler moved {epoch - last} steps (last_epoch {last} -> "
                      f"{epoch}) between two guard.step calls, but the guard steps it at most "
                      "once: the loop steps it too, so the schedule runs twice as fast (and does "
                      "not hold on a skip); drop your scheduler.step(), since "
                      "Guard(scheduler=...) steps it once per applied update",
                      GuardMisuseWarning, stacklevel=4)

    def _check_clipped(self, grad_norm: float) -> None:
        if self._warned_clipped:
            return
        if not (math.isfinite(grad_norm) and grad_norm > 0):
            self._norms.clear()
            return
        if self._norms and abs(grad_norm - self._norms[0]) > _CLIPPED_RTOL * self._norms[0]:
            self._norms.clear()
        self._norms.append(grad_norm)
        if len(self._norms) < _CLIPPED_RUN:
            return
        self._warned_clipped = True
        warnings.warn(f"the gradient norm the guard measured was {grad_norm:.6g} at "
                      f"{_CLIPPED_RUN} steps in a row (within {_CLIPPED_RTOL:g}): the gradients "
                      "were clipped before guard.step, so the guard sees the clip value, never a "
                      "spike; drop clip_grad_norm_ (or accelerator.clip_grad_norm_) from the "
                      "loop and clip with GuardConfig(clip=...) (default 1.0), which clips "
                      "after measuring", GuardMisuseWarning, stacklevel=4)

    def judged(self, grad_norm: float) -> None:
        """A step's norm reached the host: a run of equal norms means a clip before the guard;
        a suspect one makes the guard look, once, for a foreign GradScaler."""
        self._check_clipped(grad_norm)
        if self._scanned or (math.isfinite(grad_norm) and grad_norm <= _SUSPECT_NORM):
            return
        self._scanned = True
        scaler = foreign_scaler()
        if scaler is None:
            return
        scale = float(scaler.get_scale())
        warnings.warn(f"a torch.amp.GradScaler other than the guard's has scaled a loss (scale "
                      f"{scale:g}), and the gradient norm the guard measured is {grad_norm:g}: "
                      "the gradients are still scaled, so every norm, threshold and clip is off "
                      f"by about {scale:g}x. Drop scaler.scale(loss).backward() and scaler.step(): "
                      "give the guard the policy instead (Guard(precision=sg.PrecisionPolicy("
                      "kind='fp16-mixed')) and guard.backward(loss)), or train in bf16",
                      GuardMisuseWarning, stacklevel=4)
