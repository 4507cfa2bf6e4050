"""``python -m giftcomm.perf side-by-side MODE --trees OLD NEW``: one measurement on two source
trees (say, the commit before a change and after it) in one run, with the baselines measured in the
same runs::

    python -m giftcomm.perf side-by-side allreduce --trees /tmp/old . [--ranks 2] [--sizes 1K,4M]
    python -m giftcomm.perf side-by-side per-call  --trees /tmp/old . [--ranks 1,2] [--rounds 9]
    python -m giftcomm.perf side-by-side auto      [--trees .] [--sizes 1K,16K,256K,1M,4M,16M,64M]
    python -m giftcomm.perf side-by-side ddp       [--trees .] [--width 1024 --depth 6 --batch 64]

Modes (one row of :data:`MODES` each; the first contender is the one compared, the others are the
baselines):

- ``allreduce``: the plain ``giftcomm.allreduce(x, fmt=FMT, out=out)`` of float32, size by size,
  against MPI_Allreduce on float32 (the transport's own collective) and giftcomm's bf16 path.
- ``per-call``: the same at 1 KiB with many back-to-back calls: the per-call overhead.
- ``auto``: ``algorithm="auto"`` against MPI_Allreduce float32, giftcomm's native bf16
  (``algorithm="native", fmt="bf16"``) and its bf16 ring; ``best baseline/this`` is the fastest
  baseline's time over auto's (>= 1: auto at least as fast as every baseline).
- ``ddp``: a DDP training step on gloo (an MLP of ``--depth`` x Linear(``--width``)) with
  giftcomm's hook (``GiftState(fmt=FMT)``: auto) against DDP's default allreduce and the hook with
  compression forced (``allow_native=False``).

Every measurement runs as its own job, ``mpiexec -n P python giftcomm/perf/side_by_side_worker.py``
with PYTHONPATH set to one tree; the worker (of this checkout) uses only giftcomm's public API, so
an older tree needs no new code, and times with this checkout's giftcomm/perf/timing.py (the
contenders of one job in ``--inner-rounds`` interleaved rounds, each round's time the slowest
rank's). ``--rounds`` jobs per tree, the trees' order alternating from round to round (a shared,
noisy machine: the median over rounds is what counts). Prints, per world size, row (size) and
contender, the median over rounds of the seconds per call (microseconds; ddp: milliseconds per
step) in each tree and ``new/old`` (the baselines' own ``new/old`` shows how far the machine
drifted between the trees' runs); on the compared contender's line, ``best baseline/this`` per
tree and, where the tree reports it, the algorithm it ran. With one tree, the same without
``new/old``. The cost model reads the calibration in force (GIFTCOMM_CALIBRATION).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import config
from .sizes import format_size, parse_size
from .timing import load_average

WORKER = Path(__file__).with_name("side_by_side_worker.py")
MARK = "SIDE-BY-SIDE "
#: this checkout (the folder holding the giftcomm package that runs this command)
HERE = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mode:
    """One comparison: the worker's kind, its contenders (label, keywords or None for the transport's
    or DDP's own collective) as a function of the format, and its default sizes, ranks and counts."""

    kind: str
    help: str
    contenders: Any  # fmt -> list[tuple[str, dict | None]]
    sizes: str = ""
    ranks: str = "2"
    calls: int = 0  # 0: by size (about 4 MiB of input per timing, 1 to 50 calls)
    warmup: int = 3
    inner_rounds: int = 7


