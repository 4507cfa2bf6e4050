"""Transport over CUDA-aware MPI (mpi4py) with device buffers.

Buffers are CuPy arrays (or any object exposing ``__cuda_array_interface__``); mpi4py hands MPI
the device pointer, and a CUDA-aware MPI library moves the bytes (GPUDirect, IPC, or staging,
as the library decides). Before a send, the current CuPy stream is synchronized, so the kernels
that produced the buffer have finished when MPI reads it; a completed receive is visible to
every later kernel. A receive also synchronizes first: kernels still queued may read the buffer
that MPI is about to overwrite.

Whether the MPI library is CUDA-aware is asked of the library itself (:func:`cuda_support`):
``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)`` (MPICH >= 4), else
``MPIX_Query_cuda_support()`` (Open MPI, MPICH); ``GIFTCOMM_CUDA_AWARE_MPI=1`` / ``=0`` overrides.
With a library that is not CUDA-aware, device pointers must not be used (a host MPI would read
them as host addresses and crash): :class:`DeviceMpiTransport` refuses to start unless
``require_cuda_aware=False`` (what the CPU tests do with fake device arrays over host memory).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import _xp, config
from .base import DEVICE, GROUPED, Request
from .mpi import MpiRequest, MpiTransport

MPIX_GPU_SUPPORT_CUDA = 0


@dataclass(frozen=True)
class CudaSupport:
    """What the MPI library says about CUDA. supported: True/False, or None when the library has
    no query function (unknown). how: which query (or override) gave the answer."""

    supported: bool | None
    how: str


def _libmpi_handles() -> list[ctypes.CDLL]:
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line.split()[-1] if line.strip() else ""
                if "libmpi" in os.path.basename(name) and name not in paths:
                    paths.append(name)
    except OSError:
        pass
    handles = [ctypes.CDLL(p) for p in paths]
    handles.append(ctypes.CDLL(None))
    return handles


def cuda_support() -> CudaSupport:
    """Ask the loaded MPI library whether it is CUDA-aware (see the module docstring)."""
    env = config.choice("GIFTCOMM_CUDA_AWARE_MPI")
    if env in ("0", "1"):
        return CudaSupport(env == "1", "GIFTCOMM_CUDA_AWARE_MPI")
    for lib in _libmpi_handles():
        fn = getattr(lib, "MPIX_GPU_query_support", None)
        if fn is not None:
            flag = ctypes.c_int(0)
            if fn(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
                return CudaSupport(bool(flag.value), "MPIX_GPU_query_support")
        fn = getattr(lib, "MPIX_Query_cuda_support", None)
        if fn is not None:
            return CudaSupport(bool(fn()), "MPIX_Query_cuda_support")
    return CudaSupport(None, "no query function in the MPI library")


def _msg(buf: Any) -> list:
    if not _xp.is_device_array(buf):
        raise TypeError(f"device MPI transport: expected a device array, got {type(buf).__name__}")
    return [buf, MPI.BYTE]


class DeviceMpiTransport(MpiTransport):
    """Point-to-point with device buffers over a private duplicate of ``comm``.

    Control collectives (allgather_int64 / allgather_object), node ids and splits are
    MpiTransport's, in host memory. GROUPED: each hop's operations are started and waited
    together, after the stream is synchronized.
    """

    schedule = GROUPED
    memory = DEVICE

    def __init__(self, comm: MPI.Comm | None = None, require_cuda_aware: bool = True,
                 timeout: float | None = None, on_timeout: str | None = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        self.support = cuda_support()
        super().__init__(comm, timeout=timeout, on_timeout=on_timeout)
        # Every rank must decide alike (over the private duplicate, under the deadline).
        ok = self.allgather_int64(np.array([1 if self.support.supported else 0], np.int64)).min()
        if require_cuda_aware and not ok:
            self.free()
            raise RuntimeError(
                f"the MPI library is not CUDA-aware on every rank ({self.support.how} says "
                f"{self.support.supported} here); use the NCCL transport or host buffers, or set "
                "GIFTCOMM_CUDA_AWARE_MPI=1 if you know better")

    def isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        self._check()
        _xp.synchronize(buf)  # the producing kernels must be done before MPI reads the buffer
        return MpiRequest(self.comm.Isend(_msg(buf), dest, tag), self, "device send", dest)

    def irecv(self, buf: Any, source: int, tag: int = 0) -> Request:
        self._check()
        _xp.synchronize(buf)  # queued kernels may still read the buffer MPI is about to fill
        return MpiRequest(self.comm.Irecv(_msg(buf), source, tag), self, "device receive", source)

    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int, tag: int = 0) -> None:
        self._check()
        _xp.synchronize(sendbuf)
        _xp.synchronize(recvbuf)
        reqs = [self.comm.Irecv(_msg(recvbuf), source, tag), self.comm.Isend(_msg(sendbuf), dest, tag)]
        self.wait_for(reqs, f"device sendrecv (to {dest}, from {source})", (source, dest))

