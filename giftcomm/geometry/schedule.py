"""GIFT's schedule: one frozen, validated record of when and how the adapters build and use a
geometry, taken whole by every adapter (``schedule=``), the way FSDP takes its
MixedPrecisionPolicy.

:class:`GiftSchedule` holds the geometry kind, the warm-up, the estimate and refresh cadence, the
damping and selective policy, the paper preset's settings and the error feedback; each knob is
validated in ``__post_init__`` (ValueError/TypeError naming it). What is reduced and how (the wire
format, block, rounding, ...) is the call options' (:class:`giftcomm.options.CallOptions`);
what the adapter is bound to (the model, the capture, the transports) stays the adapter's own.

:func:`schedule_of` is the one converter of the adapters' keywords of the previous release
(``refresh_every=``, ``error_feedback=``, ...) into a record, with a DeprecationWarning naming
the replacement.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from ..options import DEFAULT_DAMPING
from .paper import PaperOptions
from .policy import SelectivePolicy

__all__ = ["GiftSchedule", "GEOMETRIES", "FEEDBACK", "SCHEDULE_NAMES", "schedule_of"]

GEOMETRIES = ("none", "reduced", "kfac", "paper")
"""The geometry kinds: "none" (the wire format in plain coordinates), "reduced" (factors estimated
from the reduced gradients, no communication), "kfac" (KFAC factors captured from the model's
nn.Linear layers, averaged over the group), "paper" (the GIFT paper's preset,
giftcomm.geometry.paper). Each adapter takes the kinds it implements (docs/adapters.md)."""

FEEDBACK = ("ordinary", "transformed", "transformed-kept")
"""Where error-feedback residuals live: gradient coordinates (giftcomm.collectives.feedback.ErrorFeedback),
the geometry's coordinates re-expressed at a refresh, or not re-expressed (TransformedFeedback)."""


