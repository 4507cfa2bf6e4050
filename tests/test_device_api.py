"""The device path of the public collectives (giftcomm.device_api), run on the CPU.

The device functions are backend-generic, so NumPy arrays over the device loopback
(giftcomm.transport.device_loopback) drive the same code a GPU runs: reduce_scatter, allgather,
allreduce (ring, direct, auto) and gift_allreduce with a geometry, against the plain reference
simulations bit for bit; out=; bad or mismatched arguments raise the same exception on every
rank, with the host path's message; the caller's input is never modified. The public functions
route device arrays (fake ``__cuda_array_interface__`` ones here) to this path. The direct
reduce-scatter queues all its messages before its first wait (one NCCL group); under mpiexec
(``-m mpi``) the device path runs over the CUDA-aware MPI transport with fake device buffers.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import giftcomm as gc
from giftcomm import api, device_api
from giftcomm.cuda.collective_check import KFAC_LAYOUT, collective_checks, random_kfac_geometry
from giftcomm.geometry import Geometry
from giftcomm.reference import (simulate_allgather, simulate_allreduce, simulate_gift_allreduce,
                                simulate_reduce_scatter)
from giftcomm.reference.simulate import resolve_algorithm
from giftcomm.transport import Request, Transport
from giftcomm.transport.device_loopback import DeviceLoopbackGroup
from test_gpu_plumbing import FakeDeviceArray

PS = [1, 2, 3, 4, 5, 8]
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16]
# (fmt, n, block): block-scaled FP8 with partial last blocks, fewer blocks than ranks, raw formats
CASES = [("e4m3", 1000, 32), ("e5m2", 515, 256), ("e4m3", 7, 3), ("bf16", 300, 64), ("fp32", 41, 8)]


def run(p, fn):
    return DeviceLoopbackGroup(p).run(fn)


def inputs(rng, p, n, dtype, spread=8.0):
    """Per-rank inputs of varied magnitude (block scales differ) in ``dtype``."""
    return [(rng.standard_normal(n) * np.exp(rng.uniform(-spread, spread, n) / 4)).astype(dtype) for _ in range(p)]


def same(a, b):
    """Bit-identical arrays (dtype, shape, bytes)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def outcomes(p, fn, group=DeviceLoopbackGroup):
    """Every rank's result or exception (the loopback re-raises only the first)."""
    def body(t):
        try:
            return fn(t)
        except (TypeError, ValueError) as exc:
            return exc
    return group(p).run(body)


def assert_same_error(errors, cls, *fragments):
    """Every rank raised ``cls`` with one and the same message, containing ``fragments``."""
    assert all(type(e) is cls for e in errors), errors
    assert len({str(e) for e in errors}) == 1, [str(e) for e in errors]
    for frag in fragments:
        assert frag in str(errors[0]), (frag, str(errors[0]))


# ----------------------------------------------------------------------- reduce_scatter
@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_reduce_scatter_matches_simulation(rng, p, algorithm):
    for fmt, n, block in CASES:
        for dtype in DTYPES:
            xs = inputs(rng, p, n, dtype)
            copies = [x.copy() for x in xs]
            op = ("sum", "avg")[int(rng.integers(2))]
            got = run(p, lambda t: device_api.device_reduce_scatter(xs[t.rank], t, op, fmt, block, None, algorithm))
            want = simulate_reduce_scatter(xs, fmt, block, op, algorithm)
            bounds = gc.chunk_bounds(n, p, block)
            for r in range(p):
                assert got[r].shape == (bounds[r + 1] - bounds[r],)
                assert same(got[r], want[r]), (fmt, n, block, dtype, op, r)
            assert all(same(x, c) for x, c in zip(xs, copies))


# ---------------------------------------------------------------------------- allgather
@pytest.mark.parametrize("p", PS)
def test_allgather_unequal_shards_matches_simulation(rng, p):
    for fmt, _, block in CASES:
        for dtype in DTYPES:
            shards = [inputs(rng, 1, int(rng.integers(0, 3 * block + 2)), dtype)[0] for _ in range(p)]
            if p > 1:
                shards[int(rng.integers(p))] = np.zeros(0, dtype)  # an empty shard somewhere
            copies = [s.copy() for s in shards]
            got = run(p, lambda t: device_api.device_allgather(shards[t.rank], t, fmt, block, None))
            want = simulate_allgather(shards, fmt, block)
            assert all(same(g, w) for g, w in zip(got, want)), (fmt, block, dtype)
            assert all(same(s, c) for s, c in zip(shards, copies))


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_allgather_of_reduce_scatter_is_allreduce(rng, p, algorithm):
    for dtype in (np.float32, np.float64):
        xs = inputs(rng, p, 2049, dtype)

        def both(t):
            shard = device_api.device_reduce_scatter(xs[t.rank], t, "sum", "e4m3", 64, None, algorithm)
            gathered = device_api.device_allgather(shard, t, "e4m3", 64, None)
            return gathered, device_api.device_allreduce(xs[t.rank], None, t, "sum", "e4m3", 64, None, algorithm)

        want = simulate_allreduce(xs, "e4m3", 64, "sum", algorithm)
        for (gathered, reduced), w in zip(run(p, both), want):
            assert same(gathered, w) and same(reduced, w)


