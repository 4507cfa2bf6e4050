"""Persistent allreduce plans (giftcomm.plan_allreduce): equal to the simulation of the planned
algorithm on every call; a bad array on one rank, or ranks calling different plans, raises the
same error on every rank (with the check word inside the one-shot message, and with the small
gather of the other algorithms); under mpiexec the same over MPI.

Plans run every format of the table through every algorithm on both schedules as a covering
design (each format x algorithm pair once per schedule, P and the size rotating: conftest.covering);
under mpiexec every format runs through a plan and through the node-shared channel."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import ALGORITHM_CHOICES, FORMAT_NAMES, block_for, covering, local_sizes, outcomes, same

import giftcomm as gc
from giftcomm.reference import simulate_allreduce
from giftcomm.reference.simulate import resolve_algorithm
from giftcomm.transport.device_loopback import DeviceLoopbackGroup

PLAN_CASES = covering(FORMAT_NAMES, ALGORITHM_CHOICES, [1, 2, 3, 5], [0, 7, 300, 40000])


@pytest.mark.parametrize("fmt, algorithm, p, n", PLAN_CASES)
@pytest.mark.parametrize("group", [gc.LoopbackGroup, DeviceLoopbackGroup])
def test_plan_calls_equal_the_simulation(rng, fmt, algorithm, p, n, group):
    """Every format through every algorithm's plan (a covering design: P and n rotating)."""
    dtype = (np.float32, np.float64, np.float16)[int(rng.integers(3))]
    rounds = [[rng.standard_normal(n).astype(dtype) for _ in range(p)] for _ in range(3)]
    op = ("sum", "avg")[int(rng.integers(2))]
    block = block_for(fmt, 32)
    local_size = local_sizes(algorithm, p)[-1]

    def body(t):
        plan = gc.plan_allreduce(rounds[0][t.rank], comm=t, op=op, fmt=fmt, block=block, algorithm=algorithm,
                                 local_size=local_size)
        outs = [plan(r[t.rank]) for r in rounds]
        into = np.empty(n, dtype)
        assert plan(rounds[0][t.rank], out=into) is into
        return plan.algorithm, outs, into

    res = group(p).run(body)
    ran = res[0][0]
    if algorithm == "auto":  # no node-shared channel here: the plain call's choice
        assert ran == resolve_algorithm("auto", n, p, local_size, fmt, block)
    for k, xs in enumerate(rounds):
        want = simulate_allreduce(xs, fmt, block, op, ran, local_size)
        assert all(same(r[1][k], w) for r, w in zip(res, want)), (ran, k)
    assert all(same(r[2], w) for r, w in zip(res, simulate_allreduce(rounds[0], fmt, block, op, ran, local_size)))


def test_a_plan_rounds_stochastically_with_a_seed_per_call(rng):
    p, n = 3, 500
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]

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
    for i, fmt in enumerate(FORMAT_NAMES):  # every format, the size alternating
        n = (100, 30000)[i % 2]
        xs = [gen.standard_normal(n).astype(np.float32) for _ in range(p)]
        plan = gc.plan_allreduce(xs[r], comm=comm, op="avg", fmt=fmt)
        got = [plan(xs[r]) for _ in range(3)]
        want = simulate_allreduce(xs, fmt, None, "avg", plan.algorithm)[r]
        assert all(same(g, want) for g in got)
        if p > 1:
            with pytest.raises(ValueError, match="rank"):
                plan(xs[r][:-1] if r == p - 1 else xs[r])
        assert same(plan(xs[r]), want)  # the plan stays usable after an agreed error


def _shared_inputs(comm, rng, n: int, dtype=np.float32) -> list[np.ndarray]:
    """Every rank's input, the same list on every rank (rank 0's seed)."""
    gen = np.random.default_rng(comm.bcast(int(rng.integers(2**31)), root=0))
    return [gen.standard_normal(n).astype(dtype) for _ in range(comm.size)]


def _channel_of(comm):
    from giftcomm.transport import resolve

    return resolve(comm).state.channel


