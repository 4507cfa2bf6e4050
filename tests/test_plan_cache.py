"""The plain calls' plan cache (giftcomm.plans.cache): repeated allreduces run their cached plan,
equal to the simulation bit for bit; calls whose signatures (shape, dtype, format, out=) differ
across ranks, hitting and missing the cache in any mix, raise "ranks disagree" on every rank or
run correctly, never mixing; a plan's call against a plain call raises on every rank; the cache
is bounded (LRU) and released with the transport's state. Under mpiexec: the same over MPI."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import outcomes, same

import giftcomm as gc
from giftcomm.plans import cache as plan_cache
from giftcomm.reference import simulate_allreduce

# (shape, dtype, fmt, out=, algorithm): A and B agree (count, dtype, fmt, algorithm) while their shapes and
# out= differ; the last two run the transport's own allreduce (algorithm="native") under the same signature
VARIANTS = [((64,), np.float32, "e4m3", False, "auto"), ((8, 8), np.float32, "e4m3", True, "auto"),
            ((64,), np.float64, "e4m3", False, "auto"), ((96,), np.float32, "e4m3", True, "auto"),
            ((64,), np.float32, "bf16", False, "auto"), ((64,), np.float32, "e4m3", False, "native"),
            ((8, 8), np.float32, "bf16", True, "native")]


def _inputs(step: int, size: int, n: int, dtype) -> list[np.ndarray]:
    gen = np.random.default_rng(1000 + step)
    return [gen.standard_normal(n).astype(dtype) for _ in range(size)]


def _alternate(comm, t, rank: int, size: int, seed: int, steps: int) -> list[str]:
    """``steps`` calls, each rank drawing its variant at random; checks every outcome and returns
    what each step did ("ok" / "disagree") for the caller to compare across ranks."""
    picks = [np.random.default_rng([seed, q]).integers(len(VARIANTS), size=steps) for q in range(size)]
    for q in range(1, size):  # every third step the ranks draw alike, so agreeing calls occur at any P
        picks[q][::3] = picks[0][::3]
    done = []
    for step in range(steps):
        mine = VARIANTS[picks[rank][step]]
        shape, dtype, fmt, with_out, algorithm = mine
        every = [VARIANTS[picks[q][step]] for q in range(size)]
        agree = len({(int(np.prod(v[0])), v[1], v[2], v[4]) for v in every}) == 1
        n = int(np.prod(shape))
        xs = _inputs(step, size, n, dtype)
        x = xs[rank].reshape(shape)
        kept = x.copy()
        out = np.full(shape, np.nan, dtype) if with_out else None
        try:
            got = gc.allreduce(x, comm=comm, fmt=fmt, out=out, algorithm=algorithm)
        except ValueError as exc:
            assert not agree and "ranks disagree" in str(exc), (step, every, exc)
            done.append("disagree")
            continue
        assert agree, (step, every)
        assert same(x, kept)  # the input is not modified
        if with_out:
            assert got is out
        algorithm = max(t.state.plan_cache.values(), key=lambda p: p.used).algorithm  # the plan this call ran or made
        assert gc.api.last_algorithm(comm)[0] == algorithm  # cached calls report what they ran too
        want = simulate_allreduce(xs, fmt, None, "sum", algorithm)[rank]
        assert same(got.reshape(-1), want), (step, every, algorithm)
        done.append("ok")
    return done


@pytest.mark.parametrize("p", [2, 3])
def test_alternating_signatures_never_mix(p):
    def body(t):
        return _alternate(t, t, t.rank, p, seed=p, steps=24)

    res = gc.LoopbackGroup(p, shared_memory=True).run(body)
    assert all(r == res[0] for r in res) and {"ok", "disagree"} <= set(res[0])


def test_repeated_calls_reuse_one_plan(rng):
    xs = [rng.standard_normal(300).astype(np.float32) for _ in range(2)]

    def body(t):
        outs = [gc.allreduce(xs[t.rank], comm=t, op="avg") for _ in range(4)]
        plans = list(t.state.plan_cache.values())
        return outs, [id(p) for p in plans], plans[0].algorithm

    res = gc.LoopbackGroup(2, shared_memory=True).run(body)
    assert all(len(r[1]) == 1 for r in res)
    want = simulate_allreduce(xs, "e4m3", None, "avg", res[0][2])
    assert all(same(o, want[q]) for q, r in enumerate(res) for o in r[0])


def test_bad_input_after_a_cached_call_raises_on_every_rank(rng):
    xs = [rng.standard_normal(64).astype(np.float32) for _ in range(3)]

    def body(t):
        gc.allreduce(xs[t.rank], comm=t)  # cached on every rank
        bad = xs[t.rank].astype(np.int32) if t.rank == 1 else xs[t.rank]
        return gc.allreduce(bad, comm=t)

    errors = outcomes(3, body, group=lambda p: gc.LoopbackGroup(p, shared_memory=True))
    assert all(type(e) is TypeError and "rank(s) 1" in str(e) for e in errors), errors
    assert len({str(e) for e in errors}) == 1


def test_plan_call_against_a_plain_call_raises_on_every_rank(rng):
    xs = [rng.standard_normal(64).astype(np.float32) for _ in range(2)]

    def body(t):
        plan = gc.plan_allreduce(xs[t.rank], comm=t)
        gc.allreduce(xs[t.rank], comm=t)  # cached everywhere
        if t.rank == 0:
            return plan(xs[0])
        return gc.allreduce(xs[1], comm=t)  # a cached hit here

    errors = outcomes(2, body, group=lambda p: gc.LoopbackGroup(p, shared_memory=True))
    assert all(type(e) is ValueError and "ranks disagree on plan" in str(e) for e in errors), errors

    def missing(t):
        plan = gc.plan_allreduce(xs[t.rank], comm=t)
        return plan(xs[0]) if t.rank == 0 else gc.allreduce(xs[1][:10], comm=t)  # a miss here

    errors = outcomes(2, missing, group=lambda p: gc.LoopbackGroup(p, shared_memory=True))
    assert all(type(e) is ValueError and "ranks disagree" in str(e) for e in errors), errors


def test_cache_is_bounded_and_released(rng, monkeypatch):
    monkeypatch.setattr(plan_cache, "PLAN_CACHE_SIZE", 3)
    sizes = [10, 20, 30, 40, 10]

    def body(t):
        lengths = []
        for n in sizes:
            gc.allreduce(np.ones(n, np.float32), comm=t)
            lengths.append(len(t.state.plan_cache))
        kept = sorted(p.shape[0] for p in t.state.plan_cache.values())
        t.release_state()
        return lengths, kept, len(t.state.plan_cache)

    res = gc.LoopbackGroup(2, shared_memory=True).run(body)
    assert all(r == ([1, 2, 3, 3, 3], [10, 30, 40], 0) for r in res), res


def test_no_cache_without_a_channel(rng):
    def body(t):
        out = gc.allreduce(np.ones(16, np.float32), comm=t)
        return out, len(t.state.plan_cache)

    res = gc.LoopbackGroup(2).run(body)  # no shared memory: every call agrees
    assert all(r[1] == 0 and same(r[0], np.full(16, 2, np.float32)) for r in res)


@pytest.mark.mpi
def test_alternating_signatures_over_mpi():
    from mpi4py import MPI

    from giftcomm.transport import resolve

    comm = MPI.COMM_WORLD
    seed = comm.bcast(int(np.random.default_rng().integers(2**31)), root=0)
    done = _alternate(comm, resolve(comm), comm.rank, comm.size, seed, steps=24)
    assert comm.allgather(done) == [done] * comm.size and "ok" in done


def test_gift_allreduce_without_geometry_is_the_cached_allreduce(rng):
    """gift_allreduce(x, None) is allreduce: the same cached plan (so the same auto choice) and
    the same bytes."""
    xs = [rng.standard_normal(500).astype(np.float32) for _ in range(2)]

    def body(t):
        a = gc.gift_allreduce(xs[t.rank], None, comm=t)
        b = gc.allreduce(xs[t.rank], comm=t)
        return a, b, len(t.state.plan_cache), gc.api.last_algorithm(t)[0]

    res = gc.LoopbackGroup(2, shared_memory=True).run(body)
    want = simulate_allreduce(xs, "e4m3", None, "sum", res[0][3])
    assert all(r[2] == 1 and same(r[0], want[0]) and same(r[1], want[0]) for r in res)


def test_call_options_keep_their_hash_out_of_pickles():
    """CallOptions remembers its hash (the cache hashes it on every call); a pickle carries none,
    since string hashes differ between processes."""
    import pickle

    from giftcomm.options import CallOptions

    o = CallOptions.of(fmt="nvfp4", rounding="stochastic", seed=3)
    h = hash(o)
    assert "_hash" in o.__dict__
    back = pickle.loads(pickle.dumps(o))
    assert "_hash" not in back.__dict__
    assert back == o and hash(back) == h
    assert o.replace(seed=4) != o and {o: 1}.get(o.replace(seed=3)) == 1


# (count, dtype, fmt, out=, layout): reduce_scatter signatures; the first two agree (count, dtype, fmt, layout)
# while out= differs
SCATTER_VARIANTS = [(96, np.float32, "e4m3", False, "equal"), (96, np.float32, "e4m3", True, "equal"),
                    (96, np.float32, "e4m3", False, "blocks"), (96, np.float64, "e4m3", False, "equal"),
                    (128, np.float32, "nvfp4", True, "equal"), (96, np.float32, "bf16", False, "equal")]


def _alternate_scatters(t, rank: int, size: int, seed: int, steps: int) -> list[str]:
    """``steps`` reduce_scatters, each rank drawing its signature at random (every third step
    alike), each then allgathered; checks every outcome against the simulation and returns what
    each step did ("ok" / "disagree")."""
    from giftcomm.reference import simulate_reduce_scatter

    picks = [np.random.default_rng([seed, q]).integers(len(SCATTER_VARIANTS), size=steps) for q in range(size)]
    for q in range(1, size):
        picks[q][::3] = picks[0][::3]
    done = []
    for step in range(steps):
        n, dtype, fmt, with_out, layout = SCATTER_VARIANTS[picks[rank][step]]
        every = [SCATTER_VARIANTS[picks[q][step]] for q in range(size)]
        agree = len({(v[0], v[1], v[2], v[4]) for v in every}) == 1
        xs = _inputs(step, size, n * size, dtype)
        blocks = gc.chunk_bounds(n * size, size, gc.formats.resolve_block(fmt, None))
        shard_n = n if layout == "equal" else int(blocks[rank + 1] - blocks[rank])
        out = np.full(shard_n, np.nan, dtype) if with_out else None
        try:
            shard = gc.reduce_scatter(xs[rank], comm=t, fmt=fmt, out=out, layout=layout)
        except ValueError as exc:
            assert not agree and "disagree" in str(exc), (step, exc)
            done.append("disagree")
            continue
        assert agree, step
        ran = gc.api.last_algorithm(t)[0]
        want = simulate_reduce_scatter(xs, fmt, None, "sum", ran, layout=layout)
        assert same(shard, want[rank]) and (out is None or shard is out), (step, ran)
        full = gc.allgather(shard, comm=t, fmt="fp32")  # every rank's shard, each through float32
        assert same(full, np.concatenate(want).astype(np.float32).astype(dtype)), step
        done.append("ok")
    return done


@pytest.mark.parametrize("p", [2, 3])
def test_repeated_reduce_scatters_and_allgathers_reuse_the_agreed_job_and_never_mix(p):
    """Equal signatures run (the cached job from the second time on) and equal the simulation bit
    for bit; differing ones raise "ranks disagree" on every rank, whether the ranks hit or miss
    the cache; afterwards the cache holds the agreed jobs."""

    def body(t):
        return _alternate_scatters(t, t.rank, p, seed=p, steps=24), len(t.state.plan_cache)

    res = gc.LoopbackGroup(p, shared_memory=True).run(body)
    assert all(r[0] == res[0][0] for r in res) and {"ok", "disagree"} <= set(res[0][0])
    assert all(r[1] > 0 for r in res)


@pytest.mark.mpi
def test_alternating_reduce_scatter_signatures_over_mpi():
    from mpi4py import MPI

    from giftcomm.transport import resolve

    comm = MPI.COMM_WORLD
    seed = comm.bcast(int(np.random.default_rng().integers(2**31)), root=0)
    done = _alternate_scatters(resolve(comm), comm.rank, comm.size, seed, steps=24)
    assert comm.allgather(done) == [done] * comm.size and "ok" in done


def test_bad_input_in_a_cached_reduce_scatter_raises_on_every_rank_and_the_cache_stays_usable(rng):
    xs = [rng.standard_normal(64).astype(np.float32) for _ in range(2)]

    def body(t):
        for _ in range(2):
            gc.reduce_scatter(xs[t.rank], comm=t, layout="equal")  # cached from the second call
        bad = np.full(31, np.nan, np.float32) if t.rank == 1 else None  # out of the wrong length on rank 1
        try:
            gc.reduce_scatter(xs[t.rank], comm=t, layout="equal", out=bad)
            err = None
        except ValueError as exc:
            err = str(exc)
        again = gc.reduce_scatter(xs[t.rank], comm=t, layout="equal")
        return err, again, gc.api.last_algorithm(t)[0]

    from giftcomm.reference import simulate_reduce_scatter

    res = gc.LoopbackGroup(2, shared_memory=True).run(body)
    assert res[0][0] is not None and res[0][0] == res[1][0] and "rank(s) 1" in res[0][0], res
    want = simulate_reduce_scatter(xs, "e4m3", None, "sum", res[0][2], layout="equal")
    assert all(same(r[1], want[q]) for q, r in enumerate(res))
