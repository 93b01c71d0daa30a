"""Build argparse options from a keyword-only config dataclass, so defaults live in one place.

Each field becomes ``--field-name`` with the field's default and the docstring line under the
field as its help text.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
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


def _parser_for(tp: Any) -> tuple[Any, dict[str, Any]]:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        return type(choices[0]), {"choices": choices}
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _parser_for(inner[0])
    return tp, {}


def add_config_args(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--option`` per field of dataclass ``cls``."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp, extra = _parser_for(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        # argparse %-formats help strings: a literal percent sign must be doubled
        help_text = f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%")
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=tp, default=default, help=help_text, **extra)


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """Instantiate ``cls`` from the parsed options it added."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def flag_message(exc: BaseException, cls: type) -> str:
    """A config's ValueError in the words of the command line: ``TrainConfig.steps=0`` becomes
    ``--steps=0``, so the message names the flag the user typed."""
    text = str(exc)
    for f in dataclasses.fields(cls):
        text = text.replace(f"{cls.__name__}.{f.name}=", f"--{f.name.replace('_', '-')}=")
    return text
