"""Error growth with the rank count: ring vs direct vs hierarchical vs recursive doubling.

::

    python -m studies errors [--ps 2,3,4,6,8,12,16,24,32,48,64] [--mpi-ps 2,3,4] [--n 32768]
                             [--fmt e4m3,e5m2] [--rounding nearest] [--algos ring,direct,...]
                             [--trials 3] [--seed 0] [--out perf/results/errors-study.md]

For every value distribution (``gaussian``: independent N(0,1) per rank; ``heavy``: Student-t
with 3 degrees of freedom, heavy-tailed; ``correlated``: a common N(0,1) vector shared by all
ranks plus independent N(0, 0.5^2) noise, as gradients that agree in direction), every
block-scaled wire format (``--fmt``: e4m3, e5m2, mxfp8, mxfp8_e5m2, mxfp4, nvfp4; each with its
own block), every rounding (``--rounding``: nearest, stochastic), every rank count P and every
algorithm, the relative error

    ||allreduce(x_1..x_P) - sum_fp64(x_1..x_P)||_2 / ||sum_fp64||_2

is computed with the single-process reference simulation (giftcomm.reference.simulate_allreduce;
the mean over ``--trials`` seeds ``seed, seed+1, ...``: trial ``t`` draws its inputs from seed
``seed+t`` and, with stochastic rounding, passes ``seed=seed+t`` to the call). Hierarchical uses
nodes of 4 consecutive ranks (``hierarchical:L``: of L; rows only for P divisible by it). Then,
for each P in ``--mpi-ps``, the inputs of seed ``--seed`` go through the real
``giftcomm.allreduce`` under ``mpiexec -n P`` (spawned by this command; ``--mpi-ps ''`` skips
it): the table shows the MPI error and whether the MPI result equals the simulation bit for bit
on every rank. Writes a markdown report, a PNG plot and the raw JSON (``--out`` with .png/.json);
every row names its format and rounding.

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

from giftcomm.cost.model import Topology, error_growth, quantizations
from giftcomm.formats import bytes_per_value
from giftcomm.perf.common import Progress, add_fmt, parent_parser
from giftcomm.reference import simulate_allreduce

__all__ = ["make_inputs", "relative_error", "sim_error", "study", "ErrorRow", "DISTS", "ALGOS", "ROUNDINGS",
           "main"]

DISTS = ("gaussian", "heavy", "correlated")
ALGOS = ("ring", "direct", "hierarchical", "doubling", "oneshot")
ROUNDINGS = ("nearest", "stochastic")
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


def split_algo(algo: str) -> tuple[str, int | None]:
    """"hierarchical:2" -> ("hierarchical", 2); "ring" -> ("ring", None) (the spelling of
    ``python -m studies fidelity --algos``)."""
    name, _, ls = algo.partition(":")
    if name not in ALGOS:
        raise ValueError(f"unknown algorithm {algo!r}; known: {ALGOS} (hierarchical:L for nodes of L ranks)")
    if ls and name != "hierarchical":
        raise ValueError(f"only hierarchical takes a node size, got {algo!r}")
    return name, (int(ls) if ls else None)


def local_size_for(algo: str, p: int) -> int | None:
    """Ranks per node for the hierarchical algorithm in this study (None: not applicable).
    ``hierarchical``: nodes of 4; ``hierarchical:L``: nodes of L (both only where it divides P)."""
    name, k = split_algo(algo)
    if name != "hierarchical":
        return None
    k = k or LOCAL_SIZE
    return k if p % k == 0 else None


def rounding_kw(rounding: str, seed: int) -> dict:
    """The rounding keywords of one call: stochastic rounding is seeded with ``seed``."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; known: {ROUNDINGS}")
    return {"rounding": "stochastic", "seed": seed} if rounding == "stochastic" else {}


def sim_error(dist: str, fmt: str, p: int, algo: str, n: int, seed: int, local_size: int | None = None,
              rounding: str = "nearest") -> float:
    """Relative error of the simulated allreduce of ``make_inputs(dist, p, n, seed)``; with
    stochastic rounding the call's seed is ``seed`` too."""
    xs = make_inputs(dist, p, n, seed)
    y = simulate_allreduce(xs, fmt=fmt, algorithm=split_algo(algo)[0], local_size=local_size,
                           **rounding_kw(rounding, seed))[0]
    return relative_error(y, xs)


