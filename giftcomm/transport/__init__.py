"""Transports: how bytes move between ranks (MPI, in-process loopback)."""
from __future__ import annotations

from typing import Any

from .base import Request, Transport, wait_all
from .loopback import LoopbackGroup, LoopbackTransport

__all__ = ["Request", "Transport", "wait_all", "LoopbackGroup", "LoopbackTransport", "resolve"]


def resolve(comm: Any) -> Transport:
    """The transport for a ``comm=`` argument: a Transport as is, an mpi4py communicator, or None
    for MPI.COMM_WORLD."""
    if isinstance(comm, Transport):
        return comm
    from . import mpi  # imported lazily: the loopback path needs no MPI

    if comm is None:
        return mpi.transport_for(None)
    from mpi4py import MPI

    if isinstance(comm, MPI.Comm):
        return mpi.transport_for(comm)
    raise TypeError(f"comm must be an mpi4py communicator, a giftcomm Transport or None, got {type(comm).__name__}")
