"""reduce_scatter(layout="equal"): FSDP's / ZeRO's equal contiguous shards, for every format,
rounding and reduce-scatter algorithm, against the reference simulation of the same layout, bit
for bit; bad layouts raise on every rank. In-process ranks (pipelined and grouped loopback)."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_same_error, outcomes, same

import giftcomm as gc
from giftcomm.formats import FORMATS
from giftcomm.reference import simulate_reduce_scatter
from giftcomm.reference.simulate import resolve_algorithm
from giftcomm.transport.device_loopback import DeviceLoopbackGroup


def inputs(rng, p, n, dtype=np.float32):
    return [(rng.standard_normal(n) * np.exp(rng.uniform(-6, 6, n) / 4)).astype(dtype) for _ in range(p)]


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_equal_layout_matches_simulation_for_every_format_and_algorithm(rng, p, fmt):
    # shards of 1370 values: neither a multiple of any block (16, 32, 256) nor of nvfp4's group (1024)
    n = 1370 * p
    xs = inputs(rng, p, n)
    scaled = FORMATS[fmt].scaled
    for algorithm, group, rounding in [("ring", gc.LoopbackGroup, "nearest"), ("direct", DeviceLoopbackGroup, "nearest"),
                                       ("auto", gc.LoopbackGroup, "stochastic" if scaled else "nearest")]:
        seed = 7 if rounding == "stochastic" else None
        op = "avg" if algorithm == "direct" else "sum"
        # auto without the native path: this test is about giftcomm's own shards
        got = group(p).run(lambda t: gc.reduce_scatter(xs[t.rank], comm=t, fmt=fmt, op=op, algorithm=algorithm,
                                                       slice_elems=512, rounding=rounding, seed=seed, layout="equal",
                                                       allow_native=False))
        sim_algorithm = resolve_algorithm(algorithm, n, p, None, fmt, allow_native=False, kind="reduce_scatter")
        want = simulate_reduce_scatter(xs, fmt, None, op, sim_algorithm, rounding=rounding, seed=seed, layout="equal")
        for r in range(p):
            assert got[r].shape == (n // p,), (algorithm, got[r].shape)
            assert same(got[r], want[r]), (fmt, algorithm, r)


def test_equal_layout_shards_are_the_equal_slices_and_default_stays_blocks(rng):
    p, n = 3, 3 * 333
    xs = inputs(rng, p, n)
    exact = np.sum(xs, axis=0, dtype=np.float64)
    got = gc.LoopbackGroup(p).run(lambda t: gc.reduce_scatter(xs[t.rank], comm=t, fmt="fp32", layout="equal"))
    for r in range(p):
        np.testing.assert_allclose(got[r], exact[r * 333 : (r + 1) * 333], rtol=1e-6, atol=1e-6)
    blocks = gc.LoopbackGroup(p).run(lambda t: gc.reduce_scatter(xs[t.rank], comm=t, block=64))
    bounds = gc.chunk_bounds(n, p, 64)
    assert [b.size for b in blocks] == list(np.diff(bounds)) != [333] * 3


def test_equal_layout_of_torch_bfloat16_into_out(rng):
    import torch
    p, n = 2, 2 * 301
    xs = [torch.from_numpy(x).to(torch.bfloat16) for x in inputs(rng, p, n)]
    outs = [torch.empty(n // p, dtype=torch.bfloat16) for _ in range(p)]
    got = gc.LoopbackGroup(p).run(lambda t: gc.reduce_scatter(xs[t.rank], comm=t, out=outs[t.rank], layout="equal"))
    want = simulate_reduce_scatter([x.float().numpy() for x in xs], layout="equal")
    for r in range(p):
        assert got[r] is outs[r]
        assert torch.equal(outs[r], torch.from_numpy(want[r]).to(torch.bfloat16))


def test_equal_layout_that_does_not_divide_raises_on_every_rank(rng):
    xs = inputs(rng, 3, 1000)
    errors = outcomes(3, lambda t: gc.reduce_scatter(xs[t.rank], comm=t, layout="equal"))
    assert_same_error(errors, ValueError, "layout='equal'", "1000 elements on 3 ranks", "1002")


def test_unknown_or_disagreeing_layout_raises_on_every_rank(rng):
    xs = inputs(rng, 2, 512)
    assert_same_error(outcomes(2, lambda t: gc.reduce_scatter(xs[t.rank], comm=t, layout="rows")), ValueError,
                      "layout must be one of")
    errors = outcomes(2, lambda t: gc.reduce_scatter(xs[t.rank], comm=t, layout=("blocks", "equal")[t.rank]))
    assert_same_error(errors, ValueError, "ranks disagree on layout")


def test_simulation_rejects_a_layout_that_does_not_divide(rng):
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        simulate_reduce_scatter(inputs(rng, 2, 7), layout="equal")
