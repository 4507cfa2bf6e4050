"""A node-shared window: every rank's bytes, readable and writable by every rank, plus a fence.

A transport whose ranks share memory (one node) hands one out through
:meth:`giftcomm.transport.Transport.shared_window`; giftcomm.collectives.shared uses it for a
zero-copy allreduce: a rank writes its wire messages into its own part of the window and its
peers decode them in place, with no message copy in between.

Discipline (what makes it race-free): between two fences a rank writes only its own view, and
it reads a peer's view only where that peer wrote before the last fence and will not write again
until after the next one.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

ENV_SWITCH = "GIFTCOMM_SHARED_MEMORY"


def enabled_by_env() -> bool:
    """False when $GIFTCOMM_SHARED_MEMORY is 0/off/false/no (default on)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


class SharedWindow:
    """``views[q]``: rank q's part of the window (uint8, ``nbytes`` bytes each, all mapped in this
    process); :meth:`fence` is a barrier that also orders every rank's earlier writes to the
    window before every rank's later reads (collective)."""

    def __init__(self, views: list[np.ndarray], fence: Callable[[], None], release: Callable[[], None]) -> None:
        self.views = views
        self.nbytes = int(views[0].size) if views else 0
        self._fence, self._release = fence, release

    def fence(self) -> None:
        """Wait until every rank reaches its fence (collective)."""
        self._fence()

    def release(self) -> None:
        """Free the window (collective); its views must not be used afterwards."""
        self._release()
        self.views = []


def grown_size(nbytes: int) -> int:
    """The size to allocate for a request of ``nbytes``: rounded up to 64 KiB, so that nearby sizes
    reuse one window (the same on every rank, since ``nbytes`` is)."""
    step = 1 << 16
    return max(step, -(-int(nbytes) // step) * step)


SHM_DIR = "/dev/shm"


def shm_room(total_bytes: int, where: str = SHM_DIR) -> tuple[bool, int]:
    """Whether the shared-memory file system ``where`` has ``total_bytes`` free (a window there is
    only backed by pages when touched: a full one kills the process with SIGBUS instead of failing
    the allocation), and how many bytes it has. True when ``where`` does not exist (the MPI
    library then uses other memory)."""
    try:
        st = os.statvfs(where)
    except OSError:
        return True, -1
    free = st.f_bavail * st.f_frsize
    return free >= total_bytes, free
