"""Error growth with the rank count: ring vs direct vs hierarchical vs recursive doubling.

::

    python -m studies errors [--ps 2,3,4,6,8,12,16,24,32,48,64] [--mpi-ps 2,3,4] [--n 32768]
                                   [--trials 3] [--out perf/results/errors-study.md]

For every value distribution (``gaussian``: independent N(0,1) per rank; ``heavy``: Student-t
with 3 degrees of freedom, heavy-tailed; ``correlated``: a common N(0,1) vector shared by all
ranks plus independent N(0, 0.5^2) noise, as gradients that agree in direction), every FP8
format (e4m3, e5m2), every rank count P and every algorithm, the relative error

    ||allreduce(x_1..x_P) - sum_fp64(x_1..x_P)||_2 / ||sum_fp64||_2

is computed with the single-process reference simulation (giftcomm.reference.simulate_allreduce;
the mean over ``--trials`` seeds). Hierarchical uses nodes of 4 consecutive ranks (rows only for
P divisible by 4). Then, for each P in ``--mpi-ps``, the same inputs go through the real
``giftcomm.allreduce`` under ``mpiexec -n P`` (spawned by this command; ``--mpi-ps ''`` skips
it): the table shows the MPI error and whether the MPI result equals the simulation bit for bit
on every rank. Writes a markdown report, a PNG plot and the raw JSON (``--out`` with .png/.json).

The report also checks what ``auto`` relies on: the cost model's ``quantizations(algorithm)``
should order the algorithms like the measured errors.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from giftcomm.costmodel import Topology, error_growth, quantizations
from giftcomm.perf.common import Progress, add_fmt, parent_parser
from giftcomm.reference import simulate_allreduce

__all__ = ["make_inputs", "relative_error", "sim_error", "study", "ErrorRow", "DISTS", "ALGOS", "main"]

DISTS = ("gaussian", "heavy", "correlated")
ALGOS = ("ring", "direct", "hierarchical", "doubling")
LOCAL_SIZE = 4


def make_inputs(dist: str, p: int, n: int, seed: int) -> list[np.ndarray]:
    """Every rank's float32 input (n values each) for distribution ``dist``; deterministic in seed."""
    out = []
    common = np.random.default_rng([seed, 999_999, n]).standard_normal(n)
    for r in range(p):
        rng = np.random.default_rng([seed, r, n])
        if dist == "gaussian":
            v = rng.standard_normal(n)
        elif dist == "heavy":
            v = rng.standard_t(3, n)
        elif dist == "correlated":
            v = common + 0.5 * rng.standard_normal(n)
        else:
            raise ValueError(f"unknown distribution {dist!r}; known: {DISTS}")
        out.append(v.astype(np.float32))
    return out


def relative_error(y: np.ndarray, inputs: list[np.ndarray]) -> float:
    """||y - s||_2 / ||s||_2 with s the float64 sum of the inputs."""
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    d = y.astype(np.float64) - exact
    return float(np.linalg.norm(d) / np.linalg.norm(exact))


def local_size_for(algo: str, p: int) -> int | None:
    """Ranks per node for the hierarchical algorithm in this study (None: not applicable)."""
    if algo != "hierarchical":
        return None
    return LOCAL_SIZE if p % LOCAL_SIZE == 0 else None


def sim_error(dist: str, fmt: str, p: int, algo: str, n: int, seed: int, local_size: int | None = None) -> float:
    """Relative error of the simulated allreduce of ``make_inputs(dist, p, n, seed)``."""
    xs = make_inputs(dist, p, n, seed)
    y = simulate_allreduce(xs, fmt=fmt, algorithm=algo, local_size=local_size)[0]
    return relative_error(y, xs)


@dataclass
class ErrorRow:
    """Mean relative error over trials (simulation); with MPI: its error and the bit check."""

    dist: str
    fmt: str
    p: int
    algorithm: str
    local_size: int | None
    relerr: float
    source: str = "sim"              # "sim" or "mpi"
    identical: bool | None = None     # mpi: equals the simulation on every rank, bit for bit


def study(ps, fmts=("e4m3", "e5m2"), dists=DISTS, algos=ALGOS, n: int = 1 << 15, trials: int = 3,
          progress: bool = False) -> list[ErrorRow]:
    """The simulated error table (ErrorRow per distribution, format, P, applicable algorithm)."""
    rows = []
    cells = [(dist, fmt, p, algo, local_size_for(algo, p)) for dist in dists for fmt in fmts for p in ps
             for algo in algos]
    cells = [c for c in cells if not (c[3] == "hierarchical" and c[4] is None)]
    with Progress(len(cells), enabled=progress) as bar:
        for dist, fmt, p, algo, k in cells:
            bar.update(f"{dist} {fmt} P={p} {algo}")
            err = float(np.mean([sim_error(dist, fmt, p, algo, n, seed, k) for seed in range(trials)]))
            rows.append(ErrorRow(dist, fmt, p, algo, k, err))
    return rows


