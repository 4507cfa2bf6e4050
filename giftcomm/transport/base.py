"""The few point-to-point and control operations the collectives need.

A transport connects ``size`` ranks. Buffers are contiguous 1-D NumPy arrays (uint8 wire
messages, or small int64 control vectors). Every transport gives the same semantics; the
collectives never talk to MPI (or anything else) directly.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np

from .shared_window import SharedWindow, cached_window


class Request(ABC):
    """A pending nonblocking send or receive."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the operation completes."""


class Transport(ABC):
    """Point-to-point messages plus two small control collectives, for ``size`` ranks."""

    rank: int
    size: int
    shared_memory: bool = False
    """True when every rank can map every other rank's memory, so that :meth:`shared_window`
    gives a window (the same on every rank)."""

    @abstractmethod
    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        """Start sending ``buf`` (contiguous) to ``dest``; do not touch ``buf`` until waited."""

    @abstractmethod
    def irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Request:
        """Start receiving exactly ``buf.nbytes`` bytes from ``source`` into ``buf``."""

    def sendrecv(self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int, tag: int = 0) -> None:
        """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source``."""
        reqs = [self.irecv(recvbuf, source, tag), self.isend(sendbuf, dest, tag)]
        wait_all(reqs)

    @abstractmethod
    def allgather_int64(self, vec: np.ndarray) -> np.ndarray:
        """Gather every rank's int64 vector (same length everywhere): array of shape (size, len)."""

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object per rank (control path only: error messages)."""

    def node_ids(self) -> np.ndarray:
        """Node index of every rank (int64, shape (size,)): ranks sharing memory share a node.

        The default is one node for all ranks; MPI transports ask the MPI library.
        """
        return np.zeros(self.size, np.int64)

    def shared_window(self, nbytes: int) -> SharedWindow | None:
        """A window of at least ``nbytes`` bytes per rank that every rank maps, or None when the
        ranks do not share memory (``shared_memory`` False; the default).

        Collective, with the same ``nbytes`` on every rank. The window is kept and reused by
        later calls; it is reallocated (and earlier views become invalid) only to grow. A
        transport that can share memory sets ``shared_memory`` and defines
        ``_allocate_window(nbytes) -> SharedWindow`` (collective).
        """
        allocate = getattr(self, "_allocate_window", None)
        if not self.shared_memory or allocate is None:
            return None
        return cached_window(self, nbytes, allocate)

    def split(self, members: Sequence[int], name: str) -> "Transport":
        """A transport over the parent ranks ``members`` (which include this rank), cached by name.

        Every rank calls split with the same name at the same point of the program (like
        MPI_Comm_split); each rank passes the members of its own group.
        """
        cache = self.__dict__.setdefault("_giftcomm_splits", {})
        key = (name, tuple(members))
        if key not in cache:
            from .sub import TAG_SPAN, SubTransport

            cache[key] = SubTransport(self, members, tag_base=TAG_SPAN * (1 + len(cache)))
        return cache[key]


def wait_all(requests: Sequence[Request]) -> None:
    """Wait for every request in order."""
    for req in requests:
        req.wait()
