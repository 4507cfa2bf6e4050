"""Estimators of the Kronecker factors that a Geometry is built from.

- ``KfacEstimator``: running averages of ``A = E[a a^T]`` (layer inputs) and ``G = E[d d^T]``
  (gradients w.r.t. the layer outputs) from batches the caller feeds, per rank; ``sync(comm)``
  averages them over ranks and eigendecomposes (see ``sync.py`` for the two modes); then
  ``geometry(...)`` builds the same Geometry on every rank.
- ``GradientFactorEstimator``: communication-free. Fed the *already reduced* gradient buffer
  (identical on every rank), it keeps ``L = E[g g^T] / n`` (m x m, stands in for G) and
  ``R = E[g^T g] / m`` (n x n, stands in for A). Every rank sees the same inputs, so every
  rank computes the same factors and geometry without communicating.

Running averages are exponential: ``F <- beta F + (1 - beta) F_batch``, except that the first
batch sets ``F`` (no bias towards zero). Statistics are accumulated in float64.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .geometry import DEFAULT_DAMPING, Geometry
from .layout import Layout, as_layout
from .policy import SelectivePolicy, select
from .spectral import Spectrum
from .sync import MODES, SyncReport, sync_spectra

__all__ = ["KfacEstimator", "GradientFactorEstimator", "row_col_mean_squares"]


def _check_decay(decay: float) -> float:
    d = float(decay)
    if not 0.0 <= d < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay!r}")
    return d


def _matrix_segments(layout: Layout, names: Sequence[str] | None) -> list[str]:
    if names is None:
        return [s.name for s in layout if s.ndim >= 2]
    for n in names:
        if n not in layout:
            raise ValueError(f"{n!r} is not a segment of the layout")
    return [s.name for s in layout if s.name in set(names)]


def _ema(old: np.ndarray | None, new: np.ndarray, decay: float) -> np.ndarray:
    if old is None:
        return new
    old *= decay
    old += (1.0 - decay) * new
    return old


def _build(layout, spectra: Mapping[str, tuple[Spectrum, Spectrum]], rank, damping, policy) -> Geometry:
    factors = {name: (sa, sg) for name, (sg, sa) in spectra.items()}
    if policy is not None:
        return select(layout, factors, policy, damping)
    return Geometry.from_kfac(layout, factors, rank=rank, damping=damping)


class KfacEstimator:
    """Per-rank running KFAC factors, synchronised every ``sync_every`` steps.

    layout: the buffer layout. segments: names to estimate (default: every segment with >= 2
    axes). decay: EMA factor beta in [0, 1). sync_every: T, used by ``should_sync``.
    mode: default sync mode, "broadcast" (measured cheaper, docs/method.md) or "allreduce".
    """

    def __init__(self, layout, segments: Sequence[str] | None = None, decay: float = 0.95,
                 sync_every: int = 100, mode: str = "broadcast"):
        self.layout = as_layout(layout)
        self.segments = _matrix_segments(self.layout, segments)
        self.decay = _check_decay(decay)
        if int(sync_every) < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.sync_every = int(sync_every)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._a: dict[str, np.ndarray | None] = {n: None for n in self.segments}
        self._g: dict[str, np.ndarray | None] = {n: None for n in self.segments}
        self.counts: dict[str, int] = {n: 0 for n in self.segments}
        self.spectra: dict[str, tuple[Spectrum, Spectrum]] | None = None
        self.last_report: SyncReport | None = None

    def update(self, name: str, inputs: np.ndarray, output_grads: np.ndarray) -> None:
        """Feed one batch of segment ``name``.

        inputs: (..., n) layer inputs a; output_grads: (..., m) gradients of the loss w.r.t. the
        layer outputs d (leading axes are flattened into rows; any float dtype).
        Batch factors: ``a^T a / rows`` (n x n) and ``d^T d / rows`` (m x m).
        """
        if name not in self._a:
            raise ValueError(f"{name!r} is not an estimated segment ({self.segments})")
        m, n = self.layout[name].matrix_shape
        a = np.asarray(inputs, np.float64).reshape(-1, n) if np.shape(inputs)[-1] == n else None
        d = np.asarray(output_grads, np.float64).reshape(-1, m) if np.shape(output_grads)[-1] == m else None
        if a is None or d is None:
            raise ValueError(f"{name!r}: inputs must end with {n} and output_grads with {m}, got "
                             f"{np.shape(inputs)} and {np.shape(output_grads)}")
        if a.shape[0] == 0 or a.shape[0] != d.shape[0]:
            raise ValueError(f"{name!r}: need the same, non-zero number of rows in inputs and output_grads")
        self._a[name] = _ema(self._a[name], a.T @ a / a.shape[0], self.decay)
        self._g[name] = _ema(self._g[name], d.T @ d / d.shape[0], self.decay)
        self.counts[name] += 1

    def factors(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """This rank's local running factors: name -> (A, G) float64 (fed segments only)."""
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for n in self.segments:
            a, g = self._a[n], self._g[n]
            if a is not None and g is not None:  # set together by the first update (counts[n] > 0)
                out[n] = (a, g)
        return out

    def should_sync(self, step: int) -> bool:
        """True on steps that are multiples of ``sync_every`` (step 0 included)."""
        return int(step) % self.sync_every == 0

    def sync(self, comm=None, mode: str | None = None) -> SyncReport:
        """Collective over ``comm`` (a giftcomm Transport or an mpi4py communicator; None: this
        process only). Averages the factors over
        ranks and eigendecomposes them; afterwards ``spectra`` is identical on every rank.
        The local running averages are not changed (their mean over ranks is the global one)."""
        mode = mode or self.mode
        mats: list[np.ndarray] = []
        counts: list[int] = []
        for n in self.segments:
            m_out, n_in = self.layout[n].matrix_shape
            g, a = self._g[n], self._a[n]
            if g is None:
                g = np.zeros((m_out, m_out))
            if a is None:
                a = np.zeros((n_in, n_in))
            mats += [g, a]
            counts += [self.counts[n]] * 2
        spectra, report = sync_spectra(comm, mats, counts, mode)
        pairs = zip(self.segments, spectra[0::2], spectra[1::2])
        # a segment's two factors have the same counts, so both are synced or neither is
        self.spectra = {n: (sg, sa) for n, sg, sa in pairs if sg is not None and sa is not None}
        self.last_report = report
        return report

    def geometry(self, rank=None, damping: float = DEFAULT_DAMPING, policy: SelectivePolicy | None = None) -> Geometry:
        """The Geometry of the last ``sync`` (identical on every rank). With ``policy`` the
        selective policy decides per segment; otherwise every synced segment is whitened with
        ``rank`` (as in ``Geometry.from_kfac``)."""
        if self.spectra is None:
            raise RuntimeError("call sync(comm) before geometry()")
        return _build(self.layout, self.spectra, rank, damping, policy)


