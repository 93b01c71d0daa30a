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
none under the fused linear loss, which builds no logits). The guard numbers its steps as the
Trainer does (the first batch is step 1).

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
from typing import Any

import torch

from ..guard import GuardConfig, TrainingHalted
from ._common import GuardParts, build_guard, logger_metrics, write_report

__all__ = ["HeldSchedule", "SpikeguardCallback", "relaunch_config"]  # noqa: F822 (__getattr__)

log = logging.getLogger("spikeguard")


class _Shifted:
    """The Trainer as a schedule sees it: ``global_step`` and ``global_train_tokens_seen``
    without the steps (and their tokens) whose update the guard withheld."""

    def __init__(self, trainer: Any, steps: int, tokens: int) -> None:
        self._trainer, self._steps, self._tokens = trainer, steps, tokens

    @property
    def global_step(self) -> int:
        return self._trainer.global_step - self._steps

    @property
    def global_train_tokens_seen(self) -> int:
        return self._trainer.global_train_tokens_seen - self._tokens

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


class HeldSchedule:
    """OLMo-core's LR scheduler, held on a withheld update: ``set_lr(group, trainer)`` gives the
    LR of the position counted in applied updates (and their tokens), so a skipped batch does not
    advance the schedule. ``held_steps`` and ``held_tokens`` are checkpointed with the callback."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.held_steps = 0
        self.held_tokens = 0

    def set_lr(self, group: dict[str, Any], trainer: Any) -> Any:
        return self.scheduler.set_lr(group, _Shifted(trainer, self.held_steps, self.held_tokens))

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class _OlmoGuardLogic:
    """The callback's behaviour; mixed with ``olmo_core.train.callbacks.Callback`` on first use."""

    priority = -10  # after OLMo-core's own callbacks: the checkpointer has saved when it runs

    def __init__(self, *, config: GuardConfig | None = None, sinks: Iterable[Any] | None = None,
                 out_dir: str | Path | None = None, cancel_on_tier2: bool = False,
                 **guard_kwargs: Any) -> None:
        """``config`` is the GuardConfig (``read_lag`` 0; ``tier2="rollback"`` is refused);
        ``sinks`` more record sinks; the records go to ``metrics.jsonl`` and a halt report to
        ``report.json``/``report.txt`` in ``out_dir`` (default: the Trainer's ``save_folder``).
        ``cancel_on_tier2``: a Tier 2 alert cancels the run (every rank decides alike), keeping
        the summary in ``tier2_summary`` for ``relaunch_config``. ``guard_kwargs`` go to
        ``Guard`` (``on_alert``, ``probes``)."""
        self.config, self.sinks, self.out_dir = config, sinks, out_dir
        self.cancel_on_tier2 = cancel_on_tier2
        self.tier2_summary: dict[str, Any] | None = None
        """The summary of the last Tier 2 alert (None while there was none)."""
        self._on_alert = guard_kwargs.pop("on_alert", None)
        self.guard_kwargs = guard_kwargs
        self.parts: GuardParts | None = None
        self.schedule: HeldSchedule | None = None
        self.report_path: Path | None = None
        """Where the halt report went (None while the run is healthy)."""
        self._plain: Any = None
        self._batch_tokens = 0
        self._restored = False
        self._logged = 0

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
        self.parts = build_guard(tm.model, tm.optim, self.config, sinks=self.sinks,
                                 out_dir=self.out_dir, framework="OLMo-core",
                                 on_alert=self._alert, **self.guard_kwargs)
        self.parts.optimizer.defer_halt = False  # the Trainer's own error path stops the run
        if tm.scheduler is not None:
            self.schedule = HeldSchedule(tm.scheduler)
            tm.scheduler = self.schedule
        self._hook_losses(tm)

    def _alert(self, summary: dict[str, Any]) -> None:
        self.tier2_summary = summary
        if self._on_alert is not None:
            self._on_alert(summary)
        if self.cancel_on_tier2:  # the guard's numbers are all-reduced: every rank is here
            self.trainer.cancel_run(f"spikeguard: Tier 2 at step {summary['step']} "
                                    f"({'; '.join(summary['reasons'])})", no_sync=True)

    def _hook_losses(self, tm: Any) -> None:
        """Each micro-batch's mean cross-entropy (from model_forward) and log Z (from the
        output layer's logits) go to the guard."""
        guard = self.parts.guard
        lse: dict[str, torch.Tensor] = {}
        head = getattr(getattr(tm.model, "lm_head", None), "w_out", None)
        if head is not None:
            def keep(module: Any, args: Any, logits: torch.Tensor) -> None:
                if torch.is_grad_enabled():
                    lse["z"] = torch.logsumexp(logits.detach().float(), dim=-1)

            head.register_forward_hook(keep)
        forward = tm.model_forward

        def model_forward(input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                          **kwargs: Any) -> Any:
            out = forward(input_ids, labels=labels, **kwargs)
            ce = getattr(out, "ce_loss", None)
            if labels is None or ce is None or not torch.is_grad_enabled():
                return out
            counted = labels != kwargs.get("ignore_index", -100)
            n = counted.sum().clamp(min=1)
            mean = ce.detach().float() * kwargs.get("loss_div_factor", 1.0) / n
            z = lse.pop("z", None)
            log_z = (z.reshape(counted.shape) * counted).sum() / n if z is not None and \
                z.numel() == counted.numel() else None
            guard.accumulate(mean.reshape(()), log_z=log_z)
            return out

        tm.model_forward = model_forward

    # -- the step ---------------------------------------------------------------------------------
    def pre_train(self) -> None:
        if not self._restored:  # no guard state in the checkpoint: number as the Trainer does
            self.guard.start_at(self.trainer.global_step + 1)

    def pre_epoch(self) -> None:
        self.guard.discard()  # the Trainer's dry-run batch before the first epoch trains nothing

    def pre_step(self, batch: dict[str, Any]) -> None:
        tokens = self.trainer.data_loader.global_num_tokens_in_batch(batch)
        self._batch_tokens = int(tokens) if tokens is not None else 0

    def pre_optim_step(self) -> None:
        if self.guard.step_index < self.trainer.global_step:  # after TrainerConfig.steps_to_skip
            self.guard.start_at(self.trainer.global_step)
        tm = self.trainer.train_module
        self._plain, tm.optim = tm.optim, self.parts.optimizer

    def post_train_batch(self) -> None:
        self._restore_optim()
        guard, records = self.parts.guard, self.parts.records
        if guard.last_skipped and self.schedule is not None:
            self.schedule.held_steps += 1
            self.schedule.held_tokens += self._batch_tokens
        if records.last is not None and records.records > self._logged:
            self._logged = records.records
            for name, value in logger_metrics(records.last, records.skips).items():
                self.trainer.record_metric(name, value, reduce_type=None)

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
        return {"guard": self.parts.guard.stateful().state_dict(), "held": list(held)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.guard.stateful().load_state_dict(state_dict["guard"])
        if self.schedule is not None:
            self.schedule.held_steps, self.schedule.held_tokens = (int(x) for x in
                                                                   state_dict["held"])
        self._restored = True


def relaunch_config(config: Any, summary: dict[str, Any], *, save_folder: str | Path) -> Any:
    """The rollback as a relaunch: ``config`` (the run's TrainerConfig) starting from the newest
    checkpoint in its save folder at or before ``onset - 2`` (the guard's rollback rule), with the
    steps ``onset..detection`` of the Tier 2 ``summary`` skipped (``steps_to_skip``), saving to a
    new ``save_folder`` (the old one's newest checkpoint would win over ``load_path``)."""
    from olmo_core.train import StepSkipRange

    from ..checkpoint.info import rollback_target

    old = Path(config.save_folder)
    steps = [int(d.name[4:]) for d in old.glob("step*") if d.name[4:].isdigit() and d.is_dir()]
    onset, detected = int(summary["onset_step"]), int(summary["step"])
    target = rollback_target(onset, steps)
    if target is None:
        raise ValueError(f"no checkpoint in {old} at or before step {onset - 2} (the anomaly "
                         f"began at {onset}; found {sorted(steps)}): nothing to roll back to")
    skips = [*(config.steps_to_skip or []), StepSkipRange(start=onset, stop=detected + 1)]
    return config.replace(save_folder=str(save_folder), load_path=str(old / f"step{target}"),
                          steps_to_skip=skips)


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
