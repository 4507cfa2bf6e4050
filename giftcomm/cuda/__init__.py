"""The GPU's kernels: CUDA kernels of the wire codec (CuPy RawModule) and their loader.

Importing this package needs nothing beyond NumPy; CuPy is imported when a device function is
first called. ``available()`` says whether CuPy and a CUDA device are usable here.

- :mod:`giftcomm.cuda.codec`: the trusted CUDA kernels behind :mod:`giftcomm.codec` for CuPy
  arrays, bit-identical to giftcomm.reference.codec.
- :mod:`giftcomm.cuda._loader`: finds and compiles the CUDA sources (kernels/*.cu), for this
  package and for the geometry's device pieces (giftcomm.geometry.fused: the GIFT transform
  fused into the codec, kernels/gc_fused.cu).

This package sits below the geometry and the codec (it imports only the format table), so the
device transforms that take a Geometry live in giftcomm.geometry (fused, fused_model,
dense_plan). The collectives themselves are giftcomm.collectives, one implementation for host
and device.
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
