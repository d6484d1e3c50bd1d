"""The import direction of DESIGN.md, checked on the source (``ast``, nothing is imported).

Imports run one way, downward:
``cli`` -> ``bench`` (beside it ``harness``, which never imports ``bench``) -> ``route``,
``integrations`` -> ``server`` -> ``store`` ->
``tiers``, ``policies``, ``loader``, ``plan``, ``sim`` -> the ground floor (``keys``, ``entry``,
``config``, ``errors``, ``registry`` and the shared helpers ``buffers``, ``fastcopy``, ``fileio``,
``s3client``, ``output``).

Every ``import`` counts, at module level or inside a function (a lazy import is still a
dependency). A module may import its own package, any lower layer, and a package beside it in
the same layer unless ``APART`` keeps the two apart. Module-level imports must form no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "kvtier"

# area (first name under kvtier) -> layer; higher layers import lower ones, never the reverse
LAYERS = {
    "__main__": 6, "cli": 6,
    "bench": 5, "harness": 5,
    "route": 4, "integrations": 4,
    "server": 3,
    "store": 2,
    "tiers": 1, "policies": 1, "loader": 1, "plan": 1, "sim": 1,
    "keys": 0, "entry": 0, "config": 0, "errors": 0, "registry": 0, "buffers": 0, "fileio": 0,
    "s3client": 0, "output": 0, "codecs": 0, "fp8": 0, "fastcopy": 0, "_ntcopy": 0, "__init__": 0,
}
# packages of one layer that must not know each other (DESIGN.md: "the loader does not know
# the KV store"; the router knows neither vLLM's connector nor the store; the harness the
# benchmarks and tests run on knows no benchmark)
APART = {("loader", "tiers"), ("loader", "policies"), ("route", "integrations"), ("integrations", "route"),
         ("harness", "bench")}

# Upward imports known today (none left). Each entry must still occur, so the list only shrinks.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The kvtier modules an ``from X import a, b`` names (``X.a`` where that is a module)."""
    if node.level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not (target == "kvtier" or target.startswith("kvtier.")):
        return []
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
    return subs or [target]


def _imports(name: str, top_level_only: bool) -> set[str]:
    """kvtier modules ``name`` imports (every import, or only those run when it is imported)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    nodes = _top_level(tree.body) if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name == "kvtier" or a.name.startswith("kvtier.")}
        elif isinstance(node, ast.ImportFrom):
            found |= set(_resolve(name, path.name == "__init__.py", node))
    return found - {name}


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements run at import time: the module body, and the bodies of its if/try blocks
    (not functions or classes' methods, and not ``if TYPE_CHECKING:``)."""
    out: list[ast.stmt] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.If):
            if not (isinstance(stmt.test, ast.Name) and stmt.test.id == "TYPE_CHECKING"):
                out += _top_level(stmt.body) + _top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            out += _top_level(stmt.body) + _top_level(stmt.orelse) + _top_level(stmt.finalbody)
            for handler in stmt.handlers:
                out += _top_level(handler.body)
    return out


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _upward(importer: str, imported: str) -> bool:
    a, b = _area(importer), _area(imported)
    if a == b:
        return False
    return LAYERS[b] > LAYERS[a] or (a, b) in APART


def test_every_area_has_a_layer():
    missing = sorted({_area(m) for m in MODULES} - set(LAYERS))
    assert not missing, f"add these to LAYERS (and to DESIGN.md's order): {missing}"


def test_no_module_imports_upward():
    found = {(m, t) for m in MODULES for t in _imports(m, top_level_only=False) if _upward(m, t)}
    new = sorted(found - KNOWN_UPWARD)
    assert not new, "upward imports (move the shared code down):\n" + "\n".join(f"  {m} -> {t}" for m, t in new)
    gone = sorted(KNOWN_UPWARD - found)
    assert not gone, f"fixed, remove from KNOWN_UPWARD: {gone}"


def test_no_import_cycles():
    graph = {m: {t for t in _imports(m, top_level_only=True) if t in MODULES} for m in MODULES}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_only_the_benchmarks_import_the_harness():
    """``kvtier.harness`` (child processes, real servers) serves ``kvtier.bench`` and the tests;
    no product module (tiers, store, server, router, connector, CLI) depends on it."""
    found = sorted((m, t) for m in MODULES for t in _imports(m, top_level_only=False)
                   if _area(t) == "harness" and _area(m) not in ("harness", "bench"))
    assert not found, "\n".join(f"  {m} -> {t}" for m, t in found)


def test_bench_seed_has_no_cycle_even_through_function_level_imports():
    """``seed`` measures into ``seed_data.Run`` and ``seed_report`` renders it: the report never
    imports the measuring module back, not even inside a function."""
    seed = {m for m in MODULES if m.startswith("kvtier.bench.seed")}
    graph = {m: {t for t in _imports(m, top_level_only=False) if t in seed} for m in seed}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component) + [sorted(component)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", sorted(m for m, p in MODULES.items() if p.name == "__init__.py"))
def test_every_package_says_what_lives_there_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    assert doc, f"{package}: no docstring"
    if package != "kvtier":
        assert "Imports" in doc or "import" in doc, f"{package}: the docstring does not say what it may import"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The test itself: a lazy ``bench -> cli`` import and a relative one are both found."""
    tree = ast.parse("def f():\n    from kvtier.cli._common import note\nfrom ..cli import plan\n")
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    targets = {t for n in nodes for t in _resolve("kvtier.bench.tiers", False, n)}
    assert targets == {"kvtier.cli._common", "kvtier.cli.plan"}
    assert all(_upward("kvtier.bench.tiers", t) for t in targets)
    assert not _upward("kvtier.cli.bench", "kvtier.bench.tiers")
