"""Cost of the geometry on this machine: forward + inverse time per segment, and sync modes.

Shapes (one transformer block, no GQA, SwiGLU MLP; ``out x in`` as in PyTorch's Linear):

- ``llama-300m``: hidden 1024, intermediate 2816 (2.75x), 24 blocks:
  q/k/v/o 1024x1024, gate/up 2816x1024, down 1024x2816.
- ``llama-600m``: hidden 1536, intermediate 4096 (2.67x), 20 blocks:
  q/k/v/o 1536x1536, gate/up 4096x1536, down 1536x4096.

Usage::

    python -m giftcomm.perf geometry-cost transforms [--models llama-300m llama-600m] [--ranks 16 32 64 128]
    mpiexec -n 2 python -m giftcomm.perf geometry-cost sync [--model llama-300m]

Factors are synthetic (random orthonormal eigenbasis, log-spaced eigenvalues): the time does
not depend on their values. Times are the median of ``repeats`` runs after one warm-up.
"""
from __future__ import annotations

import argparse
import os
import platform
from dataclasses import dataclass

import numpy as np

from ..geometry.geometry import Geometry
from ..geometry.layout import Layout
from ..geometry.spectral import Spectrum
from .timing import time_calls

__all__ = ["MODELS", "CostRow", "measure_transform_cost", "format_cost_table", "measure_sync", "block_shapes"]

MODELS: dict[str, dict] = {
    "llama-300m": {"hidden": 1024, "intermediate": 2816, "blocks": 24},
    "llama-600m": {"hidden": 1536, "intermediate": 4096, "blocks": 20},
}


def block_shapes(model: str) -> list[tuple[str, tuple[int, int], int]]:
    """(segment names, (out, in), count per block) of one transformer block's weight matrices."""
    h, i = MODELS[model]["hidden"], MODELS[model]["intermediate"]
    return [("q/k/v/o", (h, h), 4), ("gate/up", (i, h), 2), ("down", (h, i), 1)]


def _random_spectrum(rng, d: int, cond: float = 1e4) -> Spectrum:
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    vals = np.logspace(0, -np.log10(cond), d)
    return Spectrum(vals / vals.mean(), q, 1.0)


@dataclass
class CostRow:
    """One measurement: model, segment names, (out, in), count per block, transform label,
    ranks, flops of forward + inverse, median seconds of forward + inverse."""

    model: str
    names: str
    shape: tuple[int, int]
    count: int
    transform: str
    rank: int | None
    flops: float
    seconds: float


