"""The plain call goes one way down: api -> the plans (giftcomm.plans: the plan cache and the
persistent plans, one floor) -> the engine -> everything below (the algorithms, agreement, codec, transport), each floor calling only floors
below it (docs/architecture.md, "Floors of a call").

Two checks: the imports (:func:`test_no_floor_imports_one_above_it`: every import statement of a
floor's module, the late ones inside functions included, names only floors below; and no module
below the engine imports a floor at all), and the calls themselves
(:func:`test_plain_calls_never_call_upwards`: the functions a plain allreduce, reduce_scatter and
allgather run, first and repeated, traced with ``sys.setprofile``; a call from one floor into a
function of a floor above it, a callback included, fails).

Run as a script under MPI it prints the moves of the plain calls between floors (the counts
docs/architecture.md reports)::

    mpiexec -n 2 env PYTHONPATH=$PWD python tests/test_call_path.py
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
from test_import_graph import from_target

PKG = Path(__file__).resolve().parents[1] / "giftcomm"
FLOORS = {"giftcomm.api": 3, "giftcomm.plans.cache": 2, "giftcomm.plans.persistent": 2, "giftcomm.collectives.engine": 1}
"""The floors of a plain call, top down; every other giftcomm module it reaches is floor 0."""


def floor(module: str) -> int:
    return FLOORS.get(module, 0)


def _module_of(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(PKG.parent).with_suffix("")
    is_pkg = rel.name == "__init__"
    return ".".join(rel.parts[:-1] if is_pkg else rel.parts), is_pkg


def imports(path: Path, module_level_only: bool) -> set[str]:
    """The giftcomm modules ``path`` imports (``from pkg import sub`` counts as the submodule;
    ``module_level_only``: skip imports inside functions, classes and ``if TYPE_CHECKING:``)."""
    module, is_pkg = _module_of(path)
    tree = ast.parse(path.read_text())
    if module_level_only:
        todo, nodes = list(tree.body), []
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                nodes.append(node)
            elif isinstance(node, ast.If):
                todo += ([] if "TYPE_CHECKING" in ast.unparse(node.test) else node.body) + node.orelse
            elif isinstance(node, (ast.Try, ast.With)):
                todo += getattr(node, "body", []) + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    else:
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
            continue
        target = from_target(module, is_pkg, node)
        subs = {f"{target}.{a.name}" for a in node.names if _exists(f"{target}.{a.name}")}
        found |= subs
        if len(subs) < len(node.names) and target != "giftcomm":  # names defined in the package module itself
            found.add(target)
    return {m for m in found if m.startswith("giftcomm.") and _exists(m) and m != module}


def _exists(module: str) -> bool:
    path = PKG.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _path(module: str) -> Path:
    path = PKG.parent.joinpath(*module.split("."))
    return path / "__init__.py" if (path / "__init__.py").exists() else path.with_suffix(".py")


def below_the_floors() -> set[str]:
    """Every module the floors' modules import at module level, transitively, but the floors."""
    seen: set[str] = set()
    todo = list(FLOORS)
    while todo:
        for dep in imports(_path(todo.pop()), module_level_only=True):
            if dep not in seen and dep not in FLOORS:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_floor_imports_one_above_it():
    bad = [f"{m} imports {dep}" for m in FLOORS for dep in imports(_path(m), module_level_only=False)
           if floor(dep) > floor(m)]
    below = below_the_floors()
    assert "giftcomm.collectives.call" in below and "giftcomm.codec" in below  # the walk sees the floors' imports
    bad += [f"{m} imports {dep}" for m in sorted(below) for dep in imports(_path(m), module_level_only=False)
            if dep in FLOORS]
    assert not bad, f"imports reaching up the floors of a call: {bad}"


# ----------------------------------------------------------------------------- the calls themselves


def trace(fn: Callable[[], Any]) -> tuple[list[str], list[tuple[str, str, str]]]:
    """Run ``fn()`` on this thread under ``sys.setprofile``: (the giftcomm modules control passes
    through, consecutive repeats merged, calls and returns alike; every call from one giftcomm
    module into a Python function of another as (caller module, callee module, function name)).
    A call's caller is the nearest giftcomm frame below it (through NumPy or the standard library)
    inside ``fn``."""
    path: list[str] = []
    calls: list[tuple[str, str, str]] = []

    here = sys._getframe()  # the frames below it (the caller of trace) are not the call's

    def home(frame: Any) -> str | None:
        while frame is not None and frame is not here:
            name = frame.f_globals.get("__name__", "")
            if name.startswith("giftcomm"):
                return name
            frame = frame.f_back
        return None

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            callee = frame.f_globals.get("__name__", "")
            if not callee.startswith("giftcomm"):
                return
            caller = home(frame.f_back)
            if caller is not None and caller != callee:
                calls.append((caller, callee, frame.f_code.co_name))
            if not path or path[-1] != callee:
                path.append(callee)
        elif event == "return":
            back = home(frame.f_back)
            if back is not None and path and path[-1] != back:
                path.append(back)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return path, calls


