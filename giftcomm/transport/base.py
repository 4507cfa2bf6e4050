"""The few point-to-point and control operations the collectives need.

A transport connects ``size`` ranks. Buffers are contiguous 1-D NumPy arrays (uint8 wire
messages, or small int64 control vectors). Every transport gives the same semantics; the
collectives never talk to MPI (or anything else) directly.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np


class Request(ABC):
    """A pending nonblocking send or receive."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the operation completes."""


class Transport(ABC):
    """Point-to-point messages plus two small control collectives, for ``size`` ranks."""

    rank: int
    size: int

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


def wait_all(requests: Sequence[Request]) -> None:
    """Wait for every request in order."""
    for req in requests:
        req.wait()