# ---------------------------------------------------------------------------- allreduce
@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("algorithm", ["ring", "direct", "auto"])
def test_allreduce_matches_simulation(rng, p, algorithm):
    for fmt, n, block in CASES:
        for dtype in DTYPES:
            xs = [x.reshape(-1, 1) if n % 2 else x.reshape(2, -1) for x in inputs(rng, p, n, dtype)]
            copies = [x.copy() for x in xs]
            op = ("sum", "avg")[int(rng.integers(2))]
            got = run(p, lambda t: device_api.device_allreduce(xs[t.rank], None, t, op, fmt, block, None, algorithm))
            ran = resolve_algorithm(algorithm, n, p, None, fmt, block)
            ran = ran if ran in device_api.DEVICE_ALGORITHMS else "ring"
            want = simulate_allreduce(xs, fmt, block, op, ran)
            assert all(same(g, w) for g, w in zip(got, want)), (fmt, n, block, dtype, op, ran)
            assert all(same(x, c) for x, c in zip(xs, copies))


def test_auto_on_device_is_ring_or_direct(rng):
    """A size where the cost model picks recursive doubling (tiny message): the device runs the ring."""
    p, n = 8, 16
    assert resolve_algorithm("auto", n, p, None, "e4m3", 256) == "doubling"
    xs = inputs(rng, p, n, np.float32)
    got = run(p, lambda t: device_api.device_allreduce(xs[t.rank], None, t, "sum", "e4m3", 256, None, "auto"))
    want = simulate_allreduce(xs, "e4m3", 256, "sum", "ring")
    assert all(same(g, w) for g, w in zip(got, want))


def test_empty_and_single_values(rng):
    for p in (1, 3):
        for n in (0, 1):
            xs = inputs(rng, p, n, np.float32)
            got = run(p, lambda t: device_api.device_allreduce(xs[t.rank], None, t, "avg", "e4m3", 256, None, "direct"))
            assert all(same(g, w) for g, w in zip(got, simulate_allreduce(xs, "e4m3", 256, "avg", "direct")))
            got = run(p, lambda t: device_api.device_reduce_scatter(xs[t.rank], t, "sum", "e4m3", 256, None, "ring"))
            assert all(same(g, w) for g, w in zip(got, simulate_reduce_scatter(xs, "e4m3", 256, "sum")))


# ------------------------------------------------------------------------ gift_allreduce
SIZE = sum(int(np.prod(shape)) for _, shape in KFAC_LAYOUT)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_gift_allreduce_geometry_matches_simulation(rng, p, algorithm):
    geo = random_kfac_geometry(rng, rank=6)
    assert not geo.is_identity
    for dtype in (np.float32, np.float64, BF16):
        for op in ("sum", "avg"):
            xs = inputs(rng, p, SIZE, dtype, spread=2)
            copies = [x.copy() for x in xs]
            got = run(p, lambda t: device_api.device_allreduce(xs[t.rank], geo, t, op, "e4m3", 64, None, algorithm))
            want = simulate_gift_allreduce(xs, geo, "e4m3", 64, op, algorithm)
            assert all(same(g, w) for g, w in zip(got, want)), (dtype, op)
            assert all(same(x, c) for x, c in zip(xs, copies))


def test_identity_geometry_is_plain_allreduce(rng):
    p = 3
    xs = inputs(rng, p, SIZE, np.float32)
    ident = Geometry.identity(KFAC_LAYOUT)
    got = run(p, lambda t: device_api.device_allreduce(xs[t.rank], ident, t, "sum", "e4m3", 256, None, "ring"))
    assert all(same(g, w) for g, w in zip(got, simulate_allreduce(xs, "e4m3", 256, "sum", "ring")))


