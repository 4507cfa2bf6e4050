"""The ring collectives over the in-process loopback transport, against the reference simulation.

P virtual ranks run as threads; every rank's output must equal the simulation bit for bit.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import giftcomm as gc
from giftcomm.reference import simulate_allgather, simulate_allreduce, simulate_reduce_scatter

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]


def run(p, fn):
    return gc.LoopbackGroup(p).run(fn)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def inputs(rng, p, shape, dtype, scale=1.0):
    return [(rng.standard_normal(shape) * scale).astype(dtype) for _ in range(p)]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", [0, 1, 3, 7, 300, 4099])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "bf16", "fp16", "fp32"])
def test_allreduce_equals_simulation(rng, p, n, fmt):
    xs = inputs(rng, p, (n,), np.float32)
    outs = run(p, lambda t: gc.allreduce(xs[t.rank], comm=t, fmt=fmt, block=32))
    want = simulate_allreduce(xs, fmt=fmt, block=32)
    assert all(same_bytes(o, w) for o, w in zip(outs, want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_allreduce_dtypes_ops_and_shapes(rng, dtype, op):
    p = 3
    xs = inputs(rng, p, (5, 7, 11), dtype)
    outs = run(p, lambda t: gc.allreduce(xs[t.rank], comm=t, op=op, block=16))
    want = simulate_allreduce(xs, block=16, op=op)
    assert all(same_bytes(o, w) for o, w in zip(outs, want))
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0) / (p if op == "avg" else 1)
    rel = np.linalg.norm(outs[0].astype(np.float64) - exact) / np.linalg.norm(exact)
    assert rel < 0.1  # e4m3 with 3 mantissa bits, three ranks


def test_fp32_format_is_an_exact_ring_sum_of_small_integers(rng):
    p = 4
    xs = [rng.integers(-1000, 1000, 1234).astype(np.float32) for _ in range(p)]
    outs = run(p, lambda t: gc.allreduce(xs[t.rank], comm=t, fmt="fp32"))
    np.testing.assert_array_equal(outs[0], np.sum(xs, axis=0))


def test_input_is_not_modified_and_non_contiguous_input_is_accepted(rng):
    p = 3
    base = [rng.standard_normal((40, 30)).astype(np.float32) for _ in range(p)]
    views = [b[::2, 1::3] for b in base]
    before = [b.copy() for b in base]
    outs = run(p, lambda t: gc.allreduce(views[t.rank], comm=t))
    want = simulate_allreduce([np.ascontiguousarray(v) for v in views])
    assert all(same_bytes(o, w) for o, w in zip(outs, want))
    assert all(np.array_equal(b, c) for b, c in zip(base, before))


@pytest.mark.parametrize("algorithm", ["ring", "direct", "doubling"])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("shape", [(1000,), (25, 40)])
def test_out_argument_including_in_place(rng, algorithm, op, shape):
    # ring and direct decode straight into a contiguous float32 out; the rest copy into it
    p = 3
    xs = inputs(rng, p, shape, np.float32)
    want = simulate_allreduce(xs, op=op, algorithm=algorithm)
    outs_buf = [np.empty(shape, np.float32) for _ in range(p)]
    got = run(p, lambda t: gc.allreduce(xs[t.rank], comm=t, op=op, out=outs_buf[t.rank], algorithm=algorithm))
    assert all(g is o for g, o in zip(got, outs_buf))
    assert all(same_bytes(o, w) for o, w in zip(outs_buf, want))
    inplace = [x.copy() for x in xs]
    run(p, lambda t: gc.allreduce(inplace[t.rank], comm=t, op=op, out=inplace[t.rank], algorithm=algorithm))
    assert all(same_bytes(o, w) for o, w in zip(inplace, want))
    fortran = [np.empty(shape, np.float32, order="F") for _ in range(p)]  # not C-contiguous
    run(p, lambda t: gc.allreduce(xs[t.rank], comm=t, op=op, out=fortran[t.rank], algorithm=algorithm))
    assert all(np.array_equal(f.view(np.uint32), w.view(np.uint32)) for f, w in zip(fortran, want))


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16])
def test_reduce_scatter_and_allgather(rng, p, dtype):
    n = 1000
    xs = inputs(rng, p, (n,), dtype)
    shards = run(p, lambda t: gc.reduce_scatter(xs[t.rank], comm=t, block=64))
    want = simulate_reduce_scatter(xs, block=64)
    assert all(same_bytes(s, w) for s, w in zip(shards, want))
    bounds = gc.chunk_bounds(n, p, 64)
    assert [s.size for s in shards] == list(np.diff(bounds))
    gathered = run(p, lambda t: gc.allgather(shards[t.rank], comm=t, block=64))
    assert all(same_bytes(g, w) for g, w in zip(gathered, simulate_allgather(shards, block=64)))
    if dtype != ml_dtypes.bfloat16:  # the shard is the unrounded sum: gathering it is the allreduce
        full = simulate_allreduce(xs, block=64, algorithm="ring")
        assert all(same_bytes(g, f) for g, f in zip(gathered, full))


def test_allgather_of_unequal_shards(rng):
    shards = [rng.standard_normal(n).astype(np.float32) for n in (5, 0, 300)]
    outs = run(3, lambda t: gc.allgather(shards[t.rank], comm=t, fmt="e5m2"))
    want = simulate_allgather(shards, fmt="e5m2")
    assert all(same_bytes(o, w) for o, w in zip(outs, want))
    assert outs[0].size == 305


def raised(p, fn):
    """Run fn on p virtual ranks; return each rank's exception (type, message) or None."""

    def body(t):
        try:
            fn(t)
        except (TypeError, ValueError) as exc:
            return type(exc), str(exc)
        return None

    return run(p, body)


