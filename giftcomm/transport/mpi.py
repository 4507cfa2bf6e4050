"""Transport over an mpi4py communicator (host memory buffers)."""
from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .base import Request, Transport


class _MpiRequest(Request):
    __slots__ = ("_req",)

    def __init__(self, req: MPI.Request) -> None:
        self._req = req

    def wait(self) -> None:
        self._req.Wait()


class MpiTransport(Transport):
    """Point-to-point over a private duplicate of ``comm``, so our tags never meet the caller's."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.user_comm = comm
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._nodes = self._find_nodes()

    def _find_nodes(self) -> np.ndarray:
        """Node index per rank from MPI_COMM_TYPE_SHARED (collective; done once, at creation)."""
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        leader = local.allreduce(self.rank, op=MPI.MIN)
        local.Free()
        leaders = np.array(self.comm.allgather(leader), np.int64)
        return np.unique(leaders, return_inverse=True)[1].astype(np.int64)

    def node_ids(self) -> np.ndarray:
        return self._nodes.copy()

    def split(self, members, name: str) -> Transport:
        """A real MPI sub-communicator (MPI_Comm_split, collective over this transport)."""
        cache = self.__dict__.setdefault("_giftcomm_splits", {})
        key = (name, tuple(members))
        if key not in cache:
            sub = self.comm.Split(color=min(members), key=self.rank)
            t = MpiTransport.__new__(MpiTransport)
            t.user_comm, t.comm = sub, sub
            t.rank, t.size = sub.Get_rank(), sub.Get_size()
            t._nodes = self._nodes[list(members)]
            cache[key] = t
        return cache[key]

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        return _MpiRequest(self.comm.Isend([buf, MPI.BYTE], dest, tag))

    def irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Request:
        return _MpiRequest(self.comm.Irecv([buf, MPI.BYTE], source, tag))

    def sendrecv(self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int, tag: int = 0) -> None:
        self.comm.Sendrecv([sendbuf, MPI.BYTE], dest, tag, [recvbuf, MPI.BYTE], source, tag)

    def allgather_int64(self, vec: np.ndarray) -> np.ndarray:
        vec = np.ascontiguousarray(vec, dtype=np.int64)
        table = np.empty((self.size, vec.size), np.int64)
        self.comm.Allgather([vec, MPI.INT64_T], [table, MPI.INT64_T])
        return table

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def free(self) -> None:
        """Release the private communicator (optional; MPI frees it at finalize)."""
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


_cache: dict[int, MpiTransport] = {}


def transport_for(comm: MPI.Comm | None) -> MpiTransport:
    """The cached transport of an mpi4py communicator (COMM_WORLD when None).

    The first call on a communicator duplicates it, which is collective: every rank of it makes
    that first call together, as with any collective.
    """
    if comm is None:
        comm = MPI.COMM_WORLD
    key = MPI.Comm.py2f(comm)
    t = _cache.get(key)
    if t is None or t.user_comm != comm:
        t = _cache[key] = MpiTransport(comm)
    return t
