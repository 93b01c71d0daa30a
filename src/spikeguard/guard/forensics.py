"""Tier 3 forensics: which tensor went non-finite, and where, when a run halts.

:class:`HaltReport` is what :class:`TrainingHalted` carries: the reasons, (a) the parameters whose
gradients hold a NaN or Inf, by name, (b) the first module in forward order whose output is
non-finite and (c) the first module in backward order whose input gradient is non-finite. (b) and
(c) need the step re-run with hooks (the guard's ``rerun`` closure). Under torch.distributed every
rank contributes what it sees (a NaN may sit in one rank's shard only) and every rank ends with
the same report: names are gathered from all ranks (one ``all_gather_object`` each, on the halt
path only).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .. import _dist

__all__ = ["HaltReport", "TrainingHalted", "gather_names", "nonfinite_params", "trace_nonfinite"]


@dataclass
class HaltReport:
    """Why a run halted and which tensors went non-finite (identical on every rank)."""

    step: int
    """The step that halted."""
    reasons: tuple[str, ...]
    """The verdict's reasons (the first names the metric that moved first)."""
    nonfinite_params: list[str] = field(default_factory=list)
    """Parameters whose gradient held a NaN or Inf, in the model's parameter order."""
    first_forward: str | None = None
    """First module, in forward order, whose output was non-finite when the step was re-run."""
    first_backward: str | None = None
    """First module, in backward order, whose input gradient was non-finite on the re-run."""
    traced: bool = False
    """Whether the step was re-run with hooks (without a rerun closure b and c stay None)."""
    summary: dict[str, Any] | None = None
    """The Tier 2 summary when a skip storm or an unrecovered skip made the halt."""
    detail: str = ""
    """One more line of explanation (e.g. the rollback budget ran out)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"HALT at step {self.step}: {'; '.join(self.reasons) or 'halted'}"]
        if self.detail:
            lines.append(f"  {self.detail}")
        if self.nonfinite_params:
            shown = ", ".join(self.nonfinite_params[:8])
            more = len(self.nonfinite_params) - 8
            lines.append(f"  non-finite gradients in: {shown}{f' (+{more} more)' if more > 0 else ''}")
        if self.traced:
            lines.append(f"  first non-finite output (forward): {self.first_forward or 'none'}")
            lines.append(f"  first non-finite input grad (backward): {self.first_backward or 'none'}")
        return "\n".join(lines)


class TrainingHalted(RuntimeError):
    """Raised by the guard on a halt; ``report`` is the :class:`HaltReport` (``str(exc)`` too)."""

    def __init__(self, report: HaltReport) -> None:
        super().__init__(str(report))
        self.report = report


def _gather(obj: Any) -> list[Any]:
    if _dist.world_size() == 1:
        return [obj]
    out: list[Any] = [None] * _dist.world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def gather_names(local: list[str], named_parameters: list[tuple[str, nn.Parameter]]) -> list[str]:
    """The union over ranks of each rank's ``local`` names, in the model's parameter order (one
    ``all_gather_object``; every rank must call it)."""
    order = {name: i for i, (name, _) in enumerate(named_parameters)}
    found = set().union(*_gather(local))
    return sorted(found, key=order.__getitem__)


def nonfinite_params(named_parameters: list[tuple[str, nn.Parameter]]) -> list[str]:
    """Names of parameters whose (local) gradient holds a NaN or Inf, over every rank, in the
    given order. A host read per parameter: for the halt path, not the step."""
    from ..measure.gradnorm import nonfinite_params as local_nonfinite

    return gather_names(local_nonfinite(named_parameters), named_parameters)


def _finite(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return not x.is_floating_point() or bool(torch.isfinite(_dist.local_tensor(x.detach())).all())
    if isinstance(x, (tuple, list)):
        return all(_finite(v) for v in x)
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    return True


def trace_nonfinite(model: nn.Module, rerun: Callable[[], Any]) -> tuple[str | None, str | None]:
    """Re-run the step with hooks; return (first module in forward order with a non-finite
    output, first module in backward order with a non-finite input gradient), agreed over ranks.

    Forward: a forward hook on every module checks its output. Backward: a forward pre-hook
    registers a tensor hook on each floating input that requires grad, so the gradient reaching
    that input is checked when autograd computes it (robust to in-place ops, unlike full
    backward hooks). Gradients are zeroed before the re-run.
    """
    counter = [0]
    first_fwd: list[tuple[int, str]] = []
    first_bwd: list[tuple[int, str]] = []
    handles = []

    def on_output(name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            counter[0] += 1
            if not first_fwd and not _finite(output):
                first_fwd.append((counter[0], name))
        return hook

    def on_input(name: str):
        def grad_hook(grad: torch.Tensor) -> None:
            counter[0] += 1
            if not first_bwd and not _finite(grad):
                first_bwd.append((counter[0], name))

        def pre(module: nn.Module, args: Any) -> None:
            for a in args if isinstance(args, tuple) else (args,):
                if isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point():
                    a.register_hook(grad_hook)
        return pre

    for name, module in model.named_modules():
        label = name or type(model).__name__
        handles.append(module.register_forward_hook(on_output(label)))
        handles.append(module.register_forward_pre_hook(on_input(label)))
    try:
        for p in model.parameters():
            p.grad = None
        with torch.enable_grad():
            rerun()
    finally:
        for h in handles:
            h.remove()
    picks = _gather((first_fwd[0] if first_fwd else (math.inf, None),
                     first_bwd[0] if first_bwd else (math.inf, None)))
    # the earliest over ranks; ranks run the same modules in the same order
    fwd = min((p[0] for p in picks), key=lambda x: x[0])[1]
    bwd = min((p[1] for p in picks), key=lambda x: x[0])[1]
    return fwd, bwd
