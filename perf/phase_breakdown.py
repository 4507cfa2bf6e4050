"""Where the time of one host allreduce goes, per rank: codec calls, waits, agreement, the rest.

Usage: mpiexec -n P python perf/phase_breakdown.py [--count N] [--iters K] [--fmt e4m3]
                                                    [--shared-memory auto|off]

Wraps the codec kernels the collectives call (giftcomm.codec's native and reference kernel
tables: encode, decode, decode_add_encode, decode_accumulate), the MPI transport's request waits,
isend/irecv and agreement allgather, and the shared window's fence with timers, then times K calls of
the engine's plain allreduce (``giftcomm.collectives.engine.execute``: the agreed path of a
plain call, never the plan cache; each after a barrier) on N float32 values. Prints, per rank,
the mean microseconds per call in each part; "other" is the rest (Python, slicing, the result).
A diagnostic, not a benchmark: the timers add about a microsecond per wrapped call.
"""
from __future__ import annotations

import argparse
import collections
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from giftcomm import codec
from giftcomm.collectives import engine
from giftcomm.options import call_options
from giftcomm.perf.timing import time_calls
from giftcomm.transport import mpi as mpi_transport
from giftcomm.transport.shared_window import SharedWindow

_spent: collections.Counter[str] = collections.Counter()


def _timed(owner: Any, name: str, key: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _spent[key] += time.perf_counter() - t0

    if isinstance(owner.__dict__.get(name), staticmethod):
        setattr(owner, name, staticmethod(wrapper))
    else:
        setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=1 << 20, help="float32 values per rank (default 1M = 4 MiB)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--fmt", default="e4m3")
    ap.add_argument("--shared-memory", default="auto", choices=["auto", "off"],
                    help="zero-copy shared window on one node (auto) or MPI messages (off)")
    args = ap.parse_args()
    for kernels in (codec.NativeKernels, codec.ReferenceKernels):  # what giftcomm.codec.kernels_for hands out
        for name in ("encode", "decode", "decode_add_encode", "decode_accumulate"):
            _timed(kernels, name, name)
    _timed(mpi_transport.MpiRequest, "wait", "wait")
    for name in ("isend", "irecv"):
        _timed(mpi_transport.MpiTransport, name, name)
    _timed(mpi_transport.MpiTransport, "allgather_int64", "agreement")
    _timed(SharedWindow, "fence", "fence")
    comm = mpi_transport.MpiTransport(MPI.COMM_WORLD, shared_memory=None if args.shared_memory == "auto" else False)
    x = np.random.default_rng(comm.rank).standard_normal(args.count).astype(np.float32)
    out = np.empty_like(x)
    opts = call_options({"fmt": args.fmt})
    call = lambda: engine.execute(comm, engine.ALLREDUCE, x, out, opts)  # noqa: E731 - the plain call, never cached
    for _ in range(5):
        call()
    _spent.clear()
    mean, _ = time_calls(call, args.iters, warmup=0, barrier=comm.comm.Barrier, stat="mean")
    rows = comm.comm.gather((mean * args.iters, dict(_spent)))
    if comm.rank == 0:
        print(f"# P={comm.size} count={args.count} fmt={args.fmt} iters={args.iters} shared window: "
              f"{'yes' if comm.shared_memory else 'no'}: mean us per call")
        for r, (t, parts) in enumerate(rows):
            us = {k: v / args.iters * 1e6 for k, v in sorted(parts.items())}
            other = t / args.iters * 1e6 - sum(us.values())
            print(f"rank {r}: total {t / args.iters * 1e6:.0f}  " + "  ".join(f"{k} {v:.0f}" for k, v in us.items())
                  + f"  other {other:.0f}")
    comm.free()


if __name__ == "__main__":
    main()
