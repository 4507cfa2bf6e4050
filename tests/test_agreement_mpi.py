"""The agreement, field by field, under mpiexec (tests/run_all.sh runs it at P = 1..5).

For every field the ranks must agree on (giftcomm.collectives.call MATCH for allreduce /
gift_allreduce / reduce_scatter, GATHER_MATCH and the out size for allgather), the last rank
passes a different value and every rank must raise the same ValueError naming that field; for
the ring and the direct algorithm, with the shared window and with MPI messages. Dropping any
field from the agreement makes its test fail (a rank returns or times out instead of raising
the same error), in bounded time: each test's transport has a 10 s deadline and raises.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import FORMAT_NAMES, SCATTER_ALGORITHMS

import giftcomm as gc
from giftcomm.collectives.call import GATHER_MATCH, MATCH

pytestmark = [pytest.mark.mpi, pytest.mark.multirank]

N = 3000
DEADLINE_S = 10.0


@pytest.fixture
def comm():
    from mpi4py import MPI

    c = MPI.COMM_WORLD
    if c.size < 2:
        pytest.skip("a disagreement needs at least two ranks")
    return c


@pytest.fixture(params=["window", "messages"])
def transport(request, comm):
    """A fresh MpiTransport (own private communicator) with the shared window or without; it
    raises instead of aborting at its deadline, so a missing check fails the test, not the job."""
    from giftcomm.transport.mpi import MpiTransport

    t = MpiTransport(comm, shared_memory=None if request.param == "window" else False, timeout=DEADLINE_S,
                     on_timeout="raise")
    yield t
    failed = comm.allgather(t._health.failure is not None)
    if not any(failed):
        t.free()


class _Geometry:
    """A GeometryLike that is the identity, with a chosen fingerprint."""

    is_identity = False

    def __init__(self, size: int, fingerprint: int) -> None:
        self.size, self._fp = size, fingerprint

    def forward(self, flat):
        return np.asarray(flat, np.float32)

    def inverse(self, flat):
        return flat

    def fingerprint(self) -> int:
        return self._fp


def _outcome(comm, fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared across ranks below
        return type(exc).__name__, str(exc)
    return "returned", ""


def assert_same_error_everywhere(comm, fn, field: str) -> None:
    got = comm.allgather(_outcome(comm, fn))
    assert len(set(got)) == 1, f"ranks differ: {got}"
    kind, message = got[0]
    assert kind == "ValueError", got[0]
    want = "does not hold" if field == "out" else f"disagree on {field}"
    assert want in message, message


def _common_case(field: str, odd: bool, x: np.ndarray, kw: dict) -> tuple[np.ndarray, bool]:
    """The fields every collective agrees on alike: (x, True) after making the odd rank's call
    differ in ``field`` (in ``x`` or ``kw``), or (x, False) for a field this does not know."""
    if field == "dtype":
        return (x.astype(np.float64) if odd else x), True
    if field == "fmt":
        kw["fmt"] = "e5m2" if odd else "e4m3"
    elif field == "block":
        kw["block"] = 128 if odd else 256
    elif field == "op":
        kw["op"] = "avg" if odd else "sum"
    elif field == "slice":
        kw["slice_elems"] = 512 if odd else 1024
    elif field == "rounding":
        kw.update(rounding="stochastic" if odd else "nearest", seed=7 if odd else None)
    elif field == "seed":
        kw.update(rounding="stochastic", seed=8 if odd else 7)
    else:
        return x, False
    return x, True


def _allreduce_case(field: str, odd: bool, algorithm: str, t, x):
    """(callable) the call of the rank that is odd (True) or like the others, for ``field``."""
    kw: dict = dict(comm=t, algorithm=algorithm)
    geometry = None
    x, known = _common_case(field, odd, x, kw)
    if known:
        pass
    elif field == "count":
        x = np.ones(N + 1, np.float32) if odd else x
    elif field == "geometry":
        geometry = _Geometry(x.size, 2 if odd else 1)
    elif field == "algorithm":
        others = [a for a in SCATTER_ALGORITHMS if a != algorithm]
        kw["algorithm"] = others[0] if odd else algorithm
    elif field == "local_size":
        kw["local_size"] = 1 if odd else None
    elif field == "allow_native":  # (algorithm="native" with allow_native=False is a local error: auto)
        kw.update(allow_native=not odd, algorithm="auto" if algorithm == "native" else algorithm)
    elif field == "shared_memory":
        pass  # the transport differs (see the test)
    elif field == "caller":
        return _in_thread("giftcomm-odd-thread" if odd else None, lambda: gc.gift_allreduce(x, geometry, **kw))
    else:  # a field added to MATCH without a case here
        raise AssertionError(f"no test case for the agreed field {field!r}: add one")
    return lambda: gc.gift_allreduce(x, geometry, **kw)


ALLREDUCE_CASES = {"count", "dtype", "fmt", "block", "op", "slice", "geometry", "algorithm", "local_size",
                   "shared_memory", "caller", "rounding", "seed", "allow_native"}
GATHER_CASES = {"dtype", "fmt", "block", "slice", "caller", "rounding", "seed"}


def _in_thread(name: str | None, fn):
    """``fn`` run on a thread called ``name`` (None: on this thread); its exception re-raised here."""
    if name is None:
        return fn

    def run():
        box: list = []

        def body():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                box.append(exc)

        th = threading.Thread(target=body, name=name)
        th.start()
        th.join()
        if box:
            raise box[0]

    return run


def test_every_agreed_field_has_a_case():
    """A field added to the agreement needs its case here (the parametrisations read MATCH)."""
    assert set(MATCH) <= ALLREDUCE_CASES, set(MATCH) - ALLREDUCE_CASES
    assert set(GATHER_MATCH) <= GATHER_CASES, set(GATHER_MATCH) - GATHER_CASES


@pytest.mark.parametrize("algorithm", SCATTER_ALGORITHMS)
@pytest.mark.parametrize("field", list(MATCH))
def test_one_rank_differs_in_an_allreduce_field(comm, transport, field, algorithm):
    t = transport
    odd = comm.rank == comm.size - 1
    original = t.shared_memory
    if field == "shared_memory":  # with the window or without, one rank that differs must raise
        t.shared_memory = not odd
    x = np.ones(N, np.float32)
    assert_same_error_everywhere(comm, _allreduce_case(field, odd, algorithm, t, x), field)
    t.shared_memory = original
    # the communicator is still usable, and the call is right once the ranks agree
    y = gc.allreduce(x, comm=t, algorithm=algorithm, fmt="fp32")
    assert np.array_equal(y, np.full(N, comm.size, np.float32))


@pytest.mark.parametrize("field", ["count", "dtype", "fmt", "block", "op", "slice", "caller", "rounding", "seed"])
def test_one_rank_differs_in_a_reduce_scatter_field(comm, transport, field):
    odd = comm.rank == comm.size - 1
    x = np.ones(N, np.float32)
    kw: dict = dict(comm=transport, algorithm="ring")
    x, _ = _common_case(field, odd, x, kw)
    if field == "count":
        x = np.ones(N + 256, np.float32) if odd else x
    name = "giftcomm-odd-thread" if odd and field == "caller" else None
    assert_same_error_everywhere(comm, _in_thread(name, lambda: gc.reduce_scatter(x, **kw)), field)


@pytest.mark.parametrize("field", list(GATHER_MATCH) + ["out"])
def test_one_rank_differs_in_an_allgather_field(comm, transport, field):
    odd = comm.rank == comm.size - 1
    shard = np.ones(100 + comm.rank, np.float32)  # lengths may differ: not a disagreement
    kw: dict = dict(comm=transport)
    shard, _ = _common_case(field, odd, shard, kw)
    if field == "out":
        total = sum(100 + r for r in range(comm.size))
        kw["out"] = np.empty(total - 1 if odd else total, np.float32)
    name = "giftcomm-odd-thread" if odd and field == "caller" else None
    assert_same_error_everywhere(comm, _in_thread(name, lambda: gc.allgather(shard, **kw)), field)
    got = gc.allgather(np.ones(100 + comm.rank, np.float32), comm=transport, fmt="fp32")
    assert got.size == sum(100 + r for r in range(comm.size))


def test_one_rank_differs_in_format_for_every_format(comm):
    """Every format of the table against its neighbour in the table, both directions: the same
    ValueError naming fmt on every rank, for allreduce and allgather; then the agreed call runs."""
    from giftcomm.reference import simulate_allreduce
    from giftcomm.transport.mpi import MpiTransport

    t = MpiTransport(comm, timeout=DEADLINE_S, on_timeout="raise")
    odd = comm.rank == comm.size - 1
    x = np.ones(N, np.float32)
    for i, fmt in enumerate(FORMAT_NAMES):
        other = FORMAT_NAMES[(i + 1) % len(FORMAT_NAMES)]
        assert_same_error_everywhere(comm, lambda: gc.allreduce(x, comm=t, fmt=other if odd else fmt), "fmt")
        assert_same_error_everywhere(comm, lambda: gc.allgather(x[:100], comm=t, fmt=fmt if odd else other), "fmt")
        y = gc.allreduce(x, comm=t, fmt=fmt)
        assert y.tobytes() == simulate_allreduce([x] * comm.size, fmt)[comm.rank].tobytes(), fmt
    t.free()
