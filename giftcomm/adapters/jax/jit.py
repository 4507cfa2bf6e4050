"""Quantized psum / pmean / psum_scatter inside ``jax.jit`` and ``jax.shard_map``.

Drop-in for ``lax.psum``, ``lax.pmean`` and ``lax.psum_scatter`` over one or more mesh axes, on
arrays and pytrees, with giftcomm's call options (giftcomm.options.CallOptions: fmt, block,
rounding, seed, mx_scale, algorithm: a row of giftcomm.algorithms with a ``jit_scatter``
schedule -- "ring" (default; "auto" means ring) or "direct")::

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P())
    def step(params, batch):
        grads = jax.grad(loss)(params, batch)
        return giftcomm.adapters.jax.pmean(grads, "data", fmt="e4m3")

What runs (all traced once, static shapes):

1. the leaves (float dtypes) are packed in tree order into one float32 vector of n values;
2. psum / pmean: the vector is cut into P block-aligned chunks (giftcomm.algorithms.partition.chunk_bounds)
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

Per-step seeds, error feedback (psum, pmean and psum_scatter), GIFT (psum and pmean):

- ``seed`` may be a traced integer array (the step number passed to the jitted step, the same on
  every device): a scalar (taken as a uint32: a seed below 2**32) or ``uint32[2]`` words (low,
  high) of a 64-bit seed; the keys are ``call_key`` of that seed computed in uint32 arithmetic
  (jax_codec.call_key_words), so the bits equal the int seed's and one compiled step serves
  every seed;
- ``feedback=state`` (``feedback_init(grads)``: float32 zeros like the leaves) makes the call
  return ``(result, new_state)``: the state is added to the leaves (in float32) before the
  reduction, and the new state is what this device's own encodes of its values lost, exactly as
  giftcomm.collectives.feedback.ErrorFeedback records it (the chunks the algorithm row's ``own_pieces``
  names; one device, everything; non-finite residuals are 0);
- ``geometry=g`` (a giftcomm Geometry, or a giftcomm.adapters.jax.geometry.JaxGeometry passed as a jitted
  argument) reduces ``forward(packed leaves)`` and maps the sum back with ``inverse`` before
  ``pmean``'s division (giftcomm.simulate_gift_allreduce's order); with feedback the residual is
  mapped back by ``inverse`` too (ErrorFeedback.record with a geometry).

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

from ...algorithms import AUTO, BY_NAME, TABLE, Algorithm
from ...algorithms.partition import shared_chunk_bounds
from ...formats import message_nbytes
from ...options import CallOptions, options_of_call
from ...reference.rounding import call_key
from . import codec as jax_codec
from .geometry import JaxGeometry

_all_gather_invariant: Any
try:  # Varying -> Invariant all_gather (not in jax.lax's public names yet)
    from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant
except ImportError:  # pragma: no cover - older jax: results typed varying
    _all_gather_invariant = None

__all__ = ["psum", "pmean", "psum_scatter", "feedback_init", "wire_bytes", "jit_algorithms", "ring_scatter",
           "direct_scatter"]

JIT_AUTO = "ring"
"""What ``algorithm="auto"`` runs inside jit (no cost model there: XLA schedules the transfers)."""

_UNSUPPORTED = ("slice_elems", "timeout")  # host-transport options: meaningless under jit


def _split_seed(owner: str, options: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(options without an array seed, the array seed or None). A seed that is a jax or NumPy
    array (a traced per-step seed): an integer scalar or ``uint32[2]`` key words (low, high)."""
    seed = options.get("seed")
    if seed is None or isinstance(seed, (int, np.integer)):
        return options, None
    if not hasattr(seed, "dtype") or not hasattr(seed, "shape"):
        return options, None  # CallOptions rejects it with the common wording
    if not jnp.issubdtype(seed.dtype, jnp.integer) or seed.shape not in ((), (2,)):
        raise ValueError(f"{owner}: an array seed must be an integer scalar or uint32[2] key words (low, high); "
                         f"got {seed.dtype}{list(seed.shape)}")
    return {k: v for k, v in options.items() if k != "seed"}, seed


