"""The collectives under mpiexec (run at P = 1..5 by tests/run_all.sh), against the simulation.

Every rank builds all P inputs from one seed broadcast by rank 0, runs its part of the collective,
and checks its output against the single-process simulation, bit for bit; the ranks then compare
digests so the results are also bit-identical across ranks: the home of invariant 1
(tests/README.md). Every format of the table runs through every algorithm, over the shared
window and over MPI messages, as covering designs (each format x algorithm pair at least once
over the runs at P = 1..5 of tests/run_all.sh, the size rotating: conftest.on_this_world).
"""
from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import pytest
from conftest import ALGORITHM_CHOICES, FORMAT_NAMES, SCALED_FORMATS, SCATTER_ALGORITHMS, on_this_world

import giftcomm as gc
from giftcomm.reference import simulate_allreduce, simulate_reduce_scatter
from giftcomm.reference.simulate import resolve_algorithm

pytestmark = pytest.mark.mpi


@pytest.fixture
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture
def shared_rng(comm):
    seed = comm.bcast(int(np.random.SeedSequence().entropy % (2**32)) if comm.rank == 0 else None)
    print(f"shared seed={seed}")
    return np.random.default_rng(seed)


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest() + str(a.dtype) + str(a.shape)


def assert_identical_everywhere(comm, a: np.ndarray) -> None:
    digests = comm.allgather(digest(a))
    assert len(set(digests)) == 1, digests


SIZES = [0, 1, 3, 5, 1000, 65537]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_allreduce_equals_simulation_bit_for_bit(comm, shared_rng, fmt):
    i = FORMAT_NAMES.index(fmt)
    for n in (SIZES[i % len(SIZES)], SIZES[(i + 3) % len(SIZES)]):
        xs = [shared_rng.standard_normal(n).astype(np.float32) for _ in range(comm.size)]
        y = gc.allreduce(xs[comm.rank], comm=comm, fmt=fmt)
        ran = gc.api.last_algorithm(comm)[0]  # auto's choice: on one node it predicts the plan channel
        assert digest(y) == digest(simulate_allreduce(xs, fmt=fmt, algorithm=ran)[comm.rank]), (n, ran)
        assert_identical_everywhere(comm, y)


@pytest.fixture(params=["window", "messages"])
def transport(request, comm):
    """An MpiTransport with the shared window (when every rank is on one node) or without it."""
    from giftcomm.transport.mpi import MpiTransport

    t = MpiTransport(comm, shared_memory=None if request.param == "window" else False)
    yield t
    t.free()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_dtypes_and_ops(transport, shared_rng, dtype, op):
    xs = [shared_rng.standard_normal((33, 17)).astype(dtype) for _ in range(transport.size)]
    for algorithm in SCATTER_ALGORITHMS:
        y = gc.allreduce(xs[transport.rank], comm=transport, op=op, block=64, algorithm=algorithm)
        assert digest(y) == digest(simulate_allreduce(xs, block=64, op=op, algorithm=algorithm)[transport.rank])
        assert_identical_everywhere(transport.comm, y)


@pytest.mark.parametrize("algorithm", SCATTER_ALGORITHMS)
def test_reduce_scatter_then_allgather(comm, shared_rng, algorithm):
    j = SCATTER_ALGORITHMS.index(algorithm)
    for i, fmt in enumerate(FORMAT_NAMES):
        if not (on_this_world(i + j, comm.size) or on_this_world(i + j + 1, comm.size)):
            continue  # the pairs dealt over P = 1..5, each twice
        xs = [shared_rng.standard_normal(10007).astype(np.float32) for _ in range(comm.size)]
        shard = gc.reduce_scatter(xs[comm.rank], comm=comm, fmt=fmt, algorithm=algorithm)
        assert digest(shard) == digest(simulate_reduce_scatter(xs, fmt, None, "sum", algorithm)[comm.rank]), fmt
        full = gc.allgather(shard, comm=comm, fmt=fmt)
        assert digest(full) == digest(simulate_allreduce(xs, fmt, None, "sum", algorithm)[comm.rank]), fmt
        assert_identical_everywhere(comm, full)


@pytest.mark.parametrize("fmt, algorithm", [(f, (["auto"] + SCATTER_ALGORITHMS)[i % 3])
                                            for i, f in enumerate(FORMAT_NAMES)])
def test_reduce_scatter_equal_layout(comm, shared_rng, fmt, algorithm):
    n = comm.size * 1031  # each shard 1031 values: no whole number of blocks
    xs = [shared_rng.standard_normal(n).astype(np.float32) for _ in range(comm.size)]
    shard = gc.reduce_scatter(xs[comm.rank], comm=comm, fmt=fmt, algorithm=algorithm, layout="equal")
    chosen = gc.api.last_algorithm(comm)[0]  # auto's choice (the transport's own allreduce for small shards)
    assert chosen == algorithm or algorithm == "auto"
    want = simulate_reduce_scatter(xs, fmt, None, "sum", chosen, layout="equal")[comm.rank]
    assert shard.shape == (1031,) and digest(shard) == digest(want)
    if comm.size > 1:
        with pytest.raises(ValueError, match="layout='equal'"):
            gc.reduce_scatter(xs[comm.rank][1:], comm=comm, layout="equal")


