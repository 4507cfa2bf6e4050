"""giftcomm's environment variables: one table, one parser.

Every ``GIFTCOMM_*`` variable the library reads is declared in :data:`VARIABLES` (name, kind,
default, meaning) and read through :func:`flag`, :func:`choice`, :func:`number` or :func:`path`,
which all parse alike: surrounding blanks are ignored, booleans accept 1/0, on/off, true/false,
yes/no (any case), and a value that does not parse raises ValueError naming the variable (a typo
must not silently mean "on"). docs/api.md lists the same table.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["Variable", "VARIABLES", "flag", "cached_flag", "choice", "number", "path", "raw"]


@dataclass(frozen=True)
class Variable:
    """One environment variable. kind: "flag", "choice", "number", "path" or "text" (read with
    :func:`raw`); default: the value
    used when it is unset or empty (None: no default); choices: allowed values of a "choice"."""

    name: str
    kind: str
    default: str | None
    meaning: str
    choices: tuple[str, ...] = ()


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("GIFTCOMM_NATIVE", "flag", "1", "use the native C codec kernels when built (0: the NumPy reference)"),
    Variable("GIFTCOMM_NATIVE_ISA", "choice", None, "force a native kernel variant (tests and benchmarks)",
             ("avx512vbmi", "avx512", "avx2", "generic")),
    Variable("GIFTCOMM_SHARED_MEMORY", "flag", "1",
             "zero-copy allreduce through an MPI shared window when every rank is on one node"),
    Variable("GIFTCOMM_CUDA_AWARE_MPI", "choice", "auto",
             "whether the MPI library takes device pointers (auto: ask the library)", ("auto", "0", "1")),
    Variable("GIFTCOMM_CALIBRATION", "path", None,
             "the cost model's calibration file (default: $XDG_CACHE_HOME/giftcomm/calibration.json)"),
    Variable("GIFTCOMM_NETBED_RATE", "text", None,
             "the link rate of a netbed run (set by python -m studies netbed; labels benchmark output)"),
    Variable("GIFTCOMM_TIMEOUT", "number", "600",
             "seconds a blocking wait (message, agreement, shared-window fence, communicator creation) waits "
             "for its peers before the GIFTCOMM_ON_TIMEOUT policy applies (0: wait for ever)"),
    Variable("GIFTCOMM_ON_TIMEOUT", "choice", "abort",
             "what a wait past its deadline does: abort (print the error and MPI_Abort the job, so mpiexec "
             "returns) or raise (CommTimeout, a TimeoutError; the transport is unusable afterwards)",
             ("abort", "raise")),
)}

_TRUE, _FALSE = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def raw(name: str) -> str | None:
    """The variable's value with blanks stripped, its default when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or VARIABLES[name].default


def flag(name: str) -> bool:
    """A boolean variable."""
    value = (raw(name) or "").lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ.get(name)!r} is not a boolean: use one of {', '.join(_TRUE + _FALSE)}")


RECHECK_S = 1.0
"""Per-call paths read a variable at most this often (seconds); see :func:`cached_flag`."""
_flags: dict[str, tuple[float, bool]] = {}


def cached_flag(name: str) -> bool:
    """:func:`flag` for per-call paths: read and parsed at most once every :data:`RECHECK_S`
    seconds, the last answer in between (one clock read), so a change made while the program
    runs takes effect within a second."""
    now = time.monotonic()
    seen = _flags.get(name)
    if seen is None or now - seen[0] >= RECHECK_S:
        seen = _flags[name] = (now, flag(name))
    return seen[1]


def choice(name: str) -> str | None:
    """A variable with a fixed set of values (None when unset without a default)."""
    value = raw(name)
    allowed = VARIABLES[name].choices
    if value is not None and value.lower() not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return None if value is None else value.lower()


def number(name: str) -> float:
    """A non-negative finite number."""
    value = raw(name)
    try:
        x = float(value or "")  # unset: not a number either
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a number") from None
    if not (x >= 0 and x != float("inf")):
        raise ValueError(f"{name}={value!r} must be a finite number >= 0")
    return x


def path(name: str) -> str | None:
    """A file path with ~ expanded (None when unset)."""
    value = raw(name)
    return None if value is None else os.path.expanduser(value)
