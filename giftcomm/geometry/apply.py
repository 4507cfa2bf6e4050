"""Applying a Geometry to a flat buffer: batched, fused, on any array backend (NumPy, CuPy).

Segments are grouped by (matrix shape, side kinds, ranks). A group whose sides are low rank or
identity (``S = c I + U E U^T``, identity: ``c = 1``, no U) is applied with the fused formula
(docs/method.md, section 2, "application"):

    P = X U_R,  Q = U_L^T X                       (one read of X)
    W = U_L^T P;  A = (c_L P + U_L E_L W) E_R;  B = c_R E_L Q           (small)
    Y = c_L c_R X + [A | U_L] @ [U_R^T ; B]       (one rank-(k_L + k_R) GEMM, one read of X,
                                                   one write of Y)

which equals ``S_L X S_R`` (both sides symmetric). On NumPy the two sweeps go over tiles of
about ``TILE_ELEMENTS`` values (whole matrices of a batch when they are that small, else row
blocks of one matrix), so the second read of each tile and the ``c X`` term come from the cache:
about two reads and one write of the segment per direction instead of the six sweeps of the
side-by-side application. A right-side-only transform finishes each row tile on its own: one
sweep per direction. Rank-1 sides are padded with a zero-weight column (exact). Groups with dense
sides use ``S_L @ X @ S_R`` as one batched matmul per side (the same kernel as
``giftcomm.geometry.dense_plan.TransformPlan``); other kinds (diagonal, Hadamard, mixes) go segment by
segment through the sides' own ``left`` / ``right``.

Batching: on NumPy only segments adjacent in the buffer are batched (a view, no gather); on other
backends all segments of a group are gathered with one index array (one kernel) and batched.
Side parameters are stacked once per group and backend and cached on the plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .sides import DenseSide, IdentitySide, LowRankSide

__all__ = ["ApplyPlan", "TILE_ELEMENTS", "dense_apply", "lowrank_apply"]

TILE_ELEMENTS = 1 << 16  # 256 KiB of fp32: a tile and its scratch stay in L2


def dense_apply(xp, x3, left3=None, right3=None):
    """``left3 @ x3 @ right3`` on a (B, m, n) stack (None: identity side); float32, batched."""
    y = x3
    if left3 is not None:
        y = xp.matmul(left3, y)
    if right3 is not None:
        y = xp.matmul(y, right3)
    return y


@dataclass
class _LowRankParams:
    """Stacked parameters of a low-rank/identity group on one backend, for one direction, with
    the products the fused formula needs precomputed (fewer array operations per call)."""

    ul: Any = None     # (B, m, kL)
    ult: Any = None    # (B, kL, m)
    ur: Any = None     # (B, n, kR)
    urt: Any = None    # (B, kR, n)
    cc: Any = None     # (B, 1, 1): c_L c_R
    ldr: Any = None    # (B, 1, kR): c_L E_R (two-sided) or E_R (right only)
    dldr: Any = None   # (B, kL, kR): E_L (x) E_R (two-sided)
    rdl: Any = None    # (B, kL, 1): c_R E_L (two-sided) or E_L (left only)


def _tiles(b: int, m: int, n: int, numpy: bool, tile: int):
    """(batch slice, row slice) tiles covering a (b, m, n) stack."""
    if not numpy or b * m * n <= tile:
        return [(slice(0, b), slice(0, m))]
    if m * n <= tile:
        bt = max(1, tile // (m * n))
        return [(slice(i, min(i + bt, b)), slice(0, m)) for i in range(0, b, bt)]
    rt = max(1, tile // max(n, 1))
    return [(slice(i, i + 1), slice(r, min(r + rt, m))) for i in range(b) for r in range(0, m, rt)]


def lowrank_apply(xp, x3, out3, p: _LowRankParams, tile: int = TILE_ELEMENTS):
    """``out3 = S_L x3 S_R`` for a (B, m, n) stack, sides ``c I + U E U^T`` (or identity).

    x3 may have any float dtype (tiles are cast to float32 in the cache); out3 is float32 and may
    be x3 itself (in place).
    """
    b, m, n = x3.shape
    f32 = np.float32
    numpy = xp is np
    has_l, has_r = p.ul is not None, p.ur is not None
    if has_r and not has_l and numpy and b * m * n > tile:
        return _right_sided_tiled(xp, x3, out3, p, tile)
    tiles = _tiles(b, m, n, numpy, tile)

    def tile_in(bs, rs):
        t = x3[bs, rs]
        return t if t.dtype == f32 else t.astype(f32)

    # pass 1: P = X U_R and Q = U_L^T X, tile by tile (the second product reads the cached tile)
    P = xp.empty((b, m, p.ur.shape[2]), f32) if has_r else None
    if has_l and len(tiles) == 1:
        xt = tile_in(*tiles[0])
        if has_r:
            xp.matmul(xt, p.ur, out=P)
        Q = xp.matmul(p.ult, xt)
    else:
        Q = xp.zeros((b, p.ult.shape[1], n), f32) if has_l else None
        for bs, rs in tiles:
            xt = tile_in(bs, rs)
            if P is not None:  # has_r
                xp.matmul(xt, p.ur[bs], out=P[bs, rs])
            if Q is not None:  # has_l
                Q[bs] += xp.matmul(p.ult[bs, :, rs], xt)
    # the small factors of the rank-(kL + kR) update L @ R
    if has_l and has_r:
        a = P * p.ldr
        a += xp.matmul(p.ul, xp.matmul(p.ult, P) * p.dldr)
        lm = xp.concatenate([a, p.ul], axis=2)
        rm = xp.concatenate([p.urt, p.rdl * Q], axis=1)
    elif has_r:
        lm, rm = P * p.ldr, p.urt
    else:
        lm, rm = p.ul, p.rdl * Q
    cc = p.cc
    # pass 2: Y = c_L c_R X + L @ R, tile by tile; c X goes through one preallocated scratch tile
    # (a fresh temporary per tile would be mapped and faulted in every time)
    bs0, rs0 = tiles[0]
    scratch = xp.empty((bs0.stop - bs0.start, rs0.stop - rs0.start, n), f32)
    for bs, rs in tiles:  # the tile of X is read before its output tile is written: out3 may be x3
        st = scratch[: bs.stop - bs.start, : rs.stop - rs.start]
        xp.multiply(tile_in(bs, rs), cc[bs], out=st)
        ot = out3[bs, rs]
        xp.matmul(lm[bs, rs], rm[bs], out=ot)
        ot += st
    return out3


def _right_sided_tiled(xp, x3, out3, p: _LowRankParams, tile: int):
    """A right-side-only low-rank transform in a single sweep of row tiles: ``S_R`` acts within
    each row, so ``Y_t = c X_t + (X_t U) E U^T`` finishes every tile on its own (one read of X,
    one write of Y per direction; the tile's second read comes from the cache). A left-only
    transform needs all rows for ``U^T X`` and takes the two-sweep path (column tiles of the
    row-major buffer measured slower)."""
    b, m, n = x3.shape
    f32 = np.float32
    rt = max(1, tile // max(n, 1))
    tiles = [(i, slice(r, min(r + rt, m))) for i in range(b) for r in range(0, m, rt)]
    scratch = xp.empty((min(rt, m), n), f32)
    small = xp.empty((min(rt, m), p.ur.shape[2]), f32)
    for i, rs in tiles:
        xt = x3[i, rs]
        if xt.dtype != f32:
            xt = xt.astype(f32)
        st = scratch[: rs.stop - rs.start]
        xp.multiply(xt, p.cc[i, 0, 0], out=st)  # read before the output tile is written (in place)
        sm = small[: rs.stop - rs.start]
        xp.matmul(xt, p.ur[i], out=sm)
        sm *= p.ldr[i]
        ot = out3[i, rs]
        xp.matmul(sm, p.urt[i], out=ot)
        ot += st
    return out3


def _stack(xp, arrays, dtype=np.float32):
    return xp.asarray(np.ascontiguousarray(np.stack([np.asarray(a, dtype) for a in arrays])))


def _lowrank_params(xp, lefts, rights, inverse: bool) -> _LowRankParams:
    def side(sides):
        if isinstance(sides[0], IdentitySide):
            return None, None, np.ones(len(sides)), None
        d = np.stack([s.delta_inv if inverse else s.delta_fwd for s in sides]).astype(np.float64)
        c = np.array([s.c_inv if inverse else s.c_fwd for s in sides], np.float64)
        u = np.stack([s.u for s in sides])
        if u.shape[2] == 1:  # rank 1: pad with a zero column of zero weight (exact) so that no
            # product is NumPy's slow (m, 1) @ (1, n) outer product
            u, d = np.concatenate([u, np.zeros_like(u)], axis=2), np.concatenate([d, np.zeros_like(d)], axis=1)
        return xp.asarray(u), xp.asarray(np.ascontiguousarray(u.transpose(0, 2, 1))), c, d

    ul, ult, cl, dl = side(lefts)
    ur, urt, cr, dr = side(rights)
    up = lambda a: xp.asarray(np.ascontiguousarray(a, np.float32))  # noqa: E731
    p = _LowRankParams(ul=ul, ult=ult, ur=ur, urt=urt, cc=up((cl * cr)[:, None, None]))
    if dl is not None and dr is not None:
        p.ldr, p.dldr, p.rdl = up((cl[:, None] * dr)[:, None, :]), up(dl[:, :, None] * dr[:, None, :]), \
            up((cr[:, None] * dl)[:, :, None])
    elif dr is not None:
        p.ldr = up(dr[:, None, :])
    else:
        p.rdl = up(dl[:, :, None])
    return p


@dataclass
class _Group:
    """Segments (indices into the geometry's transforms) applied together."""

    kind: str                 # "lowrank", "dense" or "sides" (segment by segment)
    m: int
    n: int
    items: list               # transform indices, in buffer order
    params: dict = field(default_factory=dict)  # inverse flag -> stacked parameters
    index: Any = None         # gather index on the backend (groups that are not one run)


def _group_kind(t) -> str:
    kinds = {type(t.left), type(t.right)}
    if kinds <= {LowRankSide, IdentitySide}:
        return "lowrank"
    if kinds <= {DenseSide, IdentitySide}:
        return "dense"
    return "sides"


def _side_key(s) -> tuple:
    return (s.kind, s.rank)


class ApplyPlan:
    """How one Geometry is applied on one backend ``xp``: its groups and stacked parameters."""

    def __init__(self, transforms, xp):
        self.xp = xp
        self.transforms = transforms
        numpy = xp is np
        self.groups: list[_Group] = []
        open_: dict[tuple, _Group] = {}
        last_stop: dict[tuple, int] = {}
        for i, t in enumerate(transforms):
            seg = t.segment
            if t.is_identity or seg.size == 0:
                continue
            kind = _group_kind(t)
            m, n = seg.matrix_shape
            key = (kind, m, n, _side_key(t.left), _side_key(t.right))
            g = open_.get(key) if kind != "sides" else None
            # NumPy batches runs of adjacent segments only (a view); other backends gather
            if g is not None and (not numpy or last_stop[key] == seg.offset):
                g.items.append(i)
            else:
                g = _Group(kind, m, n, [i])
                self.groups.append(g)
                open_[key] = g
            last_stop[key] = seg.stop
        self.identity_runs = _runs([t.segment for t in transforms if t.is_identity and t.segment.size])

    def _contiguous(self, g: _Group) -> bool:
        segs = [self.transforms[i].segment for i in g.items]
        return all(a.stop == b.offset for a, b in zip(segs, segs[1:]))

    def _params(self, g: _Group, inverse: bool):
        if inverse not in g.params:
            ts = [self.transforms[i] for i in g.items]
            xp = self.xp
            if g.kind == "lowrank":
                g.params[inverse] = _lowrank_params(xp, [t.left for t in ts], [t.right for t in ts], inverse)
            else:  # dense: S_R is symmetric, so X S_R^T = X S_R
                def side(attr):
                    ss = [getattr(t, attr) for t in ts]
                    if isinstance(ss[0], IdentitySide):
                        return None
                    return _stack(xp, [s.inv if inverse else s.fwd for s in ss])
                g.params[inverse] = (side("left"), side("right"))
        return g.params[inverse]

    def apply(self, x, inverse: bool, out=None):
        """Float32 (size,) array (new, or ``out``): every segment of ``x`` transformed (identity:
        copied)."""
        xp = self.xp
        if out is None:
            out = xp.empty(x.shape[0], np.float32)
        if out is not x:
            for a, b in self.identity_runs:
                out[a:b] = x[a:b]
        for g in self.groups:
            segs = [self.transforms[i].segment for i in g.items]
            if g.kind == "sides":
                t = self.transforms[g.items[0]]
                mat = xp.ascontiguousarray(x[segs[0].offset:segs[0].stop], dtype=np.float32).reshape(g.m, g.n)
                res = t.inverse(mat) if inverse else t.forward(mat)
                out[segs[0].offset:segs[0].stop] = res.reshape(-1)
                continue
            nb = len(segs)
            if self._contiguous(g):
                lo, hi = segs[0].offset, segs[-1].stop
                x3 = x[lo:hi].reshape(nb, g.m, g.n)
                out3 = out[lo:hi].reshape(nb, g.m, g.n)
                scatter = None
            else:
                if g.index is None:
                    starts = np.array([s.offset for s in segs], np.int64)
                    g.index = xp.asarray(starts[:, None] + np.arange(g.m * g.n, dtype=np.int64)[None, :])
                x3 = x[g.index].reshape(nb, g.m, g.n)
                out3 = xp.empty((nb, g.m, g.n), np.float32)
                scatter = g.index
            params = self._params(g, inverse)
            if g.kind == "lowrank":
                lowrank_apply(xp, x3, out3, params, TILE_ELEMENTS)
            else:
                xin = x3 if x3.dtype == np.float32 else x3.astype(np.float32)
                out3[...] = dense_apply(xp, xin, *params)
            if scatter is not None:
                out[scatter] = out3.reshape(nb, -1)
        return out


def _runs(segs) -> list[tuple[int, int]]:
    """Maximal [start, stop) element ranges covered by adjacent segments (buffer order)."""
    runs: list[list[int]] = []
    for s in sorted(segs, key=lambda s: s.offset):
        if runs and runs[-1][1] == s.offset:
            runs[-1][1] = s.stop
        else:
            runs.append([s.offset, s.stop])
    return [(a, b) for a, b in runs]