def _int_at_least(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"GiftSchedule: {name} must be an int >= {least}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class GiftSchedule:
    """When and how an adapter builds and uses GIFT geometries (validated when built).

    geometry (default "none"): one of :data:`GEOMETRIES`.
    warmup (default 0): steps (DDP iterations, FSDP reduce-scatter calls) reduced first by the framework's
    own uncompressed collective (counted as "native", fallback reason "warmup"); int >= 0.
    estimate_every (default 10): steps between updates of the reduced-gradient estimator ("reduced"); int >= 1.
    refresh_every (default 100): steps between geometry rebuilds ("reduced", "kfac"); int >= 1. With
    geometry="paper" the cadence is ``paper.refresh_every`` (:attr:`refresh_period`).
    rebuild_lag (default 10): steps a rebuild may take on the DDP hook's geometry thread before every rank
    adopts it; int >= 0.
    decay (default 0.95): the reduced-gradient estimator's EMA decay per update, in [0, 1).
    policy (default None): the selective policy choosing which segments to transform (None means
    SelectivePolicy()).
    damping: the geometries' damping delta, relative to each factor's mean eigenvalue
    (dimensionless, finite, >= 0; default giftcomm.options.DEFAULT_DAMPING).
    paper (default None): the paper preset's settings with geometry="paper" (a PaperOptions or a dict of its
    fields; None: the paper's defaults); ValueError with another geometry.
    error_feedback (default False): keep what this rank's own encoding lost and add it to the next step's
    gradient (giftcomm.collectives.feedback; the adapter checks that the wire format is block-scaled).
    feedback (default None): where the residuals live (:data:`FEEDBACK`; None: the adapter's rule, "transformed"
    with geometry="paper" -- "transformed-kept" when ``paper.reexpress`` is False -- else
    "ordinary"); used only with error_feedback=True.
    """

    geometry: str = "none"
    warmup: int = 0
    estimate_every: int = 10
    refresh_every: int = 100
    rebuild_lag: int = 10
    decay: float = 0.95
    policy: SelectivePolicy | None = None
    damping: float = DEFAULT_DAMPING
    paper: PaperOptions | None = None
    error_feedback: bool = False
    feedback: str | None = None

    def __post_init__(self) -> None:
        if self.geometry not in GEOMETRIES:
            raise ValueError(f"GiftSchedule: geometry must be one of {GEOMETRIES}, got {self.geometry!r}")
        set_ = object.__setattr__
        set_(self, "warmup", _int_at_least("warmup", self.warmup, 0))
        set_(self, "estimate_every", _int_at_least("estimate_every", self.estimate_every, 1))
        set_(self, "refresh_every", _int_at_least("refresh_every", self.refresh_every, 1))
        set_(self, "rebuild_lag", _int_at_least("rebuild_lag", self.rebuild_lag, 0))
        d = self.damping
        if isinstance(d, bool) or not isinstance(d, (int, float, np.floating)) or not (np.isfinite(d) and d >= 0):
            raise ValueError(f"GiftSchedule: damping must be a finite number >= 0, got {d!r}")
        set_(self, "damping", float(d))
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not 0.0 <= self.decay < 1.0:
            raise ValueError(f"GiftSchedule: decay must be in [0, 1), got {self.decay!r}")
        if self.policy is None:
            set_(self, "policy", SelectivePolicy())
        elif not isinstance(self.policy, SelectivePolicy):
            raise TypeError(f"GiftSchedule: policy must be a SelectivePolicy, got {type(self.policy).__name__}")
        paper = self.paper
        if paper is not None and self.geometry != "paper":
            raise ValueError(f'GiftSchedule: paper= goes with geometry="paper" only (geometry is {self.geometry!r})')
        if isinstance(paper, Mapping):
            try:
                paper = PaperOptions.of(None, **dict(paper))
            except TypeError as exc:
                raise TypeError(f"GiftSchedule: {exc}") from None
        elif paper is not None and not isinstance(paper, PaperOptions):
            raise TypeError(f"GiftSchedule: paper must be None, a PaperOptions or a dict of its fields, "
                            f"got {type(paper).__name__}")
        set_(self, "paper", paper if paper is not None or self.geometry != "paper" else PaperOptions())
        if not isinstance(self.error_feedback, (bool, np.bool_)):
            raise TypeError(f"GiftSchedule: error_feedback must be a bool, got {self.error_feedback!r}")
        set_(self, "error_feedback", bool(self.error_feedback))
        if self.feedback is not None and self.feedback not in FEEDBACK:
            raise ValueError(f"GiftSchedule: feedback must be None or one of {FEEDBACK}, got {self.feedback!r}")

    @property
    def refresh_period(self) -> int:
        """Steps between geometry rebuilds: ``paper.refresh_every`` with geometry="paper", else
        ``refresh_every``."""
        return self.paper.refresh_every if self.paper is not None else self.refresh_every

    @property
    def feedback_kind(self) -> str:
        """Where the residuals live (:data:`FEEDBACK`): ``feedback``, or the rule of its None."""
        if self.feedback is not None:
            return self.feedback
        if self.paper is None:
            return "ordinary"
        return "transformed" if self.paper.reexpress else "transformed-kept"

    def replace(self, **changes: Any) -> GiftSchedule:
        """A validated copy with ``changes``."""
        return replace(self, **changes)

    def check_for(self, owner: str, geometries: tuple[str, ...], uses: tuple[str, ...]) -> GiftSchedule:
        """This record, after checking that ``owner`` implements its geometry (one of
        ``geometries``) and that every knob it does not read (not in ``uses``) is at its default:
        ValueError naming the owner and the knob otherwise (a knob is never silently ignored)."""
        if self.geometry not in geometries:
            raise ValueError(f"{owner}: schedule.geometry must be one of {geometries}, got {self.geometry!r}")
        for f in fields(self):
            if f.name in uses or f.name in ("geometry", "paper", "policy"):
                continue
            if getattr(self, f.name) != f.default:
                raise ValueError(f"{owner}: schedule.{f.name} is not used here (it takes {', '.join(uses)}); "
                                 f"got {getattr(self, f.name)!r}")
        if "policy" not in uses and self.policy != SelectivePolicy():
            raise ValueError(f"{owner}: schedule.policy is not used here")
        return self


SCHEDULE_NAMES: tuple[str, ...] = tuple(f.name for f in fields(GiftSchedule))
"""The schedule's knobs (the adapters' keywords of the previous release, bar renames)."""


def schedule_of(owner: str, schedule: GiftSchedule | None, given: MutableMapping[str, Any],
                default: GiftSchedule, renamed: Mapping[str, str] | None = None) -> GiftSchedule:
    """The one :class:`GiftSchedule` of an adapter's constructor: ``schedule``, or ``default``
    (the adapter's own) with the knobs of the previous release's keywords found in ``given``.

    given: the constructor's remaining keywords; the schedule knobs among them (their names in
    :data:`SCHEDULE_NAMES`, or a key of ``renamed``, e.g. {"start_gift_iter": "warmup"}) are
    taken out of it, and a DeprecationWarning names the replacement (``schedule=
    giftcomm.GiftSchedule(...)``). A ``geometry=None`` keyword means "none". Raises TypeError
    when ``schedule`` is no GiftSchedule or is given beside such keywords, ValueError/TypeError
    (prefixed with ``owner``) for a bad knob."""
    renamed = renamed or {}
    old = {k: given.pop(k) for k in [k for k in given if k in SCHEDULE_NAMES or k in renamed]}
    if schedule is not None and not isinstance(schedule, GiftSchedule):
        raise TypeError(f"{owner}: schedule must be a giftcomm.GiftSchedule, got {type(schedule).__name__}")
    if not old:
        return default if schedule is None else schedule
    knobs = {renamed.get(k, k): v for k, v in old.items()}
    if knobs.get("geometry", "none") is None:
        knobs["geometry"] = "none"
    if schedule is not None:
        raise TypeError(f"{owner}: give schedule= or the keyword(s) {', '.join(old)}, not both")
    warnings.warn(f"{owner}: the keyword(s) {', '.join(old)} are deprecated; pass schedule=giftcomm.GiftSchedule("
                  f"{', '.join(f'{k}=...' for k in knobs)}) instead", DeprecationWarning, stacklevel=3)
    try:
        return replace(default, **knobs)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{owner}: {exc}") from None
