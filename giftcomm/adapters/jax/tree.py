"""JAX adapter (needs ``jax``): allreduce a pytree of gradients with giftcomm.

::

    grads = jax.grad(loss)(params, batch)
    grads = allreduce_tree(grads, op="avg", fmt="e4m3")           # one flat FP8 allreduce
    sync = TreeSync(fmt="e4m3", refresh_every=50)                 # GIFT, communication-free factors
    grads = sync(grads)

The leaves (any float dtype: float32, bfloat16, float16, float64; any shapes) are packed into
one float32 buffer in ``tree_flatten`` order, reduced with ``giftcomm.gift_allreduce``, then
split and returned as ``jnp`` arrays of the leaves' shapes and dtypes, in the same tree
structure. Host (CPU) leaves are read as NumPy arrays (``np.asarray`` of a CPU jax array is a
zero-copy view); GPU leaves are packed with ``jnp`` on their device and the flat jax array goes
to giftcomm's device path zero-copy (DLPack into CuPy, CUDA kernels, NCCL), so nothing visits the
host. The adapter runs **outside** ``jax.jit``: compute the gradients in a jitted function, call
the adapter between it and the jitted update (docs/adapters.md shows the split train step).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ... import api
from ...accounting import Tally
from ...geometry import Geometry, GradientFactorEstimator, Layout
from ...geometry.schedule import GiftSchedule, schedule_of
from ...options import CallOptions, options_of_call
from ..calls import step_options
from .geometry import JaxGeometry
from .jit import feedback_init, pmean, psum, psum_scatter

__all__ = ["psum", "pmean", "psum_scatter", "feedback_init", "JaxGeometry", "TreeSpec", "tree_spec", "flatten_tree", "flatten_tree_jnp",
           "unflatten_tree", "allreduce_tree", "TreeSync", "on_gpu"]

_AVG = {"op": "avg"}  # the tree adapters average unless told otherwise
TREE_SCHEDULE = GiftSchedule(geometry="reduced", estimate_every=1, refresh_every=50)
"""TreeSync's schedule when none is given."""


