"""Measure the cost model's constants: per-link alpha/beta and the codec's rates.

Run under mpiexec with at least 2 ranks::

    mpiexec -n 2 python -m giftcomm.perf calibrate [--out FILE] [--local-size K]

What is measured (all by ping-pong between two ranks; the other ranks wait without spinning):

- **link classes**: ``shm`` (two ranks on the same node) and ``net`` (two ranks on different
  nodes). Nodes come from ``transport.node_ids()`` (MPI_COMM_TYPE_SHARED), or, with
  ``--local-size K``, each run of K consecutive ranks counts as one node (e.g. on the netbed with
  several ranks per host, or to pretend nodes on one machine). A class with no suitable pair of
  ranks is not measured: its previous value (from the calibration file in force) or the built-in
  default is kept and the output says so.
- **alpha** (seconds per message): one-way time of small messages (8 B .. 1 KiB by default)
  minus the bytes' share ``beta * size``, median over sizes.
- **beta** (seconds per byte): the slope of a least-squares line ``t = a + beta * size`` through
  the one-way times of large messages (256 KiB .. 16 MiB by default).
- **software overheads** (seconds): ``call_overhead`` per allreduce call and ``step_overhead``
  per algorithm step, from tiny (256-value) giftcomm allreduces with ring, direct and doubling:
  the line ``t = call + steps * (alpha + step)`` through (steps, median time).
- **overlap** (0..1): how far wire and codec time hide each other in a pipelined phase, fitted
  to one ring e4m3 allreduce of ``--overlap-bytes`` (16 MiB) timed with all the constants above
  known: 1 means ``max(wire, codec)``, 0 means ``wire + codec`` (one CPU core does both).
- **native path** (``native_alpha``, ``native_beta``): giftcomm's ``algorithm="native"`` (the
  transport's own allreduce, fp32) timed on 256 values (alpha: that time, less ``call_overhead``
  unless the calls ran a cached plan through the node-shared channel, as on one node)
  and on ``--overlap-bytes`` of float32 (beta: what that time leaves per reduced byte,
  ``(P-1)/P * 4n``, beyond twice the link's beta), and the same input summed as bf16 for
  ``native_half_beta``; older files without them get the defaults.
- **nics_per_node** is not measured: ``--nics-per-node N`` sets it (0: one NIC per rank).
- **codec rates** (float32 values per second, one core, on rank 0, e4m3, block 256): encode,
  decode, fused decode_add_encode, decode_accumulate, via ``giftcomm.codec`` (native kernels
  when built), on ``--codec-elems`` values (default 4M: larger than the caches, as in a large
  allreduce). Also, for information, the same for bf16 (a pass-through format).

The result is the JSON that :func:`giftcomm.cost.calibration.load_calibration` reads; it is written to
``--out`` (default: :func:`giftcomm.cost.calibration.calibration_path`) and printed. Extra keys under
``"measured"`` record the raw timings, the load average and the layout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .. import algorithms, codec, config
from ..algorithms.machine import BOUNDS, Calibration, LinkCost
from ..cost.calibration import calibration_path, load_calibration
from ..formats import FORMATS, Format
from .common import time_calls, topology
from .sizes import parse_size, size_range
from .timing import load_average

__all__ = ["fit_line", "fit_link", "measure_codec_rates", "measure_native", "build_calibration", "calibration_json",
           "fit_overheads", "fit_overlap", "steps_of", "main"]


# ----------------------------------------------------------------------------- fitting (pure)

def fit_line(x, y) -> tuple[float, float]:
    """Least-squares line ``y = intercept + slope * x``; returns (intercept, slope).

    x, y: sequences of equal length (>= 2 distinct x values)."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.size != y.size or x.size < 2 or np.ptp(x) == 0:
        raise ValueError("need at least two distinct x values, with one y each")
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def fit_link(sizes, seconds, small_max: int = 1024, large_min: int = 256 * 1024) -> LinkCost:
    """alpha (s/message) and beta (s/byte) from one-way message times.

    sizes: message sizes in bytes; seconds: one-way time of one message of that size. beta is the
    slope of the least-squares line through the points with ``size >= large_min``; alpha is the
    median over the points with ``size <= small_max`` of ``t - beta * size``. Both are clamped
    from below at the smallest value a calibration file may hold (giftcomm.algorithms.machine.BOUNDS): on a
    noisy machine the slope through a few sizes can come out flat or negative. Each group needs at
    least one point (the large group two distinct sizes)."""
    s = np.asarray(sizes, np.float64)
    t = np.asarray(seconds, np.float64)
    large, small = s >= large_min, s <= small_max
    if not small.any():
        raise ValueError(f"no message of at most {small_max} bytes to fit alpha")
    _, beta = fit_line(s[large], t[large])
    beta = max(beta, BOUNDS["beta"][0])
    alpha = max(float(np.median(t[small] - beta * s[small])), BOUNDS["alpha"][0])
    return LinkCost(alpha=alpha, beta=beta)


