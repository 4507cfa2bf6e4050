"""The transform of one segment: ``Y = S_L X S_R^T`` on the segment's (m, n) matrix view.

``S_L`` (m x m) acts on the output axis and comes from G; ``S_R`` (n x n) acts on the input
axis and comes from A. For KFAC whitening ``S_L = P_G^-1/2`` and ``S_R = P_A^-1/2``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .layout import Segment
from .sides import DenseSide, DiagonalSide, IdentitySide, LowRankSide, Side
from .spectral import Spectrum, anisotropy, damped, lowrank_damped, side_error_factor

__all__ = ["SegmentTransform", "SideChoice", "make_side", "identity_transform", "kfac_transform"]

# A side choice: None (identity), "full", "diag", or an int k (rank-k low-rank).
SideChoice = None | str | int


@dataclass
class SegmentTransform:
    """One segment's operator pair and the numbers ``Geometry.summary`` prints.

    left: acts on the m rows; right: acts on the n columns. info keys (all optional):
    anisotropy (out, in) AM/HM of the damped eigenvalues; cond (out, in); predicted (norm ratio
    of the whitened-norm FP8 error, transform vs Euclidean, model of docs/method.md); note.
    """

    segment: Segment
    left: Side
    right: Side
    info: dict = field(default_factory=dict)

    @property
    def is_identity(self) -> bool:
        return self.left.is_identity and self.right.is_identity

    @property
    def kind(self) -> str:
        kinds = {self.left.kind, self.right.kind} - {"identity"}
        if not kinds:
            return "identity"
        if kinds == {"full"}:
            return "kfac-full"
        if kinds <= {"full", "lowrank"}:
            return "kfac-lowrank"
        return "+".join(sorted(kinds))

    def flops(self) -> float:
        """Flops of forward + inverse on this segment (two applications of each side)."""
        m, n = self.segment.matrix_shape
        return 2.0 * (self.left.flops_per_column() * n + self.right.flops_per_column() * m)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """x: (m, n) float32 -> ``S_L x S_R^T`` (float32, may alias x if identity)."""
        return self.left.left(self.right.right(x))

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """y: (m, n) float32 -> ``S_L^-1 y S_R^-T``."""
        return self.left.left(self.right.right(y, inverse=True), inverse=True)


def make_side(spec: Spectrum | None, dim: int, choice: SideChoice, damping: float) -> Side:
    """Build one side from a factor spectrum and a choice (see SideChoice)."""
    if choice is None or spec is None:
        return IdentitySide(dim)
    if spec.dim != dim:
        raise ValueError(f"factor of size {spec.dim} does not match the segment's axis of size {dim}")
    if spec.vectors is None or choice == "diag":
        if spec.vectors is not None:
            spec = Spectrum.from_diagonal(np.einsum("ij,j,ij->i", spec.vectors, spec.values, spec.vectors))
        return DiagonalSide.from_spectrum(spec, damping)
    if choice == "full":
        return DenseSide.from_spectrum(spec, damping)
    if isinstance(choice, (int, np.integer)) and not isinstance(choice, bool) and choice >= 1:
        return LowRankSide.from_spectrum(spec, int(choice), damping)
    raise ValueError(f"a side is None, 'full', 'diag' or a rank >= 1, got {choice!r}")


def _whitened_spectra(spec: Spectrum, side: Side, damping: float) -> tuple[np.ndarray, np.ndarray]:
    """(p, q): true damped eigenvalues and the ones the side whitens with (same basis)."""
    p = damped(spec.values, damping)
    if isinstance(side, LowRankSide):
        return p, lowrank_damped(spec.values, side.rank, damping)
    if isinstance(side, (DenseSide, DiagonalSide)):
        return p, p
    return p, np.ones_like(p)


def side_info(spec: Spectrum | None, side: Side, damping: float) -> tuple[float, float, float]:
    """(anisotropy AM/HM, condition number, error factor) of one side (1, 1, 1 without factor)."""
    if spec is None or spec.dim == 0:
        return 1.0, 1.0, 1.0
    p, q = _whitened_spectra(spec, side, damping)
    return anisotropy(p), float(p.max() / p.min()), side_error_factor(p, q)


def kfac_transform(
    seg: Segment, spec_g: Spectrum | None, spec_a: Spectrum | None,
    choice_g: SideChoice, choice_a: SideChoice, damping: float, note: str = "",
) -> SegmentTransform:
    """A segment's whitening transform from its factors' spectra and per-side choices."""
    m, n = seg.matrix_shape
    left = make_side(spec_g, m, choice_g, damping)
    right = make_side(spec_a, n, choice_a, damping)
    ag, cg, eg = side_info(spec_g, left, damping)
    aa, ca, ea = side_info(spec_a, right, damping)
    info = {"anisotropy": (ag, aa), "cond": (cg, ca), "predicted": float(np.sqrt(eg * ea)), "note": note}
    return SegmentTransform(seg, left, right, info)


def identity_transform(seg: Segment, note: str = "") -> SegmentTransform:
    m, n = seg.matrix_shape
    return SegmentTransform(seg, IdentitySide(m), IdentitySide(n), {"note": note} if note else {})
