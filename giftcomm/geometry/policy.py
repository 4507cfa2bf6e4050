"""Selective policy: which segments to transform, and with which ranks.

Two rules. The default (``budget="auto"`` -> 0.1) is the time budget described last; the
per-segment rule (``budget=None``, or an explicit ``flops_per_gain``) goes per segment, in order
(docs/method.md gives the reasons):

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

With a time budget (``budget``, a fraction of the FP8 collective's predicted time, 0.1 by
default; see ``SelectivePolicy.budgeted``) steps 2-4 are replaced by a choice over the whole buffer: every
eligible segment offers candidates (the step-2 choice, smaller ranks, one-sided variants), each
with a predicted gain ``w_s (1 - r^2)`` (``w_s`` = elements x anisotropy out x anisotropy in,
the segment's predicted Euclidean whitened squared error) and a predicted time
(``TransformTimeModel``); the candidates are picked greedily by gain per second along each
segment's convex hull (the LP relaxation of the multiple-choice knapsack) until the budget is
spent. docs/method.md, section 4, gives the reasons.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

import numpy as np

from .geometry import DEFAULT_DAMPING, Geometry, check_damping, spectra_from_factors
from .layout import as_layout
from .spectral import Spectrum, anisotropy, damped, lowrank_damped, rank_for_energy, side_error_factor
from .transform import SegmentTransform, SideChoice, identity_transform, kfac_transform

__all__ = ["SelectivePolicy", "TransformTimeModel", "select", "collective_seconds"]


@dataclass(frozen=True)
class TransformTimeModel:
    """Predicted seconds of forward + inverse of segment transforms on some machine.

    One transformed segment of ``e`` elements: ``passes * e * s(e) + flops / flops_per_second +
    seconds_per_segment``, where ``s(e)`` is ``seconds_per_pass`` for segments of at most
    ``cache_elements`` and ``seconds_per_pass_large`` above. A pass is one read or one write of
    the segment at copy speed (a copy is 2 passes); ``passes`` is the cost of the implementation
    (``giftcomm/geometry/apply.py``), forward and inverse together, output write included, in
    those units, fitted to measurements rather than counted: two-sided and left-only low rank
    ``FUSED_PASSES`` = 16 (nominal memory traffic 6: per direction one read for ``X U_R`` /
    ``U_L^T X``, one read and one write for the rank-(k_L + k_R) update; the rest is the skinny
    GEMMs running below memory bandwidth), right-only low rank ``RIGHT_ONLY_PASSES`` = 14 (one
    sweep per direction, nominal 4); the side-by-side path (diagonal, Hadamard, dense, mixes)
    the per-side ``PASSES`` plus ``SIDES_OUTPUT_PASSES``. A non-identity geometry also copies
    every identity segment into its output (``copy_seconds``: ``COPY_PASSES`` = 3, nominally 2).
    Every rate is the large one when the whole buffer exceeds ``cache_elements`` (its segments
    come from memory, however small). ``seconds_per_segment``: the call overhead of one
    segment's forward + inverse. ``fresh_output_seconds``: per element of the buffer, the extra
    cost of forward and inverse each writing a fresh output array (page faults, and the inverse's
    copies of identity segments: ~1.2e-9 on the development VM, which has no transparent huge
    pages); the default 0 models the call pattern
    ``forward(x, out=workspace)``, ``inverse(result, out=result)`` (a reused buffer, an in-place
    inverse that skips the identity segments). Defaults: least-squares fit on the 2-core
    development VM (fp32, one BLAS thread, that call pattern) with a margin of ~1.1-1.3
    (perf/results/gift-cost.md; ``python -m studies fidelity cost`` prints a fit); refit
    for other machines (a GPU is 2-3 orders of magnitude faster).
    """

    seconds_per_pass: float = 0.05e-9
    seconds_per_pass_large: float = 0.11e-9
    cache_elements: int = 1 << 20
    flops_per_second: float = 60e9
    seconds_per_segment: float = 10e-6
    fresh_output_seconds: float = 0.0

    # side-by-side path, per side (a copy's read or write = 1 pass; fitted, not nominal)
    PASSES = {"identity": 0, "diagonal": 6, "lowrank": 36, "full": 12, "hadamard": 48}
    SIDES_OUTPUT_PASSES = 6
    COPY_PASSES = 3         # an identity segment's copy from memory (nominal 2: read + write)
    FUSED_PASSES = 16       # two-sided or left-only low rank (nominal memory traffic: 6)
    RIGHT_ONLY_PASSES = 14  # right-only low rank, one sweep per direction (nominal: 4)

    def passes(self, left_kind: str, right_kind: str) -> int:
        """Element passes of forward + inverse of one segment, the output write included."""
        kinds = {left_kind, right_kind}
        if kinds <= {"lowrank", "identity"} and "lowrank" in kinds:
            return self.RIGHT_ONLY_PASSES if left_kind == "identity" else self.FUSED_PASSES
        return self.PASSES.get(left_kind, 12) + self.PASSES.get(right_kind, 12) + self.SIDES_OUTPUT_PASSES

    def pass_seconds(self, elements: int, buffer_elements: int = 0) -> float:
        """Seconds of one element-wise sweep over a segment of ``elements`` values in a buffer of
        ``buffer_elements``: at the large rate when either exceeds the cache (a segment of a
        large buffer comes from memory however small it is)."""
        big = max(elements, buffer_elements) > self.cache_elements
        return elements * (self.seconds_per_pass_large if big else self.seconds_per_pass)

    def seconds(self, elements: int, flops: float, left_kind: str, right_kind: str,
                buffer_elements: int = 0) -> float:
        """Seconds of forward + inverse of a transformed segment of ``elements`` values and
        ``flops`` flops (output write included) in a buffer of ``buffer_elements``."""
        return (self.passes(left_kind, right_kind) * self.pass_seconds(elements, buffer_elements)
                + flops / self.flops_per_second + self.seconds_per_segment)

    def copy_seconds(self, elements: int, buffer_elements: int = 0) -> float:
        """Seconds of copying an identity segment into the output (forward; the in-place inverse
        skips it): ``COPY_PASSES`` passes."""
        return self.COPY_PASSES * self.pass_seconds(elements, buffer_elements)

    def transform_seconds(self, t: SegmentTransform, buffer_elements: int = 0) -> float:
        """Predicted seconds of one built transform in a non-identity geometry (the copy for an
        identity segment)."""
        if t.is_identity:
            return self.copy_seconds(t.segment.size, buffer_elements)
        return self.seconds(t.segment.size, t.flops(), t.left.kind, t.right.kind, buffer_elements)

    def geometry_seconds(self, geo) -> float:
        """Predicted seconds of forward + inverse of a whole Geometry: 0 when it is the identity
        (gift_allreduce then skips it), else every transform plus the copies of the others."""
        if geo.is_identity:
            return 0.0
        return self.fresh_output_seconds * geo.size + sum(self.transform_seconds(t, geo.size) for t in geo.transforms)


DEFAULT_BUDGET = 0.1            # fraction of the FP8 collective's predicted wire time (P = 4, 1 Gbit/s)
DEFAULT_FLOPS_PER_GAIN = 4096.0  # the per-segment rule's exchange rate (flops per element for a gain of 1)


def collective_seconds(n: int, ranks: int, bandwidth: float, bytes_per_value: float = 1.015625) -> float:
    """Wire time of a ring allreduce of ``n`` values: ``2 (P-1)/P * n * bytes_per_value / bandwidth``
    (seconds; bandwidth in bytes/s per link; 0 for one rank)."""
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * n * bytes_per_value / bandwidth


@dataclass(frozen=True)
class SelectivePolicy:
    """Settings of the selective policy (see the module doc for the rule).

    min_size: segments with fewer elements stay identity (elements).
    energy: fraction of a factor's trace the kept eigenpairs must hold (0 < energy <= 1).
    max_rank: cap on k per side (None: no cap).
    min_gain: least predicted relative error reduction ``1 - r`` worth a transform.
    flops_per_gain: flops per element one is willing to spend for a gain of 1.0 (all error
      removed); the transform is kept when its flops per element <= gain * flops_per_gain.
      None: 4096. Not used when ``budget`` is set; giving it explicitly selects the per-segment
      rule when ``budget`` is "auto".
    budget: "auto" (the default: 0.1, or None when ``flops_per_gain`` is given), None
      (per-segment rule above), or the fraction of the collective's predicted wire time
      (``collective_seconds(layout.size, ranks, bandwidth, wire_bytes_per_value)``) that
      forward + inverse of all segments together may take, by ``time_model``.
    ranks, bandwidth (bytes/s per link), wire_bytes_per_value: the collective the budget is
      relative to (defaults: P = 4 at 1 Gbit/s, E4M3 with 256-value blocks).
    time_model: predicted transform time on the machine that runs it.
    rank_rule: "utility" (default): per side the candidates are the identity, the ``energy``
      rank, the powers of two up to ``max_rank`` and the full side (when ``2 max_rank >= d``);
      the pair with the largest ``gain - flops_per_element / flops_per_gain`` is taken.
      "energy": both sides at the ``energy`` rank (``side_choice``), the rule before the
      fidelity study (docs/method.md section 4a says why it changed).
    """

    min_size: int = 4096
    energy: float = 0.9
    max_rank: int | None = 128
    min_gain: float = 0.1
    flops_per_gain: float | None = None
    budget: float | None | str = "auto"
    ranks: int = 4
    bandwidth: float = 125e6
    wire_bytes_per_value: float = 1.015625
    time_model: TransformTimeModel = field(default_factory=TransformTimeModel)
    rank_rule: str = "utility"

    @classmethod
    def budgeted(cls, fraction: float = 0.1, ranks: int = 4, bandwidth: float = 125e6,
                 time_model: TransformTimeModel | None = None, **kw) -> SelectivePolicy:
        """The budget-aware policy: transforms take at most ``fraction`` of the predicted wire
        time of the FP8 ring allreduce at ``ranks`` ranks and ``bandwidth`` bytes/s per link
        (default 10% at P = 4, 1 Gbit/s), by ``time_model`` (default: the development CPU)."""
        return cls(budget=fraction, ranks=ranks, bandwidth=bandwidth,
                   time_model=time_model or TransformTimeModel(), **kw)

    def __post_init__(self):
        # "auto": the time budget DEFAULT_BUDGET, unless an exchange rate flops_per_gain is given
        # (then the per-segment rule); flops_per_gain None means DEFAULT_FLOPS_PER_GAIN
        budget = self.budget
        if isinstance(budget, str):
            if budget != "auto":
                raise ValueError(f"budget must be None, a number >= 0 or 'auto', got {budget!r}")
            budget = None if self.flops_per_gain is not None else DEFAULT_BUDGET
            object.__setattr__(self, "budget", budget)
        rate = self.flops_per_gain
        if rate is None:
            rate = DEFAULT_FLOPS_PER_GAIN
            object.__setattr__(self, "flops_per_gain", rate)
        if not 0.0 < self.energy <= 1.0:
            raise ValueError(f"energy must be in (0, 1], got {self.energy}")
        if self.max_rank is not None and self.max_rank < 1:
            raise ValueError(f"max_rank must be >= 1 or None, got {self.max_rank}")
        if self.min_size < 0 or rate < 0:
            raise ValueError("min_size and flops_per_gain must be >= 0")
        if budget is not None and not budget >= 0:
            raise ValueError(f"budget must be None or >= 0, got {budget}")
        if self.ranks < 1 or not self.bandwidth > 0 or not self.wire_bytes_per_value > 0:
            raise ValueError("ranks must be >= 1, bandwidth and wire_bytes_per_value > 0")
        if self.rank_rule not in ("utility", "energy"):
            raise ValueError(f"rank_rule must be 'utility' or 'energy', got {self.rank_rule!r}")

    def side_choice(self, spec: Spectrum) -> SideChoice:
        """'full' or the rank k for one factor's side."""
        k = rank_for_energy(spec.values, self.energy)
        if self.max_rank is not None:
            k = min(k, self.max_rank)
        k = max(k, 1)
        return "full" if 2 * k >= spec.dim else k

    def eligible(self, seg, spec_g: Spectrum | None, spec_a: Spectrum | None) -> str | None:
        """None when the segment may be transformed, else why not (the identity's note)."""
        if spec_g is None or spec_a is None:
            return "no factors"
        if seg.ndim < 2:
            return "not a matrix"
        if seg.size < self.min_size:
            return f"small (< {self.min_size})"
        return None

    def decide(self, seg, spec_g: Spectrum | None, spec_a: Spectrum | None, damping: float) -> SegmentTransform:
        """The transform of one segment under the per-segment rule (identity or whitening);
        ``budget`` is applied over the whole buffer by ``select``."""
        why = self.eligible(seg, spec_g, spec_a)
        if why is not None:
            return identity_transform(seg, why)
        assert spec_g is not None and spec_a is not None  # eligible() checked
        if self.rank_rule == "energy":
            cg, ca = self.side_choice(spec_g), self.side_choice(spec_a)
        else:
            cg, ca = self._best_pair(seg, spec_g, spec_a, damping)
        t = kfac_transform(seg, spec_g, spec_a, cg, ca, damping)
        gain = 1.0 - t.info["predicted"]
        fpe = t.flops() / max(seg.size, 1)
        if gain < self.min_gain:
            return _rejected(seg, t, f"gain {gain:.2f} < {self.min_gain}")
        if fpe > gain * self.flops_per_gain:
            return _rejected(seg, t, f"{fpe:.0f} flop/elem > gain {gain:.2f} x {self.flops_per_gain:g}")
        t.info["note"] = f"gain {gain:.2f}"
        return t

    def side_options(self, spec: Spectrum, damping: float) -> list[tuple[SideChoice, float, float, str]]:
        """Candidate choices of one side: (choice, predicted side error factor, flops per
        column, side kind), for choice None (identity), ranks k (the ``energy`` rank and powers
        of two up to ``max_rank``, each with ``2k < d``) and "full" (when ``2 max_rank >= d``)."""
        d = spec.dim
        p = damped(spec.values, damping)
        cap = d if self.max_rank is None else min(self.max_rank, d)
        ks = {min(max(rank_for_energy(spec.values, self.energy), 1), cap)}
        k = 1
        while k <= cap:
            ks.add(k)
            k *= 2
        out: list[tuple[SideChoice, float, float, str]] = [(None, 1.0, 0.0, "identity")]
        for k in sorted(ks):
            if 2 * k < d:
                q = lowrank_damped(spec.values, k, damping)
                out.append((k, side_error_factor(p, q), 4.0 * d * k + 2.0 * d + k, "lowrank"))
        if 2 * cap >= d:
            out.append(("full", side_error_factor(p, p), 2.0 * d * d, "full"))
        return out

    def _best_pair(self, seg, spec_g: Spectrum, spec_a: Spectrum, damping: float) -> tuple[SideChoice, SideChoice]:
        """(choice G, choice A) maximising ``gain - flops per element / flops_per_gain``."""
        m, n = seg.matrix_shape
        rate = cast(float, self.flops_per_gain)  # a number: __post_init__ replaced None
        best: tuple[SideChoice, SideChoice] = (None, None)
        best_u = -np.inf
        opts_a = self.side_options(spec_a, damping)
        for cg, eg, fg, _ in self.side_options(spec_g, damping):
            for ca, ea, fa, _ in opts_a:
                if cg is None and ca is None:
                    continue
                fpe = 2.0 * (fg / m + fa / n)
                u = (1.0 - np.sqrt(eg * ea)) - (fpe / rate if rate > 0 else np.inf)
                if u > best_u:
                    best, best_u = (cg, ca), u
        return best


