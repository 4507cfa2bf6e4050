"""Geometry: the per-segment transforms of a flat gradient buffer, and their constructors.

The collective calls only ``size``, ``is_identity``, ``forward``, ``inverse``, ``fingerprint``
and ``summary`` (see docs/geometry.md).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._xp import array_module
from ..options import DEFAULT_DAMPING  # damping delta: estimated factors are noisy in their small eigenvalues (docs/method.md "Damping")
from .apply import ApplyPlan
from .layout import Layout, as_layout
from .sides import HadamardSide, IdentitySide
from .spectral import Spectrum
from .transform import SegmentTransform, SideChoice, identity_transform, kfac_transform

__all__ = ["DEFAULT_DAMPING", "Geometry", "as_spectrum", "spectra_from_factors"]

_FINGERPRINT_TAG = b"giftcomm.geometry/v1"


def as_spectrum(f) -> Spectrum:
    """A Spectrum from a Spectrum, a square matrix, or a 1-D vector (a diagonal factor)."""
    if isinstance(f, Spectrum):
        return f
    a = np.asarray(f)
    return Spectrum.from_diagonal(a) if a.ndim == 1 else Spectrum.from_matrix(a)


def spectra_from_factors(layout: Layout, factors: Mapping) -> dict[str, tuple[Spectrum, Spectrum]]:
    """name -> (spectrum of G, spectrum of A) from name -> (A, G); checks names and sizes."""
    out = {}
    for name, pair in factors.items():
        if name not in layout:
            raise ValueError(f"factors given for {name!r}, which is not a segment of the layout")
        try:
            a, g = pair
        except (TypeError, ValueError):
            raise ValueError(f"factors[{name!r}] must be an (A, G) pair") from None
        seg = layout[name]
        m, n = seg.matrix_shape
        sa, sg = as_spectrum(a), as_spectrum(g)
        if sa.dim != n or sg.dim != m:
            raise ValueError(
                f"segment {name!r} of shape {seg.shape} needs A of size {n} and G of size {m}, "
                f"got {sa.dim} and {sg.dim}"
            )
        out[name] = (sg, sa)
    return out




def check_damping(damping: float) -> float:
    d = float(damping)
    if not (d >= 0.0 and np.isfinite(d)):
        raise ValueError(f"damping must be a finite number >= 0, got {damping!r}")
    return d


def rank_choice(rank, name: str, m: int, n: int) -> tuple[SideChoice, SideChoice]:
    """(choice for G, choice for A) from from_kfac's ``rank`` argument."""
    r = rank.get(name) if isinstance(rank, Mapping) else rank
    if r is None:
        return "full", "full"
    if isinstance(r, tuple):
        rg, ra = r
        return ("full" if rg is None else min(int(rg), m)), ("full" if ra is None else min(int(ra), n))
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1:
        raise ValueError(f"rank must be None, an int >= 1, a (k_out, k_in) pair or a mapping, got {r!r}")
    return min(int(r), m), min(int(r), n)


PRESET_BUILDERS: dict[str, Callable[..., Geometry]] = {}
"""Geometry.preset's table: name -> builder(layout, factors, options, **fields). A preset's own
module registers its row (giftcomm.geometry.paper registers "paper"), so this module imports none."""