@dataclass(frozen=True)
class TreeSpec:
    """How a pytree maps onto a flat buffer: treedef, leaf shapes, dtypes, element offsets and
    the geometry Layout (segment names from the leaves' key paths)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    offsets: tuple[int, ...]
    layout: Layout

    @property
    def size(self) -> int:
        return self.layout.size


def tree_spec(tree) -> TreeSpec:
    """The TreeSpec of a pytree of arrays (leaves: jax/NumPy arrays or scalars)."""
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    shapes, dtypes, offsets, entries, off = [], [], [], [], 0
    for path, leaf in paths_leaves:
        shape = tuple(np.shape(leaf))
        shapes.append(shape)
        dtypes.append(np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.dtype(np.float32))
        offsets.append(off)
        entries.append((jax.tree_util.keystr(path) or "leaf", shape))
        off += int(np.prod(shape, dtype=np.int64))
    return TreeSpec(treedef, tuple(shapes), tuple(dtypes), tuple(offsets), Layout(entries))


def flatten_tree(tree, spec: TreeSpec | None = None, dtype=np.float32) -> tuple[np.ndarray, TreeSpec]:
    """(flat 1-D buffer of ``dtype`` holding every leaf in order, spec). A single leaf of the
    right dtype is returned as a zero-copy read-only view of the jax array."""
    spec = spec or tree_spec(tree)
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) == 1 and np.dtype(spec.dtypes[0]) == np.dtype(dtype):
        return np.asarray(leaves[0]).reshape(-1), spec
    flat = np.empty(spec.size, dtype)
    for leaf, off, shape in zip(leaves, spec.offsets, spec.shapes):
        n = int(np.prod(shape, dtype=np.int64))
        flat[off : off + n] = np.asarray(leaf).reshape(-1)
    return flat, spec


def on_gpu(tree) -> bool:
    """True when any leaf of ``tree`` is a jax array on a GPU."""
    for leaf in jax.tree_util.tree_leaves(tree):
        devices = getattr(leaf, "devices", None)
        if devices is not None and any(d.platform in ("gpu", "cuda", "rocm") for d in devices()):
            return True
    return False


def flatten_tree_jnp(tree, spec: TreeSpec | None = None) -> tuple[Any, TreeSpec]:
    """(flat float32 jax array of every leaf in order, spec), packed by ``jnp`` on the leaves'
    device (the device route: the buffer never visits the host)."""
    spec = spec or tree_spec(tree)
    leaves = [jnp.ravel(jnp.asarray(leaf)).astype(jnp.float32) for leaf in jax.tree_util.tree_leaves(tree)]
    flat = jnp.concatenate(leaves) if leaves else jnp.zeros(0, jnp.float32)
    return flat, spec


def unflatten_tree(flat: np.ndarray, spec: TreeSpec):
    """The pytree of ``jnp`` arrays (the spec's shapes and dtypes) cut from ``flat``."""
    leaves = []
    for off, shape, dt in zip(spec.offsets, spec.shapes, spec.dtypes):
        n = int(np.prod(shape, dtype=np.int64))
        leaves.append(jnp.asarray(flat[off : off + n].reshape(shape), dtype=dt))
    return jax.tree_util.tree_unflatten(spec.treedef, leaves)


def _flatten(tree, device: bool | None):
    if device is None:
        device = on_gpu(tree)
    return flatten_tree_jnp(tree) if device else flatten_tree(tree)


def allreduce_tree(tree, *, comm: Any = None, geometry=None, device: bool | None = None,
                   options: CallOptions | None = None, **opts: Any):
    """Collective: the pytree reduced over all ranks (``op`` "avg" or "sum"), one flat
    ``gift_allreduce`` of the leaves packed as float32. options / ``**opts``: the call options of
    ``giftcomm.allreduce`` (keywords, or one CallOptions as ``options=``; docs/api.md; op
    defaults to "avg"; seed, under stochastic rounding, is used as given), validated before
    anything moves: a bad one raises ValueError/TypeError naming allreduce_tree. geometry: None or a Geometry over
    ``tree_spec(tree).layout``. device: pack with ``jnp`` and hand giftcomm the jax array (None:
    when a leaf is on a GPU; then ``comm`` None or an mpi4py communicator means NCCL, or pass a
    device Transport). Bit-identical on every rank. Not for use inside ``jax.jit``."""
    o = options_of_call("allreduce_tree", options, opts, _AVG)
    flat, spec = _flatten(tree, device)
    out = api.gift_allreduce(flat, geometry, comm=comm, options=o)
    return unflatten_tree(out, spec)


class TreeSync:
    """Reduce gradient pytrees step after step with GIFT geometry from the reduced gradients.

    options / ``**opts``: the call options of ``giftcomm.allreduce`` (keywords, or one CallOptions
    as ``options=``; docs/api.md; op defaults to "avg"; validated here; ``sync.options`` is the
    record); with
    ``rounding="stochastic"`` call ``k`` (0, 1, ...) is rounded with the seed
    ``giftcomm.adapters.calls.step_seed(seed, k, 0)``. schedule: a :class:`giftcomm.GiftSchedule`
    with geometry "reduced", taken whole (default :data:`TREE_SCHEDULE`: ``estimate_every=1``,
    ``refresh_every=50``): the ``GradientFactorEstimator`` (EMA ``decay``) is fed the reduced flat
    buffer (identical on every rank) every ``estimate_every`` calls; every ``refresh_every`` calls
    the geometry is rebuilt with the selective ``policy`` and ``damping``: every rank builds the
    same geometry without communicating (another knob off its default is a ValueError). The
    previous release's keywords (estimate_every, refresh_every, policy, damping, decay) still
    build it, with a DeprecationWarning. ``seconds`` accumulates the wall time of estimator updates
    and geometry builds.
    """

    def __init__(self, *, comm: Any = None, schedule: GiftSchedule | None = None, device: bool | None = None,
                 options: CallOptions | None = None, **opts: Any) -> None:
        self.schedule = schedule_of("TreeSync", schedule, opts, TREE_SCHEDULE).check_for(
            "TreeSync", ("reduced",), ("estimate_every", "refresh_every", "decay", "policy", "damping"))
        self.options: CallOptions = options_of_call("TreeSync", options, opts, _AVG)
        self.comm = comm
        self._tally = Tally()  # what stats() reports
        self.device = device
        self.spec: TreeSpec | None = None
        self.estimator: GradientFactorEstimator | None = None
        self.geometry: Geometry | None = None
        self.calls = 0
        self.seconds = 0.0

    def stats(self) -> dict[str, Any]:
        """What this rank sent in this TreeSync's allreduces: the dict of :func:`giftcomm.stats`
        (calls, bytes_sent per format or "native", algorithms, fallbacks; docs/api.md, "What was sent")."""
        return self._tally.as_dict()

    def __call__(self, tree):
        """Collective: the reduced pytree (as ``allreduce_tree`` with the current geometry)."""
        flat, spec = _flatten(tree, self.device)
        if self.spec is None or spec.layout != self.spec.layout:
            self.spec, self.geometry = spec, None
            self.estimator = GradientFactorEstimator(spec.layout, decay=self.schedule.decay)
        assert self.estimator is not None
        out = api.gift_allreduce(flat, self.geometry, comm=self.comm, options=step_options(self.options, self.calls))
        self._tally.add(self.comm)
        t0 = time.perf_counter()
        if self.calls % self.schedule.estimate_every == 0:
            self.estimator.update(np.asarray(out))  # a host copy for GPU arrays, estimator steps only
        if (self.calls + 1) % self.schedule.refresh_every == 0 and self.estimator.count > 0:
            self.geometry = self.estimator.geometry(policy=self.schedule.policy, damping=self.schedule.damping)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return unflatten_tree(out, spec)
