"""GIFT for sharded gradients (FSDP2, ZeRO): a geometry whose inverse works on one shard alone.

FSDP2 pads dim 0 of every parameter to a multiple of ``P`` and gives rank ``r`` rows
``[r*c, (r+1)*c)`` of each one, ``c = ceil(m / P)`` (m = dim 0); its reduce-scatter buffer is
``(P, N/P)``, row ``r`` the concatenation of every parameter's chunk ``r``. A segment transform
``Y = S_L X S_R^T`` on the (m, n) matrix view (giftcomm.geometry.transform) is shard-local when
it maps each chunk of rows to itself:

- the right side ``S_R`` (from A, the input axis) acts within each row: always shard-local;
- the left side ``S_L`` (from G, the output axis) mixes rows, so here it is block-diagonal,
  one block per chunk: block ``r`` whitens with the principal sub-matrix ``G[rows_r, rows_r]``,
  damped relative to the *whole* factor's mean eigenvalue (so a G that is already
  block-diagonal gives exactly the unsharded transform). Padding rows get the identity.

A 1-D parameter (bias, norm scale: matrix view (1, n)) is sharded along its n axis, so there the
right side is the block-diagonal one. The sharded side is always full whitening of its blocks
(or diagonal for a diagonal factor); ``rank`` applies to the other side only.

:class:`ShardedGeometry` holds, for a layout and ``P``, one :class:`Geometry` per shard (over
:func:`shard_layout`: the segments' chunks, padded, in buffer order) and the same operator over
the unsharded layout (:meth:`ShardedGeometry.full`). Forward on rank ``q`` is every shard's
forward on its row of the buffer; the inverse of the reduced shard ``r`` is ``shard(r).inverse``
alone. See docs/method.md "Sharded gradients".
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from math import prod
from typing import Any

import numpy as np

from ..options import DEFAULT_DAMPING
from .geometry import Geometry, check_damping, rank_choice
from .layout import Layout, as_layout
from .sides import DenseSide, DiagonalSide, Side
from .spectral import Spectrum, damped
from .transform import SegmentTransform, identity_transform, make_side

__all__ = ["ShardedGeometry", "row_chunks", "shard_layout", "restrict", "inverse_flat_shard"]


def row_chunks(m: int, shards: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 chunks of ``m`` rows on ``shards`` ranks: ``c = ceil(m / shards)`` and chunk
    ``r`` the real rows ``[min(r*c, m), min((r+1)*c, m))`` (the rest of its ``c`` rows padding)."""
    c = -(-m // shards)
    return [(min(r * c, m), min((r + 1) * c, m)) for r in range(shards)]


def check_shards(shards: Any) -> int:
    if isinstance(shards, bool) or not isinstance(shards, (int, np.integer)) or shards < 1:
        raise ValueError(f"shards must be a positive int (the number of ranks), got {shards!r}")
    return int(shards)


def shard_layout(layout, shards: int, rank: int) -> Layout:
    """The layout of rank ``rank``'s row of the sharded buffer: each segment as its padded dim-0
    chunk, shape ``(ceil(m / shards), *shape[1:])``, in the layout's order. ValueError for a 0-d
    segment (FSDP2 shards along dim 0)."""
    layout = as_layout(layout)
    shards = check_shards(shards)
    if not 0 <= rank < shards:
        raise ValueError(f"rank {rank} is not in [0, {shards})")
    for seg in layout:
        if seg.ndim == 0:
            raise ValueError(f"segment {seg.name!r} is 0-d; sharded layouts split dim 0")
    return Layout([(s.name, (-(-s.shape[0] // shards), *s.shape[1:])) for s in layout])


def _factor(f: Any) -> tuple[np.ndarray, bool]:
    """(float64 matrix or diagonal, is_diagonal) of a factor given as a square matrix, a 1-D
    diagonal or a Spectrum."""
    if isinstance(f, Spectrum):
        if f.vectors is None:
            return f.values * f.scale, True
        return (f.vectors * (f.values * f.scale)) @ f.vectors.T, False
    a = np.asarray(f, dtype=np.float64)
    if a.ndim == 1:
        return a, True
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"a Kronecker factor is a square matrix or a 1-D diagonal, got shape {a.shape}")
    return 0.5 * (a + a.T), False


def _block_pairs(f: Any, dim: int, shards: int, damping: float) -> tuple[list[tuple[np.ndarray, np.ndarray]], bool]:
    """Per chunk of ``dim``: the (forward, inverse) whitening of the factor's principal block,
    float64 (matrices, or vectors for a diagonal factor), damped relative to the whole factor's
    mean eigenvalue."""
    mat, diagonal = _factor(f)
    if mat.shape[0] != dim:
        raise ValueError(f"factor of size {mat.shape[0]} does not match the segment's axis of size {dim}")
    if not np.all(np.isfinite(mat)):
        raise ValueError("a Kronecker factor has non-finite entries")
    mean = float(np.mean(mat) if diagonal else np.trace(mat) / max(dim, 1))
    pairs = []
    for lo, hi in row_chunks(dim, shards):
        if diagonal:
            v = mat[lo:hi] / mean if mean > 0 else np.ones(hi - lo)
            p = damped(np.maximum(v, 0.0), damping)
            pairs.append((p**-0.5, p**0.5))
            continue
        if mean > 0:
            vals, vecs = np.linalg.eigh(mat[lo:hi, lo:hi] / mean)
        else:
            vals, vecs = np.ones(hi - lo), np.eye(hi - lo)
        p = damped(np.maximum(vals, 0.0), damping)
        fwd, inv = (vecs * p**-0.5) @ vecs.T, (vecs * p**0.5) @ vecs.T
        pairs.append((0.5 * (fwd + fwd.T), 0.5 * (inv + inv.T)))
    return pairs, diagonal


def _side(pairs: list[tuple[np.ndarray, np.ndarray]], diagonal: bool, pad: int = 0) -> Side:
    """One side from chunk blocks: block-diagonal over them, then ``pad`` identity rows."""
    if diagonal:
        fwd = np.concatenate([f for f, _ in pairs] + [np.ones(pad)])
        inv = np.concatenate([i for _, i in pairs] + [np.ones(pad)])
        return DiagonalSide(fwd, inv)
    sizes = [f.shape[0] for f, _ in pairs]
    d = sum(sizes) + pad
    fwd, inv = np.eye(d), np.eye(d)
    lo = 0
    for (f, i), k in zip(pairs, sizes):
        fwd[lo : lo + k, lo : lo + k], inv[lo : lo + k, lo : lo + k] = f, i
        lo += k
    return DenseSide(fwd, inv)


class ShardedGeometry:
    """One GIFT geometry per shard of a dim-0 sharded buffer, plus the same operator unsharded.

    Build with :meth:`from_kfac` (or :meth:`identity`). ``layout``: the unsharded layout (each
    segment a parameter, its full shape); ``shards``: P. :meth:`shard` (r) is a Geometry over
    :func:`shard_layout` (layout, P, r); :meth:`full` a Geometry over ``layout`` whose
    restriction to chunk r equals ``shard(r)`` (up to float32 rounding). Identical on every
    rank built from the same factors; :meth:`fingerprint` covers every shard.
    """

    def __init__(self, layout: Layout, shards: int, per_shard: list[Geometry], full: Geometry) -> None:
        self.layout, self.shards = as_layout(layout), check_shards(shards)
        if len(per_shard) != self.shards:
            raise ValueError(f"need {self.shards} shard geometries, got {len(per_shard)}")
        self._shards, self._full = list(per_shard), full
        self._fingerprint: int | None = None

    @property
    def shard_size(self) -> int:
        """Elements of one shard's row of the padded buffer (N / P)."""
        return self._shards[0].size

    @property
    def is_identity(self) -> bool:
        return self._full.is_identity

    def shard(self, rank: int) -> Geometry:
        """Rank ``rank``'s geometry over its padded row (shard_layout(layout, P, rank))."""
        return self._shards[rank]

    def full(self) -> Geometry:
        """The operator over the unsharded layout (left factors block-diagonal along the chunks)."""
        return self._full

    def forward_rows(self, rows: Any, out: Any = None) -> Any:
        """``rows``: (P, N/P) array (the sharded buffer, any float dtype, NumPy or CuPy) -> float32
        (P, N/P) with every row in its shard's GIFT coordinates (``out`` if given)."""
        if tuple(rows.shape) != (self.shards, self.shard_size):
            raise ValueError(f"expected a ({self.shards}, {self.shard_size}) buffer, got shape {tuple(rows.shape)}")
        if out is None:
            out = _empty_like(rows, np.float32)
        for r in range(self.shards):
            self._shards[r].forward(rows[r], out=out[r])
        return out

    def fingerprint(self) -> int:
        """Signed 64-bit BLAKE2b over P and every shard's fingerprint."""
        if self._fingerprint is None:
            h = hashlib.blake2b(b"giftcomm.sharded/v1", digest_size=8)
            h.update(self.shards.to_bytes(8, "little"))
            for g in self._shards:
                h.update(int(g.fingerprint()).to_bytes(8, "little", signed=True))
            self._fingerprint = int.from_bytes(h.digest(), "little", signed=True)
        return self._fingerprint

    def __repr__(self) -> str:
        return f"<ShardedGeometry {len(self.layout)} segments on {self.shards} shards, fingerprint {self.fingerprint():#x}>"

    # ------------------------------------------------------------------ constructors
    @classmethod
    def identity(cls, layout, shards: int) -> ShardedGeometry:
        layout, shards = as_layout(layout), check_shards(shards)
        return cls(layout, shards, [Geometry.identity(shard_layout(layout, shards, r)) for r in range(shards)],
                   Geometry.identity(layout))

    @classmethod
    def from_kfac(cls, layout, factors: Mapping, shards: int, rank=None,
                  damping: float = DEFAULT_DAMPING) -> ShardedGeometry:
        """KFAC whitening made shard-local (module doc): ``factors`` name -> (A, G) as for
        :meth:`Geometry.from_kfac` (matrix, 1-D diagonal or Spectrum); ``rank`` (None, k,
        (k_out, k_in) or a mapping) applies to the side that is not sharded. Segments without
        factors get the identity. ValueError for sizes that do not match the layout."""
        layout, shards, damping = as_layout(layout), check_shards(shards), check_damping(damping)
        rows = [shard_layout(layout, shards, r) for r in range(shards)]
        per: list[list[SegmentTransform]] = [[] for _ in range(shards)]
        full: list[SegmentTransform] = []
        for name in factors:
            if name not in layout:
                raise ValueError(f"factors given for {name!r}, which is not a segment of the layout")
        for i, seg in enumerate(layout):
            if seg.name not in factors:
                full.append(identity_transform(seg, "no factors"))
                for r in range(shards):
                    per[r].append(identity_transform(rows[r].segments[i], "no factors"))
                continue
            try:
                a, g = factors[seg.name]
            except (TypeError, ValueError):
                raise ValueError(f"factors[{seg.name!r}] must be an (A, G) pair") from None
            m, n = seg.matrix_shape
            choice_g, choice_a = rank_choice(rank, seg.name, m, n)
            if seg.ndim >= 2:  # rows sharded: G block-diagonal, A as chosen
                pairs, diagonal = _block_pairs(g, m, shards, damping)
                other = make_side(_spectrum(a, n), n, choice_a, damping)
                full.append(SegmentTransform(seg, _side(pairs, diagonal), other, {"note": f"sharded x{shards}"}))
                for r in range(shards):
                    s = rows[r].segments[i]
                    left = _side([pairs[r]], diagonal, s.shape[0] - pairs[r][0].shape[0])
                    per[r].append(SegmentTransform(s, left, other, {"note": f"shard {r}/{shards}"}))
            else:  # a 1-D segment (1, n): its n axis is sharded, so A is block-diagonal
                pairs, diagonal = _block_pairs(a, n, shards, damping)
                other = make_side(_spectrum(g, m), m, choice_g, damping)
                full.append(SegmentTransform(seg, other, _side(pairs, diagonal), {"note": f"sharded x{shards}"}))
                for r in range(shards):
                    s = rows[r].segments[i]
                    right = _side([pairs[r]], diagonal, s.shape[0] - pairs[r][0].shape[0])
                    per[r].append(SegmentTransform(s, other, right, {"note": f"shard {r}/{shards}"}))
        return cls(layout, shards, [Geometry(rows[r], per[r]) for r in range(shards)], Geometry(layout, full))


def _spectrum(f: Any, dim: int) -> Spectrum:
    if isinstance(f, Spectrum):
        spec = f
    else:
        a = np.asarray(f)
        spec = Spectrum.from_diagonal(a) if a.ndim == 1 else Spectrum.from_matrix(a)
    if spec.dim != dim:
        raise ValueError(f"factor of size {spec.dim} does not match the segment's axis of size {dim}")
    return spec


def _empty_like(rows: Any, dtype) -> Any:
    from .._xp import array_module

    return array_module(rows).empty(tuple(rows.shape), dtype)


def restrict(layout, flat: np.ndarray, shards: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s padded row of the sharded buffer of an unsharded flat buffer (float32):
    every segment's chunk ``rank``, zero-padded to ``ceil(m / P)`` rows, in layout order (what
    FSDP2's reduce-scatter input holds in row ``rank``)."""
    layout = as_layout(layout)
    parts = []
    for seg in layout:
        rows = np.asarray(flat[seg.offset : seg.stop], np.float32).reshape(seg.shape[0], -1)
        c = -(-seg.shape[0] // shards)
        lo, hi = row_chunks(seg.shape[0], shards)[rank]
        chunk = np.zeros((c, prod(seg.shape[1:])), np.float32)
        chunk[: hi - lo] = rows[lo:hi]
        parts.append(chunk.reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def inverse_flat_shard(geometry: Geometry, shard: Any, lo: int, comm: Any = None) -> np.ndarray:
    """Collective: ``geometry.inverse`` restricted to the elements ``[lo, lo + shard.size)`` of the
    flat buffer (ZeRO's equal shards, e.g. ShardedGradSync), from this rank's shard alone plus one
    small exchange.

    For a geometry whose transformed segments act on the input side only (identity left side,
    e.g. the paper's preset: ``x -> x F^T`` row by row of the (m, n) view), every row wholly
    inside the shard is mapped here; a row that an equal split cuts at ``lo`` or at the shard's
    end is assembled from the pieces every rank holds of it (one ``allgather_object`` over
    ``comm`` of those pieces, at most two rows' worth per segment per rank; every rank calls it,
    even with nothing to send) and mapped whole, keeping this rank's part. shard: (k,) float
    array (NumPy) in the geometry's coordinates; returns (k,) float32. ValueError for a segment
    whose left side is not the identity (its map mixes rows: not shard-local this way)."""
    from .sync import as_transport

    x = np.asarray(shard, np.float32).reshape(-1)
    hi = lo + x.size
    out = x.copy()
    pieces: list[tuple[int, np.ndarray]] = []
    cut: list[tuple[Any, int, int]] = []  # (transform, row start, row end) of my rows cut by a shard edge
    for t in geometry.transforms:
        if t.is_identity:
            continue
        if not t.left.is_identity:
            raise ValueError(f"inverse_flat_shard: segment {t.segment.name!r} transforms its output side (rows mix); "
                             "only input-side geometries invert on an equal shard alone")
        seg = t.segment
        n = seg.matrix_shape[1]
        s0, s1 = max(seg.offset, lo), min(seg.stop, hi)
        if s0 >= s1:
            continue
        r0, r1 = (s0 - seg.offset) // n, -(-(s1 - seg.offset) // n)  # rows touched: [r0, r1)
        f0 = r0 if seg.offset + r0 * n >= lo else r0 + 1  # rows wholly inside: [f0, f1)
        f1 = r1 if seg.offset + r1 * n <= hi else r1 - 1
        if f1 > f0:
            a = seg.offset + f0 * n - lo
            rows = out[a : a + (f1 - f0) * n].reshape(f1 - f0, n)
            out[a : a + (f1 - f0) * n] = np.asarray(t.right.right(rows, inverse=True), np.float32).reshape(-1)
        for r in sorted({r0, r1 - 1} - set(range(f0, f1))):
            a, b = seg.offset + r * n, seg.offset + (r + 1) * n
            pieces.append((max(a, lo), x[max(a, lo) - lo : min(b, hi) - lo].copy()))
            cut.append((t, a, b))
    t_ = as_transport(comm)
    every = [pieces] if t_ is None or t_.size == 1 else t_.allgather_object(pieces)
    for t, a, b in cut:
        row = np.zeros(b - a, np.float32)
        for got in every:
            for start, vals in got:
                if a <= start < b:
                    row[start - a : start - a + vals.size] = vals
        y = np.asarray(t.right.right(row[None, :], inverse=True), np.float32)[0]
        out[max(a, lo) - lo : min(b, hi) - lo] = y[max(a, lo) - a : min(b, hi) - a]
    return out
