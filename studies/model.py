"""The scaling model: check the cost model against real allreduces, and project it to clusters.

Two subcommands::

    mpiexec -n 4 python -m studies model validate [-b 64K -e 64M] [--local-size K] [--out FILE.md]
    python -m studies model project [--out perf/results/model-projection.md]

``validate`` (under mpiexec) times real ``giftcomm.allreduce`` calls for every algorithm that
applies to the rank layout and every format, at input sizes (float32 bytes) from ``-b`` to
``-e``, and prints the cost model's prediction (``giftcomm.cost.model.predict`` with the
calibration in force: GIFTCOMM_CALIBRATION or the default file) beside the measurement. Time per
call: the median over calls of the slowest rank's time (each call starts after a barrier).
Error = (predicted - measured) / measured. It also reports, per (size, format), the algorithm
``auto`` picks and the measured fastest one.

``project`` evaluates the same formulas with constants for a GPU cluster (stated in the output,
see :data:`GPU_ASSUMPTIONS`) for Llama-300M-class and Llama-600M-class gradients on 8..1024 GPUs
in nodes of 4, at several network rates per GPU, for fp32/bf16/e4m3 and GIFT (e4m3 bytes plus
the geometry transform's time), ring and hierarchical; writes a markdown table and a PNG.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from giftcomm.cost.model import Calibration, LinkCost, Topology, choose, load_calibration, predict
from giftcomm.formats import get_format
from giftcomm.perf.common import time_calls, topology
from giftcomm.perf.sizes import format_size, parse_size, size_range
from giftcomm.plans.cache import CACHED_MAX_BYTES

__all__ = ["ValidationRow", "validate_rows", "project_rows", "ProjectionRow", "gpu_calibration",
           "model_params", "gift_transform_seconds", "GPU_ASSUMPTIONS", "main"]

ALL_ALGOS = ("ring", "direct", "doubling", "hierarchical", "hierarchical_direct", "oneshot", "native")


# =============================================================================== validate

@dataclass
class ValidationRow:
    """One (algorithm, format, size): predicted and measured seconds per call, relative error."""

    algorithm: str
    fmt: str
    nbytes: int
    count: int
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def _idle_barrier(comm) -> None:
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def _time_call(comm, fn, iters: int, warmup: int, budget_s: float, stat: str = "median") -> float:
    """Median (or min) over calls of the slowest rank's seconds; each call starts after a barrier.

    At least 3 calls, at most ``iters``, about ``budget_s`` seconds of timed calls in all."""
    return time_calls(fn, iters, warmup=warmup, comm=comm, stat=stat, budget_s=budget_s)[0]


def validate_rows(comm, sizes: list[int], fmts: list[str], algos: list[str], local_size: int | None,
                  cal: Calibration, iters: int, warmup: int, budget_s: float, on_row=None,
                  stat: str = "median") -> tuple[list[ValidationRow], Topology, dict[int, dict[str, float]]]:
    """Collective over the mpi4py ``comm``: time and predict every (size, format, algorithm); and
    per size the native baselines' seconds (giftcomm.perf.collective_bench.baseline_calls: MPI fp32,
    MPI bf16, giftcomm's bf16 ring), timed the same way."""
    import giftcomm
    from giftcomm.perf.collective_bench import BASELINES, baseline_calls
    from giftcomm.plans import persistent
    from giftcomm.transport import resolve

    t = resolve(comm)
    _, topo = topology(t, local_size)
    rows = []
    baselines: dict[int, dict[str, float]] = {}
    able = persistent.able(t, False)
    for size in sizes:
        n = size // 4
        x = np.random.default_rng([7, comm.rank, n]).standard_normal(n, dtype=np.float32)
        calls = baseline_calls(comm, x, BASELINES)
        baselines[size] = {name: _time_call(comm, fn, iters, warmup, budget_s, stat) for name, fn in calls.items()}
        for fmt in fmts:
            for algo in algos:
                # repeated small calls run their cached plan through the node-shared channel
                pred = predict(algo, n, topo, get_format(fmt), 256, cal, channel=able and size <= CACHED_MAX_BYTES)
                if not math.isfinite(pred):
                    continue
                fn = lambda: giftcomm.allreduce(x, comm=comm, fmt=fmt, algorithm=algo, local_size=local_size)
                meas = _time_call(comm, fn, iters, warmup, budget_s, stat)
                row = ValidationRow(algo, fmt, size, n, pred, meas)
                rows.append(row)
                if on_row:
                    on_row(row)
    return rows, topo, baselines


