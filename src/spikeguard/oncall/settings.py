"""The settings an answer may change (``--set NAME=VALUE``), parsed and checked without the run.

=================  ==========================================================================
``z_loss``         the z-loss coefficient (0 off; PaLM uses 1e-4), GPTConfig.z_loss
``lr``             the peak learning rate; the schedule keeps its shape around it
``lr_scale``       multiply the learning rate (peak and schedule) by this factor
``clip``           the gradient-norm clip threshold, or ``none`` to turn clipping off
``qk_clip``        QK-Clip's logit threshold (Kimi K2 uses 100), or ``none`` for off
``precision.M``    run module M (a name from the run's layers, e.g. ``blocks.3.attn``) in
                   ``fp32`` outside autocast, or ``auto`` to follow the run's policy again
=================  ==========================================================================

``parse_setting`` takes text (from the command line) or a value already parsed and returns the
value the run applies; a bad name or value is an AnswerError-compatible ValueError of one line.
``CONFIG_PATH`` says where each lands in config.json's ``config``.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["CONFIG_PATH", "SETTINGS", "config_with", "parse_setting", "split_setting"]

SETTINGS = ("z_loss", "lr", "lr_scale", "clip", "qk_clip", "precision.<module>")
"""The names ``--set`` knows (``precision.`` takes a module name after the dot)."""

CONFIG_PATH = {"z_loss": ("gpt", "z_loss"), "lr": ("lr",), "clip": ("guard", "clip"),
               "qk_clip": ("guard", "probes", "signals", "qk_clip")}
"""Where a setting's value lives in TrainConfig (config.json's ``config``)."""


def split_setting(text: str) -> tuple[str, str]:
    """'z_loss=1e-4' -> ('z_loss', '1e-4'); ValueError naming the form otherwise."""
    name, eq, value = str(text).partition("=")
    if not eq or not name.strip() or not value.strip():
        raise ValueError(f"--set {text!r} must be NAME=VALUE (e.g. z_loss=1e-4); names: "
                         f"{', '.join(SETTINGS)}")
    return name.strip(), value.strip()


def _number(name: str, value: Any, *, allow_none: bool = False, zero: bool = False) -> float | None:
    if allow_none and (value is None or (isinstance(value, str) and value.lower() in ("none", "off"))):
        return None
    try:
        x = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x) or x < 0 or (x == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        off = " or none (off)" if allow_none else ""
        raise ValueError(f"--set {name}={value!r}: the value must be a finite number {bound}{off}")
    return x


def parse_setting(name: str, value: Any, *, layers: list[str]) -> tuple[str, Any]:
    """(name, value) checked and parsed (module docstring); ValueError of one line if not."""
    if name == "z_loss":
        x = _number(name, value, zero=True)
        if x is not None and x > 1e-2:
            raise ValueError(f"--set z_loss={value}: far above 1e-3, which visibly hurts the "
                             "loss; PaLM uses 1e-4")
        return name, x
    if name == "lr":
        return name, _number(name, value)
    if name == "lr_scale":
        x = _number(name, value)
        if x is not None and x > 10:
            raise ValueError(f"--set lr_scale={value}: a factor above 10 is likely a typo; "
                             "give the peak LR with --set lr=VALUE instead")
        return name, x
    if name in ("clip", "qk_clip"):
        return name, _number(name, value, allow_none=True)
    if name.startswith("precision."):
        module = name.removeprefix("precision.")
        if module not in layers:
            near = [m for m in layers if module and module.split(".")[-1] in m][:5]
            hint = f" (similar: {', '.join(near)})" if near else ""
            raise ValueError(f"--set {name}: the run has no module {module!r}{hint}; the "
                             "incident lists the run's layers (spikeguard watch shows them)")
        if str(value) not in ("fp32", "auto"):
            raise ValueError(f"--set {name}={value!r}: a layer's precision is fp32 (outside "
                             "autocast) or auto (the run's policy)")
        return name, str(value)
    raise ValueError(f"--set {name}: unknown setting; known: {', '.join(SETTINGS)}")


def config_with(config: Any, settings: dict[str, Any]) -> Any:
    """``config`` (a TrainConfig as a dict, config.json's ``config``) with each setting written
    where TrainConfig keeps it (CONFIG_PATH; the others live in config.json's ``oncall`` only)."""
    for name, value in settings.items():
        where = CONFIG_PATH.get(name)
        node = config
        if where is None:
            continue
        for key in where[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[where[-1]] = value
    return config
