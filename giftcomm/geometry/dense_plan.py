"""Dense per-segment transform pairs on the GPU: ``Y = T_L @ X @ T_R`` for every segment, batched.

A flat gradient buffer holds segments (layers); segment ``k`` is the (m_k, n_k) row-major matrix
at element offset ``start_k``. A :class:`TransformPlan` holds, per segment, an optional dense
left factor ``T_L`` (m x m) and right factor ``T_R`` (n x n) (None = identity) and their
inverses, uploaded once to the device as float32. ``forward(flat)`` gives the transformed
buffer, ``inverse(flat)`` applies ``T_L^-1 @ Y @ T_R^-1``; elements outside every segment, and
segments with two identity sides, are copied unchanged.

Batching: segments with the same (m, n) and the same sides present are stacked and multiplied
with one batched ``xp.matmul`` per side (cuBLAS strided-batched GEMM under CuPy), so a model
with many equal layers costs two GEMM launches per shape group, not two per layer.

Precision: float32 operands and results. CuPy uses plain fp32 GEMM unless the environment sets
``CUPY_TF32=1`` (TF32 would change the transform's rounding, never the codec's bit-exactness,
but keep it off for reproducible numbers). Works on NumPy too (the CPU tests use it).

Relation to giftcomm.geometry: ``Geometry.forward`` / ``inverse`` take a CuPy array themselves
(side parameters uploaded once per backend, segments of equal shape and side kinds batched;
low-rank sides through the fused rank-(k_L + k_R) update, see ``giftcomm/geometry/apply.py``).
This plan is for arbitrary dense operator pairs (not necessarily symmetric, inverses computed if
not given); its batched product is the geometry's dense kernel, ``giftcomm.geometry.apply.dense_apply``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import _xp
from .apply import dense_apply

__all__ = ["SegmentPair", "TransformPlan"]


@dataclass
class SegmentPair:
    """One segment's operators: element offset ``start`` of its (m, n) row-major matrix; ``left``
    (m, m) or None, ``right`` (n, n) or None; ``left_inv``/``right_inv`` likewise (computed in
    float64 from the factor when not given)."""

    start: int
    m: int
    n: int
    left: Any = None
    right: Any = None
    left_inv: Any = None
    right_inv: Any = None

    @property
    def size(self) -> int:
        return self.m * self.n


def _inv(a: Any) -> np.ndarray | None:
    if a is None:
        return None
    return np.linalg.inv(np.asarray(a, dtype=np.float64)).astype(np.float32)


@dataclass
class _Group:
    m: int
    n: int
    starts: Any          # int64 (B,) element offsets, host
    index: Any           # (B, m*n) int64 element indices on the backend, for gather/scatter
    left: Any            # (B, m, m) float32 or None
    right: Any           # (B, n, n) float32 or None
    left_inv: Any
    right_inv: Any


class TransformPlan:
    """The segments of one buffer of ``size`` elements, grouped by shape, on backend ``xp``."""

    def __init__(self, size: int, pairs: Sequence[SegmentPair], xp: Any = np) -> None:
        self.size, self.xp = int(size), xp
        end = 0
        for p in sorted(pairs, key=lambda q: q.start):
            if p.start < end or p.start + p.size > size:
                raise ValueError(f"segment at {p.start} of {p.m}x{p.n} overlaps another or leaves the buffer")
            end = p.start + p.size
            for name, mat, dim in (("left", p.left, p.m), ("right", p.right, p.n)):
                if mat is not None and np.shape(mat) != (dim, dim):
                    raise ValueError(f"segment at {p.start}: {name} must be {dim}x{dim}, got {np.shape(mat)}")
        keyed: dict[tuple, list[SegmentPair]] = {}
        for p in pairs:
            if p.left is None and p.right is None:
                continue
            keyed.setdefault((p.m, p.n, p.left is not None, p.right is not None), []).append(p)
        self.groups: list[_Group] = []
        for (m, n, has_l, has_r), ps in keyed.items():
            starts = np.array([p.start for p in ps], np.int64)
            index = starts[:, None] + np.arange(m * n, dtype=np.int64)[None, :]

            def stack(mats: list) -> Any:
                return xp.asarray(np.stack([np.asarray(a, np.float32) for a in mats]))

            self.groups.append(_Group(
                m, n, starts, xp.asarray(index),
                stack([p.left for p in ps]) if has_l else None,
                stack([p.right for p in ps]) if has_r else None,
                stack([p.left_inv if p.left_inv is not None else _inv(p.left) for p in ps]) if has_l else None,
                stack([p.right_inv if p.right_inv is not None else _inv(p.right) for p in ps]) if has_r else None,
            ))

    def _apply(self, flat: Any, inverse: bool) -> Any:
        xp = self.xp
        if _xp.array_module(flat) is not xp:
            raise TypeError(f"this plan lives on {xp.__name__}; got a {type(flat).__name__}")
        flat = xp.ascontiguousarray(flat, dtype=np.float32).reshape(-1)
        if flat.size != self.size:
            raise ValueError(f"plan covers {self.size} elements, got {flat.size}")
        out = flat.copy()
        for g in self.groups:
            x = flat[g.index].reshape(-1, g.m, g.n)
            left, right = (g.left_inv, g.right_inv) if inverse else (g.left, g.right)
            out[g.index] = dense_apply(xp, x, left, right).reshape(len(g.starts), -1)
        return out

    def forward(self, flat: Any) -> Any:
        """``T_L @ X @ T_R`` on every segment of the flat float32 buffer (a new array)."""
        return self._apply(flat, inverse=False)

    def inverse(self, flat: Any) -> Any:
        """``T_L^-1 @ Y @ T_R^-1`` on every segment (a new array)."""
        return self._apply(flat, inverse=True)

    def flops(self) -> float:
        """Floating-point operations of one forward (or inverse) call."""
        total = 0.0
        for g in self.groups:
            b = len(g.starts)
            if g.left is not None:
                total += 2.0 * b * g.m * g.m * g.n
            if g.right is not None:
                total += 2.0 * b * g.m * g.n * g.n
        return total