def _time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up."""
    return time_calls(fn, repeats, warmup=1)[0]


def measure_transform_cost(models=("llama-300m", "llama-600m"), ranks=(16, 32, 64, 128),
                           repeats: int = 3, seed: int = 0) -> list[CostRow]:
    """Time forward + inverse of one segment per distinct block shape, full and low-rank k."""
    rng = np.random.default_rng(seed)
    spectra: dict[int, Spectrum] = {}
    rows = []
    for model in models:
        for names, (m, n), count in block_shapes(model):
            for d in (m, n):
                if d not in spectra:
                    spectra[d] = _random_spectrum(rng, d)
            layout = Layout([("w", (m, n))])
            x = rng.standard_normal(m * n).astype(np.float32)
            for k in (None, *ranks):
                geo = Geometry.from_kfac(layout, {"w": (spectra[n], spectra[m])}, rank=k)
                secs = _time(lambda: geo.inverse(geo.forward(x)), repeats)
                rows.append(CostRow(model, names, (m, n), count, "full" if k is None else "low-rank", k,
                                    geo.flops(), secs))
            ident = Geometry.identity(layout)
            rows.append(CostRow(model, names, (m, n), count, "identity (copy)", None, 0.0,
                                _time(lambda: ident.inverse(ident.forward(x)), repeats)))
    return rows


def format_cost_table(rows: list[CostRow]) -> str:
    """Markdown tables: per segment, then per block and per model (time x count x blocks)."""
    out = ["| model | segment | out x in | transform | k | GFLOP fwd+inv | ms fwd+inv | GFLOP/s | ns/elem |",
           "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        m, n = r.shape
        gfs = r.flops / r.seconds / 1e9 if r.flops else 0.0
        out.append(f"| {r.model} | {r.names} | {m}x{n} | {r.transform} | {r.rank or '-'} | "
                   f"{r.flops / 1e9:.2f} | {r.seconds * 1e3:.1f} | {gfs:.1f} | {r.seconds / (m * n) * 1e9:.2f} |")
    out += ["", "| model | transform | k | s per block | s per model (all blocks) | GFLOP per model |",
            "| --- | --- | --- | ---: | ---: | ---: |"]
    for model, transform, rank in dict.fromkeys((r.model, r.transform, r.rank) for r in rows):
        sel = [r for r in rows if (r.model, r.transform, r.rank) == (model, transform, rank)]
        per_block = sum(r.seconds * r.count for r in sel)
        gflop = sum(r.flops * r.count for r in sel) * MODELS[model]["blocks"] / 1e9
        out.append(f"| {model} | {transform} | {rank or '-'} | {per_block:.3f} | "
                   f"{per_block * MODELS[model]['blocks']:.2f} | {gflop:.0f} |")
    return "\n".join(out)


def measure_sync(comm, model: str = "llama-300m", repeats: int = 2, seed: int = 0) -> dict[str, list]:
    """Collective: time KfacEstimator.sync in both modes for one block's factors (7 segments).

    Returns mode -> list of SyncReport (from the slowest rank: max of seconds over ranks)."""
    from mpi4py import MPI

    from ..geometry.estimators import KfacEstimator

    rng = np.random.default_rng([seed, comm.Get_rank()])
    entries = []
    for names, shape, count in block_shapes(model):
        entries += [(f"{names.split('/')[j]}", shape) for j in range(count)] if "/" in names else [(names, shape)]
    layout = Layout(entries)
    est = KfacEstimator(layout)
    for name, (m, n) in entries:
        est.update(name, rng.standard_normal((256, n)), rng.standard_normal((256, m)))
    results: dict[str, list] = {}
    for mode in ("allreduce", "broadcast"):
        results[mode] = []
        for _ in range(repeats + 1):
            comm.Barrier()
            rep = est.sync(comm, mode=mode)
            rep.seconds = comm.allreduce(rep.seconds, op=MPI.MAX)
            results[mode].append(rep)
        results[mode] = results[mode][1:]
    return results


def _machine() -> str:
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "default"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}, "
            f"BLAS threads: {threads}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m giftcomm.perf geometry-cost", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("transforms", help="forward+inverse time per segment")
    t.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    t.add_argument("--ranks", nargs="+", type=int, default=[16, 32, 64, 128])
    t.add_argument("--repeats", type=int, default=3)
    s = sub.add_parser("sync", help="KfacEstimator.sync: allreduce vs broadcast mode (run under mpiexec)")
    s.add_argument("--model", default="llama-300m", choices=list(MODELS))
    s.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    if a.cmd == "transforms":
        print(f"machine: {_machine()}")
        print(format_cost_table(measure_transform_cost(a.models, a.ranks, a.repeats)))
        return
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    res = measure_sync(comm, a.model, a.repeats)
    if comm.Get_rank() == 0:
        print(f"machine: {_machine()}; ranks: {comm.Get_size()}; model block: {a.model} (7 segments, 14 factors)")
        print("| mode | s per sync (median, slowest rank) | rank-0 comm s | rank-0 eigh s | rank-0 send MB |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for mode, reps in res.items():
            r0 = reps[-1]
            print(f"| {mode} | {np.median([r.seconds for r in reps]):.2f} | {r0.comm_seconds:.2f} | "
                  f"{r0.eigh_seconds:.2f} | {r0.bytes / 1e6:.0f} |")


if __name__ == "__main__":
    main()