def _options(owner: str, op: str, options: dict[str, Any]) -> tuple[CallOptions, Any]:
    """(the validated CallOptions, an array seed or None): ``options=`` a CallOptions and/or the
    option keywords; op is the function's (psum sums, pmean averages, another op is a ValueError)."""
    record = options.pop("options", None)
    options, traced_seed = _split_seed(owner, options)
    opts = options_of_call(owner, record, options, {"op": op}, fixed=("op",))
    algorithm = JIT_AUTO if opts.algorithm == AUTO else opts.algorithm
    row = BY_NAME.get(algorithm)
    if row is None or row.jit_scatter is None:
        raise ValueError(f"{owner}: algorithm must be one of auto, {', '.join(jit_algorithms())} inside jit; "
                         f"got {opts.algorithm!r}")
    for name in _UNSUPPORTED:
        if getattr(opts, name) is not None:
            raise ValueError(f"{owner}: {name} has no meaning inside jit (XLA schedules the transfers)")
    if opts.rounding == "stochastic" and opts.seed is None and traced_seed is None:
        raise ValueError(f"{owner}: stochastic rounding needs seed= (an int, or an integer array such as the "
                         "training step, the same on every device)")
    return opts.replace(algorithm=algorithm), traced_seed


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


def jit_algorithms() -> tuple[str, ...]:
    """The algorithms the jit path runs (and "auto": :data:`JIT_AUTO`): the rows of
    giftcomm.algorithms with a ``jit_scatter`` schedule, read now (registered rows count)."""
    return tuple(a.name for a in TABLE if a.jit_scatter is not None)


def own_shifts(row: Algorithm, p: int) -> frozenset[int]:
    """The chunks each of ``p`` > 1 devices encodes alone from its own values, as shifts from its
    index (device r's chunk (r + s) mod P for each shift s): the row's ``own_pieces`` over P
    one-element chunks, the same shifts on every device. ValueError for a row whose own pieces
    are not whole chunks keyed at stage 0 alike on every device (the jit schedules record
    residuals per chunk)."""
    shifts = None
    for q in range(p):
        pieces, stage = row.own_pieces(p, p, q, lambda c: (c, c + 1))
        mine = frozenset((lo - q) % p for lo, hi in pieces if hi == lo + 1)
        if stage != 0 or len(mine) != len(pieces) or (shifts is not None and mine != shifts):
            raise ValueError(f"algorithm {row.name!r}: its own pieces on {p} devices are not whole chunks alike on "
                             "every device; the jit path cannot record its error feedback")
        shifts = mine
    assert shifts is not None
    return shifts


