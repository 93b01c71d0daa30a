"""Build argparse options from keyword-only config dataclasses, so defaults live in one place.

Each field becomes ``--field-name`` with the field's default and the docstring line under the
field as its help text. A field whose type is itself a config dataclass (``GuardConfig.detector``)
is walked: its fields become flags of their own names (``--grad-k``), prefixed with the path only
where two leaves share a name (``--model-vocab-size`` beside ``--detector-vocab-size``). A
``float | None`` field with a non-None default also gets ``--no-<name>`` (sets None: "off").
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from typing import Any, Literal

__all__ = ["add_config_args", "config_from_args", "field_docs", "flag_message"]


def field_docs(cls: type) -> dict[str, str]:
    """The docstring line written under each field of a dataclass."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = nxt.value.value.strip().splitlines()[0]
    return docs


def _inner(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        inner = [a for a in args if a is not type(None)]
        return (inner[0] if len(inner) == 1 else typing.Union[tuple(inner)]), len(inner) < len(args)  # noqa: UP007
    return tp, False


def _parser_for(tp: Any) -> tuple[Any, dict[str, Any]]:
    tp, _ = _inner(tp)
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        return type(choices[0]), {"choices": choices}
    return tp, {}


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _leaves(cls: type, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dataclasses.Field, type]]:
    """Every non-dataclass field under ``cls`` with its path and owning class."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp, _ = _inner(hints[f.name])
        if dataclasses.is_dataclass(tp):
            out += _leaves(tp, (*path, f.name))
        else:
            out.append(((*path, f.name), f, cls))
    return out


def _flags(cls: type, skip: tuple[str, ...]) -> list[tuple[str, tuple[str, ...], dataclasses.Field, type]]:
    leaves = [leaf for leaf in _leaves(cls) if leaf[0][-1] not in skip and leaf[0][0] not in skip]
    counts: dict[str, int] = {}
    for path, _, _ in leaves:
        counts[path[-1]] = counts.get(path[-1], 0) + 1
    out = []
    for path, f, owner in leaves:
        name = path[-1] if counts[path[-1]] == 1 else "_".join(path)
        out.append((name, path, f, owner))
    return out


def _dest(path: tuple[str, ...]) -> str:
    return "cfg__" + "__".join(path)


def add_config_args(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--option`` per leaf field of dataclass ``cls`` (nested configs walked)."""
    for name, path, f, owner in _flags(cls, skip):
        flag = "--" + name.replace("_", "-")
        hint = typing.get_type_hints(owner)[f.name]
        tp, extra = _parser_for(hint)
        _, optional = _inner(hint)
        default = _default(f)
        doc = field_docs(owner).get(f.name, "")
        # argparse %-formats help strings: a literal percent sign must be doubled
        help_text = f"{doc} (default: {default})".replace("%", "%%")
        dest = _dest(path)
        if tp is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
            continue
        parser.add_argument(flag, dest=dest, type=tp, default=default, help=help_text, **extra)
        if optional and default is not None:
            parser.add_argument("--no-" + name.replace("_", "-"), dest=dest, action="store_const",
                                const=None, help=f"turn {flag} off (None)")


def _build(cls: type, values: dict[tuple[str, ...], Any], path: tuple[str, ...] = ()) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        tp, _ = _inner(hints[f.name])
        here = (*path, f.name)
        if dataclasses.is_dataclass(tp):
            if any(p[:len(here)] == here for p in values):
                kwargs[f.name] = _build(tp, values, here)
        elif here in values:
            kwargs[f.name] = values[here]
    return cls(**kwargs)


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """Instantiate ``cls`` (nested configs included) from the parsed options it added."""
    values = {tuple(k[len("cfg__"):].split("__")): v for k, v in vars(args).items()
              if k.startswith("cfg__")}
    return _build(cls, values)


def flag_message(exc: BaseException, cls: type) -> str:
    """A config's ValueError in the words of the command line: ``TrainConfig.steps=0`` becomes
    ``--steps=0`` (``DetectorConfig.grad_k=0`` becomes ``--grad-k=0``), so the message names the
    flag the user typed."""
    text = str(exc)
    for name, _, f, owner in _flags(cls, ()):
        text = text.replace(f"{owner.__name__}.{f.name}=", f"--{name.replace('_', '-')}=")
    return text
