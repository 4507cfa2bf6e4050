"""The 4-bit and microscaling formats (nvfp4, mxfp4, mxfp8) and stochastic rounding in every
collective and algorithm, against the reference simulations bit for bit, on both schedules;
nvfp4's bytes do not depend on the slice size; bad combinations raise the same error on every
rank; stochastic results are identical on every rank, reproducible from the seed, and differ
between seeds."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import outcomes, same

import giftcomm as gc
from giftcomm.reference import simulate_allgather, simulate_allreduce, simulate_gift_allreduce, simulate_reduce_scatter
from giftcomm.transport.device_loopback import DeviceLoopbackGroup
from studies.device.collective_check import random_kfac_geometry

FMTS = ["nvfp4", "mxfp4", "mxfp8", "e4m3"]
ALGORITHMS = ["ring", "direct", "doubling", "hierarchical", "hierarchical_direct", "oneshot"]


def inputs(rng, p, n, spread=6.0, dtype=np.float32):
    return [(rng.standard_normal(n) * np.exp(rng.uniform(-spread, spread, n))).astype(dtype) for _ in range(p)]






@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("group", [gc.LoopbackGroup, DeviceLoopbackGroup])
def test_every_algorithm_equals_its_simulation(rng, p, fmt, rounding, group):
    n = int(rng.integers(1, 5000))
    seed = int(rng.integers(0, 2**63)) if rounding == "stochastic" else None
    dtype = (np.float32, np.float64)[int(rng.integers(2))]
    xs = inputs(rng, p, n, dtype=dtype)
    for algorithm in ALGORITHMS:
        local_size = (2 if p % 2 == 0 else 1) if algorithm.startswith("hierarchical") else None
        got = group(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt=fmt, algorithm=algorithm, local_size=local_size,
                                                  slice_elems=2048, rounding=rounding, seed=seed))
        want = simulate_allreduce(xs, fmt, None, "sum", algorithm, local_size, rounding=rounding, seed=seed)
        assert all(same(g, w) for g, w in zip(got, want)), (algorithm, n, dtype)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_reduce_scatter_allgather_and_gift(rng, fmt, rounding):
    p, n = 3, 3001
    seed = 99 if rounding == "stochastic" else None
    xs = inputs(rng, p, n)
    for algorithm in ("ring", "direct"):
        got = gc.LoopbackGroup(p).run(lambda t: gc.reduce_scatter(xs[t.rank], comm=t, fmt=fmt, algorithm=algorithm,
                                                                  rounding=rounding, seed=seed))
        want = simulate_reduce_scatter(xs, fmt, None, "sum", algorithm, rounding=rounding, seed=seed)
        assert all(same(g, w) for g, w in zip(got, want)), algorithm
    shards = [x[: 100 * (r + 1)] for r, x in enumerate(xs)]
    got = gc.LoopbackGroup(p).run(lambda t: gc.allgather(shards[t.rank], comm=t, fmt=fmt, rounding=rounding, seed=seed))
    assert all(same(g, w) for g, w in zip(got, simulate_allgather(shards, fmt, rounding=rounding, seed=seed)))
    geo = random_kfac_geometry(rng, rank=4)
    gs = inputs(rng, p, geo.size, spread=1)
    got = gc.LoopbackGroup(p).run(lambda t: gc.gift_allreduce(gs[t.rank], geo, comm=t, fmt=fmt, op="avg",
                                                              algorithm="ring", rounding=rounding, seed=seed))
    want = simulate_gift_allreduce(gs, geo, fmt, None, "avg", "ring", rounding=rounding, seed=seed)
    assert all(same(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nvfp4_bytes_do_not_depend_on_the_slice_size(rng, rounding):
    p, n = 3, 50000
    seed = 5 if rounding == "stochastic" else None
    xs = inputs(rng, p, n)
    results = [gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt="nvfp4", algorithm="ring",
                                                              slice_elems=s, rounding=rounding, seed=seed))
               for s in (1, 1000, 1500, 4096, 1 << 20)]
    assert all(same(r[0], results[0][0]) for r in results)


def test_stochastic_rounding_is_reproducible_identical_everywhere_and_seeded(rng):
    p, n = 4, 4096
    xs = inputs(rng, p, n, spread=1)
    run = lambda seed: gc.LoopbackGroup(p).run(  # noqa: E731
        lambda t: gc.allreduce(xs[t.rank], comm=t, fmt="nvfp4", rounding="stochastic", seed=seed))
    a, b, c = run(1), run(1), run(2)
    assert all(same(x, a[0]) for x in a) and all(same(x, y) for x, y in zip(a, b))
    assert not same(a[0], c[0])
    exact = np.sum(xs, axis=0)
    mean = np.mean([run(s)[0] for s in range(40)], axis=0)
    nearest = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt="nvfp4"))[0]
    # averaging over seeds removes most of stochastic rounding's error, not nearest rounding's bias
    assert np.linalg.norm(mean - exact) < 0.5 * np.linalg.norm(nearest - exact)


BAD = {
    "block of a fixed-block format": (dict(fmt="nvfp4", block=32), ValueError, "block"),
    "stochastic on a pass-through format": (dict(fmt="bf16", rounding="stochastic", seed=1), ValueError, "stochastic"),
    "stochastic without a seed": (dict(fmt="e4m3", rounding="stochastic"), ValueError, "seed"),
    "unknown rounding": (dict(rounding="up"), ValueError, "rounding"),
    "negative seed": (dict(rounding="stochastic", seed=-1), ValueError, "rank(s) 1"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_combinations_on_one_rank_raise_on_every_rank(rng, name):
    p = 3
    kw, cls, fragment = BAD[name]
    xs = inputs(rng, p, 200)
    errors = outcomes(p, lambda t: gc.allreduce(xs[t.rank], comm=t, **(kw if t.rank == 1 else {})))
    assert all(type(e) is cls for e in errors), errors
    assert len({str(e) for e in errors}) == 1 and fragment in str(errors[0]) and "rank(s) 1" in str(errors[0])


def test_a_plan_rounds_stochastically_with_a_seed_per_call(rng):
    p, n = 3, 500
    xs = inputs(rng, p, n)

    def body(t):
        plan = gc.plan_allreduce(xs[t.rank], comm=t, fmt="mxfp4", rounding="stochastic")
        return plan.algorithm, plan(xs[t.rank], seed=11), plan(xs[t.rank], seed=12)

    res = gc.LoopbackGroup(p).run(body)
    for k, seed in ((1, 11), (2, 12)):
        want = simulate_allreduce(xs, "mxfp4", None, "sum", res[0][0], rounding="stochastic", seed=seed)
        assert all(same(r[k], w) for r, w in zip(res, want))
    errors = outcomes(p, lambda t: gc.plan_allreduce(xs[t.rank], comm=t, rounding="stochastic")(xs[t.rank],
                                                                                                 seed=t.rank))
    assert all(type(e) is ValueError and "disagree on seed" in str(e) for e in errors), errors


@pytest.mark.mpi
def test_formats_over_mpi():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p, r = comm.size, comm.rank
    gen = np.random.default_rng(2024)  # the same inputs on every rank
    xs = inputs(gen, p, 7000)
    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        for rounding, seed in (("nearest", None), ("stochastic", 3)):
            for algorithm in ("ring", "direct", "doubling", "oneshot", "hierarchical"):
                kw = dict(fmt=fmt, algorithm=algorithm, rounding=rounding, seed=seed, slice_elems=2048,
                          local_size=1 if algorithm == "hierarchical" else None)
                got = gc.allreduce(xs[r], comm=comm, **kw)
                want = simulate_allreduce(xs, fmt, None, "sum", algorithm, kw["local_size"], rounding=rounding,
                                          seed=seed)[r]
                assert same(got, want), kw
