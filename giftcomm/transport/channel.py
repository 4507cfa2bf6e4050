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
    pass

WORDS = 4
"""Header words per message: error code, plan word, caller, seed (giftcomm.plans.persistent)."""
PLAIN_WORD = -1
"""The plan word a plain call posts (:meth:`PlanChannel.meet`); plans' words are CRC-32s, >= 0."""
STALE_WORD = -2
"""The plan word a plan of a released transport posts into its successor's channel."""
CACHED = 1 << 40
"""Flag bit in the word of a plain call's cached plan (giftcomm.plans.cache; plans' CRC-32s lack it)."""


def plain_words(words: np.ndarray) -> np.ndarray:
    """``words`` with every cached plan's word read as :data:`PLAIN_WORD`: a plain call that
    found a cached plan and one that did not are the same caller (the cached plan then falls
    back to the agreement: giftcomm.plans.persistent)."""
    return np.where((words >= 0) & (words & CACHED != 0), PLAIN_WORD, words)


def native_channel() -> Any:
    """The native Channel type, or None when this build or platform has none."""
    try:
        from .. import _codec_native
    except ImportError:
        return None
    return getattr(_codec_native, "Channel", None)


def payload_offset() -> int:
    """Bytes from the start of a slot to its message (the sequence word and header come first)."""
    from .. import _codec_native

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