@pytest.mark.mpi
@pytest.mark.parametrize("fmt, op", [(f, ("sum", "avg")[i % 2]) for i, f in enumerate(FORMAT_NAMES)])
def test_channel_plans_equal_the_simulation_on_every_call(rng, fmt, op):
    """On one node a one-shot plan's calls go through the shared-memory channel (native encode,
    exchange and rank-order sum); every call, with and without out= (in place too), equals the
    simulation bit for bit."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    r = comm.rank
    for n in (1, 255, 4096):
        xs = _shared_inputs(comm, rng, n)
        plan = gc.plan_allreduce(xs[r], comm=comm, op=op, fmt=fmt, allow_native=False)  # auto among giftcomm's rows
        assert plan.algorithm == "oneshot" and _channel_of(comm) is not None
        want = simulate_allreduce(xs, fmt, None, op, "oneshot")[r]
        for _ in range(3):  # both slots, and a slot reused
            assert same(plan(xs[r]), want)
        out = np.full(n, np.nan, np.float32)
        assert plan(xs[r], out=out) is out and same(out, want)
        mine = xs[r].copy()
        plan(mine, out=mine)
        assert same(mine, want)


@pytest.mark.mpi
def test_channel_slow_paths_equal_the_simulation(rng):
    """Stochastic rounding, 16-bit input and a larger (ring) plan also go through the channel
    (the message encoded in Python, or the header alone); a bigger plan grows the channel and
    the older plan keeps working."""
    import ml_dtypes
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    r = comm.rank
    xs = _shared_inputs(comm, rng, 1000)
    sr = gc.plan_allreduce(xs[r], comm=comm, fmt="nvfp4", rounding="stochastic", allow_native=False)
    for seed in (3, 2**63 + 5):
        assert same(sr(xs[r], seed=seed), simulate_allreduce(xs, "nvfp4", None, "sum", "oneshot",
                                                             rounding="stochastic", seed=seed)[r])
    halves = [x.astype(ml_dtypes.bfloat16) for x in xs]
    bf = gc.plan_allreduce(halves[r], comm=comm, op="avg", allow_native=False)
    assert same(bf(halves[r]), simulate_allreduce(halves, "e4m3", None, "avg", "oneshot")[r])
    small = gc.plan_allreduce(xs[r], comm=comm, allow_native=False)  # (auto among giftcomm's rows: oneshot)
    big_in = _shared_inputs(comm, rng, 32768, np.float16)  # 64 KiB in, 128 KiB of fp32 on the wire
    big = gc.plan_allreduce(big_in[r], comm=comm, fmt="fp32", algorithm="oneshot")  # a larger payload
    assert same(big(big_in[r]), simulate_allreduce(big_in, "fp32", None, "sum", "oneshot")[r])
    assert same(small(xs[r]), simulate_allreduce(xs, "e4m3", None, "sum", "oneshot")[r])
    ring_in = _shared_inputs(comm, rng, 50000)
    ring = gc.plan_allreduce(ring_in[r], comm=comm, algorithm="ring")
    assert same(ring(ring_in[r]), simulate_allreduce(ring_in, "e4m3", None, "sum", "ring")[r])


@pytest.mark.mpi
@pytest.mark.multirank
def test_channel_disagreements_raise_on_every_rank(rng):
    """Over the channel: a float64 array on the last rank (the others on the native fast path),
    and ranks calling different plans, raise the same error on every rank; the plans stay usable."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p, r = comm.size, comm.rank
    xs = _shared_inputs(comm, rng, 300)
    a = gc.plan_allreduce(xs[r], comm=comm)
    b = gc.plan_allreduce(xs[r][:200], comm=comm)
    with pytest.raises(ValueError, match=r"bad input on rank\(s\) " + str(p - 1)):
        a(xs[r].astype(np.float64) if r == p - 1 else xs[r])
    with pytest.raises(ValueError, match="ranks disagree on plan"):
        a(xs[r]) if r == 0 else b(xs[r][:200])
    assert same(a(xs[r]), simulate_allreduce(xs, "e4m3", None, "sum", "oneshot")[r])


@pytest.mark.mpi
@pytest.mark.multirank
def test_channel_encode_failure_on_one_rank_raises_on_every_rank(rng, monkeypatch):
    """A failure after the local checks (here: reading the array on the last rank, on the
    channel's Python path) still reaches the other ranks: the same error everywhere, no wait."""
    from mpi4py import MPI

    import giftcomm.plans.persistent as persistent

    comm = MPI.COMM_WORLD
    p, r = comm.size, comm.rank
    xs = _shared_inputs(comm, rng, 500)
    plan = gc.plan_allreduce(xs[r], comm=comm, rounding="stochastic")  # stochastic: the Python path
    if r == p - 1:
        def broken(call):
            raise ZeroDivisionError("cannot read the array")

        monkeypatch.setattr(persistent.calls, "flat_values", broken)
    with pytest.raises(RuntimeError, match=rf"bad input on rank\(s\) {p - 1}.*ZeroDivisionError"):
        plan(xs[r], seed=9)
    monkeypatch.undo()
    assert same(plan(xs[r], seed=9), simulate_allreduce(xs, "e4m3", None, "sum", "oneshot", rounding="stochastic",
                                                        seed=9)[r])