def test_disagreement_raises_on_every_rank_and_comm_stays_usable(comm, shared_rng):
    x = np.zeros(10 + comm.rank * (comm.size > 1), np.float32)
    fmt = "e5m2" if comm.rank == comm.size - 1 and comm.size > 1 else "e4m3"
    if comm.size > 1:
        with pytest.raises(ValueError, match="disagree on count") as info:
            gc.allreduce(x, comm=comm, fmt=fmt)
        assert len(set(comm.allgather(str(info.value)))) == 1
    bad = np.arange(4) if comm.rank == 0 else np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="rank\\(s\\) 0"):
        gc.allreduce(bad, comm=comm)
    xs = [shared_rng.standard_normal(100).astype(np.float32) for _ in range(comm.size)]
    y = gc.allreduce(xs[comm.rank], comm=comm)
    assert digest(y) == digest(simulate_allreduce(xs, algorithm=gc.api.last_algorithm(comm)[0])[comm.rank])


def test_nan_on_one_rank_is_non_finite_on_all(comm, shared_rng):
    x = shared_rng.standard_normal(3000).astype(np.float32)
    if comm.rank == comm.size - 1:
        x[1500] = np.nan
    y = gc.allreduce(x, comm=comm)
    assert np.isnan(y[1500]) and np.all(np.isnan(y[1280:1536]))
    assert np.all(np.isfinite(y[:1280])) and np.all(np.isfinite(y[1536:]))


def test_sub_communicator(comm, shared_rng):
    sub = comm.Split(comm.rank % 2, comm.rank)
    xs = [shared_rng.standard_normal(500).astype(np.float32) for _ in range(comm.size)]
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    y = gc.allreduce(xs[comm.rank], comm=sub)
    want = simulate_allreduce([xs[r] for r in members], algorithm=gc.api.last_algorithm(sub)[0])[sub.rank]
    assert digest(y) == digest(want)
    sub.Free()


