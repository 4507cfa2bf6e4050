"""Cross-rank agreement on a call's arguments, in one small collective.

Every rank validates its own arguments locally (without raising yet), then all ranks exchange a
short int64 signature: an error code and a fixed list of fields (element count, dtype, format,
block, op, geometry fingerprint...). If any rank failed locally, or a field that must agree
differs, every rank raises the same exception with the same message. No rank is left waiting,
and the communicator stays usable.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import numpy as np

from ..errors import CommAborted
from ..formats import describe_code
from ..transport import Transport
from ..transport.channel import PLAIN_WORD, STALE_WORD, PlanChannel, plain_words

T = TypeVar("T")

_ERROR_TYPES: dict[int, type[Exception]] = {1: TypeError, 2: ValueError, 3: RuntimeError}
_ERROR_CODES = {cls: code for code, cls in _ERROR_TYPES.items()}

DTYPE_CODES = {"float32": 1, "float64": 2, "float16": 3, "bfloat16": 4}
OP_CODES = {"sum": 1, "avg": 2}


def error_code(exc: Exception) -> int:
    """The code an exception travels as in an agreement table (column 0; 0 means success)."""
    return _ERROR_CODES.get(type(exc), 3)


def error_row(exc: Exception, width: int) -> np.ndarray:
    row = np.zeros(width, np.int64)
    row[0] = error_code(exc)
    return row


def raise_failures(transport: Transport, what: str, table: np.ndarray, error: Exception | None) -> None:
    """If any rank's row of ``table`` carries an error code, raise it on every rank (one more
    gather, of the messages; only on this error path)."""
    failed = np.flatnonzero(table[:, 0])
    if failed.size:
        messages = transport.allgather_object(None if error is None else f"{type(error).__name__}: {error}")
        cls = _ERROR_TYPES.get(int(table[failed[0], 0]), RuntimeError)
        detail = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        raise cls(f"{what}: bad input on rank(s) {', '.join(map(str, failed))} -- {detail}") from error


def agree(
    transport: Transport,
    what: str,
    prepared: tuple[T, dict[str, int]] | Exception,
    fields: tuple[str, ...],
    must_match: tuple[str, ...],
    explain: Callable[[np.ndarray], str] | None = None,
) -> tuple[T, np.ndarray]:
    """Check on all ranks that the local step before it succeeded everywhere and agrees.

    ``prepared``: this rank's (plan, signature), where signature maps each name in ``fields``
    to an int, or the exception the local step raised (the caller catches it, so that every
    failure joins the agreement and no rank is left waiting); ``must_match``, the fields every
    rank must have alike, are the first of ``fields``. A failure is reported by every rank
    (TypeError and ValueError as themselves, anything else as RuntimeError naming the original
    type). Returns (plan, table): table is the (size, len(fields)) int64 array of every rank's
    fields, so callers can read fields that may differ (e.g. shard lengths). Raises, on every
    rank alike, TypeError, ValueError or RuntimeError naming the ranks and fields at fault.
    ``explain``: when given, the ranks' disagreement on ``must_match`` is told by
    ``explain(table)`` (the (size, len(fields)) table, in ``fields`` order) instead: ValueError
    ``f"{what}: {explain(table)}"`` (the same table, so the same message, on every rank).
    """
    plan: T | None = None
    error: Exception | None = None
    try:
        if isinstance(prepared, Exception):
            raise prepared
        plan, sig = prepared
        vec = np.array([0, *map(sig.__getitem__, fields)], np.int64)
    except Exception as exc:  # every failure joins the agreement, so no rank is left waiting
        error = exc
        vec = error_row(exc, 1 + len(fields))
    table = transport.allgather_int64(vec)
    k = 1 + len(must_match)  # the error code and must_match: one contiguous comparison
    assert fields[: k - 1] == must_match, f"{must_match} must be the first of {fields}"
    if not _uniform(table, k):  # a rank failed, or the ranks disagree: find which, and say it
        if table[:, 0].any():
            raise_failures(transport, what, table, error)
        if explain is not None:
            raise ValueError(f"{what}: {explain(table[:, 1:])}")
        for col, key in enumerate(must_match, 1):
            column = table[:, col]
            if np.any(column != column[0]):
                values = ", ".join(f"rank {r}: {_describe(key, int(v))}" for r, v in enumerate(column))
                raise ValueError(f"{what}: ranks disagree on {key} ({values})")
    assert plan is not None
    return plan, table[:, 1:]


@contextmanager
def confirmed(transport: Transport, what: str) -> Iterator[None]:
    """``with confirmed(t, what): <local work>`` -- local work between two collective phases
    (such as a geometry's forward transform), checked to have succeeded on every rank on the way
    out: one gather of an error code. A failure on any rank raises the same exception on every
    rank instead of leaving the others waiting."""
    try:
        yield
    except Exception as exc:
        raise_failures(transport, what, transport.allgather_int64(error_row(exc, 1)), exc)
        raise  # raise_failures raised already; kept for the reader and the type checker
    raise_failures(transport, what, transport.allgather_int64(np.zeros(1, np.int64)), None)


def _uniform(table: np.ndarray, k: int) -> bool:
    """No rank failed (column 0 is 0) and every row has the first row's first ``k`` columns.
    Python lists for a few ranks (a NumPy comparison costs more there), NumPy for many."""
    if len(table) > 16:
        head = table[:, :k]
        return not head[0, 0] and not (head[1:] != head[0]).any()
    rows = table.tolist()
    want = rows[0][:k]
    return not want[0] and all(row[:k] == want for row in rows)


def _describe(key: str, value: int) -> str:
    names: dict[str, dict[int, str]] = {
        "dtype": {v: k for k, v in DTYPE_CODES.items()},
        "op": {v: k for k, v in OP_CODES.items()},
        "rounding": {0: "nearest", 1: "stochastic"},
    }
    if key == "fmt":
        return describe_code(value)
    return names.get(key, {}).get(value, str(value))


def meet_plans(t: Transport, channel: PlanChannel, word: int, caller: int, what: str) -> None:
    """Post a header with no message in the plans' channel (``word``: PLAIN_WORD for a plain
    call, STALE_WORD for a stale plan) and check it against every rank's, so that a plain call
    (or a stale plan) on one rank and a persistent plan on another meet here and raise on both at
    once: the plans' calls and the plain calls share one caller agreement. Raises on every rank
    alike: what a failing rank posted, or ValueError when the ranks disagree."""
    status = channel.native.call(0, int(word), int(caller), 0, None, None, 0, 1, None, False, t.timeout)
    if status == 4:
        raise CommAborted(f"{what}: the plan channel is unusable after an earlier timeout or interrupt")
    if status == 2:
        late = tuple(int(q) for q in np.flatnonzero(channel.table[:, 0] == -1))
        t.expired(f"{what} (meeting the plans in the shared-memory channel)", late, t.timeout)
    table = channel.table
    if table[:, 0].any():
        raise_failures(t, what, table, None)
    table = table.copy()
    table[:, 1] = plain_words(table[:, 1])  # a cached plan's call is a plain call (it then agrees)
    if (table[1:, 1:3] != table[0, 1:3]).any():
        kinds = {PLAIN_WORD: "a plain call", STALE_WORD: "a plan of a released communicator"}
        ranks = "; ".join(f"rank {q}: {kinds.get(int(table[q, 1]), 'a persistent plan')}" for q in range(len(table)))
        col = "plan" if (table[:, 1] != table[0, 1]).any() else "caller"
        raise ValueError(f"{what}: ranks disagree on {col} ({ranks}; or differently named threads)")
