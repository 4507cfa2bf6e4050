"""The call options: one validated record shared by every entry point.

:class:`CallOptions` holds what a caller may choose about *how* values are reduced — the wire
format, block, rounding, seed, algorithm, pipelining slice, timeout and op — independently of
*what* is reduced (the array, ``out``, the communicator). The four collectives, persistent
plans, the DDP hook's :class:`~giftcomm.adapters.torch.GiftState`, the FSDP2 comm, ``GradSync``
and the JAX adapter all build one (``CallOptions.of(**kwargs)``) and validate it once against the
format rules, so a bad option fails where it is given, with one message wording for every entry
point. Defaults live here (and :data:`DEFAULT_DAMPING` for the geometries).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from . import algorithms
from .formats import SCALE_RULES, Format, check_key, check_rounding, get_format, resolve_block

__all__ = ["CallOptions", "DEFAULT_DAMPING", "OPS", "OPTION_NAMES", "options_of_call", "Entry", "PLAIN",
           "call_options"]

DEFAULT_DAMPING = 0.03
"""The geometries' damping delta, relative to each factor's mean eigenvalue (docs/method.md)."""

OPS = ("sum", "avg")
"""The reductions giftcomm computes."""


def _positive_int_or_none(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class CallOptions:
    """How one collective call reduces its values (validated: build with :meth:`of`).

    fmt: wire format name (``giftcomm.formats.FORMATS``: "e4m3", "e5m2", "mxfp8", "mxfp8_e5m2",
    "mxfp4", "nvfp4", "bf16", "fp16", "fp32") or a Format (a scale-rule variant sets mx_scale
    unless mx_scale is given too). block: values per scale, None meaning the
    format's own (16 nvfp4, 32 MX, 256 otherwise); after validation :attr:`resolved_block` is
    the int used. rounding: "nearest" or "stochastic" (scaled formats only). seed: int in
    [0, 2**64) identifying the call for stochastic rounding (None: none given yet; an adapter
    derives per-step seeds from it). algorithm: a name of the algorithm table or "auto".
    slice_elems: values per pipelined slice (None: automatic). timeout: seconds each wait may
    wait for its peers (None: the transport's, $GIFTCOMM_TIMEOUT). op: "sum" or "avg".
    mx_scale: the shared-exponent rule of the E8M0-scaled formats (mxfp8, mxfp8_e5m2, mxfp4):
    "ceil" (default: the smallest power of two keeping each block's amax within the element max,
    so nothing saturates) or "floor" (OCP MX v1.0's ``floor(log2(amax)) - emax``, byte-identical
    to other OCP implementations; the top of each block saturates). "floor" with any other format
    is a ValueError (they have no such rule); "ceil" is accepted everywhere and changes nothing
    for them. :attr:`format` carries the rule (Format.scale_rule), and ranks whose rules differ
    fail the cross-rank check.
    allow_native: whether ``algorithm="auto"`` may take the transport's own allreduce (the
    ``native`` row: uncompressed, chosen only where predicted faster than every compressed
    algorithm); False keeps every call on giftcomm's wire format. ``algorithm="native"`` with
    ``allow_native=False`` is a ValueError. Ranks must agree on it.
    """

    fmt: str = "e4m3"
    block: int | None = None
    rounding: str = "nearest"
    seed: int | None = None
    algorithm: str = "auto"
    slice_elems: int | None = None
    timeout: float | None = None
    op: str = "sum"
    mx_scale: str = SCALE_RULES[0]
    allow_native: bool = True

    def __hash__(self) -> int:
        # remembered: the plain calls' plan cache hashes the options on every call (giftcomm.plans.cache)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict[str, Any]:  # a pickle carries no hash (str hashes differ per process)
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_valid")}

    @classmethod
    def of(cls, owner: str = "", **kwargs: Any) -> CallOptions:
        """Build and validate; ``owner`` (e.g. "GiftState") prefixes error messages. Unknown
        keywords raise TypeError naming them."""
        _check_names(owner, kwargs)
        return _owned(owner, lambda: cls(**kwargs).validated())

    def validated(self) -> CallOptions:
        """This record with fmt as its canonical name and every field checked (ValueError or
        TypeError, with the same words whichever entry point called it)."""
        f = get_format(self.fmt)
        mx_scale = self.mx_scale
        if f.scale_rule and mx_scale == SCALE_RULES[0]:  # fmt given as a Format variant: its rule
            mx_scale = f.scale_rule
        f.with_scale_rule(mx_scale)
        resolve_block(f, self.block)
        check_rounding(self.rounding, f)
        seed = None if self.seed is None else check_key(self.seed, "seed")
        if self.op not in OPS:
            raise ValueError(f"op must be 'sum' or 'avg', got {self.op!r}")
        choices = algorithms.CHOICES  # read now: a registered row counts
        if not isinstance(self.algorithm, str) or self.algorithm not in choices:
            raise ValueError(f"algorithm must be one of {', '.join(choices)}; got {self.algorithm!r}")
        if not isinstance(self.allow_native, (bool, np.bool_)):
            raise ValueError(f"allow_native must be True or False, got {self.allow_native!r}")
        if self.algorithm in algorithms.BY_NAME and algorithms.BY_NAME[self.algorithm].native and not self.allow_native:
            raise ValueError("algorithm='native' contradicts allow_native=False")
        slice_elems = _positive_int_or_none(self.slice_elems, "slice_elems")
        timeout = self.timeout
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.floating, np.integer)):
                raise ValueError(f"timeout must be a number of seconds or None, got {timeout!r}")
            timeout = float(timeout)
            if not (timeout >= 0 and np.isfinite(timeout)):
                raise ValueError(f"timeout must be a finite number of seconds >= 0, got {self.timeout!r}")
        done = replace(self, fmt=f.name, block=None if self.block is None else int(self.block), seed=seed,
                       slice_elems=slice_elems, timeout=timeout, mx_scale=mx_scale,
                       allow_native=bool(self.allow_native))
        object.__setattr__(done, "_valid", True)  # options_of_call takes such a record as it is
        return done

    @property
    def format(self) -> Format:
        """The wire format record, with the scale rule ``mx_scale`` (Format.with_scale_rule)."""
        return get_format(self.fmt).with_scale_rule(self.mx_scale)

    @property
    def resolved_block(self) -> int:
        """The block size calls use: ``block`` or the format's own."""
        return resolve_block(self.format, self.block)

    def replace(self, **changes: Any) -> CallOptions:
        """A validated copy with ``changes`` (``giftcomm.allreduce(x, options=o.replace(seed=s))``:
        a validated record with a new seed checks the seed alone)."""
        if self.__dict__.get("_valid") and changes.keys() <= {"seed"}:
            seed = changes.get("seed")
            done = replace(self, seed=None if seed is None else check_key(seed, "seed"))
            object.__setattr__(done, "_valid", True)
            return done
        return replace(self, **changes).validated()


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(CallOptions))
"""The option keywords every entry point takes."""