# ----------------------------------------------------------------------------- MPI worker

def mpi_local_size(algo: str, p: int) -> int | None:
    """Ranks per node for hierarchical under MPI at small P: 4 if it divides P, else 2, else skip."""
    if algo != "hierarchical":
        return None
    for k in (LOCAL_SIZE, 2):
        if p % k == 0:
            return k
    return None


def mpi_worker(out_json: str, fmts, dists, algos, n: int, seed: int) -> int:
    """Under mpiexec: real allreduce of the study's inputs; rank 0 writes rows to ``out_json``."""
    from mpi4py import MPI

    import giftcomm

    comm = MPI.COMM_WORLD
    p, r = comm.size, comm.rank
    rows = []
    for dist in dists:
        xs = make_inputs(dist, p, n, seed)
        for fmt in fmts:
            for algo in algos:
                k = mpi_local_size(algo, p)
                if algo == "hierarchical" and k is None:
                    continue
                y = giftcomm.allreduce(xs[r], comm=comm, fmt=fmt, algorithm=algo, local_size=k)
                want = simulate_allreduce(xs, fmt=fmt, algorithm=algo, local_size=k)[r]
                ok = comm.allreduce(int(y.tobytes() == want.tobytes()), op=MPI.MIN)
                digests = comm.allgather(hashlib.sha256(y.tobytes()).hexdigest())
                ok = bool(ok) and len(set(digests)) == 1
                rows.append(asdict(ErrorRow(dist, fmt, p, algo, k, relative_error(y, xs), "mpi", ok)))
    if r == 0:
        Path(out_json).write_text(json.dumps(rows))
    return 0


def run_mpi(ps, fmts, dists, algos, n: int, seed: int, timeout: int = 900) -> list[ErrorRow]:
    """Spawn ``mpiexec -n P`` workers for each P; their rows."""
    rows = []
    from studies import ROOT, subprocess_env

    env, root = subprocess_env(), str(ROOT)
    for p in ps:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = ["mpiexec", "-n", str(p), sys.executable, "-m", "studies.errors", "--worker", out,
                   "--fmt", ",".join(fmts), "--dists", ",".join(dists), "--algos", ",".join(algos),
                   "--n", str(n), "--seed", str(seed)]
            subprocess.run(cmd, check=True, env=env, timeout=timeout, cwd=root)
            rows += [ErrorRow(**d) for d in json.loads(Path(out).read_text())]
    return rows


# ----------------------------------------------------------------------------- report