MODES: dict[str, Mode] = {
    "allreduce": Mode("allreduce", "plain allreduce per size vs MPI_Allreduce fp32 and giftcomm bf16",
                      lambda f: [(f"giftcomm {f}", {"fmt": f}), ("MPI fp32", None), ("giftcomm bf16", {"fmt": "bf16"})],
                      sizes="1K,64K,4M,16M,64M"),
    "per-call": Mode("allreduce", "per-call time at 1 KiB (many back-to-back calls)",
                     lambda f: [(f"giftcomm {f}", {"fmt": f}), ("MPI fp32", None), ("giftcomm bf16", {"fmt": "bf16"})],
                     sizes="1K", ranks="1,2", calls=2000, warmup=200, inner_rounds=9),
    "auto": Mode("allreduce", "algorithm='auto' vs MPI fp32, native bf16 and the bf16 ring",
                 lambda f: [(f"auto {f}", {"fmt": f, "algorithm": "auto"}), ("MPI fp32", None),
                            ("native bf16", {"fmt": "bf16", "algorithm": "native"}),
                            ("bf16 ring", {"fmt": "bf16", "algorithm": "ring"})],
                 sizes="1K,16K,256K,1M,4M,16M,64M"),
    "ddp": Mode("ddp", "DDP step on gloo: giftcomm's hook vs DDP's default allreduce",
                lambda f: [(f"giftcomm hook {f} auto", {"fmt": f}), ("DDP default (gloo)", None),
                           (f"giftcomm hook {f} compressed", {"fmt": f, "allow_native": False})],
                warmup=3, inner_rounds=3),
}


def _tree(path: str) -> Path:
    tree = Path(path).resolve()
    if not (tree / "giftcomm" / "__init__.py").is_file():
        raise SystemExit(f"giftcomm.perf side-by-side: {path} holds no giftcomm package (giftcomm/__init__.py)")
    return tree


