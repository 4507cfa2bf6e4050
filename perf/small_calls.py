"""Per-call time of small allreduces: giftcomm.allreduce, a persistent plan
(giftcomm.plan_allreduce) and MPI_Allreduce (float32), side by side in one run.

Repeated plain calls run the plan cached for their signature (giftcomm.plans.cache), so the
plain call's overhead over the plan is the signature lookup and the keyword handling.

    mpiexec -n P python perf/small_calls.py [--fmt e4m3] [--sizes 1K,4K,16K,64K] [--calls 400]

For every size: the median over 9 rounds of the mean microseconds per call (each timing after a
barrier; the three contenders take turns within every round, so that a busy moment of the machine
falls on all of them), and the plain call's and the plan's time over MPI_Allreduce's. e4m3 on the wire for giftcomm,
float32 input.
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import giftcomm
from giftcomm.perf.sizes import parse_size
from giftcomm.perf.timing import time_rounds


def per_call_us(fns, calls: int, comm) -> list[float]:
    """Median microseconds per call of each function, over 9 interleaved rounds (this rank's own times)."""
    return [t * 1e6 for t in time_rounds(fns, 9, calls=calls, barrier=comm.Barrier)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default="e4m3")
    ap.add_argument("--sizes", default="1K,4K,16K,64K")
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        print(f"# P={comm.size} fmt={args.fmt} float32 input; us per call, median of 9 x {args.calls}")
        print(f"# {'bytes':>8} {'allreduce':>10} {'plan':>8} {'MPI fp32':>9} {'call/MPI':>9} {'plan/MPI':>9}  "
              "plan algorithm")
    for size in args.sizes.split(","):
        n = parse_size(size) // 4
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        out = np.empty_like(x)
        plan = giftcomm.plan_allreduce(x, fmt=args.fmt)
        for _ in range(50):
            giftcomm.allreduce(x, fmt=args.fmt, out=out)
            plan(x, out=out)
        plain, planned, mpi = per_call_us([lambda: giftcomm.allreduce(x, fmt=args.fmt, out=out),
                                           lambda: plan(x, out=out), lambda: comm.Allreduce(x, out)], args.calls, comm)
        if comm.rank == 0:
            print(f"  {4 * n:>8} {plain:>10.1f} {planned:>8.1f} {mpi:>9.1f} {plain / mpi:>8.2f}x {planned / mpi:>8.2f}x"
                  f"  {plan.algorithm}", flush=True)


if __name__ == "__main__":
    main()
