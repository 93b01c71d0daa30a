"""The Guard inside Lightning: a skip really skips, a halt stops the Trainer with a report.

    guard_cb = SpikeguardCallback(config=sg.GuardConfig(detector=...))

    class LitLM(L.LightningModule):
        def training_step(self, batch, batch_idx):
            out = sg.cross_entropy(self.net(batch[0]), batch[1])   # loss, ce, log Z
            guard_cb.accumulate(out, tokens=batch[0])             # tokens: the input ids
            return out.loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, ...)
            return guard_cb.configure_optimizers(self, opt, sched)

    L.Trainer(callbacks=[guard_cb], gradient_clip_val=None).fit(LitLM(), loader)

Under automatic optimization Lightning calls ``optimizer.step(closure)``: the closure runs
``training_step``, backward, the ``on_before_optimizer_step`` hooks and Lightning's own
clipping, then the optimizer's update. The optimizer is a ``GuardedOptimizer``: after the
closure its ``step()`` is ``guard.step()`` (measure, gate, clip, step or skip). Lightning's
clipping would run before the guard measures, so ``gradient_clip_val`` must stay unset and the
guard clips (``GuardConfig.clip``). The LR scheduler (``interval="step"``) is held on a step the
guard withheld. The callback logs the guard's metrics with ``pl_module.log``, sets
``trainer.should_stop`` on a halt, writes the report, and raises ``TrainingHalted`` when
training ends. Its ``state_dict`` is the guard's, so a Lightning checkpoint carries the
detector's windows.

lightning (``lightning.pytorch``) is imported on first use of ``SpikeguardCallback``.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch import nn

from ..guard import GuardConfig
from ._common import GuardParts, HeldScheduler, build_guard, logger_metrics, write_report

__all__ = ["SpikeguardCallback"]  # noqa: F822 (made on first access, by __getattr__)

log = logging.getLogger("spikeguard")


class _LightningGuardLogic:
    """The callback's behaviour; mixed with ``lightning.pytorch.Callback`` on first use."""

    def __init__(self, *, config: GuardConfig | None = None, sinks: Iterable[Any] | None = None,
                 out_dir: str | Path | None = None, **guard_kwargs: Any) -> None:
        """``config`` is the GuardConfig (``read_lag`` is 0 here; ``tier2="rollback"`` is
        refused); ``sinks`` more record sinks; the records also go to ``metrics.jsonl`` and a
        halt report to ``report.json`` and ``report.txt`` in ``out_dir`` (default: the
        trainer's ``log_dir``). ``guard_kwargs`` go to ``Guard`` (``on_alert``, ``probes``)."""
        self.config, self.sinks, self.out_dir = config, sinks, out_dir
        self.guard_kwargs = guard_kwargs
        self.parts: GuardParts | None = None
        self.report_path: Path | None = None
        """Where the halt report went (None while the run is healthy)."""
        self._logged = 0
        self._restored: dict[str, Any] | None = None
        self._rerunning = False
        self._rerun_out: tuple[Any, Any] | None = None
        self._trainer_ref: Any = None
        self._batch: tuple[Any, int] | None = None
        self._state_loaded = False

    # -- what the LightningModule calls ---------------------------------------------------------
    @property
    def guard(self) -> Any:
        """The Guard (made by ``configure_optimizers``)."""
        if self.parts is None:
            raise ValueError("the guard does not exist yet: return callback.configure_optimizers("
                             "self, optimizer, scheduler) from LightningModule.configure_optimizers")
        return self.parts.guard

    @property
    def halted(self) -> Any:
        """The TrainingHalted of a halt (None while the run is healthy)."""
        return self.parts.optimizer.halted if self.parts is not None else None

    def accumulate(self, out: Any, *, log_z: torch.Tensor | None = None,
                   tokens: torch.Tensor | None = None) -> None:
        """Record a micro-batch's loss and log Z with the guard (``guard.accumulate``): call it
        in ``training_step`` with a LossOutput, or a 0-d mean loss and ``log_z``; ``tokens``:
        its input token ids, padding marked -1 (the guard's input-token check; left out, the
        check does not run). The guard gets a closure that re-runs this micro-batch
        (``_rerun``)."""
        if self._rerunning:  # a re-run's training_step is not a new micro-batch
            self._rerun_out = (out, log_z)
            return
        rerun = None
        if self._trainer_ref is not None and self._batch is not None:
            rerun = functools.partial(self._rerun, self._trainer_ref, self._batch)
        self.guard.accumulate(out, log_z=log_z, rerun=rerun, tokens=tokens)

    def _rerun(self, trainer: Any, batch: tuple[Any, int]) -> Any:
        """Re-run one micro-batch: ``training_step`` through the strategy (its precision
        context) and a backward of its loss over ``accumulate_grad_batches``, as Lightning's
        own, without Lightning's closure, so no callback hook runs twice on a skip (the closure
        would run on_before_backward, on_after_backward and on_before_optimizer_step again).
        Returns what ``training_step`` handed to ``accumulate``."""
        self._rerunning, self._rerun_out = True, None
        try:
            out = trainer.strategy.training_step(*batch)
            loss = out["loss"] if isinstance(out, dict) else out
            if loss is not None:
                self.guard.backward(loss / trainer.accumulate_grad_batches)
        finally:
            self._rerunning = False
        if self._rerun_out is None:
            return loss
        given, log_z = self._rerun_out
        return given if log_z is None else SimpleNamespace(ce=given, log_z=log_z)

    def configure_optimizers(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                             scheduler: Any = None, *,
                             interval: Literal["step", "epoch"] = "step") -> dict[str, Any]:
        """Build the guard around ``module`` and ``optimizer``; returns what
        ``LightningModule.configure_optimizers`` returns: the GuardedOptimizer and, with a
        ``scheduler``, that scheduler held on a withheld update (``interval="step"``; an epoch
        schedule is passed through)."""
        if interval not in ("step", "epoch"):
            raise ValueError(f"interval={interval!r} must be 'step' or 'epoch'")
        trainer = getattr(module, "_trainer", None)
        out = self.out_dir if self.out_dir is not None else (
            trainer.log_dir if trainer is not None else None)
        self.out_dir = Path(out) if out is not None else None
        self.parts = build_guard(module, optimizer, self.config, sinks=self.sinks,
                                 out_dir=self.out_dir, framework="Lightning",
                                 **self.guard_kwargs)
        if self._restored is not None:
            self.parts.guard.stateful().load_state_dict(self._restored)
            self._restored = None
        self.parts.optimizer.reference = True  # each micro-batch's closure holds its batch
        conf: dict[str, Any] = {"optimizer": self.parts.optimizer}
        if scheduler is not None:
            held = HeldScheduler(scheduler, self.parts.guard, self.parts.optimizer,
                                 hold=interval == "step")
            conf["lr_scheduler"] = {"scheduler": held, "interval": interval}
        return conf

    # -- Lightning hooks ------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.gradient_clip_val:
            raise ValueError(f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips "
                             "before the guard measures the gradients, which hides a spike from "
                             "it; leave gradient_clip_val=None and clip with GuardConfig(clip=...) "
                             "(default 1.0): the guard clips after measuring")
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError(f"Trainer(precision={trainer.precision!r}): its GradScaler would "
                             "skip an overflowing step before the guard sees it; use "
                             "precision='bf16-mixed' or '32-true'")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # runs inside the closure, after backward and before Lightning's clipping (refused in
        # setup) and the guard's step
        if self.parts is None or optimizer is not self.parts.optimizer:
            raise ValueError("Lightning is stepping an optimizer that is not the guard's: return "
                             "callback.configure_optimizers(self, optimizer, scheduler) from "
                             "LightningModule.configure_optimizers")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self.halted is not None:  # min_steps or min_epochs kept the loop going
            raise self.halted
        self._trainer_ref, self._batch = trainer, (batch, batch_idx)
        if self.parts is not None:
            # training_step calls the model's submodules, never the LightningModule itself, so
            # the guard's forward pre-hook does not fire: note the RNG state the step starts
            # from here (what guard.autocast() does), so a re-run draws the same dropout masks
            self.parts.guard.autocast()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_step > 0 and not self._state_loaded and self.parts is not None:
            self.parts.guard.start_at(trainer.global_step)  # a checkpoint without our state

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.parts is None:
            return
        records = self.parts.records
        if records.last is not None and records.records > self._logged:
            self._logged = records.records
            pl_module.log_dict(logger_metrics(records.last, records.skips), on_step=True,
                               on_epoch=False)
        if self.halted is not None and self.report_path is None:
            trainer.should_stop = True
            folder = self.out_dir if self.out_dir is not None else Path(trainer.default_root_dir)
            self.report_path = write_report(self.halted, folder)
            log.error("spikeguard: %s (report: %s)", self.halted.report, self.report_path)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.halted is not None:
            raise self.halted

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.parts is not None and self.parts.guard.sinks is not None:
            self.parts.guard.sinks.flush()

    def state_dict(self) -> dict[str, Any]:
        return self.parts.guard.state_dict() if self.parts is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._state_loaded = True
        if "json" not in state_dict:  # saved as the guard's plain state_dict
            state_dict = {"json": json.dumps(state_dict)}
        if self.parts is None:  # restored before configure_optimizers built the guard
            self._restored = state_dict
        else:  # the metrics file continues after the restored records
            self.parts.guard.stateful().load_state_dict(state_dict)


@functools.cache
def _callback_class() -> type:
    from lightning.pytorch import Callback

    class SpikeguardCallback(_LightningGuardLogic, Callback):
        """The guard as a Lightning Callback: ``configure_optimizers`` builds the guard and
        wraps the optimizer, ``accumulate`` takes each micro-batch's loss and log Z; it logs
        the guard's metrics, stops the Trainer on a halt, writes the report and raises."""

    SpikeguardCallback.__module__ = __name__
    return SpikeguardCallback


def __getattr__(name: str) -> Any:
    if name == "SpikeguardCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

