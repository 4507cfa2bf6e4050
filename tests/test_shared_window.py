"""The zero-copy allreduce over a shared window (giftcomm.collectives.shared), on loopback ranks.

The loopback transport offers a shared window when asked (LoopbackGroup(P, shared_memory=True));
every result must equal the reference simulation and the message path bit for bit, and the
window must be reused, grown and kept race-free across calls. Every format of the table runs
through every algorithm with a shared-window path (the reduce-scatter rows), twice, as a
covering design (P and the size rotating), both roundings.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import FORMAT_NAMES, SCALED_FORMATS, SCATTER_ALGORITHMS, block_for, covering

import giftcomm as gc
from giftcomm.collectives import shared
from giftcomm.collectives.wire import Wire
from giftcomm.formats import FORMATS, get_format
from giftcomm.reference import simulate_allreduce
from giftcomm.transport.shared_window import ENV_SWITCH, enabled_by_env, grown_size, shm_room


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def run_shared(p, fn):
    return gc.LoopbackGroup(p, shared_memory=True).run(fn)


@pytest.fixture
def shared_calls(monkeypatch):
    """Counts the calls that took the shared-window path (the engine calls the module)."""
    calls = []
    real = shared.allreduce

    def spy(*args, **kwargs):
        calls.append(kwargs.get("direct"))
        return real(*args, **kwargs)

    monkeypatch.setattr(shared, "allreduce", spy)
    return calls


# every format x every shared-window algorithm, twice, P and the size rotating (conftest.covering)
WINDOW_CASES = (covering(FORMAT_NAMES, SCATTER_ALGORITHMS, [1, 2, 3, 4, 5, 8], [1, 7, 300, 4099, 70001])
                + covering(FORMAT_NAMES, SCATTER_ALGORITHMS, [5, 8, 3, 2, 4, 1], [4099, 300, 70001, 7, 1]))


@pytest.mark.parametrize("fmt, algorithm, p, n", WINDOW_CASES)
def test_equals_simulation_and_takes_the_shared_path(rng, shared_calls, fmt, algorithm, p, n):
    xs = [(rng.standard_normal(n) * 10.0 ** rng.integers(-4, 4)).astype(np.float32) for _ in range(p)]
    block = block_for(fmt, 64)
    unit = FORMATS[fmt].slice_unit(FORMATS[fmt].fixed_block or 64)
    slice_elems = int(rng.choice([unit, 10 * unit, 1 << 18]))
    rounding, seed = ("stochastic", int(rng.integers(2**63))) if fmt in SCALED_FORMATS and n % 2 else ("nearest", None)
    outs = run_shared(p, lambda t: gc.allreduce(xs[t.rank], comm=t, fmt=fmt, block=block, algorithm=algorithm,
                                                slice_elems=slice_elems, rounding=rounding, seed=seed))
    want = simulate_allreduce(xs, fmt, block, "sum", algorithm, rounding=rounding, seed=seed)
    assert all(same_bytes(o, w) for o, w in zip(outs, want))
    assert shared_calls == [algorithm == "direct"] * p


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("algorithm", SCATTER_ALGORITHMS)
def test_dtypes_ops_and_out(rng, dtype, op, algorithm):
    p = 3
    xs = [rng.standard_normal((37, 29)).astype(dtype) for _ in range(p)]
    want = simulate_allreduce(xs, op=op, block=32, algorithm=algorithm)

    def body(t):
        fresh = gc.allreduce(xs[t.rank], comm=t, op=op, block=32, algorithm=algorithm)
        out = np.full_like(xs[t.rank], 7)
        given = gc.allreduce(xs[t.rank], comm=t, op=op, block=32, algorithm=algorithm, out=out)
        inplace = xs[t.rank].copy()
        gc.allreduce(inplace, comm=t, op=op, block=32, algorithm=algorithm, out=inplace)
        return fresh, given is out and out, inplace

    for (fresh, given, inplace), w in zip(run_shared(p, body), want):
        assert same_bytes(fresh, w) and same_bytes(given, w) and same_bytes(inplace, w)


def test_inputs_are_not_modified(rng):
    xs = [rng.standard_normal(5000).astype(np.float32) for _ in range(4)]
    copies = [x.copy() for x in xs]
    run_shared(4, lambda t: gc.allreduce(xs[t.rank], comm=t))
    assert all(same_bytes(x, c) for x, c in zip(xs, copies))


def test_window_is_reused_grown_and_results_stay_exact_across_calls(rng):
    """Sizes go up and down between calls, algorithms alternate: every call must match the
    simulation (a missing fence shows up as a stale or half-written message), and the window is
    reallocated only when a call needs more than it has."""
    p = 4
    sizes = [5000, 300, 300000, 7000, 300000, 1000000, 10]
    algos = SCATTER_ALGORITHMS * 4
    plan = [(n, a, [rng.standard_normal(n).astype(np.float32) for _ in range(p)]) for n, a in zip(sizes, algos)]

    def body(t):
        results, windows = [], []
        for _n, algorithm, xs in plan:
            results.append(gc.allreduce(xs[t.rank], comm=t, algorithm=algorithm, slice_elems=2048))
            windows.append(t.shared_window(0))
        return results, windows

    outs = run_shared(p, body)
    for i, (n, algorithm, xs) in enumerate(plan):
        want = simulate_allreduce(xs, algorithm=algorithm)
        assert all(same_bytes(outs[r][0][i], want[r]) for r in range(p)), (n, algorithm)
    windows = outs[0][1]
    assert windows[0] is windows[1]  # 300 values fit in the window made for 5000
    assert windows[2] is not windows[1] and windows[2].nbytes >= windows[1].nbytes
    assert windows[3] is windows[2] and windows[4] is windows[2]
    assert windows[5] is not windows[4] and windows[6] is windows[5]
    # every rank sees the same partner views
    assert all(outs[r][1][-1].views[q] is outs[0][1][-1].views[q] for r in range(p) for q in range(p))


def test_nan_in_one_block_stays_in_that_block(rng):
    xs = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
    xs[2][1500] = np.nan
    for algorithm in SCATTER_ALGORITHMS:
        outs = run_shared(3, lambda t: gc.allreduce(xs[t.rank], comm=t, algorithm=algorithm))
        for y, w in zip(outs, simulate_allreduce(xs, algorithm=algorithm)):
            assert same_bytes(y, w)
            assert np.all(np.isnan(y[1280:1536])) and np.all(np.isfinite(y[:1280])) and np.all(np.isfinite(y[1536:]))


def test_other_algorithms_and_collectives_keep_the_message_path(rng, shared_calls):
    xs = [rng.standard_normal(4099).astype(np.float32) for _ in range(4)]
    outs = run_shared(4, lambda t: gc.allreduce(xs[t.rank], comm=t, algorithm="doubling"))
    assert all(same_bytes(o, w) for o, w in zip(outs, simulate_allreduce(xs, algorithm="doubling")))
    run_shared(4, lambda t: gc.allgather(gc.reduce_scatter(xs[t.rank], comm=t), comm=t))
    assert shared_calls == []


def test_ranks_that_disagree_on_shared_memory_raise_alike(rng):
    """One rank with the window, one without: the agreement step catches it on both ranks."""
    group = gc.LoopbackGroup(2, shared_memory=True)
    group.transports[1].shared_memory = False
    x = rng.standard_normal(100).astype(np.float32)
    errors = []

    def body(t):
        try:
            gc.allreduce(x, comm=t)
        except ValueError as exc:
            errors.append(str(exc))

    group.run(body)
    assert len(errors) == 2 and errors[0] == errors[1] and "disagree on shared_memory" in errors[0]


def test_message_only_transports_have_no_window():
    t = gc.LoopbackGroup(1).transports[0]
    assert t.shared_memory is False and t.shared_window(100) is None
    wire = Wire.of(get_format("e4m3"), 256)
    assert shared.allreduce(t, np.zeros(4, np.float32), np.array([0, 4]), wire, np.dtype(np.float32), 256) is None


def test_shm_room(tmp_path):
    ok, free = shm_room(1, str(tmp_path))
    assert ok and free > 0
    assert not shm_room(free + (1 << 40), str(tmp_path))[0]
    assert shm_room(1 << 60, str(tmp_path / "missing"))[0]  # no such file system: not our check to make


def test_env_switch_and_window_rounding(monkeypatch):
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    assert enabled_by_env()
    for off in ("0", "off", "False", " no "):
        monkeypatch.setenv(ENV_SWITCH, off)
        assert not enabled_by_env()
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert enabled_by_env()
    assert grown_size(1) == 1 << 16 and grown_size((1 << 16) + 1) == 2 << 16 and grown_size(3 << 16) == 3 << 16
