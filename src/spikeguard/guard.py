"""The Guard: measure, decide, act in one call per optimizer step, identical on every rank.

    guard = sg.Guard(model, optimizer, scheduler=scheduler, checkpoints=ckpt, data=stream,
                     sinks=[sg.JsonlSink("metrics.jsonl")])
    for x, y in stream:
        out = model.loss(model(x), y)          # a LossOutput: loss, ce, log Z
        out.loss.backward()
        guard.step(out)                        # clip, gate, step or skip, decide, log, save

One ``step`` after backward: the global grad norm with the loss and log Z averaged over data
ranks in the same all-reduce (``grad_stats``); the device gate (non-finite, or grad norm > k x
running median, or loss / EMA > skip ratio; see ``respond/_gate.py``); clipping; the optimizer
step through the precision runtime with the gate as its skip (on fused AdamW no host read at
all); then the host SpikeDetector on the step's numbers, and what its verdict asks: advance the
LR schedule only for applied updates, alert or roll back on Tier 2, halt with a report on Tier 3,
write the record to the sinks, save a checkpoint at the manager's interval. The guard zeroes the
gradients at the end of every step.

Host reads: with ``read_lag=0`` (the default off CUDA) the host reads step t's numbers at t, one
small vector. With ``read_lag=1`` (the default on CUDA) they are copied to pinned memory behind an
event and read at step t+1, so a healthy or skipped step never waits for the device; Tier 2 and
Tier 3 actions, the record and the schedule then act one step late (the schedule still advances
exactly once per applied update, before the next update). A Tier 1 skip is never late: the gate
acts at step t on the device.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ._validate import check_int, check_positive
from .detect.gradnorm import grad_stats
from .detect.precision import PrecisionPolicy, PrecisionRuntime
from .detect.probes import ProbeConfig, Probes
from .record import Action, StepMetrics, metrics_record
from .respond._detector_config import DetectorConfig
from .respond._gate import DeviceGate
from .respond._summary import History, tier2_summary
from .respond.detector import SpikeDetector, Verdict
from .respond.forensics import HaltReport, TrainingHalted, nonfinite_params, trace_nonfinite
from .sinks import Sinks

__all__ = ["Guard", "GuardConfig", "GuardedOptimizer", "TrainingHalted"]

log = logging.getLogger("spikeguard")

_STATE_VERSION = 1
_BATCH_HISTORY = 20_000
"""Steps whose consumed batch range the guard remembers (a Tier 2 onset lies within them)."""


@dataclass(kw_only=True, frozen=True)
class GuardConfig:
    """What the guard does; every threshold of its decisions lives in ``detector``."""

    detector: DetectorConfig = field(default_factory=DetectorConfig)
    """Thresholds of every tier (DetectorConfig.for_run(total_steps) sizes them for short runs)."""
    clip: float | None = 1.0
    """Clip the global gradient norm to this value; None turns clipping off (never 0 or < 0)."""
    tier2: Literal["alert", "rollback"] = "alert"
    """Tier 2: alert (report and go on; a skip storm halts) or rollback (needs checkpoints)."""
    max_rollbacks: int = 3
    """Rollbacks (and reconfigured resumes) allowed in one run; the next one halts instead."""
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    """Which probes run and how often, when the guard is built with probes=True."""
    read_lag: int | None = None
    """Steps between a step and the host reading its numbers: 0, 1, or None (1 on CUDA, else 0)."""

    def __post_init__(self) -> None:
        if self.clip is not None:
            check_positive(self.clip, "GuardConfig.clip", default=1.0,
                           hint="None turns clipping off; a negative value would ascend")
        if self.tier2 not in ("alert", "rollback"):
            raise ValueError(f"GuardConfig.tier2={self.tier2!r} must be 'alert' or 'rollback'")
        check_int(self.max_rollbacks, "GuardConfig.max_rollbacks", minimum=0, default=3)
        if self.read_lag not in (None, 0, 1):
            raise ValueError(f"GuardConfig.read_lag={self.read_lag!r} must be 0, 1 or None (auto)")


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
        if self._event is not None:
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
    probes: dict[str, Any]
    stats: Any
    """The step's GradStats while its gradients are alive (read_lag 0), else None."""

    @property
    def grads_alive(self) -> bool:
        return self.stats is not None


