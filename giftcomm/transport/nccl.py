"""Transport over NCCL point-to-point (``cupy.cuda.nccl.NcclCommunicator``), device buffers.

- Setup: rank 0 makes the NCCL unique id and broadcasts it over an mpi4py communicator
  (:meth:`NcclTransport.from_mpi`), or the caller passes ``unique_id``/``rank``/``size``.
- Point-to-point is *stream-ordered*: ``isend``/``irecv`` only queue the operation;
  ``Request.wait()`` (on any queued request) issues everything queued, in order, inside one
  ``ncclGroupStart``/``ncclGroupEnd`` on CuPy's current stream, and returns without waiting for
  the GPU. Kernels launched later on the same stream see the received bytes; host code that
  reads them must synchronize the stream first.
  Because queued operations are issued together, a hop must queue its receive and its send and
  then wait (what ``sendrecv`` and the GROUPED schedule of giftcomm.collectives do); queuing a receive whose matching send
  the peer can only post after its own next wait would deadlock, as in NCCL itself.
- Control collectives (agreement, object broadcast, float64 sums) go over a host MPI transport
  when there is one (:meth:`NcclTransport.from_mpi`; its waits have a deadline), else over NCCL
  (allGather of int64 on the device; objects pickled).
"""
from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _xp
from .base import DEVICE, GroupedTransport, QueuedOp

if TYPE_CHECKING:
    from .mpi import MpiTransport


def _nccl():
    from cupy.cuda import nccl

    if not getattr(nccl, "available", True):
        raise RuntimeError("NCCL is not available to CuPy (install nvidia-nccl-cu12/13 or a system NCCL)")
    return nccl


def _current_stream_ptr() -> int:
    import cupy

    return int(cupy.cuda.get_current_stream().ptr)


