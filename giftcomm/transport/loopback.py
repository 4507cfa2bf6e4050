"""An in-process transport: P virtual ranks as P threads of one process.

For tests and single-machine experiments: ``LoopbackGroup(P).run(fn)`` calls ``fn(transport)``
on P threads and returns the P results (re-raising the first exception after all finished).
Messages are copied through per-(source, dest, tag) queues. Every wait (a receive, a barrier, a
control gather) has the deadline of the waiting rank's :attr:`Transport.timeout` (default
``$GIFTCOMM_TIMEOUT``; ``LoopbackGroup(P, timeout=...)`` sets it for every rank; 0: none) and
raises :class:`giftcomm.errors.CommTimeout` when it passes (there is no job to abort here).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from typing import Any, Callable

import numpy as np

from ..errors import CommTimeout
from .base import Request, Transport
from .shared_window import SharedWindow


def _limit(t: Transport | None) -> float | None:
    """The deadline of a wait by ``t`` for queue/threading waits (None: no deadline)."""
    if t is None:
        from .. import config

        seconds = config.number("GIFTCOMM_TIMEOUT")
    else:
        seconds = t.timeout
    return seconds or None


class _Done(Request):
    def wait(self) -> None:
        pass


class PendingRecv(Request):
    """A receive from ``source`` (for the error message) by ``transport`` (whose timeout applies;
    None: $GIFTCOMM_TIMEOUT)."""

    def __init__(self, box: "queue.Queue[np.ndarray]", buf: np.ndarray, transport: Transport | None = None,
                 source: int = -1) -> None:
        self._box, self._buf, self._t, self._source = box, buf, transport, source

    def wait(self) -> None:
        limit = _limit(self._t)
        try:
            data = self._box.get(timeout=limit)
        except queue.Empty:
            rank = "?" if self._t is None else self._t.rank
            peer = "a rank" if self._source < 0 else f"rank {self._source}"
            raise CommTimeout(f"giftcomm: loopback receive timed out on rank {rank} after {limit:g} s waiting for "
                              f"{peer} (it did not send)", "receive", (self._source,) if self._source >= 0 else (),
                              limit or 0.0, -1 if self._t is None else self._t.rank) from None
        if data.nbytes != self._buf.nbytes:
            raise ValueError(f"loopback message of {data.nbytes} bytes into a {self._buf.nbytes}-byte buffer")
        self._buf.reshape(-1).view(np.uint8)[...] = data  # NumPy or CuPy (device loopback)


class LoopbackGroup:
    """P virtual ranks sharing mailboxes; ``transports[r]`` is rank r's transport.

    shared_memory: whether the transports offer a shared window (threads share memory anyway),
    so that allreduces take the zero-copy path of giftcomm.collectives.shared. Default False:
    every byte moves as a message.
    """

    def __init__(self, size: int, shared_memory: bool = False, timeout: float | None = None) -> None:
        if size < 1:
            raise ValueError("a loopback group needs at least one rank")
        self.size = size
        self.shared_memory = bool(shared_memory)
        self._boxes: dict[tuple[int, int, int], queue.Queue] = defaultdict(queue.Queue)
        self._lock = threading.Lock()
        self._barrier = threading.Barrier(size)
        self._slots: list[Any] = [None] * size
        self.transports = [LoopbackTransport(self, r) for r in range(size)]
        self.timeout = timeout

    @property
    def timeout(self) -> float | None:
        """The deadline of every rank's waits (None: each transport's own, $GIFTCOMM_TIMEOUT)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self._timeout = seconds
        for t in getattr(self, "transports", ()):
            t.timeout = seconds

    def box(self, source: int, dest: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._boxes[(source, dest, tag)]

    def barrier(self, rank: int | None = None, what: str = "barrier") -> None:
        """Wait until every rank's thread gets here (``rank``: whose deadline applies)."""
        t = None if rank is None else self.transports[rank]
        limit = _limit(t)
        start = time.monotonic()
        try:
            self._barrier.wait(limit)
        except threading.BrokenBarrierError:  # this wait timed out, or another rank's broke it
            if limit is None or time.monotonic() - start < 0.999 * limit:
                raise
            raise CommTimeout(f"giftcomm: loopback {what} timed out on rank {rank} after {limit:g} s waiting for "
                              f"the other ranks of {self.size}", what, tuple(range(self.size)), limit,
                              -1 if rank is None else rank) from None

    def gather(self, rank: int, obj: Any) -> list[Any]:
        self._slots[rank] = obj
        self.barrier(rank, "gather")
        result = list(self._slots)
        self.barrier(rank, "gather")
        return result

    def run(self, fn: Callable[[Transport], Any]) -> list[Any]:
        """Run ``fn(transport)`` for every rank on its own thread; return the results in rank order."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def body(r: int) -> None:
            try:
                results[r] = fn(self.transports[r])
            except BaseException as exc:  # re-raised below, in the caller's thread
                errors[r] = exc
                self._barrier.abort()

        # one thread name for every rank (and run): calls pair up as from one caller (plan.exclusive)
        threads = [threading.Thread(target=body, args=(r,), name="giftcomm-loopback", daemon=True)
                   for r in range(self.size)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


class LoopbackTransport(Transport):
    """One virtual rank of a :class:`LoopbackGroup` (PIPELINED, host buffers)."""

    def __init__(self, group: LoopbackGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size
        self.shared_memory = group.shared_memory

    def allocate_window(self, nbytes: int) -> SharedWindow:
        views = self.group.gather(self.rank, np.zeros(nbytes, np.uint8))
        return SharedWindow(views, lambda: self.group.barrier(self.rank, "shared-window fence"), lambda: None)

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        self.group.box(self.rank, dest, tag).put(np.array(buf, copy=True).reshape(-1).view(np.uint8))
        return _Done()

    def irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Request:
        return PendingRecv(self.group.box(source, self.rank, tag), buf, self, source)

    def allgather_int64(self, vec: np.ndarray) -> np.ndarray:
        rows = self.group.gather(self.rank, np.array(vec, dtype=np.int64, copy=True))
        return np.stack(rows)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.group.gather(self.rank, obj)
