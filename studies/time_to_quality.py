"""Time to quality on a network: wall-clock seconds and steps each wire needs to reach a target
validation loss, from training runs whose gradients really crossed rate-shaped links.

The runs are ``studies.train`` runs under ``--transport mpi`` on the netbed (P hosts, one rank
each; the gradients go through giftcomm's GradSync over MPI/TCP, through the shapers), one
folder per link rate::

    perf/netbed run --hosts 4 --rate 100mbit --timeout 3000 -- env OMP_NUM_THREADS=1 \\
        python -m studies train --transport mpi --world 4 --size medium --seeds 0 \\
        --modes fp32,bf16,e4m3-n,nvfp4-n --val-every 5 --out DIR/100mbit
    (the same at --rate 1gbit into DIR/1gbit)
    python -m studies time-to-quality 100mbit=DIR/100mbit 1gbit=DIR/1gbit \\
        --json perf/results/time-to-quality.json --png perf/results/time-to-quality.png

A run's clock is the sum of its steps' ``t_step`` (the slowest rank's forward, backward,
gradient sync and update; the validation passes are not counted). Two targets: "reference", the
final validation loss of the ``fp32`` run of the same rate and seed, and "stated", ``--target X``
(one loss for every run, e.g. one every wire reaches: a single seed's final loss carries the
run-to-run chaos of the training comparison); a run reaches a target at its first validation at
or below it. Bytes per
step are what one rank sends in a ring allreduce of the model's gradient values in the mode's
wire format: ``2 (P - 1)`` messages of ``ceil(n / P)`` values (giftcomm.formats.message_nbytes).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import numpy as np

from studies import train


def bytes_per_step(mode: str, n_values: int, world: int) -> int:
    """Bytes one rank sends a step in a ring allreduce of ``n_values`` gradient values in
    ``mode``'s wire (baseline wires: their element format, one scale per tensor ignored)."""
    from giftcomm.formats import message_nbytes

    if world < 2:
        return 0
    fmt = train.parse_mode(mode).fmt
    chunk = -(-n_values // world)
    if fmt in train.BASELINES:
        return 2 * (world - 1) * chunk  # one FP8 byte a value, the per-tensor scale aside
    return 2 * (world - 1) * message_nbytes(chunk, fmt)


def run_curve(rows: list[dict]) -> list[tuple[float, int, float]]:
    """(seconds since the start, step, validation loss) at every validated step of one run."""
    clock, out = 0.0, []
    for r in rows:
        clock += r["t_step"]
        if not math.isnan(r["val_loss"]):
            out.append((clock, int(r["step"]), r["val_loss"]))
    return out


def reach(curve: list[tuple[float, int, float]], target: float) -> tuple[float | None, int | None]:
    """(seconds, steps) at the first validation at or below ``target``; (None, None) if never."""
    for seconds, step, val in curve:
        if val <= target:
            return seconds, step + 1
    return None, None


def analyse(folders: dict[str, str], n_values: int, target: float | None = None, reference: str = "fp32") -> dict:
    """{"targets": what each means, "rates": {rate: {"world", "rows": [...]}}} for run folders
    keyed by rate. Each row: mode, seed, bytes_per_step, seconds_per_step (median), steps,
    total_seconds, final_val, the curve [[seconds, step, val], ...], and per target ("reference":
    the final validation loss of the ``reference`` run of the same rate and seed; "stated": the
    ``target`` loss, when given) {loss, steps, seconds (None: not reached), speedup against the
    reference run's seconds to the same target}."""
    targets = {"reference": f"the final validation loss of the {reference} run (same rate, seed)"}
    if target is not None:
        targets["stated"] = f"validation loss {target}"
    out: dict[str, Any] = {"targets": targets, "rates": {}}
    for rate, folder in folders.items():
        runs = train.load_runs(folder)
        if not runs:
            raise ValueError(f"{rate}: no studies.train runs in {folder}")
        worlds = {w for w, _ in runs}
        if len(worlds) != 1:
            raise ValueError(f"{rate}: runs of several world sizes in {folder}: {sorted(worlds)}")
        (world,) = worlds
        rows = []
        for (_, mode), by_seed in sorted(runs.items()):
            for seed, steps in sorted(by_seed.items()):
                ref = runs.get((world, reference), {}).get(seed)
                goals = {"reference": ref[-1]["val_loss"] if ref else float("nan")}
                if target is not None:
                    goals["stated"] = target
                curve = run_curve(steps)
                row: dict[str, Any] = dict(mode=mode, seed=seed, bytes_per_step=bytes_per_step(mode, n_values, world),
                                           seconds_per_step=float(np.median([r["t_step"] for r in steps])),
                                           steps=len(steps), total_seconds=curve[-1][0] if curve else float("nan"),
                                           final_val=steps[-1]["val_loss"], curve=[list(c) for c in curve])
                for name, goal in goals.items():
                    seconds, n = reach(curve, goal) if not math.isnan(goal) else (None, None)
                    row[name] = dict(loss=goal, steps=n, seconds=seconds)
                rows.append(row)
        for r in rows:
            base = next((b for b in rows if b["mode"] == reference and b["seed"] == r["seed"]), None)
            for name in targets:
                mine, theirs = r[name]["seconds"], base[name]["seconds"] if base else None
                r[name]["speedup"] = theirs / mine if mine and theirs else None
        out["rates"][rate] = dict(world=world, folder=folder, rows=rows)
    return out


def markdown(result: dict) -> str:
    lines = [f"Targets: {'; '.join(f'{k}: {v}' for k, v in result['targets'].items())}.", "",
             "| rate | mode | seed | MB/step | s/step | target | loss | steps to it | seconds to it | speed-up vs fp32 "
             "| final val |", "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for rate, r in result["rates"].items():
        for row in r["rows"]:
            for name in result["targets"]:
                t = row[name]
                seconds = "-" if t["seconds"] is None else f"{t['seconds']:.1f}"
                steps = "not reached" if t["steps"] is None else str(t["steps"])
                speedup = "-" if t["speedup"] is None else f"{t['speedup']:.2f}x"
                lines.append(f"| {rate} | {row['mode']} | {row['seed']} | {row['bytes_per_step'] / 1e6:.2f} | "
                             f"{row['seconds_per_step']:.3f} | {name} | {t['loss']:.4f} | {steps} | {seconds} | "
                             f"{speedup} | {row['final_val']:.4f} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Validation loss against wall-clock seconds, one panel per rate, a line per mode and seed."""
    from studies.plotting import pyplot, save

    plt = pyplot()
    rates = list(result["rates"])
    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.8), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for row in result["rates"][rate]["rows"]:
            c = np.array(row["curve"])
            ax.plot(c[:, 0], c[:, 2], marker=".", lw=1.2, label=f"{row['mode']} (seed {row['seed']})")
        for name in result["targets"]:
            for t in {row[name]["loss"] for row in result["rates"][rate]["rows"]}:
                if not math.isnan(t):
                    ax.axhline(t, color="k", lw=0.7, ls=":" if name == "reference" else "--")
        lo = min(v for row in result["rates"][rate]["rows"] for _, _, v in row["curve"])
        ax.set_ylim(lo - 0.05, lo + 0.6)  # the approach to the target, not the first steps' fall
        ax.set(title=f"{rate}, P = {result['rates'][rate]['world']} hosts: validation loss against time",
               xlabel="wall-clock seconds (training steps)", ylabel="nats/byte")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies time-to-quality", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("folders", nargs="+", metavar="RATE=DIR", help="a studies.train output folder per link rate")
    p.add_argument("--target", type=float, default=None,
                   help="a stated target loss for every run (beside the fp32 run's final loss)")
    p.add_argument("--size", choices=sorted(train.SIZES), default="medium", help="the runs' model preset (its n)")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    a = p.parse_args(argv)
    folders = {}
    for spec in a.folders:
        rate, sep, folder = spec.partition("=")
        if not sep:
            p.error(f"expected RATE=DIR, got {spec!r}")
        folders[rate] = folder
    n = int(train.make_model(train.SIZES[a.size], 0).num_parameters())
    result = analyse(folders, n, a.target)
    result["command"] = "python -m studies time-to-quality " + " ".join(argv if argv is not None else sys.argv[1:])
    result["n_values"] = n
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    if a.png:
        plot(result, a.png)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
