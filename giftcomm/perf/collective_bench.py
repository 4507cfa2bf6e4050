"""nccl-tests-style sweeps of the collectives, with fidelity columns.

Run under mpiexec, e.g. ``mpiexec -n 4 python -m giftcomm.perf allreduce -b 1K -e 64M -f 4
--fmt e4m3,bf16,fp32``. For every size, every format runs through one shared timing-and-checking
loop, and the MPI library's own MPI_Allreduce in fp32 runs as the baseline row (fmt ``mpi``).

Every row writes into one preallocated result buffer, as the MPI row's recvbuf is.

Columns: size (input bytes), count (elements), type, fmt, redop, time (us per call: the median
over the timed calls of the slowest rank's time, each call after a barrier), algbw (GB/s = size / time), busbw (GB/s = algbw * 2(P-1)/P), #wrong (with
--check: elements that differ from the reference simulation, bit for bit, plus ranks whose
result differs from rank 0's), relerr (||y - s||_2 / ||s||_2 against the float64 sum s), maxabs
(max |y - s|).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import ml_dtypes
import numpy as np

from .. import api, codec
from ..formats import FORMATS, bytes_per_value
from ..reference import simulate_allreduce
from .sizes import format_size, parse_size, size_range

SHARED_MEMORY = {"auto": None, "on": True, "off": False}  # --shared-memory -> MpiTransport(shared_memory=)
DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@dataclass
class Row:
    """One line of the table."""

    size: int
    count: int
    type: str
    fmt: str
    redop: str
    time_us: float
    algbw: float
    busbw: float
    wrong: int | None
    relerr: float
    maxabs: float


def _rank_input(seed: int, rank: int, count: int, dtype) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, count])
    return rng.standard_normal(count, dtype=np.float32).astype(dtype)


def _timed(comm, fn: Callable[[], np.ndarray], iters: int, warmup: int) -> tuple[float, np.ndarray]:
    """Seconds per call and the last result: the median over ``iters`` calls of the slowest
    rank's time for that call (each call starts after a barrier).

    The median, not the mean, because other processes on a small shared machine add rare long
    stalls to single calls; every row, the MPI baseline included, is timed the same way.
    """
    from mpi4py import MPI

    for _ in range(warmup):
        fn()
    times = np.empty(max(iters, 1))
    for i in range(times.size):
        comm.Barrier()
        t0 = time.perf_counter()
        y = fn()
        times[i] = time.perf_counter() - t0
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return float(np.median(slowest)), y


def _fidelity(comm, y: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    from mpi4py import MPI

    d = y.astype(np.float64) - exact
    with np.errstate(invalid="ignore"):
        num = float(np.dot(d, d)) if d.size else 0.0
        den = float(np.dot(exact, exact)) if d.size else 0.0
        maxabs = float(np.max(np.abs(d))) if d.size else 0.0
    num, maxabs = comm.allreduce(num, op=MPI.MAX), comm.allreduce(maxabs, op=MPI.MAX)
    return (np.sqrt(num / den) if den > 0 else 0.0), maxabs


def _count_wrong(comm, y: np.ndarray, want: np.ndarray) -> int:
    mine = int(np.count_nonzero(y.reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8)))
    digests = comm.allgather(hashlib.sha256(y.tobytes()).hexdigest())
    return comm.allreduce(mine) + sum(d != digests[0] for d in digests)


def run_allreduce_sweep(comm, sizes: list[int], fmts: list[str], dtype_name: str, op: str, block: int,
                        iters: int, warmup: int, check: bool, seed: int, progress: bool,
                        on_row: Callable[[Row], None], algorithm: str = "auto",
                        slice_elems: int | None = None, transport: Any = None) -> list[Row]:
    """Time and check allreduce for every size and format, plus the MPI fp32 baseline.

    ``transport``: what giftcomm's calls get as ``comm=`` (default ``comm`` itself), e.g. an
    MpiTransport with the shared window switched off."""
    from mpi4py import MPI

    transport = comm if transport is None else transport
    dtype = DTYPES[dtype_name]
    p = comm.size
    rows: list[Row] = []
    total = len(sizes) * (len(fmts) + 1)
    done = 0
    for size in sizes:
        count = max(size // np.dtype(dtype).itemsize, 0)
        x = _rank_input(seed, comm.rank, count, dtype)
        exact = np.empty(count, np.float64)
        comm.Allreduce(x.astype(np.float64), exact, op=MPI.SUM)
        if op == "avg":
            exact /= p
        # Every row writes into a result buffer allocated once, as the MPI row's recvbuf is
        # (nccl-tests does the same): a fresh 64 MiB array per call costs more in page faults
        # than the decode itself.
        result_buf = np.empty_like(x)
        cases: list[tuple[str, Callable[[], np.ndarray]]] = [
            (fmt, lambda fmt=fmt: api.allreduce(x, comm=transport, op=op, fmt=fmt, block=block, algorithm=algorithm,
                                                 slice_elems=slice_elems, out=result_buf))
            for fmt in fmts
        ]
        x32 = x.astype(np.float32)
        y32 = np.empty_like(x32)

        def mpi_baseline() -> np.ndarray:
            comm.Allreduce(x32, y32, op=MPI.SUM)
            if op == "avg":
                np.divide(y32, np.float32(p), out=y32)
            return y32

        cases.append(("mpi", mpi_baseline))
        for name, fn in cases:
            if progress and comm.rank == 0:
                done += 1
                print(f"\r[{done}/{total}] {format_size(size)} {name}    ", end="", file=sys.stderr, flush=True)
            seconds, y = _timed(comm, fn, iters, warmup)
            relerr, maxabs = _fidelity(comm, y.reshape(-1), exact)
            wrong = None
            if check and name != "mpi":
                inputs = [_rank_input(seed, r, count, dtype) for r in range(p)]
                want = simulate_allreduce(inputs, fmt=name, block=block, op=op, algorithm=algorithm)[comm.rank]
                wrong = _count_wrong(comm, y, want)
            algbw = size / seconds / 1e9 if seconds > 0 else 0.0
            row = Row(size, count, "float32" if name == "mpi" else dtype_name, name, op, seconds * 1e6,
                      algbw, algbw * 2 * (p - 1) / p, wrong, relerr, maxabs)
            rows.append(row)
            on_row(row)
    if progress and comm.rank == 0:
        print("\r" + " " * 40 + "\r", end="", file=sys.stderr, flush=True)
    return rows


HEADER = (f"{'size':>12} {'count':>12} {'type':>9} {'fmt':>5} {'redop':>5} {'time(us)':>11} "
          f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7} {'relerr':>9} {'maxabs':>9}")


def format_row(r: Row) -> str:
    wrong = "-" if r.wrong is None else str(r.wrong)
    return (f"{r.size:>12} {r.count:>12} {r.type:>9} {r.fmt:>5} {r.redop:>5} {r.time_us:>11.1f} "
            f"{r.algbw:>11.3f} {r.busbw:>11.3f} {wrong:>7} {r.relerr:>9.2e} {r.maxabs:>9.2e}")


def build_parser(prog: str = "giftcomm.perf allreduce") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="nccl-tests-style allreduce sweep with fidelity columns")
    ap.add_argument("-b", "--minbytes", default="1K", help="smallest input size in bytes (1K, 4M...)")
    ap.add_argument("-e", "--maxbytes", default="64M", help="largest input size in bytes")
    ap.add_argument("-f", "--stepfactor", type=float, default=4, help="size multiplier between rows")
    ap.add_argument("--fmt", default="e4m3,bf16,fp32", help="comma-separated wire formats")
    ap.add_argument("-d", "--dtype", default="float32", choices=list(DTYPES), help="input dtype")
    ap.add_argument("-o", "--op", default="sum", choices=["sum", "avg"])
    ap.add_argument("--block", type=int, default=256, help="elements per FP8 scale")
    ap.add_argument("-n", "--iters", type=int, default=10,
                    help="timed calls per row (time = median over them of the slowest rank)")
    ap.add_argument("-w", "--warmup", type=int, default=2, help="untimed calls per row")
    ap.add_argument("-c", "--check", action="store_true",
                    help="count elements differing from the reference simulation (slow at large sizes)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--label", default="", help="a title for this run in the JSON (used by perf plot)")
    ap.add_argument("--algorithm", default="auto", help="allreduce algorithm (auto, ring, direct, ...)")
    ap.add_argument("--slice-elems", type=int, default=None,
                    help="pipelining slice in values (default: automatic; changes speed, never results)")
    ap.add_argument("--shared-memory", default="auto", choices=list(SHARED_MEMORY),
                    help="zero-copy shared window when every rank is on one node (auto: yes unless "
                         "$GIFTCOMM_SHARED_MEMORY=0); changes speed, never results")
    ap.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fmts = [f.strip() for f in args.fmt.split(",") if f.strip()]
    unknown = [f for f in fmts if f not in FORMATS]
    if unknown:
        print(f"unknown format(s) {unknown}; known: {list(FORMATS)}", file=sys.stderr)
        return 2
    sizes = size_range(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    from mpi4py import MPI

    from ..transport.mpi import MpiTransport

    comm = MPI.COMM_WORLD
    transport = MpiTransport(comm, shared_memory=SHARED_MEMORY[args.shared_memory])
    if comm.rank == 0:
        link = os.environ.get("GIFTCOMM_NETBED_RATE", "host (no netbed shaping)")
        print(f"# giftcomm allreduce: P={comm.size} algorithm={args.algorithm} slice={args.slice_elems} "
              f"dtype={args.dtype} op={args.op} block={args.block} "
              f"iters={args.iters} (median of the slowest rank) warmup={args.warmup} check={args.check}")
        print(f"# native codec: {'yes' if codec.native_available() else 'NO (NumPy reference)'}; "
              f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}; link: {link}; shared window: "
              f"{'yes (zero-copy ring/direct)' if transport.shared_memory else 'no (MPI messages)'}")
        tuning = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(("MPIR_CVAR_", "FI_", "UCX_")))
        if tuning:
            print("# MPI settings from the environment (every row alike): " + " ".join(tuning))
        print("# wire bytes/value: " + ", ".join(f"{f}={bytes_per_value(f, args.block):.4f}" for f in fmts)
              + "; mpi = MPI_Allreduce on float32 input (baseline)")
        print(HEADER, flush=True)

    def on_row(r: Row) -> None:
        if comm.rank == 0:
            if sys.stderr.isatty() and not args.no_progress:
                print("\r" + " " * 40 + "\r", end="", file=sys.stderr)
            print(format_row(r), flush=True)

    rows = run_allreduce_sweep(comm, sizes, fmts, args.dtype, args.op, args.block, args.iters, args.warmup,
                               args.check, args.seed, not args.no_progress, on_row, args.algorithm,
                               args.slice_elems, transport)
    transport.free()
    bad = sum(r.wrong or 0 for r in rows)
    if comm.rank == 0:
        if args.check:
            print(f"# check: {bad} wrong elements in total ({'OK' if bad == 0 else 'FAILED'})")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"P": comm.size, "label": args.label, "link": os.environ.get("GIFTCOMM_NETBED_RATE", "host"),
                           "args": vars(args), "rows": [asdict(r) for r in rows]}, fh, indent=1)
    return 1 if bad else 0
