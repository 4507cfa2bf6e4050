"""Values per second of the native codec kernels for every block-scaled format and both roundings.

    python native/bench_formats.py [--n 4M] [--repeats 7] [--isa avx512vbmi] [--data wide|normal]

One row per (format, rounding, kernel): the median time of ``repeats`` calls on ``n`` values
(float32 inputs, 1-D; e4m3/e5m2 with block 256, the MX formats and nvfp4 with their own block),
as values per second and as input GB/s (4 bytes per value). Single-threaded, like the kernels.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from giftcomm import codec
from giftcomm.formats import get_format, message_nbytes, resolve_block

FORMATS = ("e4m3", "e5m2", "nvfp4", "mxfp4", "mxfp8", "mxfp8_e5m2")


def _size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", default="4M")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--isa", default=None)
    p.add_argument("--data", choices=("wide", "normal"), default="normal")
    p.add_argument("--formats", default=",".join(FORMATS))
    a = p.parse_args()
    if a.isa:
        codec.use_native_variant(a.isa)
    try:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    except (AttributeError, OSError):
        pass
    n = _size(a.n)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    if a.data == "wide":
        x *= np.exp2(rng.uniform(-20, 19, n)).astype(np.float32)
    local = rng.standard_normal(n).astype(np.float32)
    k = codec.NativeKernels
    print(f"# native variant {codec.native_variant()}; n = {n}; data {a.data}; median of {a.repeats}")
    print(f"{'format':<11} {'rounding':<10} {'kernel':<18} {'Gvalues/s':>9} {'GB/s in':>8}")
    for name in a.formats.split(","):
        f = get_format(name)
        block = resolve_block(f, None)
        msg = np.empty(message_nbytes(n, f, block), np.uint8)
        out = np.empty_like(msg)
        dec = np.empty(n, np.float32)
        k.encode(x, f, block, msg)
        for rounding, key in (("nearest", None), ("stochastic", 1234)):
            calls = {
                "encode": lambda: k.encode(x, f, block, out, key, 0),
                "decode_add_encode": lambda: k.decode_add_encode(msg, local, f, block, out, None, key, 0),
            }
            if rounding == "nearest":
                calls["decode"] = lambda: k.decode(msg, n, f, block, dec)
                calls["decode_accumulate"] = lambda: k.decode_accumulate(msg, dec, f, block)
            for kname, fn in calls.items():
                fn()
                ts = []
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                t = float(np.median(ts))
                print(f"{name:<11} {rounding:<10} {kname:<18} {n / t / 1e9:9.3f} {4 * n / t / 1e9:8.2f}")


if __name__ == "__main__":
    main()
