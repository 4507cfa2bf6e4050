"""Invariant 6 (tests/README.md): accumulation is fp32 (or wider) at every hop; the wire format
is only the wire format.

- With the fp32 pass-through format every algorithm is an exact sum of small integers (a sum
  rounded to a narrower type at any hop would not be).
- 16-bit inputs whose sum overflows their own type (but not float32) average to the right
  finite value through every algorithm: the sum was never held in the input's type.
- A block-scaled format's direct reduce-scatter shard is exactly the float32 sum, in rank order,
  of every other rank's decoded contribution and its own exact values: quantized once, then summed in fp32 (the
  codec's fused hop is checked the same way in tests/test_codec_reference.py).
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import ALGORITHM_NAMES, SCALED_FORMATS, local_sizes, same

import giftcomm as gc
from giftcomm import codec
from giftcomm.reference import simulate_allreduce


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_fp32_format_makes_every_algorithm_an_exact_sum_of_integers(rng, algorithm):
    p = 6
    xs = [rng.integers(-500, 500, 4096).astype(np.float32) for _ in range(p)]
    local_size = local_sizes(algorithm, p)[-2] if len(local_sizes(algorithm, p)) > 1 else None
    outs = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt="fp32", algorithm=algorithm,
                                                          local_size=local_size))
    assert all(np.array_equal(o, np.sum(xs, axis=0)) for o in outs)


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_sixteen_bit_sums_past_their_range_average_correctly(rng, algorithm):
    """Four fp16 inputs near 40000: their sum (~160000) overflows float16 (max 65504), their
    average does not; bf16 inputs summed past 2^8 * their spacing keep the small parts."""
    p = 4
    xs = [(40000 + rng.integers(-64, 64, 300) * 8).astype(np.float16) for _ in range(p)]
    local_size = local_sizes(algorithm, p)[1] if len(local_sizes(algorithm, p)) > 1 else None
    outs = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt="fp32", op="avg",
                                                          algorithm=algorithm, local_size=local_size))
    exact = (np.sum([x.astype(np.float64) for x in xs], axis=0) / p).astype(np.float16)
    assert all(o.dtype == np.float16 and np.all(np.isfinite(o)) for o in outs)
    assert all(np.array_equal(o, exact) for o in outs)
    assert same(outs[0], simulate_allreduce(xs, "fp32", None, "avg", algorithm, local_size)[0])


@pytest.mark.parametrize("fmt", SCALED_FORMATS)
def test_direct_shard_is_the_fp32_sum_of_the_decoded_contributions(rng, fmt):
    p, n = 5, 3000
    xs = [(rng.standard_normal(n) * np.exp(rng.uniform(-4, 4, n))).astype(np.float32) for _ in range(p)]
    shards = gc.LoopbackGroup(p).run(lambda t: gc.reduce_scatter(xs[t.rank], comm=t, fmt=fmt, algorithm="direct"))
    bounds = gc.chunk_bounds(n, p, gc.formats.resolve_block(fmt, None))
    for r in range(p):
        lo, hi = int(bounds[r]), int(bounds[r + 1])
        acc = np.zeros(hi - lo, np.float32)
        for q in range(p):
            mine = xs[q][lo:hi]  # the owner's own values travel nowhere: added exactly
            acc += mine if q == r else codec.decode(codec.encode(mine, fmt), hi - lo, fmt)
        assert same(shards[r], acc), (fmt, r)