def steps_of(algorithm: str, p: int) -> int:
    """Message steps of one allreduce on p ranks, as the cost model counts them (the algorithm
    table's ``steps``: ring and direct 2(p-1); doubling log2 of the largest power of two <= p,
    plus 2 when p is not one). ValueError for an algorithm whose steps depend on the node layout."""
    steps = algorithms.row(algorithm).steps
    if steps is None:
        raise ValueError(f"no step count for {algorithm!r}")
    return steps(p)


def fit_overheads(steps, seconds, alpha: float) -> tuple[float, float]:
    """(call_overhead, step_overhead) in seconds from tiny allreduces: the line
    ``t = call + steps * (alpha + step)`` through (steps, seconds); both clamped at 0."""
    intercept, slope = fit_line(steps, seconds)
    return max(intercept, 0.0), max(slope - alpha, 0.0)


def fit_overlap(measured: float, t_full: float, t_none: float) -> float:
    """The overlap in [0, 1] that makes the prediction equal ``measured``, given the predictions
    with full overlap (``t_full``, overlap 1) and none (``t_none``, overlap 0): linear between."""
    if t_none <= t_full:
        return 1.0
    return float(min(1.0, max(0.0, 1.0 - (measured - t_full) / (t_none - t_full))))


# ----------------------------------------------------------------------------- measurements

#: the statistic over repetitions, a key of timing.STATS (median by default; ``--stat min`` for the
#: best case, which is less sensitive to other jobs on a busy machine); set by main()
STAT_NAME = ["median"]


def _idle(comm) -> None:
    """Wait at a barrier without spinning a core (MPICH's blocking waits busy-poll)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def _pingpong(comm, me: int, a: int, b: int, sizes: list[int], reps_small: int, budget_s: float) -> list[float]:
    """One-way seconds per size between ranks a and b (median of repetitions of a round trip / 2).

    Called by a and b only. Each size runs at least 3 round trips, at most ``reps_small``, and for
    about ``budget_s`` seconds."""
    peer = b if me == a else a
    out = []
    for size in sizes:
        buf = np.zeros(max(size, 1), np.uint8)[:size]
        trip = lambda: _round_trip(comm, me, a, peer, buf)
        # warm-up round trips (connection set-up, page faults); a times the last one to choose
        # the repetition count and tells b
        trial = time_calls(trip, 1, warmup=2)[0]
        reps = int(min(reps_small, max(3, budget_s / max(trial, 1e-7)))) if me == a else None
        reps = _exchange_int(comm, me, a, peer, reps)
        out.append(time_calls(trip, reps, warmup=0, stat=STAT_NAME[0])[0] / 2)
    return out


def _round_trip(comm, me: int, a: int, peer: int, buf: np.ndarray) -> None:
    """One ping-pong of ``buf`` between a (sends first) and its peer."""
    from mpi4py import MPI  # lazily, as everywhere in the perf tools

    if me == a:
        comm.Send([buf, MPI.BYTE], peer, 7)
        comm.Recv([buf, MPI.BYTE], peer, 7)
    else:
        comm.Recv([buf, MPI.BYTE], peer, 7)
        comm.Send([buf, MPI.BYTE], peer, 7)


def _exchange_int(comm, me: int, a: int, peer: int, value: int | None) -> int:
    """a sends ``value`` to its peer; both return it."""
    if me == a:
        comm.send(value, dest=peer, tag=8)
        return int(value or 0)
    return int(comm.recv(source=peer, tag=8))


def _pair(nodes: np.ndarray, same_node: bool) -> tuple[int, int] | None:
    """Two ranks on the same node (or on different nodes), rank 0 first when possible."""
    p = len(nodes)
    for a in range(p):
        for b in range(a + 1, p):
            if (nodes[a] == nodes[b]) == same_node:
                return a, b
    return None


def measure_link(comm, pair: tuple[int, int], small: list[int], large: list[int], reps: int,
                 budget_s: float) -> tuple[LinkCost, dict]:
    """Collective over ``comm``: ping-pong between ``pair``; everybody gets (LinkCost, raw data)."""
    a, b = pair
    me = comm.rank
    sizes = small + large
    times = None
    if me in pair:
        times = _pingpong(comm, me, a, b, sizes, reps, budget_s)
    _idle(comm)
    times = comm.bcast(times if me == a else None, root=a)
    link = fit_link(sizes, times, small_max=max(small), large_min=min(large))
    return link, {"pair": list(pair), "sizes": sizes, "one_way_s": times}


def measure_overheads(comm, alpha: float, reps: int = 200, n: int = 256) -> tuple[float, float, dict]:
    """Collective: time tiny giftcomm.allreduce calls (n values, e4m3) with every algorithm of the
    table that has a step count (all but the hierarchical ones); median over calls of the slowest
    rank. Returns (call, step, raw data)."""
    import giftcomm

    x = np.ones(n, np.float32)
    algos = [a.name for a in algorithms.TABLE if a.steps is not None]  # not the hierarchical ones
    times = []
    for algo in algos:
        times.append(time_calls(lambda: giftcomm.allreduce(x, comm=comm, algorithm=algo), reps, warmup=5,
                                comm=comm, stat=STAT_NAME[0])[0])
    steps = [steps_of(a, comm.size) for a in algos]
    if len(set(steps)) < 2:  # e.g. P = 2 has ring = direct = 2 steps, doubling 1: always distinct
        return 0.0, 0.0, {}
    call, step = fit_overheads(steps, times, alpha)
    return call, step, {"algorithms": algos, "steps": steps, "seconds": times, "values": n}


def measure_overlap(comm, cal: Calibration, topo, nbytes: int, reps: int = 5) -> tuple[float, dict]:
    """Collective: time a ring e4m3 allreduce of ``nbytes`` of float32 (statistic over calls of the
    slowest rank) and fit the calibration's overlap to it. Returns (overlap, raw data)."""
    from dataclasses import replace

    import giftcomm

    from ..cost.model import predict
    from ..formats import get_format

    n = nbytes // 4
    x = np.random.default_rng(comm.rank).standard_normal(n, dtype=np.float32)
    measured = time_calls(lambda: giftcomm.allreduce(x, comm=comm, algorithm="ring"), reps, warmup=1,
                          comm=comm, stat=STAT_NAME[0])[0]
    e4m3 = get_format("e4m3")
    t_full = predict("ring", n, topo, e4m3, 256, replace(cal, overlap=1.0))
    t_none = predict("ring", n, topo, e4m3, 256, replace(cal, overlap=0.0))
    ov = fit_overlap(measured, t_full, t_none)
    return ov, {"bytes": nbytes, "measured_s": measured, "predicted_full_overlap_s": t_full,
                "predicted_no_overlap_s": t_none, "overlap": ov}