def floor_moves(path: list[str], calls: list[tuple[str, str, str]]) -> dict[str, Any]:
    """The counts of the plain calls' path: along the path (calls and returns alike), the moves
    between the floors of :data:`FLOORS` (visits below them left out, a run on one floor
    counted once) and how many of them go back up; the calls between floors, those that skip a
    floor going down (e.g. api -> engine) and the upward ones (into a floor above the caller's,
    e.g. a callback)."""
    floors = [floor(m) for m in path if floor(m)]
    merged = [f for i, f in enumerate(floors) if i == 0 or f != floors[i - 1]]
    return {"floor moves": len(merged) - 1, "moves up": sum(b > a for a, b in zip(merged, merged[1:])),
            "calls between floors": sum(floor(a) != floor(b) for a, b, _ in calls),
            "skips": sorted({f"{a} -> {b}.{f}" for a, b, f in calls if floor(b) and floor(a) - floor(b) > 1}),
            "upward calls": sorted({f"{a} -> {b}.{f}" for a, b, f in calls if floor(b) > floor(a)}),
            "floor path": " -> ".join(str(f) for f in merged)}


def plain_calls(comm: Any, rank: int) -> list[tuple[str, Callable[[], Any]]]:
    """The plain calls traced: 1 KiB of float32, each first (planned, agreed) and repeated (cached)."""
    import giftcomm as gc

    x = np.random.default_rng(rank).standard_normal(256).astype(np.float32)
    z = np.random.default_rng(99).standard_normal((2, 16, 16))  # alike on every rank
    geometry = gc.Geometry.from_kfac([("w", (16, 16))], {"w": (z[0] @ z[0].T + np.eye(16), z[1] @ z[1].T + np.eye(16))})
    return [("allreduce, first", lambda: gc.allreduce(x, comm=comm)),
            ("allreduce, repeated", lambda: gc.allreduce(x, comm=comm)),
            ("gift_allreduce without geometry, repeated", lambda: gc.gift_allreduce(x, comm=comm)),
            ("gift_allreduce with a geometry", lambda: gc.gift_allreduce(x, geometry, comm=comm)),
            ("reduce_scatter, first", lambda: gc.reduce_scatter(x, comm=comm)),
            ("reduce_scatter, repeated", lambda: gc.reduce_scatter(x, comm=comm)),
            ("allgather, first", lambda: gc.allgather(x[:64], comm=comm)),
            ("allgather, repeated", lambda: gc.allgather(x[:64], comm=comm))]


def test_plain_calls_never_call_upwards():
    import giftcomm as gc

    def body(t: Any) -> list[tuple[str, dict[str, Any], int]]:
        out = []
        for what, fn in plain_calls(t, t.rank):
            path, calls = trace(fn)  # each rank's thread traces itself
            out.append((what, floor_moves(path, calls), len(t.state.plan_cache)))
        return out

    for rank_result in gc.LoopbackGroup(2, shared_memory=True).run(body):
        for what, moves, _cached in rank_result:
            assert moves["calls between floors"] > 0, what  # the trace sees the calls
            assert not moves["upward calls"], (what, moves["upward calls"])
            assert not moves["skips"], (what, moves["skips"])
            assert moves["floor path"].startswith("3 -> 2"), (what, moves["floor path"])
        assert rank_result[-1][2] >= 3  # the repeated calls ran cached plans (allreduce, reduce_scatter, allgather)


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    for what, fn in plain_calls(comm, comm.rank):
        path, calls = trace(fn)
        moves = floor_moves(path, calls)
        if comm.rank == 0:
            print(f"{what}: {moves['floor moves']} moves between the floors ({moves['moves up']} back up): "
                  f"{moves['floor path']}; {len(path) - 1} moves between modules; "
                  f"{moves['calls between floors']} calls between floors; upward calls {moves['upward calls']}; "
                  f"calls skipping a floor {moves['skips']}")

if __name__ == "__main__":
    main()
