"""A giftcomm Geometry as ``jnp`` matrix products, for GIFT inside ``jax.jit``.

:class:`JaxGeometry` holds, per segment of a :class:`giftcomm.geometry.Geometry` that is not the
identity, the segment's two sides as float32 arrays: a diagonal side as its scale vectors
(forward ``s``, inverse ``1/s``), every other side (full KFAC, low-rank, Hadamard, the paper
preset's Cholesky factor) as the dense (d, d) matrices of its forward and inverse maps,
materialised once on the host by applying the NumPy side to the identity matrix. Forward on a
flat float32 vector: each segment's (m, n) matrix view ``X -> S_L X S_R^T`` (``L @ X @ R``,
float32 products at ``Precision.HIGHEST``: no TF32 / bf16 passes on GPUs); inverse likewise with
the inverse maps; identity segments are copied.

It is a pytree whose leaves are those arrays: pass it to a jitted step as an argument (replicated,
``in_specs=P()`` under ``shard_map``) and a refreshed geometry of the same structure reuses the
compiled step; ``giftcomm.adapters.jax.psum(grads, "data", geometry=jg)`` applies it around the
reduction. Equal to ``Geometry.forward`` / ``inverse`` up to float32 rounding (the products are
summed in another order than NumPy's; the dense form of a low-rank or Hadamard side rounds
differently from its factored form): tests/jax_jit_cases.py bounds the difference.

Memory: a dense side costs d**2 float32 values (the paper preset's sides are dense anyway); a
diagonal side d.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...geometry import Geometry
from ...geometry.sides import DiagonalSide, IdentitySide, Side

__all__ = ["JaxGeometry", "SideArrays"]

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclass(frozen=True)
class _Seg:
    """Where one transformed segment lies and how its sides are stored (static)."""

    offset: int
    m: int
    n: int
    left: str    # "identity", "diag" or "dense"
    right: str


SideArrays = tuple[Any, ...]
"""(forward, inverse) arrays of one side: (d,) vectors (diagonal) or (d, d) matrices (dense; the
left side's in ``S @ X`` form, the right side's in ``X @ R`` form); () for the identity."""


def _side_arrays(side: Side, right: bool) -> tuple[str, SideArrays]:
    if isinstance(side, IdentitySide) or side.is_identity:
        return "identity", ()
    if isinstance(side, DiagonalSide):
        return "diag", (np.asarray(side.s_fwd, np.float32), np.asarray(side.s_inv, np.float32))
    eye = np.eye(side.dim, dtype=np.float32)
    apply = side.right if right else side.left
    fwd = np.ascontiguousarray(np.asarray(apply(eye.copy()), np.float32))
    inv = np.ascontiguousarray(np.asarray(apply(eye.copy(), inverse=True), np.float32))
    return "dense", (fwd, inv)


@jax.tree_util.register_pytree_node_class
class JaxGeometry:
    """A Geometry's maps as jnp arrays (see the module docstring). Build with :meth:`of`.

    size: the flat buffer's element count; segments: static placement of the transformed
    segments; arrays: per transformed segment ((left fwd, left inv), (right fwd, right inv))."""

    def __init__(self, size: int, segments: tuple[_Seg, ...], arrays: tuple[tuple[SideArrays, SideArrays], ...]):
        self.size, self.segments, self.arrays = int(size), tuple(segments), tuple(arrays)

    @classmethod
    def of(cls, geometry: Geometry | JaxGeometry) -> JaxGeometry:
        """The JaxGeometry of a giftcomm Geometry (itself for a JaxGeometry)."""
        if isinstance(geometry, JaxGeometry):
            return geometry
        if not isinstance(geometry, Geometry):
            raise TypeError(f"geometry must be a giftcomm.geometry.Geometry or a JaxGeometry, got "
                            f"{type(geometry).__name__}")
        segs, arrays = [], []
        for t in geometry.transforms:
            if t.is_identity or t.segment.size == 0:
                continue
            m, n = t.segment.matrix_shape
            lk, la = _side_arrays(t.left, right=False)
            rk, ra = _side_arrays(t.right, right=True)
            segs.append(_Seg(t.segment.offset, m, n, lk, rk))
            arrays.append((tuple(jnp.asarray(a) for a in la), tuple(jnp.asarray(a) for a in ra)))
        return cls(geometry.size, tuple(segs), tuple(arrays))

    @property
    def is_identity(self) -> bool:
        return not self.segments

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return (self.arrays,), (self.size, self.segments)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> JaxGeometry:
        return cls(aux[0], aux[1], children[0])

    def forward(self, flat: jax.Array) -> jax.Array:
        """float32[size] -> float32[size] in the geometry's coordinates (traceable)."""
        return self._apply(flat, 0)

    def inverse(self, flat: jax.Array) -> jax.Array:
        """float32[size] in the geometry's coordinates -> the original ones (traceable)."""
        return self._apply(flat, 1)

    def _apply(self, flat: jax.Array, which: int) -> jax.Array:
        flat = jnp.asarray(flat, jnp.float32).reshape(-1)
        if flat.size != self.size:
            raise ValueError(f"geometry covers {self.size} elements but the packed pytree has {flat.size}")
        pieces, at = [], 0
        for seg, (la, ra) in zip(self.segments, self.arrays):
            if seg.offset > at:
                pieces.append(flat[at : seg.offset])
            x = flat[seg.offset : seg.offset + seg.m * seg.n].reshape(seg.m, seg.n)
            if seg.right == "diag":
                x = x * ra[which][None, :]
            elif seg.right == "dense":
                x = jnp.matmul(x, ra[which], precision=_HIGHEST)
            if seg.left == "diag":
                x = la[which][:, None] * x
            elif seg.left == "dense":
                x = jnp.matmul(la[which], x, precision=_HIGHEST)
            pieces.append(x.reshape(-1))
            at = seg.offset + seg.m * seg.n
        if at < self.size:
            pieces.append(flat[at:])
        return jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]
