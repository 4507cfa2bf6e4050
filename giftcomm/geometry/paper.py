"""The GIFT paper's method as a preset: ``Geometry.preset("paper", layout, factors)``.

What the paper runs (*GIFT: Geometry-Informed Low-precision Gradient Communication for LLM
Pretraining*, arXiv 2607.07494; docs/method.md "The paper's method"),
restated as giftcomm's definitions:

- **Input side only**: ``W~ = W L_A^-T`` on a weight's (m, n) matrix view (A the (n, n) covariance
  of the layer's inputs), mapped back by ``W = W~ L_A^T``. The output axis is left alone.
- **Low rank plus residual diagonal**: with ``U_r, l_r`` the top-``rank`` eigenpairs of A (largest
  eigenvalues, r = 32 by default),
  ``A^ = U_r diag(l_r) U_r^T + diag(max(diag(A - U_r diag(l_r) U_r^T), d))``;
  for ``rank >= n`` the low-rank part is A itself and the diagonal term is ``d I``.
- **Factor**: ``L_A = chol(A^ + d I)`` (lower triangular), damping ``d`` **absolute** (1e-3 by
  default, in the units of A). ``factor="symmetric"`` uses the symmetric inverse square root
  ``S = (A^ + d I)^-1/2`` of the same matrix instead (``W~ = W S``, ``W = W~ S^-1``).
- **Estimation**: ``A`` is an exponential moving average of ``a^T a / rows`` with decay 0.95 per
  batch (the first batch sets it), kept per rank (:class:`InputFactorEstimator`); every
  ``refresh_every`` (50) steps it is averaged over the data-parallel ranks through the
  transport's control operations and the factor rebuilt from the average
  (:func:`refresh_geometry`), so every rank applies the same map (fingerprints compared).
- **Factor EMA**: as the paper, the factor itself is smoothed across refreshes,
  ``F <- factor_decay F_prev + (1 - factor_decay) F_fresh`` (0.95 by default; 0 keeps the fresh
  factor), with F = L (Cholesky: the blend of lower-triangular factors with positive diagonals
  is one again) or F = (A^ + d I)^1/2 (symmetric: a blend of positive definite matrices is one
  again); the map is then built from the blended F (``x -> x F^-T``). The history lives in a
  :class:`FactorEMA` that the caller keeps across refreshes (the adapters do); a one-shot
  ``Geometry.preset("paper", ...)`` has none and uses the fresh factor.
- **Selection**: the paper's rule (:class:`SaturationProfile`): over a window of steps, score each
  weight by the fraction of its FP8 codes that hit the format's upper or lower bound, and
  transform the top N, or those above a threshold. giftcomm's own :class:`SelectivePolicy` stays
  available beside it.

The map of one segment acts on each row of the (m, n) view independently (``x -> x L^-T``), so a
row shard (FSDP2 shards dim 0) maps alone: :func:`paper_sharded` gives the per-shard geometries.

Numerics: A is approximated and factored in float64; ``L^-1`` is formed once per refresh (NumPy
has no triangular solve and SciPy is not a dependency of giftcomm; the inverse of the triangular
factor is itself lower triangular) and both ``L^-1`` and ``L`` are rounded once to float32, so
forward and inverse are one float32 GEMM each (``x @ L^-T`` and ``x @ L^T``), on any array
backend. Bad input raises ValueError: a non-finite A, or ``A^ + d I`` that is not positive
definite (possible only for ``d <= 0`` or an A that is not positive semi-definite).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import ml_dtypes
import numpy as np

from ..formats import Format, get_format
from .geometry import PRESET_BUILDERS, Geometry
from .layout import Layout, as_layout
from .sides import DenseSide, IdentitySide, Side
from .transform import SegmentTransform, identity_transform

__all__ = ["PRESETS", "FACTORS", "PaperOptions", "CholeskySide", "approximate_input_factor", "input_side",
           "input_factor", "side_of_factor", "FactorEMA",
           "paper_geometry", "paper_sharded", "InputFactorEstimator", "average_input_factors", "refresh_geometry",
           "refresh_geometries", "refresh_sharded", "REFRESH_FIELDS", "refresh_signature", "agree_refresh",
           "SaturationProfile", "saturation_fraction", "select_saturated", "select_for", "average_scores"]

PRESETS = ("paper",)
"""The preset names ``Geometry.preset`` knows."""

FACTORS = ("cholesky", "symmetric")
"""The factor of the damped approximation: its Cholesky factor (the paper's) or its symmetric
inverse square root (giftcomm's KFAC convention)."""


@dataclass(frozen=True)
class PaperOptions:
    """The paper's settings (each settable; defaults are the paper's).

    rank: eigenpairs of A kept (r, >= 1). damping: d, absolute (units of A), >= 0. decay: EMA decay
    of A per batch, in [0, 1). refresh_every: K, steps between factor refreshes (>= 1). factor:
    "cholesky" or "symmetric" (FACTORS). names: the segments to transform; None: chosen by the
    paper's rule, a saturation profile over the first ``profile_steps`` syncs of an adapter
    (:class:`SaturationProfile`, :func:`select_for`), or, for a one-shot
    ``Geometry.preset("paper", ...)`` that has no gradients to profile, every 2-D segment with a
    factor. top_n, top_fraction, threshold: the selection rule (:func:`select_for`): the top_n
    highest scores (None: the ceil(top_fraction x count) highest, giftcomm's default 0.25 where the
    paper gives only its own model's count, 13 layers; both None: every scored weight), then only
    those with a score >= threshold (None: no threshold). profile_steps: the length of the profile
    window (the paper's 100; 0: no profile, names None then transforms every 2-D segment with a
    factor from the first sync). reexpress: error feedback re-expressed in the new coordinates at a
    refresh (:class:`giftcomm.collectives.feedback.TransformedFeedback`); False is the artifact's behaviour.
    factor_decay: the EMA of the factor itself across refreshes, in [0, 1) (the paper's 0.95;
    0: each refresh uses its fresh factor; :class:`FactorEMA`).
    """

    rank: int = 32
    damping: float = 1e-3
    decay: float = 0.95
    refresh_every: int = 50
    factor: str = "cholesky"
    names: tuple[str, ...] | None = None
    top_n: int | None = None
    top_fraction: float | None = 0.25
    threshold: float | None = None
    profile_steps: int = 100
    reexpress: bool = True
    factor_decay: float = 0.95

    def __post_init__(self) -> None:
        def positive_int(name: str, v: Any, low: int = 1) -> None:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ValueError(f"PaperOptions: {name} must be an int >= {low}, got {v!r}")

        positive_int("rank", self.rank)
        positive_int("refresh_every", self.refresh_every)
        positive_int("profile_steps", self.profile_steps, 0)
        if self.top_n is not None:
            positive_int("top_n", self.top_n)
        d = self.damping
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (np.isfinite(d) and d >= 0):
            raise ValueError(f"PaperOptions: damping must be a finite number >= 0 (absolute), got {d!r}")
        if not (isinstance(self.decay, (int, float)) and 0.0 <= self.decay < 1.0):
            raise ValueError(f"PaperOptions: decay must be in [0, 1), got {self.decay!r}")
        fd = self.factor_decay
        if isinstance(fd, bool) or not (isinstance(fd, (int, float)) and 0.0 <= fd < 1.0):
            raise ValueError(f"PaperOptions: factor_decay must be in [0, 1), got {fd!r}")
        if self.factor not in FACTORS:
            raise ValueError(f"PaperOptions: factor must be one of {FACTORS}, got {self.factor!r}")
        tf = self.top_fraction
        if tf is not None and (isinstance(tf, bool) or not isinstance(tf, (int, float)) or not 0 < tf <= 1):
            raise ValueError(f"PaperOptions: top_fraction is a fraction of the scored weights in (0, 1], got {tf!r}")
        if self.threshold is not None and not (isinstance(self.threshold, (int, float)) and 0 <= self.threshold <= 1):
            raise ValueError(f"PaperOptions: threshold is a fraction of codes in [0, 1], got {self.threshold!r}")
        if self.names is not None:
            if isinstance(self.names, str) or not all(isinstance(n, str) for n in self.names):
                raise TypeError(f"PaperOptions: names must be a sequence of segment names, got {self.names!r}")
            object.__setattr__(self, "names", tuple(self.names))
        if not isinstance(self.reexpress, bool):
            raise TypeError(f"PaperOptions: reexpress must be a bool, got {self.reexpress!r}")

    @classmethod
    def of(cls, options: PaperOptions | None = None, **overrides: Any) -> PaperOptions:
        """``options`` (default: the paper's) with ``overrides`` (TypeError naming an unknown one)."""
        known = {f.name for f in fields(cls)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise TypeError(f"unknown option(s) of the 'paper' preset: {bad}; known: {sorted(known)}")
        return replace(options or cls(), **overrides)


# ------------------------------------------------------------------------------ the factor
def _check_factor(a: Any, name: str) -> np.ndarray:
    f = np.asarray(a, dtype=np.float64)
    if f.ndim != 2 or f.shape[0] != f.shape[1]:
        raise ValueError(f"paper preset: A of {name!r} must be a square matrix, got shape {f.shape}")
    if not np.all(np.isfinite(f)):
        raise ValueError(f"paper preset: A of {name!r} has non-finite entries")
    return 0.5 * (f + f.T)


def approximate_input_factor(a: Any, rank: int = 32, damping: float = 1e-3) -> np.ndarray:
    """``A^ = U_r diag(l_r) U_r^T + diag(max(diag(A - U_r diag(l_r) U_r^T), d))``: (n, n) float64
    from a symmetric (n, n) A (any float dtype; symmetrised). ``U_r, l_r``: the ``rank`` largest
    eigenpairs (all of them when rank >= n)."""
    f = _check_factor(a, "A")
    n = f.shape[0]
    vals, vecs = np.linalg.eigh(f)
    k = min(int(rank), n)
    u, lam = vecs[:, n - k:], vals[n - k:]
    low = (u * lam) @ u.T
    resid = np.maximum(np.diag(f) - np.diag(low), float(damping))
    out = low + np.diag(resid)
    return 0.5 * (out + out.T)


class CholeskySide(Side):
    """``S = L^-1`` for a lower-triangular Cholesky factor L (d x d): ``right(x) = x L^-T``,
    ``right(x, inverse=True) = x L^T``; ``left`` the transposed action (``L^-1 x``, ``L x``).

    linv: L^-1 (d, d) float32 lower triangular; l: L (d, d) float32 lower triangular."""

    kind = "cholesky"

    def __init__(self, linv: np.ndarray, l_factor: np.ndarray):
        self.linv = np.ascontiguousarray(linv, dtype=np.float32)
        self.l = np.ascontiguousarray(l_factor, dtype=np.float32)
        self.dim = self.l.shape[0]
        self.rank = self.dim

    def left(self, x, inverse=False):
        return self._on(x, "l" if inverse else "linv")[0] @ x

    def right(self, x, inverse=False):
        return x @ self._on(x, "l" if inverse else "linv")[0].T

    def params(self):
        return (self.linv, self.l)

    def flops_per_column(self) -> float:
        return float(self.dim * self.dim)  # a triangular product: half a dense one


def input_factor(a: Any, options: PaperOptions | None = None, name: str = "A") -> np.ndarray:
    """The (n, n) float64 factor F of one weight's input covariance A (module doc): the lower
    Cholesky factor L of ``A^ + d I`` (``factor="cholesky"``) or its symmetric square root
    (``"symmetric"``); the map is ``x -> x F^-T``. ValueError, naming ``name``, for a
    non-finite A or a damped approximation that is not positive definite."""
    o = options or PaperOptions()
    f = _check_factor(a, name)
    m = approximate_input_factor(f, o.rank, o.damping) + o.damping * np.eye(f.shape[0])
    if o.factor == "cholesky":
        try:
            low = np.linalg.cholesky(m)
        except np.linalg.LinAlgError:
            low = None
        if low is None or not np.all(np.isfinite(low)) or not np.all(np.diag(low) > 0):
            raise ValueError(f"paper preset: A^ + d I of {name!r} is not positive definite (damping d = "
                             f"{o.damping:g}, absolute); A must be positive semi-definite and d > 0")
        return np.tril(low)
    vals, vecs = np.linalg.eigh(m)
    if not vals[0] > 0:
        raise ValueError(f"paper preset: A^ + d I of {name!r} is not positive definite (smallest eigenvalue "
                         f"{vals[0]:.3g}, damping d = {o.damping:g}, absolute)")
    root = (vecs * vals**0.5) @ vecs.T
    return 0.5 * (root + root.T)


def _finite_in_float32(name: str, what: str, m: np.ndarray) -> None:
    """ValueError naming segment ``name`` when the float64 matrix ``m`` (a factor or its inverse)
    is not finite once rounded to float32, the precision the map is applied in."""
    with np.errstate(over="ignore"):
        ok = bool(np.all(np.isfinite(m.astype(np.float32))))
    if not ok:
        big = float(np.max(np.abs(m))) if np.all(np.isfinite(m)) else float("inf")
        raise ValueError(f"paper preset: {what} of {name!r} is not finite in float32 (largest |entry| {big:.3g}; "
                         f"float32 holds up to {float(np.finfo(np.float32).max):.3g}); the map x -> x F^-T would "
                         "turn the gradients into Inf/NaN: rescale that layer's inputs (A is in their squared units), "
                         "or, for an A near zero, raise the damping")


def side_of_factor(f: np.ndarray, factor: str = "cholesky", name: str = "A") -> Side:
    """The input-side operator of a factor F from :func:`input_factor` (or a blend of such):
    ``right(x) = x F^-T``, ``right(x, inverse=True) = x F^T``; a :class:`CholeskySide` for
    ``"cholesky"`` (F lower triangular), a symmetric ``DenseSide`` for ``"symmetric"``. Both
    matrices the map applies (F and its inverse) are rounded to float32: ValueError naming
    ``name`` when either is not finite there (e.g. A = 1e80 I, whose factor 1e40 overflows)."""
    f = np.asarray(f, np.float64)
    _finite_in_float32(name, "the factor F", f)
    if factor == "cholesky":
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            linv = np.tril(np.linalg.inv(f))
        _finite_in_float32(name, "the inverse factor F^-1", linv)
        return CholeskySide(linv, f)
    vals, vecs = np.linalg.eigh(0.5 * (f + f.T))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        fwd = (vecs * vals**-1.0) @ vecs.T
    _finite_in_float32(name, "the inverse factor F^-1", fwd)
    return DenseSide(0.5 * (fwd + fwd.T), f)


def input_side(a: Any, options: PaperOptions | None = None, name: str = "A") -> Side:
    """The input-side operator of one weight from its (n, n) input covariance A:
    ``side_of_factor(input_factor(a, options, name), options.factor)`` (fresh factor, no EMA)."""
    o = options or PaperOptions()
    return side_of_factor(input_factor(a, o, name), o.factor, name)


class FactorEMA:
    """The paper's EMA of the factor across refreshes (per process; identical on every rank when
    fed the same averaged A, which :func:`refresh_geometries` makes sure of).

    ``factors``: name -> (factor kind, F (n, n) float64), the blended factors of the last refresh
    agreed on. A refresh stages ``blend(name, fresh, kind, decay)`` for each segment and
    ``commit()`` s them once every rank built its map (a refresh that fails anywhere changes
    nothing). A segment whose factor kind or size changed restarts from its fresh factor."""

    def __init__(self) -> None:
        self.factors: dict[str, tuple[str, np.ndarray]] = {}
        self.staged: dict[str, tuple[str, np.ndarray]] = {}

    def blend(self, name: str, fresh: np.ndarray, kind: str, decay: float) -> np.ndarray:
        """``decay F_prev + (1 - decay) fresh`` (fresh when there is no compatible F_prev), staged."""
        prev = self.factors.get(name)
        f = fresh
        if prev is not None and prev[0] == kind and prev[1].shape == fresh.shape and decay > 0:
            f = decay * prev[1] + (1.0 - decay) * fresh
            if kind == "symmetric":
                f = 0.5 * (f + f.T)
        self.staged[name] = (kind, f)
        return f

    def commit(self) -> None:
        self.factors.update(self.staged)
        self.staged = {}

    def discard(self) -> None:
        self.staged = {}

    def state_dict(self) -> dict[str, Any]:
        return {"factors": {n: (k, f.copy()) for n, (k, f) in self.factors.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.factors = {n: (str(k), np.asarray(f, np.float64)) for n, (k, f) in state["factors"].items()}
        self.staged = {}


def _input_factor(pair: Any) -> Any:
    """A from a factors entry: A itself, or an (A, G) pair (G ignored: input side only)."""
    if isinstance(pair, tuple) and len(pair) == 2:
        return pair[0]
    return pair


def _chosen(layout: Layout, factors: Mapping, options: PaperOptions) -> list[str]:
    for name in factors:
        if name not in layout:
            raise ValueError(f"paper preset: factor given for {name!r}, which is not a segment of the layout")
    if options.names is None:
        return [s.name for s in layout if s.ndim >= 2 and s.name in factors]
    missing = [n for n in options.names if n in layout and n not in factors]
    if missing:
        raise ValueError(f"paper preset: no factor A for the selected segment(s) {missing[:8]}")
    flat = [n for n in options.names if n in layout and layout[n].ndim < 2]
    if flat:
        raise ValueError(f"paper preset: selected segment(s) {flat[:8]} are not matrices (input side needs 2-D)")
    return [n for n in options.names if n in layout]


def paper_geometry(layout, factors: Mapping, options: PaperOptions | None = None, *,
                   smoothing: FactorEMA | None = None, **overrides: Any) -> Geometry:
    """The paper's geometry over ``layout``: segment -> input-side map for every chosen segment.

    factors: name -> A ((n, n) input covariance of the segment's (m, n) view; an (A, G) pair is
    accepted and G ignored). options / overrides: :class:`PaperOptions`. Chosen segments:
    ``options.names`` (each must have a factor: ValueError otherwise), else every 2-D segment
    with a factor; all others get the identity. smoothing: a :class:`FactorEMA` holding the
    previous refresh's factors: each factor is blended with it (``options.factor_decay``, staged
    in it); None: the fresh factors."""
    o = PaperOptions.of(options, **overrides)
    layout = as_layout(layout)
    chosen = set(_chosen(layout, factors, o))
    ts = []
    for seg in layout:
        if seg.name not in chosen:
            ts.append(identity_transform(seg, "paper: not selected"))
            continue
        m, n = seg.matrix_shape
        a = _input_factor(factors[seg.name])
        if np.shape(a) != (n, n):
            raise ValueError(f"paper preset: segment {seg.name!r} of shape {seg.shape} needs A of shape ({n}, {n}), "
                             f"got {np.shape(a)}")
        f = input_factor(a, o, seg.name)
        if smoothing is not None:
            f = smoothing.blend(seg.name, f, o.factor, o.factor_decay)
        side = side_of_factor(f, o.factor, seg.name)
        ts.append(SegmentTransform(seg, IdentitySide(m), side, {"note": f"paper {o.factor} r={o.rank} d={o.damping:g}"}))
    return Geometry(layout, ts)


def paper_sharded(layout, factors: Mapping, shards: int, options: PaperOptions | None = None, *,
                  smoothing: FactorEMA | None = None, **overrides: Any):
    """The paper's geometry for a dim-0 sharded buffer (FSDP2): a ShardedGeometry whose shard
    ``r`` applies the same input-side map to its own rows only (the map acts row by row, so no
    shard needs another's rows); padding rows pass through (the map of a zero row is zero)."""
    from .sharded import ShardedGeometry, check_shards, shard_layout

    o = PaperOptions.of(options, **overrides)
    layout, shards = as_layout(layout), check_shards(shards)
    full = paper_geometry(layout, factors, o, smoothing=smoothing)
    rows = [shard_layout(layout, shards, r) for r in range(shards)]
    per = []
    for r in range(shards):
        ts = []
        for t, seg in zip(full.transforms, rows[r].segments):
            if t.is_identity:
                ts.append(identity_transform(seg, t.info.get("note", "")))
            else:
                m, _ = seg.matrix_shape
                ts.append(SegmentTransform(seg, IdentitySide(m), t.right, {"note": f"{t.info['note']} shard {r}/{shards}"}))
        per.append(Geometry(rows[r], ts))
    return ShardedGeometry(layout, shards, per, full)


# ------------------------------------------------------------------------------ estimation
class InputFactorEstimator:
    """Per-rank EMA of each segment's input covariance ``A = E[a a^T]`` (float64).

    layout: the buffer layout; segments: names to estimate (default: every 2-D segment); decay:
    the EMA decay per batch (the first batch sets A). ``update(name, inputs)`` with inputs
    (..., n) (leading axes flattened into rows; any float dtype): ``A <- decay A + (1 - decay)
    a^T a / rows``."""

    def __init__(self, layout, segments: Sequence[str] | None = None, decay: float = 0.95):
        self.layout = as_layout(layout)
        if segments is None:
            segments = [s.name for s in self.layout if s.ndim >= 2]
        for n in segments:
            if n not in self.layout:
                raise ValueError(f"{n!r} is not a segment of the layout")
        self.segments = list(segments)
        if not 0.0 <= float(decay) < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self._a: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {n: 0 for n in self.segments}

    def update(self, name: str, inputs: Any) -> None:
        if name not in self.counts:
            raise ValueError(f"{name!r} is not an estimated segment ({self.segments})")
        n = self.layout[name].matrix_shape[1]
        if np.shape(inputs)[-1:] != (n,):
            raise ValueError(f"{name!r}: inputs must end with {n}, got shape {np.shape(inputs)}")
        a = np.asarray(inputs, np.float64).reshape(-1, n)
        if a.shape[0] == 0:
            raise ValueError(f"{name!r}: no rows")
        batch = a.T @ a / a.shape[0]
        old = self._a.get(name)
        self._a[name] = batch if old is None else self.decay * old + (1.0 - self.decay) * batch
        self.counts[name] += 1

    def factors(self) -> dict[str, np.ndarray]:
        """This rank's local EMA: name -> A (n, n) float64 (fed segments only)."""
        return dict(self._a)

    def state_dict(self) -> dict[str, Any]:
        """This rank's EMA (copies) and batch counts: ``{"a": {name: A}, "counts": {name: int}}``."""
        return {"a": {n: a.copy() for n, a in self._a.items()}, "counts": dict(self.counts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (ValueError for a segment or shape this estimator lacks)."""
        a = {str(n): np.array(v, np.float64) for n, v in state["a"].items()}
        for n, v in a.items():
            k = self.layout[n].matrix_shape[1] if n in self.counts else None
            if k is None or v.shape != (k, k):
                raise ValueError(f"InputFactorEstimator.load_state_dict: no segment {n!r} with A of shape {v.shape}")
        self._a = a
        self.counts = {n: int(state["counts"].get(n, 0)) for n in self.segments}


# ------------------------------------------------------------------------------ the refresh's agreement
REFRESH_FIELDS = ("sync", "refresh_every", "rank", "damping", "decay", "factor_decay", "factor", "names",
                  "top_n", "top_fraction", "threshold", "profile_steps", "reexpress")
"""The fields :func:`agree_refresh` compares (then the adapter's own ``extra`` ones)."""

_FLOAT_FIELDS = ("damping", "decay", "factor_decay", "top_fraction", "threshold")


def _float_bits(x: float | None) -> int:
    return -1 if x is None else int(np.array(float(x), np.float64).view(np.int64))


def _digest(obj: Any) -> int:
    """A process-independent 63-bit digest of ``repr(obj)`` (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=8).digest(), "little") >> 1


def refresh_signature(options: PaperOptions, sync: int) -> dict[str, int]:
    """The int64 fields of :data:`REFRESH_FIELDS` for sync number ``sync`` under ``options``."""
    o = options
    return {"sync": int(sync), "refresh_every": int(o.refresh_every), "rank": int(o.rank),
            "damping": _float_bits(o.damping), "decay": _float_bits(o.decay),
            "factor_decay": _float_bits(o.factor_decay), "factor": FACTORS.index(o.factor),
            "names": -1 if o.names is None else _digest(o.names), "top_n": -1 if o.top_n is None else int(o.top_n),
            "top_fraction": _float_bits(o.top_fraction), "threshold": _float_bits(o.threshold), "profile_steps": int(o.profile_steps),
            "reexpress": int(o.reexpress)}


def _describe_field(key: str, value: int) -> str:
    if key in _FLOAT_FIELDS:
        return "None" if value == -1 else f"{float(np.array(value, np.int64).view(np.float64)):g}"
    if key == "factor":
        return FACTORS[value] if 0 <= value < len(FACTORS) else str(value)
    if key == "names":
        return "None (every 2-D layer)" if value == -1 else f"a selection with digest {value:016x}"
    if key == "top_n":
        return "None" if value == -1 else str(value)
    if key == "reexpress":
        return str(bool(value))
    return str(value)


def agree_refresh(comm: Any, what: str, sync: int, options: PaperOptions,
                  extra: Mapping[str, int] | None = None) -> None:
    """Collective over ``comm`` (a giftcomm Transport, an mpi4py communicator, or None / one rank:
    nothing to agree): the check every adapter running the paper's preset makes at EVERY sync,
    before any refresh collective, that the ranks agree on when and how the maps are refreshed:
    the sync counter ``sync`` (the refresh is due when ``sync % refresh_every == 0``), every
    :class:`PaperOptions` field (:data:`REFRESH_FIELDS`) and the adapter's own ``extra`` int
    fields (e.g. a warm-up length). One int64 allgather (giftcomm.collectives.agree.agree), so a
    mismatch raises the same ValueError on every rank at once, naming the fields and every
    rank's value, instead of one rank entering the refresh's collectives while another reduces."""
    from ..collectives.agree import agree
    from .sync import as_transport

    t = as_transport(comm)
    if t is None or t.size == 1:
        return
    sig = refresh_signature(options, sync)
    more = {str(k): int(v) for k, v in (extra or {}).items()}
    sig.update(more)
    fields = REFRESH_FIELDS + tuple(more)
    _, table = agree(t, what, (True, sig), fields, ())
    bad = [(key, table[:, i]) for i, key in enumerate(fields) if np.any(table[:, i] != table[0, i])]
    if bad:
        said = "; ".join(f"{key} (" + ", ".join(f"rank {r}: {_describe_field(key, int(v))}" for r, v in
                                                 enumerate(col)) + ")" for key, col in bad)
        raise ValueError(f"{what}: the ranks disagree on when or how to refresh the paper preset's maps -- {said}. "
                         "Every rank must call sync equally often (restore every rank from the same step's "
                         "checkpoint) with the same paper settings")


def average_input_factors(comm: Any, factors: Mapping[str, Any], step: int) -> dict[str, np.ndarray]:
    """Collective over ``comm`` (a giftcomm Transport, an mpi4py communicator, or None: this
    process alone): the mean over ranks of each rank's A, identical on every rank.

    Every rank must call it at the same ``step`` with factors for the same names and shapes: one
    allgather of (step, names, shapes) first, and any difference (a rank missing a factor, a
    refresh that only some ranks reach at this step) raises RuntimeError on every rank, naming
    the ranks. Then one ``sum_float64`` of all factors packed together (the transport's control
    operation, deadline-bound like every wait of the transport)."""
    from .sync import as_transport

    mats = {n: np.ascontiguousarray(a, dtype=np.float64) for n, a in sorted(factors.items())}
    t = as_transport(comm)
    if t is None or t.size == 1:
        return {n: a.copy() for n, a in mats.items()}
    head = (int(step), tuple((n, a.shape) for n, a in mats.items()))
    heads = t.allgather_object(head)
    if any(h != heads[0] for h in heads):
        steps = sorted({h[0] for h in heads})
        names = [set(n for n, _ in h[1]) for h in heads]
        every = set.union(*names)
        lines = [f"rank {r}: step {h[0]}, missing {sorted(every - names[r])[:6]}" for r, h in enumerate(heads)
                 if h != heads[0] or r == 0]
        raise RuntimeError(f"paper preset: the ranks disagree on the factor refresh (steps {steps}); every rank must "
                           f"refresh at the same step with a factor A for the same segments: " + "; ".join(lines))
    packed = np.concatenate([a.reshape(-1) for a in mats.values()]) if mats else np.zeros(0)
    total = t.sum_float64(packed) / t.size
    out, lo = {}, 0
    for n, a in mats.items():
        out[n] = total[lo : lo + a.size].reshape(a.shape)
        lo += a.size
    return out


def refresh_geometry(comm: Any, layout, factors: Mapping[str, Any], step: int,
                     options: PaperOptions | None = None, *, smoothing: FactorEMA | None = None,
                     **overrides: Any) -> Geometry:
    """Collective: average this rank's factors over the ranks (:func:`average_input_factors`),
    build :func:`paper_geometry` from the average (blended with ``smoothing``'s previous factors
    when given: the factor EMA), and make sure every rank has the same map: a failure on any
    rank (e.g. a factor not positive definite after damping) raises ValueError on every rank
    with that rank's message, and differing fingerprints take rank 0's geometry (as
    ``Geometry.agree``) and its factors."""
    return refresh_geometries(comm, {0: layout}, factors, step, options, smoothing=smoothing, **overrides)[0]


def _agreed(t: Any, build: Any, fingerprint: Any, smoothing: FactorEMA | None) -> Any:
    """Run ``build()`` on every rank of transport ``t`` (None or one rank: this process alone) and
    agree: its error on any rank is a ValueError on every rank; fingerprints that differ take
    rank 0's result (and staged factors). Commits ``smoothing`` on success, discards on failure."""
    alone = t is None or t.size == 1
    err, got = None, None
    try:
        got = build()
    except (ValueError, TypeError) as exc:
        if smoothing is not None:
            smoothing.discard()
        if alone:
            raise
        err = f"{type(exc).__name__}: {exc}"
    if not alone:
        every = t.allgather_object((err, None if err is not None else fingerprint(got)))
        bad = [(r, e) for r, (e, _) in enumerate(every) if e is not None]
        if bad:
            if smoothing is not None:
                smoothing.discard()
            raise ValueError("paper preset: the factor refresh failed on rank(s) " +
                             "; ".join(f"{r}: {e}" for r, e in bad))
        if any(fp != every[0][1] for _, fp in every):
            staged = None if smoothing is None else smoothing.staged
            got, staged = t.broadcast_object((got, staged) if t.rank == 0 else None, root=0)
            if smoothing is not None:
                smoothing.staged = staged
    if smoothing is not None:
        smoothing.commit()
    return got


def refresh_geometries(comm: Any, layouts: Mapping[Any, Any], factors: Mapping[str, Any], step: int,
                       options: PaperOptions | None = None, *, smoothing: FactorEMA | None = None,
                       **overrides: Any) -> dict[Any, Geometry]:
    """:func:`refresh_geometry` for several layouts at once (e.g. one per gradient bucket): one
    average of every factor, then key -> :func:`paper_geometry` of that layout (with the factors
    of its segments), agreed in one allgather. Same order of keys expected on every rank."""
    from .sync import as_transport

    o = PaperOptions.of(options, **overrides)
    avg = average_input_factors(comm, factors, step)

    def build() -> dict[Any, Geometry]:
        geos = {}
        for key, lay in layouts.items():
            lay = as_layout(lay)
            geos[key] = paper_geometry(lay, {n: a for n, a in avg.items() if n in lay}, o, smoothing=smoothing)
        return geos

    return _agreed(as_transport(comm), build, lambda g: [g[k].fingerprint() for k in layouts], smoothing)


def refresh_sharded(comm: Any, layout, factors: Mapping[str, Any], shards: int, step: int,
                    options: PaperOptions | None = None, *, smoothing: FactorEMA | None = None,
                    **overrides: Any):
    """:func:`refresh_geometry` for a dim-0 sharded buffer (FSDP2): the average of the ranks' A,
    then :func:`paper_sharded`; errors and fingerprints agreed in one allgather (ValueError on
    every rank if the build fails on any)."""
    from .sync import as_transport

    o = PaperOptions.of(options, **overrides)
    avg = average_input_factors(comm, factors, step)
    return _agreed(as_transport(comm), lambda: paper_sharded(layout, avg, shards, o, smoothing=smoothing),
                   lambda g: g.fingerprint(), smoothing)


# ------------------------------------------------------------------------------ selection
def saturation_fraction(values: Any, fmt: str | Format = "e5m2", scale: float | None = None) -> float:
    """Fraction (in [0, 1]) of the FP8 codes of ``values`` (any shape, float) that hit a bound of
    the format, with one scale per tensor (the paper's wire).

    Definition: ``s = scale`` (default ``max|values| / fmt.max_value``, the per-tensor scale),
    ``q = fp8(values / s)`` rounded to nearest even and saturated to +-max. A value's code hits
    the **upper bound** when ``|q| == max_value``; it hits the **lower bound** when the value is
    not zero and ``|q| <= the format's smallest subnormal`` (it underflows to zero or to the
    smallest subnormal). Zeros (exact) never count; non-finite values count as upper. An all-zero
    tensor scores 0."""
    f = get_format(fmt)
    if not f.scaled or f.value_bits != 8:
        raise ValueError(f"saturation_fraction needs an FP8 format (e4m3, e5m2), got {f.name}")
    x = np.asarray(values, dtype=np.float32).reshape(-1)
    if x.size == 0:
        return 0.0
    finite = np.isfinite(x)
    amax = float(np.max(np.abs(x[finite]))) if finite.any() else 0.0
    s = float(scale) if scale is not None else amax / f.max_value
    if not s > 0:
        return float(np.count_nonzero(~finite)) / x.size
    y = np.clip(np.where(finite, x, 0.0) / np.float32(s), -f.max_value, f.max_value)
    q = np.abs(y.astype(f.wire_dtype).astype(np.float32))
    tiny = float(ml_dtypes.finfo(f.wire_dtype).smallest_subnormal)
    hits = (q >= f.max_value) | ((x != 0) & (q <= tiny)) | ~finite
    return float(np.count_nonzero(hits)) / x.size


class SaturationProfile:
    """The paper's selection rule: profile a window of steps, score each weight by the fraction of
    its FP8 codes that hit the format's bounds (:func:`saturation_fraction`, averaged over the
    steps it was fed), transform the top N or those above a threshold.

    fmt: the wire format scored (the paper: "e5m2", one scale per tensor). steps: the window
    (``full`` after that many :meth:`update` calls per weight; later calls are ignored)."""

    def __init__(self, fmt: str | Format = "e5m2", steps: int = 100):
        self.fmt = get_format(fmt)
        saturation_fraction(np.zeros(1), self.fmt)  # validates the format
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
            raise ValueError(f"SaturationProfile: steps must be an int >= 1, got {steps!r}")
        self.steps = int(steps)
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def update(self, name: str, grad: Any) -> None:
        """Score one step's gradient of weight ``name`` (within the window)."""
        if self.counts.get(name, 0) >= self.steps:
            return
        self.totals[name] = self.totals.get(name, 0.0) + saturation_fraction(grad, self.fmt)
        self.counts[name] = self.counts.get(name, 0) + 1

    def update_flat(self, layout, flat: Any, names: Iterable[str] | None = None) -> None:
        """Score every 2-D segment of ``layout`` (or ``names``) in one flat gradient buffer."""
        layout = as_layout(layout)
        x = np.asarray(flat).reshape(-1)
        for seg in layout:
            if (names is None and seg.ndim >= 2) or (names is not None and seg.name in names):
                self.update(seg.name, x[seg.offset : seg.stop])

    @property
    def full(self) -> bool:
        return bool(self.counts) and all(c >= self.steps for c in self.counts.values())

    def scores(self) -> dict[str, float]:
        """name -> mean fraction of bound-hitting codes over the profiled steps."""
        return {n: self.totals[n] / self.counts[n] for n in self.counts}

    def select(self, top_n: int | None = None, threshold: float | None = None) -> tuple[str, ...]:
        """:func:`select_saturated` of :meth:`scores`."""
        return select_saturated(self.scores(), top_n, threshold)

    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals), "counts": dict(self.counts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.totals = {str(n): float(v) for n, v in state["totals"].items()}
        self.counts = {str(n): int(v) for n, v in state["counts"].items()}


def select_saturated(scores: Mapping[str, float], top_n: int | None = None,
                     threshold: float | None = None) -> tuple[str, ...]:
    """The names to transform: the ``top_n`` highest scores (ties broken by name), then only those
    with ``score >= threshold``; None disables either rule (both None: every name). Sorted by
    descending score."""
    order = sorted(scores, key=lambda n: (-scores[n], n))
    if top_n is not None:
        order = order[: int(top_n)]
    if threshold is not None:
        order = [n for n in order if scores[n] >= threshold]
    return tuple(order)


def select_for(options: PaperOptions, scores: Mapping[str, float]) -> tuple[str, ...]:
    """The paper's selection under ``options`` (:class:`PaperOptions`: top_n, else
    ceil(top_fraction x len(scores)), then threshold; :func:`select_saturated`) from the scores of
    a :class:`SaturationProfile` (name -> mean fraction of bound-hitting codes)."""
    top = options.top_n
    if top is None and options.top_fraction is not None and scores:
        top = max(1, int(np.ceil(options.top_fraction * len(scores) - 1e-9)))
    return select_saturated(scores, top, options.threshold)


def average_scores(comm: Any, scores: Mapping[str, float]) -> dict[str, float]:
    """Collective over ``comm`` (a giftcomm Transport, an mpi4py communicator, or None: this process
    alone): the mean over the ranks of each rank's profile scores, identical on every rank (one
    allgather of the names, then one ``sum_float64``). RuntimeError on every rank when the ranks
    profiled different weights."""
    from .sync import as_transport

    names = sorted(scores)
    t = as_transport(comm)
    if t is None or t.size == 1:
        return {n: float(scores[n]) for n in names}
    every = t.allgather_object(tuple(names))
    if any(e != every[0] for e in every):
        raise RuntimeError("paper preset: the ranks profiled different weights for the selection: " +
                           "; ".join(f"rank {r}: {len(e)} weights" for r, e in enumerate(every)))
    total = t.sum_float64(np.array([scores[n] for n in names], np.float64)) / t.size
    return {n: float(v) for n, v in zip(names, total)}


PRESET_BUILDERS["paper"] = paper_geometry  # Geometry.preset("paper", ...)