class Geometry:
    """Linear, invertible, per-segment transforms of a flat buffer of ``size`` elements.

    Build with the constructors (``from_kfac``, ``identity``, ``diagonal``, ``hadamard``) or
    ``giftcomm.geometry.select``. Immutable once built; the fingerprint is cached.
    """

    def __init__(self, layout: Layout, transforms: Sequence[SegmentTransform]):
        self.layout = as_layout(layout)
        self.transforms: tuple[SegmentTransform, ...] = tuple(transforms)
        if [t.segment for t in self.transforms] != list(self.layout.segments):
            raise ValueError("one transform per layout segment, in layout order")
        self._fingerprint: int | None = None
        self._plans: dict = {}  # backend name -> ApplyPlan (stacked parameters on that backend)

    def __getstate__(self):  # the per-backend plans are rebuilt on demand, never pickled
        state = dict(self.__dict__)
        state["_plans"] = {}
        return state

    # ---------------------------------------------------------------- the collective's interface
    @property
    def size(self) -> int:
        """Total elements of the flat buffer."""
        return self.layout.size

    @property
    def is_identity(self) -> bool:
        """True when every segment's transform is the identity (forward/inverse only cast)."""
        return all(t.is_identity for t in self.transforms)

    def forward(self, flat: Any, out: Any = None) -> Any:
        """Flat (size,) array of any float dtype -> new float32 (size,) array in GIFT coordinates.

        NumPy in, NumPy out; a CuPy (device) array in, a CuPy array out (the side parameters are
        uploaded once per backend and kept). ``out``: optional float32 (size,) array of the same
        backend to write into instead: ``flat`` itself (in place) or a buffer not overlapping it;
        reusing one saves the page faults of a fresh buffer (perf/results/gift-cost.md)."""
        return self._apply(flat, inverse=False, out=out)

    def inverse(self, flat: Any, out: Any = None) -> Any:
        """Flat (size,) array in GIFT coordinates -> new float32 (size,) array in the original ones
        (``out`` as for ``forward``)."""
        return self._apply(flat, inverse=True, out=out)

    def fingerprint(self) -> int:
        """Signed 64-bit int (fits np.int64): BLAKE2b of the layout, kinds and parameter bytes."""
        if self._fingerprint is None:
            h = hashlib.blake2b(_FINGERPRINT_TAG, digest_size=8)
            for t in self.transforms:
                seg = t.segment
                name = seg.name.encode()
                h.update(len(name).to_bytes(8, "little") + name)
                h.update(np.asarray(seg.shape, "<i8").tobytes() + len(seg.shape).to_bytes(8, "little"))
                for side in (t.left, t.right):
                    h.update(side.kind.encode() + b"\0" + int(side.dim).to_bytes(8, "little"))
                    for p in side.params():
                        a = np.ascontiguousarray(p)
                        h.update(a.dtype.str.encode() + np.asarray(a.shape, "<i8").tobytes())
                        h.update(a.tobytes())
            self._fingerprint = int.from_bytes(h.digest(), "little", signed=True)
        return self._fingerprint

    def summary(self) -> str:
        """A table: per segment shape, transform, ranks, anisotropy, condition number,
        predicted error ratio and flops of forward + inverse; then totals."""
        return _summary(self)

    # ---------------------------------------------------------------- other public helpers
    def __len__(self) -> int:
        return len(self.transforms)

    def __getitem__(self, name: str) -> SegmentTransform:
        return self.transforms[self.layout.segments.index(self.layout[name])]

    def flops(self) -> float:
        """Flops of one forward plus one inverse over the whole buffer."""
        return float(sum(t.flops() for t in self.transforms))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Geometry) and self.layout == other.layout and self.fingerprint() == other.fingerprint()

    def __hash__(self) -> int:
        return self.fingerprint()

    def __repr__(self) -> str:
        n = sum(not t.is_identity for t in self.transforms)
        return f"<Geometry {len(self)} segments ({n} transformed), size {self.size}, fingerprint {self.fingerprint():#x}>"

    def agree(self, comm, root: int = 0) -> Geometry:
        """Collective: return a geometry identical on every rank of ``comm`` (a giftcomm Transport
        — MPI, torch.distributed, NCCL, loopback — an mpi4py communicator, or None for this process
        alone, which returns ``self``).

        Compares fingerprints (one allgather of an int); if they differ anywhere, every rank
        takes ``root``'s geometry (pickled broadcast). Returns ``self`` when they already agree.
        """
        from .sync import as_transport

        t = as_transport(comm)
        if t is None:  # this process alone: nothing to agree with
            return self
        fps = t.allgather_object(self.fingerprint())
        if all(f == fps[0] for f in fps):
            return self
        return t.broadcast_object(self if t.rank == root else None, root=root)

    # ---------------------------------------------------------------- constructors
    @classmethod
    def identity(cls, layout_or_size) -> Geometry:
        """The identity geometry of a layout (or of an int size: one 1-D segment "flat")."""
        layout = as_layout(layout_or_size)
        return cls(layout, [identity_transform(s) for s in layout])

    @classmethod
    def from_kfac(cls, layout, factors: Mapping, rank=None, damping: float = DEFAULT_DAMPING) -> Geometry:
        """KFAC whitening ``Y = P_G^-1/2 X P_A^-1/2`` of every segment that has factors.

        layout: Layout or list of (name, shape). factors: name -> (A, G), A (n, n) over the input
        axis, G (m, m) over the output axis of the segment's (m, n) matrix view; each may also
        be a precomputed Spectrum or a 1-D diagonal. rank: None (full whitening), an int k
        (top-k eigenpairs per side, capped at the side's size), a (k_out, k_in) pair, or a
        mapping name -> any of those. damping: delta, relative to the mean eigenvalue.
        Segments without factors get the identity.
        """
        return cls._per_segment(layout, factors, damping,
                                lambda seg: rank_choice(rank, seg.name, *seg.matrix_shape))

    @classmethod
    def diagonal(cls, layout, factors: Mapping, damping: float = DEFAULT_DAMPING) -> Geometry:
        """Row/column scaling ``Y = diag(g)^-1/2 X diag(a)^-1/2`` (damped, unit mean).

        factors: name -> (a, g), each a 1-D vector (e.g. column and row mean squares of
        gradients, see ``row_col_mean_squares``) or a square matrix (its diagonal is used).
        """
        return cls._per_segment(layout, factors, damping, lambda seg: ("diag", "diag"))

    @classmethod
    def _per_segment(cls, layout, factors: Mapping, damping: float, choice) -> Geometry:
        """A KFAC-style transform for every segment with factors (identity elsewhere);
        ``choice(segment)`` gives the (output side, input side) rank choice."""
        layout = as_layout(layout)
        damping = check_damping(damping)
        spectra = spectra_from_factors(layout, factors)
        ts = []
        for seg in layout:
            if seg.name not in spectra:
                ts.append(identity_transform(seg, "no factors"))
                continue
            cg, ca = choice(seg)
            sg, sa = spectra[seg.name]
            ts.append(kfac_transform(seg, sg, sa, cg, ca, damping))
        return cls(layout, ts)

    @classmethod
    def preset(cls, name: str, layout, factors: Mapping, **options) -> Geometry:
        """A named method in one word. ``"paper"``: the GIFT paper's input-side method
        (giftcomm.geometry.paper: Cholesky factor of the low-rank-32 + residual-diagonal
        approximation of A, damping 1e-3 absolute); factors: name -> A (or (A, G), G ignored);
        options: :class:`~giftcomm.geometry.paper.PaperOptions` fields (rank, damping, factor,
        names, ...) or ``options=`` a PaperOptions. ValueError for an unknown name."""
        build = PRESET_BUILDERS.get(name)
        if build is None:
            raise ValueError(f"unknown geometry preset {name!r}; known: {tuple(PRESET_BUILDERS)}")
        return build(layout, factors, options.pop("options", None), **options)

    @classmethod
    def hadamard(cls, layout, seed: int = 0, min_size: int = 0, names: Sequence[str] | None = None) -> Geometry:
        """Randomised Hadamard rotation of both axes of each segment's matrix view.

        Applied to segments with at least ``min_size`` elements (and in ``names`` if given);
        axes of size 1 are left alone. Seeded per (seed, segment name, axis): identical on all
        ranks. Orthogonal, so the Euclidean error is unchanged; it spreads outliers.
        """
        layout = as_layout(layout)
        ts = []
        for seg in layout:
            if seg.size < max(min_size, 1) or (names is not None and seg.name not in names):
                ts.append(identity_transform(seg))
                continue
            m, n = seg.matrix_shape
            left = HadamardSide(m, seed, f"{seg.name}/out") if m > 1 else IdentitySide(m)
            right = HadamardSide(n, seed, f"{seg.name}/in") if n > 1 else IdentitySide(n)
            ts.append(SegmentTransform(seg, left, right, {"note": f"seed {seed}"}))
        return cls(layout, ts)

    # ---------------------------------------------------------------- internals
    def _apply(self, flat: Any, inverse: bool, out: Any = None) -> Any:
        xp = array_module(flat)
        x = flat if xp is not np else np.asarray(flat)
        if x.ndim != 1 or x.size != self.size:
            raise ValueError(f"expected a 1-D buffer of {self.size} elements, got shape {x.shape}")
        if not np.issubdtype(x.dtype, np.floating) and x.dtype.kind != "V":
            raise ValueError(f"expected a float buffer, got dtype {x.dtype}")
        if out is not None and (array_module(out) is not xp or out.shape != (self.size,) or out.dtype != np.float32
                                or (xp is np and out is not x and np.shares_memory(out, x))):
            raise ValueError(f"out must be a float32 ({self.size},) array of the input's backend: the input "
                             "itself (in place) or not overlapping it")
        plans = self.__dict__.setdefault("_plans", {})  # also for geometries pickled before plans existed
        plan = plans.get(xp.__name__)
        if plan is None:
            plan = plans[xp.__name__] = ApplyPlan(self.transforms, xp)
        return plan.apply(x, inverse, out)


