"""The algorithm table (giftcomm.algorithms) is the one list of algorithms: the
runners, the reduce-scatters, the reference simulations, the accepted ``algorithm=`` values and
the cost model all name exactly its rows, and every row's formulas evaluate."""
from __future__ import annotations

import math

import numpy as np
import pytest

import giftcomm as gc
from giftcomm import algorithms
from giftcomm.algorithms import AUTO, BY_NAME, CHOICES, CODES, NAMES, SCATTER_CHOICES, TABLE
from giftcomm.collectives import runners
from giftcomm.cost import model as costmodel
from giftcomm.cost.model import Calibration, Topology
from giftcomm.formats import get_format
from giftcomm.options import CallOptions
from giftcomm.reference import simulate

E4M3 = get_format("e4m3")  # the cost and byte formulas take the Format


@pytest.mark.parametrize("name", NAMES)
def test_every_row_carries_its_runners_and_simulations(name):
    """A built-in row names its code by "module:function" (the table imports nothing above it);
    each resolves to a function of the floor it names, the reduce-scatter pieces exactly for the
    rows with ``scatter``."""
    row = BY_NAME[name]
    pieces = ("runner", "simulation") + (("scatter_runner", "scatter_simulation") if row.scatter else ())
    for piece in pieces:
        ref = getattr(row, piece)
        assert isinstance(ref, str) and ref.startswith(("giftcomm.collectives.", "giftcomm.reference.simulate:"))
        assert callable(row.part(piece)) and row.part(piece) is row.part(piece)
    assert row.part("runner") is runners.runner_of(row) and row.part("simulation").__module__ == simulate.__name__
    if not row.scatter:
        assert row.scatter_runner is None and row.scatter_simulation is None


@pytest.mark.parametrize("name", NAMES)
def test_a_row_the_jit_path_runs_names_its_schedule_and_message_count(name):
    """A row with a jit schedule (giftcomm.adapters.jax.jit) names it by reference and counts its
    chunk messages; on equal chunks those messages are the bytes its row says each rank sends
    (``sent_bytes``), on every rank and any P."""
    row = BY_NAME[name]
    assert (row.jit_scatter is None) == (row.chunk_messages is None)
    if row.jit_scatter is None:
        return
    assert row.scatter and isinstance(row.jit_scatter, str) and row.jit_scatter.startswith("giftcomm.adapters.")
    for p in range(2, 9):
        for fmt, block in (("e4m3", 32), ("mxfp4", 32), ("bf16", 16)):
            n = p * block * 3
            one = gc.message_nbytes(n // p, fmt, block)
            f = get_format(fmt)
            assert {row.sent_bytes(n, p, r, f, block) for r in range(p)} == {row.chunk_messages(p) * one}
    from giftcomm.adapters.jax import jit as jax_jit

    assert row.part("jit_scatter").__module__ == jax_jit.__name__ and name in jax_jit.jit_algorithms()


def test_the_name_lists_are_the_table():
    assert len(NAMES) == len(set(NAMES)) == len(TABLE)
    assert set(SCATTER_CHOICES) - {AUTO} == {a.name for a in TABLE if a.scatter}
    assert CHOICES == (AUTO, *NAMES) and gc.api.ALGORITHMS == CHOICES and list(CHOICES[1:]) == list(NAMES)


def test_codes_are_fixed_distinct_and_cover_every_choice():
    assert CODES == {"auto": 0, "ring": 1, "direct": 2, "doubling": 3, "hierarchical": 4, "hierarchical_direct": 5,
                     "oneshot": 6, "native": 7}  # they travel in the agreed signature: never renumber
    assert set(CODES) == set(CHOICES) and len(set(CODES.values())) == len(CODES)
    assert all(algorithms.BY_CODE[a.code] is a for a in TABLE)


@pytest.mark.parametrize("name", NAMES)
def test_every_rows_formulas_evaluate(name):
    row = BY_NAME[name]
    cal = Calibration()
    for topo in (Topology(1, 1, 1), Topology(2, 1, 2), Topology(5, 1, 5), Topology(8, 2, 4), Topology(6, 3, 2)):
        multi_node = topo.nodes > 1 and topo.local_size > 1
        for n in (1, 1000, 1 << 22):
            t = costmodel.predict(name, n, topo, E4M3, 256, cal)
            assert t > 0 and (math.isfinite(t) or (row.needs_nodes and not multi_node)), (topo, n, t)
        growth = costmodel.error_growth(name, topo)
        assert 1.0 <= growth <= topo.ranks + 1 and math.isfinite(growth)
        q = costmodel.quantizations(name, topo)
        assert isinstance(q, int) and 1 <= q <= topo.ranks + 2
        if row.steps is not None and topo.ranks > 1:
            assert isinstance(row.steps(topo.ranks), int) and row.steps(topo.ranks) >= 1
    # more bytes never cost less
    topo = Topology(4, 1, 4)
    times = [costmodel.predict(name, n, topo, E4M3, 256, cal) for n in (1 << 10, 1 << 16, 1 << 22)]
    assert times == sorted(times)


def test_unknown_names_raise_listing_the_table():
    for call in (lambda: costmodel.predict("nonsense", 10, Topology(2, 1, 2), E4M3),
                 lambda: costmodel.error_growth("nonsense", Topology(2, 1, 2)),
                 lambda: CallOptions.of(algorithm="nonsense")):
        with pytest.raises(ValueError, match="nonsense") as info:
            call()
        assert all(name in str(info.value) for name in NAMES)


def test_every_choice_is_a_valid_option_and_auto_picks_a_row():
    for name in CHOICES:
        assert CallOptions.of(algorithm=name).algorithm == name
    for topo in (Topology(2, 1, 2), Topology(8, 2, 4), Topology(16, 4, 4)):
        for n in (16, 1 << 14, 1 << 24):
            pick = costmodel.choose(n, topo, E4M3, 256, Calibration())
            assert BY_NAME[pick].auto


def test_the_engine_runs_every_row_as_its_simulation(rng):
    """One call of every row through the engine's runner table equals that row's simulation."""
    p, n = 4, 333
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    for name in NAMES:
        outs = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, algorithm=name, local_size=2,
                                                              block=32))
        want = simulate.simulate_allreduce(xs, block=32, algorithm=name, local_size=2)
        assert all(o.tobytes() == w.tobytes() for o, w in zip(outs, want)), name


def test_the_name_lists_are_read_only():
    for live in (NAMES, CHOICES, SCATTER_CHOICES, TABLE):
        for change in (lambda v: v.append("x"), lambda v: v.__setitem__(0, "x"), lambda v: v.clear()):
            with pytest.raises(TypeError, match="read-only"):
                change(live)
    assert CHOICES[0] == AUTO and len(CHOICES) == len(NAMES) + 1