class _Ring:
    """The per-call constants: format, block, keys per device, the axis and its size, the
    algorithm's row (its schedule and own pieces)."""

    def __init__(self, opts: CallOptions, axis: Any, p: int, traced_seed: Any = None) -> None:
        self.f, self.block, self.axis, self.p = opts.format, opts.resolved_block, axis, p
        self.rounding = opts.rounding if self.f.scaled else "nearest"
        self.row = BY_NAME[opts.algorithm]  # "auto" was resolved by _options
        self.scatter = self.row.part("jit_scatter")
        self.recorded: set[int] = set()  # the shifts whose residuals a schedule recorded
        if traced_seed is not None and self.rounding == "stochastic":
            self.keys: Any = jax_codec.call_key_words(traced_seed, range(p))
        else:
            seed = opts.seed or 0
            self.keys = np.array([jax_codec.key_words(call_key(seed, r)) for r in range(p)], np.uint32)
        self.rank = jax.lax.axis_index(axis)
        self.lens: Any = None

    def encode(self, v: jax.Array, offset: Any, chunk: Any, party: Any = None) -> jax.Array:
        """The message of chunk ``chunk``'s values ``v`` (its first ``lens[chunk]``; the rest padding)."""
        key = jnp.asarray(self.keys)[self.rank if party is None else party]
        return jax_codec.encode(v, self.f, self.block, rounding=self.rounding, key=key,
                                offset=jnp.asarray(offset).astype(jnp.uint32), valid=self.valid(chunk))

    def decode(self, msg: jax.Array, n: int, chunk: Any) -> jax.Array:
        """float32[n]: chunk ``chunk``'s values of ``msg`` (zeros past its length)."""
        return jax_codec.decode(msg, n, self.f, self.block, valid=self.valid(chunk))

    def valid(self, chunk: Any) -> Any:
        """The true length of chunk ``chunk`` (int or traced) for the codec, or None where the
        row's encoding of the leading values does not depend on the padding (every row but the
        adaptive ones) or the chunks are not padded."""
        if self.f.adaptive is None or self.lens is None:
            return None
        return jnp.asarray(self.lens.astype(np.int32))[chunk]

    def shift(self, msg: jax.Array, s: int) -> jax.Array:
        """Every device's ``msg`` moved to device (index + s) mod P."""
        return jax.lax.ppermute(msg, self.axis, [(i, (i + s) % self.p) for i in range(self.p)])

    def reduce_scatter(self, chunks: jax.Array, los: np.ndarray, own_error: bool = False,
                       lens: np.ndarray | None = None) -> Any:
        """float32[L]: this device's chunk of the sum of every device's ``chunks`` (P, L), chunk c
        starting at element ``los[c]`` of the flat vector (the reference's ``_chunk_sums``) and
        holding ``lens[c]`` values, zero-padded to L (None: every chunk is L values).
        own_error: also return float32[P, L], what this device's encodes of its own values lost
        (``chunks - decode(encode(chunks))`` on the chunks the row's ``own_pieces`` names,
        :func:`own_shifts`; 0 elsewhere); at P = 1 that is the allgather's, added by the caller.
        The schedule is the row's ``jit_scatter``."""
        self.lens = lens
        lo = jnp.asarray(los.astype(np.uint32))
        err = jnp.zeros_like(chunks)  # unused (and dropped by XLA) without own_error
        if self.p == 1:
            return (chunks[0], err) if own_error else chunks[0]
        shifts = own_shifts(self.row, self.p) if own_error else frozenset()
        self.recorded = set()
        acc, err = self.scatter(self, chunks, lo, err, shifts)
        if self.recorded != shifts:
            raise ValueError(f"algorithm {self.row.name!r}: its own pieces (shifts {sorted(shifts)}) are not the "
                             f"chunks its jit schedule encodes alone (shifts {sorted(self.recorded)})")
        return (acc, err) if own_error else acc

    def own_error(self, err: jax.Array, shifts: frozenset[int], s: int, chunks: jax.Array, c: Any,
                  msg: jax.Array) -> jax.Array:
        """``err`` with row ``c`` (this device's chunk at shift ``s`` of ``chunks``, encoded alone
        as ``msg``) set to what that encode lost, when ``s`` is one of the row's own ``shifts``."""
        if s not in shifts:
            return err
        self.recorded.add(s)
        return err.at[c].set(chunks[c] - self.decode(msg, chunks.shape[1], c))


    def allgather(self, mine: jax.Array, los: np.ndarray, lens: np.ndarray | None = None) -> jax.Array:
        """float32[P, L]: every owner's chunk encoded once by it and decoded by every device,
        typed device-invariant (as lax.psum's result: ``out_specs=P()`` accepts it); ``lens``:
        as for :meth:`reduce_scatter`."""
        self.lens = lens
        msg = self.encode(mine, jnp.asarray(los.astype(np.uint32))[self.rank], self.rank)
        every = _gather_invariant(msg, self.axis)
        return jnp.stack([self.decode(every[c], mine.shape[0], c) for c in range(self.p)])


def direct_scatter(ring: _Ring, chunks: jax.Array, lo: jax.Array, err: jax.Array,
                   shifts: frozenset[int]) -> tuple[Any, Any]:
    """The ``direct`` row's ``jit_scatter``, the schedule of :meth:`_Ring.reduce_scatter` (P > 1):
    each chunk encoded once by its device and sent straight to its owner, summed there in device
    order; the residuals of the own chunks at ``shifts`` recorded in ``err``."""
    p, r, L = ring.p, ring.rank, chunks.shape[1]
    got = [chunks[r]]
    for s in range(1, p):
        c = (r + s) % p
        msg = ring.encode(chunks[c], lo[c], c)
        err = ring.own_error(err, shifts, s, chunks, c, msg)
        got.append(ring.decode(ring.shift(msg, s), L, r))
    by_shift = jnp.stack(got)
    by_src = by_shift[(r - jnp.arange(p)) % p]  # row q: device q's contribution
    acc = by_src[0]
    for q in range(1, p):
        acc = acc + by_src[q]
    return acc, err


