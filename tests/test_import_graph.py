"""The import graph between giftcomm's top-level parts has no loops.

A part is a top-level subpackage (giftcomm/collectives/, giftcomm/transport/, ...) or a top-level
module (giftcomm/formats.py, giftcomm/api.py, ...). Part A imports part B when a module of A
imports a module of B at module level (imports inside functions are deliberate late bindings
and are not counted; neither are ``if TYPE_CHECKING:`` blocks). The floors themselves, lazy
imports included, are tests/test_layers.py's table.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "giftcomm"
ALLOWED: set[tuple[str, str]] = set()
"""Loops tolerated for now, as (part, part) pairs: none."""


def _part(module: str) -> str | None:
    """The top-level part of a giftcomm module name ('giftcomm.collectives.ring' -> 'collectives'),
    None for the package itself or a name outside giftcomm."""
    parts = module.split(".")
    if parts[0] != "giftcomm" or len(parts) < 2:
        return None
    return parts[1]


def _module_level_imports(tree: ast.Module):
    """The import statements run at import time: the module body and its try/if/with blocks,
    except ``if TYPE_CHECKING:``."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "TYPE_CHECKING" not in test:
                todo += node.body
            todo += node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.With):
            todo += node.body


def _exists(module: str) -> bool:
    path = PKG.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or path.with_suffix(".pyi").exists() or (path / "__init__.py").exists()


def from_target(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The module a ``from X import ...`` statement of ``module`` (a package's ``__init__`` when
    ``is_pkg``) names: relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, dict[str, list[str]]]:
    """{part: {part it imports: ["module -> module", ...]}}."""
    edges: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        is_pkg = rel.name == "__init__"
        module = ".".join(rel.parts[:-1] if is_pkg else rel.parts)
        here = _part(module)
        if here is None:
            continue
        for node in _module_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                target = from_target(module, is_pkg, node)
                # "from . import ring" imports the module giftcomm.<pkg>.ring
                targets = [target] + [f"{target}.{a.name}" for a in node.names if _exists(f"{target}.{a.name}")]
            for target in targets:
                there = _part(target)
                if there is not None and there != here and _exists(target):
                    edges.setdefault(here, {}).setdefault(there, []).append(f"{module} -> {target}")
    return edges


def loops(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected groups of more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(set(edges) | {w for out in edges.values() for w in out}):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_known_edges():
    """The walk finds imports (so an empty loop list means something)."""
    edges = import_graph()
    assert "formats" in edges.get("algorithms", {})
    assert "algorithms" in edges.get("collectives", {})
    assert "collectives" in edges.get("api", {})


def test_no_loops_between_top_level_parts():
    edges = import_graph()
    bad = []
    for group in loops(edges):
        pairs = {(a, b) for a in group for b in group if b in edges.get(a, {})}
        if not pairs <= ALLOWED:
            bad.append({f"{a} -> {b}": edges[a][b][:2] for a, b in sorted(pairs - ALLOWED)})
    assert not bad, f"import loops between giftcomm's top-level parts: {bad}"


def test_a_loop_is_found():
    assert loops({"a": {"b": ["x"]}, "b": {"c": ["y"]}, "c": {"a": ["z"]}, "d": {"a": ["w"]}}) == [["a", "b", "c"]]


# ----------------------------------------------------------------------------- studies

STUDIES = PKG.parent / "studies"


def studies_graph() -> dict[str, dict[str, list[str]]]:
    """{studies module: {studies module it imports: [line, ...]}}, counting every import statement,
    the ones inside functions included (the studies import each other lazily, so a loop through
    a late import is still a loop)."""
    edges: dict[str, dict[str, list[str]]] = {}
    names = {".".join(p.relative_to(STUDIES.parent).with_suffix("").parts).removesuffix(".__init__")
             for p in STUDIES.rglob("*.py")}
    for path in sorted(STUDIES.rglob("*.py")):
        module = ".".join(path.relative_to(STUDIES.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                if target in names and target != module and target != "studies":
                    edges.setdefault(module, {}).setdefault(target, []).append(f"{module}:{node.lineno}")
    return edges


def test_studies_graph_sees_known_edges():
    edges = studies_graph()
    assert "studies.cases" in edges.get("studies.fidelity", {})
    assert "studies.cases" in edges.get("studies.gradients", {})


def test_no_loops_between_studies_modules():
    edges = studies_graph()
    found = loops(edges)
    assert not found, "import loops between studies modules: " + "; ".join(
        " <-> ".join(group) + f" ({ {a: edges[a] for a in group} })" for group in found)
