"""``python -m giftcomm.perf allreduce``: an nccl-tests ``all_reduce_perf``-style sweep with
fidelity columns.

Run under mpiexec, e.g. ``mpiexec -n 4 python -m giftcomm.perf allreduce -b 1K -e 64M -f 4
--fmt e4m3,bf16,fp32``. For every size, every format runs through one shared timing-and-checking
loop (repeated identical calls, as nccl-tests times them: plain calls reuse a cached plan where
the ranks share a node), then the baselines, in the same run (``--baselines``): the MPI library's
own MPI_Allreduce on float32 (fmt ``mpi``) and on bfloat16 (fmt ``mpibf``: the values rounded to
bf16, summed by MPI_Allreduce with giftcomm's bf16 MPI operation, as ``algorithm="native",
fmt="bf16"`` does) and giftcomm's own bf16 ring (fmt ``bf16``, algo ``ring (baseline)``: bf16 on
the wire, fp32 accumulation). Every row's ``xbest`` is the fastest baseline's time over its time.

The output follows nccl-tests so that the tools which read all_reduce_perf logs read it too:
a ``#`` header with one placement line per rank, then the columns of all_reduce_perf's
out-of-place half, in its order and units, then giftcomm's own columns, then the footer
(``# Out of bounds values : N OK|FAILED`` and ``# Avg bus bandwidth : X``). Every call is
out-of-place (the result goes to a buffer allocated once per size); in-place is not measured.

=========  ===================================================================================
size       input bytes per rank (B)
count      input elements per rank
type       input element type, nccl-tests' names (float, half, bfloat16, double)
redop      sum or avg
root       -1 (no root in an allreduce)
time       us per call: the median over the timed calls of the slowest rank's time, each call
           after a barrier
algbw      GB/s (1e9 bytes/s) = size / time
busbw      GB/s = algbw * 2(P-1)/P, as nccl-tests defines it for allreduce: in bytes of *input*,
           so an FP8 format can show more than the link's rate
#wrong     elements of rank 0's result that differ, bit for bit, from the single-process
           reference simulation of the same algorithm, plus ranks whose result is not identical
           to rank 0's (``-c 0``: N/A). MPI row: elements farther from the float64 sum than fp32
           rounding allows (P * 2^-23 * sum |x_i|), plus ranks that disagree; mpibf row: elements
           that differ from the native path's definition (simulate_allreduce(fmt="bf16",
           algorithm="native"), MPICH's order), plus ranks that disagree
fmt        the wire format (mpi: MPI_Allreduce on float32; mpibf: MPI_Allreduce on bfloat16)
algo       the algorithm the call used (``auto``: the cost model's choice, the one the API makes)
wirebw     GB/s = busbw * wire bytes per value / input bytes per value: the bus bandwidth in bytes
           actually sent (FP8 payload plus scales), comparable with the link's rate
relerr     ||y - s||_2 / ||s||_2 against the float64 sum s (worst rank)
maxabs     max |y - s| (worst rank)
xbest      the fastest baseline row's time at this size over this row's time: above 1 is faster
           than every baseline (the baselines printed in this run, ``--baselines``)
=========  ===================================================================================
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import ml_dtypes
import numpy as np

import giftcomm
from giftcomm import codec, config
from giftcomm.algorithms import BY_NAME, native_bytes
from giftcomm.api import ALGORITHMS
from giftcomm.formats import FORMATS, bytes_per_value, get_format, resolve_block
from giftcomm.reference import simulate_allreduce

from .common import Progress, add_fmt, add_json, parent_parser, split_list, time_calls
from .sizes import format_size, parse_size, size_range

SHARED_MEMORY = {"auto": None, "on": True, "off": False}  # --shared-memory -> MpiTransport(shared_memory=)
DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
NCCL_TYPE = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16"}


@dataclass
class Row:
    """One line of the table (the JSON keeps these names; times in us, bandwidths in GB/s)."""

    size: int
    count: int
    type: str
    redop: str
    root: int
    time_us: float
    algbw: float
    busbw: float
    wrong: int | None
    fmt: str
    algorithm: str
    wirebw: float
    relerr: float
    maxabs: float
    xbest: float = float("nan")


def _rank_input(seed: int, rank: int, count: int, dtype: Any) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, count])
    return rng.standard_normal(count, dtype=np.float32).astype(dtype)


def _fidelity(comm: Any, y: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    from mpi4py import MPI

    d = y.astype(np.float64) - exact
    with np.errstate(invalid="ignore"):
        num = float(np.dot(d, d)) if d.size else 0.0
        den = float(np.dot(exact, exact)) if d.size else 0.0
        maxabs = float(np.max(np.abs(d))) if d.size else 0.0
    num, maxabs = comm.allreduce(num, op=MPI.MAX), comm.allreduce(maxabs, op=MPI.MAX)
    return (float(np.sqrt(num / den)) if den > 0 else 0.0), maxabs


def _disagreeing_ranks(comm: Any, y: np.ndarray) -> int:
    digests = comm.allgather(hashlib.sha256(np.ascontiguousarray(y).tobytes()).hexdigest())
    return sum(d != digests[0] for d in digests)


def _half_sum(kind: str) -> Any:
    from giftcomm.transport.mpi import half_sum  # lazily: mpi4py, as everywhere in the perf tools

    return half_sum(kind)


BASELINES = ("mpi", "mpibf", "ring-bf16")
"""The baseline rows ``--baselines`` may ask for: MPI_Allreduce on float32 and on bfloat16, and
giftcomm's own bf16 ring."""