def ring_scatter(ring: _Ring, chunks: jax.Array, lo: jax.Array, err: jax.Array,
                 shifts: frozenset[int]) -> tuple[Any, Any]:
    """The ``ring`` row's ``jit_scatter``, the schedule of :meth:`_Ring.reduce_scatter` (P > 1):
    partial sums passed to the next device and requantized at every hop (hop 0 encodes the own
    chunk at shift P - 1 alone; its residual recorded in ``err`` when ``shifts`` names it)."""
    p, r, L = ring.p, ring.rank, chunks.shape[1]
    c = (r - 1) % p
    msg = ring.encode(chunks[c], lo[c], c)
    err = ring.own_error(err, shifts, p - 1, chunks, c, msg)
    for k in range(2, p + 1):
        c = (r - k) % p
        acc = ring.decode(ring.shift(msg, 1), L, c) + chunks[c]
        if k < p:
            msg = ring.encode(acc, lo[c], c)
    return acc, err


def _gather_invariant(msg: jax.Array, axis: Any) -> jax.Array:
    """``lax.all_gather(msg, axis)`` typed invariant over ``axis`` under shard_map's replication
    check (jax's all_gather_invariant, not yet public: plain all_gather where it is missing,
    whose result shard_map then types as varying)."""
    if _all_gather_invariant is None:
        return jax.lax.all_gather(msg, axis)
    # the input must be typed varying over the axis; one that is not (one device, nearest
    # rounding of replicated values) becomes so by adding 0 * the device index (folded by XLA)
    msg = msg + (jax.lax.axis_index(axis) * 0).astype(msg.dtype)
    return _all_gather_invariant(msg, axis)


def _check_size(owner: str, n: int) -> None:
    if n >= 1 << 32:
        raise ValueError(f"{owner}: {n} values; the jit path counts elements in 32 bits (fewer than 2**32)")


def feedback_init(tree: Any, copies: int | None = None) -> Any:
    """The error-feedback state of :func:`psum` / :func:`pmean` before the first step: float32
    zeros shaped like every leaf of ``tree`` (the per-device gradients). copies: None, or k for
    leaves of shape (k, *shape), to hold the per-device states outside ``shard_map`` (pass them
    with ``in_specs=P(axis)``: each device then sees (1, *shape), which the calls accept: a
    state leaf needs the element count of its gradient leaf, not its shape)."""
    lead = () if copies is None else (int(copies),)
    return jax.tree_util.tree_map(lambda v: jnp.zeros(lead + tuple(jnp.shape(v)), jnp.float32), tree)


def _feedback_leaves(owner: str, feedback: Any, treedef: Any, sizes: list[int]) -> list[jax.Array]:
    leaves, fdef = jax.tree_util.tree_flatten(feedback)
    if fdef != treedef:
        raise ValueError(f"{owner}: feedback must have the structure of x (feedback_init(x) builds it); "
                         f"got {fdef} for {treedef}")
    out = []
    for i, (leaf, size) in enumerate(zip(leaves, sizes)):
        leaf = jnp.asarray(leaf)
        if leaf.dtype != jnp.float32 or int(np.prod(leaf.shape, dtype=np.int64)) != size:
            raise ValueError(f"{owner}: feedback leaf {i} must be float32 with {size} elements (its gradient leaf's "
                             f"count); got {leaf.dtype}{list(leaf.shape)}")
        out.append(leaf)
    return out


def _geometry(owner: str, geometry: Any, n: int) -> JaxGeometry | None:
    if geometry is None:
        return None
    geo = JaxGeometry.of(geometry)
    if geo.size != n:
        raise ValueError(f"{owner}: the geometry covers {geo.size} elements but the packed pytree has {n} "
                         "(build it over tree_spec(x).layout)")
    return None if geo.is_identity else geo


