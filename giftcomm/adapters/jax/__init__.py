"""JAX adapter (needs ``jax``): see docs/adapters.md.

- ``allreduce_tree``, ``TreeSync``, ``tree_spec``, ``flatten_tree``, ...: a pytree of gradients
  reduced outside ``jax.jit`` through giftcomm's collectives (:mod:`giftcomm.adapters.jax.tree`).
- ``psum``, ``pmean``, ``psum_scatter``, ``feedback_init``: quantized collectives inside
  ``jax.jit`` / ``jax.shard_map`` (:mod:`giftcomm.adapters.jax.jit`).
- ``JaxGeometry``: a giftcomm Geometry as ``jnp`` matrix products (:mod:`giftcomm.adapters.jax.geometry`).
- :mod:`giftcomm.adapters.jax.codec`: the wire codec in ``jax.numpy``, bit-identical to the reference.
"""
from .geometry import JaxGeometry
from .jit import feedback_init, pmean, psum, psum_scatter
from .tree import (
    TreeSpec,
    TreeSync,
    allreduce_tree,
    flatten_tree,
    flatten_tree_jnp,
    on_gpu,
    tree_spec,
    unflatten_tree,
)

__all__ = ["psum", "pmean", "psum_scatter", "feedback_init", "JaxGeometry", "TreeSpec", "tree_spec", "flatten_tree",
           "flatten_tree_jnp", "unflatten_tree", "allreduce_tree", "TreeSync", "on_gpu"]
