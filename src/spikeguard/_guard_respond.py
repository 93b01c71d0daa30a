"""The guard's response side: Tier 2 (alert, rollback within a budget) and Tier 3 (halt with
forensics, or resume reconfigured), plus the per-step records that the host side resolves.

Private to :mod:`spikeguard.guard`: ``Guard`` inherits ``_Responses``, which reads the guard's
attributes (config, model, optimizer, scheduler, precision, checkpoints, data, history, sinks,
rollbacks, _batches, _window_alerts, _extra) and acts on them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._validate import check_positive
from .record import Action, StepMetrics
from .respond._summary import tier2_summary
from .respond.detector import Verdict
from .respond.forensics import (
    HaltReport,
    TrainingHalted,
    gather_names,
    nonfinite_params,
    trace_nonfinite,
)

__all__: list[str] = []

log = logging.getLogger("spikeguard")


def _is_storm(reason: str) -> bool:
    return reason.startswith("skips ") or reason.startswith("loss not recovered")


class _Readback:
    """One step's numbers on their way to the host (pinned copy + event on CUDA)."""

    def __init__(self, vec: torch.Tensor) -> None:
        self._event = None
        if vec.device.type == "cuda":
            self._host = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
            self._host.copy_(vec, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = vec.to("cpu")

    def values(self) -> list[float]:
        # at step t+1 the event of step t has long completed: query() avoids even a no-op wait
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        return self._host.tolist()


@dataclass
class _Pending:
    step: int
    readback: _Readback
    lr: float | None
    batches: tuple[int, int] | None
    data_state: dict[str, Any] | None
    rerun: Callable[[], Any] | None
    probes: Any
    """The step's ProbeValues (their numbers ride at the end of the read-back vector), or None."""
    stats: Any
    """The step's GradStats while its gradients are alive (read_lag 0), else None."""
    finite: tuple[Any, list[int]] | None = None
    """read_lag 1: per local gradient, whether its norm was finite (a device bool vector, read
    only on the halt path) and its parameter's index: names the culprits after the grads are gone."""
    rows: tuple[Any, ...] = ()
    """Each micro-batch's per-sequence values (LossOutput.sequences, or None)."""

    @property
    def grads_alive(self) -> bool:
        return self.stats is not None


class _Frozen:
    """A state_dict snapshot standing in for the data stream when a checkpoint is written late."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


class _Responses:
    """Tier 2 and Tier 3 actions of the Guard (see the module docstring), and its saves."""

    def _maybe_save(self, p: _Pending) -> None:
        ck = self.checkpoints
        if ck is None or not ck.should_save(p.step):
            return
        if self.sinks is not None:  # the saved record count must match what is in the files
            self.sinks.flush()
        data = self.data if p.data_state is None else _Frozen(p.data_state)
        ck.save(p.step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                scaler=self.precision if self.precision.scaler is not None else None, data=data,
                extra_state=self._extra_state(), alerts=list(self._window_alerts))
        self._window_alerts.clear()

    def _extra_state(self) -> dict[str, Any]:
        return {"guard": self, **self._extra}

    # -- the data a step consumed -------------------------------------------------------------
    def _position(self) -> int | None:
        pos = getattr(self.data, "position", None)
        return int(pos) if isinstance(pos, int) else None

    def _consume_batches(self) -> tuple[int, int] | None:
        pos = self._position()
        if pos is None or self._data_pos is None:
            self._data_pos = pos
            return None
        span = (self._data_pos, pos - 1)
        self._data_pos = pos
        self._batches.append((self.step_index, *span))
        return span

    def _data_range(self, onset: int, detection: int) -> tuple[int, int] | None:
        spans = [(lo, hi) for s, lo, hi in self._batches if onset <= s <= detection and lo <= hi]
        if not spans:
            return None
        return min(lo for lo, _ in spans), max(hi for _, hi in spans)

    def _summary(self, p: _Pending, verdict: Verdict) -> dict[str, Any]:
        onset = verdict.onset_step if verdict.onset_step is not None else p.step
        target = self._rollback_target(onset)
        summary = tier2_summary(self.history, step=p.step, reasons=verdict.reasons, onset=onset,
                                data_range=self._data_range(onset, p.step), rollback_to=target)
        summary["skips"] = self.attribution.summary(onset, p.step)  # by cause: data or transient
        return summary

    def _rollback_target(self, onset: int) -> int | None:
        """The newest healthy checkpoint that predates the update before the onset (the one
        rule, ``respond.checkpoint.rollback_target``, applied to the healthy checkpoints)."""
        if self.checkpoints is None:
            return None
        from .respond.checkpoint import rollback_target

        return rollback_target(onset, [c.step for c in self.checkpoints.list() if c.healthy])

    def _tier2(self, p: _Pending, verdict: Verdict, extras: dict[str, Any]) -> Action:
        summary = self._summary(p, verdict)
        extras["summary"] = summary
        if self.config.tier2 == "rollback":
            return self._rollback(p, verdict, extras, summary)
        if any(_is_storm(r) for r in verdict.reasons):
            # flagged steps never enter the statistics, so a level shift cannot re-baseline:
            # skipping on would skip for ever; under the alert policy the run stops here
            return self._halt(p, verdict, extras, summary=summary,
                              detail="a skip storm or an unrecovered skip under tier2='alert'")
        if self.on_alert is not None:
            self.on_alert(summary)
        else:
            log.warning("spikeguard: Tier 2 at step %d: %s (suggested rollback to step %s)",
                        p.step, "; ".join(verdict.reasons), summary["rollback_checkpoint"])
        return Action.ALERT

    def _restore_before(self, onset: int) -> Any:
        from .respond.checkpoint import CheckpointError

        target = self._rollback_target(onset)
        if target is None:
            raise CheckpointError(f"no healthy checkpoint at or before step {onset - 2} "
                                  f"(the update before the onset at {onset} may be the cause)")
        # state that lives outside the run's timeline (a fault injector: the world does not rewind)
        kept = {k: self._extra[k].state_dict() for k in self.keep_on_rollback}
        info = self.checkpoints.restore(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.precision if self.precision.scaler is not None else None,
            data=self.data, extra_state=self._extra_state(), at_or_before=target)
        for k, state in kept.items():
            self._extra[k].load_state_dict(state)
        self._pending = None
        self._micro.clear()
        return info

    def _rollback(self, p: _Pending, verdict: Verdict, extras: dict[str, Any],
                  summary: dict[str, Any]) -> Action:
        from .respond.checkpoint import CheckpointError

        if self.rollbacks >= self.config.max_rollbacks:
            return self._halt(p, verdict, extras, summary=summary,
                              detail=f"rollback budget of {self.config.max_rollbacks} exhausted")
        onset = verdict.onset_step if verdict.onset_step is not None else p.step
        skip = self._data_range(onset, p.step)
        # before the restore, which takes the attribution history back to the checkpoint
        drops = self.attribution.range_drops(onset, p.step) if hasattr(self.data, "drop") else None
        try:
            info = self._restore_before(onset)
        except CheckpointError as e:
            return self._halt(p, verdict, extras, summary=summary, detail=f"cannot roll back: {e}")
        self.rollbacks += 1
        if drops is not None:  # only the quarantined sequences of the range, not the range
            for index, rows in drops.items():
                self.data.drop(index, rows)
            skip = None
            extras["dropped_sequences"] = {str(i): r for i, r in drops.items()}
        if skip is not None and hasattr(self.data, "skip"):
            self.data.skip(*skip)
        self._data_pos = self._position()
        extras.update(rollback_to=info.step, skip_range=list(skip) if skip else None,
                      rollbacks=self.rollbacks)
        log.warning("spikeguard: Tier 2 at step %d: rolled back to step %d, skipping batches %s",
                    p.step, info.step, skip)
        return Action.ROLLBACK

    def _halt(self, p: _Pending, verdict: Verdict, extras: dict[str, Any], *,
              summary: dict[str, Any] | None = None, detail: str = "") -> Action:
        report = HaltReport(step=p.step, reasons=verdict.reasons, summary=summary, detail=detail)
        if p.grads_alive:
            report.nonfinite_params = nonfinite_params(self.named_params)
        elif p.finite is not None and p.finite[0] is not None:
            flags, owners = p.finite
            local = [self.named_params[i][0] for i, ok in zip(owners, flags.tolist()) if not ok]
            report.nonfinite_params = gather_names(local, self.named_params)
        if p.rerun is not None and verdict.tier >= 3:
            report.first_forward, report.first_backward = trace_nonfinite(self.model, p.rerun)
            report.traced = True
            if not report.nonfinite_params:  # the re-run rebuilt this step's gradients
                report.nonfinite_params = nonfinite_params(self.named_params)
            self.optimizer.zero_grad(set_to_none=True)
        changes = self._try_reconfigure(report, verdict, extras)
        if changes is not None:
            return Action.ROLLBACK
        extras["halt"] = {k: v for k, v in report.to_dict().items() if k != "summary"}
        self._log(self._last_metrics(p, verdict), verdict, Action.HALT, extras)
        if self.sinks is not None:
            self.sinks.flush()
        if self.checkpoints is not None:
            self.checkpoints.wait()
        raise TrainingHalted(report)

    def _last_metrics(self, p: _Pending, verdict: Verdict) -> StepMetrics:
        e = verdict.evidence
        return StepMetrics(step=p.step, loss=e.get("loss", float("nan")),
                           grad_norm=e.get("grad_norm", float("nan")),
                           log_z=e.get("log_z", float("nan")), nan_frac=e.get("nan_frac", 0.0),
                           lr=p.lr, grad_scale=e.get("grad_scale"))

    def _try_reconfigure(self, report: HaltReport, verdict: Verdict,
                         extras: dict[str, Any]) -> dict[str, Any] | None:
        if self.reconfigure is None or self.checkpoints is None:
            return None
        if self.rollbacks >= self.config.max_rollbacks:
            report.detail = (report.detail + "; " if report.detail else "") + \
                "no reconfigure: rollback budget exhausted"
            return None
        changes = self.reconfigure(report)
        if not changes:
            return None
        onset = verdict.onset_step if verdict.onset_step is not None else report.step
        try:
            info = self._restore_before(onset)
        except Exception as e:
            report.detail = (report.detail + "; " if report.detail else "") + \
                f"reconfigure could not resume: {e}"
            return None
        self.rollbacks += 1
        applied = self._apply_changes(dict(changes))
        self._data_pos = self._position()
        extras.update(reconfigured=applied, rollback_to=info.step, rollbacks=self.rollbacks,
                      halt=report.to_dict())
        log.warning("spikeguard: halt at step %d answered by reconfigure %s; resuming from %d",
                    report.step, applied, info.step)
        return applied

    def _apply_changes(self, changes: dict[str, Any]) -> dict[str, Any]:
        applied: dict[str, Any] = {}
        for key, value in changes.items():
            if key == "precision":
                policy = dataclasses.replace(self.precision.policy, kind=value)
                self.precision = policy.runtime(self.model)
            elif key == "lr_scale":
                check_positive(value, "reconfigure lr_scale")
                for g in self.optimizer.param_groups:
                    g["lr"] *= value
                if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
                    self.scheduler.base_lrs = [lr * value for lr in self.scheduler.base_lrs]
            elif key == "z_loss":
                cfg = getattr(self.model, "cfg", None)
                if cfg is None or not hasattr(cfg, "z_loss"):
                    raise ValueError("reconfigure z_loss needs a model with cfg.z_loss "
                                     "(the reference GPT); apply it in your own loss instead")
                self.model.cfg = dataclasses.replace(cfg, z_loss=float(value))
            else:
                raise ValueError(f"reconfigure returned {key!r}, which the guard cannot apply; "
                                 "known: precision, lr_scale, z_loss")
            applied[key] = value
        return applied
