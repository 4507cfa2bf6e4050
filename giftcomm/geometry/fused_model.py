"""Host model of the fused GIFT transform kernels (kernels/gc_fused.cu): the same float32
operations in the same order, in NumPy, so that the kernels can be checked bit for bit; and the
layout both share (:class:`FusedLayout`: shape groups, the float32 parameter pool, the piece
table). Design: docs/gpu.md "Fused transform".

A segment whose sides are low rank or identity (``S = c I + U D U^T``) is

    Y = cc X + L1 U_R^T + U_L R2,   L1 = ldr * P,   R2 = rdl * Q + (dldr * W) U_R^T,
    P = X U_R,  Q = U_L^T X,  W = U_L^T P,

with ``cc = c_L c_R``, ``ldr = c_L D_R``, ``rdl = c_R D_L``, ``dldr = D_L (x) D_R`` (an identity
side: c = 1, rank 0), each rounded once to float32 from float64. ``inverse=True`` uses the
sides' inverse parameters (``S^-1 = c' I + U D' U^T``).

Operation order (the kernels'): P[b,i,r]: 32 lane partials (lane l sums j = l, l+32, ... in
order), then pairwise halving (offsets 16, 8, 4, 2, 1: the xor butterfly's lane 0); Q[b,s,j]:
rows i = 0..m-1 in order; Wd = dldr * (sum over i in order of U_L[i,s] P[i,r]); L1 = ldr * P;
R2t[b,j,s] = rdl*Q then + Wd[s,r] U_R[j,r] for r in order; y = cc x + acc with
acc = sum_r L1[i,r] U_R[j,r] (r in order) then + U_L[i,s] R2t[j,s] (s in order). No FMA, IEEE
float32 with subnormals (NumPy's float32 arithmetic).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .sides import IdentitySide, LowRankSide

__all__ = ["FusedLayout", "GroupLayout", "ModelGeometry", "supports", "project", "small", "apply_model",
           "transform_model"]

f32 = np.float32
RT = 8  # rank tile of the projection kernels (GC_FZ_RT)


def supports(geometry: Any) -> bool:
    """Whether every non-identity segment of ``geometry`` has low-rank or identity sides (what the
    fused kernels implement)."""
    ts = getattr(geometry, "transforms", None)
    if ts is None:
        return False
    return all(t.is_identity or t.segment.size == 0 or {type(t.left), type(t.right)} <= {LowRankSide, IdentitySide}
               for t in ts)


@dataclass
class GroupLayout:
    """Segments of one (m, n, kL, kR); ``o`` maps each stack name to its pool offset (elements)."""

    m: int
    n: int
    kl: int
    kr: int
    starts: np.ndarray  # (B,) int64 buffer offsets
    o: dict = field(default_factory=dict)

    @property
    def b(self) -> int:
        return int(self.starts.size)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        b, m, n, kl, kr = self.b, self.m, self.n, self.kl, self.kr
        return {"ur": (b, n, kr), "ul": (b, m, kl), "ldr": (b, kr), "rdl": (b, kl), "dldr": (b, kl, kr),
                "P": (b, m, kr), "Q": (b, kl, n), "Wd": (b, kl, kr), "L1": (b, m, kr), "R2t": (b, n, kl)}


@dataclass
class FusedLayout:
    """Everything the kernels read besides X: ``pool`` (float32: parameters, then room for the
    products), the piece table ``pstart`` (NP + 1 int64), ``rec`` (NP x 8 int64), ``pcc`` (NP
    float32), and the shape groups. Built on the host from a Geometry, for one direction."""

    size: int
    groups: list
    pool: np.ndarray
    pstart: np.ndarray
    rec: np.ndarray
    pcc: np.ndarray

    @classmethod
    def build(cls, geometry: Any, inverse: bool) -> "FusedLayout":
        if not supports(geometry):
            raise ValueError("the fused transform needs low-rank or identity sides on every segment")
        size = int(geometry.size)
        keyed: dict[tuple, list] = {}
        for t in geometry.transforms:
            if t.is_identity or t.segment.size == 0:
                continue
            m, n = t.segment.matrix_shape
            kl = 0 if t.left.is_identity else t.left.rank
            kr = 0 if t.right.is_identity else t.right.rank
            keyed.setdefault((m, n, kl, kr), []).append(t)
        groups, chunks, used = [], [], 0
        params: dict[int, dict[str, np.ndarray]] = {}
        for (m, n, kl, kr), ts in keyed.items():
            g = GroupLayout(m, n, kl, kr, np.array([t.segment.offset for t in ts], np.int64))
            par = _params(ts, inverse)
            for name, shape in g.shapes().items():
                g.o[name] = used
                k = int(np.prod(shape))
                chunks.append(par[name].reshape(-1) if name in par else np.zeros(k, f32))
                used += k
            groups.append(g)
            params[id(g)] = par
        pool = np.concatenate(chunks).astype(f32) if chunks else np.zeros(1, f32)
        # piece table: every segment of a group is a piece; gaps and identity segments are copies
        pieces = []  # (start, stop, rec, cc)
        for g in groups:
            par = params[id(g)]
            for bi, s in enumerate(g.starts):
                rec = [int(s), g.n, g.kl, g.kr, g.o["L1"] + bi * g.m * g.kr, g.o["ur"] + bi * g.n * g.kr,
                       g.o["ul"] + bi * g.m * g.kl, g.o["R2t"] + bi * g.n * g.kl]
                pieces.append((int(s), int(s) + g.m * g.n, rec, float(par["cc"][bi])))
        pieces.sort()
        starts: list[int] = []
        recs: list[list[int]] = []
        ccs: list[float] = []
        at = 0

        def piece(start: int, rec: list[int], cc: float) -> None:
            starts.append(start)
            recs.append(rec)
            ccs.append(cc)

        for a, b, rec, cc in pieces:
            if a > at:  # a gap between segments: copied
                piece(at, [at, 0, 0, 0, 0, 0, 0, 0], 1.0)
            piece(a, rec, cc)
            at = b
        if at < size or not starts:
            piece(at, [at, 0, 0, 0, 0, 0, 0, 0], 1.0)
        starts.append(max(size, at))
        return cls(size, groups, pool, np.array(starts, np.int64), np.array(recs, np.int64).reshape(-1),
                   np.array(ccs, f32))

    @property
    def npieces(self) -> int:
        return int(self.pcc.size)

    def view(self, pool: Any, g: GroupLayout, name: str) -> Any:
        """Stack ``name`` of group ``g`` as a (shaped) view of ``pool`` (any backend)."""
        shape = g.shapes()[name]
        k = int(np.prod(shape))
        return pool[g.o[name] : g.o[name] + k].reshape(shape)


def _params(ts: list, inverse: bool) -> dict[str, np.ndarray]:
    def side(s):
        if s.is_identity:
            return 1.0, None, None
        c = float(s.c_inv if inverse else s.c_fwd)
        d = np.asarray(s.delta_inv if inverse else s.delta_fwd, np.float64)
        return c, d, s.u

    out: dict[str, list] = {k: [] for k in ("ur", "ul", "ldr", "rdl", "dldr", "cc")}
    for t in ts:
        cl, dl, ul = side(t.left)
        cr, dr, ur = side(t.right)
        out["cc"].append(np.float64(cl * cr))
        if ur is not None:
            out["ur"].append(ur)
            out["ldr"].append(cl * dr)
        if ul is not None:
            out["ul"].append(ul)
            out["rdl"].append(cr * dl)
        if ul is not None and ur is not None:
            out["dldr"].append(dl[:, None] * dr[None, :])
    return {k: np.ascontiguousarray(np.stack(v)).astype(f32) for k, v in out.items() if v}


# ---------------------------------------------------------------- the model, step by step
def _src(x: np.ndarray, g: GroupLayout) -> np.ndarray:
    """(B, m, n) float32 values of the group's segments from the flat buffer ``x``."""
    idx = g.starts[:, None] + np.arange(g.m * g.n, dtype=np.int64)[None, :]
    return np.asarray(x, f32)[idx].reshape(g.b, g.m, g.n)


