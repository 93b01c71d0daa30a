"""Applying a person's decision to a running Guard at a step boundary.

Today's wiring (until the guard's responses are policy objects): ``spikeguard train`` builds the
Guard with ``on_alert=oncall.page`` and, after each ``guard.step``, calls ``oncall.poll`` and
hands a decision to ``apply_decision``. It uses the guard's parts as the responder's own
rollback does: restore a checkpoint (``CheckpointManager.restore(at_or_before=)``, the objects in
``keep_on_rollback`` kept as they are), re-apply the skip ranges learned so far and the answer's
``--skip-data``, and continue at the restored step; then the settings. The ask policy does the
same through the guard's response interface once it exists; nothing here is specific to the
reference GPT except ``z_loss``, which needs a model with ``cfg.z_loss``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .ask import Decision

__all__ = ["apply_decision", "apply_settings", "keep_fp32", "reapply"]


def apply_decision(guard: Any, model: nn.Module, decision: Decision) -> dict[str, Any]:
    """Apply ``decision`` (the same on every rank) and return what was done, for the record.
    A halt changes nothing here: the caller stops the run."""
    done: dict[str, Any] = {}
    if decision.action == "rollback":
        assert decision.to is not None, "validate() fills in the checkpoint"
        guard.flush()  # read_lag 1: the step still on the device belongs to the old timeline
        resp = guard.responder
        kept = {k: obj.state_dict() for k, obj in resp.keep_on_rollback.items()}
        info = guard.checkpoints.restore(at_or_before=decision.to)
        for k, state in kept.items():
            resp.keep_on_rollback[k].load_state_dict(state)
        resp.rollbacks += 1
        guard.ledger.reapply()
        if decision.skip_data is not None and guard.ledger.can_skip:
            guard.ledger.skip(*decision.skip_data)
            done["skip_data"] = list(decision.skip_data)
        guard.micro.clear()
        guard.optimizer.zero_grad(set_to_none=True)
        guard._pending = None
        guard.state.continue_at(guard._step)  # probes and data measured from here; records kept
        guard.watch.rolled_back(guard._step, guard._step)
        done["rollback_to"] = info.step
    if decision.settings:
        done["settings"] = apply_settings(guard, model, decision.settings)
    return done


def _scale_lr(guard: Any, factor: float) -> None:
    for group in guard.optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    sched = guard.scheduler
    if sched is not None and hasattr(sched, "base_lrs"):
        sched.base_lrs = [lr * factor for lr in sched.base_lrs]


def _peak_lr(guard: Any) -> float:
    sched = guard.scheduler
    if sched is not None and getattr(sched, "base_lrs", None):
        return float(sched.base_lrs[0])
    return float(guard.optimizer.param_groups[0]["lr"])


def apply_settings(guard: Any, model: nn.Module, settings: dict[str, Any]) -> dict[str, Any]:
    """Apply parsed settings (settings.py); returns them as a resumed run re-applies them
    (``lr_scale`` becomes the absolute ``lr`` it led to, so applying it twice is harmless)."""
    out: dict[str, Any] = {}
    for name, value in settings.items():
        if name == "z_loss":
            cfg = getattr(model, "cfg", None)
            if cfg is None or not hasattr(cfg, "z_loss"):
                raise ValueError("--set z_loss needs a model with cfg.z_loss (the reference "
                                 "GPT); in your own loop, pass z_loss to sg.cross_entropy")
            model.cfg = dataclasses.replace(cfg, z_loss=float(value))
            out[name] = float(value)
        elif name in ("lr", "lr_scale"):
            peak = _peak_lr(guard)
            factor = float(value) / peak if name == "lr" else float(value)
            _scale_lr(guard, factor)
            out["lr"] = peak * factor
        elif name == "clip":
            guard.updater.clip = value
            out[name] = value
        elif name == "qk_clip":
            signals = getattr(guard.probes, "signals", None) if guard.probes else None
            if signals is None or not signals._hooks:
                raise ValueError("--set qk_clip needs the guard's signals (probes on, the "
                                 "update ratio read every step)")
            signals.config = dataclasses.replace(signals.config, qk_clip=value)
            out[name] = value
        elif name.startswith("precision."):
            keep_fp32(model.get_submodule(name.removeprefix("precision.")), value == "fp32")
            out[name] = value
        else:
            raise ValueError(f"--set {name}: unknown setting")
    return out


def keep_fp32(module: nn.Module, on: bool = True) -> None:
    """Run ``module`` in fp32 outside autocast (its floating inputs cast up), or undo that."""
    original = module.__dict__.get("_spikeguard_forward")
    if not on:
        if original is not None:
            module.forward = original
            del module.__dict__["_spikeguard_forward"]
        return
    if original is not None:
        return
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        up = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        device = next(module.parameters(), torch.empty(0)).device.type
        with torch.autocast(device, enabled=False):
            return inner(*up, **kwargs)

    module.__dict__["_spikeguard_forward"] = inner
    module.forward = forward


def reapply(section: dict[str, Any] | None, guard: Any, model: nn.Module,
            data: Any) -> dict[str, Any]:
    """A resumed run keeps what answers changed: config.json's ``oncall`` section (its
    settings and ``--skip-data`` ranges) applied again after the restore. Returns the settings."""
    if not section:
        return {}
    for lo, hi in section.get("skip_data", []):
        if (lo, hi) not in {tuple(r) for r in getattr(data, "skip_ranges", ())}:
            data.skip(lo, hi)
    return apply_settings(guard, model, dict(section.get("overrides", {})))
