"""The responder: Tier 2 (alert, or roll back within a budget) and Tier 3 (halt with forensics,
or resume reconfigured). The policy for what a Tier 2 or Tier 3 verdict does lives here.

Built with what it acts on: the checkpoints, the batch ledger (what a rollback skips or drops),
the step history (the Tier 2 summary), attribution (the skips by cause), the recorder (a halt
writes its record before it raises), the step part (a reconfigured precision replaces its
runtime) and the training objects. ``respond`` returns the action taken; after ROLLBACK the
states were restored and the caller drops whatever it held of the steps rolled back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from .._validate import check_positive
from ..detector.detector import Verdict
from ..record import Action, StepMetrics
from .forensics import HaltReport, TrainingHalted, gather_names, nonfinite_params, trace_nonfinite
from .step import Pending
from .summary import tier2_summary

__all__ = ["Responder"]

log = logging.getLogger("spikeguard")


class Responder:
    """Tier 2 and Tier 3 actions (module docstring). ``rollbacks`` counts rollbacks and
    reconfigured resumes against ``max_rollbacks``."""

    def __init__(self, *, tier2: str, max_rollbacks: int, lr_scale: float, checkpoints: Any,
                 ledger: Any,
                 history: Any, attribution: Any, recorder: Any, updater: Any, model: Any,
                 named_params: list, optimizer: Any, scheduler: Any = None,
                 on_alert: Callable[[dict[str, Any]], None] | None = None,
                 reconfigure: Callable[[HaltReport], Mapping[str, Any] | None] | None = None,
                 keep_on_rollback: Mapping[str, Any] | None = None) -> None:
        self.tier2, self.max_rollbacks, self.lr_scale = tier2, max_rollbacks, lr_scale
        self.checkpoints, self.ledger, self.history = checkpoints, ledger, history
        self.attribution, self.recorder, self.updater = attribution, recorder, updater
        self.model, self.named_params = model, named_params
        self.optimizer, self.scheduler = optimizer, scheduler
        self.on_alert, self.reconfigure = on_alert, reconfigure
        self.keep_on_rollback = dict(keep_on_rollback or {})
        self.rollbacks = 0
        self.replay: tuple[int, int, float] | None = None
        """(restored step, detection step, LR scale) of the last rollback."""

    def respond(self, p: Any, verdict: Verdict, extras: dict[str, Any]) -> Action:
        """The action for a verdict of tier 2 or 3 (raises TrainingHalted on a halt)."""
        if verdict.tier >= 3:
            return self._halt(p, verdict, extras)
        if verdict.tier == 2:
            return self._tier2(p, verdict, extras)
        return verdict.action

    def _summary(self, p: Pending, verdict: Verdict) -> dict[str, Any]:
        onset = verdict.onset_step if verdict.onset_step is not None else p.step
        target = self._rollback_target(onset)
        summary = tier2_summary(self.history, step=p.step, reasons=verdict.reasons, onset=onset,
                                data_range=self.ledger.data_range(onset, p.step), rollback_to=target)
        summary["skips"] = self.attribution.summary(onset, p.step)  # by cause: data or transient
        return summary

    def _rollback_target(self, onset: int) -> int | None:
        """The newest healthy checkpoint that predates the update before the onset (the one
        rule, ``checkpoint.manager.rollback_target``, applied to the healthy checkpoints)."""
        if self.checkpoints is None:
            return None
        from ..checkpoint.info import rollback_target

        return rollback_target(onset, [c.step for c in self.checkpoints.list() if c.healthy])

    def _tier2(self, p: Pending, verdict: Verdict, extras: dict[str, Any]) -> Action:
        summary = self._summary(p, verdict)
        extras["summary"] = summary
        if self.tier2 == "rollback":
            return self._rollback(p, verdict, extras, summary)
        return self._alert(p, verdict, summary)

    def _alert(self, p: Pending, verdict: Verdict, summary: dict[str, Any]) -> Action:
        """Page (``on_alert(summary)``, else a log line) and go on: training continues."""
        if self.on_alert is not None:
            self.on_alert(summary)
        else:
            log.warning("spikeguard: Tier 2 at step %d: %s (suggested rollback to step %s)",
                        p.step, "; ".join(verdict.reasons), summary["rollback_checkpoint"])
        return Action.ALERT

    def _restore_before(self, onset: int) -> Any:
        from ..checkpoint.info import CheckpointError

        target = self._rollback_target(onset)
        if target is None:
            raise CheckpointError(f"no healthy checkpoint at or before step {onset - 2} "
                                  f"(the update before the onset at {onset} may be the cause)")
        # state that lives outside the run's timeline (a fault injector: the world does not rewind)
        kept = {k: obj.state_dict() for k, obj in self.keep_on_rollback.items()}
        info = self.checkpoints.restore(at_or_before=target)
        for k, state in kept.items():
            self.keep_on_rollback[k].load_state_dict(state)
        return info

    def _rollback(self, p: Pending, verdict: Verdict, extras: dict[str, Any],
                  summary: dict[str, Any]) -> Action:
        from ..checkpoint.info import CheckpointError

        if self.rollbacks >= self.max_rollbacks:
            return self._halt(p, verdict, extras, summary=summary,
                              detail=f"rollback budget of {self.max_rollbacks} exhausted")
        onset = verdict.onset_step if verdict.onset_step is not None else p.step
        skip = self.ledger.data_range(onset, p.step)
        # before the restore, which takes the attribution history back to the checkpoint
        drops = self.attribution.range_drops(onset, p.step) if self.ledger.can_drop else None
        try:
            info = self._restore_before(onset)
        except CheckpointError as e:
            # nothing healthy to go back to: say so and carry on (a halt would lose the run)
            extras["rollback_failed"] = str(e)
            log.warning("spikeguard: Tier 2 at step %d: cannot roll back (%s); alerting and "
                        "going on", p.step, e)
            return self._alert(p, verdict, summary)
        self.rollbacks += 1
        self.ledger.reapply()  # earlier rollbacks' ranges and drops hold across this restore
        if drops is not None:  # only the quarantined sequences of the range, not the range
            self.ledger.drop(drops)
            skip = None
            extras["dropped_sequences"] = {str(i): r for i, r in drops.items()}
        if skip is not None and self.ledger.can_skip:
            self.ledger.skip(*skip)
        self.ledger.resync()
        scale = self._replay_scale(info.step, p.step)
        self.updater.lr_ramp = (info.step + 1, p.step, scale)
        extras.update(rollback_to=info.step, skip_range=list(skip) if skip else None,
                      rollbacks=self.rollbacks, replay_lr_scale=scale)
        log.warning("spikeguard: Tier 2 at step %d: rolled back to step %d, skipping batches %s",
                    p.step, info.step, skip)
        return Action.ROLLBACK

    def _replay_scale(self, restored: int, detection: int) -> float:
        """The LR scale of this replay: ``lr_scale``, times the last one when this rollback
        lands in the stretch the last one replayed (the same trouble came back: go lower)."""
        last, scale = self.replay, self.lr_scale
        if last is not None and restored <= last[1]:
            scale *= last[2]
        self.replay = (restored, detection, scale)
        return scale

    def _halt(self, p: Pending, verdict: Verdict, extras: dict[str, Any], *,
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
        self.recorder.log(self._last_metrics(p, verdict), verdict, Action.HALT, extras)
        self.recorder.flush()
        if self.checkpoints is not None:
            self.checkpoints.wait()
        raise TrainingHalted(report)

    def _last_metrics(self, p: Pending, verdict: Verdict) -> StepMetrics:
        e = verdict.evidence
        return StepMetrics(step=p.step, loss=e.get("loss", float("nan")),
                           grad_norm=e.get("grad_norm", float("nan")),
                           log_z=e.get("log_z", float("nan")), nan_frac=e.get("nan_frac", 0.0),
                           lr=p.lr, grad_scale=e.get("grad_scale"))

    def _try_reconfigure(self, report: HaltReport, verdict: Verdict,
                         extras: dict[str, Any]) -> dict[str, Any] | None:
        if self.reconfigure is None or self.checkpoints is None:
            return None
        if self.rollbacks >= self.max_rollbacks:
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
        self.ledger.resync()
        extras.update(reconfigured=applied, rollback_to=info.step, rollbacks=self.rollbacks,
                      halt=report.to_dict())
        log.warning("spikeguard: halt at step %d answered by reconfigure %s; resuming from %d",
                    report.step, applied, info.step)
        return applied

    def _apply_changes(self, changes: dict[str, Any]) -> dict[str, Any]:
        applied: dict[str, Any] = {}
        for key, value in changes.items():
            if key == "precision":
                policy = dataclasses.replace(self.updater.precision.policy, kind=value)
                self.updater.precision = policy.runtime(self.model)
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