def _reduce(owner: str, tree: Any, axis_name: Any, op: str, options: dict[str, Any], feedback: Any = None,
            geometry: Any = None) -> Any:
    opts, traced_seed = _options(owner, op, options)
    axis, p = _axis(owner, axis_name)
    leaves, treedef = _leaves(owner, tree)
    sizes = [int(np.prod(x.shape, dtype=np.int64)) for x in leaves]
    n = sum(sizes)
    _check_size(owner, n)
    fb = None
    if feedback is not None:
        if not opts.format.scaled:
            raise ValueError(f"{owner}: feedback needs a block-scaled format; {opts.fmt} is a pass-through format "
                             "(nothing to feed back)")
        fb = _feedback_leaves(owner, feedback, treedef, sizes)
    geo = _geometry(owner, geometry, n)
    if n == 0:
        return tree if fb is None else (tree, feedback)
    flat = jnp.concatenate([x.reshape(-1).astype(jnp.float32) for x in leaves])
    if fb is not None:  # compensate: add last step's residual (ErrorFeedback.compensate)
        flat = flat + jnp.concatenate([e.reshape(-1) for e in fb])
    y = flat if geo is None else geo.forward(flat)
    ring = _Ring(opts, axis, p, traced_seed)
    bounds = np.asarray(shared_chunk_bounds(n, p, ring.block))
    lens = np.diff(bounds)
    L = int(lens.max())
    chunks = jnp.stack([jnp.pad(y[bounds[c] : bounds[c + 1]], (0, L - lens[c])) for c in range(p)])
    if fb is None:
        mine = ring.reduce_scatter(chunks, bounds[:-1], lens=lens)
    else:
        mine, err_chunks = ring.reduce_scatter(chunks, bounds[:-1], own_error=True, lens=lens)
    rows = ring.allgather(mine, bounds[:-1], lens)
    total = jnp.concatenate([rows[c, : lens[c]] for c in range(p)])
    if fb is not None:
        err = y - total if p == 1 else jnp.concatenate([err_chunks[c, : lens[c]] for c in range(p)])
    if geo is not None:
        total = geo.inverse(total)
    if op == "avg":
        total = total / jax_codec.divisor(p, total)
    out, off = [], 0
    for x, size in zip(leaves, sizes):
        out.append(total[off : off + size].reshape(x.shape).astype(x.dtype))
        off += size
    result = jax.tree_util.tree_unflatten(treedef, out)
    if fb is None:
        return result
    if geo is not None:  # the residual kept in gradient coordinates (ErrorFeedback.record)
        err = geo.inverse(err)
    err = jnp.where(jnp.isfinite(err), err, jnp.float32(0))
    new, off = [], 0
    for e, size in zip(fb, sizes):
        new.append(err[off : off + size].reshape(e.shape))
        off += size
    return result, jax.tree_util.tree_unflatten(treedef, new)


def psum(x: Any, axis_name: Any, *, feedback: Any = None, geometry: Any = None, **options: Any) -> Any:
    """``lax.psum(x, axis_name)`` through giftcomm's wire: the sum over the devices of the mesh
    axis (or tuple of axes) ``axis_name`` of every leaf of the pytree ``x`` (float16, bfloat16
    or float32 leaves; returned in their shapes and dtypes, identical on every device).
    ``options``: the call options (docs/api.md) as keywords or one CallOptions as ``options=``
    (fmt="e4m3", block, rounding, seed, mx_scale, algorithm "auto"/"ring"/"direct"; op is the
    function's; slice_elems and timeout stay None); ``seed`` may also be an integer array (traced:
    e.g. the step number, the same on every device), a scalar below 2**32 or uint32[2] words
    (low, high) of a 64-bit seed, rounding exactly as that int seed does.
    feedback: None, or the error-feedback state (:func:`feedback_init`; a pytree of float32
    leaves like x's): then the call returns ``(result, new_state)``, the state's residual added
    to x before the reduction and the new state what this device's own encodes lost
    (giftcomm.collectives.feedback.ErrorFeedback with the pieces of ``own_pieces``). geometry: None, a
    giftcomm Geometry or a :class:`~giftcomm.adapters.jax.geometry.JaxGeometry` over the packed
    leaves (tree order; e.g. built on ``tree_spec(x).layout``): the reduction runs in its
    coordinates, ``inverse(sum(forward(x)))`` (GIFT), the residual mapped back to x's.
    Call inside ``jax.shard_map`` (under jit)."""
    return _reduce("psum", x, axis_name, "sum", options, feedback, geometry)