def _rejected(seg, t: SegmentTransform, why: str) -> SegmentTransform:
    out = identity_transform(seg, f"identity: {why}")
    out.info.update(anisotropy=t.info["anisotropy"], cond=t.info["cond"], rejected_predicted=t.info["predicted"])
    return out


def select(layout, factors: Mapping, policy: SelectivePolicy | None = None, damping: float = DEFAULT_DAMPING) -> Geometry:
    """Build a Geometry choosing per segment identity / low-rank / full whitening by ``policy``.

    layout, factors, damping: as for ``Geometry.from_kfac``. policy: a SelectivePolicy
    (default settings when None).
    """
    layout = as_layout(layout)
    damping = check_damping(damping)
    policy = policy or SelectivePolicy()
    spectra = spectra_from_factors(layout, factors)
    if policy.budget is not None:
        return Geometry(layout, _select_budgeted(layout, spectra, policy, damping))
    ts = []
    for seg in layout:
        spec_g, spec_a = spectra.get(seg.name, (None, None))
        ts.append(policy.decide(seg, spec_g, spec_a, damping))
    return Geometry(layout, ts)


# ---------------------------------------------------------------------------- budgeted selection
_Payload = TypeVar("_Payload")


def _hull(points: Sequence[tuple[float, float, _Payload]]) -> list[tuple[float, float, _Payload | None]]:
    """Upper concave hull of (cost, gain, payload) points from (0, 0, None): increasing cost,
    increasing gain, decreasing gain per cost between consecutive points."""
    pts = sorted(((c, g, x) for c, g, x in points if g > 0 and c > 0), key=lambda t: (t[0], -t[1]))
    hull: list[tuple[float, float, _Payload | None]] = [(0.0, 0.0, None)]
    for c, g, x in pts:
        if g <= hull[-1][1]:
            continue
        while len(hull) >= 2:
            (c1, g1, _), (c2, g2, _) = hull[-2], hull[-1]
            # drop the last point if it lies on or below the segment from hull[-2] to (c, g)
            if (g2 - g1) * (c - c1) <= (g - g1) * (c2 - c1):
                hull.pop()
            else:
                break
        hull.append((c, g, x))
    return hull


