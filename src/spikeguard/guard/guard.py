"""The Guard: measure, decide, act in one call per optimizer step, identical on every rank.

    guard = sg.Guard(model, optimizer, scheduler=scheduler, checkpoints=ckpt, data=stream,
                     sinks=[sg.JsonlSink("metrics.jsonl")])
    for x, y in stream:
        out = model.loss(model(x), y)          # a LossOutput: loss, ce, log Z
        out.loss.backward()
        for verdict in guard.step(out):        # clip, gate, step or skip, decide, log, save
            ...

The Guard owns no decision itself: it builds its parts and passes each step through them
(docs/design.md walks one step): the step part (``step.Updater``: measure, gate, clip, apply),
the judge (``judge.Judge``: the detector on the host numbers), attribution (explains a skip, may
ask for a re-run without some rows), the responder (Tier 2 and 3), the batch ledger, the
recorder, the checkpoint manager. A framework that steps the optimizer itself calls
``decide()`` instead of ``step()`` (docs/adapters.md).

Host reads: with ``read_lag=0`` (off CUDA) step t's numbers are read at t; with ``read_lag=1``
(on CUDA) at t+1, so no step waits for the device, and Tier 2/3, the record and the schedule act
one step late; a Tier 1 skip is never late. ``step`` returns the verdicts read in that call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..detect.precision import PrecisionPolicy, PrecisionRuntime
from ..detect.probes import Probes, guard_probes
from ..detector.detector import SpikeDetector, Verdict
from ..detector.gate import DeviceGate
from ..readback import Readback
from ..record import Action
from ..sinks import Sinks
from .adapter import Decision, check_data, check_decide
from .attribution import Attribution, AttributionConfig
from .checks import check_grads, check_pair, check_start_at, check_states
from .config import GuardConfig
from .forensics import HaltReport, TrainingHalted
from .judge import Judge
from .ledger import BatchLedger
from .micro import MicroBatches
from .misuse import MisuseWatch
from .recorder import Recorder
from .responder import Responder
from .state import GuardState, PartsState
from .step import Pending, ScalerState, Updater
from .summary import History
from .weights import WeightsProbe, weights_reason

__all__ = ["AttributionConfig", "Guard", "GuardConfig", "TrainingHalted"]


class Guard:
    """One call per optimizer step: measure, clip, gate, step or skip, decide, act, log, save.

    ``model`` and ``optimizer`` are the training pair (FSDP2, DDP or plain); ``scheduler`` an LR
    scheduler that the guard steps once per applied update; ``precision`` a PrecisionPolicy (or
    its runtime) whose loss scaler and autocast the guard owns; ``checkpoints`` a
    CheckpointManager (the guard registers the model, optimizer, scheduler, scaler, data, its own
    state and ``extra_state`` with it; saves at its interval, rollback, resume); ``data`` the
    batch source (a TokenStream: its position is saved, and a rollback skips the poisoned range);
    ``sinks`` where each step's record goes; ``probes`` True (``config.probes``), a Probes object,
    False (none) or None (the signals only, ``config.signals``); ``on_alert(summary)`` is called
    on a Tier 2 alert; ``reconfigure(report)`` may answer a halt with changes (``{"precision":
    "bf16-mixed", "lr_scale": 0.5, "z_loss": 1e-3}``) to resume with from the last healthy
    checkpoint. ``extra_state``: more objects to checkpoint (``state_dict``/``load_state_dict``);
    those in ``keep_on_rollback`` are restored on ``resume`` only, never by a rollback (state
    outside the run's timeline, such as a fault injector). ``pp_group``/``tp_group``: grad_stats.
    """

    _step, _ran = 0, 0  # _ran: steps taken in this process (0: a restore is a resume)
    last_skipped: bool = False
    """Whether the last resolved step's update was withheld (a skip or a halt); a framework
    that steps the LR scheduler itself holds it then (integrations/)."""
    last_action: Action = Action.CONTINUE
    """What the guard did at the last resolved step."""
    _rerun_now: Callable[..., Any] | None = None
    _reference = True
    _pending: Pending | None = None

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
        self.config = cfg = config if config is not None else GuardConfig()
        check_pair(model, optimizer)
        self.keep_on_rollback = tuple(keep_on_rollback)
        check_states(cfg, checkpoints, extra_state, self.keep_on_rollback)
        check_data(data)
        self.watch = MisuseWatch(cfg, data, scheduler)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.checkpoints, self.data = checkpoints, data
        if not isinstance(precision, PrecisionRuntime):
            precision = (precision or PrecisionPolicy(kind="fp32")).runtime(model)
        self.recorder = Recorder(Sinks(sinks) if sinks is not None else None)
        self.probes: Probes | None = guard_probes(model, optimizer, cfg.probes, probes=probes,
                                                  signals=cfg.signals, pp_group=pp_group)
        self.named_params = list(model.named_parameters())
        self.params = [p for _, p in self.named_params]
        lag = cfg.read_lag
        self.read_lag = lag if lag is not None else int(precision.device.type == "cuda")
        self.detector = SpikeDetector(cfg.detector)
        self.history = History(cfg.detector.median_window)
        self.ledger = BatchLedger(data)
        self.updater = Updater(self.params, optimizer, precision,
                               DeviceGate(cfg.detector, precision.device), clip=cfg.clip,
                               respond=cfg.respond, scheduler=scheduler, pp_group=pp_group,
                               tp_group=tp_group, clipping=cfg.clipping)
        self.attribution = Attribution(cfg.attribution, measure=self.updater.measure_rerun,
                                       ledger=self.ledger, sinks=self.recorder.sinks)
        self.weights = (WeightsProbe(self.updater, self.probes, read_lag=self.read_lag,
                                     reference_age=cfg.reference_age, max_blind_skips=cfg.detector
                                     .max_consecutive_skips)
                        if cfg.weights_check and cfg.respond else None)
        self.judge = Judge(self.detector, self.history, self.weights, self.updater,
                           respond=cfg.respond)
        extra = dict(extra_state or {})
        self.responder = Responder(
            tier2=cfg.tier2, max_rollbacks=cfg.max_rollbacks, lr_scale=cfg.rollback_lr_scale,
            checkpoints=checkpoints, ledger=self.ledger, history=self.history,
            attribution=self.attribution, recorder=self.recorder, updater=self.updater,
            model=model, named_params=self.named_params, optimizer=optimizer,
            scheduler=scheduler, on_alert=on_alert, reconfigure=reconfigure,
            keep_on_rollback={k: extra[k] for k in self.keep_on_rollback})
        self.state = PartsState(self.detector, self.updater, self.history, self.ledger,
                                self.attribution, self.responder, self.recorder, self.probes)
        if checkpoints is not None:
            checkpoints.register(model=model, optimizer=optimizer, scheduler=scheduler, data=data,
                                 scaler=ScalerState(self.updater) if precision.scaler else None,
                                 guard=self, **extra)
        self._window_alerts: list[str] = []
        self.micro = MicroBatches(model, precision.device)
        if self.probes is not None:
            self.probes.start_step(self._step)

    # -- the parts' numbers, by their old names ------------------------------------------------
    @property
    def precision(self) -> PrecisionRuntime:
        return self.updater.precision

    @property
    def gate(self) -> DeviceGate:
        return self.updater.gate

    @property
    def applied(self) -> int:
        """Updates applied so far. The LR schedule steps on each and on a loss-scaler overflow."""
        return self.updater.applied

    @property
    def withheld(self) -> int:
        """Updates withheld on this timeline (``spikeguard train`` makes them up with batches)."""
        return self.updater.withheld

    @property
    def rollbacks(self) -> int:
        """Rollbacks and reconfigured resumes so far."""
        return self.responder.rollbacks

    @property
    def records(self) -> int:
        """Records handed to the sinks so far (a checkpoint saves the count)."""
        return self.recorder.records

    @property
    def sinks(self) -> Sinks | None:
        return self.recorder.sinks

    @property
    def step_index(self) -> int:
        """The number of the next step: a rollback sets it back, so drive the loop by it."""
        self.watch.index_read = True  # the loop follows it (guard/misuse.py)
        return self._step

    # -- the step -----------------------------------------------------------------------------
    def autocast(self):
        """The forward pass context of the precision policy (bf16/fp16 autocast, or nothing).
        It notes the RNG state the forward starts from: a re-run of the step draws the same
        dropout masks (guard/micro.py)."""
        self.micro.forward_starts()
        return self.precision.autocast()

    def backward(self, loss: Any) -> None:
        """``loss.backward()`` through the loss scaler under fp16 (``loss`` may be a LossOutput).
        In attribution's re-run without quarantined rows it weighs this rank's loss so that the
        update is the mean over the tokens kept on every rank."""
        loss = loss.loss if hasattr(loss, "loss") and hasattr(loss, "log_z") else loss
        self.updater.backward(loss)

    def accumulate(self, out: Any, *, log_z: torch.Tensor | None = None,
                   rerun: Callable[..., Any] | None = None) -> torch.Tensor:
        """One micro-batch, after its backward: ``out`` its LossOutput or 0-d loss, the
        micro-batch's own mean, undivided (``step()`` takes the mean of the k); ``rerun()`` re-runs
        its forward and backward as the loop did, division by k included, and returns ``out``
        again (the recipe and the contract: guard/micro.py). Returns ``out.loss`` (or ``out``)."""
        return self.micro.add(out, log_z=log_z, rerun=rerun)

    def step(self, out: Any = None, *, log_z: torch.Tensor | None = None,
             rerun: Callable[[], Any] | None = None,
             reference: bool = True) -> tuple[Verdict, ...]:
        """One optimizer step, after backward (see the module docstring). Returns the verdicts
        the host read in this call, each with its ``step``: step t's with read_lag 0; step
        t-1's (none on the first call) with read_lag 1. ``rerun()`` re-runs the batch's forward
        and backward (``guard.backward``) and returns its LossOutput (Tier 3 forensics;
        attribution of a skip, where ``rerun(keep=mask)`` keeps only the rows ``mask`` marks).
        ``reference=False``: ``rerun`` re-runs whatever batch is current, not this step's (a
        framework's closure), so the weights check never takes it as a later step's reference.
        Raises TrainingHalted on a halt, after the record is written."""
        check_grads(self.params, has_loss=out is not None or bool(self.micro))
        self.watch.before_step()
        self._ran += 1
        if out is not None:
            self.accumulate(out, log_z=log_z)
        batches = self.ledger.consume(self._step)
        self._rerun_now = rerun  # read_lag 1: attribution may redo this step's grads (a drop)
        self._reference = reference
        if self.read_lag == 0:
            return (self._resolve(self._device_step(batches, rerun)),)
        verdicts: tuple[Verdict, ...] = ()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            t = self._step
            verdicts = (self._resolve(pending),)
            if self._step != t:  # rolled back or reconfigured: this step's grads are stale
                self.micro.clear()
                self.optimizer.zero_grad(set_to_none=True)
                return verdicts
        self._pending = self._device_step(batches, rerun)
        return verdicts

    def decide(self, out: Any = None, *, log_z: torch.Tensor | None = None,
               rerun: Callable[..., Any] | None = None, reference: bool = True) -> Decision:
        """``step()`` for a framework that steps the optimizer itself: measure, gate, clip, judge,
        respond, record, and return whether to apply the update (``Decision.apply``: then the
        framework calls ``optimizer.step()`` and its scheduler's ``step()``). Needs read_lag 0,
        no loss scaler and no ``scheduler`` in the guard. A halt raises TrainingHalted."""
        up = self.updater
        check_decide(self.read_lag, up.precision.scaler, up.scheduler, self.checkpoints, up.bound)
        if self.probes is not None:  # the framework steps after the read: no update readings
            self.probes.signals.steps_after_read()
        up.defer = True
        try:
            (verdict,) = self.step(out, log_z=log_z, rerun=rerun, reference=reference)
            for param, grad in zip(self.params, up.deferred_grads or ()):  # a drop's re-run
                param.grad = grad
        finally:
            up.defer, up.deferred_grads = False, None
        action = self.last_action
        apply = up.deferred and action is not Action.ROLLBACK and self._step == verdict.step + 1
        return Decision(apply=apply, step=verdict.step, action=action, verdict=verdict,
                        lr_factor=up._factor)

    def flush(self) -> tuple[Verdict, ...]:
        """Resolve a step still waiting for its host read (read_lag 1); returns its verdict."""
        if self._pending is None:
            return ()
        pending, self._pending = self._pending, None
        return (self._resolve(pending),)

    def close(self) -> tuple[Verdict, ...]:
        """Flush, close the sinks, commit a pending async checkpoint; returns what flush read."""
        try:
            return self.flush()
        finally:
            self.recorder.close()
            if self.checkpoints is not None:
                self.checkpoints.wait()

    def _device_step(self, batches: tuple[int, int] | None,
                     rerun: Callable[[], Any] | None) -> Pending:
        t = self._step
        batch = self.micro.take(rerun)
        factor = self.updater.lr_factor(t)
        lr = self.updater.current_lr()  # before the update: the rate it used
        lr = lr * factor if lr is not None else None
        stats, numbers = self.updater.device_step(batch.loss, batch.log_z, factor)
        dev = stats.norm.device
        vec = torch.stack([x.detach().to(dev, torch.float64).reshape(()) for x in numbers])
        probes = self.probes.gather() if self.probes is not None else None
        if probes is not None and probes.vector is not None:
            # the probes' readings ride in the same read-back vector (no host read of their own)
            vec = torch.cat([vec, probes.vector.detach().to(dev, torch.float64)])
            probes.vector = None
        keep_grads = self.read_lag == 0
        if not keep_grads:
            self.optimizer.zero_grad(set_to_none=True)
        data_state = self.ledger.snapshot() if self.read_lag else None
        self._step = t + 1
        if self.probes is not None:
            self.probes.start_step(self._step)
        return Pending(t, Readback([vec]), lr, batches, data_state, batch.rerun, probes,
                       stats if keep_grads else None,
                       None if keep_grads else stats.finite_pieces(), batch.rows,
                       self._reference)

    # -- the host side ------------------------------------------------------------------------
    def _resolve(self, p: Pending) -> Verdict:
        m, verdict, extras, skipped = self.judge.judge(p)
        self.watch.judged(m.grad_norm)
        self.last_skipped = skipped
        # Tier 0 at a non-finite norm is the loss scaler's own overflow skip, not the guard's
        overflow = verdict.tier == 0 and not math.isfinite(m.grad_norm)
        self.updater.commit(skipped, overflow=overflow)
        check = extras.get("weights_check")
        if check is not None:
            verdict = verdict._replace(reasons=(*verdict.reasons,
                                                 weights_reason(check, self.micro.why_not)))
        # a loss-scaler overflow (tier 0) is the scaler's own skip: nothing to attribute; a
        # step whose weights were at fault has its cause
        if (skipped and self.config.respond and 1 <= verdict.tier < 3
                and "cause" not in extras):
            nxt = self._rerun_now  # read_lag 1: the next step, re-run if a drop is applied
            redo = (lambda: self.micro.redo(nxt)) if nxt is not None else None
            verdict = self.attribution.explain(p, verdict, extras, m, self.updater,
                                               self.probes, redo)
            self.last_skipped = verdict.skip
            if extras.get("cause") == "data" and not (check and check["weights"] is False):
                # the same batch on the same weights reproduces whichever is at fault: without
                # a weights check that cleared the weights, the re-run cannot say "data"
                extras["cause"] = "unknown"
        self.updater.withheld += self.last_skipped and not overflow  # a rollback restores it
        action = verdict.action
        if not self.config.respond:
            extras["verdict"] = action.value  # what the guard would have done
            action = Action.CONTINUE
        try:
            if self.config.respond and verdict.tier >= 2:
                action = self.responder.respond(p, verdict, extras)
        finally:
            if p.grads_alive and not self.updater.defer:  # decide(): the framework's grads
                self.optimizer.zero_grad(set_to_none=True)
        if action is Action.ROLLBACK:  # restored: nothing held of the steps rolled back stays
            self._pending = None
            self.micro.clear()
        if action is Action.SKIP and extras["skipped"] is False:
            action = Action.DROP  # the batch without its quarantined rows was applied
        # a skipped update never reached the weights: only an applied anomaly taints the interval
        if (verdict.tier >= 1 and action not in (Action.SKIP, Action.DROP)) or action is Action.ALERT:
            self._window_alerts.append(f"{p.step}: {'; '.join(verdict.reasons)}")
        self.last_action = action
        if self._step <= p.step:  # rolled back or resumed reconfigured: the loop must follow
            self.watch.rolled_back(p.step, self._step)
        self.recorder.log(m, verdict, action, extras)
        if action not in (Action.ROLLBACK, Action.HALT):
            self._maybe_save(p)
        return verdict

    def _maybe_save(self, p: Pending) -> None:
        ck = self.checkpoints
        if ck is None or not ck.should_save(p.step):
            return
        self.recorder.flush()  # the saved record count must match what is in the files
        snapshot = {"data": p.data_state} if p.data_state is not None else None
        ck.save(p.step, alerts=list(self._window_alerts), snapshot=snapshot)
        self._window_alerts.clear()

    # -- resume and state ---------------------------------------------------------------------
    def resume(self) -> Any:
        """Restore the newest healthy checkpoint (model, optimizer, scheduler, scaler, data, the
        guard's own state); returns its CheckpointInfo, or None when there is none."""
        if self.checkpoints is None or not self.checkpoints.list():
            return None
        info = self.checkpoints.restore()
        self.resumed()
        return info

    def resumed(self) -> None:
        """The guard's state came back (``resume``, or a restore through ``stateful()``): the
        data is measured from where it stands; before any step in this process the metrics file
        continues after the restored records (no step written twice)."""
        self.state.continue_at(self._step, records=self.records if self._ran == 0 else None)

    def start_at(self, step: int) -> None:
        """Number the next step ``step`` (the framework resumed without the guard's state, or
        skipped steps itself); records of step ``step`` on in the metrics file are dropped (they
        run again). Before the guard's first step in this process any step; after, only ahead."""
        self._step = check_start_at(step, at=self._step, ran=self._ran)
        self.state.continue_at(step, at_step=True)

    def stateful(self) -> GuardState:
        """The guard's state as a torch.distributed.checkpoint Stateful, for a checkpointer
        other than the guard's own (``states={"spikeguard": guard.stateful()}``)."""
        return GuardState(self)

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: detector, device statistics, counters, recent batch ranges (syncs)."""
        return self.state.state_dict(self._step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = self.state.load_state_dict(state)
        self._window_alerts.clear()
