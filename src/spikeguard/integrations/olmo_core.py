"""The Guard inside OLMo-core's Trainer (ai2-olmo-core 3.0.0): a skip really skips, the LR holds,
a halt stops the run with a non-zero exit and a report, and the guard's state rides in the
Trainer's checkpoints.

    trainer = TrainerConfig(save_folder=..., max_duration=Duration.steps(1000)).build(
        train_module, data_loader)        # a TransformerTrainModule built with max_grad_norm=None
    trainer.add_callback("spikeguard", SpikeguardCallback(config=sg.GuardConfig(...)))
    trainer.fit()                         # a halt raises sg.TrainingHalted out of fit()

OLMo-core callbacks cannot veto an optimizer step, so for the step itself (from
``pre_optim_step`` to ``post_train_batch``) the callback puts a ``GuardedOptimizer`` in
``train_module.optim``: its ``step()`` is ``guard.step()`` (measure, gate, clip, step or
skip). Outside the step the plain optimizer is back, so OLMo-core's checkpointing (which may call
the optimizer to initialise its state) never meets the guard. The Trainer's LR scheduler sets
each step's LR from ``global_step`` (or tokens seen); the callback wraps it so the position it
sees leaves out the steps the guard withheld (``HeldSchedule``). Each micro-batch's mean
cross-entropy reaches the guard from ``model_forward`` (OLMo-core's loss is a share, its sum
over the rank's token count: the callback turns it back into the micro-batch's mean), and log Z
from a forward hook on the output layer (one logsumexp of the logits the loss computed anyway;
none under the fused linear loss, which builds no logits). Its input ids go to the guard's
input-token check (padding marked -1 where the call carries an ``attention_mask``). The guard
numbers its steps as the Trainer does (the first batch is step 1).

A halt raises ``TrainingHalted`` from the optimizer step: the Trainer calls every callback's
``on_error`` (this one writes ``report.json`` and ``report.txt``), shuts down and re-raises, so
the process exits non-zero. A rollback is a cancel and relaunch: the guard alerts (Tier 2, its
summary names the newest healthy checkpoint), and the run is started again with
``TrainerConfig(load_path=<that checkpoint>, steps_to_skip=[StepSkipRange(onset, detection + 1)])``
(docs/adapters.md). ``tier2="rollback"`` inside the run is refused: the Trainer owns the data
and the step count.

olmo_core is imported on first use of ``SpikeguardCallback``, not with this module.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..checkpoint import retention
from ..guard import GuardConfig, GuardedOptimizer, HaltReport, TrainingHalted
from ..guard.lr_scale import Stretch
from ..prevent.losses import LossOutput
from ._common import GuardParts, build_guard, logger_metrics, write_report, write_run_config
from ._common import input_ids as input_ids_of
from ._incidents import recurring, recurring_report
from ._olmo_chain import RunLedger, next_config, relaunch_config

__all__ = ["HeldSchedule", "SpikeguardCallback", "next_config",  # noqa: F822 (__getattr__)
           "relaunch_config"]

log = logging.getLogger("spikeguard")


class _Shifted:
    """The Trainer as a schedule sees it: ``global_step`` and ``global_train_tokens_seen``
    without the steps (and their tokens) whose update the guard withheld or a relaunch left out,
    and ``max_steps`` without the steps a relaunch added to make those up."""

    def __init__(self, trainer: Any, steps: int, tokens: int, made_up: int = 0) -> None:
        self._trainer, self._steps, self._tokens = trainer, steps, tokens
        self._made_up = made_up

    @property
    def max_steps(self) -> Any:
        steps = self._trainer.max_steps
        return steps - self._made_up if steps is not None else None

    @property
    def global_step(self) -> int:
        return self._trainer.global_step - self._steps

    @property
    def global_train_tokens_seen(self) -> int:
        return self._trainer.global_train_tokens_seen - self._tokens

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


def _ramp_stretch(ramp: Any) -> Stretch | None:
    """A relaunch's ``lr_ramp`` from its record, ``[first, last, scale, settle]`` (one saved
    with three entries settles at 1), as the Stretch it is; None without one."""
    if not ramp:
        return None
    first, last, scale, *settle = ramp
    return Stretch(first=int(first), last=int(last), scale=float(scale), ramp=True,
                   settle=float(settle[0]) if settle else 1.0)


class HeldSchedule:
    """OLMo-core's LR scheduler, held on a withheld update: ``set_lr(group, trainer)`` gives the
    LR of the position counted in applied updates (and their tokens), so a skipped batch (or a
    step a relaunch leaves out) does not advance the schedule. ``held_steps`` and
    ``held_tokens`` are checkpointed with the callback. On a relaunch, ``made_up`` steps added
    to the run's length are left out of its ``max_steps``, and the replay's ``ramp`` (a
    ``guard.lr_scale.Stretch``, as the guard's own rollback uses: ``_ramp_stretch``) multiplies
    the scheduled LR."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.held_steps = 0
        self.held_tokens = 0
        self.made_up = 0
        self.ramp: Stretch | None = None

    def factor(self, step: int) -> float:
        """The multiple of the scheduled LR at the Trainer's ``step``."""
        return 1.0 if self.ramp is None else self.ramp.factor(step)

    def set_lr(self, group: dict[str, Any], trainer: Any) -> Any:
        lr = self.scheduler.set_lr(group, _Shifted(trainer, self.held_steps, self.held_tokens,
                                                   self.made_up))
        factor = self.factor(trainer.global_step)
        if factor == 1.0:
            return lr
        field = self.scheduler.lr_field
        if isinstance(group.get(field), torch.Tensor):
            group[field].mul_(factor)
        else:
            group[field] = group[field] * factor
        return lr * factor

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class _WindowAlerts:
    """A sink: the alerts since the last checkpoint, by the guard's rule for a checkpoint's
    health (an applied anomaly or a Tier 2 alert; a skipped batch never reached the weights)."""

    def __init__(self) -> None:
        self.alerts: list[str] = []

    def log(self, record: dict[str, Any], step: int) -> None:
        tier, action = int(record.get("tier") or 0), record.get("action")
        if (tier >= 1 and action not in ("skip", "drop")) or action == "alert":
            self.alerts.append(f"{record.get('step')}: {'; '.join(record.get('reasons') or ())}")


class _StepOptimizer(GuardedOptimizer):
    """``GuardedOptimizer`` whose re-run is this step's own batch (the micro-batches' closures
    the callback hands to ``guard.accumulate``), so the guard may keep it as the weights check's
    reference for a later step."""

    after: Any = None
    """Called once the guard has resolved the step (before OLMo-core's checkpointer runs)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.halted is not None:
            raise self.halted
        try:
            self.guard.step(rerun=closure)
        except TrainingHalted as halt:
            if not self.defer_halt:
                raise
            self.halted = halt
        if self.after is not None:
            self.after()
        return None


class _OlmoGuardLogic:
    """The callback's behaviour; mixed with ``olmo_core.train.callbacks.Callback`` on first use."""

    priority = -10  # after OLMo-core's own callbacks: the checkpointer has saved when it runs

    def __init__(self, *, config: GuardConfig | None = None, sinks: Iterable[Any] | None = None,
                 out_dir: str | Path | None = None, cancel_on_tier2: bool = False,
                 make_up_skips: int = 100, **guard_kwargs: Any) -> None:
        """``config`` is the GuardConfig (``read_lag`` 0; ``tier2="rollback"`` is refused);
        ``sinks`` more record sinks; the records go to ``metrics.jsonl``, the run's settings to
        ``config.json`` and a halt report to ``report.json``/``report.txt`` in ``out_dir``
        (default: the Trainer's ``save_folder``). ``cancel_on_tier2``: a Tier 2 alert cancels
        the run (every rank decides alike), keeping the summary in ``tier2_summary`` and in the
        run's record for ``relaunch_config``/``next_config``; a Tier 2 that comes back on a
        relaunch's replay halts instead. ``make_up_skips``: each update the guard withholds adds
        one step to the run, up to this many (``spikeguard train``'s rule; 0: none).
        ``guard_kwargs`` go to ``Guard`` (``on_alert``, ``probes``)."""
        self._args = dict(config=config, sinks=sinks, out_dir=out_dir,
                          cancel_on_tier2=cancel_on_tier2, make_up_skips=make_up_skips,
                          **guard_kwargs)
        self.config, self.sinks, self.out_dir = config, sinks, out_dir
        self.cancel_on_tier2 = cancel_on_tier2
        if not isinstance(make_up_skips, int) or make_up_skips < 0:
            raise ValueError(f"make_up_skips={make_up_skips!r} must be an int >= 0 (100 is "
                             "spikeguard train's default)")
        self.make_up_skips = make_up_skips
        self.tier2_summary: dict[str, Any] | None = None
        """The summary of the last Tier 2 alert (None while there was none)."""
        self._on_alert = guard_kwargs.pop("on_alert", None)
        self.guard_kwargs = guard_kwargs
        self.parts: GuardParts | None = None
        self.schedule: HeldSchedule | None = None
        self.record: RunLedger | None = None
        """This launch's record of healthy checkpoints (``spikeguard_run.json``)."""
        self.report_path: Path | None = None
        """Where the halt report went (None while the run is healthy)."""
        self._window = _WindowAlerts()
        self._plain: Any = None
        self._batch_tokens = 0
        self._restored = False
        self._logged = 0
        self._made_up = 0
        self._launch_made_up = 0
        self._duration: Any = None
        self._held: list[str] = []
        self._halt: TrainingHalted | None = None
        self._rerunning = False

    @property
    def relaunch(self) -> bool:
        """Whether this launch stopped at a Tier 2 for a relaunch (exit status 75:
        ``exits.exit_status(relaunch=callback.relaunch)``; ``next_config`` makes it)."""
        return self.record is not None and self.record.tier2 is not None and \
            self.record.relaunched_to is None

    def fresh(self) -> Any:
        """A new callback with the same settings (a relaunch builds its own: relaunch_config)."""
        return type(self)(**self._args)

    @property
    def guard(self) -> Any:
        if self.parts is None:
            raise ValueError("the guard does not exist yet: add the callback to a Trainer "
                             "(TrainerConfig(callbacks=...) or trainer.add_callback)")
        return self.parts.guard

    # -- attach: build the guard around the train module -----------------------------------------
    def post_attach(self) -> None:
        tm = self.trainer.train_module
        if not hasattr(tm, "model_forward") or not hasattr(tm, "optim"):
            raise ValueError(f"SpikeguardCallback needs a TransformerTrainModule, got "
                             f"{type(tm).__name__}")
        if getattr(tm, "max_grad_norm", None) is not None:
            raise ValueError(f"TransformerTrainModule(max_grad_norm={tm.max_grad_norm}) clips "
                             "before the guard measures the gradients, which hides a spike from "
                             "it; build it with max_grad_norm=None and clip with "
                             "GuardConfig(clip=...) (default 1.0)")
        out = self.out_dir if self.out_dir is not None else self.trainer.save_folder
        self.out_dir = Path(out)
        self.parts = build_guard(tm.model, tm.optim, self.config,
                                 sinks=[self._window, *(self.sinks or [])],
                                 out_dir=self.out_dir, framework="OLMo-core",
                                 on_alert=self._alert, **self.guard_kwargs)
        guard = self.parts.guard
        self.parts.optimizer = _StepOptimizer(tm.optim, guard)  # halts raise: the Trainer stops
        self.parts.optimizer.after = self._resolved
        save = Path(self.trainer.save_folder)
        self.record = RunLedger.read(save) or RunLedger(folder=save, root=str(save.resolve()))
        self.record.lr_scale = guard.config.rollback_lr_scale
        self.record.lr_keep = guard.config.rollback_lr_keep
        self.record.max_rollbacks = guard.config.max_rollbacks
        self.record.write()
        launch = self.record.launch or {}
        self._launch_made_up = int(launch.get("made_up", 0))
        self._duration = self.trainer.max_duration
        if tm.scheduler is not None:
            self.schedule = HeldSchedule(tm.scheduler)
            self.schedule.made_up = self._launch_made_up
            self.schedule.ramp = _ramp_stretch(launch.get("lr_ramp"))
            tm.scheduler = self.schedule
        self._hook_losses(tm)
        write_run_config(self.out_dir, guard.config, framework="OLMo-core", extra={
            "precision": str(getattr(tm, "autocast_precision", None) or "fp32"),
            "z_loss": getattr(tm, "z_loss_multiplier", None),
            "vocab_size": getattr(tm.model, "vocab_size", None),
            "ckpt_every": _save_interval(self.trainer), "steps": self.trainer.max_steps})

    def _alert(self, summary: dict[str, Any]) -> None:
        self.tier2_summary = summary
        onset = int(summary.get("onset_step") or summary["step"])
        why = self.record.stopped(onset) if self.record else None
        if why == "came back":  # raised after the step's record, from post_train_batch
            report = recurring_report(int(summary["step"]), onset,
                                      recurring(self.record.incidents, onset),
                                      summary["reasons"], summary=summary)
            self._halt = TrainingHalted(report)
            return
        if why is not None and self.cancel_on_tier2:  # a relaunch was what it would get
            self._halt = TrainingHalted(HaltReport(
                step=int(summary["step"]), reasons=tuple(summary["reasons"]), summary=summary,
                detail=f"no relaunch: {why}"))
            return
        if self._on_alert is not None:
            self._on_alert(summary)
        else:
            log.warning("spikeguard: Tier 2 at step %s: %s", summary["step"],
                        "; ".join(summary["reasons"]))
        if self.cancel_on_tier2:  # the guard's numbers are all-reduced: every rank is here
            self.record.tier2 = summary
            self.record.write()
            self.trainer.cancel_run(f"spikeguard: Tier 2 at step {summary['step']} "
                                    f"({'; '.join(summary['reasons'])}); relaunch from the "
                                    "newest healthy checkpoint (next_config)", no_sync=True)

    def _hook_losses(self, tm: Any) -> None:
        """Each micro-batch's mean cross-entropy (from model_forward) and log Z (from the
        output layer's logits) go to the guard, with a closure that re-runs its forward and
        backward (attribution, the weights check, the halt's forensics)."""
        guard = self.parts.guard
        lse: dict[str, torch.Tensor] = {}
        head = getattr(getattr(tm.model, "lm_head", None), "w_out", None)
        if head is not None:
            def keep(module: Any, args: Any, logits: torch.Tensor) -> None:
                if torch.is_grad_enabled():
                    lse["z"] = torch.logsumexp(logits.detach().float(), dim=-1)

            head.register_forward_hook(keep)
        forward = tm.model_forward

        def means(out: Any, labels: torch.Tensor, kwargs: dict[str, Any]) -> tuple[Any, Any]:
            counted = labels != kwargs.get("ignore_index", -100)
            n = counted.sum().clamp(min=1)
            mean = out.ce_loss.detach().float() * kwargs.get("loss_div_factor", 1.0) / n
            z = lse.pop("z", None)
            log_z = (z.reshape(counted.shape) * counted).sum() / n if z is not None and \
                z.numel() == counted.numel() else None
            return mean.reshape(()), log_z

        def rerun_of(input_ids: torch.Tensor, labels: torch.Tensor,
                     kwargs: dict[str, Any]) -> Any:
            def rerun() -> LossOutput:
                self._rerunning = True
                try:
                    out = forward(input_ids, labels=labels, **kwargs)
                    mean, log_z = means(out, labels, kwargs)
                    guard.backward(out.loss)
                finally:
                    self._rerunning = False
                z = log_z if log_z is not None else torch.full_like(mean, float("nan"))
                return LossOutput(mean, mean, torch.zeros_like(mean), z)
            return rerun

        def model_forward(input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                          **kwargs: Any) -> Any:
            out = forward(input_ids, labels=labels, **kwargs)
            if labels is None or getattr(out, "ce_loss", None) is None or \
                    not torch.is_grad_enabled() or self._rerunning:
                return out
            mean, log_z = means(out, labels, kwargs)
            guard.accumulate(mean, log_z=log_z, rerun=rerun_of(input_ids, labels, kwargs),
                             tokens=input_ids_of((input_ids,), kwargs))
            return out

        tm.model_forward = model_forward

    # -- the step ---------------------------------------------------------------------------------
    def pre_train(self) -> None:
        if not self._restored:  # no guard state in the checkpoint: number as the Trainer does
            self.guard.start_at(self.trainer.global_step + 1)
        self._extend()

    def pre_epoch(self) -> None:
        self.guard.discard()  # the Trainer's dry-run batch before the first epoch trains nothing

    def pre_step(self, batch: dict[str, Any]) -> None:
        tokens = self.trainer.data_loader.global_num_tokens_in_batch(batch)
        self._batch_tokens = int(tokens) if tokens is not None else 0
        step = self.trainer.global_step
        if self.schedule is not None and self._launch_made_up and any(
                r.start <= step < r.stop for r in self.trainer.steps_to_skip or ()):
            self._hold()  # a step a relaunch leaves out (and makes up): the schedule holds

    def _hold(self) -> None:
        self.schedule.held_steps += 1
        self.schedule.held_tokens += self._batch_tokens

    def _resolved(self) -> None:
        """After the guard's step, before the checkpointer may save: a withheld update holds
        the schedule and is made up (the checkpoint of this step must count it)."""
        if not self.parts.guard.last_skipped:
            return
        if self.schedule is not None:
            self._hold()
        if self._made_up < self.make_up_skips:
            self._made_up += 1
            self._extend()

    def pre_optim_step(self) -> None:
        if self.guard.step_index < self.trainer.global_step:  # after TrainerConfig.steps_to_skip
            self.guard.start_at(self.trainer.global_step)
        tm = self.trainer.train_module
        self._plain, tm.optim = tm.optim, self.parts.optimizer

    def post_train_batch(self) -> None:
        self._restore_optim()
        records = self.parts.records
        if records.last is not None and records.records > self._logged:
            self._logged = records.records
            for name, value in logger_metrics(records.last, records.skips).items():
                self.trainer.record_metric(name, value, reduce_type=None)
            _console(records.last)
        self._note_checkpoint()
        if self._halt is not None:
            raise self._halt

    def post_train(self) -> None:
        self._note_checkpoint()  # the checkpoint OLMo-core writes at the end or the cancel

    def _extend(self) -> None:
        """The run's length with the guard's made-up steps (the schedule's length stays)."""
        from olmo_core.train import Duration
        from olmo_core.train.common import DurationUnit

        d = self._duration
        if d is None or d.unit != DurationUnit.steps:
            return  # a length in tokens or epochs: no make-up (the Trainer counts those)
        self.trainer.max_duration = Duration.steps(d.value + self._made_up)
        if self.schedule is not None:
            self.schedule.made_up = self._launch_made_up + self._made_up

    def _note_checkpoint(self) -> None:
        """A checkpoint OLMo-core has just written goes into the record with its health; the
        healthy ones before an open incident are taken out of OLMo-core's removal list."""
        step = self.trainer.global_step
        path = Path(self.trainer.save_folder) / f"step{step}"
        if path.is_dir() and self.record.note(step, path, self._window.alerts):
            self._window.alerts = []
            self.record.write()
        ck = next((c for c in self.trainer.callbacks.values()
                   if type(c).__name__ == "CheckpointerCallback"), None)
        keep = getattr(ck, "max_checkpoints", None)
        if keep is None or not hasattr(ck, "_checkpoints_to_remove"):
            return
        mine = [SimpleNamespace(step=c["step"], healthy=c["healthy"], path=c["path"])
                for c in self.record.checkpoints if Path(c["path"]).parent == path.parent
                .resolve()]
        kept = {c.path for c in retention.protected(mine, keep)}
        pending = ck._checkpoints_to_remove  # OLMo-core 3.0.0: removed at the next step
        for p in list(pending):
            if str(Path(p).resolve()) in kept:
                pending.remove(p)
                self._held.append(p)
        for p in list(self._held):
            if str(Path(p).resolve()) not in kept:  # the incident closed: OLMo-core's rule again
                self._held.remove(p)
                pending.append(p)

    def _restore_optim(self) -> None:
        if self._plain is not None:
            self.trainer.train_module.optim, self._plain = self._plain, None

    def on_error(self, exc: BaseException) -> None:
        self._restore_optim()
        if isinstance(exc, TrainingHalted) and self.report_path is None:
            self.report_path = write_report(exc, self.out_dir)
            log.error("spikeguard: %s (report: %s)", exc.report, self.report_path)

    def close(self) -> None:
        if self.parts is not None:
            self.parts.guard.close()

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.parts is None:
            return {}
        held = (self.schedule.held_steps, self.schedule.held_tokens) if self.schedule else (0, 0)
        return {"guard": self.parts.guard.stateful().state_dict(), "held": list(held),
                "made_up": self._made_up}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.guard.stateful().load_state_dict(state_dict["guard"])
        if self.schedule is not None:
            self.schedule.held_steps, self.schedule.held_tokens = (int(x) for x in
                                                                   state_dict["held"])
        self._made_up = int(state_dict.get("made_up", 0))
        self._extend()
        self._restored = True


def _save_interval(trainer: Any) -> int | None:
    ck = next((c for c in trainer.callbacks.values()
               if type(c).__name__ == "CheckpointerCallback"), None)
    return getattr(ck, "save_interval", None)


def _console(record: dict[str, Any]) -> None:
    """A skip, alert or halt as a warning line in OLMo-core's console: its console logger
    prints only the metric names it is told to (``spikeguard/skipped`` is not among them), and a
    warning passes OLMo-core's rank filter on every rank's handler."""
    action = record.get("action")
    if action in (None, "continue"):
        return
    step = record.get("step")
    line = (f"spikeguard: step {step}: {action} (tier {record.get('tier')}; "
            f"{'; '.join(record.get('reasons') or ())})")
    cause = record.get("cause")
    if cause:
        line += f", cause {cause}"
    logging.getLogger("olmo_core.train.spikeguard").warning(line)


@functools.cache
def _callback_class() -> type:
    from olmo_core.train.callbacks import Callback

    class SpikeguardCallback(_OlmoGuardLogic, Callback):
        """The guard as an OLMo-core Callback: swaps in the guarded optimizer for each step,
        holds the LR schedule on a skip, logs the guard's metrics, writes the report on a halt
        (raised out of ``fit()``), and keeps the guard's state in the Trainer's checkpoints;
        ``.guard`` is the Guard."""

    SpikeguardCallback.__module__ = __name__
    return SpikeguardCallback


def __getattr__(name: str) -> Any:
    if name == "SpikeguardCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
