"""The public face: ``import spikeguard as sg`` gives the names imported under ``TYPE_CHECKING``
in spikeguard/__init__.py, the one list (docs/design.md says why each is there). Checked here
against what is importable, what an IDE infers from the source, what README, docs/ and the
examples use, and the cost of ``import spikeguard``; the list itself is not repeated."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import spikeguard as sg
from tests.conftest import ROOT

PKG = ROOT / "src" / "spikeguard"


def _listed() -> dict[str, str]:
    """Name -> module, read from the TYPE_CHECKING block with ast (independently of __init__)."""
    tree = ast.parse((PKG / "__init__.py").read_text())
    blocks = [n for n in tree.body
              if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    assert len(blocks) == 1, "one TYPE_CHECKING block holds the public names"
    out = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.unparse(node)
        for a in node.names:
            # "X as X": an explicit re-export that mypy and pyright honour in a py.typed package
            assert a.asname == a.name, f"write 'import {a.name} as {a.name}'"
            assert a.name not in out, f"{a.name} is listed twice"
            module = f"spikeguard.{node.module}" if node.module else f"spikeguard.{a.name}"
            out[a.name] = module
    return out


def test_the_one_list_is_what_sg_gives_and_each_name_is_its_modules_object():
    listed = _listed()
    assert sg.__all__ == sorted(listed)
    assert 20 <= len(listed) <= 25, f"{len(listed)} names: the face is what a training loop calls"
    assert {"ClipConfig", "SignalConfig", "Guard", "GuardConfig", "TrainingHalted"} <= set(listed)
    for name, module in listed.items():
        mod = importlib.import_module(module)
        expected = mod if module.endswith("." + name) else getattr(mod, name)
        assert getattr(sg, name) is expected, name
    star: dict = {}
    exec("from spikeguard import *", star)
    assert set(star) - {"__builtins__"} == set(listed)
    assert set(listed) <= set(dir(sg))
    assert isinstance(sg.__version__, str) and "__version__" not in listed
    assert (PKG / "py.typed").is_file(), "type checkers read the package's hints only with py.typed"


def test_a_building_block_is_not_top_level_and_the_error_says_where_it_is():
    from spikeguard.measure.stats import RunningMedian  # noqa: F401
    from spikeguard.prevent.attention import QKNorm  # noqa: F401
    from spikeguard.sinks import read_metrics  # noqa: F401

    for name in ("QKNorm", "read_metrics", "RunningMedian", "load_corpus", "CheckpointError"):
        with pytest.raises(AttributeError, match=f"no attribute '{name}'.*their modules"):
            getattr(sg, name)


def test_an_ide_infers_every_public_name_from_the_source():
    jedi = pytest.importorskip("jedi")
    names = sg.__all__
    script = jedi.Script("import spikeguard as sg\n" + "\n".join(f"sg.{n}" for n in names),
                         project=jedi.Project(ROOT, sys_path=[str(ROOT / "src")],
                                              smart_sys_path=False))
    for line, name in enumerate(names, start=2):
        obj = getattr(sg, name)
        expected = (obj.__name__ if isinstance(obj, type(sg))
                    else f"{obj.__module__}.{obj.__qualname__}")
        inferred = [d.full_name for d in script.infer(line, len(f"sg.{name}"))]
        assert inferred == [expected], (name, inferred)


def test_import_spikeguard_imports_nothing_else():
    code = ("import sys; before = set(sys.modules); import spikeguard; "
            "print(sorted(set(sys.modules) - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.split() == ["['spikeguard']"], out.stdout


_SG = re.compile(r"\bsg\.([A-Za-z_]\w*)")
_FROM = re.compile(r"from spikeguard import (?:\(([^)]*)\)|([\w, ]+))")
_TOP = re.compile(r"\bspikeguard\.([A-Za-z_]\w*)\b(?!\.)")


def _texts() -> dict[str, str]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "examples").glob("*.py")), *sorted(PKG.rglob("*.py")),
             *sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths if p != Path(__file__)}


def test_readme_docs_examples_and_code_use_only_public_names_at_the_top_level():
    public = set(sg.__all__) | {"__version__", "__all__", "__file__"}
    units = {p.stem for p in PKG.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    bad = []
    for where, text in _texts().items():
        bad += [f"{where}: sg.{n}" for n in _SG.findall(text) if n not in public]
        for names in map("".join, _FROM.findall(text)):
            bad += [f"{where}: from spikeguard import {n}" for n in re.split(r"[,\s]+", names)
                    if n and n not in public and n not in units]
        if where.endswith(".md") or where.startswith("examples"):
            bad += [f"{where}: spikeguard.{n}" for n in _TOP.findall(text)
                    if n not in public and n not in units]
    assert not bad, "not in the public face (import them from their modules):\n" + "\n".join(bad)
