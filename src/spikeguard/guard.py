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

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ._guard_checks import check_grads, check_loss, check_nested, check_pair
from ._guard_respond import _Pending, _Readback, _Responses
from ._guarded_optimizer import GuardedOptimizer
from ._validate import check_int, check_positive
from .detect.gradnorm import grad_stats
from .detect.precision import PrecisionPolicy, PrecisionRuntime
from .detect.probes import ProbeConfig, Probes
from .record import Action, StepMetrics, metrics_record
from .respond._attribution import Attribution, AttributionConfig
from .respond._detector_config import DetectorConfig
from .respond._gate import DeviceGate
from .respond._summary import History
from .respond.detector import SpikeDetector, Verdict
from .respond.forensics import HaltReport, TrainingHalted
from .sinks import Sinks

__all__ = ["AttributionConfig", "Guard", "GuardConfig", "GuardedOptimizer", "TrainingHalted"]

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
    respond: bool = True
    """Act on verdicts (skip, roll back, halt); False only measures and records (a baseline)."""
    attribution: AttributionConfig = field(default_factory=AttributionConfig)
    """After a skip: re-run it (data or transient?), quarantine outlier sequences, drop them."""

    def __post_init__(self) -> None:
        if self.clip is not None:
            check_positive(self.clip, "GuardConfig.clip", default=1.0,
                           hint="None turns clipping off; a negative value would ascend")
        if self.tier2 not in ("alert", "rollback"):
            raise ValueError(f"GuardConfig.tier2={self.tier2!r} must be 'alert' or 'rollback'")
        check_int(self.max_rollbacks, "GuardConfig.max_rollbacks", minimum=0, default=3)
        check_nested(self)
        if self.read_lag not in (None, 0, 1):
            raise ValueError(f"GuardConfig.read_lag={self.read_lag!r} must be 0, 1 or None (auto)")


def _split(values: list[float], n: int) -> tuple[list[float], list[float]]:
    return values[:n], values[n:]


