"""The Guard inside torchtitan's Trainer (tested with torchtitan 0.3.0): a skip is no optimizer
step and no LR scheduler step, a NaN halts naming the tensor, a Tier 2 rolls back through
torchtitan's CheckpointManager with its dataloader rewound and the poisoned batches left out.

    from spikeguard.integrations.torchtitan import guarded

    config = guarded(llama3_debugmodel(), guard=sg.GuardConfig(tier2="rollback"))
    trainer = config.build()             # a GuardedTrainer
    trainer.train()                      # raises TrainingHalted on a halt

``GuardedTrainer`` replaces the end of ``Trainer.train_step``: after ``forward_backward_step``
the guard measures the global grad norm (FSDP2 shards and pipeline stages from
``model_parts``), gates, clips (in place of torchtitan's ``clip_grad_norm_``), judges, responds
and records; the step's input ids (``input_dict["input"]``) go to its input-token check.
With read_lag 0 (the CPU's default) ``guard.decide()`` decides and the trainer calls
``optimizers.step()`` and ``lr_schedulers.step()`` only when it says apply; with read_lag 1 (a
GPU's) ``guard.step()`` steps them, a skip being fused AdamW's ``found_inf`` (no host read), and
judges each step during the next. Its ``train()`` is torchtitan's loop with the checkpoint saves
left to the guard (at torchtitan's own interval, by torchtitan's CheckpointManager, the guard's
state inside as Statefuls) and the data drawn through a source that a rollback rewinds.
docs/torchtitan.md has the whole recipe; examples/torchtitan_train.py is torchtitan's train.py
with it.

torchtitan is imported with this module (its classes are subclassed here), not with
``spikeguard``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.loss import (
    IGNORE_INDEX,
    BaseLoss,
    ChunkedLossWrapper,
    CrossEntropyLoss,
)
from torchtitan.distributed import utils as dist_utils
from torchtitan.trainer import Trainer

from ..guard import Guard, GuardConfig, TrainingHalted
from ..prevent.losses import LossOutput, cross_entropy
from ..sinks import JsonlSink
from ._common import RecordSink, write_report, write_run_config
from ._incidents import Incident, lowers_lr, recurring, recurring_report
from ._titan import OptimizersView, TitanBatches, TitanCheckpoints, scaled_lr

__all__ = ["GuardedTrainer", "SpikeguardLoss", "TitanSteps", "guarded"]

log = logging.getLogger("spikeguard")


class TitanSteps:
    """A sink in front of another: each record also says torchtitan's step (1-based, its
    console's and its checkpoint folders' numbering) beside the guard's 0-based ``step``:
    ``titan_step``, and on a rollback ``titan_rollback_to`` (the folder ``step-N`` restored)."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    def log(self, record: dict[str, Any], step: int) -> None:
        record = dict(record, titan_step=int(record["step"]) + 1)
        if record.get("rollback_to") is not None:
            record["titan_rollback_to"] = int(record["rollback_to"]) + 1
        self.sink.log(record, step)

    def __getattr__(self, name: str) -> Any:  # resume, resume_at_step, close, disabled...
        if name == "sink":
            raise AttributeError(name)
        return getattr(self.sink, name)


