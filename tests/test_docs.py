"""Every code block in docs/ runs (Python), parses as the command line takes it (`spikeguard ...`
lines: the parser and the config's validation, fault specs included), or is marked a fragment
with exactly the names it needs (``<!-- fragment: a b -->`` before it); every help line of the
CLI is whole; docs/faults.md shows every fault kind."""

from __future__ import annotations

import ast
import builtins
import functools
import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"(?:<!-- fragment:([^>]*)-->\n)?```(\w*)\n(.*?)```", re.S)


def blocks(path: Path) -> list[tuple[str, str, set[str] | None]]:
    """(language, code, the fragment's names or None) of each fenced block."""
    return [(m.group(2), m.group(3), None if m.group(1) is None else set(m.group(1).split()))
            for m in _BLOCK.finditer(path.read_text())]


def free_names(code: str) -> set[str]:
    """Names the code reads but never binds (imports, assignments, defs, arguments, loops)."""
    tree = ast.parse(code)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound


def commands(code: str) -> list[list[str]]:
    """The argv (after ``spikeguard``) of every spikeguard command in a shell block."""
    out = []
    for line in code.splitlines():
        for part in line.split("&&"):
            if part.strip().startswith("spikeguard "):
                out.append(shlex.split(part, comments=True)[1:])
    return out


def test_every_docs_block_runs_parses_or_is_a_fragment_with_its_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = {"python": 0, "fragment": 0, "command": 0}
    for path in DOCS:
        for lang, code, fragment in blocks(path):
            where = f"{path.name}: {code.splitlines()[0]!r}"
            if lang == "python" and fragment is not None:
                assert free_names(code) == fragment, where
                seen["fragment"] += 1
            elif lang == "python":
                assert not free_names(code), where
                exec(compile(code, str(path), "exec"), {"__name__": "docs"})
                seen["python"] += 1
            else:
                for argv in commands(code):
                    check_command(argv, where)
                    seen["command"] += 1
    assert seen["python"] >= 1 and seen["fragment"] >= 3 and seen["command"] >= 12, seen


@functools.cache
def _parser():
    from spikeguard.cli import build_parser

    return build_parser()


def check_command(argv: list[str], where: str) -> None:
    from spikeguard._config_cli import config_from_args
    from spikeguard.train import TrainConfig

    args = _parser().parse_args(argv)
    if args.command == "train":
        config_from_args(TrainConfig, args)  # validates, fault specs against --steps too


def test_faults_doc_gives_an_example_of_every_kind_and_form():
    from spikeguard.train import parse_fault
    from spikeguard.train.faults import _SPEC

    text = (ROOT / "docs" / "faults.md").read_text()
    kinds = re.search(r"\((.*?)\)@", _SPEC.pattern).group(1).split("|")
    specs = [a[a.index("--inject") + 1] for lang, code, _ in blocks(ROOT / "docs" / "faults.md")
             for a in commands(code) if "--inject" in a]
    parsed = [parse_fault(s) for s in specs]
    assert {f.kind for f in parsed} == set(kinds)
    assert any(f.sticky for f in parsed) and "`!`" in text
    assert any(f.args == ("repeat",) for f in parsed if f.kind == "outlier")
    for kind in kinds:
        assert f"`{kind}@S" in text, kind  # in the grammar's table


def test_defenses_doc_names_what_defenses_none_changes():
    from spikeguard.train import NO_DEFENSES

    text = " ".join((ROOT / "docs" / "defenses.md").read_text().split())
    for name in NO_DEFENSES:
        assert f"`{name}`" in text, name


def _helps(parser) -> list[tuple[str, str]]:
    import argparse

    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [(f"{name} {flag}", text) for flag, text in _helps(sub)]
        elif action.help and action.help != argparse.SUPPRESS:
            out.append((action.option_strings[0] if action.option_strings else action.dest,
                        action.help))
    return out


@pytest.mark.parametrize("sub", ["train", "diagnose", "budget", "sandbox"])
def test_no_help_line_is_cut_mid_sentence(sub):
    from spikeguard.cli import build_parser

    helps = [(f, h) for f, h in _helps(build_parser()) if f.startswith(sub + " ")]
    assert len(helps) > 3 or sub in ("sandbox", "budget")
    for flag, text in helps:
        text = text.replace("%%", "%")
        assert text.count("(") == text.count(")"), (flag, text)  # a cut leaves one open
        assert text.count("`") % 2 == 0, (flag, text)
        body = re.sub(r" \(default: [^()]*\)( \(repeatable\))?$", "", text)
        assert not re.search(r"\b(the|a|an|of|for|to|and|or|with|than|by)$", body), (flag, text)
