"""Settings an answer changes that the guard's Reply cannot carry (docs/on-call.md).

``apply_settings`` applies the parsed ``--set`` values other than the LR (which the ask
response turns into a Stretch, the guard's one LR mechanism): the z-loss coefficient on a model
with ``cfg.z_loss`` (the reference GPT), the clip threshold on the step part, QK-Clip on the
guard's signals, and a layer run in fp32 outside autocast (``keep_fp32``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

__all__ = ["apply_settings", "keep_fp32"]


def apply_settings(model: nn.Module, settings: dict[str, Any], *, updater: Any,
                   probes: Any) -> dict[str, Any]:
    """Apply parsed settings (settings.py) except ``lr``/``lr_scale``; returns them."""
    out: dict[str, Any] = {}
    for name, value in settings.items():
        if name == "z_loss":
            cfg = getattr(model, "cfg", None)
            if cfg is None or not hasattr(cfg, "z_loss"):
                raise ValueError("--set z_loss needs a model with cfg.z_loss (the reference "
                                 "GPT); in your own loop, pass z_loss to sg.cross_entropy")
            model.cfg = dataclasses.replace(cfg, z_loss=float(value))
            out[name] = float(value)
        elif name == "clip":
            updater.clip = value
            out[name] = value
        elif name == "qk_clip":
            signals = getattr(probes, "signals", None) if probes is not None else None
            if signals is None or not signals._hooks:
                raise ValueError("--set qk_clip needs the guard's signals (probes on, the "
                                 "update ratio read every step)")
            signals.config = dataclasses.replace(signals.config, qk_clip=value)
            out[name] = value
        elif name.startswith("precision."):
            keep_fp32(model.get_submodule(name.removeprefix("precision.")), value == "fp32")
            out[name] = value
        else:
            raise ValueError(f"--set {name}: not a setting apply_settings applies")
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
