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
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, Literal

__all__ = ["add_config_args", "config_from_args", "field_docs", "flag_message"]


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass: its first paragraph, on one line."""
    return dict(_field_docs(cls))  # a copy: the cached parse is never edited by a caller


@functools.cache  # reading the source is slow (tokenize): once per class, not once per flag
def _field_docs(cls: type) -> dict[str, str]:
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
                # the first paragraph, joined: a help line never stops mid-sentence
                para = inspect.cleandoc(nxt.value.value).split("\n\n")[0]
                docs[node.target.id] = " ".join(para.split())
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


def _default(f: dataclasses.Field, owner_default: Any = None) -> Any:
    """The field's default: read from the parent's default instance when the dataclass is nested
    (``TrainConfig.gpt``'s default may differ from GPTConfig's own), else the field's own."""
    if owner_default is not None:
        return getattr(owner_default, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


_Leaf = tuple[tuple[str, ...], dataclasses.Field, type, Any]


def _leaves(cls: type, path: tuple[str, ...] = (), instance: Any = None) -> list[_Leaf]:
    """Every non-dataclass field under ``cls`` with its path, owning class and default."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp, _ = _inner(hints[f.name])
        default = _default(f, instance)
        if dataclasses.is_dataclass(tp):
            out += _leaves(tp, (*path, f.name), default)
        else:
            out.append(((*path, f.name), f, cls, default))
    return out


def _skipped(path: tuple[str, ...], skip: tuple[str, ...]) -> bool:
    """``skip`` holds leaf names (skipped wherever they occur) or dotted paths."""
    return path[-1] in skip or ".".join(path) in skip


def _flags(cls: type, skip: tuple[str, ...]) -> list[tuple[str, tuple[str, ...], dataclasses.Field, type, Any]]:
    leaves = [leaf for leaf in _leaves(cls) if not _skipped(leaf[0], skip)]
    counts: dict[str, int] = {}
    for path, *_ in leaves:
        counts[path[-1]] = counts.get(path[-1], 0) + 1
    return [(path[-1] if counts[path[-1]] == 1 else "_".join(path), path, f, owner, default)
            for path, f, owner, default in leaves]


def _dest(path: tuple[str, ...]) -> str:
    return "cfg__" + "__".join(path)


def add_config_args(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--option`` per leaf field of dataclass ``cls`` (nested configs walked).
    ``skip`` names leaves (everywhere) or dotted paths (``"gpt.vocab_size"``) to leave out;
    a skipped field keeps the default. A ``tuple[str, ...]`` field is a repeatable flag."""
    for name, path, f, owner, default in _flags(cls, skip):
        flag = "--" + name.replace("_", "-")
        hint = typing.get_type_hints(owner)[f.name]
        tp, extra = _parser_for(hint)
        _, optional = _inner(hint)
        doc = field_docs(owner).get(f.name, "")
        # argparse %-formats help strings: a literal percent sign must be doubled
        help_text = f"{doc} (default: {default})".replace("%", "%%")
        dest = _dest(path)
        if tp is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
            continue
        if typing.get_origin(tp) is tuple:
            parser.add_argument(flag, dest=dest, action="append", type=typing.get_args(tp)[0],
                                default=None, metavar=name.upper(), help=help_text + " (repeatable)")
            continue
        if "choices" not in extra:
            extra["metavar"] = name.upper()
        parser.add_argument(flag, dest=dest, type=tp, default=default, help=help_text, **extra)
        if optional and default is not None:
            parser.add_argument("--no-" + name.replace("_", "-"), dest=dest, action="store_const",
                                const=None, help=f"turn {flag} off (None)")


def _build(cls: type, values: dict[tuple[str, ...], Any], path: tuple[str, ...] = (),
           instance: Any = None) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        tp, _ = _inner(hints[f.name])
        here = (*path, f.name)
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, values, here, _default(f, instance))
        elif here in values:
            kwargs[f.name] = values[here]
        elif instance is not None:  # a skipped flag: the parent's default instance decides
            kwargs[f.name] = getattr(instance, f.name)
    return cls(**kwargs)


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """Instantiate ``cls`` (nested configs included) from the parsed options it added."""
    values = {tuple(k[len("cfg__"):].split("__")): v for k, v in vars(args).items()
              if k.startswith("cfg__")}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if v is not None
              or not _appendable(cls, k)}
    return _build(cls, values)


def _appendable(cls: type, path: tuple[str, ...]) -> bool:
    for name in path[:-1]:
        cls = _inner(typing.get_type_hints(cls)[name])[0]
    return typing.get_origin(_inner(typing.get_type_hints(cls)[path[-1]])[0]) is tuple


def flag_message(exc: BaseException, cls: type) -> str:
    """A config's ValueError in the words of the command line: ``TrainConfig.steps=0`` becomes
    ``--steps=0`` (``DetectorConfig.grad_k=0`` becomes ``--grad-k=0``), so the message names the
    flag the user typed."""
    text = str(exc)
    for name, _, f, owner, _ in _flags(cls, ()):
        text = text.replace(f"{owner.__name__}.{f.name}=", f"--{name.replace('_', '-')}=")
    return text
