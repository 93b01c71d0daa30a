"""The one validator for config values, so every config speaks with one voice.

``check_int(value, "GPTConfig.n_layer")`` -> ``ValueError("GPTConfig.n_layer=0 must be an
integer >= 1")``, with the default or a hint appended when given. bool is never an integer here.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_int", "check_positive", "check_window"]


def _tail(default: Any, hint: str) -> str:
    parts = [p for p in (f"default {default!r}" if default is not None else "", hint) if p]
    return f" ({'; '.join(parts)})" if parts else ""


def check_int(value: Any, name: str, *, minimum: int = 1, default: Any = None,
              hint: str = "") -> int:
    """``value`` if it is an int >= ``minimum``; otherwise ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}{_tail(default, hint)}")
    return value


def check_positive(value: Any, name: str, *, default: Any = None, hint: str = "") -> float:
    """``value`` as a float if it is a finite number > 0; otherwise ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0{_tail(default, hint)}")
    return float(value)


def check_window(obj: Any, state: dict[str, Any]) -> int:
    """``obj.window``; ValueError if ``state`` was saved with another (never a silent resize)."""
    if int(state["window"]) != obj.window:
        raise ValueError(f"{type(obj).__name__} state has window={state['window']} but this one "
                         f"has window={obj.window}: build it with the saved window to load it")
    return obj.window