def project(lay: FusedLayout, pool: np.ndarray, x: np.ndarray) -> None:
    """Passes A and S of every group on host ``pool`` (in place) from the float32 buffer ``x``."""
    with np.errstate(all="ignore"):
        for g in lay.groups:
            xs = _src(x, g)
            b, m, n, kl, kr = g.b, g.m, g.n, g.kl, g.kr
            if kr:
                ur = lay.view(pool, g, "ur")
                npad = -(-n // 32) * 32
                xp_ = np.zeros((b, m, npad), f32)
                xp_[:, :, :n] = xs
                up = np.zeros((b, npad, kr), f32)
                up[:, :n] = ur
                lanes = np.zeros((b, m, 32, kr), f32)
                for t in range(npad // 32):  # lane l: j = l + 32 t, in order of t
                    lanes += xp_[:, :, 32 * t : 32 * t + 32, None] * up[:, None, 32 * t : 32 * t + 32, :]
                w = 32
                while w > 1:  # xor butterfly, lane 0's view: halves added pairwise
                    w //= 2
                    lanes = lanes[:, :, :w] + lanes[:, :, w : 2 * w]
                lay.view(pool, g, "P")[...] = lanes[:, :, 0]
            if kl:
                ul = lay.view(pool, g, "ul")
                q = np.zeros((b, kl, n), f32)
                for i in range(m):
                    q += ul[:, i, :, None] * xs[:, i, None, :]
                lay.view(pool, g, "Q")[...] = q
            small(lay, pool, g)


def small(lay: FusedLayout, pool: np.ndarray, g: GroupLayout) -> None:
    """Pass S (gc_fz_small, gc_fz_r2) of group ``g`` on host ``pool``."""
    b, m, kl, kr = g.b, g.m, g.kl, g.kr
    v = lambda name: lay.view(pool, g, name)  # noqa: E731
    if kr:
        v("L1")[...] = v("ldr")[:, None, :] * v("P")
    if kl and kr:
        acc = np.zeros((b, kl, kr), f32)
        for i in range(m):
            acc += v("ul")[:, i, :, None] * v("P")[:, i, None, :]
        v("Wd")[...] = v("dldr") * acc
    if kl:
        acc2 = v("rdl")[:, None, :] * v("Q").transpose(0, 2, 1)  # (b, n, kl)
        for r in range(kr):
            acc2 = acc2 + v("Wd")[:, None, :, r] * v("ur")[:, :, r, None]
        v("R2t")[...] = acc2


def apply_model(lay: FusedLayout, pool: np.ndarray, z: np.ndarray, lo: int = 0) -> np.ndarray:
    """``y[e] = cc z[e] + update(lo + e)`` for a float32 vector ``z`` of buffer range [lo, lo +
    z.size) (gc_fz_table::apply): a new float32 vector."""
    z = np.asarray(z, f32).reshape(-1)
    e = lo + np.arange(z.size, dtype=np.int64)
    p = np.searchsorted(lay.pstart, e, side="right") - 1
    rec = lay.rec.reshape(-1, 8)[p]
    y = z.copy()
    with np.errstate(all="ignore"):
        for pi in np.unique(p):
            sel = np.nonzero(p == pi)[0]
            r = lay.rec.reshape(-1, 8)[pi]
            n, kl, kr = int(r[1]), int(r[2]), int(r[3])
            if n == 0:
                continue
            off = e[sel] - r[0]
            i, j = off // n, off % n
            acc = np.zeros(sel.size, f32)
            for t in range(kr):
                acc += pool[r[4] + i * kr + t] * pool[r[5] + j * kr + t]
            for t in range(kl):
                acc += pool[r[6] + i * kl + t] * pool[r[7] + j * kl + t]
            y[sel] = lay.pcc[pi] * z[sel] + acc
    del rec
    return y


def transform_model(geometry: Any, x: np.ndarray, inverse: bool = False) -> np.ndarray:
    """The whole fused transform of the float32 buffer ``x`` on the host (passes A, S, apply)."""
    lay = FusedLayout.build(geometry, inverse)
    pool = lay.pool.copy()
    project(lay, pool, x)
    return apply_model(lay, pool, x)


class ModelGeometry:
    """A geometry's face (size, is_identity, forward, inverse, fingerprint) with the fused
    kernels' arithmetic on the host: ``simulate_gift_allreduce(inputs, ModelGeometry(geometry),
    ...)`` is the host model of gift_allreduce's device path (giftcomm.collectives.gift), bit for
    bit. Input of any float dtype is read as float32 (as the device path does)."""

    is_identity = False

    def __init__(self, geometry: Any) -> None:
        self.geometry = geometry
        self.size = int(geometry.size)
        self._lay = {inv: FusedLayout.build(geometry, inv) for inv in (False, True)}

    def fingerprint(self) -> int:
        return int(self.geometry.fingerprint())

    def _run(self, flat: Any, inverse: bool) -> np.ndarray:
        lay = self._lay[inverse]
        x = np.ascontiguousarray(np.asarray(flat).reshape(-1), f32)
        pool = lay.pool.copy()
        project(lay, pool, x)
        return apply_model(lay, pool, x)

    def forward(self, flat: Any) -> np.ndarray:
        return self._run(flat, False)

    def inverse(self, flat: Any) -> np.ndarray:
        return self._run(flat, True)
