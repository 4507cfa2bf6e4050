"""The device (CuPy / DLPack GPU) path of the public collectives.

giftcomm.allreduce / gift_allreduce / reduce_scatter / allgather hand device arrays here
(:func:`is_device_input`). Each call:

1. imports the input zero-copy (CuPy arrays as they are, torch CUDA tensors and JAX GPU arrays
   through DLPack; bfloat16 on the device is carried as its uint16 bits, see giftcomm._xp);
2. agrees on the call across ranks with the host path's signature fields and messages
   (giftcomm.collectives.agree; the field lists are giftcomm.api's), so bad or mismatched
   arguments raise the same exception on every rank;
3. runs the stream-ordered collectives of giftcomm.cuda (:mod:`~giftcomm.cuda.ring`, and
   :mod:`~giftcomm.cuda.direct` for ``algorithm="direct"``) with the CUDA codec over a
   device-capable transport, in float32 (float64 for float64 input);
4. applies ``avg``, casts back to the input's dtype and writes ``out`` (an array of the input's
   backend, shape and dtype) or returns the result in the caller's framework
   (giftcomm._xp.export_like).

Results equal the host path and ``giftcomm.reference`` simulations bit for bit. The functions
run on any backend: the CPU tests drive them with NumPy arrays over the device loopback.

Algorithms on device arrays: "ring", "direct" and "auto" (the cost model's choice when it is
ring or direct, else ring). Geometries: ``geometry.forward`` / ``inverse`` run on the input's
backend (giftcomm.geometry; giftcomm.cuda.transform for CuPy) around the device allreduce.
Host (NumPy) arrays only: "doubling", "hierarchical", "hierarchical_direct", the pipelined
slices (``slice_elems`` is checked and agreed on, and changes nothing on the device).

Transports: a device transport passed as ``comm`` (giftcomm.transport.nccl.NcclTransport,
giftcomm.transport.device_mpi.DeviceMpiTransport, a DeviceLoopbackGroup's transports), or an
mpi4py communicator / None, for which an NCCL transport is created once per communicator (the
NCCL unique id is broadcast over it). Unverified on a GPU in this repository's CI: docs/gpu.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _xp
from .collectives.agree import DTYPE_CODES, OP_CODES, agree
from .formats import Format, check_block, get_format
from .partition import accumulation_dtype, shared_chunk_bounds
from .transport import Transport

__all__ = ["DEVICE_ALGORITHMS", "device_transport", "device_allreduce", "device_reduce_scatter",
           "device_allgather", "is_device_input"]

DEVICE_ALGORITHMS = ("auto", "ring", "direct")
_nccl_cache: dict[int, Transport] = {}


def _host_api() -> Any:
    """giftcomm.api (imported here, not at module level: it imports this module)."""
    from . import api

    return api


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


def is_device_input(x: Any) -> bool:
    """True for CuPy arrays and GPU DLPack / __cuda_array_interface__ producers."""
    return not isinstance(x, np.ndarray) and _xp.is_device_array(x)


@dataclass
class DeviceCall:
    """A call validated on this rank.

    imp: the imported input (``imp.array``: NumPy or CuPy, any shape; bfloat16 on the device as
    uint16 bits). fmt, block: the wire format. sig: this rank's signature (giftcomm.api's field
    names -> int64). out: the imported ``out`` array (the caller's memory) or None.
    """

    imp: _xp.Imported
    fmt: Format
    block: int
    sig: dict[str, int]
    out: Any = None

    @property
    def arr(self) -> Any:
        """The imported array (what giftcomm.api's planning reads: ``arr.size``)."""
        return self.imp.array


def _import(x: Any, name: str) -> _xp.Imported:
    """``x`` imported zero-copy; TypeError (the host path's message) for dtypes giftcomm does not take."""
    try:
        return _xp.import_array(x)
    except ValueError:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got dtype "
                        f"{getattr(x, 'dtype', type(x).__name__)}") from None


def _validate(x: Any, name: str, fmt: Any, block: Any, op: str | None, slice_elems: Any) -> DeviceCall:
    """Local checks and this rank's signature (op None: allgather); raises TypeError/ValueError."""
    api = _host_api()
    imp = _import(x, name)
    f, b = get_format(fmt), check_block(block)
    if op is not None and op not in OP_CODES:
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    sig = dict.fromkeys(api._FIELDS, 0)
    sig.update(count=int(imp.array.size), dtype=DTYPE_CODES[imp.logical], fmt=f.code, block=b,
               op=OP_CODES.get(op, 0))
    if slice_elems is not None:
        sig["slice"] = api._positive_int(slice_elems, "slice_elems")
    return DeviceCall(imp, f, b, sig)


def _import_out(out: Any, call: DeviceCall, shape: tuple[int, ...] | None) -> Any:
    """``out`` imported zero-copy (None stays None) after checking: the input's backend (host or
    CUDA, not JAX: its arrays are immutable), the input's dtype and ``shape`` (None: any)."""
    if out is None:
        return None
    o = _import(out, "out")
    if o.device != call.imp.device or o.source == "jax":
        where = "a CUDA" if call.imp.device else "a host (NumPy)"
        raise TypeError(f"out must be {where} array, like the input; got {type(out).__name__}")
    got = tuple(o.array.shape)
    if (shape is not None and got != shape) or o.logical != call.imp.logical:
        raise ValueError(f"out must have shape {shape} and dtype {call.imp.logical}, got {got} {o.logical}")
    if not o.device and not o.array.flags.writeable:
        raise ValueError("out is read-only")
    return o.array


def _plan(t: Transport, call: DeviceCall, algorithm: str, local_size: int | None) -> None:
    """Record the algorithm (and auto's choice, restricted to ring/direct) in the signature."""
    api = _host_api()
    if algorithm in api.ALGORITHMS and algorithm not in DEVICE_ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} runs on host (NumPy) arrays only; device arrays take "
                         f"{', '.join(DEVICE_ALGORITHMS)}")
    api._plan_algorithm(t, call, algorithm, local_size, DEVICE_ALGORITHMS)


