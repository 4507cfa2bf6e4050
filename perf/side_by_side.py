"""Time giftcomm.allreduce (e4m3, float32, out=) and MPI_Allreduce (float32) at a few sizes with
the giftcomm found on sys.path, so that two trees can be compared under identical commands:

    PYTHONPATH=<tree> mpiexec -n P python perf/side_by_side.py LABEL [SIZE ...]

Only the public API of every giftcomm version is used. Prints one line per size: the median over
7 repeats of the mean time per call (microseconds) for giftcomm and for MPI_Allreduce, and their
ratio. Sizes are bytes of float32 input (default 1K 64K 4M 16M 64M)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import giftcomm

SIZES = {"1K": 1 << 10, "64K": 1 << 16, "4M": 1 << 22, "16M": 1 << 24, "64M": 1 << 26}


def _timing():
    """giftcomm/perf/timing.py of this checkout, loaded by path: the giftcomm on PYTHONPATH may be
    an older tree (the one compared against) that lacks it."""
    path = Path(__file__).resolve().parents[1] / "giftcomm" / "perf" / "timing.py"
    spec = importlib.util.spec_from_file_location("_checkout_timing", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def per_call(fn, iters: int, comm) -> float:
    """Median over 7 repeats of the mean seconds of ``fn()`` (each repeat of ``iters`` calls after
    a barrier; this rank's own times)."""
    return _timing().time_calls(fn, 7, warmup=0, calls=iters, barrier=comm.Barrier)[0]


def main() -> None:
    comm = MPI.COMM_WORLD
    label, names = sys.argv[1], sys.argv[2:] or list(SIZES)
    for name in names:
        n = SIZES[name] // 4
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        out = np.empty_like(x)
        iters = max(3, min(300, (1 << 24) // SIZES[name]))
        for _ in range(3):
            giftcomm.allreduce(x, out=out)
        ours = per_call(lambda: giftcomm.allreduce(x, out=out), iters, comm)
        mpi = per_call(lambda: comm.Allreduce(x, out), iters, comm)
        if comm.rank == 0:
            print(f"{label:>12} P={comm.size} {name:>4}: giftcomm e4m3 {ours * 1e6:10.1f} us   "
                  f"MPI fp32 {mpi * 1e6:10.1f} us   MPI/giftcomm {mpi / ours:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
