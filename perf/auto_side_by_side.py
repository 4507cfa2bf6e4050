"""``algorithm="auto"`` against the best native path, size by size, in interleaved rounds::

    mpiexec -n 2 python perf/auto_side_by_side.py [--sizes 1K,16K,256K,1M,4M,16M,64M] [--rounds 7]
            [--fmt e4m3]

For every size (bytes of float32 input), four contenders take turns in every round, each after a
barrier (giftcomm.perf.timing.time_rounds; per round the slowest rank's mean over a few
back-to-back calls): giftcomm's plain ``allreduce`` with ``algorithm="auto"`` (``--fmt``, repeated
calls as a training loop makes them: cached plans where they apply), MPI_Allreduce on float32,
MPI_Allreduce on bfloat16 (giftcomm's bf16 MPI operation, as ``algorithm="native", fmt="bf16"``
uses) and giftcomm's own bf16 ring. Prints per size the median microseconds of each, what
``auto`` ran, and ``auto/best``: the fastest baseline's time over auto's (the issue's target on
shared memory at P = 2: >= 0.95 at every size). The cost model reads the calibration in force
(GIFTCOMM_CALIBRATION). One line per size, then the load average before and after.
"""
from __future__ import annotations

import argparse
import os

import ml_dtypes
import numpy as np
from mpi4py import MPI

import giftcomm
from giftcomm.api import last_algorithm
from giftcomm.perf.sizes import parse_size
from giftcomm.perf.timing import load_average, time_rounds
from giftcomm.transport.mpi import half_sum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1K,16K,256K,1M,4M,16M,64M")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--fmt", default="e4m3")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    load = load_average()
    if comm.rank == 0:
        print(f"# auto vs the best native path: P={comm.size}, fmt {args.fmt}, {args.rounds} interleaved rounds; "
              f"calibration {os.environ.get('GIFTCOMM_CALIBRATION', '(default path or built-in)')}", flush=True)
        print(f"# {'size':>6} {'auto us':>10} {'MPI fp32':>10} {'MPI bf16':>10} {'bf16 ring':>10}  {'auto ran':>8}"
              f"  auto/best", flush=True)
    for name in args.sizes.split(","):
        nbytes = parse_size(name)
        n = nbytes // 4
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        out, y = np.empty_like(x), np.empty_like(x)
        xb = x.astype(ml_dtypes.bfloat16).view(np.uint16)
        yb = np.empty_like(xb)
        op = half_sum("bfloat16")
        fns = [lambda: giftcomm.allreduce(x, fmt=args.fmt, out=out),
               lambda: comm.Allreduce(x, y, op=MPI.SUM),
               lambda: comm.Allreduce([xb, MPI.UINT16_T], [yb, MPI.UINT16_T], op=op),
               lambda: giftcomm.allreduce(x, fmt="bf16", algorithm="ring", out=out)]
        calls = max(1, min(50, (1 << 22) // max(nbytes, 1)))
        times = time_rounds(fns, args.rounds, calls=calls, warmup=2, comm=comm)
        giftcomm.allreduce(x, fmt=args.fmt, out=out)
        ran = last_algorithm(comm)
        if comm.rank == 0:
            us = [t * 1e6 for t in times]
            print(f"  {name:>6} {us[0]:10.1f} {us[1]:10.1f} {us[2]:10.1f} {us[3]:10.1f}  "
                  f"{ran[0] if ran else '?':>8}  {min(us[1:]) / us[0]:8.2f}x", flush=True)
    if comm.rank == 0:
        print(f"# loadavg {load} -> {load_average()}")


if __name__ == "__main__":
    main()