def _chosen(table: np.ndarray) -> str:
    """The algorithm rank 0 chose (every rank runs that one)."""
    api = _host_api()
    return api.ALGORITHMS[int(table[0, api._FIELDS.index("chosen")])]


def _scatter(algorithm: str) -> Any:
    """The stream-ordered reduce-scatter of a resolved device algorithm ("ring" or "direct")."""
    from .cuda import direct, ring

    return direct.reduce_scatter if algorithm == "direct" else ring.reduce_scatter


def _geometry_signature(geometry: Any, call: DeviceCall) -> Any:
    """The geometry to apply (None for none / identity); records its fingerprint in the signature."""
    if geometry is None or geometry.is_identity:
        return None
    if geometry.size != call.arr.size:
        raise ValueError(f"geometry covers {geometry.size} elements but x has {call.arr.size}")
    call.sig["geometry"] = int(geometry.fingerprint())
    return geometry


def _flat_values(call: DeviceCall) -> Any:
    """The input as a contiguous (size,) array of its backend: bfloat16 widened to float32
    (exact), other dtypes as they are (no copy when already contiguous)."""
    arr = call.imp.array
    if call.imp.logical == "bfloat16":
        arr = _xp.to_float32(arr, "bfloat16")
    return call.imp.xp.ascontiguousarray(arr).reshape(-1)


def _as_f32(xp: Any, values: Any) -> Any:
    """A geometry's output as a contiguous float32 (size,) array of backend ``xp``."""
    return xp.ascontiguousarray(xp.asarray(values, dtype=np.float32)).reshape(-1)


def _finish(values: Any, op: str, p: int, call: DeviceCall, shape: tuple[int, ...], out: Any) -> Any:
    """``avg`` (a division by P in ``values``' dtype), cast to the input's dtype (bfloat16 on the
    device: bits, rounded to nearest even), ``shape``; write ``out`` (returned as the caller passed
    it) or return the result in the caller's framework."""
    if op == "avg":
        values = values / values.dtype.type(p)
    with np.errstate(over="ignore", invalid="ignore"):
        if call.imp.logical == "bfloat16":
            result = _xp.from_float32(values, "bfloat16")
        else:
            result = values.astype(call.arr.dtype, copy=False)
    result = result.reshape(shape)
    if call.out is not None:
        call.out[...] = result
        return out
    return _xp.export_like(result, call.imp)


