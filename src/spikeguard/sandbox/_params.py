"""Query strings -> the sandbox's config dataclasses, with messages that name the parameter.

The dataclass is the one owner of names, types and defaults: a query parameter is a field name,
its text is converted by the field's annotation (``int``, ``float``, ``bool``), and the
dataclass's own validation decides whether the value is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import fields
from typing import Any, TypeVar

__all__ = ["config_from_query"]

T = TypeVar("T")

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}
_MAX_LEN = 32


def _convert(name: str, kind: str, text: str) -> Any:
    if len(text) > _MAX_LEN:
        raise ValueError(f"{name}: a value of {len(text)} characters is too long")
    if kind == "bool":
        low = text.strip().lower()
        if low in _TRUE | _FALSE:
            return low in _TRUE
        raise ValueError(f"{name}={text!r} must be one of 1/0, true/false, on/off")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} is not an integer") from None
    if kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"{name}={text!r} must be a finite number")
        return value
    raise AssertionError(f"field {name} has an unsupported type {kind}")


def config_from_query(cls: type[T], items: Iterable[tuple[str, str]]) -> T:
    """Build ``cls`` from query ``items``; ValueError with a message for unknown, repeated or
    malformed parameters and for values the dataclass rejects."""
    kinds = {f.name: str(f.type) for f in fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for name, text in items:
        if name not in kinds:
            known = ", ".join(sorted(kinds))
            shown = name if len(name) <= _MAX_LEN else name[:_MAX_LEN] + "..."
            raise ValueError(f"unknown parameter {shown!r}; known: {known}")
        if name in values:
            raise ValueError(f"parameter {name!r} is given more than once")
        values[name] = _convert(name, kinds[name], text)
    return cls(**values)
