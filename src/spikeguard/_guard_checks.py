"""What the Guard checks about its arguments before it takes them (private to guard.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["check_grads", "check_pair"]


def check_pair(model: Any, optimizer: Any) -> None:
    """The model is a module with parameters and the optimizer steps only those parameters."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"Guard(model, optimizer): model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if not all(callable(getattr(optimizer, a, None)) for a in ("step", "zero_grad")) or \
            not isinstance(getattr(optimizer, "param_groups", None), list):
        raise TypeError(f"Guard(model, optimizer): optimizer must be a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    own = {id(p) for p in model.parameters()}
    if not own:
        raise ValueError(f"Guard(model, ...): the {type(model).__name__} has no parameters; the "
                         "guard measures, clips and steps the model's parameters")
    stray = sum(id(p) not in own for g in optimizer.param_groups for p in g["params"])
    if stray:
        raise ValueError(f"Guard(model, optimizer): {stray} of the optimizer's parameters are not "
                         "the model's, so the guard would neither measure nor clip them; build "
                         "the optimizer from model.parameters()")


def check_grads(params: list[Any]) -> None:
    """At least one parameter has a gradient (a Python check: no device read)."""
    if not any(p.grad is not None for p in params):
        raise ValueError("guard.step(): no parameter of the model has a gradient; call "
                         "loss.backward() (guard.backward(out) under fp16) before guard.step")
