"""The Guard: measure, decide, act in one call per optimizer step, identical on every rank.

The loop it fits: README's "Use in your loop" and ``examples/train_loop.py``. The Guard owns no
decision itself: it builds its parts and passes each step's outcome (``outcome.StepOutcome``)
through the stages (docs/design.md walks one step): the step part (``step.Updater``: measure,
gate, clip, apply; the one owner of the update), the weights check (``weights.WeightsProbe``),
the detect stage (``detection.Detection``: the detector on the host reading), attribution
(explains a skip, may ask for a re-run without some rows), the responses (``responses/``: Tier 2
and 3, chosen by the policy), the recorder, the checkpoint manager. A stage that wants the
update changed returns a request; the guard hands it to the updater. A framework that steps the
optimizer itself calls ``decide()`` instead of ``step()`` (docs/adapters.md).

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

from ..detector.detector import SpikeDetector, Verdict
from ..detector.gate import DeviceGate
from ..measure.precision import PrecisionPolicy, PrecisionRuntime
from ..measure.probes import Probes, guard_probes
from ..readback import Readback
from ..record import Action
from ..sinks import Sinks
from .adapter import Decision, check_data, check_decide
from .arguments import check_grads, check_pair, check_start_at, check_states
from .attribution import Attribution, AttributionConfig, Finding
from .config import GuardConfig
from .detection import Detection
from .forensics import HaltReport, TrainingHalted
from .ledger import BatchLedger
from .lr_jump import lr_judged
from .micro import MicroBatches
from .misuse import MisuseWatch
from .outcome import StepOutcome, Update
from .reading import Pending, StepReading
from .recorder import Recorder
from .responses import Incident, Policy, Reply
from .responses.ask import answer, check_oncall
from .responses.control import RunControl
from .stateful import STATE_VERSION, GuardState, upgrade
from .step import ScalerState, Updater
from .summary import History
from .tokens import TokenCheck, tokens_judged
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
    ``oncall``: the on-call loop (``spikeguard.oncall.OnCall``) that a Tier 2 pages; under
    ``tier2="ask"`` the guard applies the answer it returns at a step boundary (``_answer``).
    """

    _step, _ran = 0, 0  # _ran: steps taken in this process (0: a restore is a resume)
    last_skipped: bool = False
    """Whether the last resolved step's update was withheld (a skip or a halt); a framework
    that steps the LR scheduler itself holds it then (integrations/)."""
    last_action: Action = Action.CONTINUE
    """What the guard did at the last resolved step."""
    last_outcome: StepOutcome | None = None
    """The last resolved step's outcome (its reading, verdict, what happened to the update)."""
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
                 pp_group: Any = None, tp_group: Any = None, oncall: Any = None) -> None:
        self.config = cfg = config if config is not None else GuardConfig()
        self.oncall = check_oncall(cfg, oncall)
        on_alert = on_alert or (oncall.page if oncall is not None else None)
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
        lag = cfg.read_lag  # decided here, once: the updater holds it
        self.detector = SpikeDetector(cfg.detector)
        self.history = History(cfg.detector.median_window, cfg.detector)
        self.ledger = BatchLedger(data)
        self.updater = Updater(self.params, optimizer, precision,
                               DeviceGate(cfg.detector, precision.device), clip=cfg.clip,
                               respond=cfg.respond, scheduler=scheduler, pp_group=pp_group,
                               tp_group=tp_group, clipping=cfg.clipping, lr_jump=cfg.lr_jump,
                               tokens=TokenCheck.of(cfg),
                               read_lag=lag if lag is not None else int(
                                   precision.device.type == "cuda"))
        self.attribution = Attribution(cfg.attribution, updater=self.updater,
                                       ledger=self.ledger, sinks=self.recorder.sinks)
        self.weights = (WeightsProbe(self.updater, self.probes, reference_age=cfg.reference_age,
                                     detector=self.detector, suspect=cfg.tier2 != "rollback")
                        if cfg.weights_check and cfg.respond else None)
        self.detection = Detection(self.detector, self.history, respond=cfg.respond)
        extra = dict(extra_state or {})
        self.control = RunControl(
            max_rollbacks=cfg.max_rollbacks, checkpoints=checkpoints, ledger=self.ledger,
            history=self.history, attribution=self.attribution, model=model, probes=self.probes,
            named_params=self.named_params, optimizer=optimizer, on_alert=on_alert,
            keep_on_rollback={k: extra[k] for k in self.keep_on_rollback},
            heal_steps=cfg.detector.tier2_ratio_steps)
        self.policy = Policy(cfg, reconfigure=reconfigure)
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
    def read_lag(self) -> int:
        """0: a step's numbers are read at that step; 1: at the next (the updater's)."""
        return self.updater.read_lag

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
        return self.control.rollbacks

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
                   rerun: Callable[..., Any] | None = None, tokens: Any = None) -> torch.Tensor:
        """One micro-batch, after its backward: ``out`` its LossOutput or 0-d loss, the
        micro-batch's own mean, undivided (``step()`` takes the mean of the k); ``rerun()`` re-runs
        its forward and backward as the loop did, division by k included, and returns ``out``
        again (the recipe and the contract: guard/micro.py); ``tokens``: its input token ids
        (``step``). Returns ``out.loss`` (or ``out``)."""
        self.updater.tokens.add(tokens)
        return self.micro.add(out, log_z=log_z, rerun=rerun)

    def step(self, out: Any = None, *, log_z: torch.Tensor | None = None,
             rerun: Callable[[], Any] | None = None, reference: bool = True,
             tokens: Any = None) -> tuple[Verdict, ...]:
        """One optimizer step, after backward (see the module docstring). Returns the verdicts
        the host read in this call, each with its ``step``: step t's with read_lag 0; step
        t-1's (none on the first call) with read_lag 1. ``rerun()`` re-runs the batch's forward
        and backward (``guard.backward``) and returns its LossOutput (Tier 3 forensics;
        attribution of a skip, where ``rerun(keep=mask)`` keeps only the rows ``mask`` marks).
        ``reference=False``: ``rerun`` re-runs whatever batch is current, not this step's (a
        framework's closure), so the weights check never takes it as a later step's reference.
        ``tokens``: the batch's input token ids (the tensor the model embeds; padding left out
        or marked -1): a batch whose ids are far off the run's own frequencies is skipped
        (guard/tokens.py).
        Raises TrainingHalted on a halt, after the record is written."""
        self.updater.tokens.add(tokens)
        return self._take(out, log_z, rerun, reference, framework=False)

    def decide(self, out: Any = None, *, log_z: torch.Tensor | None = None,
               rerun: Callable[..., Any] | None = None, reference: bool = True,
               tokens: Any = None) -> Decision:
        """``step()`` for a framework that steps the optimizer itself: measure, gate, clip, judge,
        respond, record, and return whether to apply the update (``Decision.apply``: then the
        framework calls ``optimizer.step()`` and its scheduler's ``step()``). Needs read_lag 0,
        no loss scaler and no ``scheduler`` in the guard. ``tokens``: the input ids, as for
        ``step``. A halt raises TrainingHalted."""
        up = self.updater
        check_decide(up.read_lag, up.precision.scaler, up.scheduler, self.checkpoints, up.bound)
        up.tokens.add(tokens)
        if self.probes is not None:  # the framework steps after the read: no update readings
            self.probes.signals.steps_after_read()
        (verdict,) = self._take(out, log_z, rerun, reference, framework=True)
        o = self.last_outcome
        drop = o.finding.drop if o.finding is not None else None
        if drop is not None and drop.grads is not None:  # the re-run without some rows
            for param, grad in zip(self.params, drop.grads):
                param.grad = grad
        apply = (o.update in (Update.APPLIED, Update.DROPPED) and o.action is not Action.ROLLBACK
                 and self._step == verdict.step + 1)
        return Decision(apply=apply, step=verdict.step, action=o.action, verdict=verdict,
                        lr_factor=o.lr_factor)

    def discard(self) -> None:
        """Forget the micro-batches handed over since the last step (a framework's dry-run
        batch that trains nothing)."""
        self._drop_batch()

    def _drop_batch(self) -> None:
        self.micro.clear()
        self.updater.tokens.clear()  # its input ids too

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

    def _take(self, out: Any, log_z: torch.Tensor | None, rerun: Callable[..., Any] | None,
              reference: bool, *, framework: bool) -> tuple[Verdict, ...]:
        check_grads(self.params, has_loss=out is not None or bool(self.micro))
        self.watch.before_step()
        self._ran += 1
        if out is not None:
            self.accumulate(out, log_z=log_z)
        batches = self.ledger.consume(self._step)
        self._rerun_now = rerun  # read_lag 1: attribution may redo this step's grads (a drop)
        self._reference = reference
        if self.updater.read_lag == 0:
            return (self._resolve(self._device_step(batches, rerun, framework)),)
        verdicts: tuple[Verdict, ...] = ()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            t = self._step
            verdicts = (self._resolve(pending),)
            if self._step != t:  # rolled back or reconfigured: this step's grads are stale
                self._drop_batch()
                self.optimizer.zero_grad(set_to_none=True)
                return verdicts
        self._pending = self._device_step(batches, rerun, framework)
        return verdicts

    # -- the device side: measure, gate, clip, apply ------------------------------------------
    def _device_step(self, batches: tuple[int, int] | None, rerun: Callable[[], Any] | None,
                     framework: bool) -> Pending:
        t, up = self._step, self.updater
        batch = self.micro.take(rerun)
        factor = up.lr.factor(t)
        lr = up.current_lr()  # before the update: the rate it used
        check = self.config.respond and up.lr_jump.margin
        jumped, why = up.lr_jump.test(lr) if check else (False, None)
        lr_onset = up.lr_jump.onset if jumped and up.lr_jump.ceiling is not None else None
        lr = lr * factor if lr is not None else None
        stats, reading = up.device_step(batch.loss, batch.log_z, factor, apply=not framework,
                                        jumped=jumped, tokens=up.tokens.gate())
        dev = stats.norm.device
        vec = torch.stack([x.detach().to(dev, torch.float64).reshape(()) for x in reading])
        probes = self.probes.gather() if self.probes is not None else None
        if probes is not None and probes.vector is not None:
            # the probes' readings ride in the same read-back vector (no host read of their own)
            vec = torch.cat([vec, probes.vector.detach().to(dev, torch.float64)])
            probes.vector = None
        keep_grads = up.read_lag == 0
        if not keep_grads:
            self.optimizer.zero_grad(set_to_none=True)
        data_state = self.ledger.snapshot() if not keep_grads else None
        self._step = t + 1
        if self.probes is not None:
            self.probes.start_step(self._step)
        return Pending(t, Readback([vec]), lr, batches, data_state, batch.rerun, probes,
                       stats if keep_grads else None,
                       None if keep_grads else stats.finite_pieces(), batch.rows,
                       self._reference, framework=framework, lr_factor=factor, lr_jump=why,
                       lr_onset=lr_onset, after_skip=up.gate.after_skip)

    # -- the host side: the stages ------------------------------------------------------------
    def _resolve(self, p: Pending) -> Verdict:
        """Step ``p``: read, weigh, detect, attribute, settle, respond, record, checkpoint."""
        reading, tail = StepReading.read(p.readback.values())
        if reading.lr_jumped and (p.lr_jump is None or torch.distributed.is_initialized()):
            # agreed across ranks (Updater.measure); the reason too: every rank's the same
            p.lr_jump = ("lr jump: the LR on some rank rose past its bar (2x the largest "
                         "step-to-step ratio of the schedule): withheld on every rank")
        p.tokens = self.updater.tokens.observe(reading.tokens_score, reading.tokens_flagged)
        out = StepOutcome(p.step, reading, Update.WITHHELD if reading.withheld else Update.APPLIED,
                          update_bound=self.updater.bound.active, lr_factor=p.lr_factor)
        if self.weights is not None and not p.held_before:  # the LR or the input is at fault
            out = self._weigh(p, out)
        out = self.detection.judge(p, out, tail)
        out = tokens_judged(lr_judged(self.updater.lr_jump, p, out, self.config.respond),
                            p.tokens)
        if self.weights is not None:  # a page or flag naming the weights: suspect them next
            self.weights.judged(p.step, out.verdict, out.cause)
        self.watch.judged(out.metrics.grad_norm)
        verdict = out.verdict
        if verdict.tier == 0 and not math.isfinite(out.metrics.grad_norm):
            out.update = Update.OVERFLOW  # the loss scaler's own skip (Tier 0), not the guard's
        if out.weights_check is not None:
            out.verdict = verdict._replace(
                reasons=(*verdict.reasons, weights_reason(out.weights_check.record(),
                                                        self.micro.why_not)))
        # an overflow is the scaler's skip, with nothing to attribute; the weights at fault are a
        # cause; Tier 3 too under drop_sequences (a non-finite value from some rows drops them)
        tier, drop = out.verdict.tier, self.attribution.config.drop_sequences
        if (out.update is Update.WITHHELD and self.config.respond and out.cause is None
                and (1 <= tier < 3 or (tier == 3 and drop))):
            out = self._attribute(p, out)
        self.updater.settle(out.update)
        self.last_skipped = out.skipped
        self.gate.resolved(out.blamed_skip)  # the next step's storm test, or not
        out.action = out.verdict.action
        if not self.config.respond:  # the verdict says what the policy would have done
            out.verdict = out.verdict._replace(action=self.policy.intended(out.verdict))
            out.would_do, out.action = out.verdict.action, Action.CONTINUE
        try:
            if self.config.respond and out.verdict.tier >= 2:
                out = self._respond(p, out)
        finally:
            if p.grads_alive and not p.framework:  # decide(): the framework's grads
                self.optimizer.zero_grad(set_to_none=True)
        return self._record(p, out)

    def _weigh(self, p: Pending, out: StepOutcome) -> StepOutcome:
        """The weights check, and its answer handed to the updater."""
        answer = self.weights.weigh(p, out.reading)
        if answer.kept:
            self.updater.healthy()
        if answer.check is None:
            return out
        withheld = out.update is Update.WITHHELD
        if self.updater.weights_at_fault(p, answer.fault, withheld=withheld):
            out.update, withheld = Update.APPLIED, False
        out.weights_check = answer.check
        if answer.check.weights or not withheld:
            out.cause = "weights" if answer.check.weights else "unknown"
        return out

    def _attribute(self, p: Pending, out: StepOutcome) -> StepOutcome:
        """Attribution of a withheld step, with the step's gradients set aside; its requests (the
        re-run without some rows, the release of an update with no evidence against its batch)
        go to the updater."""
        verdict, m, up = out.verdict, out.metrics, self.updater
        nxt = self._rerun_now  # read_lag 1: the next step, re-run if a drop is applied
        redo = (lambda: self.micro.redo(nxt)) if nxt is not None else None
        aside, applied, finding = up.set_aside(self.probes), False, Finding()
        try:
            finding = self.attribution.judge(p, verdict, m.loss, m.grad_norm)
            if finding.keep is not None:
                result = up.apply_without(p, finding.keep, finding.weight)
                self.attribution.dropped(finding, result)
                applied = result.applied
        finally:
            up.put_back(aside, p, applied=applied, redo=redo)
        released = (not applied and self.attribution.release_asked(verdict, finding)
                    and up.release(p))  # its gradients are back in place, already clipped
        if released:
            finding.cause = "unknown"
            finding.reasons.append("released: a reproduced gradient spike at an ordinary loss, "
                                   "no sequence explains it: the clipped update goes through")
        out.finding, out.cause = finding, finding.cause
        check = out.weights_check
        if out.cause == "data" and not (check is not None and check.weights is False):
            # the same batch on the same weights reproduces whichever is at fault: without a
            # weights check that cleared the weights, the re-run cannot say "data"
            out.cause = "unknown"
        reasons = (*verdict.reasons, *finding.reasons)
        if released:
            out.update = Update.APPLIED
            out.verdict = verdict._replace(reasons=reasons, skip=False, action=Action.ALERT)
        elif applied and verdict.tier == 3:  # the non-finite rows are out: no halt
            out.update = Update.DROPPED
            out.verdict = verdict._replace(
                tier=1, action=Action.SKIP, skip=False, reasons=(
                    *reasons, "non-finite only in the quarantined sequence(s): applied without "
                    "them instead of a halt"))
        elif applied:
            out.update = Update.DROPPED
            out.verdict = verdict._replace(reasons=reasons, skip=False)
        else:
            out.verdict = verdict._replace(reasons=reasons)
        return out

    def _respond(self, p: Pending, out: StepOutcome) -> StepOutcome:
        """The policy's responses to a Tier 2 or 3 verdict; their LR and precision requests go
        to the updater. A halt is recorded, then raised."""
        replies = self.policy.respond(Incident(p, out.verdict, self._step), self.control)
        reply = Reply(replies[0].action)
        for r in replies:
            reply.record.update(r.record)
            if r.lr is not None:
                self.updater.lr.add(r.lr)
            if r.precision is not None:
                self.updater.reconfigure(r.precision, self.model)
            if r.halt is not None:
                reply.halt, reply.metrics = r.halt, r.metrics
        out.reply, out.action, out.verdict = reply, reply.action, out.verdict._replace(
            action=reply.action)  # the verdict says what the policy did
        if reply.halt is not None:
            out.metrics = reply.metrics
            self.recorder.record(out)
            self.recorder.flush()
            if self.checkpoints is not None:
                self.checkpoints.wait()
            raise TrainingHalted(reply.halt)
        return out

    def _answer(self) -> None:
        """tier2="ask": at the step boundary, a person's decision (the same on every rank:
        ``OnCall.poll``), applied as a reply (``responses/ask.py``); the next record says so."""
        if self.oncall is None or self.config.tier2 != "ask" or not self.config.respond:
            return
        decision = self.oncall.poll(self._step)
        if decision is None:  # a refused answer is said in the next record too
            self.recorder.noted = self.oncall.take_note() or self.recorder.noted
            return
        sched = self.scheduler
        peak = float(sched.base_lrs[0]) if getattr(sched, "base_lrs", None) else \
            self.updater.current_lr()
        reply = answer(decision, self.control, self._step, model=self.model,
                       updater=self.updater, probes=self.probes, peak=peak)
        if reply.lr is not None:
            self.updater.lr.add(reply.lr)
        self.oncall.applied(decision, self._step, reply.record)
        self.recorder.noted = self.oncall.take_note()
        if reply.action is Action.ROLLBACK:  # restored: nothing held of the old timeline stays
            t = self._step
            self._pending = None
            self._drop_batch()
            self.optimizer.zero_grad(set_to_none=True)
            self._continue_at(self._step)
            self.watch.rolled_back(t, self._step)
        if reply.halt is not None:
            self.recorder.flush()
            if self.checkpoints is not None:
                self.checkpoints.wait()
            raise TrainingHalted(reply.halt)

    def _record(self, p: Pending, out: StepOutcome) -> Verdict:
        """The record, what the loop must follow, and the checkpoint at its interval."""
        action, verdict = out.action, out.verdict
        if action is Action.ROLLBACK:  # restored: nothing held of the steps rolled back stays
            self._pending = None
            self._drop_batch()
        if action is Action.SKIP and out.update is Update.DROPPED:
            out.action = action = Action.DROP  # the batch without its quarantined rows went in
        # only an applied anomaly taints the interval (not a skip, nor an update held for its LR)
        if p.lr_jump is None and ((verdict.tier >= 1 and action not in (Action.SKIP, Action.DROP))
                                  or action is Action.ALERT):
            self._window_alerts.append(f"{p.step}: {'; '.join(verdict.reasons)}")
        self.last_action, self.last_outcome = action, out
        if action is not Action.ROLLBACK:
            self.control.saw(p.step, verdict.tier >= 1)
        if self._step <= p.step:  # rolled back or resumed reconfigured: the loop must follow
            self.watch.rolled_back(p.step, self._step)
        self.recorder.record(out)
        if action not in (Action.ROLLBACK, Action.HALT):
            self._maybe_save(p)
        self._answer()
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
        self._continue_at(self._step, records=self.records if self._ran == 0 else None)

    def start_at(self, step: int) -> None:
        """Number the next step ``step`` (the framework resumed without the guard's state, or
        skipped steps itself); records of step ``step`` on in the metrics file are dropped (they
        run again). Before the guard's first step in this process any step; after, only ahead."""
        self._step = check_start_at(step, at=self._step, ran=self._ran)
        self._continue_at(step, at_step=True)

    def _continue_at(self, step: int, *, records: int | None = None,
                     at_step: bool = False) -> None:
        """The guard continues at ``step``: the data is measured from where it stands, the probes
        count from ``step``; the metrics file keeps its first ``records`` records, or
        (``at_step``) those before the first of step ``step`` or later; ``records=None`` without
        ``at_step`` keeps them all (a rollback: the records stay in run order)."""
        self.ledger.resync()
        if self.probes is not None:
            self.probes.start_step(step)
        sinks = self.recorder.sinks
        if sinks is not None and at_step:
            sinks.resume_at_step(step)
        elif sinks is not None and records is not None:
            sinks.resume(records)

    def stateful(self) -> GuardState:
        """The guard's state as a torch.distributed.checkpoint Stateful, for a checkpointer
        other than the guard's own (``states={"spikeguard": guard.stateful()}``)."""
        return GuardState(self)

    def _parts(self) -> dict[str, Any]:
        """The parts with state, by the name their state has in the guard's."""
        return {"detector": self.detector, "gate": self.updater.gate, "updater": self.updater,
                "history": self.history, "ledger": self.ledger, "attribution": self.attribution,
                "responses": self.control, "recorder": self.recorder}

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: every part's state by name, and the step number (syncs)."""
        return {"version": STATE_VERSION, "step_index": self._step,
                **{name: part.state_dict() for name, part in self._parts().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every part (a state of this version, or one of version 2)."""
        state = upgrade(state)
        for name, part in self._parts().items():
            part.load_state_dict(state[name])
        self._step = int(state["step_index"])
        self._window_alerts.clear()