class Guard(_Responses):
    """One call per optimizer step: measure, clip, gate, step or skip, decide, act, log, save.

    ``model`` and ``optimizer`` are the training pair (FSDP2, DDP or plain); ``scheduler`` an LR
    scheduler that the guard steps once per applied update; ``precision`` a PrecisionPolicy (or
    its runtime) whose loss scaler and autocast the guard owns; ``checkpoints`` a
    CheckpointManager (saves at its interval, rollback, resume); ``data`` the batch source (a
    TokenStream: its position is saved, and a rollback skips the poisoned range); ``sinks`` where
    each step's record goes; ``probes`` True (built from ``config.probes``) or a Probes object;
    ``on_alert(summary)`` is called on a Tier 2 alert; ``reconfigure(report)`` may answer a halt
    with changes (``{"precision": "bf16-mixed", "lr_scale": 0.5, "z_loss": 1e-3}``) to resume
    with from the last healthy checkpoint. ``extra_state`` names more objects with
    ``state_dict``/``load_state_dict`` to checkpoint with the run; those named in
    ``keep_on_rollback`` are restored on ``resume`` only, never by a rollback (state outside the
    run's timeline, such as a fault injector). ``pp_group``/``tp_group`` go to ``grad_stats``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 config: GuardConfig | None = None, scheduler: Any = None,
                 precision: PrecisionPolicy | PrecisionRuntime | None = None,
                 checkpoints: Any = None, data: Any = None, sinks: Iterable[Any] | None = None,
                 probes: Probes | bool | None = None,
                 on_alert: Callable[[dict[str, Any]], None] | None = None,
                 reconfigure: Callable[[HaltReport], Mapping[str, Any] | None] | None = None,
                 extra_state: Mapping[str, Any] | None = None,
                 keep_on_rollback: Iterable[str] = (),
                 pp_group: Any = None, tp_group: Any = None) -> None:
        self.config = config if config is not None else GuardConfig()
        check_pair(model, optimizer)
        if self.config.tier2 == "rollback" and checkpoints is None:
            raise ValueError("GuardConfig(tier2='rollback') needs checkpoints=CheckpointManager(...)"
                             " to roll back to; pass one or use tier2='alert'")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.checkpoints, self.data = checkpoints, data
        self.on_alert, self.reconfigure = on_alert, reconfigure
        self.pp_group, self.tp_group = pp_group, tp_group
        if extra_state and "guard" in extra_state:
            raise ValueError("extra_state key 'guard' is the guard's own; rename it")
        self._extra = dict(extra_state or {})
        self.keep_on_rollback = tuple(keep_on_rollback)
        unknown = set(self.keep_on_rollback) - set(self._extra)
        if unknown:
            raise ValueError(f"keep_on_rollback names {sorted(unknown)}, which are not in "
                             f"extra_state ({sorted(self._extra)})")
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
        self.attribution = Attribution(self.config.attribution)
        self.step_index = self.rollbacks = self.applied = 0
        self.last_skipped = False
        """Whether the last resolved step's update was withheld (a skip or a halt); a framework
        that steps the LR scheduler itself holds it then (integrations/)."""
        self.records = 0
        """Records handed to the sinks so far (one per step; a checkpoint saves the count, so a
        resumed run can cut a metrics file back to the checkpoint)."""
        self._batches: deque[tuple[int, int, int]] = deque(maxlen=_BATCH_HISTORY)
        self._window_alerts: list[str] = []
        self._micro: list[tuple[torch.Tensor, torch.Tensor, Any]] = []  # loss, log Z, sequences
        self._rerun_now: Callable[..., Any] | None = None
        self._loss_weight, self._backwards = 1.0, 0  # see backward()
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
        """``loss.backward()`` through the loss scaler under fp16 (``loss`` may be a LossOutput).
        In attribution's re-run without quarantined rows it weighs this rank's loss so that the
        update is the mean over the tokens kept on every rank."""
        loss = loss.loss if hasattr(loss, "loss") and hasattr(loss, "log_z") else loss
        if self._loss_weight != 1.0:
            loss = loss * self._loss_weight
        self._backwards += 1
        self.precision.scale(loss).backward()

    def accumulate(self, out: Any, *, log_z: torch.Tensor | None = None) -> None:
        """Record one micro-batch's loss and log Z (detached) after its backward; ``step()`` then
        uses their mean. ``out`` is a LossOutput (its ``ce`` and ``log_z``) or a 0-d loss."""
        seq = getattr(out, "sequences", None)  # per-sequence values: attribution on a skip
        if hasattr(out, "ce") and hasattr(out, "log_z"):
            loss, log_z = out.ce, out.log_z if log_z is None else log_z
        else:
            loss = out
        check_loss(loss, self.params[0].device)
        loss = loss.detach().float().reshape(())
        z = (torch.full_like(loss, float("nan")) if log_z is None
             else log_z.detach().float().reshape(()).to(loss.device))
        self._micro.append((loss, z, seq))

    def step(self, out: Any = None, *, log_z: torch.Tensor | None = None,
             rerun: Callable[[], Any] | None = None) -> Verdict | None:
        """One optimizer step, after backward (see the module docstring). Returns the verdict the
        host read this call: step t's with read_lag 0; step t-1's with read_lag 1 (None on the
        first step). ``rerun()`` re-runs the batch's forward and backward (``guard.backward``)
        and returns its LossOutput (Tier 3 forensics; attribution of a skip, where
        ``rerun(keep=mask)`` keeps only the rows ``mask`` marks). Raises TrainingHalted on a
        halt, after the record is written."""
        if out is None and not self._micro:
            raise ValueError("guard.step() needs the step's loss: pass step(out), or call "
                             "guard.accumulate(out) after each micro-batch's backward")
        check_grads(self.params)
        if out is not None:
            self.accumulate(out, log_z=log_z)
        batches = self._consume_batches()
        self._rerun_now = rerun  # read_lag 1: attribution may redo this step's grads (a drop)
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

    def _device_step(self, batches: tuple[int, int] | None,
                     rerun: Callable[[], Any] | None) -> _Pending:
        t = self.step_index
        losses, zs, seqs = zip(*self._micro)
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
        self.precision.step(self.optimizer, skip=gate if self.config.respond else False)
        scale = self.precision.scale_tensor()
        dev = stats.norm.device
        applied_gate = gate if self.config.respond else torch.zeros_like(gate)
        parts = [loss_g, log_z_g, stats.norm, applied_gate, armed, coef,
                 scale if scale is not None else torch.full((), float("nan"), device=dev)]
        vec = torch.stack([p.detach().to(dev, torch.float64).reshape(()) for p in parts])
        probes = self.probes.gather() if self.probes is not None else None
        if probes is not None and probes.vector is not None:
            # the probes' readings ride in the same read-back vector (no host read of their own)
            vec = torch.cat([vec, probes.vector.detach().to(dev, torch.float64)])
            probes.vector = None
        keep_grads = self.read_lag == 0
        if not keep_grads:
            self.optimizer.zero_grad(set_to_none=True)
        data_state = (self.data.state_dict() if self.read_lag and hasattr(self.data, "state_dict")
                      else None)
        self.step_index = t + 1
        if self.probes is not None:
            self.probes.start_step(self.step_index)
        return _Pending(t, _Readback(vec), lr, batches, data_state, rerun, probes,
                        stats if keep_grads else None,
                        None if keep_grads else stats.finite_pieces(), seqs)

    # -- the host side ------------------------------------------------------------------------
    def _resolve(self, p: _Pending) -> Verdict:
        (loss, log_z, norm, gate, armed, coef, scale), rest = _split(p.readback.values(), 7)
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
        if (self.config.respond and verdict.tier <= 1 and verdict.skip != skipped
                and not self._warned_disagree):
            self._warned_disagree = True
            log.warning("spikeguard: device gate (%s) and host verdict (%s) disagree at step %d",
                        skipped, verdict.skip, p.step)
        self.history.add(p.step, loss, norm, log_z)
        self.last_skipped = skipped
        if not skipped:
            self.applied += 1
            if self.scheduler is not None:
                self.scheduler.step()
        extras: dict[str, Any] = {"armed": armed, "skipped": skipped, "clip_coef": coef}
        if p.probes is not None:
            extras.update(p.probes.decode(rest))
        # a loss-scaler overflow (tier 0) is the scaler's own skip: nothing to attribute
        if skipped and self.config.respond and 1 <= verdict.tier < 3:
            verdict = self.attribution.on_skip(self, p, verdict, extras, loss, norm)
        action = verdict.action
        if not self.config.respond:
            extras["verdict"] = action.value  # what the guard would have done
            action = Action.CONTINUE
        try:
            if not self.config.respond:
                pass
            elif verdict.tier >= 3:
                action = self._halt(p, verdict, extras)
            elif verdict.tier == 2:
                action = self._tier2(p, verdict, extras)
        finally:
            if p.grads_alive:
                self.optimizer.zero_grad(set_to_none=True)
        # a skipped update never reached the weights: only an applied anomaly taints the interval
        if (verdict.tier >= 1 and action is not Action.SKIP) or action is Action.ALERT:
            self._window_alerts.append(f"{p.step}: {'; '.join(verdict.reasons)}")
        self._log(m, verdict, action, extras)
        if action not in (Action.ROLLBACK, Action.HALT):
            self._maybe_save(p)
        return verdict

    def _log(self, m: StepMetrics, verdict: Verdict, action: Action, extras: dict[str, Any]) -> None:
        self.records += 1
        if self.sinks is None:
            return
        rec = metrics_record(m, tier=verdict.tier, action=action, reasons=verdict.reasons)
        rec.update(extras)
        self.sinks.log(rec, m.step)

    # -- resume and state ---------------------------------------------------------------------
    def resume(self) -> Any:
        """Restore the newest healthy checkpoint (model, optimizer, scheduler, scaler, data, the
        guard's own state); returns its CheckpointInfo, or None when there is none."""
        if self.checkpoints is None or not self.checkpoints.list():
            return None
        info = self.checkpoints.restore(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.precision if self.precision.scaler is not None else None,
            data=self.data, extra_state=self._extra_state())
        self._data_pos = self._position()
        if self.probes is not None:
            self.probes.start_step(self.step_index)
        if self.sinks is not None:  # the metrics file continues after the restored step
            self.sinks.resume(self.records)
        return info

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: detector, device statistics, counters, recent batch ranges (syncs)."""
        return {"version": _STATE_VERSION, "step_index": self.step_index,
                "applied": self.applied, "rollbacks": self.rollbacks, "records": self.records,
                "detector": self.detector.state_dict(), "gate": self.gate.state_dict(),
                "history": self.history.state_dict(),
                "batches": [list(b) for b in self._batches],
                "attribution": self.attribution.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"guard state version {state.get('version')!r} is not "
                             f"{_STATE_VERSION}; it was saved by another spikeguard version")
        self.detector.load_state_dict(state["detector"])
        self.gate.load_state_dict(state["gate"])
        self.history.load_state_dict(state["history"])
        self.attribution.load_state_dict(state.get("attribution"))
        self.step_index = int(state["step_index"])
        self.applied = int(state["applied"])
        self.records = int(state["records"])
        # a rollback restores an older state: the budget already spent stays spent
        self.rollbacks = max(self.rollbacks, int(state["rollbacks"]))
        self._batches = deque((tuple(int(x) for x in b) for b in state["batches"]),
                              maxlen=_BATCH_HISTORY)
        self._window_alerts.clear()
