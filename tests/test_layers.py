"""The package is layered: a module imports only from lower layers or from its own package, so
there are no import cycles between packages and nothing imports upward. docs/design.md draws the
same map; this test keeps it true."""

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "spikeguard"

LAYERS = {
    "_validate": 0, "_dist": 0, "record": 0, "readback": 0, "_config_cli": 0, "_crash": 0,
    "prevent": 1, "data": 1, "testing": 1, "sinks": 1,
    "measure": 2, "model": 2, "schedules": 2,
    "detector": 3, "checkpoint": 3, "oncall": 3.5,
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


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these by job (STYLE: 100-400 lines a module, 600 at most): {long}"


# -- no import cycle, type hints included ------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the spikeguard modules it imports: every import, lazy ones and those under
    ``if TYPE_CHECKING:`` included (``from pkg import name`` names the module pkg.name when
    there is one, else pkg itself)."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base_name = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    base_name = node.module or ""
                if not base_name.startswith("spikeguard"):
                    continue
                for alias in node.names:
                    sub = f"{base_name}.{alias.name}"
                    edges.add(sub if sub in files else base_name)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
        edges.discard(name)
    return graph


def test_no_import_cycle_even_for_type_hints():
    graph = _module_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# -- short functions -------------------------------------------------------------------------------
MAX_LINES = 60
DESIGN = PKG.parents[1] / "docs" / "design.md"
_ROW = re.compile(r"^\| `([\w/.]+\.py): (\w+)` \| (.+?) \|$", re.M)


def _long_functions() -> dict[str, int]:
    """``path:name`` -> lines of every function in the package over MAX_LINES (ast: end_lineno -
    lineno + 1; the longest where a name repeats in a file)."""
    long: dict[str, int] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    key = f"{rel}:{node.name}"
                    long[key] = max(n, long.get(key, 0))
    return long


def _named_in_design() -> dict[str, str]:
    """``path:name`` -> the reason, from the table of docs/design.md's "Long functions"."""
    text = DESIGN.read_text()
    section = text[text.index("## Long functions"):]
    section = section[:section.index("\n## ", 1)]
    return {f"{rel}:{name}": why.strip() for rel, name, why in _ROW.findall(section)}


def test_every_function_over_60_lines_is_named_in_the_design_with_its_reason():
    named = _named_in_design()
    missing = [f"{k} ({n} lines)" for k, n in _long_functions().items() if k not in named]
    assert not missing, (f"split these (at most {MAX_LINES} lines a function), or name each in "
                         f"docs/design.md's \"Long functions\" table with why: {missing}")
    assert all(len(why) > 20 for why in named.values()), named  # a reason, not a placeholder


def test_the_named_long_functions_still_exist_and_are_long():
    """An exception that no longer applies is removed from docs/design.md's table."""
    long = _long_functions()
    stale = [k for k in _named_in_design() if k not in long]
    assert not stale, f"no longer over {MAX_LINES} lines (or gone): drop them from the table: {stale}"


# -- no private module of another package ------------------------------------------------------
PRIVATE_IMPORTS_ALLOWED = {
    # the `spikeguard diagnose` subcommand's flags and entry point (diagnose/ is reworked apart)
    ("cli.py", "spikeguard.diagnose._cli"),
}


def test_no_module_imports_another_packages_private_module():
    """A subpackage's ``_``-prefixed modules are its own; the top-level ones (``_dist``,
    ``_validate``, ...) are shared by the whole library."""
    graph = _module_graph()
    bad = []
    for name, edges in graph.items():
        rel = str(Path(*name.split(".")[1:])) + ".py" if "." in name else "__init__.py"
        path = PKG / rel if (PKG / rel).exists() else PKG / Path(*name.split(".")[1:]) / "__init__.py"
        own = name.split(".")[1] if name.count(".") >= 1 else None
        for target in edges:
            parts = target.split(".")
            private = [i for i, p in enumerate(parts) if p.startswith("_") and i >= 2]
            if private and parts[1] != own:
                key = (str(path.relative_to(PKG)), target)
                if key not in PRIVATE_IMPORTS_ALLOWED:
                    bad.append(f"{key[0]} imports {target}")
    assert not bad, "\n".join(sorted(bad))


if __name__ == "__main__":  # python tests/test_layers.py: the long functions, named or not
    named = _named_in_design()
    for key, n in sorted(_long_functions().items(), key=lambda kv: -kv[1]):
        print(f"{n:4d}  {key}  {'(named)' if key in named else '(NOT NAMED in docs/design.md)'}")