def device_allreduce(x: Any, geometry: Any, comm: Any, op: str, fmt: Any, block: int, out: Any,
                     algorithm: str, local_size: int | None = None, slice_elems: int | None = None) -> Any:
    """giftcomm.gift_allreduce / allreduce for an array on the device path.

    x: any shape, float32/float64/float16/bfloat16, CuPy or a CUDA DLPack producer (NumPy works
    too). geometry: None, or a giftcomm.geometry.Geometry of x.size elements whose
    forward/inverse take arrays of x's backend; its fingerprint must agree on all ranks.
    Returns x's shape and dtype in the caller's framework (``out`` if given), equal bit for bit
    to ``simulate_gift_allreduce`` / ``simulate_allreduce`` with the algorithm that ran.
    """
    api = _host_api()
    t = device_transport(comm)

    def prepare():
        call = _validate(x, "x", fmt, block, op, slice_elems)
        call.out = _import_out(out, call, tuple(call.arr.shape))
        geo = _geometry_signature(geometry, call)
        _plan(t, call, algorithm, local_size)
        return (call, geo), call.sig

    (call, geo), table = agree(t, "giftcomm.allreduce", prepare, api._FIELDS, api._MATCH)
    xp = call.imp.xp
    flat = _flat_values(call)
    if geo is not None:
        flat = _as_f32(xp, geo.forward(flat))
    if flat.size == 0:
        total = xp.zeros(0, accumulation_dtype(flat.dtype))
    else:
        from .cuda import ring

        total = ring.allreduce_flat(t, flat, call.fmt, call.block, scatter=_scatter(_chosen(table)))
    if geo is not None:
        total = _as_f32(xp, geo.inverse(total))
    return _finish(total, op, t.size, call, tuple(call.arr.shape), out)


def device_reduce_scatter(x: Any, comm: Any, op: str, fmt: Any, block: int, out: Any, algorithm: str,
                          slice_elems: int | None = None) -> Any:
    """giftcomm.reduce_scatter on the device path: this rank's shard (chunk ``rank`` of
    ``chunk_bounds(x.size, P, block)``), 1-D, x's dtype, the owner's sum (not re-quantized);
    equal bit for bit to ``simulate_reduce_scatter(..., algorithm)`` (ring, or direct)."""
    api = _host_api()
    t = device_transport(comm)

    def prepare():
        call = _validate(x, "x", fmt, block, op, slice_elems)
        bounds = shared_chunk_bounds(call.arr.size, t.size, call.block)
        call.out = _import_out(out, call, (int(bounds[t.rank + 1] - bounds[t.rank]),))
        _plan(t, call, algorithm, None)
        return (call, bounds), call.sig

    (call, bounds), table = agree(t, "giftcomm.reduce_scatter", prepare, api._FIELDS, api._MATCH)
    flat = _flat_values(call)
    acc_t = accumulation_dtype(flat.dtype)
    if flat.size == 0:
        total = call.imp.xp.zeros(0, acc_t)
    else:
        total, _ = _scatter(_chosen(table))(t, flat, bounds, call.fmt, call.block, acc_t)
    return _finish(total, op, t.size, call, (int(bounds[t.rank + 1] - bounds[t.rank]),), out)


def device_allgather(shard: Any, comm: Any, fmt: Any, block: int, out: Any, slice_elems: int | None = None) -> Any:
    """giftcomm.allgather on the device path: every rank's shard (read flat; lengths may differ),
    in rank order, 1-D, the shard's dtype; each shard encoded once by its owner, every rank
    decodes the same bytes (``simulate_allgather`` bit for bit). ``out``: 1-D, all the values."""
    from .cuda import ring

    t = device_transport(comm)
    api = _host_api()

    def prepare():
        call = _validate(shard, "shard", fmt, block, None, slice_elems)
        call.out = _import_out(out, call, None)
        if call.out is not None and call.out.ndim != 1:
            raise ValueError(f"out must be 1-D, got shape {tuple(call.out.shape)}")
        sig = {k: call.sig[k] for k in api._GATHER_FIELDS if k != "out"}
        sig["out"] = -1 if call.out is None else int(call.out.size)
        return call, sig

    call, table = agree(t, "giftcomm.allgather", prepare, api._GATHER_FIELDS, api._GATHER_MATCH)
    counts, total_n = api._gathered_counts(table)
    flat = _flat_values(call)
    codec = ring.codec_for(flat)
    own = codec.encode(flat.astype(np.float32, copy=False), call.fmt, call.block)
    values = ring.allgather(t, own, counts, call.fmt, call.block, codec)
    return _finish(values, "sum", t.size, call, (total_n,), out)
