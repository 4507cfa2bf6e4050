"""The GPU path: CUDA kernels of the wire codec (CuPy RawModule), device transforms, a device ring.

Importing this package needs nothing beyond NumPy; CuPy is imported when a device function is
first called. ``available()`` says whether CuPy and a CUDA device are usable here.

- :mod:`giftcomm.cuda.codec`: encode / decode / decode_add_encode / decode_accumulate on CuPy
  arrays, the signatures of :mod:`giftcomm.codec`, bit-identical to giftcomm.reference.codec.
- :mod:`giftcomm.cuda.transform`: batched dense per-segment transforms (T_L @ X @ T_R) on the GPU.
- :mod:`giftcomm.cuda.ring`: the ring reduce-scatter / allgather over stream-ordered transports
  (NCCL, CUDA-aware MPI, the GPU loopback), on any array backend.
- :mod:`giftcomm.cuda._loader`: finds and compiles the CUDA sources (kernels/*.cu).
"""
from __future__ import annotations

__all__ = ["available", "device_count"]


def device_count() -> int:
    """Number of CUDA devices CuPy can use here (0 without CuPy, driver or device)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # ImportError, CUDARuntimeError (no driver / no device), ...
        return 0


def available() -> bool:
    """True when CuPy imports and at least one CUDA device is usable."""
    return device_count() > 0
