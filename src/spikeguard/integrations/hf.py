"""The Guard inside HF Trainer: a skip really skips, a halt stops the Trainer with a report.

    trainer = Trainer(model=model, args=TrainingArguments(..., max_grad_norm=0),
                      train_dataset=ds, optimizers=(optimizer, scheduler),
                      compute_loss_func=SpikeguardLoss(z_loss=1e-4))
    callback = guard_trainer(trainer, config=sg.GuardConfig(detector=...))
    trainer.train()            # raises TrainingHalted after the Trainer stopped, on a halt

The Trainer calls ``optimizer.step()`` (through accelerate's AcceleratedOptimizer, which only
forwards it), so the optimizer becomes a ``GuardedOptimizer`` whose ``step()`` is
``guard.step()``: measure, gate, clip, step or skip. The Trainer would clip before any callback
sees the gradients, so ``max_grad_norm`` must be 0 and the guard clips (``GuardConfig.clip``).
The Trainer steps the LR scheduler after every optimizer step unless accelerate reports a
GradScaler overflow; the scheduler is wrapped so that a step the guard withheld holds it too.
The loss and log Z reach the guard from the loss function: ``SpikeguardLoss`` (cross-entropy +
z-loss on shifted labels, with log Z from the same pass), or your own ``compute_loss_func``
that calls ``callback.guard.accumulate(mean_loss, log_z=...)`` once per micro-batch.

transformers is imported on first use, not with this module.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch

from .. import _dist
from ..guard import GuardConfig, GuardedOptimizer
from ..prevent.losses import cross_entropy
from ._common import GuardParts, HeldScheduler, build_guard, input_ids, logger_metrics, write_report

__all__ = ["SpikeguardLoss", "guard_trainer"]

log = logging.getLogger("spikeguard")

GUARD_STATE = "spikeguard_guard.json"
"""The guard's state in each of the Trainer's checkpoint folders (``checkpoint-<step>``)."""


class SpikeguardLoss:
    """``Trainer(compute_loss_func=SpikeguardLoss())``: cross-entropy + z-loss (PaLM's 1e-4)
    of a causal LM's logits against its labels, shifted by one (``shift_labels=False`` for
    labels already aligned with the logits), and ``ignore_index`` tokens left out.

    Returns the sum over counted tokens divided by ``num_items_in_batch`` (the Trainer's count
    over every micro-batch of the step), so gradient accumulation gives the step's true mean.
    While gradients are on (training, not evaluation) it hands the guard that ``guard_trainer``
    connects the micro-batch's mean cross-entropy and mean log Z, and a closure that re-runs
    the micro-batch (the model's inputs, kept by a forward pre-hook, and its labels): the
    weights check, the attribution of a skip and the halt report's module need it. The kept
    ``input_ids`` (padding marked by ``attention_mask``) go to the guard's input-token check.
    """

    def __init__(self, *, z_loss: float = 1e-4, shift_labels: bool = True,
                 ignore_index: int = -100, softcap: float | None = None) -> None:
        self.z_loss, self.shift_labels = z_loss, shift_labels
        self.ignore_index, self.softcap = ignore_index, softcap
        self.guard: Any = None
        self.model: torch.nn.Module | None = None
        """The model whose training forwards ``watch`` keeps the inputs of (for re-runs)."""
        self._call: tuple[Any, Any] | None = None
        self.recording = True

    def watch(self, model: torch.nn.Module) -> None:
        """Keep the inputs of ``model``'s training forwards (a forward pre-hook), so that each
        micro-batch's closure can re-run it."""
        self.model = model

        def keep(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if module.training and torch.is_grad_enabled() and self.recording:
                self._call = (args, kwargs)

        model.register_forward_pre_hook(keep, with_kwargs=True)

    def _loss(self, outputs: Any, labels: torch.Tensor,
              num_items_in_batch: torch.Tensor | int | None) -> tuple[torch.Tensor, Any]:
        """(the loss to backpropagate, a record with the micro-batch's mean ``ce`` and ``log_z``)."""
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        if self.shift_labels:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        out = cross_entropy(logits, labels.to(logits.device), z_loss=self.z_loss,
                            ignore_index=self.ignore_index, softcap=self.softcap,
                            reduction="sum", per_sequence=True)
        counted = (labels != self.ignore_index).sum().clamp(min=1).to(out.loss.device)
        if num_items_in_batch is None:
            denom: torch.Tensor | int = counted
        elif isinstance(num_items_in_batch, torch.Tensor):
            denom = num_items_in_batch.to(out.loss.device).clamp(min=1)
        else:
            denom = max(int(num_items_in_batch), 1)
        loss = out.loss / denom
        # the micro-batch's own means, and each sequence's (attribution quarantines rows by them)
        return loss, SimpleNamespace(loss=loss, ce=out.ce / counted, log_z=out.log_z,
                                     sequences=out.sequences)

    def __call__(self, outputs: Any, labels: torch.Tensor | None,
                 num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        if labels is None:
            raise ValueError("SpikeguardLoss needs the batch's 'labels' (the Trainer passes them "
                             "when the dataset has a 'labels' column)")
        loss, mean = self._loss(outputs, labels, num_items_in_batch)
        if torch.is_grad_enabled() and loss.requires_grad and self.recording:
            if self.guard is None:
                raise ValueError("SpikeguardLoss is not connected to a guard: call "
                                 "guard_trainer(trainer) before trainer.train()")
            rerun = tokens = None
            if self.model is not None and self._call is not None:
                rerun = functools.partial(self._rerun, self._call, labels, num_items_in_batch)
                tokens = input_ids(*self._call)
            self._call = None
            self.guard.accumulate(mean, rerun=rerun, tokens=tokens)
        return loss

    def _rerun(self, call: tuple[Any, Any], labels: torch.Tensor,
               num_items_in_batch: torch.Tensor | int | None, keep: torch.Tensor | None = None
               ) -> Any:
        """The micro-batch's forward and backward as the Trainer ran them (its loss over the
        step's ``num_items_in_batch``); returns its mean ``ce`` and ``log_z``. ``keep`` (a bool
        mask of rows): only those rows, their loss over their own tokens (the guard's backward
        weighs it across ranks)."""
        args, kwargs = call
        if keep is not None:
            n = labels.shape[0]

            def rows(v: Any) -> Any:
                return v[keep.to(v.device)] if torch.is_tensor(v) and v.dim() and len(v) == n else v

            args, kwargs = tuple(rows(a) for a in args), {k: rows(v) for k, v in kwargs.items()}
            labels, num_items_in_batch = rows(labels), None
        self.recording = False
        try:
            loss, mean = self._loss(self.model(*args, **kwargs), labels, num_items_in_batch)
            self.guard.backward(loss)
        finally:
            self.recording = True
        return mean


def _check_trainer(trainer: Any, loss: str) -> None:
    """What guard_trainer refuses or warns about in the Trainer's arguments."""
    args = trainer.args
    if args.max_grad_norm:
        raise ValueError(f"TrainingArguments.max_grad_norm={args.max_grad_norm} clips before the "
                         "guard sees the gradients, which hides a spike from it; set "
                         "max_grad_norm=0 and clip with GuardConfig(clip=...) (default 1.0)")
    if args.fp16:
        raise ValueError("TrainingArguments.fp16=True: accelerate's GradScaler would skip an "
                         "overflowing step before the guard sees it; use bf16=True or fp32")
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled",
                                                                   False):
        raise ValueError("guard_trainer supports a plain or DDP model; DeepSpeed and FSDP replace "
                         "the parameters after the guard would have taken them")
    if loss not in ("spikeguard", "own"):
        raise ValueError(f"loss={loss!r} must be 'spikeguard' or 'own'")
    loss_func = trainer.compute_loss_func
    if loss == "spikeguard" and not isinstance(loss_func, SpikeguardLoss):
        raise ValueError("pass Trainer(compute_loss_func=SpikeguardLoss()) so that the loss and "
                         "log Z reach the guard, or guard_trainer(..., loss='own') when your "
                         "loss function calls callback.guard.accumulate(loss, log_z=...)")
    if args.logging_nan_inf_filter:
        warnings.warn("TrainingArguments.logging_nan_inf_filter=True replaces a NaN or Inf loss "
                      "in the Trainer's logged 'loss' by the running average, hiding it; the "
                      "guard still sees it (spikeguard/loss); set logging_nan_inf_filter=False",
                      UserWarning, stacklevel=3)


def guard_trainer(trainer: Any, *, config: GuardConfig | None = None,
                  loss: Literal["spikeguard", "own"] = "spikeguard",
                  sinks: Iterable[Any] | None = None, out_dir: str | Path | None = None,
                  **guard_kwargs: Any) -> Any:
    """Put a Guard into ``trainer`` (a ``transformers.Trainer``) before ``trainer.train()``.

    Wraps the Trainer's optimizer (created now from its arguments when none was passed) in a
    GuardedOptimizer and its LR scheduler in a held one, connects the ``SpikeguardLoss`` given
    as ``compute_loss_func`` (``loss="own"``: your loss function or model calls
    ``callback.guard.accumulate`` itself), and adds the callback it returns. ``config`` is the
    GuardConfig (``read_lag`` is 0 here; ``tier2="rollback"`` is refused); ``sinks`` more
    record sinks; the records also go to ``metrics.jsonl`` and a halt report to ``report.json``
    and ``report.txt`` in ``out_dir`` (default: ``args.output_dir``). ``guard_kwargs`` go to
    ``Guard`` (``on_alert``, ``probes``).
    """
    _check_trainer(trainer, loss)
    args, loss_func = trainer.args, trainer.compute_loss_func
    if trainer.optimizer is None:
        trainer.create_optimizer()
    if isinstance(trainer.optimizer, GuardedOptimizer):
        raise ValueError("this Trainer already has a guard")
    out = Path(out_dir if out_dir is not None else args.output_dir)
    parts = build_guard(trainer.model, trainer.optimizer, config, sinks=sinks, out_dir=out,
                        framework="HF Trainer", **guard_kwargs)
    trainer.optimizer = parts.optimizer
    if trainer.lr_scheduler is not None:
        trainer.lr_scheduler = HeldScheduler(trainer.lr_scheduler, parts.guard, parts.optimizer)
    if isinstance(loss_func, SpikeguardLoss):
        loss_func.guard = parts.guard
        loss_func.watch(trainer.model)
        parts.optimizer.reference = True  # each micro-batch's closure holds its own batch
        if loss_func.shift_labels and hasattr(trainer, "_loss_shifts_labels"):
            # the Trainer counts num_items_in_batch over labels[..., 1:] only for models whose
            # loss_type it knows to shift; ours shifts, whatever the model says
            trainer._loss_shifts_labels = True
    callback_cls, raiser_cls = _callback_classes()
    callback = callback_cls(trainer, parts, out)
    # first: what it adds to a log reaches every reporter (TensorBoard, W&B) after it
    trainer.callback_handler.callbacks.insert(0, callback)
    # last: the halt is raised once every other callback has seen the end of training
    trainer.add_callback(raiser_cls(parts.optimizer))
    return callback


class _GuardCallbackLogic:
    """The callback's behaviour; mixed with transformers' TrainerCallback on first use."""

    def __init__(self, trainer: Any, parts: GuardParts, out_dir: Path) -> None:
        self.trainer, self.guard = trainer, parts.guard
        self.optimizer, self.records = parts.optimizer, parts.records
        self.out_dir = out_dir
        self.report_path: Path | None = None
        """Where the halt report went (None while the run is healthy)."""
        self._logged = 0

    @property
    def halted(self) -> Any:
        """The TrainingHalted of a halt (None while the run is healthy)."""
        return self.optimizer.halted

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # a scheduler the Trainer built in train() from its arguments is held here
        sched = self.trainer.lr_scheduler
        if sched is not None and not isinstance(sched, HeldScheduler):
            self.trainer.lr_scheduler = HeldScheduler(sched, self.guard, self.optimizer)
            self.trainer.callback_handler.lr_scheduler = self.trainer.lr_scheduler
        if state.global_step == 0:
            self._fresh_start()
        if state.global_step > 0:  # resumed: the guard's steps continue the Trainer's
            saved = Path(args.output_dir) / f"checkpoint-{state.global_step}" / GUARD_STATE
            if saved.is_file():  # its state, and the metrics file after its records
                self.guard.stateful().load_state_dict({"json": saved.read_text()})
            else:
                self.guard.start_at(state.global_step)

    def _fresh_start(self) -> None:
        """A run from step 0 into a folder an earlier run wrote: its metrics file starts anew
        (the Trainer overwrites its own checkpoints too), and the earlier run's report and
        quarantine go, so nothing in the folder mixes two runs."""
        old = self.out_dir / "metrics.jsonl"
        if not old.is_file() or old.stat().st_size == 0:
            return
        self.guard.start_at(0)  # drops every record from step 0 on: all of them
        gone = [n for n in ("report.json", "report.txt", "quarantine.jsonl")
                if (self.out_dir / n).is_file()]
        if _dist.rank() == 0:
            for name in gone:
                (self.out_dir / name).unlink()
        log.warning("spikeguard: a fresh run (step 0, no resume_from_checkpoint) into %s, "
                    "which holds an earlier run's metrics.jsonl%s: they start anew; pass "
                    "trainer.train(resume_from_checkpoint=...) to continue that run instead, or "
                    "another output_dir to keep it", self.out_dir,
                    f" and {', '.join(gone)}" if gone else "")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if _dist.rank() == 0:  # beside the Trainer's own checkpoint files
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                (folder / GUARD_STATE).write_text(self.guard.stateful().state_dict()["json"])

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = kwargs.get("optimizer")
        while opt is not None and opt is not self.optimizer and hasattr(opt, "optimizer"):
            opt = opt.optimizer  # accelerate's AcceleratedOptimizer wraps ours
        if opt is not self.optimizer:
            raise ValueError("the Trainer's optimizer is no longer the guard's GuardedOptimizer; "
                             "call guard_trainer(trainer) last, right before trainer.train()")

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.halted is not None and self.report_path is None:
            control.should_training_stop = True
            self.report_path = write_report(self.halted, self.out_dir)
            log.error("spikeguard: %s (report: %s)", self.halted.report, self.report_path)
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        rec = self.records.last
        if rec is not None and (rec.get("skipped") or (rec.get("tier") or 0) >= 2):
            control.should_log = True  # a skip, an alert or a halt gets its own log entry
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        rec = self.records.last
        if (logs is None or rec is None or self.records.records == self._logged
                or any(k.startswith("eval_") for k in logs)):
            return
        self._logged = self.records.records
        metrics = logger_metrics(rec, self.records.skips)
        logs.update(metrics)
        history = state.log_history
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(metrics)  # the Trainer stored a copy of logs before this hook


class _HaltRaiserLogic:
    def __init__(self, optimizer: GuardedOptimizer) -> None:
        self.optimizer = optimizer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.optimizer.halted is not None:
            raise self.optimizer.halted


@functools.cache
def _callback_classes() -> tuple[type, type]:
    from transformers import TrainerCallback

    class SpikeguardCallback(_GuardCallbackLogic, TrainerCallback):
        """The guard's TrainerCallback (made by ``guard_trainer``): holds the LR scheduler on a
        skip, adds the guard's metrics to the Trainer's logs, stops the Trainer on a halt and
        writes the report; ``.guard`` is the Guard."""

    class SpikeguardHaltRaiser(_HaltRaiserLogic, TrainerCallback):
        """Raises the halt after every other callback saw the end of training."""

    return SpikeguardCallback, SpikeguardHaltRaiser
