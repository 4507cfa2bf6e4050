"""One-sided linear operators S (d x d) of a segment transform ``Y = S_L X S_R^T``.

Each side acts on float32 matrices along one axis: ``left(x)`` computes ``S x`` for ``x`` of
shape (d, c); ``right(x)`` computes ``x S^T`` for ``x`` of shape (r, d). ``inverse=True`` applies
``S^-1`` instead. Results are float32 arrays (the identity side may return its input).
Parameters are float32 arrays, built in float64 and rounded once.

Sides work on any array backend (NumPy, CuPy): the parameters are uploaded to the backend of
``x`` on first use and kept (``_on``); ``params()`` are always the host arrays.

``flops_per_column()`` counts the floating-point operations of one application per column of
``x`` (multiply and add counted separately), for the cost model of the selective policy.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

from .._xp import array_module
from .spectral import Spectrum, damped, floor_value

__all__ = ["Side", "IdentitySide", "DenseSide", "LowRankSide", "DiagonalSide", "HadamardSide"]


class Side:
    """Base class: a d x d operator. Subclasses define ``left``; ``right`` defaults to transposes."""

    kind = "side"
    dim: int
    rank: int | None = None

    def left(self, x: np.ndarray, inverse: bool = False) -> np.ndarray:
        """``S x`` (or ``S^-1 x``) for x of shape (d, c); every concrete side defines it."""
        raise NotImplementedError(f"{type(self).__name__} must define left()")

    def right(self, x: np.ndarray, inverse: bool = False) -> np.ndarray:
        """``x S^T`` (or ``x S^-T``) for x of shape (r, d)."""
        xp = array_module(x)
        return xp.ascontiguousarray(self.left(xp.ascontiguousarray(x.T), inverse).T)

    def _on(self, x, *names: str) -> tuple:
        """The named parameter arrays on the backend of ``x`` (uploaded once, then cached)."""
        xp = array_module(x)
        if xp is np:
            return tuple(getattr(self, n) for n in names)
        cache = self.__dict__.setdefault("_device", {}).setdefault(xp.__name__, {})
        return tuple(cache[n] if n in cache else cache.setdefault(n, xp.asarray(getattr(self, n))) for n in names)

    def __getstate__(self):  # device copies are not pickled
        state = dict(self.__dict__)
        state.pop("_device", None)
        return state

    def params(self) -> tuple[np.ndarray, ...]:
        """The arrays that define the operator (hashed into the geometry's fingerprint)."""
        return ()

    def flops_per_column(self) -> float:
        return 0.0

    @property
    def is_identity(self) -> bool:
        return False


class IdentitySide(Side):
    """S = I (returns its input unchanged)."""

    kind = "identity"

    def __init__(self, dim: int):
        self.dim = int(dim)

    def left(self, x, inverse=False):
        return x

    def right(self, x, inverse=False):
        return x

    @property
    def is_identity(self) -> bool:
        return True


class DenseSide(Side):
    """Full whitening: ``S = P^-1/2``, ``S^-1 = P^1/2`` (symmetric d x d float32 matrices)."""

    kind = "full"

    def __init__(self, fwd: np.ndarray, inv: np.ndarray):
        self.fwd = np.ascontiguousarray(fwd, dtype=np.float32)
        self.inv = np.ascontiguousarray(inv, dtype=np.float32)
        self.dim = self.fwd.shape[0]
        self.rank = self.dim

    @classmethod
    def from_spectrum(cls, spec: Spectrum, damping: float) -> DenseSide:
        """``P^-+1/2 = U diag(p^-+1/2) U^T`` with ``p`` the damped eigenvalues (float64, then f32)."""
        p = damped(spec.values, damping)
        u = spec.vectors
        if u is None:
            raise ValueError("DenseSide needs eigenvectors; use DiagonalSide for a diagonal factor")
        fwd = (u * p**-0.5) @ u.T
        inv = (u * p**0.5) @ u.T
        return cls(0.5 * (fwd + fwd.T), 0.5 * (inv + inv.T))

    def left(self, x, inverse=False):
        return self._on(x, "inv" if inverse else "fwd")[0] @ x

    def right(self, x, inverse=False):
        return x @ self._on(x, "inv" if inverse else "fwd")[0]  # symmetric: S^T = S

    def params(self):
        return (self.fwd, self.inv)

    def flops_per_column(self) -> float:
        return 2.0 * self.dim * self.dim


class LowRankSide(Side):
    """Rank-k whitening: ``S = c I + U (D - c) U^T`` with U (d, k) orthonormal float32.

    Forward: ``D = (p_top + ...)^-1/2`` of the top-k damped eigenvalues, ``c`` = damped floor
    value to the power -1/2; inverse: the same with power +1/2. Exact inverse pair because U has
    orthonormal columns. Cost per column: about 4 d k flops instead of 2 d^2.
    """

    kind = "lowrank"
    rank: int  # always set: the number of columns of U

    def __init__(self, u: np.ndarray, d_fwd: np.ndarray, c_fwd: float, d_inv: np.ndarray, c_inv: float):
        self.u = np.ascontiguousarray(u, dtype=np.float32)
        self.ut = np.ascontiguousarray(self.u.T)  # contiguous U^T: faster skinny GEMMs
        self.dim, self.rank = self.u.shape
        self.c_fwd = np.float32(c_fwd)
        self.c_inv = np.float32(c_inv)
        # store D - c, the coefficient of the low-rank correction
        self.delta_fwd = (np.asarray(d_fwd, np.float64) - float(self.c_fwd)).astype(np.float32)
        self.delta_inv = (np.asarray(d_inv, np.float64) - float(self.c_inv)).astype(np.float32)

    @classmethod
    def from_spectrum(cls, spec: Spectrum, k: int, damping: float) -> LowRankSide:
        """Top-k eigenpairs of ``spec``; the rest of the spectrum replaced by the mean of it."""
        if spec.vectors is None:
            raise ValueError("LowRankSide needs eigenvectors")
        k = int(min(max(k, 1), spec.dim))
        top = damped(spec.values[:k], damping)
        c = float(damped(np.array([floor_value(spec.values, k)]), damping)[0])
        return cls(spec.vectors[:, :k], top**-0.5, c**-0.5, top**0.5, c**0.5)

    def left(self, x, inverse=False):
        """The straightforward side-by-side application (``Geometry`` uses the fused batched
        one of ``giftcomm.geometry.apply``; the tests compare the two)."""
        c = self.c_inv if inverse else self.c_fwd
        u, ut, delta = self._on(x, "u", "ut", "delta_inv" if inverse else "delta_fwd")
        y = ut @ x
        y *= delta[:, None]
        out = u @ y
        out += c * x
        return out

    def right(self, x, inverse=False):
        c = self.c_inv if inverse else self.c_fwd
        u, ut, delta = self._on(x, "u", "ut", "delta_inv" if inverse else "delta_fwd")
        y = x @ u
        y *= delta
        out = y @ ut
        out += c * x
        return out

    def params(self):
        return (self.u, np.array([self.c_fwd, self.c_inv], np.float32), self.delta_fwd, self.delta_inv)

    def flops_per_column(self) -> float:
        return 4.0 * self.dim * self.rank + 2.0 * self.dim + self.rank


class DiagonalSide(Side):
    """Diagonal scaling ``S = diag(s)``: s (d,) float32, ``S^-1 = diag(1/s)``."""

    kind = "diagonal"

    def __init__(self, s_fwd: np.ndarray, s_inv: np.ndarray):
        self.s_fwd = np.ascontiguousarray(s_fwd, dtype=np.float32)
        self.s_inv = np.ascontiguousarray(s_inv, dtype=np.float32)
        self.dim = self.s_fwd.shape[0]

    @classmethod
    def from_spectrum(cls, spec: Spectrum, damping: float) -> DiagonalSide:
        """``s = p^-1/2`` of the damped diagonal (``spec.vectors`` must be None)."""
        p = damped(spec.values, damping)
        return cls(p**-0.5, p**0.5)

    def left(self, x, inverse=False):
        return self._on(x, "s_inv" if inverse else "s_fwd")[0][:, None] * x

    def right(self, x, inverse=False):
        return x * self._on(x, "s_inv" if inverse else "s_fwd")[0]

    def params(self):
        return (self.s_fwd, self.s_inv)

    def flops_per_column(self) -> float:
        return float(self.dim)


def _fwht_rows(x: np.ndarray) -> np.ndarray:
    """Orthonormal Walsh-Hadamard transform along axis 0 of (h, c) float32, h a power of two."""
    xp = array_module(x)
    h = x.shape[0]
    y = x
    s = 1
    while s < h:
        y = y.reshape(h // (2 * s), 2, s, -1)
        y = xp.stack((y[:, 0] + y[:, 1], y[:, 0] - y[:, 1]), axis=1)
        s *= 2
    y = y.reshape(h, -1)
    return y * np.float32(1.0 / math.sqrt(h)) if h > 1 else y.copy()


def _power_of_two_blocks(d: int) -> list[int]:
    """d as a sum of distinct powers of two, largest first (its binary digits)."""
    return [1 << b for b in range(d.bit_length() - 1, -1, -1) if d >> b & 1]


class HadamardSide(Side):
    """Randomised Hadamard rotation ``S = H P D`` (orthogonal, ``S^-1 = S^T``).

    D: random signs (d,); P: random permutation; H: block-diagonal orthonormal Walsh-Hadamard
    with power-of-two blocks summing to d (d = 1536 -> 1024 + 512). Seeded from (seed, name,
    axis) by BLAKE2b, so every rank builds the same operator. Cost: (log2 h + 2) flops per
    element and column.
    """

    kind = "hadamard"

    def __init__(self, dim: int, seed: int, tag: str):
        self.dim = int(dim)
        digest = hashlib.blake2b(f"{int(seed)}/{tag}".encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        self.signs = np.where(rng.random(self.dim) < 0.5, -1.0, 1.0).astype(np.float32)
        self.perm = rng.permutation(self.dim).astype(np.int64)
        self.iperm = np.argsort(self.perm).astype(np.int64)
        self.blocks = _power_of_two_blocks(self.dim)

    def _h(self, x: np.ndarray) -> np.ndarray:
        out = array_module(x).empty_like(x)
        lo = 0
        for b in self.blocks:
            out[lo : lo + b] = _fwht_rows(x[lo : lo + b])
            lo += b
        return out

    def left(self, x, inverse=False):
        signs, perm, iperm = self._on(x, "signs", "perm", "iperm")
        if inverse:  # S^T = D P^T H
            return signs[:, None] * self._h(x)[iperm]
        return self._h((signs[:, None] * x)[perm])

    def params(self):
        return (self.signs, self.perm)

    def flops_per_column(self) -> float:
        return self.dim * (math.log2(max(self.blocks[0], 1)) + 2.0) if self.dim else 0.0
