"""The training comparison that decides giftcomm's defaults.

One grid of ``studies.train`` runs (same model, data, seeds and schedule for every row; loopback,
P virtual ranks): the wire configurations of ``CONFIGS`` x the optimizers (AdamW; Muon on the
hidden 2-D weights with AdamW on the rest) x seeds. Then:

- the final-loss table: final validation loss mean +- sd over seeds, the paired gap to fp32 of
  the same optimizer and seed (mean +- sd), the training loss of the last 20 steps likewise, and
  the paired differences that decide a default (error feedback against none, a geometry against
  its Euclidean twin); every gap and decision with its paired-t 95% confidence interval
  (``ci95``) and the noise floor (the RMS of the per-seed differences a one-ulp perturbation of
  the initial weights causes: the ``-ulp`` control rows, ``noise`` in compare.json); a gap or
  decision is "resolved" when its interval excludes 0 and its size exceeds the noise floor. The
  metric is the validation loss averaged over the last ``val_last`` evaluations (the powered
  preset: 3 evaluations of 256 KiB of held-out text, ``val_bytes`` in compare.json's config);
- ``train-curves.png``: validation loss against step (mean over seeds, +- sd shaded) and the
  paired training-loss gap to fp32 (moving average), one column per optimizer;
- the paper's rows (``e5m2t-paper``, ``e4m3-paper``, ``e4m3-ef-paper``, ``nvfp4-paper``) run the
  paper's method as its artifact does (``studies.train.PaperInputs``): every Linear weight's own
  gradient scored for FP8 E5M2 saturation over a profile window of ``paper_profile`` steps (20
  of the run's 100; the paper's 100 of thousands) with no map and no error feedback, then the
  top quarter by the scores averaged over the ranks transformed from that step, refreshed every
  ``paper_refresh`` steps (the paper's 50) with the factor EMA (0.95); error feedback, in the
  ``-ef-paper`` rows, on the transformed weights only;
- the step-time side: the transform's measured seconds per step (``t_transform``, slowest rank)
  against the communication time the wire saves, from the 1 Gbit/s netbed (P = 4) results already
  in perf/results: seconds per gradient value of each wire at 64 MiB, times the model's gradient
  values (``netbed_seconds_per_value``).

::

    OMP_NUM_THREADS=1 python -m studies train-compare --out DIR                    # the grid (8 seeds) + report
    OMP_NUM_THREADS=1 python -m studies train-compare --optimizers muon --seeds 0,1,2 --out DIR
    OMP_NUM_THREADS=1 python -m studies train-compare --verify DIR --configs e4m3 --seeds 0  # reproduces?
    python -m studies train-compare --report --out DIR                             # report only
    python -m studies train-compare --quick --out DIR                              # CI: tiny, < 30 s

Writes into ``--out``: the runs (``P<world>-s<seed>-<mode>.csv/.json``, studies.train's format),
``compare.md`` (the tables), ``compare.json`` (the same numbers) and ``train-curves.png``.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from studies import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Row:
    """One configuration of the grid: ``mode`` is the studies.train mode with AdamW (Muon adds
    ``-muon``); ``wire`` names the netbed row its bytes cost (None: not priced)."""

    key: str
    label: str
    mode: str
    wire: str | None


CONFIGS = (
    Row("fp32", "fp32", "fp32", "fp32"),
    Row("bf16", "bf16", "bf16", "bf16"),
    Row("e5m2t", "paper's wire: E5M2 per tensor, NCCL fp16 pairwise sums (baseline 3a)", "e5m2t", "e5m2t"),
    Row("e5m2t-paper", "paper's GIFT: preset + EF (transformed) on the paper's wire", "e5m2t-n-ef-paper", "e5m2t"),
    Row("e4m3", "giftcomm E4M3 block 256", "e4m3-n", "e4m3"),
    Row("e4m3-ef", "giftcomm E4M3 block 256 + error feedback", "e4m3-n-ef", "e4m3"),
    Row("e4m3-paper", "giftcomm E4M3 block 256 + paper preset", "e4m3-n-paper", "e4m3"),
    Row("e4m3-ef-paper", "giftcomm E4M3 block 256 + paper preset + error feedback", "e4m3-n-ef-paper", "e4m3"),
    Row("nvfp4", "NVFP4 (E4M3 scale per 16)", "nvfp4-n", "nvfp4"),
    Row("nvfp4-gift", "NVFP4 + GIFT (giftcomm's default policy)", "nvfp4-n-gift", "nvfp4"),
    Row("nvfp4-paper", "NVFP4 + paper preset", "nvfp4-n-paper", "nvfp4"),
    # noise-floor controls: the row above them with every initial weight one ulp off (same seed)
    Row("fp32-ulp", "fp32, initial weights one ulp off (noise control)", "fp32-ulp", None),
    Row("e4m3-ulp", "giftcomm E4M3 block 256, initial weights one ulp off (noise control)", "e4m3-n-ulp", None),
    Row("nvfp4-ulp", "NVFP4, initial weights one ulp off (noise control)", "nvfp4-n-ulp", None),
)
# (control, the row it perturbs): their paired differences are the runs' own chaos, the noise floor
NOISE_CONTROLS = (("fp32-ulp", "fp32"), ("e4m3-ulp", "e4m3"), ("nvfp4-ulp", "nvfp4"))
OPTIMIZERS = ("adamw", "muon")
# which pairs decide a default: (row, the row it is compared with, what it decides)
DECISIONS = (
    ("e4m3", "e5m2t", "wire: giftcomm E4M3/256 against the paper's E5M2 per tensor"),
    ("e5m2t-paper", "e5m2t", "the paper's GIFT on its own wire"),
    ("e4m3-paper", "e4m3", "geometry (paper preset) on E4M3/256"),
    ("e4m3-ef-paper", "e4m3-ef", "geometry (paper preset) on E4M3/256 with error feedback"),
    ("e4m3", "bf16", "format: E4M3/256 against bf16"),
    ("e4m3-ef", "e4m3", "error feedback on E4M3/256"),
    ("nvfp4", "e4m3", "format: NVFP4 against E4M3/256"),
    ("nvfp4-gift", "nvfp4", "geometry (GIFT, default policy) on NVFP4"),
    ("nvfp4-paper", "nvfp4", "geometry (paper preset) on NVFP4"),
)
# the netbed files (1 Gbit/s, 4 hosts x 1 rank) whose 64 MiB rows price the wires
NETBED_MAIN = "perf/results/netbed-allreduce-1gbit-p4.txt"  # run 1: e4m3, bf16, fp32 on the ring
NETBED_NVFP4 = "perf/results/netbed-1gbit-p4-nvfp4.txt"  # nvfp4, e4m3, fp32 in one run
NETBED_BYTES = 64 << 20


def mode_name(row: Row, opt: str) -> str:
    return row.mode if opt == "adamw" else f"{row.mode}-{opt}"


def _netbed_rows(path: str, first_section_only: bool = False) -> dict[str, float]:
    """fmt -> seconds of the ``NETBED_BYTES`` fp32 input in a ``giftcomm.perf allreduce`` table
    (the first row of each fmt; ``first_section_only``: stop at the second ``## run``)."""
    out: dict[str, float] = {}
    sections = 0
    with open(os.path.join(ROOT, path)) as f:
        for line in f:
            if line.startswith("## run"):
                sections += 1
                if first_section_only and sections > 1:
                    break
            m = re.match(r"\s+(\d+)\s+\d+\s+float\s+sum\s+-?\d+\s+([\d.]+)\s+\S+\s+\S+\s+\d+\s+(\S+)\s", line)
            if m and int(m.group(1)) == NETBED_BYTES and m.group(3) not in out:
                out[m.group(3)] = float(m.group(2)) * 1e-6
    return out


def netbed_seconds_per_value() -> dict[str, dict]:
    """wire -> {"s_per_value", "source"}: the allreduce time of one fp32 gradient value on the
    1 Gbit/s netbed at P = 4 (64 MiB calls, wire-bound). fp32, bf16, e4m3 from NETBED_MAIN's run 1;
    nvfp4 as its ratio to fp32 in NETBED_NVFP4 (same run) times NETBED_MAIN's fp32; e5m2t (the
    paper's per-tensor wire, never run on the netbed) as e4m3's scaled by the bytes per value."""
    n = NETBED_BYTES // 4
    main = _netbed_rows(NETBED_MAIN, first_section_only=True)
    nv = _netbed_rows(NETBED_NVFP4)
    out: dict[str, dict[str, Any]] = {w: {"s_per_value": main[w] / n, "source": f"{NETBED_MAIN} run 1, 64 MiB"}
                                      for w in ("fp32", "bf16", "e4m3")}
    out["nvfp4"] = {"s_per_value": nv["nvfp4"] / nv["fp32"] * main["fp32"] / n,
                    "source": f"{NETBED_NVFP4} (nvfp4/fp32 of that run) x fp32 of {NETBED_MAIN}"}
    # not run on the netbed: 1 byte per value (and one scale per tensor) against E4M3/256's 1.0156
    out["e5m2t"] = {"s_per_value": out["e4m3"]["s_per_value"] / 1.015625,
                    "source": "e4m3's x 1/1.0156 (bytes per value; not measured on the netbed)"}
    return out


def _sd(a) -> float:
    return float(np.std(a, ddof=1)) if len(a) > 1 else float("nan")


def metric(rows: list[dict], last: int) -> float:
    """The comparison's metric of one run: validation loss (nats/byte) averaged over its last
    ``last`` evaluations."""
    vals = [r["val_loss"] for r in rows if not math.isnan(r["val_loss"])]
    return float(np.mean(vals[-last:]))


def ci95(diffs) -> list[float]:
    """The paired t 95% confidence interval [lo, hi] of the mean of ``diffs`` (per-seed paired
    differences); [nan, nan] with fewer than 2."""
    d = np.asarray(diffs, dtype=np.float64)
    if len(d) < 2:
        return [float("nan"), float("nan")]
    from scipy import stats

    half = float(stats.t.ppf(0.975, len(d) - 1)) * float(np.std(d, ddof=1)) / math.sqrt(len(d))
    return [float(d.mean()) - half, float(d.mean()) + half]


def noise_floor(by: dict, opt: str, last: int) -> dict:
    """The noise floor of one optimizer: for each control of NOISE_CONTROLS present, the per-seed
    differences (control minus the row it perturbs, same seed) and their root mean square; the
    floor is the RMS over every control's differences (nats/byte; nan when no control ran)."""
    pairs, every = [], []
    for control, base in NOISE_CONTROLS:
        if (opt, control) not in by or (opt, base) not in by:
            continue
        a, b = by[(opt, control)][1], by[(opt, base)][1]
        common = sorted(set(a) & set(b))
        d = [metric(a[s], last) - metric(b[s], last) for s in common]
        every += d
        pairs.append(dict(row=control, base=base, n=len(d), diffs=d,
                          rms=float(np.sqrt(np.mean(np.square(d)))) if d else float("nan")))
    return dict(floor=float(np.sqrt(np.mean(np.square(every)))) if every else float("nan"), controls=pairs)


def resolved(interval: list[float], mean: float, floor: float) -> bool:
    """A gap or decision is resolved when its 95% interval excludes 0 and its size exceeds the
    noise floor (a comparison without a measured floor resolves nothing)."""
    lo, hi = interval
    return bool((lo > 0 or hi < 0) and not math.isnan(floor) and abs(mean) > floor)


def _tail(rows: list[dict], n: int = 20) -> float:
    return float(np.mean([r["train_loss"] for r in rows[-n:]]))


def compare(runs: dict, world: int, n_values: int, last: int = 1) -> dict:
    """The comparison's numbers: {"rows": [...], "decisions": [...], "noise": {opt: ...}, "time":
    [...]} (see module doc). runs: studies.train.load_runs's; n_values: gradient values per step
    (the model's parameters); last: the metric's number of final evaluations (:func:`metric`)."""
    rows, by = [], {}
    prices = netbed_seconds_per_value()
    for opt in OPTIMIZERS:
        ref = runs.get((world, mode_name(CONFIGS[0], opt)), {})
        for row in CONFIGS:
            got = runs.get((world, mode_name(row, opt)))
            if not got:
                continue
            seeds = sorted(got)
            final = np.array([metric(got[s], last) for s in seeds])
            paired = [s for s in seeds if s in ref]
            gap = np.array([metric(got[s], last) - metric(ref[s], last) for s in paired])
            tgap = np.array([_tail(got[s]) - _tail(ref[s]) for s in paired])
            t_tr = float(np.mean([np.mean([r["t_transform"] for r in got[s][1:]]) for s in seeds]))
            t_geo = float(np.mean([np.mean([r["t_geometry"] for r in got[s][1:]]) for s in seeds]))
            e = dict(opt=opt, key=row.key, label=row.label, mode=mode_name(row, opt), n=len(seeds), seeds=seeds,
                     final=final.tolist(), val=float(final.mean()), val_sd=_sd(final),
                     gap=float(gap.mean()) if len(gap) else float("nan"), gap_sd=_sd(gap),
                     tgap=float(tgap.mean()) if len(tgap) else float("nan"), tgap_sd=_sd(tgap),
                     t_transform=t_tr, t_geometry=t_geo,
                     err_l2=float(np.mean([train._mean_measured(got[s], "err_l2") for s in seeds])))
            e["beyond"] = bool(len(gap) > 1 and abs(e["gap"]) > 2 * e["gap_sd"])
            e["ci95"] = ci95(gap)
            rows.append(e)
            by[(opt, row.key)] = (e, got)
    noise = {opt: noise_floor(by, opt, last) for opt in OPTIMIZERS}
    for e in rows:
        e["noise_floor"] = noise[e["opt"]]["floor"]
        e["resolved"] = resolved(e["ci95"], e["gap"], e["noise_floor"]) if e["key"] != "fp32" else False
    decisions = []
    for key, base, what in DECISIONS:
        for opt in OPTIMIZERS:
            if (opt, key) not in by or (opt, base) not in by:
                continue
            a, b = by[(opt, key)][1], by[(opt, base)][1]
            common = sorted(set(a) & set(b))
            d = np.array([metric(a[s], last) - metric(b[s], last) for s in common])
            dt = np.array([_tail(a[s]) - _tail(b[s]) for s in common])
            interval, floor = ci95(d), noise[opt]["floor"]
            decisions.append(dict(opt=opt, what=what, row=key, base=base, n=len(common), diff=float(d.mean()),
                                  diff_sd=_sd(d), tdiff=float(dt.mean()), tdiff_sd=_sd(dt),
                                  beyond=bool(len(d) > 1 and abs(d.mean()) > 2 * _sd(d)),
                                  ci95=interval, noise_floor=floor, resolved=resolved(interval, float(d.mean()), floor)))
    time_rows = []
    for opt in OPTIMIZERS:
        for row in CONFIGS:
            if (opt, row.key) not in by or row.wire not in prices:
                continue
            e = by[(opt, row.key)][0]
            comm = n_values * prices[row.wire]["s_per_value"]
            saved_fp32 = n_values * prices["fp32"]["s_per_value"] - comm
            saved_bf16 = n_values * prices["bf16"]["s_per_value"] - comm
            time_rows.append(dict(opt=opt, key=row.key, wire=row.wire, comm_ms=1e3 * comm,
                                  saved_vs_fp32_ms=1e3 * saved_fp32, saved_vs_bf16_ms=1e3 * saved_bf16,
                                  transform_ms=1e3 * e["t_transform"],
                                  transform_ns_per_value=1e9 * e["t_transform"] / n_values,
                                  net_vs_bf16_ms=1e3 * (saved_bf16 - e["t_transform"])))
    return dict(world=world, n_values=n_values, metric_last=last, rows=rows, decisions=decisions, noise=noise,
                time=time_rows,
                prices={k: dict(v, ns_per_value=1e9 * v["s_per_value"]) for k, v in prices.items()})


def _interval(x: list[float]) -> str:
    return "-" if any(math.isnan(v) for v in x) else f"[{x[0]:+.4f}, {x[1]:+.4f}]"


def markdown(c: dict) -> str:
    """The tables of ``compare``'s result."""
    last = c.get("metric_last", 1)
    out = [f"P = {c['world']} (loopback), {c['n_values']:,} gradient values per step. Metric = validation loss "
           f"(nats/byte) averaged over the last {last} evaluation(s); gaps are paired by seed against fp32 with the "
           "same optimizer, with their paired-t 95% interval; the noise floor is the RMS of the per-seed differences "
           "that a one-ulp perturbation of the initial weights causes (the controls below); 'resolved': the interval "
           "excludes 0 and |mean| exceeds the noise floor.", "",
           "Noise floor (one-ulp controls, paired with the row they perturb):", "",
           "| optimizer | control | seeds | RMS difference |", "| --- | --- | ---: | ---: |"]
    for opt, nz in c.get("noise", {}).items():
        for ctl in nz["controls"]:
            out.append(f"| {opt} | {ctl['row']} vs {ctl['base']} | {ctl['n']} | {ctl['rms']:.4f} |")
        out.append(f"| {opt} | **floor (all controls)** | | {nz['floor']:.4f} |")
    out += ["", "| optimizer | configuration | mode | seeds | metric | gap to fp32 | 95% CI | noise floor | resolved? | "
            "train-loss gap (last 20 steps) | L2 grad err |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | :---: | ---: | ---: |"]
    for e in c["rows"]:
        ref = e["key"] == "fp32"
        out.append(f"| {e['opt']} | {e['label']} | `{e['mode']}` | {e['n']} | {e['val']:.4f} ± {e['val_sd']:.4f} | "
                   + ("- | - | - | - | - | -" if ref else
                      f"{e['gap']:+.4f} ± {e['gap_sd']:.4f} | {_interval(e['ci95'])} | {e['noise_floor']:.4f} | "
                      f"{'yes' if e['resolved'] else 'no'} | {e['tgap']:+.4f} ± {e['tgap_sd']:.4f} | {e['err_l2']:.4f}")
                   + " |")
    out += ["", "Paired differences that decide a default (row minus its base, same seed; < 0: the row is better):", "",
            "| optimizer | question | seeds | metric diff | 95% CI | noise floor | resolved? | train-loss diff (last 20) |",
            "| --- | --- | ---: | ---: | ---: | ---: | :---: | ---: |"]
    for d in c["decisions"]:
        out.append(f"| {d['opt']} | {d['what']} | {d['n']} | {d['diff']:+.4f} ± {d['diff_sd']:.4f} | "
                   f"{_interval(d['ci95'])} | {d['noise_floor']:.4f} | {'yes' if d['resolved'] else 'no'} | "
                   f"{d['tdiff']:+.4f} ± {d['tdiff_sd']:.4f} |")
    out += ["", "Step time (communication priced on the 1 Gbit/s netbed, P = 4; transform measured here, slowest "
            "rank, mean over steps and seeds):", "",
            "| wire | ns per value (netbed) | source |", "| --- | ---: | --- |"]
    for w, p in c["prices"].items():
        out.append(f"| {w} | {p['ns_per_value']:.2f} | {p['source']} |")
    out += ["", "| optimizer | configuration | comm ms/step | saved vs fp32 ms | saved vs bf16 ms | transform ms/step "
            "| transform ns/value | net vs bf16 ms |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for t in c["time"]:
        out.append(f"| {t['opt']} | {t['key']} | {t['comm_ms']:.2f} | {t['saved_vs_fp32_ms']:+.2f} | "
                   f"{t['saved_vs_bf16_ms']:+.2f} | {t['transform_ms']:.2f} | {t['transform_ns_per_value']:.2f} | "
                   f"{t['net_vs_bf16_ms']:+.2f} |")
    return "\n".join(out)


def _smooth(x: np.ndarray, k: int) -> np.ndarray:
    if len(x) < k or k <= 1:
        return x
    return np.convolve(x, np.ones(k) / k, mode="valid")


def plot_curves(runs: dict, world: int, path: str, smooth: int = 15) -> None:
    """Validation loss against step (mean over seeds, +- sd shaded) and the paired training-loss
    gap to fp32 (moving average of ``smooth`` steps), one column per optimizer."""
    from studies.plotting import pyplot, save

    plt = pyplot()
    opts = [o for o in OPTIMIZERS if any((world, mode_name(r, o)) in runs for r in CONFIGS)]
    fig, axes = plt.subplots(2, len(opts), figsize=(7.5 * len(opts), 9), squeeze=False)
    colors = plt.get_cmap("tab10")
    for j, opt in enumerate(opts):
        ref = runs.get((world, mode_name(CONFIGS[0], opt)), {})
        for i, row in enumerate(CONFIGS):
            got = runs.get((world, mode_name(row, opt)))
            if not got:
                continue
            seeds = sorted(got)
            steps = [r["step"] for r in got[seeds[0]] if not math.isnan(r["val_loss"])]
            val = np.array([[r["val_loss"] for r in got[s] if not math.isnan(r["val_loss"])] for s in seeds])
            m, sd = val.mean(0), (val.std(0, ddof=1) if len(seeds) > 1 else np.zeros(val.shape[1]))
            ls = "--" if "gift" in row.key or "ef" in row.key else "-"
            axes[0, j].plot(steps, m, ls, color=colors(i), label=row.label, lw=1.2)
            axes[0, j].fill_between(steps, m - sd, m + sd, color=colors(i), alpha=0.12)
            common = [s for s in seeds if s in ref]
            if row.key != "fp32" and common:
                d = np.array([np.array([r["train_loss"] for r in got[s]]) - np.array([r["train_loss"] for r in ref[s]])
                              for s in common]).mean(0)
                sm = _smooth(d, smooth)
                axes[1, j].plot(np.arange(len(sm)) + (len(d) - len(sm)), sm, ls, color=colors(i), label=row.label, lw=1.2)
        axes[0, j].set(title=f"{opt}: validation loss, mean ± sd over seeds", xlabel="step", ylabel="nats/byte")
        lo = min((min(ln.get_ydata()) for ln in axes[0, j].get_lines()), default=0.0)
        axes[0, j].set_ylim(lo - 0.05, lo + 1.0)
        axes[1, j].axhline(0, color="k", lw=0.8)
        axes[1, j].set(title=f"{opt}: training loss − fp32 (same seed), mean over seeds, {smooth}-step average",
                       xlabel="step", ylabel="nats/byte")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    save(fig, path)


def n_values(cfg: train.Config) -> int:
    return int(train.make_model(cfg, 0).num_parameters())


def report(out: str, world: int, cfg: train.Config, header: str = "", no_plot: bool = False) -> str:
    runs = train.load_runs(out)
    c = compare(runs, world, n_values(cfg), last=cfg.val_last)
    text = markdown(c)
    with open(os.path.join(out, "compare.md"), "w") as f:
        f.write("# giftcomm training comparison\n\n" + header + text + "\n")
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump(dict(c, config=dict(asdict(cfg), val_bytes=cfg.val_batches * cfg.seq_len)), f, indent=1)
    if not no_plot:
        plot_curves(runs, world, os.path.join(out, "train-curves.png"))
    return text


def verify(out: str, keys: list[str], optimizers: list[str], seeds: list[int] | None) -> int:
    """Re-run the committed runs of ``out`` (its compare.json's config and world; the runs of the
    configuration ``keys`` x ``optimizers`` x ``seeds``, None: every seed present) with today's
    build and compare each with its record: the sha256 of the final weights and the final
    validation loss, bit for bit. Returns 0 when every selected run reproduces, 1 otherwise (or
    when none was selected)."""
    from studies.workloads.corpus import load_corpus

    with open(os.path.join(out, "compare.json")) as f:
        recorded = json.load(f)
    fields = set(train.Config.__dataclass_fields__)
    cfg = train.Config(**{k: v for k, v in recorded["config"].items() if k in fields})
    world = int(recorded["world"])
    keyed = {r.key: r for r in CONFIGS}
    corpus = load_corpus(max_bytes=cfg.corpus_bytes)
    checked = failed = 0
    for opt in optimizers:
        for key in keys:
            mode = mode_name(keyed[key], opt)
            for path in sorted(glob.glob(os.path.join(out, f"P{world}-s*-{mode}.json"))):
                with open(path) as f:
                    want = json.load(f)
                if want["mode"] != mode or (seeds is not None and want["seed"] not in seeds):
                    continue
                _, got = train.run_loopback(train.parse_mode(mode), cfg, want["seed"], world, corpus,
                                            want.get("asked_algorithm", "auto"), want.get("block"), want.get("mx_scale"))
                same = got["digest"] == want["digest"] and got["val_loss"] == want["val_loss"]
                checked += 1
                failed += not same
                print(f"{'reproduced' if same else 'DIFFERS'}: {os.path.basename(path)} val {got['val_loss']!r} "
                      f"(recorded {want['val_loss']!r}), weights {'equal' if got['digest'] == want['digest'] else 'differ'}",
                      flush=True)
    print(f"verify: {checked - failed} of {checked} runs reproduced bit for bit", flush=True)
    return 0 if checked and not failed else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies train-compare", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--configs", default=",".join(r.key for r in CONFIGS),
                   help="comma-separated configuration keys (default: all)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 0..7; --verify: every seed in DIR)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--size", choices=sorted(train.SIZES), default="powered",
                   help="model, schedule and validation preset (default powered: 256 KiB of validation, "
                        "the metric over the last 3 evaluations)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="studies.train's tiny --quick model (CI)")
    p.add_argument("--out", help="the runs' folder (required unless --verify)")
    p.add_argument("--verify", metavar="DIR", default=None,
                   help="re-run DIR's committed runs (--configs, --optimizers, --seeds select) and exit non-zero "
                        "unless each reproduces bit for bit")
    p.add_argument("--report", action="store_true", help="only recompute the report from --out")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--skip-existing", action="store_true",
                   help="skip the runs already complete in --out (e.g. an archive of an earlier grid untarred there)")
    a = p.parse_args(argv)
    keys = {r.key: r for r in CONFIGS}
    chosen = [k.strip() for k in a.configs.split(",") if k.strip()]
    bad = [k for k in chosen if k not in keys] + [o for o in a.optimizers.split(",") if o not in OPTIMIZERS]
    if bad:
        p.error(f"unknown configuration/optimizer {bad}; configurations {list(keys)}, optimizers {OPTIMIZERS}")
    if a.verify:
        import torch

        torch.set_num_threads(1)
        seeds = None if a.seeds is None else [int(s) for s in a.seeds.split(",")]
        return verify(a.verify, chosen, a.optimizers.split(","), seeds)
    if not a.out:
        p.error("--out is required (unless --verify DIR)")
    a.seeds = a.seeds or ",".join(str(s) for s in range(8))
    cfg = train.Config(**asdict(train.QUICK if a.quick else train.SIZES[a.size]))
    if a.steps is not None:
        cfg.steps = a.steps
    if not a.report:
        modes = [mode_name(keys[k], o) for o in a.optimizers.split(",") for k in chosen]
        targs = ["--world", str(a.world), "--seeds", a.seeds, "--modes", ",".join(modes), "--out", a.out, "--no-plot"]
        targs += ["--quick"] if a.quick else ["--size", a.size]
        targs += [] if a.steps is None else ["--steps", str(a.steps)]
        targs += ["--skip-existing"] if a.skip_existing else []
        rc = train.main(targs)
        if rc:
            return rc
    header = (f"Command: `python -m studies train-compare {' '.join(argv if argv is not None else sys.argv[1:])}`. "
              f"Config: {asdict(cfg)}\n\n")
    print(report(a.out, a.world, cfg, header, no_plot=a.no_plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
