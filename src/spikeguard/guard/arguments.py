"""What the Guard checks about its arguments before it takes them (private to guard.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..detector.config import DetectorConfig
from ..measure.probes import ProbeConfig
from ..prevent.clipping import ClipConfig

__all__ = ["check_grads", "check_loss", "check_nested", "check_pair", "check_start_at",
           "check_states"]


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


def check_grads(params: list[Any], *, has_loss: bool = True) -> None:
    """The step has its loss, and at least one parameter has a gradient (a Python check: no
    device read)."""
    if not has_loss:
        raise ValueError("guard.step() needs the step's loss: pass step(out), or call "
                         "guard.accumulate(out) after each micro-batch's backward")
    if not any(p.grad is not None for p in params):
        raise ValueError("guard.step(): no parameter of the model has a gradient; call "
                         "loss.backward() (guard.backward(out) under fp16) before guard.step")


def check_loss(loss: Any, device: torch.device) -> None:
    """One number on the model's device: a 0-d tensor (or one element)."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("guard.step/accumulate needs the step's loss as a 0-d tensor or a "
                         f"LossOutput with reduction='mean'; got {type(loss).__name__}"
                         f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    if loss.device != device:
        raise ValueError(f"the loss is on {loss.device} but the model's parameters are on "
                         f"{device}; compute it on the model's device")


def check_nested(config: Any) -> None:
    """A GuardConfig's nested configs are of their types (a dict would fail much later)."""
    from .responses.lower_lr import LowerLrConfig

    for name, kind in (("detector", DetectorConfig), ("probes", ProbeConfig),
                       ("clipping", ClipConfig), ("lower_lr", LowerLrConfig)):
        if not isinstance(getattr(config, name), kind):
            raise TypeError(f"GuardConfig.{name} must be a {kind.__name__}, got "
                            f"{type(getattr(config, name)).__name__}")


def check_states(config: Any, checkpoints: Any, extra_state: Any, keep_on_rollback: tuple) -> None:
    """What the guard checkpoints: rollback needs a manager, ``guard`` is the guard's own key,
    ``keep_on_rollback`` names only extra states."""
    if config.tier2 == "rollback" and checkpoints is None:
        raise ValueError("GuardConfig(tier2='rollback') needs checkpoints=CheckpointManager(...)"
                         " to roll back to; pass one or use tier2='alert'")
    if extra_state and "guard" in extra_state:
        raise ValueError("extra_state key 'guard' is the guard's own; rename it")
    unknown = set(keep_on_rollback) - set(extra_state or {})
    if unknown:
        raise ValueError(f"keep_on_rollback names {sorted(unknown)}, which are not in "
                         f"extra_state ({sorted(extra_state or {})})")


def check_start_at(step: Any, *, at: int, ran: int) -> int:
    """``guard.start_at(step)``'s argument: an int >= 0, never behind ``at`` once the guard has
    stepped (``ran`` steps in this process)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0 or (ran and step < at):
        raise ValueError(f"guard.start_at(step={step!r}) at step {at} after {ran} steps in this "
                         "process: give an int >= 0 (the framework's step count), never behind "
                         "the guard's once it stepped")
    return step
