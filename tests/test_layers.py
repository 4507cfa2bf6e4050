"""The package's layering, read from the source: no import cycles inside giftcomm/ (module-level
or lazy, inside functions), no module reading another module's private names, and no module but
the call face (giftcomm.api) and the plans (giftcomm.plans) calling the engine's entries."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "giftcomm"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` inside ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    base = base[: len(base) - level + (1 if is_package else 0)]
    return ".".join(base + ([target] if target else []))


def _sources() -> dict[str, tuple[ast.Module, bool]]:
    return {_module_name(p): (ast.parse(p.read_text()), p.name == "__init__.py") for p in PKG.rglob("*.py")}


def import_graph(sources: dict[str, tuple[ast.Module, bool]] | None = None,
                 ) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """(edges: module -> giftcomm modules it imports, private: (module, name) pairs where a module
    imports or reads another module's underscore name). ``sources``: module name -> (parsed
    source, is a package); default: the installed tree."""
    sources = _sources() if sources is None else sources
    names = set(sources)
    edges: dict[str, set[str]] = {m: set() for m in names}
    private: list[tuple[str, str]] = []
    for mod, (tree, is_pkg) in sources.items():
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("giftcomm"):
                        edges[mod].add(a.name if a.name in names else a.name.rsplit(".", 1)[0])
                        aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, is_pkg, node.level, node.module)
                if not src.startswith("giftcomm"):
                    continue
                for a in node.names:
                    full = f"{src}.{a.name}"
                    if full in names:
                        edges[mod].add(full)
                        aliases[a.asname or a.name] = full
                    else:
                        edges[mod].add(src)
                        if a.name.startswith("_") and not a.name.startswith("__") and src != mod:
                            private.append((mod, full))
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = aliases.get(node.value.id)
                if target and node.attr.startswith("_") and not node.attr.startswith("__") and target != mod:
                    private.append((mod, f"{target}.{node.attr}"))
    for mod in edges:
        edges[mod].discard(mod)
        # importing a submodule runs its package's __init__ first: not a cycle of this module's own
        edges[mod] = {e for e in edges[mod] if not mod.startswith(e + ".")}
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return found


def test_no_import_cycles_inside_giftcomm():
    edges, _ = import_graph()
    assert len(edges) > 30 and edges["giftcomm.api"]  # the graph was read
    assert _cycles(edges) == []


def test_no_module_reads_another_modules_private_names():
    _, private = import_graph()
    # the C extension is the codec's own and holds the plan channel's native part
    allowed = {("giftcomm.codec", "giftcomm._codec_native"), ("giftcomm.transport.channel", "giftcomm._codec_native")}
    assert [p for p in private if p not in allowed] == []


def test_the_checker_finds_a_planted_cycle_and_private_reads():
    """The checks above can fail: a lazy import that closes a cycle, a private import and a
    private attribute read, planted in a small fake package, are all reported."""
    planted = {
        "giftcomm": (ast.parse(""), True),
        "giftcomm.api": (ast.parse("from .plan import check\nimport giftcomm.plan as plan\nplan._table\n"), False),
        "giftcomm.plan": (ast.parse("def f():\n    from .api import _finish\n"), False),
    }
    edges, private = import_graph(planted)
    assert _cycles(edges) == [["giftcomm.api", "giftcomm.plan", "giftcomm.api"]]
    assert sorted(private) == [("giftcomm.api", "giftcomm.plan._table"), ("giftcomm.plan", "giftcomm.api._finish")]


ENGINE = "giftcomm.collectives.engine"
ENTRIES = ("execute", "agree_call")
"""The engine's entries: a whole call (validate, agree, run, finish) and its agreement."""
ENTRY_CALLERS = ("giftcomm.api", "giftcomm.plans")
"""The call face and the plans floor (docs/architecture.md, "Floors of a call")."""