def measure_native(comm, cal: Calibration, topo, nbytes: int, reps: int = 50) -> tuple[float, float, float, dict]:
    """Collective: time giftcomm's native path on 256 float32 values, and on ``nbytes`` of float32
    input summed as fp32 and as bf16 (statistic over calls of the slowest rank); returns
    (native_alpha, native_beta, native_half_beta, raw data), each clamped at 0 (docs/scaling.md:
    t = native_alpha + (P-1)/P * b n * (2 beta + native_beta), b = 4; native_half_beta: b = 2).
    native_alpha: the whole 256-value call where repeated calls run a cached plan through the
    node-shared channel (what the cost model then predicts without call_overhead), else that
    time less ``call_overhead``."""
    import giftcomm
    from giftcomm.plans import persistent
    from giftcomm.transport import resolve

    link = cal.net if topo.nodes > 1 else cal.shm
    big = max(nbytes // 4, 256)
    times = []
    for n, fmt in ((256, "fp32"), (big, "fp32"), (big, "bf16")):
        x = np.random.default_rng(comm.rank).standard_normal(n, dtype=np.float32)
        times.append(time_calls(lambda: giftcomm.allreduce(x, comm=comm, fmt=fmt, algorithm="native"),
                                reps if n == 256 else 5, warmup=2, comm=comm, stat=STAT_NAME[0])[0])
    fixed = max(times[0] - cal.call_overhead, 0.0)  # the large calls (not cached) pay call_overhead + this
    share = (comm.size - 1) / comm.size * big
    beta = max((times[1] - cal.call_overhead - fixed) / (4 * share) - 2 * link.beta, 0.0)
    half = max((times[2] - cal.call_overhead - fixed) / (2 * share) - 2 * link.beta, 0.0)
    # repeated small calls on one node run their cached plan (giftcomm.plans.cache), which the cost
    # model predicts without call_overhead (costmodel.predict, channel): alpha is that whole call
    cached = persistent.able(resolve(comm), False)
    alpha = times[0] if cached else fixed
    return alpha, beta, half, {"values": [256, big, big], "formats": ["fp32", "fp32", "bf16"], "seconds": times,
                               "native_alpha": alpha, "cached": cached, "native_beta": beta, "native_half_beta": half}


def _rate(fn, n: int, budget_s: float) -> float:
    """Values per second of ``fn`` (which processes n values): the statistic of 5 to 200 calls,
    as many as take about ``budget_s`` seconds."""
    return n / time_calls(fn, 200, warmup=1, stat=STAT_NAME[0], budget_s=budget_s, min_iters=5)[0]


def measure_codec_rates(n: int = 1 << 22, fmt: Format = FORMATS["e4m3"], block: int = 256, budget_s: float = 0.5,
                        seed: int = 0) -> dict[str, float]:
    """Codec throughput in float32 values per second (one call at a time, this process's core)
    for wire format ``fmt``.

    Keys: encode, decode, fused (decode_add_encode), accumulate (decode_accumulate)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n, dtype=np.float32)
    local = rng.standard_normal(n, dtype=np.float32)
    msg = codec.encode(x, fmt, block)
    out_msg = np.empty_like(msg)
    values = np.empty(n, np.float32)
    acc = np.zeros(n, np.float32)
    return {
        "encode": _rate(lambda: codec.encode(x, fmt, block, out=out_msg), n, budget_s),
        "decode": _rate(lambda: codec.decode(msg, n, fmt, block, out=values), n, budget_s),
        "fused": _rate(lambda: codec.decode_add_encode(msg, local, fmt, block, out=out_msg), n, budget_s),
        "accumulate": _rate(lambda: codec.decode_accumulate(msg, acc, fmt, block), n, budget_s),
    }


def build_calibration(previous: Calibration, links: dict[str, LinkCost], rates: dict[str, float] | None,
                      source: str, overheads: tuple[float, float] | None = None) -> Calibration:
    """A new Calibration: measured links and codec rates replace the previous values; the rest kept."""
    cal = Calibration(**{**asdict(previous), "shm": previous.shm, "net": previous.net})
    for name, link in links.items():
        setattr(cal, name, link)
    if rates:
        cal.encode_rate = rates["encode"]
        cal.decode_rate = rates["decode"]
        cal.fused_rate = rates["fused"]
        cal.accumulate_rate = rates["accumulate"]
    cal.source = source
    if overheads is not None:
        cal.call_overhead, cal.step_overhead = overheads
    return cal


def calibration_json(cal: Calibration, measured: dict | None = None) -> str:
    """The calibration file's text: the Calibration's fields (what load_calibration reads) plus,
    under "measured", the raw data (ignored by load_calibration)."""
    doc = json.loads(cal.to_json())
    if measured is not None:
        doc["measured"] = measured
    return json.dumps(doc, indent=1)




def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="giftcomm.perf calibrate",
                                 description="measure the cost model's constants (run under mpiexec, >= 2 ranks)")
    ap.add_argument("--out", help="calibration file to write (default: calibration.calibration_path())")
    ap.add_argument("--local-size", type=int, default=None,
                    help="treat each run of K consecutive ranks as one node (default: ask MPI)")
    ap.add_argument("--small", default="8,64,256,1K", help="sizes (bytes) for alpha, comma-separated")
    ap.add_argument("--large", default="256K,16M",
                    help="smallest,largest size for beta (bytes; factor-2 steps)")
    ap.add_argument("--reps", type=int, default=2000, help="at most this many round trips per size")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds per size (about)")
    ap.add_argument("--codec-elems", default="4M", help="values per codec call (4M = 16 MiB float32)")
    ap.add_argument("--no-codec", action="store_true", help="keep the previous codec rates")
    ap.add_argument("--overlap-bytes", default="16M",
                    help="input size of the ring allreduce that fits the overlap ('' or 0: keep)")
    ap.add_argument("--nics-per-node", type=int, default=None,
                    help="network interfaces per node (0: one per rank; default: keep the previous "
                         "value); e.g. 1 on the netbed, 4 on GH200 nodes with a NIC per GPU")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="statistic over repetitions (min: best case, for a busy machine)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    STAT_NAME[0] = args.stat
    from mpi4py import MPI

    from ..transport.mpi import MpiTransport

    world = MPI.COMM_WORLD
    if world.size < 2:
        print("calibrate needs at least 2 ranks (mpiexec -n 2 ...)", file=sys.stderr)
        return 2
    comm = world.Dup()
    t = MpiTransport(comm)
    if args.local_size and world.size % args.local_size:
        if world.rank == 0:
            print(f"--local-size {args.local_size} must divide {world.size}", file=sys.stderr)
        return 2
    nodes, topo = topology(t, args.local_size)
    layout = f"--local-size {args.local_size}" if args.local_size else "MPI_COMM_TYPE_SHARED"
    small = [parse_size(s) for s in args.small.split(",")]
    lo, hi = (parse_size(s) for s in args.large.split(","))
    large = size_range(lo, hi, 2)
    out_path = Path(args.out) if args.out else calibration_path()
    # the previous values: the file we are about to overwrite if it exists, else the one in force
    previous = load_calibration()
    if out_path.exists():
        try:
            previous = Calibration.from_dict(json.loads(out_path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass
    load_before = load_average()
    links: dict[str, LinkCost] = {}
    raw: dict[str, Any] = {}
    notes = []
    for name, same in (("shm", True), ("net", False)):
        pair = _pair(nodes, same)
        if pair is None:
            notes.append(f"{name}: no pair of ranks {'on one node' if same else 'on different nodes'}; "
                         f"kept {getattr(previous, name)} from {previous.source}")
            continue
        links[name], raw[name] = measure_link(comm, pair, small, large, args.reps, args.budget)
    multi = topo.nodes > 1
    step_link = links.get("net" if multi else "shm") or getattr(previous, "net" if multi else "shm")
    call_ovh, step_ovh, raw["overheads"] = measure_overheads(comm, step_link.alpha)
    rates = None
    if not args.no_codec:
        n = parse_size(args.codec_elems)
        if comm.rank == 0:
            rates = measure_codec_rates(n, FORMATS["e4m3"])
            raw["codec_e4m3"] = rates
            raw["codec_bf16 (information)"] = measure_codec_rates(n, FORMATS["bf16"])
            raw["codec_elems"] = n
            raw["native"] = codec.native_available()
        _idle(comm)
        rates = comm.bcast(rates, root=0)
    else:
        notes.append("codec rates: kept the previous values (--no-codec)")
    cal = build_calibration(previous, links, rates, source=str(out_path), overheads=(call_ovh, step_ovh))
    if args.nics_per_node is not None:
        cal.nics_per_node = args.nics_per_node
    if args.overlap_bytes and parse_size(args.overlap_bytes) > 0:
        cal.overlap, raw["overlap"] = measure_overlap(comm, cal, topo, parse_size(args.overlap_bytes))
        cal.native_alpha, cal.native_beta, cal.native_half_beta, raw["native_path"] = measure_native(
            comm, cal, topo, parse_size(args.overlap_bytes))
    if comm.rank == 0:
        raw.update(stat=args.stat, P=world.size, nodes=nodes.tolist(), layout=layout, host=platform.node(),
                   cpus=os.cpu_count(), loadavg_before=load_before, loadavg_after=load_average(),
                   date=time.strftime("%Y-%m-%d %H:%M:%S"), notes=notes,
                   netbed_rate=config.raw("GIFTCOMM_NETBED_RATE"))
        text = calibration_json(cal, raw)
        if not args.no_write:
            from ..cost.calibration import write_calibration  # atomic: a temporary file, then os.replace

            write_calibration(out_path, text + "\n")
        print(text)
        print(_summary(cal, notes, None if args.no_write else out_path), file=sys.stderr)
    comm.Barrier()
    return 0


def _summary(cal: Calibration, notes: list[str], path: Path | None) -> str:
    lines = [f"# calibration {'written to ' + str(path) if path else '(not written)'}"]
    for name in ("shm", "net"):
        link = getattr(cal, name)
        lines.append(f"#  {name}: alpha = {link.alpha * 1e6:.2f} us/message, "
                     f"beta = {link.beta * 1e9:.4f} ns/byte ({1 / link.beta / 1e9 if link.beta else float('inf'):.2f} GB/s)")
    lines.append(f"#  software: {cal.call_overhead * 1e6:.1f} us per call, {cal.step_overhead * 1e6:.1f} us per step; "
                 f"overlap of wire and codec {cal.overlap:.2f}")
    lines.append(f"#  native path: {cal.native_alpha * 1e6:.1f} us per call, {cal.native_beta * 1e9:.4f} ns per reduced "
                 f"byte beyond the link ({cal.native_half_beta * 1e9:.4f} for 16-bit values)")
    lines.append(f"#  codec (Mvalues/s): encode {cal.encode_rate / 1e6:.0f}, decode {cal.decode_rate / 1e6:.0f}, "
                 f"fused {cal.fused_rate / 1e6:.0f}, accumulate {cal.accumulate_rate / 1e6:.0f}")
    lines += [f"#  note: {n}" for n in notes]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