def run_worker(tree: Path, ranks: int, params: dict[str, Any], timeout: float, echo: bool) -> dict[str, Any]:
    """One job: the worker under ``mpiexec -n ranks`` with PYTHONPATH=tree; its parsed result line."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("giftcomm.perf side-by-side: no mpiexec on PATH (the mpich wheel, a dependency, provides it)")
    with tempfile.TemporaryDirectory(prefix="giftcomm-sbs-") as tmp:
        params = dict(params, rendezvous=os.path.join(tmp, "rendezvous"))
        env = dict(os.environ, PYTHONPATH=str(tree))
        cmd = [mpiexec, "-n", str(ranks), sys.executable, str(WORKER), json.dumps(params)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
    lines = res.stdout.splitlines()
    if echo:
        for line in lines:
            if not line.startswith(MARK):
                print(f"#   {line}")
    found = [ln[len(MARK):] for ln in lines if ln.startswith(MARK)]
    if res.returncode != 0 or not found:
        raise SystemExit(f"giftcomm.perf side-by-side: the worker on {tree} (P={ranks}) failed (exit code "
                         f"{res.returncode}):\n{res.stderr[-4000:]}{res.stdout[-2000:]}")
    return dict(json.loads(found[-1]))


def _cell(seconds: float | None, scale: float) -> str:
    return f"{seconds * scale:10.2f}" if seconds is not None else f"{'n/a':>10}"


def report(p: int, names: list[str], got: dict[str, list[dict[str, Any]]], mode_rows: list[tuple[str, str]],
           labels: list[str], unit: str, scale: float) -> None:
    """Print the medians over rounds, one line per row and contender (see the module's docstring)."""
    notes: dict[str, dict[str, str]] = {n: {} for n in names}
    med: dict[str, dict[tuple[str, str], float | None]] = {n: {} for n in names}
    for n in names:
        for result in got[n]:
            notes[n].update(result["notes"])
        for row, _ in mode_rows:
            for label in labels:
                vals = [r["rows"][row][label] for r in got[n] if r["rows"][row].get(label) is not None]
                med[n][row, label] = statistics.median(vals) if vals else None
    for row, shown in mode_rows:
        for i, label in enumerate(labels):
            line = f"P={p} {shown:>5}  {label:<28}"
            line += "".join(f" {n + ' ' if len(names) > 1 else ''}{_cell(med[n][row, label], scale)} {unit}" for n in names)
            if len(names) == 2:
                old, new = med[names[0]][row, label], med[names[1]][row, label]
                line += f"  new/old {new / old:5.2f}x" if old and new else "  new/old   n/a"
            if i == 0:
                parts = []
                for n in names:
                    this = med[n][row, label]
                    base = [t for lab in labels[1:] if (t := med[n][row, lab]) is not None]
                    parts.append((f"{n} " if len(names) > 1 else "")
                                 + (f"{min(base) / this:5.2f}x" if this and base else "n/a"))
                line += "  best baseline/this " + " ".join(parts)
                ran = [got[n][-1]["ran"].get(row) for n in names]
                if any(ran):
                    line += "  ran " + " ".join(f"{r or '?'}" for r in ran)
            print(line, flush=True)
    for n in names:
        for label, why in notes[n].items():
            print(f"# P={p} {n}: {label} did not run: {why}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m giftcomm.perf side-by-side", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="modes:\n" + "\n".join(f"  {k:<10} {m.help}" for k, m in MODES.items()))
    ap.add_argument("mode", choices=list(MODES))
    ap.add_argument("--trees", nargs="+", metavar="TREE", default=[str(HERE)],
                    help="one or two source trees (OLD NEW), each holding a giftcomm package; default: this one")
    ap.add_argument("--ranks", help="world sizes, comma-separated (default: the mode's)")
    ap.add_argument("--rounds", type=int, default=5, help="jobs per tree, the trees alternated (default 5)")
    ap.add_argument("--inner-rounds", type=int, help="interleaved rounds of the contenders within a job")
    ap.add_argument("--sizes", help="bytes of float32 input, comma-separated (default: the mode's)")
    ap.add_argument("--fmt", default="e4m3", help="giftcomm's wire format (default e4m3)")
    ap.add_argument("--calls", type=int, help="back-to-back calls (ddp: steps) per timing (default: the mode's)")
    ap.add_argument("--warmup", type=int, help="untimed calls of each contender first")
    ap.add_argument("--width", type=int, default=1024, help="ddp: the MLP's width")
    ap.add_argument("--depth", type=int, default=6, help="ddp: its hidden layers")
    ap.add_argument("--batch", type=int, default=64, help="ddp: the batch")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one job may take")
    ap.add_argument("--echo", action="store_true", help="show the workers' other output")
    args = ap.parse_args(argv)
    mode = MODES[args.mode]
    if not 1 <= len(args.trees) <= 2:
        ap.error("--trees takes one tree or two (OLD NEW)")
    trees = [_tree(t) for t in args.trees]
    names = ["old", "new"] if len(trees) == 2 else ["this"]
    contenders = mode.contenders(args.fmt)
    labels = [label for label, _ in contenders]
    params: dict[str, Any] = {
        "kind": mode.kind, "contenders": [{"label": label, "call": call} for label, call in contenders],
        "rounds": args.inner_rounds or mode.inner_rounds,
        "warmup": mode.warmup if args.warmup is None else args.warmup}
    if mode.kind == "ddp":
        params.update(width=args.width, depth=args.depth, batch=args.batch, steps=args.calls or 6)
        rows, unit, scale = [("step", "step")], "ms", 1e3
    else:
        sizes = [parse_size(s) for s in (args.sizes or mode.sizes).split(",") if s.strip()]
        params.update(sizes=sizes, calls=mode.calls if args.calls is None else args.calls)
        rows, unit, scale = [(str(n), format_size(n)) for n in sizes], "us", 1e6
    print(f"# side-by-side {args.mode}: " + ", ".join(f"{n}={t}" for n, t in zip(names, trees))
          + f"; {args.rounds} rounds of one job per tree (order alternating), {params['rounds']} interleaved rounds "
          f"of the contenders per job; medians over rounds of {unit} per {'step' if mode.kind == 'ddp' else 'call'}"
          f" (the slowest rank's); calibration {config.path('GIFTCOMM_CALIBRATION') or '(default path or built-in)'}",
          flush=True)
    for p in (int(r) for r in (args.ranks or mode.ranks).split(",")):
        got: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for i in range(args.rounds):
            order = list(zip(names, trees))
            if i % 2:
                order.reverse()
            for n, tree in order:
                got[n].append(run_worker(tree, p, params, args.timeout, args.echo))
            print(f"# P={p} round {i + 1}/{args.rounds} done ({' then '.join(n for n, _ in order)}); "
                  f"loadavg {load_average()}", flush=True)
        report(p, names, got, rows, labels, unit, scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
