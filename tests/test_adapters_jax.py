"""JAX adapter: pytree flatten/unflatten, allreduce of pytrees, zero copy, TreeSync geometry."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import giftcomm
import giftcomm.adapters.jax
from giftcomm import GiftSchedule
from giftcomm.adapters.jax import TreeSync, allreduce_tree, flatten_tree, tree_spec, unflatten_tree
from giftcomm.geometry import SelectivePolicy


def _tree(rng, scale=1.0):
    """A nested pytree of float leaves of assorted shapes and dtypes (dicts, lists, tuples)."""
    return {
        "dense": {"w": jnp.asarray(scale * rng.standard_normal((24, 40)), jnp.float32),
                  "b": jnp.asarray(rng.standard_normal(40), jnp.float32)},
        "blocks": [jnp.asarray(scale * rng.standard_normal((40, 16)), jnp.float32),
                   (jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.float16),
                    jnp.asarray(rng.standard_normal(()), jnp.bfloat16))],
    }


def test_tree_round_trip(rng):
    tree = _tree(rng)
    flat, spec = flatten_tree(tree)
    assert flat.dtype == np.float32 and flat.shape == (spec.size,)
    assert spec.size == sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))
    back = unflatten_tree(flat, spec)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(back)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # float32 holds f16/bf16 exactly
    names = [s.name for s in spec.layout]
    assert len(set(names)) == len(names) and "['dense']['w']" in names


def test_zero_copy_views(rng):
    x = jnp.asarray(rng.standard_normal((64, 33)), jnp.float32)
    ptr = x.unsafe_buffer_pointer()
    assert np.asarray(x).ctypes.data == ptr
    assert np.from_dlpack(x).ctypes.data == ptr
    flat, _ = flatten_tree({"only": x})  # a single float32 leaf is not copied
    assert flat.ctypes.data == ptr


@pytest.mark.parametrize("P", [1, 2, 4])
def test_allreduce_tree_equals_flat_allreduce(rng, P):
    trees = [_tree(rng) for _ in range(P)]

    def fn(t):
        got = allreduce_tree(trees[t.rank], comm=t, op="avg", fmt="e4m3")
        flat, spec = flatten_tree(trees[t.rank])
        ref = giftcomm.allreduce(flat, comm=t, op="avg", fmt="e4m3")
        return got, ref, spec

    results = giftcomm.LoopbackGroup(P).run(fn)
    got0 = results[0][0]
    for got, ref, spec in results:
        expected = unflatten_tree(ref, spec)
        for a, b, c in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected),
                           jax.tree_util.tree_leaves(got0)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))  # identical on every rank
    # close to the true mean (FP8 error bound, relative to the block's amax)
    mean = np.mean([flatten_tree(t)[0] for t in trees], axis=0)
    flat_got, _ = flatten_tree(got0)
    assert np.max(np.abs(flat_got - mean)) <= 0.2 * np.max(np.abs(mean)) + 1e-2


def test_tree_sync_reduced_gradient_geometry(rng):
    P, steps, refresh = 3, 4, 2
    # anisotropic gradients: rows scaled very differently, so the estimator sees structure
    row_scale = np.logspace(0, 3, 24)[:, None]
    trees = [[_tree(rng) for _ in range(P)] for _ in range(steps)]
    for s in range(steps):
        for r in range(P):
            trees[s][r]["dense"]["w"] = trees[s][r]["dense"]["w"] * row_scale

    def fn(t):
        sync = TreeSync(comm=t, op="avg", schedule=GiftSchedule(geometry="reduced", refresh_every=refresh,
                        policy=SelectivePolicy(min_size=0, min_gain=0.0, flops_per_gain=1e9), estimate_every=1))
        out = []
        for s in range(steps):
            geo = sync.geometry
            got = sync(trees[s][t.rank])
            flat, spec = flatten_tree(trees[s][t.rank])
            ref = giftcomm.gift_allreduce(flat, geo, comm=t, op="avg", fmt="e4m3")
            ref = flatten_tree(unflatten_tree(ref, spec))[0]  # leaves back in their own dtypes
            out.append((geo, flatten_tree(got)[0], ref))
        return out, sync.geometry

    results = giftcomm.LoopbackGroup(P).run(fn)
    fps = {res[1].fingerprint() for res in results}
    assert len(fps) == 1, "ranks built different geometries"
    final = results[0][1]
    assert not final.is_identity
    assert any(not tr.is_identity for tr in final.transforms if tr.segment.name == "['dense']['w']")
    used = [geo is not None for geo, _, _ in results[0][0]]
    assert used == [s >= refresh for s in range(steps)]
    for out, _ in results:
        for _, got, ref in out:
            np.testing.assert_array_equal(got, ref)


def test_bfloat16_leaf_dtype_kept(rng):
    tree = {"a": jnp.asarray(rng.standard_normal(300), jnp.bfloat16)}
    (out,) = giftcomm.LoopbackGroup(1).run(lambda t: allreduce_tree(tree, comm=t, op="sum", fmt="bf16"))
    assert out["a"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["a"]).astype(np.float32),
                                  np.asarray(tree["a"]).astype(ml_dtypes.bfloat16).astype(np.float32))
    assert tree_spec(tree).layout.size == 300


@pytest.mark.parametrize("P", [2, 3])
def test_device_packing_route_equals_host_route(rng, P):
    """device=True packs with jnp and hands giftcomm the jax array (the GPU route: no NumPy on the
    way); on the CPU it must give the host route's bytes, for every leaf dtype."""
    trees = [_tree(rng) for _ in range(P)]

    def fn(t):
        flat, _ = giftcomm.adapters.jax.flatten_tree_jnp(trees[t.rank])
        assert isinstance(flat, jax.Array) and flat.dtype == jnp.float32
        return (allreduce_tree(trees[t.rank], comm=t, device=True),
                allreduce_tree(trees[t.rank], comm=t, device=False))

    for dev, host in giftcomm.LoopbackGroup(P).run(fn):
        for a, b in zip(jax.tree_util.tree_leaves(dev), jax.tree_util.tree_leaves(host)):
            assert isinstance(a, jax.Array) and a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not giftcomm.adapters.jax.on_gpu(trees[0])