def baseline_calls(comm: Any, x: np.ndarray, baselines: tuple[str, ...] = BASELINES, op: str = "sum",
                   transport: Any = None, slice_elems: int | None = None) -> dict[str, Callable[[], np.ndarray]]:
    """The native baselines of :data:`BASELINES` for this rank's values ``x`` (any float dtype,
    summed as float32), each a call without arguments (collective) returning the result in a
    buffer allocated here once: ``mpi`` MPI_Allreduce on float32, ``mpibf`` MPI_Allreduce on
    bfloat16 (giftcomm's bf16 MPI operation; bfloat16 values, or float32 after ``op="avg"``'s
    division) and ``ring-bf16`` giftcomm's own bf16 ring (``x``'s dtype). ``comm``: the mpi4py
    communicator; ``transport``: what giftcomm's ring gets as ``comm=`` (default ``comm``)."""
    from mpi4py import MPI

    transport = comm if transport is None else transport
    p = comm.size
    x32 = x.astype(np.float32)
    calls: dict[str, Callable[[], np.ndarray]] = {}
    if "mpi" in baselines:
        y32 = np.empty_like(x32)

        def mpi_fp32() -> np.ndarray:
            comm.Allreduce(x32, y32, op=MPI.SUM)
            if op == "avg":
                np.divide(y32, np.float32(p), out=y32)
            return y32

        calls["mpi"] = mpi_fp32
    if "mpibf" in baselines:
        xbf = x32.astype(ml_dtypes.bfloat16).view(np.uint16)
        ybf = np.empty_like(xbf)

        def mpi_bf16() -> np.ndarray:
            comm.Allreduce([xbf, MPI.UINT16_T], [ybf, MPI.UINT16_T], op=_half_sum("bfloat16"))
            y = ybf.view(ml_dtypes.bfloat16)
            return (y.astype(np.float32) / np.float32(p)) if op == "avg" else y

        calls["mpibf"] = mpi_bf16
    if "ring-bf16" in baselines:
        ring_out = np.empty_like(x)
        calls["ring-bf16"] = lambda: giftcomm.allreduce(x, comm=transport, op=op, fmt="bf16", algorithm="ring",
                                                        slice_elems=slice_elems, out=ring_out)
    return calls