# ---------------------------------------------------------------------------------- out=
def test_out_arguments(rng):
    p, n, block = 3, 777, 32
    xs = inputs(rng, p, n, np.float32)
    want = simulate_allreduce(xs, "e4m3", block, "avg", "direct")

    def allreduce_into_out(t):
        out = np.full(n, np.nan, np.float32)
        res = device_api.device_allreduce(xs[t.rank], None, t, "avg", "e4m3", block, out, "direct")
        return res is out, out

    assert all(is_out and same(o, w) for (is_out, o), w in zip(run(p, allreduce_into_out), want))
    inplace = [x.copy() for x in xs]  # out= the input itself
    got = run(p, lambda t: device_api.device_allreduce(inplace[t.rank], None, t, "avg", "e4m3", block,
                                                       inplace[t.rank], "direct"))
    assert all(g is i and same(g, w) for g, i, w in zip(got, inplace, want))

    bounds = gc.chunk_bounds(n, p, block)
    shards = [np.empty(int(bounds[r + 1] - bounds[r]), np.float32) for r in range(p)]
    got = run(p, lambda t: device_api.device_reduce_scatter(xs[t.rank], t, "sum", "e4m3", block, shards[t.rank], "ring"))
    assert all(g is s and same(g, w) for g, s, w in zip(got, shards, simulate_reduce_scatter(xs, "e4m3", block)))

    outs = [np.empty(n, np.float32) for _ in range(p)]
    got = run(p, lambda t: device_api.device_allgather(shards[t.rank], t, "e4m3", block, outs[t.rank]))
    assert all(g is o and same(g, w) for g, o, w in zip(got, outs, simulate_allgather(shards, "e4m3", block)))


def test_bad_out_raises_on_every_rank(rng):
    p, n = 3, 100
    xs = inputs(rng, p, n, np.float32)

    def wrong_shape_on_rank_1(t):
        out = np.empty(n + (t.rank == 1), np.float32)
        return device_api.device_allreduce(xs[t.rank], None, t, "sum", "e4m3", 32, out, "ring")

    assert_same_error(outcomes(p, wrong_shape_on_rank_1), ValueError, "rank(s) 1", "out must have shape (100,)")
    errors = outcomes(p, lambda t: device_api.device_allreduce(xs[t.rank], None, t, "sum", "e4m3", 32,
                                                               np.empty(n, np.float64), "ring"))
    assert_same_error(errors, ValueError, "dtype float32")
    errors = outcomes(p, lambda t: device_api.device_allgather(xs[t.rank], t, "e4m3", 32,
                                                               np.empty(n * p - t.rank, np.float32)))
    assert_same_error(errors, ValueError, "out on rank(s) [1, 2]")


# --------------------------------------------------- agreement: the host path's messages
def _device_and_host_errors(p, device_fn, host_fn):
    return outcomes(p, device_fn), outcomes(p, host_fn, gc.LoopbackGroup)


MISMATCHES = {
    # name: (kwargs of rank 1 that differ, expected error class, fragment)
    "count": (dict(n=65), ValueError, "ranks disagree on count"),
    "fmt": (dict(fmt="e5m2"), ValueError, "ranks disagree on fmt (rank 0: e4m3, rank 1: e5m2"),
    "block": (dict(block=32), ValueError, "ranks disagree on block"),
    "op": (dict(op="avg"), ValueError, "ranks disagree on op"),
    "dtype": (dict(dtype=np.float16), ValueError, "ranks disagree on dtype"),
    "int input": (dict(dtype=np.int32), TypeError, "x must be float32, float64, float16 or bfloat16, got dtype int32"),
    "algorithm": (dict(algorithm="direct"), ValueError, "ranks disagree on algorithm"),
    "slice": (dict(slice_elems=512), ValueError, "ranks disagree on slice"),
    "bad op": (dict(op="max"), ValueError, "op must be 'sum' or 'avg'"),
    "bad block": (dict(block=0), ValueError, "rank(s) 1"),
}


