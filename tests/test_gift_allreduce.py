"""gift_allreduce with real geometries: the simulation of the same steps, bit for bit; identity
geometry == allreduce; a geometry that differs between ranks raises on every rank."""
from __future__ import annotations

import numpy as np
import pytest

import giftcomm as gc
from giftcomm.geometry import Geometry, KfacEstimator
from giftcomm.reference import simulate_allreduce, simulate_gift_allreduce

LAYOUT = [("w1", (48, 40)), ("b1", (48,)), ("w2", (24, 48))]
SIZE = 48 * 40 + 48 + 24 * 48


def run(p, fn):
    return gc.LoopbackGroup(p).run(fn)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def spd(rng, n, cond):
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    return (q * np.geomspace(1, 1 / cond, n)) @ q.T


def kfac_geometry(rng, rank=None):
    factors = {"w1": (spd(rng, 40, 1e3), spd(rng, 48, 1e3)), "w2": (spd(rng, 48, 1e3), spd(rng, 24, 1e3))}
    return Geometry.from_kfac(LAYOUT, factors, rank=rank), factors


def anisotropic_gradients(rng, factors, p):
    """Per-rank gradients G^1/2 Z A^1/2 for each 2-D segment (the structure GIFT expects)."""
    out = []
    for _ in range(p):
        parts = []
        for name, shape in LAYOUT:
            if name in factors:
                a, g = factors[name]
                la, va = np.linalg.eigh(a)
                lg, vg = np.linalg.eigh(g)
                z = rng.standard_normal(shape)
                parts.append(((vg * np.sqrt(lg)) @ vg.T @ z @ (va * np.sqrt(la)) @ va.T).ravel())
            else:
                parts.append(rng.standard_normal(shape).ravel())
        out.append(np.concatenate(parts).astype(np.float32))
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("rank", [None, 8])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_gift_allreduce_equals_simulation_of_the_same_steps(rng, p, rank, op):
    geo, factors = kfac_geometry(rng, rank)
    xs = anisotropic_gradients(rng, factors, p)
    outs = run(p, lambda t: gc.gift_allreduce(xs[t.rank], geo, comm=t, op=op, algorithm="ring"))
    want = simulate_gift_allreduce(xs, geo, op=op, algorithm="ring")
    assert all(same(o, w) for o, w in zip(outs, want))


@pytest.mark.parametrize("algorithm", ["ring", "direct", "doubling"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gift_allreduce_out_and_in_place_equal_the_simulation(rng, algorithm, dtype):
    # the collective decodes into out and inverts there in place; x must stay untouched
    p = 3
    geo, factors = kfac_geometry(rng, 8)
    xs = [x.astype(dtype) for x in anisotropic_gradients(rng, factors, p)]
    before = [x.copy() for x in xs]
    want = simulate_gift_allreduce(xs, geo, op="avg", algorithm=algorithm)
    bufs = [np.empty(SIZE, dtype) for _ in range(p)]
    outs = run(p, lambda t: gc.gift_allreduce(xs[t.rank], geo, comm=t, op="avg", algorithm=algorithm,
                                               out=bufs[t.rank]))
    assert all(o is b for o, b in zip(outs, bufs)) and all(same(b, w) for b, w in zip(bufs, want))
    assert all(same(x, b) for x, b in zip(xs, before))
    for _ in range(2):  # twice: the forward workspace is reused across calls
        inplace = [x.copy() for x in xs]
        run(p, lambda t: gc.gift_allreduce(inplace[t.rank], geo, comm=t, op="avg", algorithm=algorithm,
                                           out=inplace[t.rank]))
        assert all(same(i, w) for i, w in zip(inplace, want))


@pytest.mark.parametrize("p", [2, 3])
def test_reduce_scatter_allgather_in_gift_coordinates(rng, p):
    # docs/method.md section 7: the sharded route equals gift_allreduce bit for bit
    geo, factors = kfac_geometry(rng, 8)
    xs = anisotropic_gradients(rng, factors, p)

    def sharded(t):
        shard = gc.reduce_scatter(geo.forward(xs[t.rank]), comm=t, algorithm="ring")
        return geo.inverse(gc.allgather(shard, comm=t))

    got = run(p, sharded)
    want = run(p, lambda t: gc.gift_allreduce(xs[t.rank], geo, comm=t, algorithm="ring"))
    assert all(same(g, w) for g, w in zip(got, want))


def test_identity_geometry_is_allreduce_bit_for_bit(rng):
    xs = [rng.standard_normal(SIZE).astype(np.float32) for _ in range(3)]
    ident = Geometry.identity(LAYOUT)
    a = run(3, lambda t: gc.gift_allreduce(xs[t.rank], ident, comm=t))
    b = run(3, lambda t: gc.allreduce(xs[t.rank], comm=t))
    assert all(same(x, y) for x, y in zip(a, b))
    assert same(a[0], simulate_allreduce(xs)[0])


def test_gift_is_more_faithful_than_euclidean_fp8_on_anisotropic_gradients(rng):
    geo, factors = kfac_geometry(rng)
    xs = anisotropic_gradients(rng, factors, 4)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    gift = simulate_gift_allreduce(xs, geo, algorithm="ring")[0]
    euclid = simulate_allreduce(xs, algorithm="ring")[0]

    def whitened_error(y):
        return np.linalg.norm(geo.forward((y - exact).astype(np.float32))) / np.linalg.norm(geo.forward(exact.astype(np.float32)))

    assert whitened_error(gift) < 0.5 * whitened_error(euclid)


def test_geometry_that_differs_between_ranks_raises_on_every_rank(rng):
    geo, factors = kfac_geometry(rng)
    other = Geometry.from_kfac(LAYOUT, factors, damping=2e-3)
    x = rng.standard_normal(SIZE).astype(np.float32)

    def call(t):
        try:
            gc.gift_allreduce(x, geo if t.rank != 1 else other, comm=t)
        except ValueError as exc:
            return str(exc)

    msgs = run(3, call)
    assert all(m and "disagree on geometry" in m for m in msgs) and len(set(msgs)) == 1


def test_geometry_of_the_wrong_size_raises(rng):
    geo, _ = kfac_geometry(rng)
    with pytest.raises(ValueError, match="geometry covers"):
        run(2, lambda t: gc.gift_allreduce(np.zeros(SIZE + 1, np.float32), geo, comm=t))


@pytest.mark.mpi
def test_gift_allreduce_over_mpi_after_kfac_sync():
    """Ranks feed different KFAC batches, sync, build the geometry, and gift_allreduce: the result
    equals the simulation with that geometry and is identical on every rank."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    seed = comm.bcast(int(np.random.SeedSequence().entropy % 2**32) if comm.rank == 0 else None)
    mine = np.random.default_rng([seed, comm.rank])
    est = KfacEstimator(LAYOUT, decay=0.9)
    for _ in range(3):
        est.update("w1", mine.standard_normal((64, 40)), mine.standard_normal((64, 48)))
        est.update("w2", mine.standard_normal((64, 48)), mine.standard_normal((64, 24)))
    est.sync(comm)
    geo = est.geometry(rank=6)
    shared = np.random.default_rng(seed)
    xs = [shared.standard_normal(SIZE).astype(np.float32) for _ in range(comm.size)]
    y = gc.gift_allreduce(xs[comm.rank], geo, comm=comm, op="avg")
    want = simulate_gift_allreduce(xs, geo, op="avg")[comm.rank]
    assert y.tobytes() == want.tobytes()
    assert len(set(comm.allgather(y.tobytes()))) == 1