def _select_budgeted(layout, spectra: Mapping[str, tuple[Spectrum, Spectrum]], policy: SelectivePolicy,
                     damping: float) -> list[SegmentTransform]:
    """Per segment the chosen transform under ``policy.budget`` (see the module doc)."""
    tm = policy.time_model
    fraction = cast(float, policy.budget)  # a number: select() checked None, __post_init__ replaced "auto"
    budget = fraction * collective_seconds(layout.size, policy.ranks, policy.bandwidth, policy.wire_bytes_per_value)
    # a non-identity geometry fills a fresh output buffer: the copy of every segment is a fixed
    # cost; a transformed segment costs its transform instead of its copy
    fixed = tm.fresh_output_seconds * layout.size + sum(tm.copy_seconds(seg.size, layout.size) for seg in layout)
    notes: dict[str, str] = {}
    hulls: dict[str, list] = {}
    for seg in layout:
        spec_g, spec_a = spectra.get(seg.name, (None, None))
        why = policy.eligible(seg, spec_g, spec_a)
        if why is not None:
            notes[seg.name] = why
            continue
        assert spec_g is not None and spec_a is not None  # eligible() checked
        m, n = seg.matrix_shape
        pg, pa = damped(spec_g.values, damping), damped(spec_a.values, damping)
        weight = seg.size * anisotropy(pg) * anisotropy(pa)
        cands = []
        opts_a = policy.side_options(spec_a, damping)
        for cg, eg, fg, kg in policy.side_options(spec_g, damping):
            for ca, ea, fa, ka in opts_a:
                if cg is None and ca is None:
                    continue
                r2 = eg * ea
                if 1.0 - np.sqrt(r2) < policy.min_gain:
                    continue
                secs = tm.seconds(seg.size, 2.0 * (fg * n + fa * m), kg, ka, layout.size) \
                    - tm.copy_seconds(seg.size, layout.size)
                cands.append((secs, weight * (1.0 - r2), (cg, ca)))
        hulls[seg.name] = _hull(cands)
        if len(hulls[seg.name]) == 1:
            notes[seg.name] = f"identity: gain < {policy.min_gain}"
    # increments along each hull, best gain per second first; a segment's increments are taken
    # in order (their efficiency decreases along the hull)
    steps = []
    for name, hull in hulls.items():
        for j in range(1, len(hull)):
            dc, dg = hull[j][0] - hull[j - 1][0], hull[j][1] - hull[j - 1][1]
            steps.append((-dg / dc, name, j, dc))
    steps.sort(key=lambda s: (s[0], s[1], s[2]))
    level = {name: 0 for name in hulls}
    spent = fixed
    for _, name, j, dc in steps:
        if level[name] == j - 1 and spent + dc <= budget:
            level[name] = j
            spent += dc
    out = []
    for seg in layout:
        name = seg.name
        if name in notes and level.get(name, 0) == 0:
            out.append(identity_transform(seg, notes[name]))
            continue
        if level.get(name, 0) == 0:
            why = "over the time budget" if fixed < budget else \
                f"the buffer copies alone ({fixed * 1e3:.3g} ms) exceed the budget"
            out.append(identity_transform(seg, f"identity: {why}"))
            continue
        cg, ca = hulls[name][level[name]][2]
        spec_g, spec_a = spectra[name]
        t = kfac_transform(seg, spec_g, spec_a, cg, ca, damping)
        t.info["note"] = (f"gain {1 - t.info['predicted']:.2f}, {tm.transform_seconds(t, layout.size) * 1e3:.3g} ms "
                          f"of the {budget * 1e3:.3g} ms budget")
        out.append(t)
    return out