@pytest.mark.parametrize("name", sorted(MISMATCHES))
@pytest.mark.parametrize("what", ["allreduce", "reduce_scatter"])
def test_mismatch_raises_host_message_on_every_rank(rng, name, what):
    p = 3
    diff, cls, fragment = MISMATCHES[name]
    base = dict(n=64, dtype=np.float32, fmt="e4m3", block=16, op="sum", algorithm="ring", slice_elems=None)
    data = [rng.standard_normal(70) for _ in range(p)]

    def args(rank):
        a = dict(base, **(diff if rank == 1 else {}))
        return data[rank][: a.pop("n")].astype(a.pop("dtype")), a

    def device(t):
        x, a = args(t.rank)
        if what == "allreduce":
            return device_api.device_allreduce(x, None, t, a["op"], a["fmt"], a["block"], None, a["algorithm"],
                                               slice_elems=a["slice_elems"])
        return device_api.device_reduce_scatter(x, t, a["op"], a["fmt"], a["block"], None, a["algorithm"], a["slice_elems"])

    def host(t):
        x, a = args(t.rank)
        return getattr(gc, what)(x, comm=t, **a)

    dev, hst = _device_and_host_errors(p, device, host)
    assert_same_error(dev, cls, fragment)
    assert str(dev[0]) == str(hst[0]) and type(dev[0]) is type(hst[0])
    copies = [args(r)[0] for r in range(p)]
    assert all(same(args(r)[0], copies[r]) for r in range(p))


def test_allgather_mismatch_raises_host_message(rng):
    p = 3
    shards = [rng.standard_normal(10).astype(np.float32) for _ in range(p)]
    fmts = ["e4m3", "bf16", "e4m3"]
    dev, hst = _device_and_host_errors(
        p, lambda t: device_api.device_allgather(shards[t.rank], t, fmts[t.rank], 16, None),
        lambda t: gc.allgather(shards[t.rank], comm=t, fmt=fmts[t.rank], block=16))
    assert_same_error(dev, ValueError, "giftcomm.allgather: ranks disagree on fmt")
    assert str(dev[0]) == str(hst[0])


def test_geometry_mismatch_raises_on_every_rank(rng):
    p = 3
    geos = [random_kfac_geometry(rng, rank=4)] * 2 + [random_kfac_geometry(rng, rank=4)]
    xs = inputs(rng, p, SIZE, np.float32)
    errors = outcomes(p, lambda t: device_api.device_allreduce(xs[t.rank], geos[t.rank], t, "sum", "e4m3", 64, None, "ring"))
    assert_same_error(errors, ValueError, "giftcomm.allreduce: ranks disagree on geometry")
    small = random_kfac_geometry(rng, rank=4)
    errors = outcomes(p, lambda t: device_api.device_allreduce(xs[t.rank][:-1] if t.rank == 2 else xs[t.rank], small,
                                                               t, "sum", "e4m3", 64, None, "ring"))
    assert_same_error(errors, ValueError, "rank(s) 2", f"geometry covers {SIZE} elements but x has {SIZE - 1}")


@pytest.mark.parametrize("algorithm", ["doubling", "hierarchical", "hierarchical_direct", "nonsense"])
def test_host_only_algorithms_raise_naming_the_supported_ones(rng, algorithm):
    p = 2
    xs = inputs(rng, p, 100, np.float32)
    errors = outcomes(p, lambda t: device_api.device_allreduce(xs[t.rank], None, t, "sum", "e4m3", 32, None, algorithm))
    assert_same_error(errors, ValueError, "auto, ring, direct", repr(algorithm))
    errors = outcomes(p, lambda t: device_api.device_reduce_scatter(xs[t.rank], t, "sum", "e4m3", 32, None, algorithm))
    assert_same_error(errors, ValueError, "auto, ring, direct")


# -------------------------------------------------------------------- public API routing
def test_public_functions_route_device_arrays(monkeypatch):
    """reduce_scatter / allgather / allreduce hand device arrays to device_api with every argument."""
    calls = []
    for name in ("device_allreduce", "device_reduce_scatter", "device_allgather"):
        monkeypatch.setattr(api, name, lambda *a, _n=name: calls.append((_n, a)) or _n)
    x = FakeDeviceArray(np.zeros(8, np.float32))
    assert gc.reduce_scatter(x, comm="c", op="avg", fmt="e5m2", block=4, algorithm="direct", slice_elems=8) == "device_reduce_scatter"
    assert calls[-1][1] == (x, "c", "avg", "e5m2", 4, None, "direct", 8)
    assert gc.allgather(x, comm="c", fmt="bf16", block=2) == "device_allgather"
    assert calls[-1][1] == (x, "c", "bf16", 2, None, None)
    assert gc.allreduce(x, comm="c", algorithm="direct", local_size=2) == "device_allreduce"
    assert calls[-1][1] == (x, None, "c", "sum", "e4m3", 256, None, "direct", 2, None)


