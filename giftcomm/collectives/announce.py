"""The plan channel's handshake shared by plans, cached plans and plain calls' agreements.

On a transport with a plan channel (giftcomm.transport.channel), three kinds of call may meet:
a persistent plan's call (its header carries the plan's word), a plain call that found a cached
plan for its signature (giftcomm.plan_cache: the word carries :data:`CACHED`), and a plain call
that did not (it is about to agree on its arguments in a small collective). So that no rank
waits in the agreement while a peer waits in the channel, every agreement on such a transport
first posts a header with the code :data:`MISS` (:func:`announce_miss`); every rank then reads
the same table of headers and :func:`settle` decides alike on every rank:

- no MISS: the plans' own checks apply (giftcomm.persistent);
- MISS, and some rank failed locally: that rank's error, raised on every rank;
- MISS, and some rank ran a persistent plan (a word without :data:`CACHED`): ValueError "ranks
  disagree on caller" on every rank;
- otherwise every rank goes on to the agreement (cached-plan ranks raise :class:`Missed`, which
  their plain call catches).
"""
from __future__ import annotations

import numpy as np

from ..errors import CommAborted
from ..transport import Transport
from .agree import raise_failures

__all__ = ["MISS", "CACHED", "Missed", "announce_miss", "settle"]

MISS = 9
"""Header code (column 0) of a rank about to agree on a plain call (not an error code)."""
CACHED = 1 << 40
"""Flag bit in the word (column 1) of a cached plan's call (persistent plans' words are crc32s)."""


class Missed(Exception):
    """A cached plan's call met a peer that is about to agree (its cache had no such plan): the
    plain call falls back to the agreement, on every rank alike."""


def settle(t: Transport, table: np.ndarray, error: Exception | None, what: str) -> bool:
    """Whether some rank announced a miss and every rank should go on to the agreement (the same
    answer on every rank); raises, on every rank alike, when a rank failed locally or ran a
    persistent plan against the miss. ``table``: the (P, 4) headers of one channel call."""
    codes = table[:, 0]
    missed = codes == MISS
    if not missed.any():
        return False
    if ((codes != 0) & ~missed).any():
        clean = table.copy()
        clean[missed, 0] = 0
        raise_failures(t, what, clean, error)
    planned = np.flatnonzero((codes == 0) & (table[:, 1] & CACHED == 0))
    if planned.size:
        plain = np.flatnonzero(missed)
        raise ValueError(f"{what}: ranks disagree on caller (a plain call on rank(s) {', '.join(map(str, plain))} "
                         f"met a persistent plan's call on rank(s) {', '.join(map(str, planned))})")
    return True


def announce_miss(t: Transport, caller: int) -> None:
    """Post this rank's MISS header in the transport's plan channel, if it has one, and settle
    (collective on such transports: every peer posts in the channel for its own call)."""
    channel = t.state.channel
    if channel is None:
        return
    try:
        status = channel.native.call(MISS, 0, caller, 0, None, None, 0, 1, None, False, t.timeout)
    except BaseException:
        t.interrupted("giftcomm agreement (shared-memory channel)")
        raise
    if status == 4:
        raise CommAborted("giftcomm: the shared-memory plan channel is unusable after an earlier timeout or "
                          "interrupt (or its transport's state was released); make a new communicator")
    if status == 2:
        late = tuple(int(q) for q in np.flatnonzero(channel.table[:, 0] == -1))
        t.expired("giftcomm agreement (shared-memory channel)", late, t.timeout)
    settle(t, channel.table, None, "giftcomm")