class SpikeguardLoss(BaseLoss):
    """torchtitan's loss contract (``(pred, labels, global_valid_tokens) -> (loss, metrics)``)
    with spikeguard's cross-entropy: z-loss (PaLM's 1e-4) and log Z from the same pass over the
    logits. Like torchtitan's CrossEntropyLoss it returns this rank's sum over its counted
    tokens divided by the global token count, so the micro-batches and ranks add up to the
    step's true mean; it also adds the detached cross-entropy and log Z, divided the same way,
    to the step's totals that the trainer hands to the guard (``take``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        z_loss: float = 1e-4
        """The z-loss weight alpha in ce + alpha * mean(log Z^2) (PaLM's 1e-4; 0 turns it off)."""
        softcap: float | None = None
        """Cap the logits at softcap * tanh(logits / softcap) first (Gemma 2 uses 30)."""

    def __init__(self, config: Config, *, compile_config: Any = None) -> None:
        self.z_loss, self.softcap = config.z_loss, config.softcap
        self._ce: torch.Tensor | None = None
        self._log_z: torch.Tensor | None = None

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor,
                 global_valid_tokens: torch.Tensor | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        if isinstance(pred, DTensor):
            raise ValueError("SpikeguardLoss takes plain logits; tensor-parallel (loss-parallel) "
                             "logits are not supported: set parallelism.tensor_parallel_degree=1")
        if pred.dim() != 3:
            raise ValueError(f"SpikeguardLoss needs logits [batch, seq, vocab], got "
                             f"{tuple(pred.shape)}; it replaces ChunkedLossWrapper (the model "
                             "must return logits, not hidden states)")
        norm = global_valid_tokens.clamp(min=1) if global_valid_tokens is not None else None
        out = cross_entropy(pred, labels, z_loss=self.z_loss, ignore_index=IGNORE_INDEX,
                            softcap=self.softcap, normalizer=norm)
        ce, log_z = out.ce.detach(), out.log_z.detach()
        self._ce = ce if self._ce is None else self._ce + ce
        self._log_z = log_z if self._log_z is None else self._log_z + log_z
        return out.loss, {}

    def take(self, scale: float, device: torch.device) -> LossOutput:
        """The totals since the last ``take`` times ``scale``, as a LossOutput (zeros on a rank
        that computed no loss: a pipeline stage before the last); then starts over."""
        zero = torch.zeros((), device=device)
        ce = self._ce if self._ce is not None else zero
        log_z = self._log_z if self._log_z is not None else zero
        self._ce = self._log_z = None
        ce, log_z = ce.float() * scale, log_z.float() * scale
        return LossOutput(ce, ce, torch.zeros_like(ce), log_z)


class GuardedTrainer(Trainer):
    """torchtitan's Trainer with the guard deciding every optimizer step (module docstring).

    ``config.guard`` is the GuardConfig (``read_lag`` None: 1 on CUDA, else 0); ``config.loss``
    must be ``SpikeguardLoss.Config`` (the guard needs the loss and log Z); ``training.max_norm``
    must equal ``GuardConfig.clip`` (the guard clips in place of torchtitan); with
    ``tier2="rollback"`` ``checkpoint.enable`` must be on. ``metrics.jsonl`` (one record per step) and, on a halt, ``report.json`` go into
    ``dump_folder``. ``self.guard`` is the Guard."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        guard: GuardConfig = field(default_factory=GuardConfig)
        """What the guard does (thresholds in guard.detector; tier2="rollback" needs
        checkpoint.enable)."""

    def __init__(self, config: Config, *, sinks: list[Any] | None = None) -> None:
        _check_config(config)
        super().__init__(config)
        pd = self.parallel_dims
        self.guard_records = RecordSink()
        self._logged: int | None = None
        lag = config.guard.read_lag
        self.read_lag = lag if lag is not None else int(self.device.type == "cuda")
        self.batches = TitanBatches(self.dataloader,
                                    counters=self.state_dict if self.read_lag else None)
        parts = self.model_parts
        model: nn.Module = parts[0] if len(parts) == 1 else nn.ModuleList(parts)
        pp_mesh = pd.get_optional_mesh("pp") if pd.pp_enabled else None
        # each rank's loss is its sum over the global token count: times the ranks that hold
        # distinct pieces of it, the guard's mean over data ranks is the global token mean
        self._loss_scale = float(pd.world_size // (pd.pp * pd.tp))
        checkpoints = None
        if config.checkpoint.enable:
            checkpoints = TitanCheckpoints(self.checkpointer, config.checkpoint,
                                           steps=config.training.steps,
                                           defer=self.read_lag == 0, on_restore=self._restored)
        guard_cfg = dataclasses.replace(config.guard, read_lag=self.read_lag)
        self.optimizers_view = OptimizersView(self.optimizers)
        # read_lag 0: guard.decide(), and this trainer steps the optimizers and LR schedulers;
        # read_lag 1: guard.step() steps them (the skip is fused AdamW's found_inf, no host read)
        self.guard = Guard(model, self.optimizers_view, config=guard_cfg,
                           scheduler=self.lr_schedulers if self.read_lag else None,
                           checkpoints=checkpoints, data=self.batches,
                           sinks=[self.guard_records,
                                  TitanSteps(JsonlSink(Path(config.dump_folder) /
                                                       "metrics.jsonl")),
                                  *(sinks or [])],
                           pp_group=pp_mesh.get_group() if pp_mesh is not None else None)
        self._rollbacks_seen = 0
        write_run_config(config.dump_folder, guard_cfg, framework="torchtitan", extra={
            "precision": config.training.mixed_precision_param,
            "z_loss": config.loss.z_loss, "ckpt_every": config.checkpoint.interval
            if config.checkpoint.enable else None, "steps": config.training.steps,
            "step_numbering": "guard step s is torchtitan's step s + 1 (folder step-{s + 1})"})

    def _restored(self, step: int) -> None:
        """After a checkpoint load: torchtitan's step is the guard's (1-based)."""
        assert self.step == self.guard.step_index, (self.step, self.guard.step_index)

    def _draw(self, data_iterator: Any) -> tuple[list[list[tuple[dict, torch.Tensor]]],
                                                 torch.Tensor]:
        """The step's micro-batches (on the CPU, as the dataloader gave them), grouped per
        forward-backward call, and this rank's count of valid tokens (as torchtitan's train_step
        draws them)."""
        groups, local = [], torch.tensor(0, dtype=torch.int64)
        for _ in range(self.gradient_accumulation_steps):
            group = []
            for _ in range(self.num_pipeline_parallel_microbatches):
                input_dict, labels = next(data_iterator)
                local += (labels != IGNORE_INDEX).sum()
                group.append((input_dict, labels))
            groups.append(group)
        return groups, local

    def _forward_backward(self, groups: list, global_tokens: torch.Tensor) -> LossOutput:
        """Every micro-batch group through ``forward_backward_step``, each moved to the device
        only for its own call (torchtitan's habit: a re-run closure keeps CPU copies); the
        step's cross-entropy and log Z (this rank's share, scaled for the guard's mean over data
        ranks)."""
        pp = self.parallel_dims.pp_enabled
        for cpu_group in groups:
            group = [({k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                       for k, v in d.items()}, y.to(self.device)) for d, y in cpu_group]
            self.forward_backward_step(
                input_dict=[d for d, _ in group] if pp else group[0][0],
                labels=[y for _, y in group] if pp else group[0][1],
                global_valid_tokens=global_tokens)
        return self.loss_fn.take(self._loss_scale, self.device)

    def train_step(self, data_iterator: Any) -> None:
        """One step: forward and backward of every micro-batch, then the guard (measure, gate,
        clip, optimizers step or not, LR schedulers step per applied update, record, save)."""
        self.optimizers.zero_grad(set_to_none=True)
        lr_metrics = self.lr_schedulers.get_metrics()
        groups, local = self._draw(data_iterator)
        pd = self.parallel_dims
        global_tokens = (dist_utils.dist_sum_tensor(local.to(self.device), pd.get_mesh("batch"))
                         if pd.dp_enabled else local.to(self.device))
        self.loss_fn.take(1.0, self.device)  # nothing left over from a validation pass
        out = self._forward_backward(groups, global_tokens)

        def rerun() -> LossOutput:
            seen = self.ntokens_seen  # a re-run is not more training data
            try:
                return self._forward_backward(groups, global_tokens)
            finally:
                self.ntokens_seen = seen

        self.checkpointer.maybe_wait_for_staging()
        step = self.guard.step_index
        if step != self.step - 1:
            raise RuntimeError(f"torchtitan's step {self.step} and the guard's {step} are out of "
                               "step; drive the loop with GuardedTrainer.train()")
        ids = [d["input"] for group in groups for d, _ in group if torch.is_tensor(d.get("input"))]
        tokens = torch.cat([x.reshape(-1) for x in ids]).to(self.device) if ids else None
        if self.read_lag:  # resolves the step before, then steps or skips
            self.guard.step(out, rerun=rerun, tokens=tokens)
        else:
            decision = self.guard.decide(out, rerun=rerun, tokens=tokens)
            if decision.apply:  # else: skipped (no optimizer, no LR step) or rolled back
                with scaled_lr(self.optimizers_view, decision.lr_factor):
                    self.optimizers.step()
                self.lr_schedulers.step()
            if self.guard.checkpoints is not None:  # the save decide() asked for, now
                self.guard.checkpoints.commit()
        self._log(lr_metrics)
        self._check_recurring()

    def _check_recurring(self) -> None:
        """After a rollback: a Tier 2 that came back before the replay was back where the last
        one was detected is not the data; unless this rollback keeps the LR lower (the guard
        chose it: ``lowers_lr``), halt (``TrainingHalted``) instead of rolling back again
        (integrations/_incidents.py)."""
        ck = self.guard.checkpoints
        if ck is None or self.guard.rollbacks == self._rollbacks_seen:
            return
        self._rollbacks_seen = self.guard.rollbacks
        record = self.guard_records.last or {}
        if record.get("action") != "rollback":
            return
        detection, restored = int(record["step"]), int(record["rollback_to"])
        summary = record.get("summary") or {}
        onset = int(summary.get("onset_step", detection))
        log.warning("spikeguard: rolled back to torchtitan's step-%d (the guard's step %d) at "
                    "torchtitan's step %d", restored + 1, restored, detection + 1)
        last = recurring(ck.incidents, onset)
        c = self.guard.config
        if last is not None and not lowers_lr(c.rollback_lr_keep, c.rollback_lr_scale):
            raise TrainingHalted(recurring_report(
                detection, onset, last, record.get("reasons") or (), summary=summary,
                numbering=f" (torchtitan's step {onset + 1})"))
        ck.incidents.append(Incident(onset=onset, detection=detection, restored=restored))

    def _log(self, lr_metrics: dict[str, Any]) -> None:
        """The newest record to torchtitan's metrics (its loggers), at torchtitan's step."""
        record = self.guard_records.last
        if record is None or record.get("step") == self._logged:
            return
        self._logged = record["step"]
        if self.metrics_processor.should_log(self._logged + 1):
            loss, norm = float(record["loss"]), float(record["grad_norm"])
            self.metrics_processor.log(self._logged + 1, loss, loss, norm,
                                       extra_metrics={"n_tokens_seen": self.ntokens_seen,
                                                      **lr_metrics})

    def train(self) -> None:
        """torchtitan's loop: resume from the newest checkpoint (or torchtitan's initial load),
        then one ``train_step`` per step until ``training.steps``; checkpoints are the guard's
        (torchtitan's CheckpointManager, at its interval). A rollback moves ``self.step`` back
        and the loop follows it. On a halt: ``report.json`` in ``dump_folder``, then the
        TrainingHalted propagates (a non-zero exit under torchrun)."""
        config = self.config
        # the newest checkpoint (or load_step), the guard's state with it: the guard's metrics
        # file continues after its restored records; else torchtitan's initial load
        self.checkpointer.load(step=config.checkpoint.load_step)
        loaded = self.step
        with config.profiler.build(global_step=self.step,
                                   base_folder=config.dump_folder) as profiler:
            data = self.batch_generator(self.batches)  # torchtitan's timing and token counts
            try:
                while self.step < config.training.steps:
                    self.step += 1
                    self.gc_handler.run(self.step)
                    try:
                        self.train_step(data)
                    except DataloaderExhaustedError:
                        break
                    if config.validator.enable and self.validator.should_validate(self.step):
                        self.validator.validate(self.model_parts, self.step)
                    profiler.step()
                    if self.step - loaded == 1:
                        dist_utils.set_pg_timeouts(
                            timeout=timedelta(seconds=config.comm.train_timeout_seconds),
                            parallel_dims=self.parallel_dims)
            except TrainingHalted as halt:
                write_report(halt, config.dump_folder)
                log.error("spikeguard: halted at torchtitan's step %d (the guard's step %d); "
                          "report.txt in %s", halt.report.step + 1, halt.report.step,
                          config.dump_folder)
                raise
            finally:
                self.guard.close()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank done (torchtitan sleeps 2 s on rank 0)


def guarded(config: Any, *, guard: GuardConfig | None = None,
            loss: SpikeguardLoss.Config | None = None) -> GuardedTrainer.Config:
    """A torchtitan ``Trainer.Config`` (a model's registry entry, say) as the
    ``GuardedTrainer.Config`` with the same fields, ``guard`` (a GuardConfig, default
    GuardConfig()) and ``loss`` (default: the SpikeguardLoss.Config already there, else
    SpikeguardLoss.Config(), z-loss 1e-4) in place of torchtitan's cross-entropy. The fields
    are shared, not copied."""
    if not isinstance(config, Trainer.Config):
        raise ValueError(f"guarded(config): config must be a torchtitan Trainer.Config, got "
                         f"{type(config).__name__}")
    known = (CrossEntropyLoss.Config, ChunkedLossWrapper.Config, SpikeguardLoss.Config)
    if not isinstance(config.loss, known):
        raise ValueError(f"guarded(config): config.loss is a {type(config.loss).__qualname__}; "
                         "it replaces torchtitan's cross-entropy (CrossEntropyLoss, "
                         "ChunkedLossWrapper) with SpikeguardLoss, the same loss with log Z")
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.init and f.name != "guard"}
    if loss is None:  # a SpikeguardLoss already there stays
        loss = config.loss if isinstance(config.loss, SpikeguardLoss.Config) else \
            SpikeguardLoss.Config()
    fields["loss"] = loss
    return GuardedTrainer.Config(**fields, guard=guard if guard is not None else GuardConfig())


def _check_config(config: Any) -> None:
    """What GuardedTrainer refuses before torchtitan builds anything."""
    guard = getattr(config, "guard", None)
    if not isinstance(guard, GuardConfig):
        raise ValueError("GuardedTrainer needs GuardedTrainer.Config(guard=GuardConfig(...)); "
                         f"got a config.guard of type {type(guard).__name__}")
    if not isinstance(config.loss, SpikeguardLoss.Config):
        raise ValueError(f"config.loss is a {type(config.loss).__qualname__}; the guard needs "
                         "the loss and log Z from the logits: set config.loss = "
                         "SpikeguardLoss.Config() (it replaces ChunkedLossWrapper/"
                         "CrossEntropyLoss with the same sum / global token count)")
    if guard.clip != config.training.max_norm:
        raise ValueError(f"GuardConfig.clip={guard.clip} and training.max_norm="
                         f"{config.training.max_norm}: the guard clips in place of torchtitan's "
                         "clip_grad_norm_; set them equal (both default to 1.0)")
    if guard.tier2 == "rollback" and not config.checkpoint.enable:
        raise ValueError("GuardConfig(tier2='rollback') needs checkpoint.enable=True: the guard "
                         "rolls back through torchtitan's CheckpointManager")
    if config.training.enable_cpu_offload:
        raise ValueError("training.enable_cpu_offload is not supported with the guard")