@dataclass
class ErrorRow:
    """Mean relative error over trials (simulation); with MPI: its error and the bit check.
    algorithm: the base name (ring, direct, hierarchical, doubling); local_size: hierarchical's
    node size. rounding: nearest or stochastic (seeded per call with the trial's seed)."""

    dist: str
    fmt: str
    p: int
    algorithm: str
    local_size: int | None
    relerr: float
    source: str = "sim"              # "sim", "mpi" or "sim-trial0" (the simulation of the MPI inputs)
    identical: bool | None = None     # mpi: equals the simulation on every rank, bit for bit
    rounding: str = "nearest"


def study(ps, fmts=("e4m3", "e5m2"), dists=DISTS, algos=ALGOS, n: int = 1 << 15, trials: int = 3,
          progress: bool = False, roundings=("nearest",), seed: int = 0) -> list[ErrorRow]:
    """The simulated error table: one ErrorRow per distribution, format, rounding, P and
    applicable algorithm (``hierarchical:L``: nodes of L), the mean over the seeds
    ``seed .. seed + trials - 1`` (inputs, and the stochastic rounding's call seed)."""
    rows = []
    cells = [(dist, fmt, rnd, p, algo, local_size_for(algo, p)) for dist in dists for fmt in fmts
             for rnd in roundings for p in ps for algo in algos]
    cells = [c for c in cells if not (split_algo(c[4])[0] == "hierarchical" and c[5] is None)]
    with Progress(len(cells), enabled=progress) as bar:
        for dist, fmt, rnd, p, algo, k in cells:
            bar.update(f"{dist} {fmt} {rnd} P={p} {algo}")
            err = float(np.mean([sim_error(dist, fmt, p, algo, n, s, k, rnd) for s in range(seed, seed + trials)]))
            rows.append(ErrorRow(dist, fmt, p, split_algo(algo)[0], k, err, rounding=rnd))
    return rows


# ----------------------------------------------------------------------------- MPI worker

def mpi_local_size(algo: str, p: int) -> int | None:
    """Ranks per node for hierarchical under MPI at small P: ``hierarchical:L``: L where it
    divides P; ``hierarchical``: 4 if it divides P, else 2; else skip (None)."""
    name, fixed = split_algo(algo)
    if name != "hierarchical":
        return None
    for k in ((fixed,) if fixed else (LOCAL_SIZE, 2)):
        if p % k == 0:
            return k
    return None


def mpi_worker(out_json: str, fmts, dists, algos, n: int, seed: int, roundings=("nearest",)) -> int:
    """Under mpiexec: real allreduce of the study's inputs (seed ``seed``, which also seeds the
    stochastic rounding); rank 0 writes rows to ``out_json``."""
    from mpi4py import MPI

    import giftcomm

    comm = MPI.COMM_WORLD
    p, r = comm.size, comm.rank
    rows = []
    for dist in dists:
        xs = make_inputs(dist, p, n, seed)
        for fmt in fmts:
            for rnd in roundings:
                for algo in algos:
                    name, k = split_algo(algo)[0], mpi_local_size(algo, p)
                    if name == "hierarchical" and k is None:
                        continue
                    kw = rounding_kw(rnd, seed)
                    y = giftcomm.allreduce(xs[r], comm=comm, fmt=fmt, algorithm=name, local_size=k, **kw)
                    want = simulate_allreduce(xs, fmt=fmt, algorithm=name, local_size=k, **kw)[r]
                    ok = comm.allreduce(int(y.tobytes() == want.tobytes()), op=MPI.MIN)
                    digests = comm.allgather(hashlib.sha256(y.tobytes()).hexdigest())
                    ok = bool(ok) and len(set(digests)) == 1
                    rows.append(asdict(ErrorRow(dist, fmt, p, name, k, relative_error(y, xs), "mpi", ok, rnd)))
    if r == 0:
        Path(out_json).write_text(json.dumps(rows))
    return 0


def run_mpi(ps, fmts, dists, algos, n: int, seed: int, timeout: int = 900,
            roundings=("nearest",)) -> list[ErrorRow]:
    """Spawn ``mpiexec -n P`` workers for each P; their rows."""
    rows = []
    from studies import ROOT, subprocess_env

    env, root = subprocess_env(), str(ROOT)
    for p in ps:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = ["mpiexec", "-n", str(p), sys.executable, "-m", "studies.errors", "--worker", out,
                   "--fmt", ",".join(fmts), "--rounding", ",".join(roundings), "--dists", ",".join(dists),
                   "--algos", ",".join(algos), "--n", str(n), "--seed", str(seed)]
            subprocess.run(cmd, check=True, env=env, timeout=timeout, cwd=root)
            rows += [ErrorRow(**d) for d in json.loads(Path(out).read_text())]
    return rows