def _topo(p: int, local_size: int | None) -> Topology:
    k = local_size or p
    return Topology(p, p // k, k)


def ordering_check(rows: list[ErrorRow], predictor=quantizations, tol: float = 0.05) -> list[str]:
    """Pairs of algorithms (same distribution, format and P) that ``predictor(algorithm, topo)``
    ranks opposite to their measured error: smaller prediction but an error larger by > tol."""
    issues = []
    sims = [r for r in rows if r.source == "sim"]
    for dist, fmt, p in sorted({(r.dist, r.fmt, r.p) for r in sims}):
        sel = [r for r in sims if (r.dist, r.fmt, r.p) == (dist, fmt, p)]
        k = next((r.local_size for r in sel if r.local_size), None)
        for a in sel:
            for b in sel:
                qa, qb = predictor(a.algorithm, _topo(p, k)), predictor(b.algorithm, _topo(p, k))
                if qa < qb and a.relerr > (1 + tol) * b.relerr:
                    issues.append(f"{dist} {fmt} P={p}: {a.algorithm} ({qa:g}) has error "
                                  f"{a.relerr:.3e} > {b.algorithm} ({qb:g}) {b.relerr:.3e}")
    return issues


def theory_table(rows: list[ErrorRow]) -> str:
    """relerr / sqrt(error_growth) per distribution and format: constant if the theory holds."""
    sims = [r for r in rows if r.source == "sim"]
    out = ["| dist | fmt | eps = relerr / sqrt(error_growth): median | min | max | max / min |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for dist in [d for d in DISTS if any(r.dist == d for r in sims)]:
        for fmt in sorted({r.fmt for r in sims}):
            e = [r.relerr / np.sqrt(error_growth(r.algorithm, _topo(r.p, r.local_size)))
                 for r in sims if r.dist == dist and r.fmt == fmt]
            if e:
                out.append(f"| {dist} | {fmt} | {np.median(e):.4f} | {min(e):.4f} | {max(e):.4f} | {max(e) / min(e):.2f} |")
    return "\n".join(out)


def table(rows: list[ErrorRow], dist: str, fmt: str) -> str:
    """Markdown: P down, algorithms across (simulation), relative error."""
    sel = [r for r in rows if r.dist == dist and r.fmt == fmt and r.source == "sim"]
    algos = [a for a in ALGOS if any(r.algorithm == a for r in sel)]
    ps = sorted({r.p for r in sel})
    idx = {(r.p, r.algorithm): r.relerr for r in sel}
    out = ["| P | " + " | ".join(algos) + " | ring / direct |", "| ---: |" + " ---: |" * (len(algos) + 1)]
    for p in ps:
        cells = [f"{idx[(p, a)]:.3e}" if (p, a) in idx else "-" for a in algos]
        ratio = idx[(p, "ring")] / idx[(p, "direct")] if (p, "ring") in idx and (p, "direct") in idx else float("nan")
        out.append(f"| {p} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return "\n".join(out)


def mpi_table(rows: list[ErrorRow]) -> str:
    mpi = [r for r in rows if r.source == "mpi"]
    sim = {(r.dist, r.fmt, r.p, r.algorithm, r.local_size): r.relerr for r in rows if r.source == "sim-trial0"}
    out = ["| P | dist | fmt | algorithm | local_size | relerr (MPI) | relerr (sim, same inputs) | == simulation, every rank |",
           "| ---: | --- | --- | --- | ---: | ---: | ---: | --- |"]
    for r in sorted(mpi, key=lambda r: (r.p, DISTS.index(r.dist), r.fmt, ALGOS.index(r.algorithm))):
        s = sim.get((r.dist, r.fmt, r.p, r.algorithm, r.local_size))
        out.append(f"| {r.p} | {r.dist} | {r.fmt} | {r.algorithm} | {r.local_size or '-'} | {r.relerr:.3e} | "
                   f"{'-' if s is None else f'{s:.3e}'} | {'yes' if r.identical else 'NO'} |")
    return "\n".join(out)


def plot(rows: list[ErrorRow], path: Path) -> None:
    """PNG: one panel per (distribution, format); relative error against P, one line per algorithm."""
    from studies.plotting import pyplot, save

    plt = pyplot()

    sims = [r for r in rows if r.source == "sim"]
    dists = [d for d in DISTS if any(r.dist == d for r in sims)]
    fmts = sorted({r.fmt for r in sims})
    fig, axes = plt.subplots(len(fmts), len(dists), figsize=(4.2 * len(dists), 3.4 * len(fmts)),
                             squeeze=False, sharex=True)
    style = {"ring": ("tab:red", "o"), "direct": ("tab:blue", "s"), "hierarchical": ("tab:green", "^"),
             "doubling": ("tab:purple", "d")}
    mpi = [r for r in rows if r.source == "mpi"]
    for i, fmt in enumerate(fmts):
        for j, dist in enumerate(dists):
            ax = axes[i][j]
            for algo, (c, m) in style.items():
                sel = sorted((r for r in sims if r.dist == dist and r.fmt == fmt and r.algorithm == algo),
                             key=lambda r: r.p)
                if sel:
                    lab = f"{algo}" + (" (nodes of 4)" if algo == "hierarchical" else "")
                    ax.plot([r.p for r in sel], [r.relerr for r in sel], "-", color=c, marker=m, ms=4, label=lab)
                pts = [r for r in mpi if r.dist == dist and r.fmt == fmt and r.algorithm == algo
                       and (algo != "hierarchical" or r.local_size == LOCAL_SIZE)]
                if pts:
                    ax.plot([r.p for r in pts], [r.relerr for r in pts], "x", color="k", ms=6)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{dist}, {fmt}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(fmts) - 1:
                ax.set_xlabel("ranks P")
            if j == 0:
                ax.set_ylabel("relative L2 error vs fp64 sum")
    axes[0][0].plot([], [], "x", color="k", label="real MPI run (P<=4)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Allreduce error growth with P (reference simulation; x = MPI)", fontsize=10)
    save(fig, path)


def report(rows: list[ErrorRow], args, seconds: float) -> str:
    lines = ["# Error growth with the rank count", "", "```", "python -m studies errors "
             + " ".join(args.argv), "```", "",
             f"n = {args.n} values per rank, mean over {args.trials} seeds (simulation); block 256; "
             f"hierarchical = nodes of {LOCAL_SIZE} consecutive ranks, fp32 inside a node. "
             f"relerr = ||y - s||_2 / ||s||_2 against the float64 sum s."
             + (f" {seconds:.0f} s." if seconds else ""), ""]
    for dist in [d for d in DISTS if any(r.dist == d for r in rows)]:
        for fmt in sorted({r.fmt for r in rows}):
            lines += [f"## {dist}, {fmt}", "", table(rows, dist, fmt), ""]
    if any(r.source == "mpi" for r in rows):
        bad = sum(not r.identical for r in rows if r.source == "mpi")
        lines += ["## Real MPI runs (mpiexec, P <= 4), against the simulation of the same inputs (seed 0)", "",
                  "hierarchical: nodes of 4 ranks where 4 divides P, else 2.", "", mpi_table(rows), "",
                  f"{bad} MPI rows differ from the simulation." if bad else
                  "Every MPI result equals the simulation bit for bit on every rank.", ""]
    lines += ["## Predicted error growth (costmodel.error_growth) against the simulation", "",
              "relerr ~ eps * sqrt(error_growth(algorithm, P)): ring (P+1)/2, direct 2-1/P, doubling "
              "log2(P2)+1+(P-P2)/P, hierarchical (N+1)/2 for N nodes. If that holds, relerr / "
              "sqrt(error_growth) is the same for every algorithm and P:", "", theory_table(rows), ""]
    for name, pred in (("costmodel.quantizations", quantizations), ("costmodel.error_growth", error_growth)):
        issues = ordering_check(rows, pred)
        lines += [f"## Does {name} order the algorithms like their errors?", ""]
        lines += (["Pairs where the smaller prediction came with a larger error (> 5%):", ""]
                  + [f"- {i}" for i in issues] if issues else
                  ["Yes: at every distribution, format and P, an algorithm with a smaller prediction never "
                   "had a larger error (5% tolerance)."])
        lines.append("")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m studies errors", description="allreduce error growth with P",
                                 parents=[parent_parser(seed=0)])
    ap.add_argument("--ps", default="2,3,4,6,8,12,16,24,32,48,64", help="rank counts (simulation)")
    ap.add_argument("--mpi-ps", default="2,3,4", help="rank counts for real MPI runs ('' to skip)")
    add_fmt(ap, "e4m3,e5m2", "comma-separated FP8 formats")
    ap.add_argument("--dists", default=",".join(DISTS))
    ap.add_argument("--algos", default=",".join(ALGOS))
    ap.add_argument("--n", type=int, default=1 << 15, help="values per rank")
    ap.add_argument("--trials", type=int, default=3, help="seeds averaged in the simulation")
    ap.add_argument("--out", default="perf/results/errors-study.md", help="markdown report (.png, .json beside)")
    ap.add_argument("--from-json", metavar="JSON", help="only re-render the report from a previous run's rows")
    ap.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    split = lambda s: [x for x in s.split(",") if x]
    fmts, dists, algos = split(args.fmt), split(args.dists), split(args.algos)
    if args.worker:
        return mpi_worker(args.worker, fmts, dists, algos, args.n, args.seed)
    t0 = time.time()
    if args.from_json:  # re-render the report and plot from a previous run's rows
        rows = [ErrorRow(**d) for d in json.loads(Path(args.from_json).read_text())]
        saved = Path(args.from_json).with_suffix(".args.json")
        if saved.exists():
            first = json.loads(saved.read_text())
            again = build_parser().parse_args(first)
            again.argv, again.from_json, again.out = first, args.from_json, args.out
            args = again
        return _write(rows, args, 0.0)
    rows = study([int(p) for p in split(args.ps)], fmts, dists, algos, args.n, args.trials, progress=not args.no_progress)
    mpi_ps = [int(p) for p in split(args.mpi_ps)]
    if mpi_ps:
        mpi_rows = run_mpi(mpi_ps, fmts, dists, algos, args.n, args.seed)
        # the simulation of exactly the MPI inputs (seed args.seed), for the side-by-side column
        for r in mpi_rows:
            rows.append(ErrorRow(r.dist, r.fmt, r.p, r.algorithm, r.local_size,
                                 sim_error(r.dist, r.fmt, r.p, r.algorithm, args.n, args.seed, r.local_size),
                                 "sim-trial0"))
        rows += mpi_rows
    return _write(rows, args, time.time() - t0)


def _write(rows: list[ErrorRow], args, seconds: float) -> int:
    text = report(rows, args, seconds)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        if not args.from_json:
            out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in rows], indent=0))
            out.with_suffix(".args.json").write_text(json.dumps(args.argv))
        plot(rows, out.with_suffix(".png"))
        print(f"# wrote {out}, {out.with_suffix('.png')}, {out.with_suffix('.json')}", file=sys.stderr)
    bad = [r for r in rows if r.source == "mpi" and not r.identical]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