class _Frozen:
    """A state_dict snapshot standing in for the data stream when a checkpoint is written late."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


class Guard:
    """One call per optimizer step: measure, clip, gate, step or skip, decide, act, log, save.

    ``model`` and ``optimizer`` are the training pair (FSDP2, DDP or plain); ``scheduler`` an LR
    scheduler that the guard steps once per applied update; ``precision`` a PrecisionPolicy (or
    its runtime) whose loss scaler and autocast the guard owns; ``checkpoints`` a
    CheckpointManager (saves at its interval, rollback, resume); ``data`` the batch source (a
    TokenStream: its position is saved, and a rollback skips the poisoned range); ``sinks`` where
    each step's record goes; ``probes`` True (built from ``config.probes``) or a Probes object;
    ``on_alert(summary)`` is called on a Tier 2 alert; ``reconfigure(report)`` may answer a halt
    with changes (``{"precision": "bf16-mixed", "lr_scale": 0.5, "z_loss": 1e-3}``) to resume
    with from the last healthy checkpoint. ``pp_group``/``tp_group`` go to ``grad_stats``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 config: GuardConfig | None = None, scheduler: Any = None,
                 precision: PrecisionPolicy | PrecisionRuntime | None = None,
                 checkpoints: Any = None, data: Any = None, sinks: Iterable[Any] | None = None,
                 probes: Probes | bool | None = None,
                 on_alert: Callable[[dict[str, Any]], None] | None = None,
                 reconfigure: Callable[[HaltReport], Mapping[str, Any] | None] | None = None,
                 pp_group: Any = None, tp_group: Any = None) -> None:
        self.config = config if config is not None else GuardConfig()
        if self.config.tier2 == "rollback" and checkpoints is None:
            raise ValueError("GuardConfig(tier2='rollback') needs checkpoints=CheckpointManager(...)"
                             " to roll back to; pass one or use tier2='alert'")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.checkpoints, self.data = checkpoints, data
        self.on_alert, self.reconfigure = on_alert, reconfigure
        self.pp_group, self.tp_group = pp_group, tp_group
        if isinstance(precision, PrecisionRuntime):
            self.precision = precision
        else:
            self.precision = (precision or PrecisionPolicy(kind="fp32")).runtime(model)
        self.sinks = Sinks(sinks) if sinks is not None else None
        if probes is True:
            probes = Probes(model, self.config.probes)
        self.probes: Probes | None = probes or None
        self.named_params = list(model.named_parameters())
        self.params = [p for _, p in self.named_params]
        lag = self.config.read_lag
        self.read_lag = lag if lag is not None else int(self.precision.device.type == "cuda")
        self.detector = SpikeDetector(self.config.detector)
        self.gate = DeviceGate(self.config.detector, self.precision.device)
        self.history = History(self.config.detector.median_window)
        self.step_index = 0
        self.rollbacks = 0
        self.applied = 0
        self._batches: deque[tuple[int, int, int]] = deque(maxlen=_BATCH_HISTORY)
        self._window_alerts: list[str] = []
        self._micro: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending: _Pending | None = None
        self._data_pos = self._position()
        self._warned_disagree = False
        if self.probes is not None:
            self.probes.start_step(self.step_index)

    # -- the step -----------------------------------------------------------------------------
    def autocast(self):
        """The forward pass context of the precision policy (bf16/fp16 autocast, or nothing)."""
        return self.precision.autocast()

    def backward(self, loss: Any) -> None:
        """``loss.backward()`` through the loss scaler under fp16 (``loss`` may be a LossOutput)."""
        loss = loss.loss if hasattr(loss, "loss") and hasattr(loss, "log_z") else loss
        self.precision.scale(loss).backward()

    def accumulate(self, out: Any, *, log_z: torch.Tensor | None = None) -> None:
        """Record one micro-batch's loss and log Z (detached) after its backward; ``step()`` then
        uses their mean. ``out`` is a LossOutput (its ``ce`` and ``log_z``) or a 0-d loss."""
        if hasattr(out, "ce") and hasattr(out, "log_z"):
            loss, log_z = out.ce, out.log_z if log_z is None else log_z
        else:
            loss = out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("guard.step/accumulate needs the step's loss as a 0-d tensor or a "
                             f"LossOutput with reduction='mean'; got {type(loss).__name__}"
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        loss = loss.detach().float().reshape(())
        z = (torch.full_like(loss, float("nan")) if log_z is None
             else log_z.detach().float().reshape(()).to(loss.device))
        self._micro.append((loss, z))

    def step(self, out: Any = None, *, log_z: torch.Tensor | None = None,
             rerun: Callable[[], Any] | None = None) -> Verdict | None:
        """One optimizer step, after backward (see the module docstring). Returns the verdict the
        host read this call: step t's with read_lag 0; step t-1's with read_lag 1 (None on the
        first step). ``rerun()`` re-runs the current batch's forward and backward (for the Tier 3
        forensics). Raises TrainingHalted on a halt, after the record is written."""
        if out is not None:
            self.accumulate(out, log_z=log_z)
        if not self._micro:
            raise ValueError("guard.step() needs the step's loss: pass step(out), or call "
                             "guard.accumulate(out) after each micro-batch's backward")
        batches = self._consume_batches()
        if self.read_lag == 0:
            return self._resolve(self._device_step(batches, rerun))
        verdict = None
        if self._pending is not None:
            pending, self._pending = self._pending, None
            t = self.step_index
            verdict = self._resolve(pending)
            if self.step_index != t:  # rolled back or reconfigured: this step's grads are stale
                self._micro.clear()
                self.optimizer.zero_grad(set_to_none=True)
                return verdict
        self._pending = self._device_step(batches, rerun)
        return verdict

    def flush(self) -> Verdict | None:
        """Resolve a step still waiting for its host read (read_lag 1); returns its verdict."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        return self._resolve(pending)

    def close(self) -> None:
        """Flush, close the sinks, commit a pending async checkpoint."""
        try:
            self.flush()
        finally:
            if self.sinks is not None:
                self.sinks.close()
            if self.checkpoints is not None:
                self.checkpoints.wait()

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

    def _device_step(self, batches: tuple[int, int] | None,
                     rerun: Callable[[], Any] | None) -> _Pending:
        t = self.step_index
        losses, zs = zip(*self._micro)
        self._micro.clear()
        loss = torch.stack(losses).mean()
        log_z = torch.stack(zs).mean()
        self.precision.unscale_(self.optimizer)
        stats = grad_stats(self.params, extras=torch.stack([loss, log_z]),
                           pp_group=self.pp_group, tp_group=self.tp_group)
        loss_g, log_z_g = stats.extras[0], stats.extras[1]
        armed = self.gate.armed()
        gate = self.gate(stats.norm, loss_g)
        clip = self.config.clip
        coef = stats.clip_(clip) if clip is not None else torch.ones_like(stats.norm)
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer.param_groups else None
        lr = float(lr) if isinstance(lr, (int, float)) else None
        self.precision.step(self.optimizer, skip=gate)
        scale = self.precision.scale_tensor()
        dev = stats.norm.device
        parts = [loss_g, log_z_g, stats.norm, gate, armed, coef,
                 scale if scale is not None else torch.full((), float("nan"))]
        vec = torch.stack([p.detach().to(dev, torch.float64).reshape(()) for p in parts])
        probes = self.probes.collect() if self.probes is not None else {}
        keep_grads = self.read_lag == 0
        if not keep_grads:
            self.optimizer.zero_grad(set_to_none=True)
        data_state = (self.data.state_dict() if self.read_lag and hasattr(self.data, "state_dict")
                      else None)
        self.step_index = t + 1
        if self.probes is not None:
            self.probes.start_step(self.step_index)
        return _Pending(t, _Readback(vec), lr, batches, data_state, rerun, probes,
                        stats if keep_grads else None)

    # -- the host side ------------------------------------------------------------------------
    def _resolve(self, p: _Pending) -> Verdict:
        loss, log_z, norm, gate, armed, coef, scale = p.readback.values()
        skipped, armed = gate != 0.0, armed != 0.0
        nan_frac: float | None = 0.0
        if not (norm == norm and abs(norm) != float("inf")):
            # the non-finite path of grad_stats: a host read, and a collective that every rank
            # makes alike (the norm they branch on is bit-identical)
            nan_frac = p.stats.nan_frac if p.grads_alive else None
        m = StepMetrics(step=p.step, loss=loss, grad_norm=norm, log_z=log_z, nan_frac=nan_frac,
                        lr=p.lr, grad_scale=scale if self.precision.scaler is not None else None)
        verdict = self.detector.update(m)
        m.loss_ema_ratio = verdict.evidence.get("loss_ema_ratio")
        if verdict.tier <= 1 and verdict.skip != skipped and not self._warned_disagree:
            self._warned_disagree = True
            log.warning("spikeguard: device gate (%s) and host verdict (%s) disagree at step %d",
                        skipped, verdict.skip, p.step)
        self.history.add(p.step, loss, norm, log_z)
        if not skipped:
            self.applied += 1
            if self.scheduler is not None:
                self.scheduler.step()
        extras: dict[str, Any] = {"armed": armed, "skipped": skipped, "clip_coef": coef, **p.probes}
        action = verdict.action
        try:
            if verdict.tier >= 3:
                action = self._halt(p, verdict, extras)
            elif verdict.tier == 2:
                action = self._tier2(p, verdict, extras)
        finally:
            if p.grads_alive:
                self.optimizer.zero_grad(set_to_none=True)
        if verdict.tier >= 1 or action is Action.ALERT:
            self._window_alerts.append(f"{p.step}: {'; '.join(verdict.reasons)}")
        self._log(m, verdict, action, extras)
        if action not in (Action.ROLLBACK, Action.HALT):
            self._maybe_save(p)
        return verdict

    def _log(self, m: StepMetrics, verdict: Verdict, action: Action, extras: dict[str, Any]) -> None:
        if self.sinks is None:
            return
        rec = metrics_record(m, tier=verdict.tier, action=action, reasons=verdict.reasons)
        rec.update(extras)
        self.sinks.log(rec, m.step)

    def _maybe_save(self, p: _Pending) -> None:
        ck = self.checkpoints
        if ck is None or not ck.should_save(p.step):
            return
        data = self.data if p.data_state is None else _Frozen(p.data_state)
        ck.save(p.step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                scaler=self.precision if self.precision.scaler is not None else None, data=data,
                extra_state={"guard": self}, alerts=list(self._window_alerts))
        self._window_alerts.clear()

    def _data_range(self, onset: int, detection: int) -> tuple[int, int] | None:
        spans = [(lo, hi) for s, lo, hi in self._batches if onset <= s <= detection and lo <= hi]
        if not spans:
            return None
        return min(lo for lo, _ in spans), max(hi for _, hi in spans)

    def _summary(self, p: _Pending, verdict: Verdict) -> dict[str, Any]:
        onset = verdict.onset_step if verdict.onset_step is not None else p.step
        target = self._rollback_target(onset)
        return tier2_summary(self.history, step=p.step, reasons=verdict.reasons, onset=onset,
                             data_range=self._data_range(onset, p.step), rollback_to=target)

    def _rollback_target(self, onset: int) -> int | None:
        """The newest healthy checkpoint that predates the update before the onset: the
        checkpoint at s holds the state after update s, and update onset-1 may be the cause."""
        if self.checkpoints is None:
            return None
        ok = [c.step for c in self.checkpoints.list() if c.healthy and c.step <= onset - 2]
        return max(ok) if ok else None

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
        info = self.checkpoints.restore(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.precision if self.precision.scaler is not None else None,
            data=self.data, extra_state={"guard": self}, at_or_before=target)
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
        try:
            info = self._restore_before(onset)
        except CheckpointError as e:
            return self._halt(p, verdict, extras, summary=summary, detail=f"cannot roll back: {e}")
        self.rollbacks += 1
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
        if p.rerun is not None and verdict.tier >= 3:
            report.first_forward, report.first_backward = trace_nonfinite(self.model, p.rerun)
            report.traced = True
            if not p.grads_alive:  # read_lag 1: the re-run rebuilt this step's gradients
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

    # -- resume and state ---------------------------------------------------------------------
    def resume(self) -> Any:
        """Restore the newest healthy checkpoint (model, optimizer, scheduler, scaler, data, the
        guard's own state); returns its CheckpointInfo, or None when there is none."""
        if self.checkpoints is None or not self.checkpoints.list():
            return None
        info = self.checkpoints.restore(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.precision if self.precision.scaler is not None else None,
            data=self.data, extra_state={"guard": self})
        self._data_pos = self._position()
        if self.probes is not None:
            self.probes.start_step(self.step_index)
        return info

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: detector, device statistics, counters, recent batch ranges (syncs)."""
        return {"version": _STATE_VERSION, "step_index": self.step_index,
                "applied": self.applied, "rollbacks": self.rollbacks,
                "detector": self.detector.state_dict(), "gate": self.gate.state_dict(),
                "history": self.history.state_dict(),
                "batches": [list(b) for b in self._batches]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"guard state version {state.get('version')!r} is not "
                             f"{_STATE_VERSION}; it was saved by another spikeguard version")
        self.detector.load_state_dict(state["detector"])
        self.gate.load_state_dict(state["gate"])
        self.history.load_state_dict(state["history"])
        self.step_index = int(state["step_index"])
        self.applied = int(state["applied"])
        # a rollback restores an older state: the budget already spent stays spent
        self.rollbacks = max(self.rollbacks, int(state["rollbacks"]))
        self._batches = deque((tuple(int(x) for x in b) for b in state["batches"]),
                              maxlen=_BATCH_HISTORY)
        self._window_alerts.clear()


class GuardedOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step()`` is ``guard.step()``: for frameworks that only call
    ``optimizer.step()`` (HF Trainer, Lightning). The loss reaches the guard through
    ``guard.accumulate(out)`` in the loss function; everything else is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, guard: Guard) -> None:
        # no Optimizer.__init__: the wrapped optimizer owns param_groups and state
        self.optimizer, self.guard = optimizer, guard
        self.defaults = optimizer.defaults

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.guard.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"GuardedOptimizer({self.optimizer!r})"
