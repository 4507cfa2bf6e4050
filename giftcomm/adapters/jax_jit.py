"""Quantized psum / pmean / psum_scatter inside ``jax.jit`` and ``jax.shard_map``.

Drop-in for ``lax.psum``, ``lax.pmean`` and ``lax.psum_scatter`` over one or more mesh axes, on
arrays and pytrees, with giftcomm's call options (giftcomm.options.CallOptions: fmt, block,
rounding, seed, mx_scale, algorithm "ring" (default; "auto" means ring) or "direct")::

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P())
    def step(params, batch):
        grads = jax.grad(loss)(params, batch)
        return giftcomm.adapters.jax.pmean(grads, "data", fmt="e4m3")

What runs (all traced once, static shapes):

1. the leaves (float dtypes) are packed in tree order into one float32 vector of n values;
2. psum / pmean: the vector is cut into P block-aligned chunks (giftcomm.partition.chunk_bounds)
   padded to the longest; ``ring``: P - 1 ``lax.ppermute`` hops, each moving one uint8 wire
   message (codes and scales in giftcomm's wire layout, giftcomm.formats), decoded, added in
   float32 and re-encoded by the receiver (jax_codec); ``direct``: each device encodes every
   chunk once and P - 1 ppermutes deliver them to their owners, who add them in rank order
   (their own exact); then each owner encodes its sum once and ``lax.all_gather`` hands every
   device the same uint8 messages, which all decode;
3. psum_scatter: the scatter dimension is moved to the front, so device r's result is the r-th
   of P equal rows (giftcomm's reduce_scatter ``layout="equal"``); ring or direct as above,
   without the allgather;
4. the result is divided by P in float32 for pmean, then cast to each leaf's dtype.

The result equals ``giftcomm.simulate_allreduce`` (``simulate_reduce_scatter`` with
``layout="equal"``) of the devices' flat float32 vectors with the same options, bit for bit, and
is identical on every device; stochastic rounding draws its bits as the reference does (keys
``call_key(seed, device index)``, counters = the element's index in the flat vector).
Errors (unknown axis name, non-float leaf, psum_scatter shapes that do not divide, options the
jit path does not implement) are raised while tracing.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..formats import message_nbytes
from ..options import CallOptions, options_of_call
from ..partition import shared_chunk_bounds
from ..reference.rounding import call_key
from . import jax_codec

__all__ = ["psum", "pmean", "psum_scatter", "JIT_ALGORITHMS"]

JIT_ALGORITHMS = ("ring", "direct")
"""The algorithms of the jit path ("auto" means "ring")."""

_UNSUPPORTED = ("slice_elems", "timeout")  # host-transport options: meaningless under jit


def _options(owner: str, op: str, options: dict[str, Any]) -> CallOptions:
    """The call's options (``options=`` a CallOptions and/or the option keywords; op is the
    function's: psum sums, pmean averages, another op is a ValueError)."""
    record = options.pop("options", None)
    opts = options_of_call(owner, record, options, {"op": op}, fixed=("op",))
    algorithm = "ring" if opts.algorithm == "auto" else opts.algorithm
    if algorithm not in JIT_ALGORITHMS:
        raise ValueError(f"{owner}: algorithm must be one of auto, {', '.join(JIT_ALGORITHMS)} inside jit; "
                         f"got {opts.algorithm!r}")
    for name in _UNSUPPORTED:
        if getattr(opts, name) is not None:
            raise ValueError(f"{owner}: {name} has no meaning inside jit (XLA schedules the transfers)")
    if opts.rounding == "stochastic" and opts.seed is None:
        raise ValueError(f"{owner}: stochastic rounding needs seed= (a Python int identifying the call)")
    return opts.replace(algorithm=algorithm)


def _axis(owner: str, axis_name: Any) -> tuple[Any, int]:
    """(axis name as lax takes it, number of devices along it); ValueError for a name that is not
    a mesh axis of the enclosing shard_map."""
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not names:
        raise ValueError(f"{owner}: axis_name must name at least one mesh axis")
    size = 1
    for name in names:
        try:
            size *= int(jax.lax.axis_size(name))
        except (NameError, KeyError, ValueError) as exc:
            raise ValueError(f"{owner}: axis name {name!r} is not a mesh axis here (call it inside "
                             f"jax.shard_map over a mesh with that axis): {exc}") from None
    return (tuple(names) if len(names) > 1 else names[0]), size