def _fmt_pair(v, spec: str) -> str:
    return "-" if v is None else "/".join(format(x, spec) for x in v)


def _summary(geom: Geometry) -> str:
    rows = []
    for t in geom.transforms:
        seg = t.segment
        ks = "-" if t.is_identity else "/".join(
            "-" if s.is_identity else (str(s.rank) if s.rank is not None else s.kind[:4]) for s in (t.left, t.right)
        )
        info = t.info
        pred = info.get("predicted")
        flops = t.flops()
        rows.append((
            seg.name, "x".join(map(str, seg.shape)) or "()", t.kind, ks,
            _fmt_pair(info.get("anisotropy"), ".3g"), _fmt_pair(info.get("cond"), ".3g"),
            "-" if pred is None or t.is_identity else f"{pred:.3f}",
            "0" if flops == 0 else f"{flops / max(seg.size, 1):.0f}",
            info.get("note", ""),
        ))
    head = ("segment", "shape", "transform", "k out/in", "aniso out/in", "cond out/in", "pred.err", "flop/elem", "note")
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    n_t = [t for t in geom.transforms if not t.is_identity]
    elems = sum(t.segment.size for t in n_t)
    out = [
        f"Geometry: {len(geom)} segments, {geom.size} elements; {len(n_t)} transformed "
        f"({elems} elements); forward+inverse {geom.flops() / 1e9:.3g} GFLOP; "
        f"fingerprint {geom.fingerprint() & (2**64 - 1):016x}",
        line(head),
        *(line(r) for r in rows),
        "aniso = AM/HM of the damped normalised eigenvalues (1 = isotropic); pred.err = predicted "
        "ratio of the FP8 error in the whitened norm, transform vs Euclidean (docs/method.md).",
    ]
    return "\n".join(out)
