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

import ctypes
import errno
import mmap
import os
from typing import Callable

import numpy as np

ENV_SWITCH = "GIFTCOMM_SHARED_MEMORY"


def enabled_by_env() -> bool:
    """False when $GIFTCOMM_SHARED_MEMORY is 0/off/false/no (default on); ValueError naming the
    variable for any other value than 1/on/true/yes (a typo must not silently mean "on")."""
    from .. import config

    return config.flag(ENV_SWITCH)


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
PAGE = mmap.PAGESIZE
MARGIN = 1 << 20
"""Bytes kept free in /dev/shm beyond the window's own footprint (MPI's own segments, other
processes' small files)."""


def window_footprint(nbytes: int, ranks: int) -> int:
    """The /dev/shm bytes a shared window of ``nbytes`` per rank over ``ranks`` ranks needs, with
    a margin: each rank's part rounded up to whole pages (MPICH rounds the whole segment, and
    with ``alloc_shared_noncontig`` each part), one page of segment header, one more page for the
    rounding of the parts' boundaries, plus :data:`MARGIN` and 1/64 of the total (measured:
    MPICH 4-5 takes ``ceil(nbytes * P / page) + 1`` pages)."""
    parts = int(ranks) * (-(-int(nbytes) // PAGE) * PAGE)
    return parts + 2 * PAGE + MARGIN + parts // 64


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


MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in for writing; EFAULT instead of SIGBUS
_libc: ctypes.CDLL | None = None


def populate(view: np.ndarray) -> bool | None:
    """Back every page under ``view`` with memory now, in a way that cannot kill the process.

    A shared window lives in a sparse /dev/shm file: its pages are only allocated when first
    touched, and a touch that finds the file system full raises SIGBUS. ``madvise(
    MADV_POPULATE_WRITE)`` allocates them up front and reports a full file system as an error
    (EFAULT/ENOMEM) instead. Returns True when every page is backed (later touches cannot fail),
    False when there is no memory for them (the caller must not use the window), None when the
    kernel cannot tell (older than 5.14: only the free-space check protects the window)."""
    global _libc
    n = int(view.nbytes)
    if n == 0:
        return True
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
        _libc = lib
    addr = int(view.ctypes.data)
    lo = addr - addr % PAGE
    hi = -(-(addr + n) // PAGE) * PAGE
    if _libc.madvise(lo, hi - lo, MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM):  # advice unknown to this kernel
        return None
    return False
