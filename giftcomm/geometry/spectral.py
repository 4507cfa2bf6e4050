"""Spectra of Kronecker factors, damping, rank choice and the error-ratio model.

Conventions (docs/method.md states them):

- A factor ``F`` (``A``: in x in, or ``G``: out x out; symmetric PSD) is eigendecomposed in
  float64 and *normalised to unit mean eigenvalue*: ``F_hat = F / (trace(F) / d)``.
- Damping is relative: the whitening metric is ``P = (F_hat + delta I) / (1 + delta)``, so
  ``delta`` is a fraction of the mean eigenvalue and ``P`` again has unit mean eigenvalue.
  An isotropic factor (``F = cI``) gives ``P = I``: the transform is exactly the identity.
- Low rank ``k``: the top-k eigenvalues are kept, the other ``d - k`` are replaced by their mean
  ``c`` (so the trace is unchanged), then damped the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Spectrum", "damped", "lowrank_damped", "rank_for_energy", "anisotropy", "side_error_factor"]


@dataclass(frozen=True)
class Spectrum:
    """Eigendecomposition of one factor, normalised to unit mean eigenvalue.

    values: (d,) float64, descending, >= 0, mean 1 (a zero factor gives all ones).
    vectors: (d, d) float64 with orthonormal columns (``vectors[:, i]`` goes with ``values[i]``),
    or None for a diagonal factor (the eigenbasis is the standard basis, values in index order).
    scale: the factor's mean eigenvalue before normalisation (float, units of the factor).
    """

    values: np.ndarray
    vectors: np.ndarray | None
    scale: float

    @property
    def dim(self) -> int:
        return int(self.values.shape[0])

    @classmethod
    def from_matrix(cls, factor) -> Spectrum:
        """Eigendecompose a symmetric PSD (d, d) matrix (any float dtype; symmetrised first)."""
        f = np.asarray(factor, dtype=np.float64)
        if f.ndim != 2 or f.shape[0] != f.shape[1]:
            raise ValueError(f"a Kronecker factor is a square matrix, got shape {f.shape}")
        if not np.all(np.isfinite(f)):
            raise ValueError("a Kronecker factor has non-finite entries")
        f = 0.5 * (f + f.T)
        vals, vecs = np.linalg.eigh(f)
        vals, vecs = vals[::-1], np.ascontiguousarray(vecs[:, ::-1])
        return cls._normalised(vals, vecs)

    @classmethod
    def from_diagonal(cls, diag) -> Spectrum:
        """Spectrum of ``diag(v)`` for a (d,) vector of non-negative values (vectors=None)."""
        v = np.asarray(diag, dtype=np.float64)
        if v.ndim != 1:
            raise ValueError(f"a diagonal factor is a 1-D vector, got shape {v.shape}")
        if not np.all(np.isfinite(v)):
            raise ValueError("a diagonal factor has non-finite entries")
        return cls._normalised(v, None)

    @classmethod
    def _normalised(cls, vals: np.ndarray, vecs: np.ndarray | None) -> Spectrum:
        vals = np.maximum(vals, 0.0)
        mean = float(vals.mean()) if vals.size else 0.0
        if not mean > 0.0:
            return cls(np.ones_like(vals), vecs, 0.0)
        return cls(vals / mean, vecs, mean)


def damped(values: np.ndarray, damping: float) -> np.ndarray:
    """Eigenvalues of the damped metric ``P = (F_hat + delta I) / (1 + delta)``: (d,) float64."""
    return (values + damping) / (1.0 + damping)


def lowrank_damped(values: np.ndarray, k: int, damping: float) -> np.ndarray:
    """Damped eigenvalues of the rank-k model: top k kept, the rest set to their mean c: (d,)."""
    v = np.array(values, dtype=np.float64)
    if k < v.size:
        v[k:] = v[k:].mean()
    return damped(v, damping)


def floor_value(values: np.ndarray, k: int) -> float:
    """The floor c of the rank-k model: mean of the discarded eigenvalues (the k-th if none)."""
    return float(values[k:].mean()) if k < values.size else float(values[-1])


def rank_for_energy(values: np.ndarray, energy: float) -> int:
    """Smallest k whose top-k eigenvalues hold ``energy`` (0 < energy <= 1) of the trace."""
    if values.size == 0:
        return 0
    c = np.cumsum(values)
    total = c[-1]
    if not total > 0:
        return 1
    return int(min(values.size, np.searchsorted(c, energy * total * (1 - 1e-12)) + 1))


def anisotropy(p: np.ndarray) -> float:
    """AM/HM of the eigenvalues: ``mean(p) * mean(1/p)`` >= 1, 1 exactly for isotropic ``p``."""
    return float(np.mean(p) * np.mean(1.0 / p))


def side_error_factor(p: np.ndarray, q: np.ndarray) -> float:
    """One side's factor of the predicted squared whitened-error ratio (transform vs Euclidean).

    p: eigenvalues of the true damped metric; q: eigenvalues the transform whitens with (same
    eigenbasis; q = p: full whitening, q = const: no transform, giving 1). Under the model of
    docs/method.md (block-scaled FP8 error is isotropic, with variance proportional to the mean
    square of what is quantised; gradient ``X = P_G^1/2 Z P_A^1/2``) the squared error in the
    whitened norm is proportional to ``sum(q/p) * sum(p/q)`` per side, against
    ``sum(p) * sum(1/p)`` for Euclidean quantisation.
    """
    return float(np.sum(q / p) * np.sum(p / q) / (np.sum(p) * np.sum(1.0 / p)))
