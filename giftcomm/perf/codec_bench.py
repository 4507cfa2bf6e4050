"""Codec kernel benchmark: native C kernels vs the NumPy reference vs a memory-copy roofline.

Prints a Markdown table of throughput in Melem/s (million float32 values per second) for the four
codec operations::

    encode              float32[n] -> wire message
    decode              wire message -> float32[n]
    decode_add_encode   wire message + float32[n] -> wire message (fused ring hop, no sum_out)
    decode_accumulate   float32[n] += decode(wire message)

Each cell is the median of repeated timings on one core (the process is pinned to one CPU where
the OS allows it). ``copy`` is ``np.copyto`` of the same float32 vector (read 4n + write 4n
bytes): a rough roofline for a pass that streams the data once.

Run: ``python -m giftcomm.perf codec`` or ``python -m giftcomm.perf.codec_bench``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable

import numpy as np

from .. import codec
from ..formats import Format, get_format, message_nbytes, resolve_block
from ..reference import codec as ref
from .common import Progress, add_fmt, add_json, add_out, parent_parser, split_list, time_calls
from .sizes import parse_size

__all__ = ["main", "run"]

OPS = ("encode", "decode", "decode_add_encode", "decode_accumulate")


def _native() -> bool:
    """Is the native C extension built (whatever GIFTCOMM_NATIVE says: this benchmark compares)?"""
    return codec.native_variant() is not None


def _median_seconds(fn: Callable[[], object], repeats: int, min_time: float) -> float:
    """Median wall time in seconds of ``fn()`` over at least ``repeats`` calls (after one warm-up),
    adding calls until ``min_time`` seconds have been spent in total (at most 10x repeats)."""
    return time_calls(fn, 10 * repeats, warmup=1, budget_s=min_time, min_iters=repeats)[0]


def _kernels(impl: str, f: Format, block: int, x: np.ndarray, local: np.ndarray) -> dict[str, Callable[[], object]]:
    """Closures for the four operations on preallocated buffers, for impl 'native' or 'numpy': the
    trusted kernels giftcomm runs on the host (codec.NativeKernels, codec.ReferenceKernels)."""
    n = x.size
    msg = ref.encode(x, f, block)
    msg_out = np.empty(message_nbytes(n, f, block), np.uint8)
    enc_out = np.empty_like(msg_out)
    dec_out = np.empty(n, np.float32)
    acc = np.zeros(n, np.float32)
    k = codec.NativeKernels if impl == "native" else codec.ReferenceKernels
    return {
        "encode": lambda: k.encode(x, f, block, enc_out),
        "decode": lambda: k.decode(msg, n, f, block, dec_out),
        "decode_add_encode": lambda: k.decode_add_encode(msg, local, f, block, msg_out, None),
        "decode_accumulate": lambda: k.decode_accumulate(msg, acc, f, block),
    }


DATA = {
    # every value scaled by its own 2^-20..2^19: most blocks hold values far below their amax,
    # so FP8-subnormal codes are common (the kernels' slower path)
    "wide": lambda rng, n: rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n)),
    # plain Gaussian: the typical block has no FP8-subnormal code
    "normal": lambda rng, n: rng.standard_normal(n),
}


def run(sizes: list[int], formats: list[str], block: int, repeats: int, min_time: float, seed: int,
        with_numpy: bool = True, data: str = "wide", progress: bool = False) -> list[dict]:
    """Measure every (format, size, op); return rows of dicts with Melem/s per implementation.

    Keys: fmt, n, op, native (or None when the extension is missing), numpy (or None), copy.
    ``data``: the input values, a key of :data:`DATA`.
    """
    rng = np.random.default_rng(seed)
    rows = []
    bar = Progress(len(sizes) * len(formats) * len(OPS), enabled=progress)
    for n in sizes:
        x = DATA[data](rng, n).astype(np.float32)
        local = rng.standard_normal(n).astype(np.float32)
        dst = np.empty_like(x)
        copy = n / _median_seconds(lambda: np.copyto(dst, x), repeats, min_time) / 1e6
        for fmt in formats:
            impls = {}
            fblock = resolve_block(fmt, block)
            if _native():
                impls["native"] = _kernels("native", get_format(fmt), fblock, x, local)
            if with_numpy:
                impls["numpy"] = _kernels("numpy", get_format(fmt), fblock, x, local)
            for op in OPS:
                bar.update(f"{fmt} n={n} {op}")
                row = {"fmt": fmt, "n": n, "op": op, "native": None, "numpy": None, "copy": copy}
                for impl, fns in impls.items():
                    reps = repeats if impl == "native" else max(3, repeats // 3)
                    row[impl] = n / _median_seconds(fns[op], reps, min_time) / 1e6
                rows.append(row)
    bar.close()
    return rows


def _fmt_rate(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def format_table(rows: list[dict]) -> str:
    """Markdown table of the rows returned by :func:`run`."""
    lines = [
        "| format | n | op | native M/s | numpy M/s | native/numpy | copy M/s | native/copy |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        nat, npy, cp = r["native"], r["numpy"], r["copy"]
        ratio = f"{nat / npy:.1f}x" if nat and npy else "-"
        roof = f"{nat / cp:.2f}" if nat else "-"
        lines.append(
            f"| {r['fmt']} | {r['n']:,} | {r['op']} | {_fmt_rate(nat)} | {_fmt_rate(npy)} | {ratio} | "
            f"{_fmt_rate(cp)} | {roof} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status (0)."""
    p = argparse.ArgumentParser(prog="giftcomm.perf codec", description=__doc__.split("\n\n")[0],
                                parents=[parent_parser(seed=0)])
    p.add_argument("--sizes", default="64K,16M", help="comma-separated element counts (K/M suffixes), default 64K,16M")
    add_fmt(p, "e4m3,bf16", "comma-separated formats")
    p.add_argument("--block", type=int, default=None,
                   help="elements per scale (default: each format's own: 256; 16 for nvfp4, 32 for MX)")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per cell (median), default 15")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per cell to aim for, default 0.3")
    p.add_argument("--isa", default=None, help="native kernel variant (generic, avx2, avx512, avx512vbmi); default: best")
    p.add_argument("--data", default="wide", choices=list(DATA),
                   help="input values: wide (per-value magnitudes 2^-20..2^19, many FP8-subnormal codes; "
                        "the default) or normal (Gaussian)")
    p.add_argument("--no-numpy", action="store_true", help="skip the NumPy reference codec (it is slow)")
    p.add_argument("--no-pin", action="store_true", help="do not pin the process to one CPU")
    add_out(p, help="also write the result as Markdown to this file")
    add_json(p, help="also write the rows as JSON to this file")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)

    isa = codec.native_variant()
    if args.isa:
        if isa is None:
            p.error("--isa: the native extension is not built")
        codec.use_native_variant(args.isa)
        isa = codec.native_variant()
    pinned = None
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[-1]})
        pinned = cpus[-1]

    sizes = [parse_size(s) for s in split_list(args.sizes)]
    formats = [get_format(s).name for s in split_list(args.fmt)]
    try:
        rows = run(sizes, formats, args.block, args.repeats, args.min_time, args.seed, not args.no_numpy, args.data,
                   progress=not args.no_progress)
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, set(cpus))
    header = (
        f"native kernels: {isa or 'not built'}; block {args.block or 'per format'}; data {args.data}; "
        f"one core{f' (pinned to CPU {pinned})' if pinned is not None else ''}; median of >= {args.repeats} "
        f"calls; Melem/s = 10^6 float32 values per second"
    )
    text = header + "\n\n" + format_table(rows)
    print(text)
    if args.out:
        cmd = "python -m giftcomm.perf codec" + "".join(" " + shlex.quote(a) for a in argv
                                                       if a not in ("--out", args.out))
        with open(args.out, "w") as fh:
            fh.write(f"# Codec kernel throughput\n\n```\n{cmd}\n```\n\n{text}\n")
    if args.json:
        import json

        import giftcomm

        with open(args.json, "w") as fh:
            json.dump({"tool": "giftcomm.perf codec", "giftcomm_version": giftcomm.__version__,
                       "native_isa": isa, "block": args.block, "data": args.data,
                       "units": "Melem/s", "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
