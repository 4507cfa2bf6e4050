"""Array backend: NumPy / CuPy dispatch, DLPack in and out, the dtype table.

- :func:`array_module` gives ``numpy`` or ``cupy`` for an array; :func:`is_device_array` says
  whether an object lives in CUDA device memory (CuPy, or anything exposing
  ``__cuda_array_interface__`` or a CUDA ``__dlpack_device__``).
- :func:`import_array` takes any DLPack producer (torch tensors, JAX arrays, CuPy, NumPy...) in
  zero-copy: CUDA producers through ``cupy.from_dlpack``, CPU ones through ``numpy.from_dlpack``.
  bfloat16 has no CuPy dtype, so on the device a bfloat16 array is carried as its uint16 bit
  pattern with ``logical = "bfloat16"``; :func:`to_float32` / :func:`from_float32` convert.
- :func:`export_like` hands a result back to the producer's framework (DLPack, zero-copy).

Importing this module never imports CuPy; it is imported on the first device array.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "DTYPES", "DtypeInfo", "Imported", "array_module", "is_device_array", "import_array", "export_like",
    "to_float32", "from_float32", "bf16_bits_from_float32", "dtype_info", "synchronize", "device_pointer", "data_pointer",
    "DLPACK_CPU", "DLPACK_CUDA",
    "astype", "add_inplace", "add",
]

DLPACK_CPU, DLPACK_CUDA, DLPACK_CUDA_HOST, DLPACK_CUDA_MANAGED = 1, 2, 3, 13


@dataclass(frozen=True)
class DtypeInfo:
    """One floating dtype giftcomm accepts.

    name: logical name ("float32", ...). host: NumPy dtype on the CPU. device_storage: the CuPy
    dtype that holds it on the GPU (uint16 for bfloat16: the bit pattern). itemsize: bytes.
    code: the dtype code of cross-rank signatures (giftcomm.collectives.agree.DTYPE_CODES).
    """

    name: str
    host: np.dtype
    device_storage: np.dtype
    itemsize: int
    code: int


DTYPES: dict[str, DtypeInfo] = {
    d.name: d
    for d in (
        DtypeInfo("float32", np.dtype(np.float32), np.dtype(np.float32), 4, 1),
        DtypeInfo("float64", np.dtype(np.float64), np.dtype(np.float64), 8, 2),
        DtypeInfo("float16", np.dtype(np.float16), np.dtype(np.float16), 2, 3),
        DtypeInfo("bfloat16", np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16), 2, 4),
    )
}


_BY_HOST_DTYPE = {info.host: info for info in DTYPES.values()}  # the per-call lookup (dtype.name costs ~5 us)


def dtype_info(name_or_dtype: Any) -> DtypeInfo:
    """The table entry of a dtype (name, NumPy dtype, or a framework dtype whose str ends in the
    name, e.g. ``torch.bfloat16``); ValueError when giftcomm does not take it."""
    info = _BY_HOST_DTYPE.get(name_or_dtype) if isinstance(name_or_dtype, np.dtype) else None
    if info is not None:
        return info
    if isinstance(name_or_dtype, (np.dtype, type)) and not str(name_or_dtype).startswith("torch"):
        try:
            name_or_dtype = np.dtype(name_or_dtype).name
        except TypeError:
            pass
    name = str(name_or_dtype).rsplit(".", 1)[-1]
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name_or_dtype!r}; giftcomm takes {', '.join(DTYPES)}") from None


def _cupy():
    import cupy

    return cupy


def _cupy_loaded_array(x: Any) -> bool:
    cp = sys.modules.get("cupy")
    return cp is not None and isinstance(x, cp.ndarray)


def is_device_array(x: Any) -> bool:
    """True for arrays in CUDA device memory: CuPy arrays, ``__cuda_array_interface__`` exporters,
    DLPack producers whose device type is CUDA (or CUDA managed). NumPy arrays: False."""
    if isinstance(x, np.ndarray):
        return False
    if _cupy_loaded_array(x) or hasattr(x, "__cuda_array_interface__"):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        try:
            return int(dev()[0]) in (DLPACK_CUDA, DLPACK_CUDA_MANAGED)
        except Exception:
            return False
    return False


def array_module(x: Any) -> Any:
    """``cupy`` for device arrays (CuPy or other CUDA producers), ``numpy`` for everything else."""
    if isinstance(x, np.ndarray):
        return np
    if _cupy_loaded_array(x):
        return sys.modules["cupy"]
    if is_device_array(x):
        return _cupy()
    return np


@dataclass
class Imported:
    """An array taken in from a caller.

    array: a NumPy or CuPy array sharing the producer's memory (zero-copy). logical: its dtype
    name in :data:`DTYPES` (for bfloat16 on the device, ``array`` holds the uint16 bit pattern).
    source: "numpy", "cupy", "torch", "jax" or "dlpack" (another producer). device: True on the GPU.
    """

    array: Any
    logical: str
    source: str
    device: bool

    @property
    def xp(self) -> Any:
        return _cupy() if self.device else np


def _source_of(obj: Any) -> str:
    mod = type(obj).__module__.split(".", 1)[0]
    if mod in ("torch", "jax", "jaxlib"):
        return "jax" if mod == "jaxlib" else mod
    return "dlpack"


def import_array(obj: Any) -> Imported:
    """Take any array in, zero-copy.

    NumPy and CuPy arrays pass through; other objects go through DLPack: a CUDA producer (torch
    CUDA tensor, JAX GPU array) via ``cupy.from_dlpack``, a CPU producer via ``numpy.from_dlpack``.
    bfloat16: on the host an ``ml_dtypes.bfloat16`` view, on the device a uint16 view of the bits.
    Objects without DLPack fall back to ``numpy.asarray`` (``__cuda_array_interface__`` ones to
    ``cupy.asarray``). Raises ValueError for dtypes giftcomm does not take.
    """
    if isinstance(obj, np.ndarray):
        return Imported(obj, dtype_info(obj.dtype).name, "numpy", False)
    if _cupy_loaded_array(obj):
        return Imported(obj, dtype_info(obj.dtype).name, "cupy", True)
    source = _source_of(obj)
    if source == "torch" and getattr(obj, "requires_grad", False):
        obj = obj.detach()  # the same memory; DLPack refuses tensors that require grad
    dtype_name = str(getattr(obj, "dtype", "")).rsplit(".", 1)[-1]
    bf16 = dtype_name == "bfloat16"
    if hasattr(obj, "__dlpack__"):
        device = is_device_array(obj)
        # a bfloat16 array goes as its bits, which DLPack consumers that do not know bfloat16
        # (NumPy, CuPy 13) take: torch as an int16 view (no copy), JAX as a uint16 bitcast on the
        # JAX side (JAX arrays are immutable, so a new array of the same bits)
        producer = obj
        if bf16 and source == "torch":
            producer = obj.view(sys.modules["torch"].int16)
        elif bf16 and source == "jax":
            import jax

            producer = jax.lax.bitcast_convert_type(obj, np.uint16)
        if device:
            arr = _cupy().from_dlpack(producer)
            if bf16:
                arr = arr.view(np.uint16)
        else:
            arr = np.from_dlpack(producer)
            if bf16:
                arr = arr.view(ml_dtypes.bfloat16)
        return Imported(arr, "bfloat16" if bf16 else dtype_info(arr.dtype).name, source, device)
    if hasattr(obj, "__cuda_array_interface__"):
        arr = _cupy().asarray(obj)
        return Imported(arr, dtype_info(arr.dtype).name, source, True)
    arr = np.asarray(obj)
    return Imported(arr, dtype_info(arr.dtype).name, source, False)


def export_like(result: Any, imported: Imported) -> Any:
    """Give ``result`` (NumPy/CuPy, holding ``imported.logical`` values; bfloat16 on the device as
    uint16 bits) back in the caller's framework, zero-copy: a torch tensor for torch input, a JAX
    array for JAX input, the array itself otherwise."""
    if imported.source == "torch":
        import torch

        if imported.logical == "bfloat16":
            bits = result.view(np.int16)
            return torch.from_dlpack(bits).view(torch.bfloat16)
        return torch.from_dlpack(result)
    if imported.source == "jax":
        import jax.numpy as jnp

        if imported.logical == "bfloat16":
            return jnp.from_dlpack(result.view(np.uint16)).view(jnp.bfloat16)
        return jnp.from_dlpack(result)
    return result


def to_float32(x: Any, logical: str | None = None) -> Any:
    """float32 copy of ``x`` (NumPy or CuPy). For bfloat16 stored as uint16 bits (device), pass
    ``logical="bfloat16"``: the bits are widened exactly (bits << 16)."""
    if logical == "bfloat16" and x.dtype in (np.uint16, np.int16):
        return (x.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return x.astype(np.float32)


def from_float32(y: Any, logical: str) -> Any:
    """Cast float32 ``y`` (NumPy or CuPy) to the logical dtype, rounding to nearest even.

    bfloat16 on the device comes back as uint16 bits (NaN -> quiet NaN with its sign, overflow ->
    Inf, as ml_dtypes); on the host as ``ml_dtypes.bfloat16``. Other dtypes: ``astype``.
    """
    xp = array_module(y)
    info = dtype_info(logical)
    if info.name != "bfloat16":
        return y.astype(info.host)
    if xp is np:
        return y.astype(ml_dtypes.bfloat16)
    return bf16_bits_from_float32(y)


def bf16_bits_from_float32(y: Any) -> Any:
    """The bfloat16 bit patterns (uint16) of float32 ``y`` on any backend (RNE, like ml_dtypes)."""
    xp = array_module(y)
    u = xp.ascontiguousarray(y, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = ((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0)
    is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return xp.where(is_nan, nan, rounded).astype(np.uint16)


def synchronize(x: Any) -> None:
    """Wait until the work queued on CuPy's current stream is done, for device arrays; no-op for
    host arrays and foreign ``__cuda_array_interface__`` objects without CuPy loaded."""
    if _cupy_loaded_array(x):
        sys.modules["cupy"].cuda.get_current_stream().synchronize()


def data_pointer(x: Any) -> int:
    """The address of an array's first byte: host (NumPy) or device (CuPy, CUDA interface)."""
    if isinstance(x, np.ndarray):
        return int(x.ctypes.data)
    return device_pointer(x)