@pytest.mark.parametrize(
    "bad, exc, text",
    [
        (dict(count=True), ValueError, "disagree on count"),
        (dict(dtype=True), ValueError, "disagree on dtype"),
        (dict(fmt=True), ValueError, "disagree on fmt"),
        (dict(block=True), ValueError, "disagree on block"),
        (dict(op=True), ValueError, "disagree on op"),
        (dict(int_input=True), TypeError, "must be float32"),
        (dict(unknown_fmt=True), ValueError, "unknown format"),
        (dict(zero_block=True), ValueError, "block must be"),
        (dict(bad_out=True), ValueError, "out must have"),
    ],
)
def test_bad_input_raises_the_same_error_on_every_rank(rng, bad, exc, text):
    p = 3

    def call(t):
        odd = t.rank == 1
        x = rng.standard_normal(10 + (odd and bad.get("count", False))).astype(
            np.float64 if odd and bad.get("dtype") else np.float32)
        if odd and bad.get("int_input"):
            x = np.arange(10)
        kw = dict(
            fmt="e5m2" if odd and bad.get("fmt") else ("x8" if odd and bad.get("unknown_fmt") else "e4m3"),
            block=(64 if bad.get("block") else 0 if bad.get("zero_block") else 32) if odd else 32,
            op="avg" if odd and bad.get("op") else "sum",
            out=np.empty(3, np.float32) if odd and bad.get("bad_out") else None,
        )
        gc.allreduce(x, comm=t, **kw)

    results = raised(p, call)
    assert all(r is not None and r[0] is exc and text in r[1] for r in results), results
    assert len({r[1] for r in results}) == 1  # the very same message everywhere
    # and the transport is still usable afterwards
    xs = inputs(rng, p, (50,), np.float32)
    outs = run(p, lambda t: gc.allreduce(xs[t.rank], comm=t))
    assert same_bytes(outs[0], simulate_allreduce(xs)[0])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "bf16", "fp32"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_input_on_one_rank_is_non_finite_everywhere(rng, fmt, bad):
    p = 4
    xs = inputs(rng, p, (2000,), np.float32)
    xs[2][777] = bad
    outs = run(p, lambda t: gc.allreduce(xs[t.rank], comm=t, fmt=fmt))
    for o in outs:
        assert not np.isfinite(o[777])
        if fmt in ("e4m3", "e5m2"):  # the whole 256-block holding it, and nothing else
            assert np.all(np.isnan(o[768:1024]))
            assert np.all(np.isfinite(o[:768])) and np.all(np.isfinite(o[1024:]))
    assert same_bytes(outs[0], simulate_allreduce(xs, fmt=fmt)[0])


def test_gift_allreduce_without_geometry_or_with_the_identity_is_the_plain_allreduce(rng):
    """No geometry, or the identity geometry, gives the plain allreduce's bytes: checked against
    the simulation (allreduce itself is gift_allreduce without a geometry)."""
    from giftcomm.geometry import Geometry

    xs = inputs(rng, 3, (999,), np.float32)
    want = simulate_allreduce(xs, algorithm="ring")
    for geo in (None, Geometry.identity(999)):
        got = run(3, lambda t: gc.gift_allreduce(xs[t.rank], geo, comm=t, algorithm="ring"))
        assert all(same_bytes(x, y) for x, y in zip(got, want))


def test_comm_of_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="comm must be"):
        gc.allreduce(np.zeros(3, np.float32), comm="world")


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("slice_elems", [1, 32, 96, 1000, 1 << 18])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_pipelined_ring_is_bit_identical_for_every_slice_size(rng, p, slice_elems, dtype):
    """Slices are whole blocks, so the bytes of each block do not depend on how the hop is cut."""
    n = 32 * 37 + 5  # 38 blocks of 32, the last one partial: uneven chunks, several slices each
    xs = inputs(rng, p, (n,), dtype)
    outs = run(p, lambda t: gc.allreduce(xs[t.rank], comm=t, block=32, slice_elems=slice_elems))
    want = simulate_allreduce(xs, block=32)
    assert all(same_bytes(o, w) for o, w in zip(outs, want))
    shards = run(p, lambda t: gc.reduce_scatter(xs[t.rank], comm=t, block=32, slice_elems=slice_elems))
    assert all(same_bytes(s, w) for s, w in zip(shards, simulate_reduce_scatter(xs, block=32)))


def test_slice_size_must_agree(rng):
    results = raised(2, lambda t: gc.allreduce(np.ones(100, np.float32), comm=t, slice_elems=256 * (1 + t.rank)))
    assert all(r is not None and "disagree on slice" in r[1] for r in results)