def _leaves(owner: str, tree: Any) -> tuple[list[jax.Array], Any]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for i, leaf in enumerate(leaves):
        leaf = jnp.asarray(leaf)
        if not jnp.issubdtype(leaf.dtype, jnp.floating) or leaf.dtype == jnp.float64:
            raise TypeError(f"{owner}: leaf {i} has dtype {leaf.dtype}; the jit path carries float16, bfloat16 "
                            "and float32 leaves (sums in float32)")
        out.append(leaf)
    return out, treedef


class _Ring:
    """The per-call constants: format, block, keys per device, the axis and its size."""

    def __init__(self, opts: CallOptions, axis: Any, p: int) -> None:
        self.f, self.block, self.axis, self.p = opts.format, opts.resolved_block, axis, p
        self.rounding = opts.rounding if self.f.scaled else "nearest"
        self.direct = opts.algorithm == "direct"
        seed = opts.seed or 0
        self.keys = np.array([jax_codec.key_words(call_key(seed, r)) for r in range(p)], np.uint32)
        self.rank = jax.lax.axis_index(axis)

    def encode(self, v: jax.Array, offset: Any, party: Any = None) -> jax.Array:
        key = jnp.asarray(self.keys)[self.rank if party is None else party]
        return jax_codec.encode(v, self.f, self.block, rounding=self.rounding, key=key,
                                offset=jnp.asarray(offset).astype(jnp.uint32))

    def decode(self, msg: jax.Array, n: int) -> jax.Array:
        return jax_codec.decode(msg, n, self.f, self.block)

    def shift(self, msg: jax.Array, s: int) -> jax.Array:
        """Every device's ``msg`` moved to device (index + s) mod P."""
        return jax.lax.ppermute(msg, self.axis, [(i, (i + s) % self.p) for i in range(self.p)])

    def reduce_scatter(self, chunks: jax.Array, los: np.ndarray) -> jax.Array:
        """float32[L]: this device's chunk of the sum of every device's ``chunks`` (P, L), chunk c
        starting at element ``los[c]`` of the flat vector (the reference's ``_chunk_sums``)."""
        p, r = self.p, self.rank
        lo = jnp.asarray(los.astype(np.uint32))
        L = chunks.shape[1]
        if p == 1:
            return chunks[0]
        if self.direct:
            got = [chunks[r]]
            for s in range(1, p):
                c = (r + s) % p
                got.append(self.decode(self.shift(self.encode(chunks[c], lo[c]), s), L))
            by_shift = jnp.stack(got)
            by_src = by_shift[(r - jnp.arange(p)) % p]  # row q: device q's contribution
            acc = by_src[0]
            for q in range(1, p):
                acc = acc + by_src[q]
            return acc
        c = (r - 1) % p
        msg = self.encode(chunks[c], lo[c])
        for k in range(2, p + 1):
            c = (r - k) % p
            acc = self.decode(self.shift(msg, 1), L) + chunks[c]
            if k < p:
                msg = self.encode(acc, lo[c])
        return acc

    def allgather(self, mine: jax.Array, los: np.ndarray) -> jax.Array:
        """float32[P, L]: every owner's chunk encoded once by it and decoded by every device."""
        msg = self.encode(mine, jnp.asarray(los.astype(np.uint32))[self.rank])
        every = jax.lax.all_gather(msg, self.axis)
        return jnp.stack([self.decode(every[c], mine.shape[0]) for c in range(self.p)])


def _check_size(owner: str, n: int) -> None:
    if n >= 1 << 32:
        raise ValueError(f"{owner}: {n} values; the jit path counts elements in 32 bits (fewer than 2**32)")


def _reduce(owner: str, tree: Any, axis_name: Any, op: str, options: dict[str, Any]) -> Any:
    opts = _options(owner, op, options)
    axis, p = _axis(owner, axis_name)
    leaves, treedef = _leaves(owner, tree)
    sizes = [int(np.prod(x.shape, dtype=np.int64)) for x in leaves]
    n = sum(sizes)
    _check_size(owner, n)
    if n == 0:
        return tree
    flat = jnp.concatenate([x.reshape(-1).astype(jnp.float32) for x in leaves])
    ring = _Ring(opts, axis, p)
    bounds = np.asarray(shared_chunk_bounds(n, p, ring.block))
    lens = np.diff(bounds)
    L = int(lens.max())
    chunks = jnp.stack([jnp.pad(flat[bounds[c] : bounds[c + 1]], (0, L - lens[c])) for c in range(p)])
    rows = ring.allgather(ring.reduce_scatter(chunks, bounds[:-1]), bounds[:-1])
    total = jnp.concatenate([rows[c, : lens[c]] for c in range(p)])
    if op == "avg":
        total = total / jax_codec.divisor(p, total)
    out, off = [], 0
    for x, size in zip(leaves, sizes):
        out.append(total[off : off + size].reshape(x.shape).astype(x.dtype))
        off += size
    return jax.tree_util.tree_unflatten(treedef, out)