# ------------------------------------------------------- the GPU machine's check, on NumPy
def test_device_check_collective_section_passes_on_numpy():
    """perf/device_check.sh's collective section (giftcomm.cuda.collective_check), run here with
    NumPy arrays: every check passes, so on a GPU a failure is the device's, not the script's."""
    results = collective_checks(np, np.asarray, quick=True)
    assert len(results) >= 15
    assert all(ok for _, ok, _ in results), [label for label, ok, _ in results if not ok]


# --------------------------------------------------- the communication pattern; MPI plumbing
class _LoggedRequest(Request):
    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def wait(self):
        self.log.append(("wait",))
        self.inner.wait()


class Recording(Transport):
    """Wraps a transport, logging the point-to-point calls; with ``fake=True`` every buffer
    reaches the inner transport as a FakeDeviceArray (CUDA-aware MPI plumbing)."""

    def __init__(self, inner, fake=False):
        self.inner, self.rank, self.size, self.fake, self.log = inner, inner.rank, inner.size, fake, []

    def _pass(self, kind, buf, peer, tag):
        self.log.append((kind, peer))
        op = self.inner.isend if kind == "send" else self.inner.irecv
        return _LoggedRequest(op(FakeDeviceArray(buf) if self.fake else buf, peer, tag), self.log)

    def isend(self, buf, dest, tag=0):
        return self._pass("send", buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        return self._pass("recv", buf, source, tag)

    def allgather_int64(self, vec):
        return self.inner.allgather_int64(vec)

    def allgather_object(self, obj):
        return self.inner.allgather_object(obj)


def test_direct_is_one_batch_of_queued_messages(rng):
    """The device direct reduce-scatter queues every receive and send (one per peer) before its
    first wait: one NCCL group. The ring queues one receive and one send per hop."""
    p = 5
    xs = inputs(rng, p, 1000, np.float32)
    group = DeviceLoopbackGroup(p)
    recs = [Recording(t) for t in group.transports]
    for algorithm in ("direct", "ring"):
        for rec in recs:
            rec.log.clear()
        group.run(lambda t: device_api.device_reduce_scatter(xs[t.rank], recs[t.rank], "sum", "e4m3", 32, None, algorithm))
        for r, rec in enumerate(recs):
            others = sorted(set(range(p)) - {r})
            if algorithm == "direct":
                queued = rec.log[: 2 * (p - 1)]
                assert sorted(peer for kind, peer in queued if kind == "recv") == others
                assert sorted(peer for kind, peer in queued if kind == "send") == others
                assert rec.log[2 * (p - 1) :] == [("wait",)] * (2 * (p - 1))
            else:
                hop = [("recv", (r - 1) % p), ("send", (r + 1) % p), ("wait",), ("wait",)]
                assert rec.log == hop * (p - 1)


@pytest.mark.mpi
def test_device_collectives_over_cuda_aware_mpi_plumbing():
    """device_api over the CUDA-aware MPI transport with fake device buffers (MPICH reads the host
    memory behind the pointers): reduce_scatter, allgather, direct and gift_allreduce with a
    geometry equal the simulations on every rank."""
    from mpi4py import MPI

    from giftcomm.transport.device_mpi import DeviceMpiTransport

    inner = DeviceMpiTransport(MPI.COMM_WORLD, require_cuda_aware=False)
    t = Recording(inner, fake=True)
    p, r = t.size, t.rank
    rng = np.random.default_rng(4321)  # the same inputs on every rank
    xs = inputs(rng, p, 3001, np.float32)
    for algorithm in ("ring", "direct"):
        shard = device_api.device_reduce_scatter(xs[r], t, "sum", "e4m3", 64, None, algorithm)
        assert same(shard, simulate_reduce_scatter(xs, "e4m3", 64, "sum", algorithm)[r])
        full = device_api.device_allgather(shard, t, "e4m3", 64, None)
        assert same(full, simulate_allreduce(xs, "e4m3", 64, "sum", algorithm)[r])
    geo = random_kfac_geometry(rng, rank=4)
    gs = inputs(rng, p, geo.size, np.float32, spread=2)
    got = device_api.device_allreduce(gs[r], geo, t, "avg", "e4m3", 64, None, "direct")
    assert same(got, simulate_gift_allreduce(gs, geo, "e4m3", 64, "avg", "direct")[r])
    if p > 1:
        with pytest.raises(ValueError, match="ranks disagree on count"):
            device_api.device_allreduce(xs[r][: 100 + r], None, t, "sum", "e4m3", 64, None, "ring")
    inner.free()