def _check_names(owner: str, given: Mapping[str, Any]) -> None:
    """TypeError naming the keywords of ``given`` that are no option (the same words everywhere)."""
    unknown = sorted(set(given) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"{owner + ': ' if owner else ''}unknown option(s) {', '.join(unknown)}; "
                        f"options are {', '.join(OPTION_NAMES)}")


def _owned(owner: str, build: Any) -> CallOptions:
    """``build()``, its TypeError/ValueError prefixed with ``owner``."""
    try:
        return build()
    except (TypeError, ValueError) as exc:
        if not owner:
            raise
        raise type(exc)(f"{owner}: {exc}") from None


def options_of_call(owner: str, options: CallOptions | None = None, given: Mapping[str, Any] | None = None,
                    defaults: Mapping[str, Any] | None = None, fixed: tuple[str, ...] = ()) -> CallOptions:
    """The one validated :class:`CallOptions` of an entry point's call -- how every entry point
    takes its options whole: ``f(..., options=None, **given)``.

    owner: the entry point's name, prefixed to error messages ("" for the plain collectives).
    options: a CallOptions record (or None); the option keywords ``given`` replace its fields.
    defaults: the entry point's own defaults where they differ from CallOptions' (e.g. the DDP
    hook's ``op="avg"``), used for the names ``given`` lacks when no record is passed (a record
    is taken whole: its fields are what the caller chose). fixed: names whose value the entry
    point decides itself (e.g. the hook always averages): it takes them only at the value of
    ``defaults`` (ValueError naming the option otherwise). Raises TypeError for a keyword that
    is no option (the words of :meth:`CallOptions.of`) or an ``options`` that is no CallOptions,
    ValueError/TypeError for a bad value, all prefixed with ``owner``.
    """
    given = {} if given is None else given
    _check_names(owner, given)
    if options is None:
        opts = CallOptions.of(owner, **{**defaults, **given}) if defaults else CallOptions.of(owner, **given)
    elif not isinstance(options, CallOptions):
        raise TypeError(f"{owner + ': ' if owner else ''}options must be a giftcomm.options.CallOptions, "
                        f"got {type(options).__name__}")
    elif given:
        opts = _owned(owner, lambda: options.replace(**given))
    else:
        opts = options if options.__dict__.get("_valid") else _owned(owner, options.validated)
    for name in fixed:
        want = (defaults or {}).get(name, getattr(_DEFAULTS, name))
        if getattr(opts, name) != want:
            raise ValueError(f"{owner + ': ' if owner else ''}{name} is {want!r} here (the entry point decides it), "
                             f"got {getattr(opts, name)!r}")
    return opts


_DEFAULTS = CallOptions()


@dataclass(frozen=True, eq=False)
class Entry:
    """How one public entry point takes its options (giftcomm.options.options_of_call): the
    owner its errors name, its own defaults, the names it decides itself."""

    owner: str = ""
    defaults: Mapping[str, Any] | None = None
    fixed: tuple[str, ...] = ()


PLAIN = Entry()
"""allreduce and gift_allreduce: CallOptions' defaults, nothing fixed."""


def call_options(given: Mapping[str, Any], options: Any = None, entry: Entry = PLAIN) -> CallOptions | Exception:
    """``options_of_call`` of a call's ``options`` record and option keywords ``given``, or the
    exception it raised (the agreement step raises it on every rank). A validated record with no
    keywords beside it is taken as it is (the adapters pass ``options=o.replace(seed=s)``)."""
    try:
        return options_of_call(entry.owner, options, given, entry.defaults, entry.fixed)
    except Exception as exc:  # noqa: BLE001 - every rank raises it in the agreement
        return exc