def psum(x: Any, axis_name: Any, **options: Any) -> Any:
    """``lax.psum(x, axis_name)`` through giftcomm's wire: the sum over the devices of the mesh
    axis (or tuple of axes) ``axis_name`` of every leaf of the pytree ``x`` (float16, bfloat16
    or float32 leaves; returned in their shapes and dtypes, identical on every device).
    ``options``: the call options (docs/api.md) as keywords or one CallOptions as ``options=``
    (fmt="e4m3", block, rounding, seed, mx_scale, algorithm "auto"/"ring"/"direct"; op is the
    function's; slice_elems and timeout stay None). Call inside ``jax.shard_map`` (under jit)."""
    return _reduce("psum", x, axis_name, "sum", options)


def pmean(x: Any, axis_name: Any, **options: Any) -> Any:
    """``lax.pmean``: :func:`psum` divided by the number of devices (in float32, then cast)."""
    return _reduce("pmean", x, axis_name, "avg", options)


def psum_scatter(x: Any, axis_name: Any, *, scatter_dimension: int = 0, tiled: bool = False, **options: Any) -> Any:
    """``lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=...)`` through giftcomm's
    wire, on every leaf of the pytree ``x``: device r gets the sum of the r-th slice along
    ``scatter_dimension`` (tiled=False: that dimension must have size P and is removed;
    tiled=True: it must divide by P and shrinks P-fold). One reduce-scatter carries every leaf
    (row r of the packed (P, m) matrix is device r's slices); equal to
    ``giftcomm.simulate_reduce_scatter(..., layout="equal")`` of the packed rows."""
    owner = "psum_scatter"
    opts = _options(owner, "sum", options)
    axis, p = _axis(owner, axis_name)
    leaves, treedef = _leaves(owner, x)
    rows, shapes = [], []
    for i, leaf in enumerate(leaves):
        if leaf.ndim == 0:
            raise ValueError(f"{owner}: leaf {i} is a scalar; psum_scatter needs a dimension to scatter")
        dim = scatter_dimension + leaf.ndim if scatter_dimension < 0 else scatter_dimension
        if not 0 <= dim < leaf.ndim:
            raise ValueError(f"{owner}: scatter_dimension={scatter_dimension} is out of range for leaf {i} of "
                             f"shape {leaf.shape}")
        size = leaf.shape[dim]
        if (not tiled and size != p) or (tiled and size % p):
            need = f"equal to the axis size {p}" if not tiled else f"divisible by the axis size {p}"
            raise ValueError(f"{owner}: leaf {i} has shape {leaf.shape}; dimension {dim} must be {need} "
                             f"(tiled={tiled})")
        moved = jnp.moveaxis(leaf, dim, 0)
        piece = moved.reshape((p, size // p) + moved.shape[1:])
        shapes.append((dim, piece.shape[1:] if tiled else moved.shape[1:], leaf.dtype))
        rows.append(piece.reshape(p, -1).astype(jnp.float32))
    m = sum(int(r.shape[1]) for r in rows)
    _check_size(owner, m * p)
    if m == 0:
        return x
    ring = _Ring(opts, axis, p)
    mine = ring.reduce_scatter(jnp.concatenate(rows, axis=1), np.arange(p, dtype=np.int64) * m)
    out, off = [], 0
    for (dim, shape, dtype), r in zip(shapes, rows):
        k = int(r.shape[1])
        piece = mine[off : off + k].reshape(shape)  # tiled: the scatter dimension in front
        out.append((jnp.moveaxis(piece, 0, dim) if tiled else piece).astype(dtype))
        off += k
    return jax.tree_util.tree_unflatten(treedef, out)


def wire_bytes(n: int, p: int, **options: Any) -> int:
    """Bytes one device sends in :func:`psum` of n values on p devices (ring: P - 1 hops of one
    chunk message, plus its one message in the allgather, received by P - 1 devices)."""
    opts = _options("wire_bytes", "sum", options)
    if p == 1:
        return 0
    lens = np.diff(shared_chunk_bounds(n, p, opts.resolved_block))
    one = message_nbytes(int(lens.max()), opts.format, opts.resolved_block)
    return 2 * (p - 1) * one
