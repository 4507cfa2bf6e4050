"""Shard-local GIFT (giftcomm.geometry.ShardedGeometry): each shard's inverse works on that shard
alone and equals the sharded operator restricted to the shard; with a factor that is already
block-diagonal along the shards (or no left factor) it is the unsharded geometry exactly."""
from __future__ import annotations

import numpy as np
import pytest

import giftcomm as gc
from giftcomm.geometry import Geometry, Layout, ShardedGeometry, shard_layout
from giftcomm.geometry.sharded import restrict, row_chunks

LAYOUT = Layout([("w1", (37, 29)), ("b1", (37,)), ("conv", (7, 3, 2)), ("w2", (11, 37)), ("skip", (5, 4))])


def spd(rng, d):
    x = rng.standard_normal((d, d)) * np.exp(rng.uniform(-2, 2, d))
    return x @ x.T / d + 1e-3 * np.eye(d)


def factors(rng, block_diagonal_g_for=None):
    f = {"w1": (spd(rng, 29), spd(rng, 37)), "conv": (spd(rng, 6), np.abs(rng.standard_normal(7)) + 0.1),
         "w2": (spd(rng, 37), spd(rng, 11)), "b1": (np.abs(rng.standard_normal(37)) + 0.1, np.ones((1, 1)))}
    if block_diagonal_g_for is not None:  # zero G's entries across the shards' row chunks
        for name, (a, g) in list(f.items()):
            if g.ndim == 2 and g.shape[0] > 1:
                mask = np.zeros_like(g)
                for lo, hi in row_chunks(g.shape[0], block_diagonal_g_for):
                    mask[lo:hi, lo:hi] = 1
                f[name] = (a, g * mask)
    return f


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_each_shard_alone_equals_the_sharded_operator_restricted_to_it(rng, p):
    geo = ShardedGeometry.from_kfac(LAYOUT, factors(rng), p)
    x = rng.standard_normal(LAYOUT.size).astype(np.float32)
    y, back = geo.full().forward(x), geo.full().inverse(x)
    for r in range(p):
        xr = restrict(LAYOUT, x, p, r)
        assert geo.shard(r).layout == shard_layout(LAYOUT, p, r) and geo.shard(r).size == xr.size
        np.testing.assert_allclose(geo.shard(r).forward(xr), restrict(LAYOUT, y, p, r), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(geo.shard(r).inverse(xr), restrict(LAYOUT, back, p, r), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(geo.shard(r).inverse(geo.shard(r).forward(xr)), xr, rtol=1e-4, atol=1e-5)
    rows = np.stack([restrict(LAYOUT, x, p, r) for r in range(p)])
    np.testing.assert_array_equal(geo.forward_rows(rows)[p - 1], geo.shard(p - 1).forward(rows[p - 1]))


@pytest.mark.parametrize("p", [2, 3])
def test_block_diagonal_factors_give_exactly_the_unsharded_geometry(rng, p):
    f = factors(rng, block_diagonal_g_for=p)
    sharded, plain = ShardedGeometry.from_kfac(LAYOUT, f, p).full(), Geometry.from_kfac(LAYOUT, f)
    x = rng.standard_normal(LAYOUT.size).astype(np.float32)
    np.testing.assert_allclose(sharded.forward(x), plain.forward(x), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(sharded.inverse(x), plain.inverse(x), rtol=2e-4, atol=2e-5)
    # a general G differs: the alignment is a real approximation, not a no-op
    g = factors(rng)
    assert not np.allclose(ShardedGeometry.from_kfac(LAYOUT, g, p).full().forward(x),
                           Geometry.from_kfac(LAYOUT, g).forward(x), rtol=1e-3, atol=1e-3)


def test_one_shard_is_the_unsharded_geometry(rng):
    f = factors(rng)
    x = rng.standard_normal(LAYOUT.size).astype(np.float32)
    np.testing.assert_allclose(ShardedGeometry.from_kfac(LAYOUT, f, 1).shard(0).forward(x),
                               Geometry.from_kfac(LAYOUT, f).forward(x), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("p", [2, 3])
def test_reduce_scatter_then_shard_inverse_is_the_sum_of_the_shards(rng, p):
    """DESIGN invariant 4 per shard: inverse_r(shard r of sum forward(g_i)) == shard r of sum g_i."""
    geo = ShardedGeometry.from_kfac(LAYOUT, factors(rng), p)
    grads = [rng.standard_normal(LAYOUT.size).astype(np.float32) for _ in range(p)]
    rows = [np.stack([restrict(LAYOUT, g, p, r) for r in range(p)]) for g in grads]
    shards = gc.LoopbackGroup(p).run(lambda t: geo.shard(t.rank).inverse(
        gc.reduce_scatter(geo.forward_rows(rows[t.rank]).reshape(-1), comm=t, fmt="fp32", layout="equal")))
    total = np.sum(grads, axis=0)
    for r in range(p):
        np.testing.assert_allclose(shards[r], restrict(LAYOUT, total, p, r), rtol=1e-4, atol=1e-4)


def test_fingerprints_and_errors(rng):
    f = factors(rng)
    a, b = ShardedGeometry.from_kfac(LAYOUT, f, 2), ShardedGeometry.from_kfac(LAYOUT, f, 2)
    assert a.fingerprint() == b.fingerprint() != ShardedGeometry.from_kfac(LAYOUT, f, 3).fingerprint()
    with pytest.raises(ValueError, match="0-d"):
        ShardedGeometry.from_kfac([("s", ())], {}, 2)
    with pytest.raises(ValueError, match="does not match"):
        ShardedGeometry.from_kfac(LAYOUT, {"w1": (spd(rng, 29), spd(rng, 36))}, 2)
    with pytest.raises(ValueError, match="not a segment"):
        ShardedGeometry.from_kfac(LAYOUT, {"nope": (np.eye(2), np.eye(2))}, 2)
    with pytest.raises(ValueError, match="shards must be"):
        ShardedGeometry.from_kfac(LAYOUT, f, 0)