def validation_table(rows: list[ValidationRow], topo: Topology, cal: Calibration,
                     baselines: dict[int, dict[str, float]] | None = None, channel: bool = False) -> str:
    """Markdown: every row, then median |error| per algorithm and format, then auto vs fastest
    and, with ``baselines`` (validate_rows'), against the fastest native baseline. ``channel``:
    the calls up to CACHED_MAX_BYTES ran cached plans through the node-shared channel (auto's
    choice is then the channel's)."""
    out = ["| algorithm | fmt | size | predicted ms | measured ms | error |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r.algorithm} | {r.fmt} | {format_size(r.nbytes)} | {r.predicted_s * 1e3:.3f} | "
                   f"{r.measured_s * 1e3:.3f} | {r.error * 100:+.0f}% |")
    out += ["", "| algorithm | " + " | ".join(sorted({r.fmt for r in rows}, key=_fmt_order)) + " | all |",
            "| --- |" + " ---: |" * (len({r.fmt for r in rows}) + 1)]
    fmts = sorted({r.fmt for r in rows}, key=_fmt_order)
    for algo in [a for a in ALL_ALGOS if any(r.algorithm == a for r in rows)]:
        cells = []
        for f in fmts + [None]:
            errs = [abs(r.error) for r in rows if r.algorithm == algo and (f is None or r.fmt == f)]
            cells.append(f"{np.median(errs) * 100:.0f}%" if errs else "-")
        out.append(f"| {algo} | " + " | ".join(cells) + " |")
    allerr = [abs(r.error) for r in rows]
    out.append("| **all** | " + " | ".join(
        f"{np.median([abs(r.error) for r in rows if r.fmt == f]) * 100:.0f}%" for f in fmts)
        + f" | **{np.median(allerr) * 100:.0f}%** |")
    out += ["", "Median |error| per algorithm and format (above). `auto` (costmodel.choose) against the "
            "measured fastest algorithm (below): ratio = measured time of auto's pick / measured fastest; "
            "xbest = the fastest native baseline's time (MPI_Allreduce fp32, MPI_Allreduce bf16, giftcomm's bf16 "
            "ring, timed in the same run) / auto's pick's.", "",
            "| fmt | size | auto picks | measured fastest | ratio | fastest baseline | xbest |",
            "| --- | ---: | --- | --- | ---: | --- | ---: |"]
    for f in fmts:
        for size in sorted({r.nbytes for r in rows}):
            sel = {r.algorithm: r for r in rows if r.fmt == f and r.nbytes == size}
            if not sel:
                continue
            pick = choose(size // 4, topo, get_format(f), 256, cal, channel=channel and size <= CACHED_MAX_BYTES)
            best = min(sel.values(), key=lambda r: r.measured_s)
            ratio = sel[pick].measured_s / best.measured_s if pick in sel else float("nan")
            base = (baselines or {}).get(size)
            if base:
                name, secs = min(base.items(), key=lambda kv: kv[1])
                xbest = secs / sel[pick].measured_s if pick in sel else float("nan")
                tail = f"{_BASELINE_NAMES.get(name, name)} {secs * 1e3:.3f} ms | {xbest:.2f} |"
            else:
                tail = "- | - |"
            out.append(f"| {f} | {format_size(size)} | {pick} | {best.algorithm} | {ratio:.2f} | {tail}")
    return "\n".join(out)


_BASELINE_NAMES = {"mpi": "MPI fp32", "mpibf": "MPI bf16", "ring-bf16": "bf16 ring"}


def _fmt_order(f: str) -> int:
    order = ["e4m3", "e5m2", "bf16", "fp16", "fp32", "gift"]
    return order.index(f) if f in order else len(order)


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def cmd_validate(args) -> int:
    from mpi4py import MPI

    from giftcomm import codec

    comm = MPI.COMM_WORLD
    cal = load_calibration()
    sizes = size_range(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    fmts = [f for f in args.fmt.split(",") if f]
    algos = [a for a in args.algos.split(",") if a]
    load0 = _loadavg()
    t0 = time.time()
    if comm.rank == 0:
        print(f"# model validate: P={comm.size} local_size={args.local_size} calibration: {cal.source}; "
              f"native codec: {codec.native_available()}; load before: {load0}", flush=True)

    def on_row(r):
        if comm.rank == 0:
            print(f"{r.algorithm:>20} {r.fmt:>5} {format_size(r.nbytes):>5} pred {r.predicted_s * 1e3:9.3f} ms "
                  f"meas {r.measured_s * 1e3:9.3f} ms  err {r.error * 100:+5.0f}%", flush=True)

    rows, topo, baselines = validate_rows(comm, sizes, fmts, algos, args.local_size, cal, args.iters, args.warmup,
                                          args.budget, on_row, args.stat)
    if comm.rank == 0:
        head = (f"P = {comm.size}, topology {topo}, link: {os.environ.get('GIFTCOMM_NETBED_RATE', 'host (shared memory)')}, "
                f"calibration: {cal.source} (shm alpha {cal.shm.alpha * 1e6:.1f} us, {1 / cal.shm.beta / 1e9:.2f} GB/s; "
                f"net alpha {cal.net.alpha * 1e6:.1f} us, {1 / cal.net.beta / 1e9:.3f} GB/s; codec Mvalues/s enc "
                f"{cal.encode_rate / 1e6:.0f} dec {cal.decode_rate / 1e6:.0f} fused {cal.fused_rate / 1e6:.0f} "
                f"acc {cal.accumulate_rate / 1e6:.0f}; call {cal.call_overhead * 1e6:.0f} us, step "
                f"{cal.step_overhead * 1e6:.0f} us); statistic: {args.stat} over calls; load average before {load0}, after {_loadavg()}; "
                f"{time.time() - t0:.0f} s")
        from giftcomm.plans import persistent
        from giftcomm.transport import resolve

        table = validation_table(rows, topo, cal, baselines, channel=persistent.able(resolve(comm), False))
        print(head)
        print(table)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            cmdline = " ".join(["python -m studies model validate"] + (args.argv or []))
            Path(args.out).write_text(f"# Cost model validation\n\n```\nmpiexec -n {comm.size} {cmdline}\n```\n\n"
                                      f"{head}\n\n{table}\n")
    return 0


# =============================================================================== project

#: Constants of the projected GPU cluster (every one an assumption, printed with the results).
GPU_ASSUMPTIONS = {
    "gpus_per_node": 4,            # GH200 nodes: 4 superchips, one NIC each
    "nvlink_GBps": 150.0,          # intra-node, per GPU per direction, achieved (GB/s)
    "nvlink_alpha_us": 3.0,        # intra-node message latency (us)
    "net_alpha_us": 10.0,          # inter-node message latency incl. software (us)
    "hbm_GBps": 2000.0,            # achieved HBM bandwidth for the codec and the transform (GB/s)
    "gemm_TFLOPs": 100.0,          # achieved skinny-GEMM rate for the GIFT transform (TF32, TFLOP/s)
    "transform_rank": 64,          # low-rank k of the GIFT transform on both sides of every matrix
    "vocab": 32000,                # tied input/output embedding, not transformed
}


def model_params(model: str) -> dict[str, int]:
    """Parameter counts of the two model classes (shapes of giftcomm.perf.geometry_cost.MODELS).

    Returns {"matrices": transformed linear-layer elements, "embedding": vocab x hidden (tied),
    "total": all gradient values communicated}. Norm weights are ignored (< 0.1%)."""
    from giftcomm.perf.geometry_cost import MODELS

    m = MODELS[model]
    h, i, blocks = m["hidden"], m["intermediate"], m["blocks"]
    matrices = blocks * (4 * h * h + 3 * h * i)
    emb = GPU_ASSUMPTIONS["vocab"] * h
    return {"matrices": matrices, "embedding": emb, "total": matrices + emb}


#: GFLOP per model of the GIFT transform (forward + inverse, low rank k = 64 on both sides of every
#: matrix), as measured: the "GFLOP per model" column of perf/results/geometry-cost.md
#: (``python -m giftcomm.perf geometry-cost transforms``). The default of gift_transform_seconds.
MEASURED_TRANSFORM_GFLOP: dict[tuple[str, int], float] = {("llama-300m", 64): 318.0, ("llama-600m", 64): 584.0}
_MEASURED_SOURCE = "perf/results/geometry-cost.md"


def gift_transform_seconds(model: str, gflop: float | None = None,
                           a: dict = GPU_ASSUMPTIONS) -> tuple[float, str]:
    """Seconds per step of the GIFT transform (forward of the local gradient + inverse of the sum)
    on one GPU, by a roofline: max(flops / gemm rate, bytes / HBM bandwidth). Flops: ``gflop``
    (GFLOP per model and step) when given, else the measured MEASURED_TRANSFORM_GFLOP for this
    model and rank, else the flop formula of LowRankSide (4 d k + 2 d + k per column per
    application). Bytes: each of the 4 side applications (2 sides, forward and inverse) reads the
    fp32 matrix twice and writes it once (12 B per element). Returns (seconds, how the flops were
    obtained)."""
    k = a["transform_rank"]
    mats = model_params(model)["matrices"]
    source = f"the caller (low-rank k={k})"
    if gflop is None:
        gflop = MEASURED_TRANSFORM_GFLOP.get((model, k))
        source = f"{_MEASURED_SOURCE} (GFLOP per model, low-rank k={k})"
    if gflop is None:
        from giftcomm.perf.geometry_cost import MODELS, block_shapes

        fl = 0.0
        for _, (mo, mi), count in block_shapes(model):
            per_app = lambda d: 4.0 * d * k + 2.0 * d + k
            fl += count * 2.0 * (per_app(mo) * mi + per_app(mi) * mo)
        gflop = fl * MODELS[model]["blocks"] / 1e9
        source = f"LowRankSide flop formula, k={k}"
    t_flop = gflop * 1e9 / (a["gemm_TFLOPs"] * 1e12)
    t_mem = 4 * 12 * mats / (a["hbm_GBps"] * 1e9)
    return max(t_flop, t_mem), f"{gflop:.0f} GFLOP from {source}; {t_flop * 1e3:.1f} ms compute vs {t_mem * 1e3:.1f} ms memory"


def gpu_calibration(rate_gbit: float, a: dict = GPU_ASSUMPTIONS) -> Calibration:
    """Cost-model constants of a GPU cluster with ``rate_gbit`` Gbit/s of network per GPU.

    Codec rates from HBM traffic per float32 value: encode and decode move ~5 B (4 B fp32 +
    ~1 B e4m3), the fused hop ~6 B, decode-accumulate ~9 B."""
    bw = a["hbm_GBps"] * 1e9
    return Calibration(
        shm=LinkCost(alpha=a["nvlink_alpha_us"] * 1e-6, beta=1 / (a["nvlink_GBps"] * 1e9)),
        net=LinkCost(alpha=a["net_alpha_us"] * 1e-6, beta=8 / (rate_gbit * 1e9)),
        encode_rate=bw / 5, decode_rate=bw / 5, fused_rate=bw / 6, accumulate_rate=bw / 9,
        source=f"GPU cluster assumptions, {rate_gbit:g} Gbit/s per GPU")


@dataclass
class ProjectionRow:
    """Predicted seconds of one gradient allreduce per step (plus the transform for GIFT)."""

    model: str
    params: int
    gpus: int
    rate_gbit: float
    algorithm: str
    fmt: str          # fp32, bf16, e4m3 or gift
    seconds: float


def project_rows(models=("llama-300m", "llama-600m"), gpus=(8, 16, 32, 64, 128, 256, 512, 1024),
                 rates=(25, 100, 200, 400), algos=("ring", "hierarchical"),
                 fmts=("fp32", "bf16", "e4m3", "gift"), a: dict = GPU_ASSUMPTIONS,
                 transform_gflop: dict[str, float] | None = None) -> list[ProjectionRow]:
    """Every combination; gradients communicated as one buffer of all parameters per step.
    transform_gflop: GFLOP per step of the GIFT transform by model (gift_transform_seconds's
    ``gflop``; None or a missing model: the measured default, MEASURED_TRANSFORM_GFLOP)."""
    rows = []
    L = a["gpus_per_node"]
    for model in models:
        n = model_params(model)["total"]
        t_gift, _ = gift_transform_seconds(model, (transform_gflop or {}).get(model), a)
        for rate in rates:
            cal = gpu_calibration(rate, a)
            for p in gpus:
                topo = Topology(p, max(p // L, 1), min(L, p))
                for algo in algos:
                    for fmt in fmts:
                        wire = "e4m3" if fmt == "gift" else fmt
                        s = predict(algo, n, topo, get_format(wire), 256, cal) + (t_gift if fmt == "gift" else 0.0)
                        rows.append(ProjectionRow(model, n, p, rate, algo, fmt, s))
    return rows


def projection_table(rows: list[ProjectionRow]) -> str:
    """Markdown: ms per step, one row per (model, rate, algorithm, format), GPUs as columns."""
    gpus = sorted({r.gpus for r in rows})
    out = ["| model | Gbit/s per GPU | algorithm | fmt | " + " | ".join(str(g) for g in gpus) + " |",
           "| --- | ---: | --- | --- |" + " ---: |" * len(gpus)]
    keys = []
    for r in rows:
        k = (r.model, r.rate_gbit, r.algorithm, r.fmt)
        if k not in keys:
            keys.append(k)
    index = {(r.model, r.rate_gbit, r.algorithm, r.fmt, r.gpus): r.seconds for r in rows}
    for k in keys:
        out.append(f"| {k[0]} | {k[1]:g} | {k[2]} | {k[3]} | "
                   + " | ".join(f"{index[(*k, g)] * 1e3:.1f}" for g in gpus) + " |")
    return "\n".join(out)


def paper_comparison(rows: list[ProjectionRow], model="llama-600m", gpus=64, reduction=0.076) -> str:
    """What share of the step the bf16 gradient allreduce would have to take (exposed, not
    overlapped) for GIFT's predicted saving to equal the paper's 7.6% end-to-end reduction."""
    out = ["| algorithm | Gbit/s per GPU | bf16 ms | GIFT ms | saving ms | saving / bf16 | "
           "comm share of bf16 step needed | implied bf16 step s |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    sel = [r for r in rows if r.model == model and r.gpus == gpus]
    for algo in sorted({r.algorithm for r in sel}, key=list(ALL_ALGOS).index):
        for rate in sorted({r.rate_gbit for r in sel}):
            get = {r.fmt: r.seconds for r in sel if r.algorithm == algo and r.rate_gbit == rate}
            bf, gift = get["bf16"], get["gift"]
            save = bf - gift
            if save <= 0:
                out.append(f"| {algo} | {rate:g} | {bf * 1e3:.1f} | {gift * 1e3:.1f} | {save * 1e3:.1f} | "
                           f"{save / bf * 100:.0f}% | (no saving) | - |")
                continue
            share = reduction / (save / bf)
            out.append(f"| {algo} | {rate:g} | {bf * 1e3:.1f} | {gift * 1e3:.1f} | {save * 1e3:.1f} | "
                       f"{save / bf * 100:.0f}% | {share * 100:.0f}% | {save / reduction:.2f} |")
    return "\n".join(out)


def auto_table(cal: Calibration, gpus=(8, 64, 1024), local=4, sizes=None, fmt: str = "e4m3") -> str:
    """Markdown: the algorithm ``auto`` (costmodel.choose) picks, by input size (float32 bytes) and
    GPU count, in nodes of ``local`` (and, for comparison, all on one node of 8)."""
    sizes = sizes or [1 << k for k in range(10, 31, 4)]
    layouts = [("1 node of 8", Topology(8, 1, 8))] + [(f"{g} GPUs", Topology(g, g // local, local)) for g in gpus]
    out = ["| input size | " + " | ".join(name for name, _ in layouts) + " |",
           "| ---: |" + " --- |" * len(layouts)]
    for size in sizes:
        out.append(f"| {format_size(size)} | " + " | ".join(choose(size // 4, t, get_format(fmt), 256, cal) for _, t in layouts) + " |")
    return "\n".join(out)


def plot_projection(rows: list[ProjectionRow], path: Path) -> None:
    """PNG: one panel per (model, rate); GPUs on x (log), ms per step on y (log)."""
    from studies.plotting import pyplot, save

    plt = pyplot()

    models = sorted({r.model for r in rows})
    rates = sorted({r.rate_gbit for r in rows})
    fig, axes = plt.subplots(len(models), len(rates), figsize=(4 * len(rates), 3.4 * len(models)),
                             sharex=True, sharey="row", squeeze=False)
    colors = {"fp32": "tab:red", "bf16": "tab:orange", "e4m3": "tab:blue", "gift": "tab:green"}
    styles = {"ring": "-", "hierarchical": "--"}
    for i, model in enumerate(models):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            for algo in styles:
                for fmt in colors:
                    sel = sorted((r for r in rows if r.model == model and r.rate_gbit == rate
                                  and r.algorithm == algo and r.fmt == fmt), key=lambda r: r.gpus)
                    if sel:
                        ax.plot([r.gpus for r in sel], [r.seconds * 1e3 for r in sel], styles[algo],
                                color=colors[fmt], marker=".", label=f"{fmt} {algo}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{model}, {rate:g} Gbit/s per GPU", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(models) - 1:
                ax.set_xlabel("GPUs (nodes of 4)")
            if j == 0:
                ax.set_ylabel("gradient allreduce, ms per step")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle("Projected gradient-communication time per step (giftcomm cost model, GPU assumptions)", fontsize=10)
    save(fig, path)


def cmd_project(args) -> int:
    rates = [float(r) for r in args.rates.split(",")]
    gpus = [int(g) for g in args.gpus.split(",")]
    gflop = {m: float(v) for m, v in (kv.split("=") for kv in args.transform_gflop.split(",") if kv)}
    rows = project_rows(gpus=tuple(gpus), rates=tuple(rates), transform_gflop=gflop)
    a = GPU_ASSUMPTIONS
    lines = ["# Projected gradient-communication time per step", "",
             "```", "python -m studies model project " + " ".join(args.argv or []), "```", "",
             "Formulas: giftcomm.cost.model.predict (docs/scaling.md), with these constants (assumptions, "
             "not measurements):", ""]
    lines += [f"- {k}: {v}" for k, v in a.items()]
    lines += ["- codec rates from HBM traffic: encode/decode hbm/5 B, fused hop hbm/6 B, accumulate hbm/9 B "
              "values/s; pass-through formats 4x the fused rate (costmodel)",
              "- `ring`: one flat ring over all GPUs; every hop at the network rate (the ring crosses "
              "node boundaries). `hierarchical`: fp32 reduce-scatter inside the node (NVLink), FP8/bf16/fp32 "
              "ring across nodes on 1/4 of the buffer per GPU (each GPU its own NIC), fp32 allgather in the node.",
              "- one allreduce of the whole gradient per step (no bucketing, no overlap with backward): "
              "the time is the exposed communication if nothing overlaps it."]
    for model in ("llama-300m", "llama-600m"):
        pc = model_params(model)
        tg, how = gift_transform_seconds(model, gflop.get(model), a)
        lines.append(f"- {model}: {pc['total'] / 1e6:.0f}M gradient values ({pc['matrices'] / 1e6:.0f}M in "
                     f"transformed linear layers + {pc['embedding'] / 1e6:.1f}M tied embedding); GIFT transform "
                     f"{tg * 1e3:.1f} ms per step ({how})")
    lines += ["", "## ms per step", "", projection_table(rows), "",
              "## Set beside the paper (Llama-600M, 64 GH200: 7.6% less end-to-end time)", "",
              "If the bf16 allreduce is fully exposed and GIFT's only effect on the step is the saving below, "
              "the paper's 7.6% needs the bf16 allreduce to be `0.076 / (saving / bf16)` of the step:", "",
              paper_comparison(rows), "",
              "## What `auto` picks on this cluster (e4m3, 200 Gbit/s per GPU, nodes of 4)", "",
              auto_table(gpu_calibration(200, a)), ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        png = Path(args.png or str(Path(args.out).with_suffix(".png")))
        plot_projection(rows, png)
        print(f"# wrote {args.out} and {png}", file=sys.stderr)
    return 0


# =============================================================================== CLI

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m studies model", description="cost-model validation and projection")
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="predicted vs measured allreduce time (run under mpiexec)")
    v.add_argument("-b", "--minbytes", default="64K")
    v.add_argument("-e", "--maxbytes", default="64M")
    v.add_argument("-f", "--stepfactor", type=float, default=4)
    v.add_argument("--fmt", default="e4m3,bf16,fp32")
    v.add_argument("--algos", default=",".join(ALL_ALGOS), help="algorithms (hierarchical ones need nodes)")
    v.add_argument("--local-size", type=int, default=None, help="treat runs of K consecutive ranks as nodes")
    v.add_argument("-n", "--iters", type=int, default=20, help="at most this many timed calls per row")
    v.add_argument("-w", "--warmup", type=int, default=1)
    v.add_argument("--budget", type=float, default=1.0, help="about this many seconds of timed calls per row")
    v.add_argument("--stat", choices=["median", "min"], default="median",
                   help="statistic over calls (min: best case, for a busy machine)")
    v.add_argument("--out", help="also write the markdown table here")
    p = sub.add_parser("project", help="projections for Llama-300M/600M on GPU clusters")
    p.add_argument("--gpus", default="8,16,32,64,128,256,512,1024")
    p.add_argument("--rates", default="25,100,200,400", help="Gbit/s per GPU")
    p.add_argument("--transform-gflop", default="", metavar="MODEL=GFLOP,...",
                   help="GFLOP per step of the GIFT transform by model (default: the measured "
                        "MEASURED_TRANSFORM_GFLOP, from perf/results/geometry-cost.md)")
    p.add_argument("--out", default="perf/results/model-projection.md")
    p.add_argument("--png", default=None, help="plot (default: --out with .png)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]
    return cmd_validate(args) if args.cmd == "validate" else cmd_project(args)


if __name__ == "__main__":
    sys.exit(main())
