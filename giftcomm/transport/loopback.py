"""An in-process transport: P virtual ranks as P threads of one process.

For tests and single-machine experiments: ``LoopbackGroup(P).run(fn)`` calls ``fn(transport)``
on P threads and returns the P results (re-raising the first exception after all finished).
Messages are copied through per-(source, dest, tag) queues.
"""
from __future__ import annotations

import queue
import threading
from collections import defaultdict
from typing import Any, Callable

import numpy as np

from .base import Request, Transport
from .shared_window import SharedWindow

_TIMEOUT_S = 120.0


class _Done(Request):
    def wait(self) -> None:
        pass


class PendingRecv(Request):
    def __init__(self, box: "queue.Queue[np.ndarray]", buf: np.ndarray) -> None:
        self._box, self._buf = box, buf

    def wait(self) -> None:
        try:
            data = self._box.get(timeout=_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError("loopback receive timed out (a rank did not send)") from None
        if data.nbytes != self._buf.nbytes:
            raise ValueError(f"loopback message of {data.nbytes} bytes into a {self._buf.nbytes}-byte buffer")
        self._buf.reshape(-1).view(np.uint8)[...] = data  # NumPy or CuPy (device loopback)


class LoopbackGroup:
    """P virtual ranks sharing mailboxes; ``transports[r]`` is rank r's transport.

    shared_memory: whether the transports offer a shared window (threads share memory anyway),
    so that allreduces take the zero-copy path of giftcomm.collectives.shared. Default False:
    every byte moves as a message.
    """

    def __init__(self, size: int, shared_memory: bool = False) -> None:
        if size < 1:
            raise ValueError("a loopback group needs at least one rank")
        self.size = size
        self.shared_memory = bool(shared_memory)
        self._boxes: dict[tuple[int, int, int], queue.Queue] = defaultdict(queue.Queue)
        self._lock = threading.Lock()
        self._barrier = threading.Barrier(size)
        self._slots: list[Any] = [None] * size
        self.transports = [LoopbackTransport(self, r) for r in range(size)]

    def box(self, source: int, dest: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._boxes[(source, dest, tag)]

    def barrier(self) -> None:
        """Wait until every rank's thread gets here."""
        self._barrier.wait(_TIMEOUT_S)

    def gather(self, rank: int, obj: Any) -> list[Any]:
        self._slots[rank] = obj
        self._barrier.wait(_TIMEOUT_S)
        result = list(self._slots)
        self._barrier.wait(_TIMEOUT_S)
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
        return SharedWindow(views, self.group.barrier, lambda: None)

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        self.group.box(self.rank, dest, tag).put(np.array(buf, copy=True).reshape(-1).view(np.uint8))
        return _Done()

    def irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Request:
        return PendingRecv(self.group.box(source, self.rank, tag), buf)

    def allgather_int64(self, vec: np.ndarray) -> np.ndarray:
        rows = self.group.gather(self.rank, np.array(vec, dtype=np.int64, copy=True))
        return np.stack(rows)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.group.gather(self.rank, obj)
