"""Transport over an mpi4py communicator (host memory buffers)."""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from mpi4py import MPI

from .base import Request, Transport
from .shared_window import SHM_DIR, SharedWindow, enabled_by_env, shm_room


class _MpiRequest(Request):
    __slots__ = ("_req",)

    def __init__(self, req: MPI.Request) -> None:
        self._req = req

    def wait(self) -> None:
        self._req.Wait()


class MpiTransport(Transport):
    """Point-to-point over a private duplicate of ``comm``, so our tags never meet the caller's.

    shared_memory: use a node-shared MPI window (MPI_Win_allocate_shared) for zero-copy
    allreduces when every rank is on one node. None (default): yes unless $GIFTCOMM_SHARED_MEMORY
    is 0; False: never; True: always (ValueError when the ranks span nodes). Pass the same value
    on every rank. Creating a transport is collective.
    """

    def __init__(self, comm: MPI.Comm, shared_memory: bool | None = None) -> None:
        self.user_comm = comm
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._nodes = self._find_nodes()
        one_node = bool((self._nodes == 0).all())
        if shared_memory and not one_node:
            raise ValueError(f"shared_memory=True needs every rank on one node; these span {self._nodes.max() + 1}")
        self.shared_memory = one_node and (enabled_by_env() if shared_memory is None else bool(shared_memory))

    def _find_nodes(self) -> np.ndarray:
        """Node index per rank from MPI_COMM_TYPE_SHARED (collective; done once, at creation)."""
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        leader = local.allreduce(self.rank, op=MPI.MIN)
        local.Free()
        leaders = np.array(self.comm.allgather(leader), np.int64)
        return np.unique(leaders, return_inverse=True)[1].astype(np.int64)

    def node_ids(self) -> np.ndarray:
        return self._nodes.copy()

    def _new_split(self, members: tuple[int, ...], index: int) -> Transport:
        """A real MPI sub-communicator (MPI_Comm_split, collective over this transport)."""
        sub = self.comm.Split(color=min(members), key=self.rank)
        t = type(self).__new__(type(self))  # a device MPI transport splits into device MPI ones
        t.user_comm, t.comm = sub, sub
        t.rank, t.size = sub.Get_rank(), sub.Get_size()
        t._nodes = self._nodes[list(members)]
        return t

    def allocate_window(self, nbytes: int) -> SharedWindow | None:
        """MPI_Win_allocate_shared of ``nbytes`` per rank, in one passive-target epoch for its life
        (MPI_Win_lock_all): the fence is MPI_Win_sync, a barrier, MPI_Win_sync, the separate-memory
        -model-safe way to order plain loads and stores across ranks.

        None, with a warning and ``shared_memory`` switched off on every rank, when /dev/shm
        cannot hold the window (rank 0 checks and tells the others: one decision everywhere)."""
        room, free = self.comm.bcast(shm_room(nbytes * self.size) if self.rank == 0 else None)
        if not room:
            self.shared_memory = False
            if self.rank == 0:
                warnings.warn(f"giftcomm: {SHM_DIR} has {free >> 20} MiB free but the shared window needs "
                              f"{nbytes * self.size >> 20} MiB; allreduces use MPI messages from now on "
                              f"(enlarge {SHM_DIR}, e.g. docker run --shm-size, or set GIFTCOMM_SHARED_MEMORY=0)",
                              RuntimeWarning, stacklevel=2)
            return None
        win = MPI.Win.Allocate_shared(nbytes, 1, comm=self.comm)
        views = [np.frombuffer(win.Shared_query(q)[0], np.uint8, nbytes) for q in range(self.size)]
        win.Lock_all(MPI.MODE_NOCHECK)
        comm = self.comm

        def fence() -> None:
            win.Sync()
            comm.Barrier()
            win.Sync()

        def release() -> None:
            win.Unlock_all()
            win.Free()

        return SharedWindow(views, fence, release)

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

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.comm.bcast(obj, root=root)

    def sum_float64(self, arr: np.ndarray) -> np.ndarray:
        arr = np.ascontiguousarray(arr, dtype=np.float64)
        total = np.empty_like(arr)
        self.comm.Allreduce(arr, total, op=MPI.SUM)
        return total

    def reduce_float64(self, arr: np.ndarray, root: int) -> np.ndarray | None:
        arr = np.ascontiguousarray(arr, dtype=np.float64)
        total = np.empty_like(arr) if self.rank == root else None
        self.comm.Reduce(arr, total, op=MPI.SUM, root=root)
        return total

    def broadcast_float64(self, buf: np.ndarray, root: int) -> None:
        self.comm.Bcast(buf, root=root)

    def free(self) -> None:
        """Release the shared window and the private communicator (collective; optional: MPI frees
        them at finalize)."""
        self.release_state()
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
