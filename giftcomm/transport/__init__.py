"""Transports: how bytes move between ranks (MPI, NCCL, CUDA-aware MPI, torch.distributed,
in-process loopbacks)."""
from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from .base import ANY, DEVICE, GROUPED, HOST, PIPELINED, Request, Transport, TransportState, wait_all
from .loopback import LoopbackGroup, LoopbackTransport

if TYPE_CHECKING:
    from .nccl import NcclTransport

__all__ = ["Request", "Transport", "TransportState", "wait_all", "LoopbackGroup", "LoopbackTransport", "resolve", "release",
           "PIPELINED", "GROUPED", "HOST", "DEVICE", "ANY"]

_device_cache: dict[int, NcclTransport] = {}
_world: tuple[Any, int] | None = None  # (mpi.cached_transport, COMM_WORLD's key) once made
_CREATE = threading.Lock()  # two threads making the first call on one communicator create it once


def resolve(comm: Any, device: bool = False) -> Transport:
    """The transport for a ``comm=`` argument: a Transport as is; None under torchrun (an
    initialised torch.distributed world of several ranks while MPI's world is one process) gives
    the transport over torch's default group; an mpi4py communicator (None otherwise:
    MPI.COMM_WORLD) gives its cached MPI transport for host arrays and, for device arrays
    (``device``), an NCCL transport over the same ranks, created once per communicator
    (collectively: the NCCL unique id is broadcast over it)."""
    global _world
    if comm is None:
        if "torch.distributed" in sys.modules:  # torchrun: torch's world, not MPI's singleton
            from .torch_dist import default_transport

            t = default_transport(device=device)
            if t is not None:
                return t
        if not device and _world is not None:  # the common case, without imports (~0.1 us)
            t = _world[0](_world[1])
            if t is not None:
                return t
    elif isinstance(comm, Transport):
        return comm
    from mpi4py import MPI  # imported lazily: the loopback path needs no MPI

    from . import mpi

    if comm is None:
        comm = MPI.COMM_WORLD
        _check_launcher_world(comm)
        if not device:
            t = mpi.transport_for(comm)
            _world = (mpi.cached_transport, MPI.Comm.py2f(comm))
            return t
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, a giftcomm Transport or None, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise TypeError("comm is MPI.COMM_NULL: this process is not a member of the communicator")
    if not device:
        return mpi.transport_for(comm)  # thread-safe itself
    with _CREATE:
        key = MPI.Comm.py2f(comm)
        if key not in _device_cache:
            from .nccl import NcclTransport

            _device_cache[key] = NcclTransport.from_mpi(comm)
        return _device_cache[key]


def _check_launcher_world(world: Any) -> None:
    """``comm=None`` means MPI.COMM_WORLD here; under a launcher that started several ranks
    (torchrun: ``WORLD_SIZE`` > 1) while MPI's world is this process alone, that would reduce over
    this rank only and return its own values: raise instead, on every rank alike, naming the fix."""
    try:
        launched = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if launched > 1 and world.Get_size() == 1:
        raise RuntimeError(
            f"giftcomm: comm=None under a launcher of WORLD_SIZE={launched} ranks (torchrun) but "
            f"torch.distributed is not initialised and MPI's world is this process alone: call "
            f"torch.distributed.init_process_group(...) first (then comm=None reduces over its default group), "
            f"or pass comm= explicitly")


def release(comm: Any = None) -> None:
    """Free giftcomm's transports of an mpi4py communicator (None: MPI.COMM_WORLD), or what a
    giftcomm Transport keeps (its shared window and workspaces). Collective. A later call on the
    communicator builds a new transport; freeing the communicator (``comm.Free()``) releases its
    transport by itself."""
    if isinstance(comm, Transport):
        comm.release_state()
        return
    from mpi4py import MPI

    from . import mpi

    key = MPI.Comm.py2f(MPI.COMM_WORLD if comm is None else comm)
    with _CREATE:
        device = _device_cache.pop(key, None)
    if device is not None:
        device.free()
    mpi.release(comm)
