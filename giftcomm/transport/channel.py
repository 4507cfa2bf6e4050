"""The persistent plans' channel: a one-shot exchange of small messages in node-shared memory.

A :class:`PlanChannel` lays two message slots per rank over a node-shared window
(giftcomm.transport.shared_window). Each call of a plan writes its header (four int64 check
words) and its encoded message into its slot, publishes the slot with one sequence number, and
waits, with the transport's deadline, until every peer has published the same call; then every
rank reads every rank's header and message in place. No MPI call, no message copy: the per-call
cost of a small allreduce becomes the codec's plus one cache-line handshake. The native part
(native/gc_channel.c) does the publish, the wait and, on the fast path, the encode and the
rank-order decode-sum; this module owns the memory and the Python view of it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .shared_window import SharedWindow

if TYPE_CHECKING:
    from .base import Transport

WORDS = 4
"""Header words per message: error code, plan word, caller, seed (giftcomm.persistent)."""
PLAIN_WORD = -1
"""The plan word a plain call posts (:meth:`PlanChannel.meet`); plans' words are CRC-32s, >= 0."""
STALE_WORD = -2
"""The plan word a plan of a released transport posts into its successor's channel."""


def native_channel() -> Any:
    """The native Channel type, or None when this build or platform has none."""
    try:
        from .. import _codec_native  # type: ignore[attr-defined]
    except ImportError:
        return None
    return getattr(_codec_native, "Channel", None)


def payload_offset() -> int:
    """Bytes from the start of a slot to its message (the sequence word and header come first)."""
    from .. import _codec_native  # type: ignore[attr-defined]

    return int(_codec_native.CHANNEL_PAYLOAD_OFFSET)


def channel_window_nbytes(capacity: int) -> int:
    """Window bytes per rank for two slots of ``capacity`` payload bytes (slots 64-byte aligned)."""
    return 2 * (payload_offset() + -(-int(capacity) // 64) * 64)


class PlanChannel:
    """``native``: the C channel (``call``, ``parity``; native/gc_channel.c); ``table``: int64
    (P, 4), every rank's header of the latest call; ``capacity``: payload bytes per message."""

    def __init__(self, window: SharedWindow, rank: int, capacity: int, crowded: bool) -> None:
        self.window, self.capacity = window, int(capacity)
        self.table = np.zeros((len(window.views), WORDS), np.int64)
        self.native = native_channel()(list(window.views), rank, self.capacity, bool(crowded), self.table)
        self._offset = payload_offset()

    def payload(self, q: int, parity: int, nbytes: int) -> np.ndarray:
        """Rank ``q``'s message in slot ``parity`` (uint8, ``nbytes``): a view of the window."""
        lo = parity * self.native.stride + self._offset
        return self.window.views[q][lo : lo + nbytes]

    def release(self) -> None:
        """Close the channel (later calls raise) and free its window (collective)."""
        self.native.close()
        self.window.release()

    def meet(self, t: "Transport", word: int, caller: int, what: str) -> None:
        """Post a header with no message (``word``: :data:`PLAIN_WORD` for a plain call,
        :data:`STALE_WORD` for a stale plan) and check it against every rank's, so that a plain
        call (or a stale plan) on one rank and a persistent plan on another meet here and raise
        on both at once: the plans' calls and the plain calls share one caller agreement. Raises
        on every rank alike: what a failing rank posted, or ValueError when the ranks disagree."""
        from ..errors import CommAborted

        status = self.native.call(0, int(word), int(caller), 0, None, None, 0, 1, None, False, t.timeout)
        if status == 4:
            raise CommAborted(f"{what}: the plan channel is unusable after an earlier timeout or interrupt")
        if status == 2:
            late = tuple(int(q) for q in np.flatnonzero(self.table[:, 0] == -1))
            t.expired(f"{what} (meeting the plans in the shared-memory channel)", late, t.timeout)
        table = self.table
        if table[:, 0].any():
            from ..collectives.agree import raise_failures

            raise_failures(t, what, table, None)
        if (table[1:, 1:3] != table[0, 1:3]).any():
            kinds = {PLAIN_WORD: "a plain call", STALE_WORD: "a plan of a released communicator"}
            ranks = "; ".join(f"rank {q}: {kinds.get(int(table[q, 1]), 'a persistent plan')}"
                              for q in range(len(table)))
            col = "plan" if (table[:, 1] != table[0, 1]).any() else "caller"
            raise ValueError(f"{what}: ranks disagree on {col} ({ranks}; or differently named threads)")
