"""End-to-end data-parallel training of a compact Llama on the stdlib's sources, per comm mode.

Run under mpiexec (one process per rank, CPU)::

    OMP_NUM_THREADS=1 mpiexec -n 4 python -m studies train --comm fp32,bf16,fp8-euclid,gift --steps 200
    mpiexec -n 2 python -m studies train --quick          # CI: tiny model, < 60 s

Modes (all through ``giftcomm.adapters.torch.GradSync``, op="avg"):
  fp32        giftcomm ring allreduce with raw fp32 on the wire (plus MPI_Allreduce timed for reference)
  bf16        raw bf16 on the wire
  fp8-euclid  block-scaled E4M3, no geometry
  gift        E4M3 in the geometry of KFAC factors captured from the nn.Linear layers every
              ``--kfac-every`` steps, synced and rebuilt (selective policy) every ``--refresh`` steps

Every mode starts from the same weights (``--seed``) and sees the same batches in the same order.
Writes, into ``--out``: ``train-<mode>.csv`` (one row per step), ``train-curves.png`` (every
``train-*.csv`` found there) and ``train-summary.md``. Times are seconds, the max over ranks.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from giftcomm.perf.common import Progress

MODES = {"fp32": ("fp32", False), "bf16": ("bf16", False), "fp8-euclid": ("e4m3", False), "gift": ("e4m3", True)}
COLUMNS = ["mode", "step", "train_loss", "val_loss", "lr", "grad_rel_err", "t_step", "t_compute", "t_transform",
           "t_comm", "t_geometry", "t_mpi_ref"]


@dataclass
class RunConfig:
    """Resolved settings of one run (see ``--help``)."""

    model: str
    steps: int
    batch: int
    seq_len: int
    lr: float
    warmup: int
    weight_decay: float
    clip: float
    val_every: int
    val_batches: int
    bucket_mb: float
    block: int
    kfac_every: int
    kfac_tokens: int
    kfac_decay: float
    refresh: int
    max_rank: int
    flops_per_gain: float
    corpus_bytes: int | None
    seed: int


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m studies train", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--comm", default="fp32,bf16,fp8-euclid,gift", help="comma-separated modes: " + ",".join(MODES))
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200; 40 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model and short run for CI")
    p.add_argument("--out", default="perf/results", help="output folder")
    p.add_argument("--model", choices=["small", "tiny"], default=None, help="default small; tiny with --quick")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank per step (default 8)")
    p.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate (default 1e-3; 3e-3 --quick)")
    p.add_argument("--warmup", type=int, default=None, help="linear warm-up steps, then cosine to 10%%")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--val-every", type=int, default=None, help="steps between validation evaluations")
    p.add_argument("--val-batches", type=int, default=None, help="validation sequences per evaluation (all ranks)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--kfac-every", type=int, default=None, help="steps between KFAC captures (gift)")
    p.add_argument("--kfac-tokens", type=int, default=256, help="token rows sampled per layer per capture")
    p.add_argument("--kfac-decay", type=float, default=0.5,
                   help="EMA factor of the KFAC running averages, per capture (0: latest capture only)")
    p.add_argument("--refresh", type=int, default=None, help="steps between factor syncs / geometry rebuilds")
    p.add_argument("--max-rank", type=int, default=32, help="selective policy: max eigenpairs per side")
    p.add_argument("--flops-per-gain", type=float, default=1024.0,
                   help="selective policy: flop/element of forward+inverse worth a gain of 1 (CPU default: 1024)")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    modes = [m.strip() for m in a.comm.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"unknown --comm mode(s) {bad}; choose from {list(MODES)}")
    q = a.quick

    def pick(v, full, quick):
        return v if v is not None else (quick if q else full)

    cfg = RunConfig(
        model=pick(a.model, "small", "tiny"), steps=pick(a.steps, 200, 40), batch=pick(a.batch, 8, 4),
        seq_len=0, lr=pick(a.lr, 1e-3, 3e-3), warmup=pick(a.warmup, 30, 4), weight_decay=a.weight_decay,
        clip=a.clip, val_every=pick(a.val_every, 25, 10), val_batches=pick(a.val_batches, 64, 16),
        bucket_mb=a.bucket_mb, block=a.block, kfac_every=pick(a.kfac_every, 10, 2), kfac_tokens=a.kfac_tokens,
        kfac_decay=a.kfac_decay,
        refresh=pick(a.refresh, 50, 10), max_rank=a.max_rank,
        flops_per_gain=a.flops_per_gain, corpus_bytes=2_000_000 if q else None, seed=a.seed,
    )
    if cfg.refresh % cfg.kfac_every:
        p.error("--refresh must be a multiple of --kfac-every (factors are synced right after a capture)")
    return modes, cfg, a


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to 10% of it at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def batch_starts(seed: int, step: int, n_global: int, data_len: int, seq_len: int) -> np.ndarray:
    """Start offsets (n_global,) of the step's global batch: the same in every mode and on every
    rank (rank r takes rows r*B:(r+1)*B)."""
    return np.random.default_rng([seed, 1, step]).integers(0, data_len - seq_len - 1, n_global)


def run_mode(mode: str, cfg: RunConfig, corpus, comm, out_dir: str) -> list[dict]:
    """Train one mode from scratch; returns the per-step rows (rank 0 writes the CSV)."""
    import torch
    from mpi4py import MPI

    from giftcomm.adapters.torch import GradSync, KfacCapture, build_geometries
    from giftcomm.geometry import SelectivePolicy
    from studies.workloads.llama import CONFIGS, Llama

    rank, size = comm.Get_rank(), comm.Get_size()
    fmt, use_geometry = MODES[mode]
    torch.manual_seed(cfg.seed)
    model = Llama(CONFIGS[cfg.model])
    seq = model.cfg.seq_len
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sync = GradSync(model, comm=comm, fmt=fmt, block=cfg.block, op="avg", bucket_mb=cfg.bucket_mb)
    capture = None
    policy = SelectivePolicy(max_rank=cfg.max_rank, flops_per_gain=cfg.flops_per_gain)
    if use_geometry:
        capture = KfacCapture(model, every=cfg.kfac_every, tokens=cfg.kfac_tokens, seed=cfg.seed * 1000 + rank,
                              decay=cfg.kfac_decay)
    val_rng = np.random.default_rng([cfg.seed, 2])
    val_starts = val_rng.integers(0, len(corpus.val) - seq - 1, cfg.val_batches)
    mine_val = val_starts[rank::size]

    def validate() -> float:
        model.eval()
        total = 0.0
        with torch.no_grad():
            for i in range(0, len(mine_val), cfg.batch):
                b = torch.from_numpy(corpus.batch("val", mine_val[i : i + cfg.batch], seq))
                total += float(model.loss(b)) * len(b)
        model.train()
        return comm.allreduce(total, op=MPI.SUM) / len(val_starts)

    rows = []
    bar = Progress(cfg.steps, f"{mode} ", rank == 0)
    for step in range(cfg.steps):
        t_start = time.perf_counter()
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = batch_starts(cfg.seed, step, cfg.batch * size, len(corpus.train), seq)
        batch = torch.from_numpy(corpus.batch("train", starts[rank * cfg.batch : (rank + 1) * cfg.batch], seq))
        if capture is not None:
            capture.step(step)
            capture.seconds = 0.0
        sync.zero_grad()
        loss = model.loss(batch)
        loss.backward()
        t_fwbw = time.perf_counter() - t_start
        t_geo = capture.seconds if capture is not None else 0.0
        if capture is not None and step % cfg.refresh == 0:
            tg = time.perf_counter()
            capture.estimator.sync(comm)
            sync.set_geometries(build_geometries(capture.estimator, sync.layouts, policy))
            t_geo += time.perf_counter() - tg
        measure = step % cfg.val_every == 0 or step == cfg.steps - 1
        local = [b.copy() for b in sync.flat_grads()] if measure else None
        t_ref = 0.0
        if mode == "fp32":  # MPI's own allreduce of the same buckets, for reference only
            bufs = [b.copy() for b in sync.flat_grads()]
            comm.Barrier()
            tr = time.perf_counter()
            for buf in bufs:
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            t_ref = time.perf_counter() - tr
        times = sync.sync()
        rel_err = float("nan")
        if measure:
            num = den = 0.0
            for loc, red in zip(local, sync.flat_grads()):
                exact = np.empty(loc.size, np.float64)
                comm.Allreduce(loc.astype(np.float64), exact, op=MPI.SUM)
                exact /= size
                num += float(np.sum((red - exact) ** 2))
                den += float(np.sum(exact**2))
            rel_err = math.sqrt(num / den) if den > 0 else 0.0
        tc = time.perf_counter()
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        t_opt = time.perf_counter() - tc
        t_step = time.perf_counter() - t_start
        local_times = np.array([t_step, t_fwbw + t_opt - (capture.seconds if capture else 0.0), times.transform,
                                times.comm, t_geo, t_ref])
        worst = np.empty_like(local_times)
        comm.Allreduce(local_times, worst, op=MPI.MAX)
        train_loss = comm.allreduce(float(loss.detach()), op=MPI.SUM) / size
        val_loss = validate() if measure else float("nan")
        row = dict(mode=mode, step=step, train_loss=train_loss, val_loss=val_loss, lr=lr, grad_rel_err=rel_err)
        row.update(zip(COLUMNS[6:], worst.tolist()))
        rows.append(row)
        bar.update(f"loss {train_loss:.3f}" + (f" val {val_loss:.3f}" if measure else ""))
    bar.close()
    if capture is not None:
        capture.remove()
        if rank == 0:
            print(f"[gift] last geometry of bucket 0:\n{sync.geometries[0].summary()}", file=sys.stderr)
    if rank == 0:
        write_csv(os.path.join(out_dir, f"train-{mode}.csv"), rows)
    return rows


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def read_csvs(out_dir: str) -> dict[str, list[dict]]:
    """mode -> rows of every train-<mode>.csv in out_dir (numbers as floats)."""
    runs = {}
    for mode in MODES:
        path = os.path.join(out_dir, f"train-{mode}.csv")
        if os.path.exists(path):
            with open(path) as f:
                runs[mode] = [{k: (v if k == "mode" else float(v)) for k, v in r.items()} for r in csv.DictReader(f)]
    return runs


def summary_table(runs: dict[str, list[dict]]) -> str:
    """Markdown: per mode, final losses, mean gradient error and mean step-time split (ms)."""
    lines = ["| mode | steps | train loss (last 10) | final val loss | grad rel. err (mean) | step ms | compute ms "
             "| transform ms | comm ms | geometry ms | MPI_Allreduce ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode, rows in runs.items():
        last = rows[-10:]
        vals = [r["val_loss"] for r in rows if not math.isnan(r["val_loss"])]
        errs = [r["grad_rel_err"] for r in rows if not math.isnan(r["grad_rel_err"])]
        ms = lambda k: 1e3 * float(np.mean([r[k] for r in rows[1:] or rows]))  # noqa: E731 (skip step 0)
        ref = f"{ms('t_mpi_ref'):.1f}" if mode == "fp32" else "-"
        lines.append(f"| {mode} | {len(rows)} | {np.mean([r['train_loss'] for r in last]):.4f} | "
                     f"{vals[-1] if vals else float('nan'):.4f} | {np.mean(errs) if errs else float('nan'):.2e} | "
                     f"{ms('t_step'):.0f} | {ms('t_compute'):.0f} | {ms('t_transform'):.1f} | {ms('t_comm'):.1f} | "
                     f"{ms('t_geometry'):.1f} | {ref} |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: str) -> None:
    """Three panels: training loss (EMA-smoothed), validation loss, mean step-time split."""
    from studies.plotting import pyplot, save

    plt = pyplot()

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, rows in runs.items():
        steps = [r["step"] for r in rows]
        loss, s = [], None
        for r in rows:
            s = r["train_loss"] if s is None else 0.9 * s + 0.1 * r["train_loss"]
            loss.append(s)
        ax[0].plot(steps, loss, label=mode)
        v = [(r["step"], r["val_loss"]) for r in rows if not math.isnan(r["val_loss"])]
        ax[1].plot([x for x, _ in v], [y for _, y in v], marker="o", ms=3, label=mode)
    ax[0].set(title="training loss (EMA 0.9)", xlabel="step", ylabel="nats/byte")
    ax[1].set(title="validation loss", xlabel="step", ylabel="nats/byte")
    parts = ["t_compute", "t_transform", "t_comm", "t_geometry"]
    bottom = np.zeros(len(runs))
    for part in parts:
        h = np.array([1e3 * np.mean([r[part] for r in rows[1:] or rows]) for rows in runs.values()])
        ax[2].bar(list(runs), h, bottom=bottom, label=part[2:])
        bottom += h
    ax[2].set(title="mean time per step (max over ranks)", ylabel="ms")
    for a in ax:
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    """Entry point (``python -m studies train``); returns the exit status."""
    modes, cfg, args = parse_args(argv)
    import torch
    from mpi4py import MPI

    from studies.workloads.corpus import load_corpus
    from studies.workloads.llama import CONFIGS, Llama

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    corpus = load_corpus(max_bytes=cfg.corpus_bytes)
    digests = comm.allgather(corpus.digest)
    if any(d != digests[0] for d in digests):
        raise RuntimeError(f"ranks read different corpora: {digests}")
    out_dir = args.out
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        if os.environ.get("OMP_NUM_THREADS") != "1" and os.environ.get("OPENBLAS_NUM_THREADS") != "1":
            print("giftcomm train: set OMP_NUM_THREADS=1 (NumPy's BLAS threads oversubscribe the cores "
                  "when several ranks share a machine)", file=sys.stderr)
        n = Llama(CONFIGS[cfg.model]).num_parameters()
        print(f"giftcomm train: {size} ranks, model {cfg.model} ({n / 1e6:.2f}M params), corpus {corpus.digest} "
              f"({len(corpus.train)} train / {len(corpus.val)} val bytes, {corpus.files[0]}+{corpus.files[1]} files), "
              f"{cfg.steps} steps x {cfg.batch * size} seqs, modes {modes}", file=sys.stderr)
    for mode in modes:
        run_mode(mode, cfg, corpus, comm, out_dir)
    if rank == 0:
        runs = read_csvs(out_dir)
        table = summary_table(runs)
        with open(os.path.join(out_dir, "train-summary.md"), "w") as f:
            f.write(f"# giftcomm train: {size} ranks, model {cfg.model}, {cfg.steps} steps, seed {cfg.seed}\n\n")
            f.write(f"Command: `mpiexec -n {size} python -m studies train {' '.join(argv or sys.argv[1:])}`\n\n")
            f.write(table + "\n")
        print(table)
        if not args.no_plot:
            plot(runs, os.path.join(out_dir, "train-curves.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