class NcclTransport(GroupedTransport):
    """One rank of an NCCL communicator; buffers are CuPy arrays (contiguous), sent as bytes."""

    memory = DEVICE

    def __init__(self, unique_id: Any, rank: int, size: int, control: MpiTransport | None = None) -> None:
        nccl = _nccl()
        self.rank, self.size = int(rank), int(size)
        self.control = control
        self.comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)

    @classmethod
    def from_mpi(cls, comm: Any = None) -> "NcclTransport":
        """Create over every rank of an mpi4py communicator (collective): rank 0's unique id is
        broadcast; each rank uses CuPy's current device (set it before, e.g. to local rank).
        The control operations (agreement, geometry sync) then run on a host MPI transport over
        the same ranks, so their waits have its deadline (docs/robustness.md)."""
        from mpi4py import MPI

        from .mpi import MpiTransport

        control = MpiTransport(MPI.COMM_WORLD if comm is None else comm, shared_memory=False)
        uid = control.broadcast_object(_nccl().get_unique_id() if control.rank == 0 else None, root=0)
        return cls(uid, control.rank, control.size, control=control)

    # --- point-to-point: queued (GroupedTransport); tags are not needed, NCCL orders messages
    # per peer in queue order ----------------------------------------------------------------
    def check_buffer(self, buf: Any) -> None:
        if not _xp.is_device_array(buf):
            raise TypeError(f"NCCL transport: expected a device array, got {type(buf).__name__}")
        if not getattr(buf, "flags", None) or not buf.flags.c_contiguous:
            raise ValueError("NCCL transport: buffers must be contiguous")

    def issue(self, ops: list[QueuedOp]) -> None:
        """The queue in one ``ncclGroupStart``/``ncclGroupEnd`` on CuPy's current stream."""
        nccl = _nccl()
        stream = _current_stream_ptr()
        nccl.groupStart()
        try:
            for op in ops:
                ptr, nbytes = _xp.device_pointer(op.buf), int(op.buf.nbytes)
                if op.kind == "send":
                    self.comm.send(ptr, nbytes, nccl.NCCL_UINT8, op.peer, stream)
                else:
                    self.comm.recv(ptr, nbytes, nccl.NCCL_UINT8, op.peer, stream)
        finally:
            nccl.groupEnd()

    # --- control --------------------------------------------------------------------------
    def allgather_int64(self, vec: np.ndarray) -> np.ndarray:
        vec = np.ascontiguousarray(vec, dtype=np.int64)
        if self.control is not None:
            return self.control.allgather_int64(vec)
        import cupy

        nccl = _nccl()
        self.flush()
        src = cupy.asarray(vec)
        dst = cupy.empty(self.size * vec.size, cupy.int64)
        self.comm.allGather(src.data.ptr, dst.data.ptr, vec.size, nccl.NCCL_INT64,
                            cupy.cuda.get_current_stream().ptr)
        return cupy.asnumpy(dst).reshape(self.size, vec.size)

    def allgather_object(self, obj: Any) -> list[Any]:
        if self.control is not None:
            return self.control.allgather_object(obj)
        import cupy

        nccl = _nccl()
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        lengths = self.allgather_int64(np.array([data.size]))[:, 0]
        width = int(lengths.max())
        src = cupy.zeros(width, cupy.uint8)
        src[: data.size] = cupy.asarray(data)
        dst = cupy.empty(width * self.size, cupy.uint8)
        self.comm.allGather(src.data.ptr, dst.data.ptr, width, nccl.NCCL_UINT8, cupy.cuda.get_current_stream().ptr)
        rows = cupy.asnumpy(dst).reshape(self.size, width)
        return [pickle.loads(rows[r, : lengths[r]].tobytes()) for r in range(self.size)]

    def node_ids(self) -> np.ndarray:
        """The MPI library's node layout (for the hierarchical algorithms) when created over MPI."""
        return super().node_ids() if self.control is None else self.control.node_ids()

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return super().broadcast_object(obj, root) if self.control is None else self.control.broadcast_object(obj, root)

    def sum_float64(self, arr: np.ndarray) -> np.ndarray:
        return super().sum_float64(arr) if self.control is None else self.control.sum_float64(arr)

    def reduce_float64(self, arr: np.ndarray, root: int) -> np.ndarray | None:
        return super().reduce_float64(arr, root) if self.control is None else self.control.reduce_float64(arr, root)

    def broadcast_float64(self, buf: np.ndarray, root: int) -> None:
        if self.control is None:
            super().broadcast_float64(buf, root)
        else:
            self.control.broadcast_float64(buf, root)

    def native_sum(self, buf: Any, kind: str, into: Any = None) -> Any:
        """``ncclAllReduce`` (sum, in the kind's arithmetic) of ``buf`` into a new array (or
        ``into``), on CuPy's current stream (bfloat16: uint16 bits as ncclBfloat16)."""
        nccl = _nccl()
        self.flush()
        types = {"float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "float16": "NCCL_FLOAT16",
                 "bfloat16": "NCCL_BFLOAT16"}
        dtype = getattr(nccl, types[kind], None)
        if dtype is None:
            raise TypeError(f"this CuPy's NCCL binding has no {types[kind]}")
        total = buf.copy() if into is None else into
        self.comm.allReduce(_xp.device_pointer(buf), _xp.device_pointer(total), int(buf.size), dtype, nccl.NCCL_SUM,
                            _current_stream_ptr())
        return total

    def native_broadcast(self, buf: Any, root: int) -> None:
        """``ncclBroadcast`` of ``root``'s bytes into ``buf`` (in place), on CuPy's current stream."""
        nccl = _nccl()
        self.flush()
        ptr = _xp.device_pointer(buf)
        self.comm.broadcast(ptr, ptr, int(buf.nbytes), nccl.NCCL_UINT8, root, _current_stream_ptr())

    def free(self) -> None:
        """Destroy the NCCL communicator (after its work is done) and the control transport."""
        self.close("giftcomm: this transport was freed (its plans and state with it); make a new one")
        self.flush()
        self.comm.destroy()
        if self.control is not None:
            self.control.free()
            self.control = None
