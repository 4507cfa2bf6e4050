"""Values per second of the native codec kernels for every block-scaled format and both roundings.

    python perf/bench_formats.py [--n 4M] [--repeats 7] [--rounds 1] [--isa avx512vbmi]
                                   [--data wide|normal|gradient] [--formats e4m3,nvfp4,mxfp4]

One row per (format, rounding, kernel): the median time of ``repeats`` calls on ``n`` values
(float32 inputs, 1-D; e4m3/e5m2 with block 256, the MX formats and nvfp4 with their own block,
the adaptive rows with their super-block of 256), as values per second, nanoseconds per value
and input GB/s (4 bytes per value). Single-threaded, like the kernels. With ``--rounds R`` the
whole table is measured R times, every round going through all formats in turn (so that a slow
spell of a shared host falls on all of them alike); each row then shows the median over the
rounds and the lowest and highest round. When nvfp4 is in the run, each adaptive row's time per
kernel and rounding is also printed as a ratio to nvfp4's, both from this run (the median of the
per-round ratios). ``--data gradient``: normal values, each 256-value block scaled by its own
log-normal factor (what the adaptive rows rank).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
from pathlib import Path

import numpy as np

from giftcomm import codec
from giftcomm.formats import get_format, message_nbytes, resolve_block

FORMATS = ("e4m3", "e5m2", "nvfp4", "mxfp4", "mxfp8", "mxfp8_e5m2", "ada4_5", "ada4")
#: the baseline each adaptive row's time is compared with
BASELINE = "nvfp4"


def _timing():
    """giftcomm/perf/timing.py of this checkout, loaded by path: the giftcomm on PYTHONPATH may be
    an older tree (a side-by-side run) that lacks it."""
    path = Path(__file__).resolve().parents[1] / "giftcomm" / "perf" / "timing.py"
    spec = importlib.util.spec_from_file_location("_checkout_timing", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def _commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=here, capture_output=True,
                               text=True, check=True).stdout.split()
        files = [os.path.basename(f) for f in dirty[1::2]]
        return head + (f" (uncommitted in native/: {', '.join(files)})" if files else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", default="4M")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--isa", default=None)
    p.add_argument("--data", choices=("wide", "normal", "gradient"), default="normal")
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
    elif a.data == "gradient":
        x *= np.repeat(np.exp(2 * rng.standard_normal(-(-n // 256))), 256)[:n].astype(np.float32)
    local = rng.standard_normal(n).astype(np.float32)
    k = codec.NativeKernels
    rows: dict[tuple[str, str, str], list[float]] = {}
    calls: list[tuple[tuple[str, str, str], object]] = []
    for name in a.formats.split(","):
        f = get_format(name)
        block = resolve_block(f, None)
        msg = np.empty(message_nbytes(n, f, block), np.uint8)
        out = np.empty_like(msg)
        dec = np.empty(n, np.float32)
        k.encode(x, f, block, msg)
        for rounding, key in (("nearest", None), ("stochastic", 1234)):
            fns = {
                "encode": lambda f=f, b=block, o=out, key=key: k.encode(x, f, b, o, key, 0),
                "decode_add_encode": lambda f=f, b=block, m=msg, o=out, key=key:
                    k.decode_add_encode(m, local, f, b, o, None, key, 0),
            }
            if rounding == "nearest":
                fns["decode"] = lambda f=f, b=block, m=msg, d=dec: k.decode(m, n, f, b, d)
                fns["decode_accumulate"] = lambda f=f, b=block, m=msg, d=dec: k.decode_accumulate(m, d, f, b)
            for kname, fn in fns.items():
                calls.append(((name, rounding, kname), fn))
                rows[(name, rounding, kname)] = []
    time_calls = _timing().time_calls
    for _ in range(a.rounds):
        for row, fn in calls:
            rows[row].append(n / time_calls(fn, a.repeats, warmup=1)[0] / 1e9)
    print(f"# native variant {codec.native_variant()}; n = {n}; data {a.data}; median of {a.repeats}"
          + (f", median of {a.rounds} rounds (lowest, highest round)" if a.rounds > 1 else "")
          + f"; commit {_commit()}")
    print(f"{'format':<11} {'rounding':<10} {'kernel':<18} {'Gvalues/s':>9} {'ns/value':>8} {'GB/s in':>8}"
          + (f"  {'rounds low-high':>15}" if a.rounds > 1 else ""))
    for (name, rounding, kname), v in rows.items():
        med = float(np.median(v))
        line = f"{name:<11} {rounding:<10} {kname:<18} {med:9.3f} {1 / med:8.3f} {4 * med:8.2f}"
        if a.rounds > 1:
            line += f"  {min(v):7.3f}-{max(v):.3f}"
        print(line)
    ratios = [(name, rounding, kname, float(np.median(np.divide(rows[(BASELINE, rounding, kname)], v))))
              for (name, rounding, kname), v in rows.items()
              if get_format(name).adaptive is not None and (BASELINE, rounding, kname) in rows]
    if ratios:
        print(f"# time per value of each adaptive row / {BASELINE}'s, same run (median of the per-round ratios)")
        for name, rounding, kname, r in ratios:
            print(f"{name + '/' + BASELINE:<15} {rounding:<10} {kname:<18} {r:6.2f}x")


if __name__ == "__main__":
    main()
