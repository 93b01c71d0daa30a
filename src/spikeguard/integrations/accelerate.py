"""The Guard inside a Hugging Face ``accelerate`` loop: prepared model, optimizer, scheduler and
dataloader, gradient accumulation through ``accelerator.accumulate``, its GradScaler under fp16.

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    guard = guard_accelerator(accelerator, model, optimizer, scheduler=scheduler,
                              out_dir="runs/acc")

    def forward_backward(batch, keep=None):
        if keep is not None:
            batch = {k: v[keep] for k, v in batch.items()}
        out = sg.cross_entropy(model(input_ids=batch["input_ids"]).logits, batch["labels"])
        accelerator.backward(out.loss)       # divides by gradient_accumulation_steps itself
        return out                           # the micro-batch's own mean

    for batch in loader:
        with accelerator.accumulate(model):
            out = forward_backward(batch)
            guard.accumulate(out, rerun=functools.partial(forward_backward, batch))
            if accelerator.sync_gradients:
                guard.step()                 # instead of optimizer.step(), scheduler.step(), zero_grad()

The guard owns the step: it is built with the optimizer inside accelerate's
``AcceleratedOptimizer`` and steps accelerate's ``AcceleratedScheduler`` once per applied update
(which steps the schedule as accelerate does: ``num_processes`` times unless ``split_batches``),
so the loop calls neither ``optimizer.step()`` nor ``scheduler.step()`` nor ``zero_grad()``, and
clips nothing itself (``GuardConfig.clip`` clips after measuring). Under fp16 the guard adopts
the accelerator's own GradScaler: ``accelerator.backward`` scales the loss with it, the guard
unscales, measures, skips or steps through it, and ``scaler.update()`` runs once a step, so an
overflow is the scaler's own Tier 0 skip and never a spike. The re-run closure follows README's
contract (``functools.partial`` holds the micro-batch; ``accelerator.backward`` divides by the
accumulation count as in the loop); with ``AttributionConfig(drop_sequences=True)`` backward
through ``guard.backward(out.loss / accelerator.gradient_accumulation_steps)`` instead, which
weighs a re-run without the quarantined rows. Plain and DDP (MULTI_CPU, MULTI_GPU) runs only:
DeepSpeed, FSDP and Megatron own the optimizer step themselves.

accelerate is imported on first use, not with this module.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..guard import Guard, GuardConfig
from ..measure.precision import PrecisionPolicy
from ..sinks import JsonlSink

__all__ = ["guard_accelerator"]

_KINDS = {"no": "fp32", "fp16": "fp16-mixed", "bf16": "bf16-mixed"}
"""accelerate's ``mixed_precision`` -> the guard's PrecisionPolicy kind."""


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    from accelerate.optimizer import AcceleratedOptimizer

    if not isinstance(optimizer, AcceleratedOptimizer):
        raise ValueError(f"guard_accelerator takes the optimizer accelerator.prepare returned (an "
                         f"AcceleratedOptimizer), got {type(optimizer).__name__}: prepare it "
                         "first, so that accelerate places its state and the guard steps it")
    return optimizer.optimizer


def guard_accelerator(accelerator: Any, model: nn.Module, optimizer: Any, *,
                      scheduler: Any = None, config: GuardConfig | None = None,
                      out_dir: str | Path | None = None, sinks: Iterable[Any] | None = None,
                      **guard_kwargs: Any) -> Guard:
    """A Guard for a loop run by ``accelerator`` (module docstring).

    ``model``, ``optimizer`` and ``scheduler`` are what ``accelerator.prepare`` returned (the
    scheduler optional); ``config`` the GuardConfig; records go to ``out_dir/metrics.jsonl`` (on
    rank 0) beside ``sinks``; ``guard_kwargs`` go to ``Guard`` (``checkpoints``, ``data``,
    ``on_alert``, ``probes``). Raises ValueError naming the fix for a setup the guard cannot
    own: an unprepared optimizer, DeepSpeed/FSDP/Megatron, fp16 without accelerate's GradScaler.
    """
    from accelerate.utils import DistributedType

    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP,
                                        DistributedType.MEGATRON_LM):
        raise ValueError(f"guard_accelerator supports a plain or DDP run; {kind} steps the "
                         "optimizer and clips inside its own engine, before the guard could "
                         "measure the gradients")
    inner = _unwrap_optimizer(optimizer)
    mixed = str(accelerator.mixed_precision)
    if mixed not in _KINDS:
        raise ValueError(f"accelerator.mixed_precision={mixed!r}: the guard knows 'no', 'bf16' "
                         "and 'fp16'; use one of them")
    precision = PrecisionPolicy(kind=_KINDS[mixed]).runtime(model)  # the params' device
    if mixed == "fp16":
        if accelerator.scaler is None:
            raise ValueError("accelerator.mixed_precision='fp16' without accelerate's GradScaler: "
                             "the guard cannot see an overflow; use bf16, or fp16 with native AMP")
        precision.scaler = accelerator.scaler  # one scaler: accelerator.backward scales with it
    all_sinks = list(sinks or [])
    if out_dir is not None:
        all_sinks.append(JsonlSink(Path(out_dir) / "metrics.jsonl"))
    return Guard(model, inner, config=config, scheduler=scheduler, precision=precision,
                 sinks=all_sinks, **guard_kwargs)