@pytest.mark.big
def test_hundred_million_elements(comm):
    """10^8 values: every rank holds the same periodic input, so the result repeats with the period
    and each period equals the simulation of one period (blocks never straddle periods).
    Marked ``big``: tests/run_all.sh runs it once, at P = 2, to bound memory and time."""
    period = 256 * 5
    rng = np.random.default_rng(comm.bcast(int(np.random.SeedSequence().entropy % 2**32) if comm.rank == 0 else None))
    base = rng.standard_normal(period).astype(np.float32)
    x = np.tile(base, 10**8 // period)
    y = gc.allreduce(x, comm=comm)
    ran = resolve_algorithm("auto", x.size, comm.size, None, "e4m3")  # what auto takes for 10^8 (not one period)
    want = simulate_allreduce([base] * comm.size, algorithm=ran)[0]
    rows = y.reshape(-1, period)
    assert np.all(rows.view(np.uint32) == want.view(np.uint32))


@pytest.mark.parametrize("slice_elems", [256, 256 * 7, 1 << 18])
def test_pipelined_slices_over_mpi(transport, shared_rng, slice_elems):
    xs = [shared_rng.standard_normal(256 * 61 + 17).astype(np.float32) for _ in range(transport.size)]
    y = gc.allreduce(xs[transport.rank], comm=transport, slice_elems=slice_elems, algorithm="ring")
    assert digest(y) == digest(simulate_allreduce(xs, algorithm="ring")[transport.rank])
    assert_identical_everywhere(transport.comm, y)


@pytest.mark.parametrize("algorithm", ALGORITHM_CHOICES)
def test_every_algorithm_over_mpi(comm, shared_rng, algorithm):
    """Every format through every algorithm, with every node size dividing P: a covering design,
    the pairs dealt over P = 1..5 (conftest.on_this_world; each run of tests/run_all.sh takes its
    share), the size rotating, stochastic rounding on every other block-scaled pair."""
    j = ALGORITHM_CHOICES.index(algorithm)
    for i, fmt in enumerate(FORMAT_NAMES):
        if not on_this_world(i + j, comm.size):
            continue
        n = (7, 4099, 30001)[(i + j) % 3]
        rounding, seed = ("stochastic", 3 + i) if fmt in SCALED_FORMATS and (i + j) % 2 else ("nearest", None)
        xs = [shared_rng.standard_normal(n).astype(np.float32) for _ in range(comm.size)]
        for k in [k for k in range(1, comm.size + 1) if comm.size % k == 0]:
            kw = dict(algorithm=algorithm, local_size=k, fmt=fmt, rounding=rounding, seed=seed)
            y = gc.allreduce(xs[comm.rank], comm=comm, slice_elems=4096, **kw)
            # auto: what the call ran (a cached plain call predicts the plans' channel, which the
            # simulation's auto does not know of)
            kw["algorithm"] = gc.api.last_algorithm(comm)[0]
            assert algorithm in ("auto", kw["algorithm"])
            assert digest(y) == digest(simulate_allreduce(xs, **kw)[comm.rank]), (kw, n)
            assert_identical_everywhere(comm, y)


@pytest.mark.parametrize("algorithm", SCATTER_ALGORITHMS)
def test_shared_window_and_mpi_messages_give_the_same_bytes(comm, shared_rng, algorithm):
    """MpiTransport uses an MPI shared window on one node (the default) or MPI messages
    (shared_memory=False); both must give the simulation's bytes, over repeated calls, for every
    format (the size rotating; the pairs dealt over P = 1..5, conftest.on_this_world)."""
    from giftcomm.transport.mpi import MpiTransport

    on, off = MpiTransport(comm), MpiTransport(comm, shared_memory=False)
    assert on.shared_memory == bool((on.node_ids() == 0).all()) and not off.shared_memory
    for i, fmt in enumerate(FORMAT_NAMES):
        j = SCATTER_ALGORITHMS.index(algorithm)
        if not (on_this_world(i + j, comm.size) or on_this_world(i + j + 1, comm.size)):
            continue  # two fifths of the pairs at each P: every pair twice over P = 1..5
        n = (5, 4099, 70001)[(i + j) % 3]
        for _ in range(2):
            xs = [shared_rng.standard_normal(n).astype(np.float32) for _ in range(comm.size)]
            want = digest(simulate_allreduce(xs, fmt, None, "sum", algorithm)[comm.rank])
            for t in (on, off):
                y = gc.allreduce(xs[comm.rank], comm=t, fmt=fmt, algorithm=algorithm, slice_elems=65536)
                assert digest(y) == want, (t.shared_memory, fmt, n)
        if on.shared_memory:
            assert on.shared_window(0).nbytes >= n // comm.size // 2  # >= 4 bits a value; kept for the next call
    on.free()
    off.free()


def test_shared_memory_switches(comm, monkeypatch):
    from giftcomm.transport.mpi import MpiTransport

    monkeypatch.setenv("GIFTCOMM_SHARED_MEMORY", "0")
    assert not MpiTransport(comm).shared_memory
    monkeypatch.setenv("GIFTCOMM_SHARED_MEMORY", "1")
    assert MpiTransport(comm).shared_memory and MpiTransport(comm, shared_memory=True).shared_memory

    class TwoNodes(MpiTransport):
        def _find_nodes(self):
            return np.arange(self.size) % 2

    if comm.size > 1:
        with pytest.raises(ValueError, match="needs every rank on one node"):
            TwoNodes(comm, shared_memory=True)
        assert not TwoNodes(comm).shared_memory


def test_ranks_that_disagree_on_shared_memory_raise_on_every_rank(comm, shared_rng):
    from giftcomm.transport.mpi import MpiTransport

    t = MpiTransport(comm, shared_memory=comm.rank == 0)
    x = shared_rng.standard_normal(1000).astype(np.float32)
    if comm.size == 1:  # nobody to disagree with: the call goes through
        assert digest(gc.allreduce(x, comm=t)) == digest(simulate_allreduce([x])[0])
    else:
        with pytest.raises(ValueError, match="disagree on shared_memory") as info:
            gc.allreduce(x, comm=t)
        assert len(set(comm.allgather(str(info.value)))) == 1
    t.free()


def test_no_room_for_the_window_falls_back_to_messages_on_every_rank(comm, shared_rng, monkeypatch):
    """A /dev/shm too small for the window (rank 0 checks): every rank warns nothing but rank 0,
    switches the window off, and the result is still the simulation's bytes."""
    import warnings

    import giftcomm.transport.mpi as mpi_mod

    monkeypatch.setattr(mpi_mod, "shm_room", lambda total: (False, 1 << 20))
    t = mpi_mod.MpiTransport(comm)
    shared_before = t.shared_memory
    xs = [shared_rng.standard_normal(70001).astype(np.float32) for _ in range(comm.size)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = gc.allreduce(xs[comm.rank], comm=t, algorithm="ring")
    assert digest(y) == digest(simulate_allreduce(xs, algorithm="ring")[comm.rank])
    assert t.shared_memory is False
    said = [str(w.message) for w in caught if "shared window needs" in str(w.message)]
    assert len(said) == (1 if comm.rank == 0 and shared_before else 0), said
    y2 = gc.allreduce(xs[comm.rank], comm=t, algorithm="direct")  # later calls: messages, agreed everywhere
    assert digest(y2) == digest(simulate_allreduce(xs, algorithm="direct")[comm.rank])
    t.free()