def run_allreduce_sweep(comm: Any, sizes: list[int], fmts: list[str], dtype_name: str, op: str, block: int | None,
                        iters: int, warmup: int, check: bool, seed: int, progress: bool,
                        on_row: Callable[[Row], None], algorithm: str = "auto",
                        slice_elems: int | None = None, transport: Any = None,
                        baselines: tuple[str, ...] = ("mpi",), allow_native: bool = True) -> list[Row]:
    """Time and check allreduce for every size and format, plus the ``baselines`` (of
    :data:`BASELINES`); every row's ``xbest`` is the fastest baseline's time over its own.

    ``comm``: the mpi4py communicator (barriers, the baselines, the checks); ``transport``: what
    giftcomm's calls get as ``comm=`` (default ``comm`` itself), e.g. an MpiTransport with the
    shared window switched off. ``allow_native``: the calls' option (False: ``auto`` stays
    compressed). Rows are handed to ``on_row`` once a size is done (the ratio
    needs its baselines). Collective: every rank gets the same rows."""
    from mpi4py import MPI

    transport = comm if transport is None else transport
    dtype = DTYPES[dtype_name]
    p = comm.size
    rows: list[Row] = []
    bar = Progress(len(sizes) * (len(fmts) + len(baselines)), enabled=progress and comm.rank == 0)
    for size in sizes:
        count = max(size // np.dtype(dtype).itemsize, 0)
        x = _rank_input(seed, comm.rank, count, dtype)
        x64 = x.astype(np.float64)
        exact = np.empty(count, np.float64)
        comm.Allreduce(x64, exact, op=MPI.SUM)
        abs_sum = np.empty(count, np.float64)
        comm.Allreduce(np.abs(x64), abs_sum, op=MPI.SUM)
        del x64
        if op == "avg":
            exact /= p
            abs_sum /= p
        # Every row writes into a result buffer allocated once, as the MPI row's recvbuf is
        # (nccl-tests does the same): a fresh 64 MiB array per call costs more in page faults
        # than the decode itself.
        result_buf = np.empty_like(x)

        def ours(fmt: str, algo: str = algorithm) -> Callable[[], np.ndarray]:
            return lambda: giftcomm.allreduce(x, comm=transport, op=op, fmt=fmt, block=block,
                                              algorithm=algo, slice_elems=slice_elems, out=result_buf,
                                              allow_native=allow_native)

        cases = [(fmt, ours(fmt)) for fmt in fmts]
        calls = baseline_calls(comm, x, baselines, op=op, transport=transport, slice_elems=slice_elems)
        cases += [("bf16" if b == "ring-bf16" else b, calls[b]) for b in baselines]
        first = len(rows)
        for i, (name, fn) in enumerate(cases):
            baseline = i >= len(fmts)
            bar.update(f"{format_size(size)} {name}")
            seconds, y = time_calls(fn, iters, warmup=warmup, comm=comm)
            y = y.reshape(-1)
            relerr, maxabs = _fidelity(comm, y, exact)
            wrong: int | None = None
            if name == "mpi":
                algo = "mpi"
                wire = 4.0
                if check:
                    tol = p * 2.0 ** -23 * abs_sum
                    mine = int(np.count_nonzero(~(np.abs(y.astype(np.float64) - exact) <= tol))) if comm.rank == 0 else 0
                    wrong = comm.bcast(mine, root=0) + _disagreeing_ranks(comm, y)
            elif name == "mpibf":
                algo, wire = "mpi", 2.0
                if check:
                    mine = 0
                    if comm.rank == 0:
                        inputs = [_rank_input(seed, r, count, dtype).astype(np.float32) for r in range(p)]
                        want = simulate_allreduce(inputs, fmt="bf16", op=op, algorithm="native")[0]
                        mine = int(np.count_nonzero(_differs(y.astype(np.float32), want)))
                    wrong = comm.bcast(mine, root=0) + _disagreeing_ranks(comm, y)
            else:
                fblock = resolve_block(name, block)
                last = giftcomm.api.last_algorithm(transport)
                assert last is not None  # the calls above ran
                algo = last[0]  # what the call ran
                wire = float(native_bytes(get_format(name))) if BY_NAME[algo].native else bytes_per_value(name, fblock)
                if check:
                    # Every rank's result must equal rank 0's (checked by digest), so only rank 0
                    # runs the single-process simulation: P times less work on a shared machine.
                    mine = 0
                    if comm.rank == 0:
                        inputs = [_rank_input(seed, r, count, dtype) for r in range(p)]
                        want = simulate_allreduce(inputs, fmt=name, block=fblock, op=op, algorithm=algo)[0]
                        mine = int(np.count_nonzero(_differs(y, want)))
                        del inputs, want
                    wrong = comm.bcast(mine, root=0) + _disagreeing_ranks(comm, y)
            algbw = size / seconds / 1e9 if seconds > 0 else 0.0
            busbw = algbw * 2 * (p - 1) / p
            mpi = name in ("mpi", "mpibf")
            in_bytes = np.dtype(np.float32 if mpi else dtype).itemsize
            label = f"{algo} (baseline)" if baseline and not mpi else algo
            rows.append(Row(size, count, NCCL_TYPE["float32" if mpi else dtype_name], op, -1, seconds * 1e6,
                            algbw, busbw, wrong, name, label, busbw * wire / in_bytes, relerr, maxabs))
        best = min((r.time_us for r in rows[first + len(fmts):]), default=float("nan"))
        for r in rows[first:]:
            r.xbest = best / r.time_us if r.time_us > 0 else float("nan")
            bar.clear()
            on_row(r)
    bar.close()
    return rows


def _differs(y: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per element: do ``y`` and ``want`` differ bit for bit (NaNs with equal bits are equal)."""
    itemsize = y.dtype.itemsize
    a = np.ascontiguousarray(y).view(np.uint8).reshape(-1, itemsize)
    b = np.ascontiguousarray(want.astype(y.dtype, copy=False)).view(np.uint8).reshape(-1, itemsize)
    return (a != b).any(axis=1)


COLUMNS = [  # (header, unit, width)
    ("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8), ("redop", "", 6), ("root", "", 6),
    ("time", "(us)", 10), ("algbw", "(GB/s)", 8), ("busbw", "(GB/s)", 8), ("#wrong", "", 7),
    ("fmt", "", 6), ("algo", "", 19), ("wirebw", "(GB/s)", 8), ("relerr", "", 9), ("maxabs", "", 9),
    ("xbest", "", 6),
]
HEADER = ("#" + " ".join(f"{h:>{w}}" for h, _, w in COLUMNS)[1:] + "\n"
          + "#" + " ".join(f"{u:>{w}}" for _, u, w in COLUMNS)[1:])


def format_row(r: Row) -> str:
    wrong = "N/A" if r.wrong is None else str(r.wrong)
    cells = [f"{r.size:>12}", f"{r.count:>12}", f"{r.type:>8}", f"{r.redop:>6}", f"{r.root:>6}",
             f"{r.time_us:>10.2f}", f"{r.algbw:>8.3f}", f"{r.busbw:>8.3f}", f"{wrong:>7}",
             f"{r.fmt:>6}", f"{r.algorithm.replace(' ', '_'):>19}", f"{r.wirebw:>8.3f}", f"{r.relerr:>9.2e}",
             f"{r.maxabs:>9.2e}", f"{r.xbest:>6.2f}"]
    return " ".join(cells)


def footer(rows: list[Row], checked: bool) -> list[str]:
    """nccl-tests' footer: out-of-bounds count and the average busbw (over the giftcomm rows; the
    MPI baseline's and each format's own average follow as comments)."""
    bad = sum(r.wrong or 0 for r in rows)
    ours = [r.busbw for r in rows if not is_baseline(r)]
    lines = [f"# Out of bounds values : {bad if checked else 'N/A'} {'OK' if bad == 0 else 'FAILED'}",
             f"# Avg bus bandwidth    : {float(np.mean(ours)) if ours else 0.0:.6g} ",
             "#"]
    key = lambda r: r.fmt + (" ring (baseline)" if r.algorithm.endswith("(baseline)") else "")  # noqa: E731
    fmts = list(dict.fromkeys(key(r) for r in rows))
    lines.append("# Avg bus bandwidth (GB/s) per fmt: "
                 + ", ".join(f"{f} {float(np.mean([r.busbw for r in rows if key(r) == f])):.6g}" for f in fmts))
    ratios = [r.xbest for r in rows if not is_baseline(r) and np.isfinite(r.xbest)]
    if ratios:
        lines.append(f"# xbest (fastest baseline's time / giftcomm row's): min {min(ratios):.3g}, "
                     f"median {float(np.median(ratios)):.3g}")
    return lines


def is_baseline(r: Row) -> bool:
    """A baseline row (MPI_Allreduce float32 or bfloat16, giftcomm's bf16 ring baseline)."""
    return r.fmt in ("mpi", "mpibf") or r.algorithm.endswith("(baseline)")


def mpi_library_version() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().strip().splitlines()[0].strip()


def placement(comm: Any, t: Any) -> list[dict[str, Any]]:
    """Every rank's pid, host, node (as the transport sees it) and CPU affinity (collective)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = []
    nodes = t.node_ids() if comm.size > 1 else np.zeros(1, int)
    mine = {"rank": comm.rank, "pid": os.getpid(), "host": platform.node(), "node": int(nodes[comm.rank]),
            "cpus": _ranges(cpus)}
    return list(comm.allgather(mine))


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" ("?" for none)."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "?"


def build_parser(prog: str = "giftcomm.perf allreduce") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, parents=[parent_parser(seed=1234)],
                                 description="nccl-tests-style allreduce sweep with fidelity columns",
                                 epilog="Columns and units: see `pydoc giftcomm.perf.collective_bench`.")
    ap.add_argument("-b", "--minbytes", default="1K", help="smallest input size in bytes (1K, 4M, 16MiB...)")
    ap.add_argument("-e", "--maxbytes", default="64M", help="largest input size in bytes")
    ap.add_argument("-f", "--stepfactor", type=float, default=4, help="size multiplier between rows")
    add_fmt(ap, "e4m3,bf16,fp32")
    ap.add_argument("-d", "--dtype", default="float32", choices=list(DTYPES), help="input dtype")
    ap.add_argument("-o", "--op", default="sum", choices=["sum", "avg"])
    ap.add_argument("--block", type=int, default=None,
                    help="elements per scale (default: each format's own: 256; 16 for nvfp4, 32 for MX)")
    ap.add_argument("-n", "--iters", type=int, default=10,
                    help="timed calls per row (time = median over them of the slowest rank)")
    ap.add_argument("-w", "--warmup", type=int, default=2, help="untimed calls per row")
    ap.add_argument("-c", "--check", type=int, default=1, choices=[0, 1],
                    help="1 (default): count results that differ from the reference simulation, bit "
                         "for bit, and ranks that disagree; 0: skip (the check is slow at large sizes)")
    add_json(ap)
    ap.add_argument("--label", default="", help="a title for this run in the JSON (used by studies' plot)")
    ap.add_argument("--algorithm", default="auto", choices=ALGORITHMS, help="allreduce algorithm (default auto)")
    ap.add_argument("--slice-elems", type=int, default=None,
                    help="pipelining slice in values (default: automatic; changes speed, never results)")
    ap.add_argument("--allow-native", type=int, default=1, choices=[0, 1],
                    help="1 (default): auto may take the transport's own allreduce where predicted faster; "
                         "0: keep every giftcomm row compressed (allow_native=False)")
    ap.add_argument("--baselines", default=",".join(BASELINES),
                    help="baseline rows, comma-separated, of: mpi (MPI_Allreduce float32), mpibf "
                         "(MPI_Allreduce bfloat16), ring-bf16 (giftcomm's bf16 ring); '' for none")
    ap.add_argument("--shared-memory", default="auto", choices=list(SHARED_MEMORY),
                    help="zero-copy shared window when every rank is on one node (auto: yes unless "
                         "$GIFTCOMM_SHARED_MEMORY=0); changes speed, never results")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fmts = split_list(args.fmt)
    unknown = [f for f in fmts if f not in FORMATS]
    if unknown:
        print(f"unknown format(s) {unknown}; known: {list(FORMATS)}", file=sys.stderr)
        return 2
    sizes = size_range(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    baselines = tuple(split_list(args.baselines)) if args.baselines else ()
    if set(baselines) - set(BASELINES):
        print(f"unknown baseline(s) {sorted(set(baselines) - set(BASELINES))}; known: {list(BASELINES)}",
              file=sys.stderr)
        return 2
    from mpi4py import MPI

    from giftcomm.transport.mpi import MpiTransport

    comm = MPI.COMM_WORLD
    transport = MpiTransport(comm, shared_memory=SHARED_MEMORY[args.shared_memory])
    places = placement(comm, transport)
    link = (config.raw("GIFTCOMM_NETBED_RATE") or "host (no netbed shaping)")
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if comm.rank == 0:
        print(f"# giftcomm {giftcomm.__version__} allreduce: nRanks {comm.size} minBytes {sizes[0]} "
              f"maxBytes {sizes[-1]} step: {args.stepfactor:g}(factor) warmup iters: {args.warmup} "
              f"iters: {args.iters} validation: {args.check} date: {date}")
        print(f"# algorithm={args.algorithm} slice={args.slice_elems} dtype={args.dtype} op={args.op} "
              f"block={args.block or 'per format'}; time = median over the iters of the slowest rank; out-of-place only")
        print(f"# native codec: {'yes' if codec.native_available() else 'NO (NumPy reference)'}; "
              f"MPI: {mpi_library_version()}; link: {link}; shared window: "
              f"{'yes (zero-copy ring/direct)' if transport.shared_memory else 'no (MPI messages)'}")
        tuning = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(("MPIR_CVAR_", "FI_", "UCX_")))
        if tuning:
            print("# MPI settings from the environment (every row alike): " + " ".join(tuning))
        print("# wire bytes/value: " + ", ".join(f"{f}={bytes_per_value(f, resolve_block(f, args.block)):.4f}" for f in fmts)
              + "; baselines (same run): mpi = MPI_Allreduce on float32, mpibf = MPI_Allreduce on bfloat16 "
              "(giftcomm's bf16 MPI op), bf16 ring = giftcomm's own; xbest = fastest baseline's time / this row's")
        print("# algbw = size/time, busbw = algbw*2(P-1)/P (nccl-tests), both GB/s (1e9 B/s) of input "
              "bytes; wirebw = busbw in bytes sent")
        print("#")
        print("# Using ranks")
        for pl in places:
            print(f"#  Rank {pl['rank']:2d} Group  0 Pid {pl['pid']:6d} on {pl['host']:>10} "
                  f"node {pl['node']:2d} cpus {pl['cpus']}")
        print("#")
        print(HEADER, flush=True)

    def on_row(r: Row) -> None:
        if comm.rank == 0:
            print(format_row(r), flush=True)

    rows = run_allreduce_sweep(comm, sizes, fmts, args.dtype, args.op, args.block, args.iters, args.warmup,
                               bool(args.check), args.seed, not args.no_progress, on_row, args.algorithm,
                               args.slice_elems, transport, baselines, bool(args.allow_native))
    transport.free()
    bad = sum(r.wrong or 0 for r in rows)
    if comm.rank == 0:
        for line in footer(rows, bool(args.check)):
            print(line)
        if args.json:
            doc = {"tool": "giftcomm.perf allreduce", "giftcomm_version": giftcomm.__version__,
                   "mpi_library": mpi_library_version(), "date": date, "P": comm.size,
                   "hosts": sorted({pl["host"] for pl in places}), "placement": places, "label": args.label,
                   "link": (config.raw("GIFTCOMM_NETBED_RATE") or "host"), "args": vars(args),
                   "units": {"size": "B", "time_us": "us", "algbw": "GB/s", "busbw": "GB/s", "wirebw": "GB/s"},
                   "out_of_bounds": bad if args.check else None,
                   "avg_busbw": float(np.mean([r.busbw for r in rows if not is_baseline(r)] or [0.0])),
                   "rows": [asdict(r) for r in rows]}
            with open(args.json, "w") as fh:
                json.dump(doc, fh, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
