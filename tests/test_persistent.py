"""Persistent allreduce plans (giftcomm.plan_allreduce): equal to the simulation of the planned
algorithm on every call; a bad array on one rank, or ranks calling different plans, raises the
same error on every rank (with the check word inside the one-shot message, and with the small
gather of the other algorithms); under mpiexec the same over MPI."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import outcomes, same

import giftcomm as gc
from giftcomm.reference import simulate_allreduce
from giftcomm.transport.device_loopback import DeviceLoopbackGroup


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [0, 7, 300, 40000])
@pytest.mark.parametrize("algorithm", ["auto", "ring", "direct", "oneshot"])
@pytest.mark.parametrize("group", [gc.LoopbackGroup, DeviceLoopbackGroup])
def test_plan_calls_equal_the_simulation(rng, p, n, algorithm, group):
    dtype = (np.float32, np.float64, np.float16)[int(rng.integers(3))]
    rounds = [[rng.standard_normal(n).astype(dtype) for _ in range(p)] for _ in range(3)]
    op = ("sum", "avg")[int(rng.integers(2))]

    def body(t):
        plan = gc.plan_allreduce(rounds[0][t.rank], comm=t, op=op, block=32, algorithm=algorithm)
        outs = [plan(r[t.rank]) for r in rounds]
        into = np.empty(n, dtype)
        assert plan(rounds[0][t.rank], out=into) is into
        return plan.algorithm, outs, into

    res = group(p).run(body)
    ran = res[0][0]
    if algorithm == "auto" and n * np.dtype(dtype).itemsize <= gc.persistent.ONESHOT_MAX_BYTES:
        assert ran == "oneshot"
    for k, xs in enumerate(rounds):
        want = simulate_allreduce(xs, "e4m3", 32, op, ran)
        assert all(same(r[1][k], w) for r, w in zip(res, want)), (ran, k)
    assert all(same(r[2], w) for r, w in zip(res, simulate_allreduce(rounds[0], "e4m3", 32, op, ran)))


@pytest.mark.parametrize("n", [64, 40000])  # one-shot (check word in the message) and ring (a gather)
def test_bad_array_on_one_rank_raises_on_every_rank(rng, n):
    p = 3
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]

    def body(t):
        plan = gc.plan_allreduce(xs[t.rank], comm=t)
        assert plan(xs[t.rank]).shape == (n,)
        return plan(xs[t.rank][:-1] if t.rank == 1 else xs[t.rank])  # rank 1 passes the wrong shape

    errors = outcomes(p, body)
    assert all(type(e) is ValueError for e in errors), errors
    assert len({str(e) for e in errors}) == 1 and "rank(s) 1" in str(errors[0]) and f"shape ({n},)" in str(errors[0])


@pytest.mark.parametrize("n", [64, 40000])
def test_ranks_calling_different_plans_raise_on_every_rank(rng, n):
    p = 2
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]

    def body(t):
        a = gc.plan_allreduce(xs[t.rank], comm=t)
        b = gc.plan_allreduce(xs[t.rank], comm=t, op="avg")
        first = a if t.rank == 0 else b  # rank 0 calls plan a while rank 1 calls plan b
        return first(xs[t.rank])

    errors = outcomes(p, body)
    assert all(type(e) is ValueError and "ranks disagree on plan" in str(e) for e in errors), errors


def test_plan_creation_agrees_like_allreduce(rng):
    xs = [rng.standard_normal(100 + r).astype(np.float32) for r in range(2)]
    errors = outcomes(2, lambda t: gc.plan_allreduce(xs[t.rank], comm=t))
    assert all(type(e) is ValueError and "ranks disagree on count" in str(e) for e in errors)


@pytest.mark.mpi
def test_plans_over_mpi(rng):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p, r = comm.size, comm.rank
    gen = np.random.default_rng(77)  # the same inputs on every rank
    for n in (100, 30000):
        xs = [gen.standard_normal(n).astype(np.float32) for _ in range(p)]
        plan = gc.plan_allreduce(xs[r], comm=comm, op="avg")
        got = [plan(xs[r]) for _ in range(3)]
        want = simulate_allreduce(xs, "e4m3", 256, "avg", plan.algorithm)[r]
        assert all(same(g, want) for g in got)
        if p > 1:
            with pytest.raises(ValueError, match="rank"):
                plan(xs[r][:-1] if r == p - 1 else xs[r])
        assert same(plan(xs[r]), want)  # the plan stays usable after an agreed error