# ----------------------------------------------------------------------------- report

def _topo(p: int, local_size: int | None) -> Topology:
    k = local_size or p
    return Topology(p, p // k, k)


def _variants(rows: list[ErrorRow]) -> list[tuple[str, str]]:
    """(format, rounding) pairs of the rows, in first-seen order."""
    return list(dict.fromkeys((r.fmt, r.rounding) for r in rows))


def _label(fmt: str, rounding: str) -> str:
    return f"{fmt}, {rounding} rounding"


def ordering_check(rows: list[ErrorRow], predictor=quantizations, tol: float = 0.05) -> list[str]:
    """Pairs of algorithms (same distribution, format, rounding and P) that
    ``predictor(algorithm, topo)`` ranks opposite to their measured error: smaller prediction but
    an error larger by > tol."""
    issues = []
    sims = [r for r in rows if r.source == "sim"]
    for dist, fmt, rnd, p in sorted({(r.dist, r.fmt, r.rounding, r.p) for r in sims}):
        sel = [r for r in sims if (r.dist, r.fmt, r.rounding, r.p) == (dist, fmt, rnd, p)]
        k = next((r.local_size for r in sel if r.local_size), None)
        tag = fmt if rnd == "nearest" else f"{fmt} {rnd}"
        for a in sel:
            for b in sel:
                qa, qb = predictor(a.algorithm, _topo(p, k)), predictor(b.algorithm, _topo(p, k))
                if qa < qb and a.relerr > (1 + tol) * b.relerr:
                    issues.append(f"{dist} {tag} P={p}: {a.algorithm} ({qa:g}) has error "
                                  f"{a.relerr:.3e} > {b.algorithm} ({qb:g}) {b.relerr:.3e}")
    return issues


def _eps(r: ErrorRow) -> float:
    return r.relerr / np.sqrt(error_growth(r.algorithm, _topo(r.p, r.local_size)))


def theory_table(rows: list[ErrorRow]) -> str:
    """relerr / sqrt(error_growth) per distribution, format and rounding: constant if the theory holds."""
    sims = [r for r in rows if r.source == "sim"]
    out = ["| dist | fmt | rounding | eps = relerr / sqrt(error_growth): median | min | max | max / min |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for dist in [d for d in DISTS if any(r.dist == d for r in sims)]:
        for fmt, rnd in _variants(sims):
            e = [_eps(r) for r in sims if (r.dist, r.fmt, r.rounding) == (dist, fmt, rnd)]
            if e:
                out.append(f"| {dist} | {fmt} | {rnd} | {np.median(e):.4f} | {min(e):.4f} | {max(e):.4f} | "
                           f"{max(e) / min(e):.2f} |")
    return "\n".join(out)


def table(rows: list[ErrorRow], dist: str, fmt: str, rounding: str = "nearest") -> str:
    """Markdown: P down, algorithms across (simulation), relative error."""
    sel = [r for r in rows if r.dist == dist and r.fmt == fmt and r.rounding == rounding and r.source == "sim"]
    algos = [a for a in ALGOS if any(r.algorithm == a for r in sel)]
    ps = sorted({r.p for r in sel})
    idx = {(r.p, r.algorithm): r.relerr for r in sel}
    out = ["| P | " + " | ".join(algos) + " | ring / direct |", "| ---: |" + " ---: |" * (len(algos) + 1)]
    for p in ps:
        cells = [f"{idx[(p, a)]:.3e}" if (p, a) in idx else "-" for a in algos]
        ratio = idx[(p, "ring")] / idx[(p, "direct")] if (p, "ring") in idx and (p, "direct") in idx else float("nan")
        out.append(f"| {p} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return "\n".join(out)


def summary_table(rows: list[ErrorRow]) -> str:
    """One line per distribution, format and rounding: bytes per value, each algorithm's error at
    the smallest and the largest simulated P, ring / direct at the largest, and eps (median)."""
    sims = [r for r in rows if r.source == "sim"]
    if not sims:
        return ""
    algos = [a for a in ALGOS if any(r.algorithm == a for r in sims)]
    hi = max(r.p for r in sims)
    span = {a: (min(r.p for r in sims if r.algorithm == a), max(r.p for r in sims if r.algorithm == a)) for a in algos}
    out = ["| dist | fmt | rounding | B/value | " + " | ".join(f"{a} P={span[a][0]} -> {span[a][1]}" for a in algos)
           + f" | ring / direct P={hi} | eps median |",
           "| --- | --- | --- | ---: |" + " ---: |" * (len(algos) + 2)]
    for dist in [d for d in DISTS if any(r.dist == d for r in sims)]:
        for fmt, rnd in _variants(sims):
            sel = [r for r in sims if (r.dist, r.fmt, r.rounding) == (dist, fmt, rnd)]
            if not sel:
                continue
            idx = {(r.p, r.algorithm): r.relerr for r in sel}
            cells = []
            for a in algos:
                ps = sorted(r.p for r in sel if r.algorithm == a)
                cells.append(f"{idx[(ps[0], a)]:.2e} -> {idx[(ps[-1], a)]:.2e}" if ps else "-")
            ratio = (f"{idx[(hi, 'ring')] / idx[(hi, 'direct')]:.2f}"
                     if (hi, "ring") in idx and (hi, "direct") in idx else "-")
            out.append(f"| {dist} | {fmt} | {rnd} | {bytes_per_value(fmt, None):.4f} | " + " | ".join(cells)
                       + f" | {ratio} | {np.median([_eps(r) for r in sel]):.4f} |")
    return "\n".join(out)


def rounding_table(rows: list[ErrorRow]) -> str:
    """Stochastic / nearest error ratio per distribution, format and algorithm at the largest P
    (and the range over all P); empty unless both roundings ran."""
    sims = [r for r in rows if r.source == "sim"]
    idx = {(r.dist, r.fmt, r.rounding, r.p, r.algorithm): r.relerr for r in sims}
    algos = [a for a in ALGOS if any(r.algorithm == a for r in sims)]
    fmts = list(dict.fromkeys(r.fmt for r in sims))
    out = ["| dist | fmt | " + " | ".join(f"{a}: at max P (min-max over P)" for a in algos) + " |",
           "| --- | --- |" + " ---: |" * len(algos)]
    any_row = False
    for dist in [d for d in DISTS if any(r.dist == d for r in sims)]:
        for fmt in fmts:
            cells = []
            for a in algos:
                ratios = {p: idx[(dist, fmt, "stochastic", p, a)] / idx[(dist, fmt, "nearest", p, a)]
                          for (d, f, rnd, p, al) in idx if (d, f, rnd, al) == (dist, fmt, "nearest", a)
                          and (dist, fmt, "stochastic", p, a) in idx and idx[(d, f, rnd, p, al)] > 0}
                cells.append(f"{ratios[max(ratios)]:.2f} ({min(ratios.values()):.2f}-{max(ratios.values()):.2f})"
                             if ratios else "-")
            if any(c != "-" for c in cells):
                any_row = True
                out.append(f"| {dist} | {fmt} | " + " | ".join(cells) + " |")
    return "\n".join(out) if any_row else ""


def mpi_table(rows: list[ErrorRow]) -> str:
    mpi = [r for r in rows if r.source == "mpi"]
    sim = {(r.dist, r.fmt, r.rounding, r.p, r.algorithm, r.local_size): r.relerr
           for r in rows if r.source == "sim-trial0"}
    out = ["| P | dist | fmt | rounding | algorithm | local_size | relerr (MPI) | relerr (sim, same inputs) | "
           "== simulation, every rank |",
           "| ---: | --- | --- | --- | --- | ---: | ---: | ---: | --- |"]
    for r in sorted(mpi, key=lambda r: (r.p, DISTS.index(r.dist), r.fmt, r.rounding, ALGOS.index(r.algorithm))):
        s = sim.get((r.dist, r.fmt, r.rounding, r.p, r.algorithm, r.local_size))
        out.append(f"| {r.p} | {r.dist} | {r.fmt} | {r.rounding} | {r.algorithm} | {r.local_size or '-'} | "
                   f"{r.relerr:.3e} | {'-' if s is None else f'{s:.3e}'} | {'yes' if r.identical else 'NO'} |")
    return "\n".join(out)


def plot(rows: list[ErrorRow], path: Path) -> None:
    """PNG: one panel per (format and rounding, distribution); relative error against P, one
    line per algorithm."""
    from studies.plotting import pyplot, save

    plt = pyplot()

    sims = [r for r in rows if r.source == "sim"]
    dists = [d for d in DISTS if any(r.dist == d for r in sims)]
    variants = _variants(sims)
    fig, axes = plt.subplots(len(variants), len(dists), figsize=(4.2 * len(dists), 3.4 * len(variants)),
                             squeeze=False, sharex=True)
    style = {"ring": ("tab:red", "o"), "direct": ("tab:blue", "s"), "hierarchical": ("tab:green", "^"),
             "doubling": ("tab:purple", "d")}
    mpi = [r for r in rows if r.source == "mpi"]
    for i, (fmt, rnd) in enumerate(variants):
        for j, dist in enumerate(dists):
            ax = axes[i][j]
            for algo, (c, m) in style.items():
                sel = sorted((r for r in sims if (r.dist, r.fmt, r.rounding, r.algorithm) == (dist, fmt, rnd, algo)),
                             key=lambda r: r.p)
                if sel:
                    lab = f"{algo}" + (f" (nodes of {sel[0].local_size})" if algo == "hierarchical" else "")
                    ax.plot([r.p for r in sel], [r.relerr for r in sel], "-", color=c, marker=m, ms=4, label=lab)
                    node = sel[0].local_size
                else:
                    node = LOCAL_SIZE
                pts = [r for r in mpi if (r.dist, r.fmt, r.rounding, r.algorithm) == (dist, fmt, rnd, algo)
                       and (algo != "hierarchical" or r.local_size == node)]
                if pts:
                    ax.plot([r.p for r in pts], [r.relerr for r in pts], "x", color="k", ms=6)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{dist}, {_label(fmt, rnd)}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(variants) - 1:
                ax.set_xlabel("ranks P")
            if j == 0:
                ax.set_ylabel("relative L2 error vs fp64 sum")
    if mpi:
        axes[0][0].plot([], [], "x", color="k", label="real MPI run")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Allreduce error growth with P (reference simulation" + ("; x = MPI)" if mpi else ")"), fontsize=10)
    save(fig, path)


def _commit() -> str:
    """The checkout's HEAD commit (short), '+dirty' when tracked files differ; 'unknown' outside git."""
    from studies import ROOT

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "studies",
                                "giftcomm"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty (studies/ or giftcomm/)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(rows: list[ErrorRow], args, seconds: float) -> str:
    sims = [r for r in rows if r.source == "sim"]
    blocks = ", ".join(f"{f} {bytes_per_value(f, None):.4f} B/value" for f in dict.fromkeys(r.fmt for r in rows))
    nodes = sorted({r.local_size for r in sims if r.algorithm == "hierarchical" and r.local_size})
    lines = ["# Error growth with the rank count", "", "```", "python -m studies errors "
             + " ".join(args.argv), "```", "",
             f"commit: {getattr(args, 'commit', None) or 'unknown'}", "",
             f"n = {args.n} values per rank, mean over {args.trials} seeds {args.seed}..{args.seed + args.trials - 1} "
             f"(simulation; with stochastic rounding each call is seeded with its trial's seed); each format with "
             f"its own block ({blocks}); hierarchical = nodes of {'/'.join(map(str, nodes)) or LOCAL_SIZE} "
             f"consecutive ranks, fp32 inside a node. relerr = ||y - s||_2 / ||s||_2 against the float64 sum s."
             + (f" {seconds:.0f} s." if seconds else ""), ""]
    if len(_variants(sims)) > 1:
        lines += ["## Summary: every format and rounding", "",
                  "relerr at the smallest and the largest P per algorithm (simulation), ring / direct at the "
                  "largest P, and eps = relerr / sqrt(error_growth) (median over P and algorithms).", "",
                  summary_table(rows), ""]
        rt = rounding_table(rows)
        if rt:
            lines += ["### Stochastic / nearest rounding: error ratio", "", rt, ""]
    one_rounding = len({r.rounding for r in sims}) == 1
    for dist in [d for d in DISTS if any(r.dist == d for r in sims)]:
        for fmt, rnd in _variants(sims):
            if any((r.dist, r.fmt, r.rounding) == (dist, fmt, rnd) for r in sims):
                head = f"{dist}, {fmt}" if one_rounding and rnd == "nearest" else f"{dist}, {_label(fmt, rnd)}"
                lines += [f"## {head}", "", table(rows, dist, fmt, rnd), ""]
    if any(r.source == "mpi" for r in rows):
        bad = sum(not r.identical for r in rows if r.source == "mpi")
        lines += [f"## Real MPI runs (mpiexec), against the simulation of the same inputs (seed {args.seed})", "",
                  "hierarchical: nodes of 4 ranks where 4 divides P, else 2 (hierarchical:L: L).", "",
                  mpi_table(rows), "",
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
                  ["Yes: at every distribution, format, rounding and P, an algorithm with a smaller prediction "
                   "never had a larger error (5% tolerance)."])
        lines.append("")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m studies errors", description="allreduce error growth with P",
                                 parents=[parent_parser(seed=0)])
    ap.add_argument("--ps", default="2,3,4,6,8,12,16,24,32,48,64", help="rank counts (simulation)")
    ap.add_argument("--mpi-ps", default="2,3,4", help="rank counts for real MPI runs ('' to skip)")
    add_fmt(ap, "e4m3,e5m2", "comma-separated block-scaled formats (e4m3, e5m2, mxfp8, mxfp8_e5m2, mxfp4, nvfp4)")
    ap.add_argument("--rounding", default="nearest",
                    help="comma-separated roundings: nearest, stochastic (seeded with the trial's seed) "
                         "(default nearest)")
    ap.add_argument("--dists", default=",".join(DISTS))
    ap.add_argument("--algos", default=",".join(ALGOS),
                    help=f"comma-separated algorithms; hierarchical:L = nodes of L ranks (default {','.join(ALGOS)}, "
                         f"hierarchical = nodes of {LOCAL_SIZE})")
    ap.add_argument("--n", type=int, default=1 << 15, help="values per rank")
    ap.add_argument("--trials", type=int, default=3, help="seeds averaged in the simulation (--seed, --seed+1, ...)")
    ap.add_argument("--out", default="perf/results/errors-study.md", help="markdown report (.png, .json beside)")
    ap.add_argument("--from-json", metavar="JSON", help="only re-render the report from a previous run's rows")
    ap.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    split = lambda s: [x for x in s.split(",") if x]
    fmts, dists, algos, roundings = split(args.fmt), split(args.dists), split(args.algos), split(args.rounding)
    for a in algos:
        split_algo(a)
    for rnd in roundings:
        rounding_kw(rnd, 0)
    if args.worker:
        return mpi_worker(args.worker, fmts, dists, algos, args.n, args.seed, roundings)
    t0 = time.time()
    if args.from_json:  # re-render the report and plot from a previous run's rows
        rows = [ErrorRow(**d) for d in json.loads(Path(args.from_json).read_text())]
        saved = Path(args.from_json).with_suffix(".args.json")
        if saved.exists():
            first = json.loads(saved.read_text())
            commit = None
            if isinstance(first, dict):  # {"argv": [...], "commit": "..."}
                first, commit = first["argv"], first.get("commit")
            again = build_parser().parse_args(first)
            again.argv, again.from_json, again.out, again.commit = first, args.from_json, args.out, commit
            args = again
        args.commit = getattr(args, "commit", None) or "unknown (re-rendered from JSON)"
        return _write(rows, args, 0.0)
    args.commit = _commit()
    rows = study([int(p) for p in split(args.ps)], fmts, dists, algos, args.n, args.trials,
                 progress=not args.no_progress, roundings=roundings, seed=args.seed)
    mpi_ps = [int(p) for p in split(args.mpi_ps)]
    if mpi_ps:
        mpi_rows = run_mpi(mpi_ps, fmts, dists, algos, args.n, args.seed, roundings=roundings)
        # the simulation of exactly the MPI inputs (seed args.seed), for the side-by-side column
        for r in mpi_rows:
            rows.append(ErrorRow(r.dist, r.fmt, r.p, r.algorithm, r.local_size,
                                 sim_error(r.dist, r.fmt, r.p, r.algorithm, args.n, args.seed, r.local_size,
                                           r.rounding),
                                 "sim-trial0", rounding=r.rounding))
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
            out.with_suffix(".args.json").write_text(json.dumps({"argv": args.argv, "commit": args.commit}))
        plot(rows, out.with_suffix(".png"))
        print(f"# wrote {out}, {out.with_suffix('.png')}, {out.with_suffix('.json')}", file=sys.stderr)
    bad = [r for r in rows if r.source == "mpi" and not r.identical]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