def row_col_mean_squares(grad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(column mean squares (n,), row mean squares (m,)) of an (m, n) gradient, float64:
    the diagonals of ``g^T g / m`` and ``g g^T / n``, i.e. (a, g) for ``Geometry.diagonal``."""
    g = np.asarray(grad, np.float64)
    sq = g * g
    return sq.mean(axis=0), sq.mean(axis=1)


class GradientFactorEstimator:
    """Communication-free factors from the reduced gradients: ``L = E[g g^T]/n``, ``R = E[g^T g]/m``.

    layout, segments, decay: as for KfacEstimator. ``update(flat)`` takes the reduced flat
    gradient buffer (1-D, ``layout.size`` elements, any float dtype). Cost per update:
    ``2 m n (m + n)`` flops per segment; call it every few steps for large layers.
    """

    def __init__(self, layout, segments: Sequence[str] | None = None, decay: float = 0.95):
        self.layout = as_layout(layout)
        self.segments = _matrix_segments(self.layout, segments)
        self.decay = _check_decay(decay)
        self._l: dict[str, np.ndarray | None] = {n: None for n in self.segments}
        self._r: dict[str, np.ndarray | None] = {n: None for n in self.segments}
        self.count = 0

    def update(self, flat: np.ndarray) -> None:
        """Feed one reduced gradient buffer (identical on every rank)."""
        x = np.asarray(flat)
        if x.ndim != 1 or x.size != self.layout.size:
            raise ValueError(f"expected a 1-D buffer of {self.layout.size} elements, got shape {x.shape}")
        for name in self.segments:
            seg = self.layout[name]
            m, n = seg.matrix_shape
            g = x[seg.offset : seg.stop].astype(np.float64).reshape(m, n)
            self._l[name] = _ema(self._l[name], g @ g.T / n, self.decay)
            self._r[name] = _ema(self._r[name], g.T @ g / m, self.decay)
        self.count += 1

    def factors(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """name -> (A = R (n, n), G = L (m, m)) float64; empty before the first update."""
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for n in self.segments:
            r, lf = self._r[n], self._l[n]
            if r is not None and lf is not None:  # every segment is set by the first update
                out[n] = (r, lf)
        return out

    def geometry(self, rank=None, damping: float = DEFAULT_DAMPING, policy: SelectivePolicy | None = None) -> Geometry:
        """Geometry from the current factors (same on every rank fed the same buffers)."""
        if policy is not None:
            return select(self.layout, self.factors(), policy, damping)
        return Geometry.from_kfac(self.layout, self.factors(), rank=rank, damping=damping)
