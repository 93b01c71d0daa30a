"""The package is layered: a module imports only from lower layers or from its own package, so
there are no import cycles between packages and nothing imports upward. docs/design.md draws the
same map; this test keeps it true."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "spikeguard"

LAYERS = {
    "_validate": 0, "_dist": 0, "record": 0, "readback": 0, "_config_cli": 0, "_crash": 0,
    "prevent": 1, "data": 1, "testing": 1, "sinks": 1,
    "detect": 2, "model": 2, "schedules": 2,
    "detector": 3, "checkpoint": 3,
    "guard": 4,
    "train": 5, "diagnose": 5, "integrations": 5,
    "sandbox": 6,
    "cli": 7, "__init__": 7, "__main__": 7,
}


def _unit(parts: tuple[str, ...]) -> str:
    """The top-level unit of a module path inside the package (a subpackage or a module)."""
    return parts[0].removesuffix(".py")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level unit) of every spikeguard import in ``path``, lazy ones included."""
    rel = path.relative_to(PKG).parts
    depth = len(rel) - 1  # how many packages deep the module sits below spikeguard
    out = []
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING"
                   for n in ast.walk(node)}  # annotations only: not an import at run time
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb to the spikeguard root
                base = list(rel[:-1])[: max(0, depth - (node.level - 1))]
                target = [*base, *(node.module.split(".") if node.module else [])]
                if not target:  # "from .. import x": x are units themselves
                    out += [(node.lineno, a.name) for a in node.names]
                    continue
                out.append((node.lineno, target[0]))
            elif node.module and node.module.split(".")[0] == "spikeguard":
                parts = node.module.split(".")
                out += ([(node.lineno, parts[1])] if len(parts) > 1
                        else [(node.lineno, a.name) for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "spikeguard" and len(parts) > 1:
                    out.append((node.lineno, parts[1]))
    return out


def test_every_unit_has_a_layer():
    units = {_unit(p.relative_to(PKG).parts) for p in PKG.rglob("*.py")}
    assert units <= set(LAYERS), f"give these a layer in tests/test_layers.py: {units - set(LAYERS)}"


def test_nothing_imports_upward_or_sideways():
    bad = []
    for path in PKG.rglob("*.py"):
        own = _unit(path.relative_to(PKG).parts)
        for line, target in _imports(path):
            if target == own or target not in LAYERS:
                continue
            if LAYERS[target] >= LAYERS[own] and own not in ("__init__", "__main__"):
                bad.append(f"{path.relative_to(PKG)}:{line} imports {target} "
                           f"(layer {LAYERS[target]} >= {LAYERS[own]})")
    assert not bad, "\n".join(bad)


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these (STYLE: 100-400 lines a module): {long}"
