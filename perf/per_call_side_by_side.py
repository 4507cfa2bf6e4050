"""Per-call time of the plain giftcomm.allreduce at 1 KiB, two trees side by side in one run.

    python perf/per_call_side_by_side.py [--old /tmp/old] [--new .] [--ranks 1,2] [--rounds 7]

For every world size P and round, runs ``mpiexec -n P python perf/per_call_side_by_side.py
--worker`` once with PYTHONPATH=<old tree> and once with PYTHONPATH=<new tree>, the order
alternating from round to round (the machine is shared and noisy: the median over rounds is what
counts). A worker times ``giftcomm.allreduce(x, fmt="e4m3", out=out)`` of 256 float32 values
(1 KiB) and prints the median over 9 repeats of the mean microseconds per call (each repeat after a
barrier). Only the public API is used, so any giftcomm version runs it. Prints each round's two
numbers (with the 1-minute load average after them: other jobs on the machine) and, per P, the
medians and new - old.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
from pathlib import Path


def _timing():
    """giftcomm/perf/timing.py of this checkout, loaded by path: the giftcomm on PYTHONPATH may be
    an older tree (the one compared against) that lacks it."""
    path = Path(__file__).resolve().parents[1] / "giftcomm" / "perf" / "timing.py"
    spec = importlib.util.spec_from_file_location("_checkout_timing", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker(calls: int) -> None:
    import numpy as np
    from mpi4py import MPI

    import giftcomm

    comm = MPI.COMM_WORLD
    x = np.random.default_rng(comm.rank).standard_normal(256).astype(np.float32)
    out = np.empty_like(x)
    seconds, _ = _timing().time_calls(lambda: giftcomm.allreduce(x, fmt="e4m3", out=out), 9, warmup=200,
                                      calls=calls, barrier=comm.Barrier)
    if comm.rank == 0:
        print(f"{seconds * 1e6:.2f}", flush=True)


def run(tree: str, p: int, calls: int) -> float:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = ["mpiexec", "-n", str(p), sys.executable, os.path.abspath(__file__), "--worker", "--calls", str(calls)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd="/")
    return float(res.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--old", default="/tmp/old")
    ap.add_argument("--new", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    if args.worker:
        return worker(args.calls)
    print(f"# per-call us of giftcomm.allreduce, 256 float32 (1 KiB), fmt e4m3, out= given; median of 9 x "
          f"{args.calls} calls per run; old={args.old} new={args.new}", flush=True)
    for p in map(int, args.ranks.split(",")):
        got: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(args.rounds):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            for which in order:
                got[which].append(run(getattr(args, which), p, args.calls))
            print(f"P={p} round {i}: old {got['old'][-1]:7.2f}  new {got['new'][-1]:7.2f}   "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)
        mo, mn = statistics.median(got["old"]), statistics.median(got["new"])
        print(f"P={p} median over {args.rounds} rounds: old {mo:7.2f} us  new {mn:7.2f} us  new - old {mn - mo:+6.2f} us",
              flush=True)


if __name__ == "__main__":
    main()
