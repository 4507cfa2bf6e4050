"""The GPU pieces: CUDA kernels of the wire codec (CuPy RawModule) and device transforms.

Importing this package needs nothing beyond NumPy; CuPy is imported when a device function is
first called. ``available()`` says whether CuPy and a CUDA device are usable here.

- :mod:`giftcomm.cuda.codec`: the trusted CUDA kernels behind :mod:`giftcomm.codec` for CuPy
  arrays, bit-identical to giftcomm.reference.codec.
- :mod:`giftcomm.cuda.transform`: batched dense per-segment transforms (T_L @ X @ T_R) on the GPU.
The collectives themselves are giftcomm.collectives, one implementation for host and device.
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
