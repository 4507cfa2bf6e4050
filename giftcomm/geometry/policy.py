"""Selective policy: which segments to transform, and with which ranks.

Per segment, in order (docs/method.md gives the reasons):

1. identity when the segment has no factors, is not a matrix (1-D: biases, norm scales) or has
   fewer than ``min_size`` elements;
2. per side (G over outputs, A over inputs): ``k`` = smallest rank holding ``energy`` of the
   factor's trace, capped at ``max_rank``; when ``2k >= d`` the full d x d side is no dearer
   than the low-rank one and is used instead;
3. the predicted error ratio ``r`` (whitened-norm FP8 error, transform / Euclidean) and the
   flops ``f`` per element of forward + inverse are computed for that choice;
4. the transform is kept only when ``1 - r >= min_gain`` and ``f <= (1 - r) * flops_per_gain``
   (the predicted error reduction pays for the flops at the stated exchange rate); otherwise
   identity.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .geometry import Geometry, _check_damping, spectra_from_factors
from .layout import as_layout
from .spectral import Spectrum, rank_for_energy
from .transform import SegmentTransform, identity_transform, kfac_transform

__all__ = ["SelectivePolicy", "select"]


@dataclass(frozen=True)
class SelectivePolicy:
    """Settings of the selective policy (see the module doc for the rule).

    min_size: segments with fewer elements stay identity (elements).
    energy: fraction of a factor's trace the kept eigenpairs must hold (0 < energy <= 1).
    max_rank: cap on k per side (None: no cap).
    min_gain: least predicted relative error reduction ``1 - r`` worth a transform.
    flops_per_gain: flops per element one is willing to spend for a gain of 1.0 (all error
      removed); the transform is kept when its flops per element <= gain * flops_per_gain.
    """

    min_size: int = 4096
    energy: float = 0.9
    max_rank: int | None = 128
    min_gain: float = 0.1
    flops_per_gain: float = 4096.0

    def __post_init__(self):
        if not 0.0 < self.energy <= 1.0:
            raise ValueError(f"energy must be in (0, 1], got {self.energy}")
        if self.max_rank is not None and self.max_rank < 1:
            raise ValueError(f"max_rank must be >= 1 or None, got {self.max_rank}")
        if self.min_size < 0 or self.flops_per_gain < 0:
            raise ValueError("min_size and flops_per_gain must be >= 0")

    def side_choice(self, spec: Spectrum):
        """'full' or the rank k for one factor's side."""
        k = rank_for_energy(spec.values, self.energy)
        if self.max_rank is not None:
            k = min(k, self.max_rank)
        k = max(k, 1)
        return "full" if 2 * k >= spec.dim else k

    def decide(self, seg, spec_g: Spectrum | None, spec_a: Spectrum | None, damping: float) -> SegmentTransform:
        """The transform of one segment under this policy (identity or whitening)."""
        if spec_g is None or spec_a is None:
            return identity_transform(seg, "no factors")
        if seg.ndim < 2:
            return identity_transform(seg, "not a matrix")
        if seg.size < self.min_size:
            return identity_transform(seg, f"small (< {self.min_size})")
        t = kfac_transform(seg, spec_g, spec_a, self.side_choice(spec_g), self.side_choice(spec_a), damping)
        gain = 1.0 - t.info["predicted"]
        fpe = t.flops() / max(seg.size, 1)
        if gain < self.min_gain:
            return _rejected(seg, t, f"gain {gain:.2f} < {self.min_gain}")
        if fpe > gain * self.flops_per_gain:
            return _rejected(seg, t, f"{fpe:.0f} flop/elem > gain {gain:.2f} x {self.flops_per_gain:g}")
        t.info["note"] = f"gain {gain:.2f}"
        return t


def _rejected(seg, t: SegmentTransform, why: str) -> SegmentTransform:
    out = identity_transform(seg, f"identity: {why}")
    out.info.update(anisotropy=t.info["anisotropy"], cond=t.info["cond"], rejected_predicted=t.info["predicted"])
    return out


def select(layout, factors: Mapping, policy: SelectivePolicy | None = None, damping: float = 1e-3) -> Geometry:
    """Build a Geometry choosing per segment identity / low-rank / full whitening by ``policy``.

    layout, factors, damping: as for ``Geometry.from_kfac``. policy: a SelectivePolicy
    (default settings when None).
    """
    layout = as_layout(layout)
    damping = _check_damping(damping)
    policy = policy or SelectivePolicy()
    spectra = spectra_from_factors(layout, factors)
    ts = [policy.decide(seg, *spectra.get(seg.name, (None, None)), damping) for seg in layout]
    return Geometry(layout, ts)
