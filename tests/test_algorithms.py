"""Every allreduce algorithm against its simulation, over the loopback transport, plus the cost
model's choice and the error-growth ordering that ``auto`` relies on."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import giftcomm as gc
from giftcomm.collectives.algorithms import BY_NAME, NAMES
from giftcomm.costmodel import Calibration, LinkCost, Topology, choose, predict, quantizations
from giftcomm.reference import simulate_allreduce, simulate_reduce_scatter

ALGOS = NAMES


def run(p, fn):
    return gc.LoopbackGroup(p).run(fn)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def local_sizes(p):
    return [k for k in range(1, p + 1) if p % k == 0]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("n", [1, 5, 1000, 9000])
def test_every_algorithm_equals_its_simulation(rng, p, algorithm, n):
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    for k in local_sizes(p) if BY_NAME[algorithm].needs_nodes else [None]:
        kw = dict(algorithm=algorithm, local_size=k, block=64)
        outs = run(p, lambda t: gc.allreduce(xs[t.rank], comm=t, slice_elems=128, **kw))
        want = simulate_allreduce(xs, **kw)
        assert all(same(o, w) for o, w in zip(outs, want)), (algorithm, k)


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("fmt", ["e5m2", "bf16", "fp32"])
def test_algorithms_across_dtypes_and_formats(rng, algorithm, dtype, fmt):
    p = 4
    xs = [rng.standard_normal((13, 29)).astype(dtype) for _ in range(p)]
    kw = dict(algorithm=algorithm, local_size=2, fmt=fmt, block=32, op="avg")
    outs = run(p, lambda t: gc.allreduce(xs[t.rank], comm=t, **kw))
    assert all(same(o, w) for o, w in zip(outs, simulate_allreduce(xs, **kw)))


def test_direct_reduce_scatter(rng):
    xs = [rng.standard_normal(3001).astype(np.float32) for _ in range(3)]
    shards = run(3, lambda t: gc.reduce_scatter(xs[t.rank], comm=t, algorithm="direct", slice_elems=256))
    assert all(same(s, w) for s, w in zip(shards, simulate_reduce_scatter(xs, algorithm="direct")))
    full = run(3, lambda t: gc.allgather(shards[t.rank], comm=t))
    assert same(full[0], simulate_allreduce(xs, algorithm="direct")[0])


def test_default_auto_matches_the_simulations_default(rng):
    for n in (10, 5000, 300000):
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
        outs = run(4, lambda t: gc.allreduce(xs[t.rank], comm=t))
        assert same(outs[0], simulate_allreduce(xs)[0])


def test_hierarchical_rejects_a_local_size_that_does_not_divide_p():
    def call(t):
        try:
            gc.allreduce(np.ones(10, np.float32), comm=t, algorithm="hierarchical", local_size=2)
        except ValueError as exc:
            return str(exc)

    msgs = run(3, call)
    assert all(m and "must divide" in m for m in msgs) and len(set(msgs)) == 1


def test_fp32_format_makes_every_algorithm_an_exact_sum_of_integers(rng):
    xs = [rng.integers(-500, 500, 4096).astype(np.float32) for _ in range(6)]
    for algorithm in ALGOS:
        outs = run(6, lambda t: gc.allreduce(xs[t.rank], comm=t, fmt="fp32", algorithm=algorithm, local_size=3))
        np.testing.assert_array_equal(outs[0], np.sum(xs, axis=0))


def relative_error(xs, **kw):
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    y = simulate_allreduce(xs, **kw)[0].astype(np.float64)
    return np.linalg.norm(y - exact) / np.linalg.norm(exact)


def test_error_grows_with_p_for_the_ring_but_not_for_direct(rng):
    """The ring requantizes P-1 times, direct once: at P = 16 direct is clearly more faithful."""
    xs = [rng.standard_normal(1 << 14).astype(np.float32) for _ in range(16)]
    ring, direct = relative_error(xs, algorithm="ring"), relative_error(xs, algorithm="direct")
    hier = relative_error(xs, algorithm="hierarchical", local_size=4)
    assert direct < 0.8 * ring
    assert direct <= hier < ring  # 4 nodes: 4 requantizations instead of 16


def test_cost_model_shapes():
    cal = Calibration(shm=LinkCost(1e-5, 1 / 5e9), net=LinkCost(5e-5, 1 / 1.25e8))
    one_node, two_nodes = Topology(8, 1, 8), Topology(8, 2, 4)
    # latency-bound sizes favour one exchange or recursive doubling, bandwidth-bound ones neither
    assert choose(64, one_node, "e4m3", cal=cal) in ("oneshot", "doubling")
    assert choose(1 << 24, one_node, "e4m3", cal=cal) not in ("oneshot", "doubling")
    # the one-shot exchange's bytes grow with P: many ranks move it to doubling sooner
    assert choose(1 << 14, Topology(2, 1, 2), "e4m3", cal=cal) == "oneshot"
    assert choose(1 << 14, Topology(64, 1, 64), "e4m3", cal=cal) != "oneshot"
    # over a slow network, the hierarchical algorithms win for large buffers
    assert choose(1 << 24, two_nodes, "e4m3", cal=cal).startswith("hierarchical")
    # bytes matter: e4m3 is predicted faster than fp32 on a slow link
    assert predict("ring", 1 << 24, two_nodes, "e4m3", cal=cal) < predict("ring", 1 << 24, two_nodes, "fp32", cal=cal) / 3
    assert quantizations("direct", one_node) < quantizations("ring", one_node)


def test_chunk_bounds_is_a_fresh_array_and_the_cached_copy_is_read_only():
    from giftcomm.partition import shared_chunk_bounds

    mine = gc.chunk_bounds(1000, 3, 256)
    mine[0] = 7  # the public function hands out the caller's own array
    shared = shared_chunk_bounds(1000, 3, 256)
    assert shared[0] == 0 and not shared.flags.writeable
    assert np.array_equal(gc.chunk_bounds(1000, 3, 256), shared)


@pytest.mark.parametrize("counts", [[512, 512], [768, 512, 0, 3], [1]])
def test_ring_layout_is_cached_and_agrees_with_slice_chunk(counts):
    from giftcomm.collectives import ring
    from giftcomm.formats import get_format

    f = get_format("e4m3")
    layout = ring.layout_of(np.array(counts), f, 256, 256)
    assert ring.layout_of(np.array(counts, np.int32), f, 256, 256) is layout  # same key whatever the int dtype
    sizes = [ring.slice_chunk(n, f, 256, 256).nbytes for n in counts]
    assert list(np.diff(layout.msg_offs)) == sizes and list(np.diff(layout.elem_offs)) == counts
    assert not layout.msg_offs.flags.writeable and not layout.elem_offs.flags.writeable