def pmean(x: Any, axis_name: Any, *, feedback: Any = None, geometry: Any = None, **options: Any) -> Any:
    """``lax.pmean``: :func:`psum` divided by the number of devices (in float32, then cast);
    the same keywords."""
    return _reduce("pmean", x, axis_name, "avg", options, feedback, geometry)


def psum_scatter(x: Any, axis_name: Any, *, scatter_dimension: int = 0, tiled: bool = False, feedback: Any = None,
                 **options: Any) -> Any:
    """``lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=...)`` through giftcomm's
    wire, on every leaf of the pytree ``x``: device r gets the sum of the r-th slice along
    ``scatter_dimension`` (tiled=False: that dimension must have size P and is removed;
    tiled=True: it must divide by P and shrinks P-fold). One reduce-scatter carries every leaf
    (row r of the packed (P, m) matrix is device r's slices); equal to
    ``giftcomm.simulate_reduce_scatter(..., layout="equal")`` of the packed rows. feedback: as
    for :func:`psum` (a state like x's leaves; returns ``(result, new_state)``; at P = 1 nothing
    is encoded and the new state is 0)."""
    owner = "psum_scatter"
    opts, traced_seed = _options(owner, "sum", options)
    axis, p = _axis(owner, axis_name)
    leaves, treedef = _leaves(owner, x)
    fb = None
    if feedback is not None:
        if not opts.format.scaled:
            raise ValueError(f"{owner}: feedback needs a block-scaled format; {opts.fmt} is a pass-through format "
                             "(nothing to feed back)")
        fb = _feedback_leaves(owner, feedback, treedef, [int(np.prod(v.shape, dtype=np.int64)) for v in leaves])
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
        values = leaf.astype(jnp.float32)
        if fb is not None:  # compensate (ErrorFeedback.compensate), in the leaf's own layout
            values = values + fb[i].reshape(leaf.shape)
        moved = jnp.moveaxis(values, dim, 0)
        piece = moved.reshape((p, size // p) + moved.shape[1:])
        shapes.append((dim, piece.shape[1:] if tiled else moved.shape[1:], leaf.dtype, moved.shape))
        rows.append(piece.reshape(p, -1))
    m = sum(int(r.shape[1]) for r in rows)
    _check_size(owner, m * p)
    if m == 0:
        return x if fb is None else (x, feedback)
    ring = _Ring(opts, axis, p, traced_seed)
    los = np.arange(p, dtype=np.int64) * m
    if fb is None:
        mine = ring.reduce_scatter(jnp.concatenate(rows, axis=1), los)
    else:
        mine, err = ring.reduce_scatter(jnp.concatenate(rows, axis=1), los, own_error=True)
        err = jnp.where(jnp.isfinite(err), err, jnp.float32(0))
    out, new, off = [], [], 0
    for i, ((dim, shape, dtype, moved_shape), r) in enumerate(zip(shapes, rows)):
        k = int(r.shape[1])
        piece = mine[off : off + k].reshape(shape)  # tiled: the scatter dimension in front
        out.append((jnp.moveaxis(piece, 0, dim) if tiled else piece).astype(dtype))
        if fb is not None:  # the residual's (P, k) columns back to the leaf's layout
            e = jnp.moveaxis(err[:, off : off + k].reshape(moved_shape), 0, dim)
            new.append(e.reshape(fb[i].shape))
        off += k
    result = jax.tree_util.tree_unflatten(treedef, out)
    return result if fb is None else (result, jax.tree_util.tree_unflatten(treedef, new))


def wire_bytes(n: int, p: int, **options: Any) -> int:
    """Bytes one device sends in :func:`psum` of n values on p devices: the algorithm row's
    ``chunk_messages(p)`` messages of one chunk, every chunk padded to the longest (ring: P - 1
    hops, plus its one message in the allgather, received by P - 1 devices)."""
    opts, _ = _options("wire_bytes", "sum", options)
    if p == 1:
        return 0
    messages = BY_NAME[opts.algorithm].chunk_messages
    assert messages is not None  # every row with a jit schedule has it (giftcomm.algorithms)
    lens = np.diff(shared_chunk_bounds(n, p, opts.resolved_block))
    return messages(p) * message_nbytes(int(lens.max()), opts.format, opts.resolved_block)