def device_pointer(x: Any) -> int:
    """The data pointer of a device array (CuPy, or a ``__cuda_array_interface__`` exporter)."""
    if _cupy_loaded_array(x):
        return int(x.data.ptr)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"{type(x).__name__} is not a device array")
    return int(cai["data"][0])



# ---------------------------------------------------------------- float arithmetic of the collectives
# CuPy compiles its elementwise kernels (+, +=, astype) with -ftz=true: a float32 subnormal input
# or result becomes zero, which NumPy (and the reference) never does. The collectives' float work on
# device arrays therefore goes through these three, which use giftcomm's non-.ftz kernels there
# (giftcomm.cuda.codec) and plain NumPy on the host. float16 casts need nothing: a float16 is never
# a float32 subnormal, and a float32 subnormal rounds to a float16 zero of its sign either way.
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


def astype(x: Any, dtype: Any, copy: bool = True) -> Any:
    """``x.astype(dtype, copy=copy)``; on the device float32 <-> float64 without flush-to-zero."""
    if isinstance(x, np.ndarray):
        return x.astype(dtype, copy=copy)
    dt = np.dtype(dtype)
    if x.dtype == dt:
        return x.copy() if copy else x
    if {x.dtype, dt} == {_F32, _F64}:
        from .cuda.codec import convert

        return convert(x if x.flags.c_contiguous else x.copy(), dt)
    return x.astype(dt, copy=copy)


def add_inplace(acc: Any, x: Any) -> Any:
    """``acc += x`` (same dtype and size); on the device float32 without flush-to-zero."""
    if isinstance(acc, np.ndarray) or acc.dtype != _F32:
        acc += x
        return acc
    from .cuda.codec import add_inplace as device_add_inplace

    return device_add_inplace(acc, x)


def add(a: Any, b: Any) -> Any:
    """``a + b`` (same dtype and size, a new array); on the device float32 without flush-to-zero."""
    if isinstance(a, np.ndarray) or a.dtype != _F32:
        return a + b
    from .cuda.codec import add as device_add

    return device_add(a, b)