def test_split_train_step_outside_jit(rng):
    """The documented pattern: jitted grad, the adapter between, jitted update."""
    P = 2
    params = {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.bfloat16), "b": jnp.zeros(4, jnp.float32)}
    xs = [jnp.asarray(rng.standard_normal((16, 8)), jnp.float32) for _ in range(P)]

    @jax.jit
    def grads_of(p, x):
        return jax.grad(lambda q: jnp.mean((x @ q["w"].astype(jnp.float32) + q["b"]) ** 2))(p)

    @jax.jit
    def update(p, g):
        return jax.tree_util.tree_map(lambda a, b: (a - 0.1 * b).astype(a.dtype), p, g)

    def fn(t):
        g = allreduce_tree(grads_of(params, xs[t.rank]), comm=t)
        return update(params, g)

    new = giftcomm.LoopbackGroup(P).run(fn)
    for leaf0, leaf1 in zip(jax.tree_util.tree_leaves(new[0]), jax.tree_util.tree_leaves(new[1])):
        np.testing.assert_array_equal(np.asarray(leaf0), np.asarray(leaf1))
    assert new[0]["w"].dtype == jnp.bfloat16


def test_adapters_take_every_call_option(rng):
    """allreduce_tree / TreeSync check the options before anything moves (naming themselves);
    nvfp4 needs no block; TreeSync's stochastic call k is seeded step_seed(seed, k, 0); its
    damping default is the library's."""
    from giftcomm.adapters.calls import step_seed
    from giftcomm.options import DEFAULT_DAMPING
    from giftcomm.reference import simulate_allreduce

    t1 = giftcomm.LoopbackGroup(1).transports[0]
    tree = _tree(rng)
    for fn, owner in ((lambda **kw: allreduce_tree(tree, comm=t1, **kw), "allreduce_tree"),
                      (lambda **kw: TreeSync(comm=t1, **kw), "TreeSync")):
        for kwargs, words in [(dict(fmt="nvfp4", block=32), "fixed block"), (dict(algorithm="rnig"), "algorithm"),
                              (dict(rounding="stochastic", fmt="fp32"), "stochastic"), (dict(seed=2**64), "seed")]:
            with pytest.raises(ValueError, match=words) as err:
                fn(**kwargs)
            assert str(err.value).startswith(owner + ": ")
    assert TreeSync().schedule.damping == DEFAULT_DAMPING
    P, seed = 2, int(rng.integers(2**40))
    trees = [_tree(rng) for _ in range(P)]

    def fn(t):
        sync = TreeSync(comm=t, fmt="nvfp4", rounding="stochastic", seed=seed,
                        schedule=GiftSchedule(geometry="reduced", refresh_every=1000, estimate_every=1),
                                              allow_native=False)
        return [flatten_tree(sync(trees[t.rank]))[0] for _ in range(2)]

    outs = giftcomm.LoopbackGroup(P).run(fn)
    flats = [flatten_tree(tr)[0] for tr in trees]
    for k in range(2):
        ref = simulate_allreduce(flats, "nvfp4", None, "avg", rounding="stochastic", seed=step_seed(seed, k, 0),
                                 allow_native=False)[0]
        ref = flatten_tree(unflatten_tree(ref, tree_spec(trees[0])))[0]  # leaves back in their own dtypes
        np.testing.assert_array_equal(outs[0][k], ref)
        np.testing.assert_array_equal(outs[1][k], ref)
    assert not np.array_equal(outs[0][0], outs[0][1])


def test_allreduce_tree_with_the_paper_preset(rng):
    """The GIFT paper's preset (giftcomm.geometry.paper) through the JAX adapter: the same bytes as
    gift_allreduce of the flat buffer with that geometry, identical on every rank."""
    from giftcomm.geometry import Geometry

    P = 2
    trees = [_tree(rng) for _ in range(P)]
    spec = tree_spec(trees[0])
    a = rng.standard_normal((200, 40)) * np.linspace(0.1, 5.0, 40)
    name = next(s.name for s in spec.layout if s.shape == (24, 40))
    geo = Geometry.preset("paper", spec.layout, {name: a.T @ a / 200}, rank=8)

    def fn(t):
        got = allreduce_tree(trees[t.rank], comm=t, op="avg", geometry=geo)
        flat, _ = flatten_tree(trees[t.rank])
        ref = giftcomm.gift_allreduce(flat, geo, comm=t, op="avg")
        return flatten_tree(got)[0], flatten_tree(unflatten_tree(ref, spec))[0]

    results = giftcomm.LoopbackGroup(P).run(fn)
    for got, ref in results:
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(got, results[0][0])