def engine_entry_uses(sources: dict[str, tuple[ast.Module, bool]] | None = None) -> list[tuple[str, str]]:
    """(module, entry) for every module that reaches one of the engine's :data:`ENTRIES` (an
    attribute of the engine module by any alias, or the name imported from it), the engine
    itself aside. ``sources``: as :func:`import_graph`'s."""
    sources = _sources() if sources is None else sources
    found: list[tuple[str, str]] = []
    for mod, (tree, is_pkg) in sources.items():
        if mod == ENGINE:
            continue
        aliases: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.name == ENGINE and a.asname}
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, is_pkg, node.level, node.module)
                for a in node.names:
                    if f"{src}.{a.name}" == ENGINE:
                        aliases.add(a.asname or a.name)
                    elif src == ENGINE and a.name in ENTRIES:
                        found.append((mod, a.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ENTRIES:
                base = ast.unparse(node.value)
                if base in aliases or base == ENGINE:
                    found.append((mod, node.attr))
    return sorted(set(found))


def _outside_the_call_face(uses: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(m, e) for m, e in uses if not any(m == c or m.startswith(c + ".") for c in ENTRY_CALLERS)]


def test_only_the_call_face_and_the_plans_call_the_engines_entries():
    """Every call without a plan goes one way down, api -> the plans -> the engine: no other
    module starts a call at the engine (an adapter, a feature, a shim below the plans)."""
    uses = engine_entry_uses()
    assert ("giftcomm.plans.cache", "execute") in uses and ("giftcomm.plans.persistent", "agree_call") in uses
    assert _outside_the_call_face(uses) == []


def test_the_entry_check_finds_planted_calls():
    """The check above can fail: an attribute call through an alias, a name imported from the
    engine and a dotted call by the full name, planted outside the call face, are all reported;
    the plans' own call is not."""
    planted = {
        "giftcomm.plans.cache": (ast.parse("from ..collectives import engine\nengine.execute()\n"), False),
        "giftcomm.adapters.x": (ast.parse("from ..collectives import engine as e\ne.execute()\n"), False),
        "giftcomm.feedback": (ast.parse("from .collectives.engine import agree_call\n"), False),
        "giftcomm.geometry.sync": (ast.parse("import giftcomm.collectives.engine\n"
                                             "giftcomm.collectives.engine.agree_call()\n"), False),
    }
    assert _outside_the_call_face(engine_entry_uses(planted)) == [
        ("giftcomm.adapters.x", "execute"), ("giftcomm.feedback", "agree_call"), ("giftcomm.geometry.sync", "agree_call")]


def test_every_environment_variable_is_in_the_docs_table():
    """docs/api.md's table lists exactly giftcomm.config's variables, and no module reads a
    GIFTCOMM_ variable around the config module."""
    import re

    from giftcomm import config

    doc = (PKG.parent / "docs" / "api.md").read_text()
    table = set(re.findall(r"^\| `(GIFTCOMM_[A-Z_]+)` \|", doc, flags=re.M))
    assert table == set(config.VARIABLES)
    for path in PKG.rglob("*.py"):
        if path.name != "config.py":
            assert not re.search(r"environ(\.get)?[\[(]\s*[\"']GIFTCOMM_", path.read_text()), path


# ----------------------------------------------------------------------------- floors

FLOORS: dict[str, int] = {
    # the tables and the plumbing under everything
    "adaptive": 0,                              # the adaptive rows' rules, under the format table
    "formats": 1, "config": 1, "errors": 1,
    "algorithms": 2, "formats_header": 2,       # the algorithm table (+ machine records, shard layout); the C view of the formats
    "cost": 3, "cuda": 3, "options": 3,         # the cost model; the codec's CUDA kernels; the call options
    "_xp": 4, "reference": 4,                   # the array backend (device arithmetic: cuda); the NumPy ground truth
    "codec": 5,
    "transport": 6,
    "accounting": 7, "geometry": 7,
    "collectives": 8,
    "plans": 9,
    "api": 10,
    "adapters": 11,
    "perf": 12, "recipes": 12,
}
"""The rooms of giftcomm (its top-level modules and subpackages; the package's own __init__, a face,
is none) and their floors: a room imports, lazily or not, only rooms on lower floors
(docs/architecture.md draws the same floors)."""

UP_ALLOWED: set[tuple[str, str]] = {("giftcomm.geometry.paper", "giftcomm.collectives.agree")}
"""Imports that run back up a floor: one. The paper preset's refresh agrees through the
collectives' agreement (geometry.paper.agree_refresh, a late import)."""


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "giftcomm" and len(parts) > 1 else None


def upward_imports(edges: dict[str, set[str]], floors: dict[str, int]) -> list[tuple[str, str]]:
    """(module, module it imports) pairs between two rooms where the importer's floor is not above
    the imported one's (a room missing from ``floors`` counts as floor 0)."""
    bad = []
    for mod, targets in edges.items():
        here = _room(mod)
        for target in targets:
            there = _room(target)
            if here and there and here != there and floors.get(here, 0) <= floors.get(there, 0):
                bad.append((mod, target))
    return sorted(bad)


def test_every_room_has_a_floor():
    rooms = {p.stem for p in PKG.glob("*.py") if p.name != "__init__.py"} | {
        p.parent.name for p in PKG.glob("*/__init__.py")}
    assert rooms == set(FLOORS), f"rooms without a floor: {sorted(rooms - set(FLOORS))}; " \
                                 f"floors of no room: {sorted(set(FLOORS) - rooms)}"


def test_no_import_runs_back_up_a_floor():
    edges, _ = import_graph()
    assert len(UP_ALLOWED) <= 1
    assert upward_imports(edges, FLOORS) == sorted(UP_ALLOWED)


def test_the_floor_check_finds_a_planted_upward_import():
    """A late import from a ground-floor room into a higher one is reported; the same import
    downward is not."""
    planted = {
        "giftcomm.formats": (ast.parse("def f():\n    from .api import allreduce\n"), False),
        "giftcomm.api": (ast.parse("from .formats import Format\n"), False),
    }
    edges, _ = import_graph(planted)
    assert upward_imports(edges, {"formats": 1, "api": 2}) == [("giftcomm.formats", "giftcomm.api")]
    assert upward_imports(edges, {"formats": 3, "api": 2}) == [("giftcomm.api", "giftcomm.formats")]


# ----------------------------------------------------------------------------- moved modules

def test_the_root_holds_at_most_twelve_modules():
    assert len(list(PKG.glob("*.py"))) <= 12, sorted(p.name for p in PKG.glob("*.py"))


def test_a_moved_module_imports_from_its_old_path_as_the_new_one_with_a_warning():
    """Each old path of giftcomm.MOVED_MODULES (no file left there) imports, in a fresh interpreter,
    as the very module of its new path, with one DeprecationWarning naming both."""
    import subprocess
    import sys

    from giftcomm import MOVED_MODULES

    for old in MOVED_MODULES:
        assert not (PKG.parent / (old.replace(".", "/") + ".py")).exists(), old
    code = ("import importlib, warnings, json\n"
            "from giftcomm import MOVED_MODULES\n"
            "out = {}\n"
            "for old, new in MOVED_MODULES.items():\n"
            "    with warnings.catch_warnings(record=True) as w:\n"
            "        warnings.simplefilter('always')\n"
            "        m = importlib.import_module(old)\n"
            "    msgs = [str(x.message) for x in w if x.category is DeprecationWarning]\n"
            "    out[old] = [m is importlib.import_module(new), msgs]\n"
            "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    import json

    got = json.loads(r.stdout.strip().splitlines()[-1])
    for old, new in MOVED_MODULES.items():
        same, msgs = got[old]
        assert same, old
        assert any(old in m and new in m for m in msgs), (old, msgs)
