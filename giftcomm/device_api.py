"""The device (CuPy / DLPack GPU) path of the public collectives.

gift_allreduce / allreduce hand device arrays here: the input is imported zero-copy (CuPy arrays
as they are, torch CUDA tensors and JAX GPU arrays through DLPack), the ranks agree on the call
exactly as on the host path, and :func:`giftcomm.cuda.ring.allreduce` runs the ring with the CUDA
codec over a device-capable transport. The result comes back in the caller's framework.

Transports: a device transport passed as ``comm`` (giftcomm.transport.nccl.NcclTransport,
giftcomm.transport.device_mpi.DeviceMpiTransport, a DeviceLoopbackGroup's transports), or an
mpi4py communicator / None, for which an NCCL transport is created once per communicator (the
NCCL unique id is broadcast over it).

Not yet on the device: geometries (their transforms run on the host; giftcomm.cuda.transform has
the batched CuPy kernels), the pipelined slices and the algorithms other than the ring.
Unverified on a GPU in this repository's CI: see docs/gpu.md.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _xp
from .collectives.agree import DTYPE_CODES, OP_CODES, agree
from .formats import check_block, get_format
from .transport import Transport

_nccl_cache: dict[int, Transport] = {}
_FIELDS = ("count", "dtype", "fmt", "block", "op")


def device_transport(comm: Any) -> Transport:
    """The transport for device buffers: ``comm`` itself if it is a Transport, else NCCL over the
    mpi4py communicator (COMM_WORLD for None), created once (collectively)."""
    if isinstance(comm, Transport):
        return comm
    from mpi4py import MPI

    from .transport.nccl import NcclTransport

    comm = MPI.COMM_WORLD if comm is None else comm
    key = MPI.Comm.py2f(comm)
    if key not in _nccl_cache:
        _nccl_cache[key] = NcclTransport.from_mpi(comm)
    return _nccl_cache[key]


def device_allreduce(x: Any, geometry: Any, comm: Any, op: str, fmt: Any, block: int, out: Any,
                     algorithm: str) -> Any:
    """gift_allreduce for a device array ``x`` (see the module docstring)."""
    from .cuda import ring as device_ring

    t = device_transport(comm)

    def prepare():
        imp = _xp.import_array(x)
        f, b = get_format(fmt), check_block(block)
        if op not in OP_CODES:
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        if imp.logical not in DTYPE_CODES:
            raise TypeError(f"x must be float32, float64, float16 or bfloat16, got {imp.logical}")
        if geometry is not None and not geometry.is_identity:
            raise TypeError("geometries are not supported on device arrays yet (see docs/gpu.md)")
        if algorithm not in ("auto", "ring"):
            raise ValueError(f"device arrays run the ring algorithm only, got algorithm={algorithm!r}")
        if out is not None and (tuple(out.shape) != tuple(imp.array.shape) or not _xp.is_device_array(out)):
            raise ValueError("out must be a device array of x's shape")
        sig = dict(count=imp.array.size, dtype=DTYPE_CODES[imp.logical], fmt=f.code, block=b, op=OP_CODES[op])
        return (imp, f, b), sig

    (imp, f, b), _ = agree(t, "giftcomm.allreduce", prepare, _FIELDS, _FIELDS)
    arr = imp.array
    if imp.logical == "bfloat16":
        values = _xp.to_float32(arr, "bfloat16")
        result = _xp.from_float32(device_ring.allreduce(t, values, f, b, op), "bfloat16")
    else:
        result = device_ring.allreduce(t, arr, f, b, op)
    if out is not None:
        out[...] = result
        return out
    return _xp.export_like(result, imp)


def is_device_input(x: Any) -> bool:
    """True for CuPy arrays and GPU DLPack / __cuda_array_interface__ producers."""
    return not isinstance(x, np.ndarray) and _xp.is_device_array(x)
