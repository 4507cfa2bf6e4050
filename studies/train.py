"""Training grid: where Euclidean low-precision gradient communication hurts, and how much GIFT restores.

Runs a grid of (mode x world size x seed) of data-parallel training of a compact Llama on the
stdlib's sources. Every run of one seed starts from the same weights and sees the same batches
(rank r of P takes rows r*B:(r+1)*B of the step's global batch). A mode is
``FMT[-n|-s][-gift[@DAMPING]]``: the wire format (fp32, bf16, fp16, e4m3, e5m2, mxfp8, nvfp4,
mxfp4, ...), nearest (n, default) or stochastic (s) rounding with the step as seed, and Euclidean
(no suffix) or GIFT (KFAC factors captured from the nn.Linear layers, low-rank selective policy,
``@DAMPING`` overrides the library's default damping; ``-giftfull``: full KFAC whitening of every
Linear weight instead of the policy).

Two transports, one code path (``train_rank``):
  loopback (default) one process, P virtual ranks as threads over ``giftcomm.LoopbackGroup``,
                     each with its own model replica, optimizer and ``GradSync``: P = 16 on 2 cores
  mpi                one rank per process under mpiexec (``--transport mpi``; --world must equal
                     the number of processes). Bit-identical to loopback for the same seed: the
                     collectives are deterministic, and every cross-rank sum is taken in rank order.

::

    OMP_NUM_THREADS=1 python -m studies train       # default grid (docs/results.md lists the runs committed)
    OMP_NUM_THREADS=1 python -m studies train --quick               # CI: tiny, < 60 s
    OMP_NUM_THREADS=1 mpiexec -n 4 python -m studies train --transport mpi --world 4 --seeds 0 \\
        --modes nvfp4-s-gift --steps 20 --out /tmp/mpi                # the MPI equivalence check
    python -m studies train --report --out perf/results/train-grid  # statistics + plots only

Writes into ``--out``: ``P<world>-s<seed>-<mode>.csv`` (one row per step), ``....json`` (final
numbers and a digest of the final weights), and with ``--report`` (implied after a grid):
``summary.md``, ``train-gap.png`` (validation loss minus fp32 per mode, mean +- std over seeds)
and ``train-comm.png`` (communication-only time per step, compute apart).
"""
from __future__ import annotations

import argparse
import csv
import glob
import hashlib
import json
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from giftcomm import GiftSchedule

COLUMNS = ["mode", "world", "seed", "step", "train_loss", "val_loss", "lr", "err_l2", "err_white", "t_step",
           "t_compute", "t_transform", "t_comm", "t_geometry", "algorithm"]
PASSTHROUGH = ("fp32", "bf16", "fp16")
DEFAULT_MODES = ("fp32,bf16,e4m3-n,e4m3-s,e4m3-n-gift,e4m3-s-gift,nvfp4-n,nvfp4-s,nvfp4-n-gift,nvfp4-s-gift,"
                 "mxfp4-n,mxfp4-n-gift")
# baseline wires (giftcomm.collectives.baselines, opt-in, not giftcomm's method): the mode's FMT -> the wire
BASELINES = {"e5m2t": "e5m2/tensor-nccl", "e4m3t": "e4m3/tensor-nccl"}
MEASURE_DAMPING = 1e-3  # the metric of the whitened error: full KFAC whitening (G+dI)^-1/2 X (A+dI)^-1/2


@dataclass(frozen=True)
class Mode:
    name: str
    fmt: str
    rounding: str
    gift: bool
    damping: float | None  # None: the library's default
    full: bool = False  # "giftfull": full KFAC whitening of every Linear weight (no policy)
    ef: bool = False  # "-ef": error feedback (GradSync(schedule=GiftSchedule(error_feedback=True)))
    opt: str = "adamw"  # "-muon": torch.optim.Muon on the hidden 2-D weights, AdamW on the rest
    preset: str | None = None  # "-paper": the paper's method (PaperInputs: saturation-selected weights)
    perturb: bool = False  # "-ulp": every initial weight one ulp off (seeded directions): the noise-floor control

    @property
    def twin(self) -> str:
        """The Euclidean mode without GIFT this one is paired with (same format, rounding, EF, optimizer)."""
        return "-".join([self.fmt, self.rounding[0]] + (["ef"] if self.ef else []) + self._opt_suffix)

    @property
    def reference(self) -> str:
        """The fp32 mode this one's loss gap is measured against (same optimizer)."""
        return "-".join(["fp32"] + self._opt_suffix)

    @property
    def _opt_suffix(self) -> list[str]:
        return [] if self.opt == "adamw" else [self.opt]


def parse_mode(name: str) -> Mode:
    parts = name.split("-")
    fmt, rounding, gift, damping, full, ef, opt = parts[0], "nearest", False, None, False, False, "adamw"
    preset: str | None = None
    perturb = False
    for p in parts[1:]:
        if p == "ulp":
            perturb = True
        elif p == "muon":
            opt = "muon"
        elif p == "paper":
            preset, gift = "paper", True
        elif p in ("n", "s"):
            rounding = "nearest" if p == "n" else "stochastic"
        elif p == "ef":
            ef = True
        elif p.startswith("gift"):
            gift, full = True, p.startswith("giftfull")
            if "@" in p:
                damping = float(p.split("@", 1)[1])
        else:
            raise ValueError(f"bad mode {name!r}: FMT[-n|-s][-ef][-gift|-giftfull[@DAMPING]|-paper][-ulp][-muon]")
    if fmt in BASELINES and (rounding != "nearest" or (ef and preset is None) or (gift and preset is None)):
        raise ValueError(f"bad mode {name!r}: a baseline wire ({fmt}) rounds to nearest, takes GIFT only as "
                         "-paper, and error feedback only with it (kept in the transformed coordinates)")
    return Mode(name, fmt, rounding, gift, damping, full, ef, opt, preset, perturb)


@dataclass
class Config:
    dim: int = 96
    layers: int = 2
    heads: int = 4
    ffn: int = 256
    seq_len: int = 64
    steps: int = 150
    batch: int = 4  # sequences per rank per step
    lr: float = 3e-3
    warmup: int = 10
    weight_decay: float = 0.1
    clip: float = 1.0
    val_every: int = 25
    val_batches: int = 64  # held-out sequences of seq_len bytes per evaluation (val_bytes = val_batches * seq_len)
    val_last: int = 1  # the comparison's metric: validation loss averaged over the last val_last evaluations
    kfac_every: int = 5
    kfac_tokens: int = 128
    kfac_decay: float = 0.5
    refresh: int = 25
    paper_refresh: int = 50  # the -paper modes: steps between map refreshes (the paper's 50)
    paper_profile: int = 20  # the -paper modes: the saturation profile's window before the first map
    max_rank: int = 32
    bucket_mb: float = 25.0
    corpus_bytes: int | None = 4_000_000


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to 10% of it at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def batch_starts(seed: int, step: int, n_global: int, data_len: int, seq_len: int) -> np.ndarray:
    """Start offsets (n_global,) of the step's global batch: the same in every mode and on every rank."""
    return np.random.default_rng([seed, 1, step]).integers(0, data_len - seq_len - 1, n_global)


class MpiCtx:
    """One rank per process: giftcomm runs over the mpi4py communicator."""

    def __init__(self, comm) -> None:
        self.comm, self.transport = comm, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def allgather(self, obj):
        return self.comm.allgather(obj)


class Exchange:
    """The allgather of P loopback threads (a list in rank order)."""

    def __init__(self, size: int) -> None:
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size)


class LoopCtx:
    def __init__(self, group, exchange: Exchange, rank: int) -> None:
        self.transport, self.ex = group.transports[rank], exchange
        self.rank, self.size = rank, group.size

    def allgather(self, obj):
        self.ex.barrier.wait()
        self.ex.slots[self.rank] = obj
        self.ex.barrier.wait()
        out = list(self.ex.slots)
        self.ex.barrier.wait()
        return out


_INIT_LOCK = threading.Lock()


def make_model(cfg: Config, seed: int):
    import torch

    from studies.workloads.llama import Llama, LlamaConfig

    with _INIT_LOCK:  # torch's global generator: one virtual rank at a time
        torch.manual_seed(seed)
        return Llama(LlamaConfig(dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, ffn=cfg.ffn, seq_len=cfg.seq_len))


def perturb_one_ulp(model, seed: int) -> None:
    """Move every parameter element of ``model`` one float32 ulp up or down (directions from
    ``seed``, the same on every rank): the smallest change of the initial weights, whose effect
    on the final loss is the run-to-run noise floor of the training comparison."""
    import torch

    rng = np.random.default_rng([seed, 3])
    with torch.no_grad():
        for p in model.parameters():
            a = p.detach().numpy()
            up = rng.random(a.shape) < 0.5
            p.copy_(torch.from_numpy(np.where(up, np.nextafter(a, np.float32(np.inf)),
                                              np.nextafter(a, np.float32(-np.inf))).astype(np.float32)))


def make_optimizers(model, name: str, cfg: Config) -> list:
    """The optimizers of one replica. ``adamw``: AdamW on every parameter. ``muon``: the standard
    split, ``torch.optim.Muon`` on the hidden 2-D weights (every nn.Linear of the blocks; Muon
    orthogonalises a matrix update, so it takes 2-D tensors only) with ``adjust_lr_fn=
    "match_rms_adamw"`` (its update's RMS matches AdamW's, so both follow cfg.lr's schedule), and
    AdamW on the rest (the tied embedding / output head, the norm scales)."""
    import torch

    adamw: dict[str, Any] = dict(lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), **adamw)]
    if name != "muon":
        raise ValueError(f"unknown optimizer {name!r} (adamw, muon)")
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, **adamw)]


class PaperInputs:
    """The GIFT paper's method as its artifact runs it, for studies.train (the ``-paper`` modes).

    - A of every nn.Linear weight estimated from the layer's inputs each step
      (``giftcomm.geometry.paper.InputFactorEstimator``, EMA 0.95) from step 0;
    - the profile window: steps 0 .. ``cfg.paper_profile - 1`` run Euclidean while each rank scores
      every Linear weight's own gradient (before the wire) by its share of FP8 E5M2 codes at a bound
      (``SaturationProfile``, one scale per tensor);
    - at step ``cfg.paper_profile`` the scores are averaged over the ranks and the weights chosen
      (``select_for``: giftcomm's default top quarter; the paper's own rule picked its model's 13
      most saturated layers), the same on every rank; only those are transformed from then on;
    - every ``cfg.paper_refresh`` steps from there (the paper's 50) A is averaged over the ranks and
      the map rebuilt (``refresh_geometry``: Cholesky of low-rank-32 + residual diagonal, damping
      1e-3 absolute), the factor itself smoothed across refreshes (``FactorEMA``, 0.95)."""

    def __init__(self, model, layouts, cfg: Config) -> None:
        from giftcomm.adapters.torch.kfac import linear_segments
        from giftcomm.geometry.paper import FactorEMA, InputFactorEstimator, PaperOptions, SaturationProfile

        self.layouts = layouts
        self.modules = linear_segments(model)
        self.names = sorted(set(self.modules.values()))
        self.options = PaperOptions(refresh_every=cfg.paper_refresh, profile_steps=cfg.paper_profile)
        self.estimators = [InputFactorEstimator(lay, [n for n in self.names if n in lay], self.options.decay)
                           for lay in layouts]
        self.profile = SaturationProfile("e5m2", cfg.paper_profile)
        self.factor_emas = [FactorEMA() for _ in layouts]
        self.selected: tuple[str, ...] | None = None
        self.scores: dict[str, float] = {}  # the averaged scores the selection was made from
        self.seconds = 0.0
        self._handles = [m.register_forward_hook(self._hook(n)) for m, n in self.modules.items()]

    def _hook(self, name: str):
        def hook(module, inputs, output) -> None:
            if self.selected is not None and name not in self.selected:
                return
            t0 = time.perf_counter()
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).numpy()
            for lay, est in zip(self.layouts, self.estimators):
                if name in lay:
                    est.update(name, x)
            self.seconds += time.perf_counter() - t0
        return hook

    def observe(self, flats: list, step: int) -> None:
        """Score this rank's gradients (one flat buffer per layout) in the profile window."""
        if step >= self.options.profile_steps:
            return
        for lay, flat in zip(self.layouts, flats):
            self.profile.update_flat(lay, flat, [n for n in self.names if n in lay])

    def due(self, step: int) -> bool:
        w, k = self.options.profile_steps, self.options.refresh_every
        return step >= w and (step - w) % k == 0

    def refresh(self, comm, step: int) -> list:
        """Collective (at a :meth:`due` step): the selection first (once), then each layout's map."""
        from dataclasses import replace

        from giftcomm.geometry import Geometry
        from giftcomm.geometry.paper import average_scores, refresh_geometry, select_for

        if self.selected is None:
            self.scores = average_scores(comm, self.profile.scores())
            self.selected = select_for(self.options, self.scores)
        out = []
        for lay, est, ema in zip(self.layouts, self.estimators, self.factor_emas):
            names = tuple(n for n in self.selected if n in lay)
            if not names:
                out.append(Geometry.identity(lay))
                continue
            factors = {n: a for n, a in est.factors().items() if n in names}
            out.append(refresh_geometry(comm, lay, factors, step, replace(self.options, names=names), smoothing=ema))
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class BaselineSync:
    """GradSync's buckets reduced with a baseline wire (``giftcomm.collectives.baselines.baseline_allreduce``,
    op avg), each bucket through its geometry; ``ef``: the paper's error feedback, kept in the
    transformed coordinates of the transformed segments only and re-expressed when the geometry
    changes (``giftcomm.collectives.feedback.TransformedFeedback(euclidean=False)``). The residual is what this
    rank's own encoding lost: ``y - Q(y)`` with the MAX-agreed per-tensor scale (the later fp16
    pairwise sums' roundings are not this rank's alone and are not compensated)."""

    def __init__(self, ctx, sync, wire: str, ef: bool) -> None:
        from giftcomm.collectives.feedback import TransformedFeedback
        from giftcomm.reference.baselines import baseline_wire

        self.ctx, self.gs, self.wire = ctx, sync, baseline_wire(wire)
        self.feedback = TransformedFeedback(reexpress=True, euclidean=False) if ef else None

    def sync(self, step: int):
        from giftcomm.adapters.torch.grad_sync import SyncTimes
        from giftcomm.collectives.baselines import baseline_allreduce
        from giftcomm.reference.baselines import fp8_codes, local_scale

        times = SyncTimes()
        t0 = time.perf_counter()
        fmt = self.wire.fmt
        for b, g in zip(self.gs.buckets, self.gs.geometries):
            b.bind()
            buf = b.buffer
            moved = g is not None and not g.is_identity
            if self.feedback is not None:
                self.feedback.compensate(b.index, buf, g)
            tt = time.perf_counter()
            y = np.asarray(g.forward(np.array(buf, np.float32)), np.float32) if moved else np.array(buf, np.float32)
            times.transform += time.perf_counter() - tt if moved else 0.0
            segs = [t.segment for t in g.transforms] if moved else list(b.layout)
            if self.feedback is not None and moved:
                # this call's residual in g's coordinates (TransformedFeedback's record, at the wire's
                # MAX-agreed per-tensor scale instead of a giftcomm block scale); none on identity segments
                scales = np.max(np.array(self.ctx.allgather([local_scale(y[s.offset : s.stop], fmt) for s in segs])), 0)
                err = np.zeros_like(y)
                for s, t, sc in zip(segs, g.transforms, scales):
                    if not t.is_identity:
                        v, sc = y[s.offset : s.stop], np.float32(sc if sc > 0 else 1.0)
                        err[s.offset : s.stop] = v - fp8_codes(v / sc, fmt).astype(np.float32) * sc
                self.feedback.residuals[b.index], self.feedback.geometries[b.index] = err, g
                self.feedback.signatures[b.index] = None
            for s in segs:  # one scale per parameter tensor, as the paper's wire
                part = y[s.offset : s.stop]
                baseline_allreduce(part, self.wire, comm=self.ctx.transport, op="avg", out=part)
            tt = time.perf_counter()
            buf[...] = g.inverse(y) if moved else y
            times.transform += time.perf_counter() - tt if moved else 0.0
        times.total = time.perf_counter() - t0
        times.comm = times.total - times.transform
        self.gs.algorithms = ["ring"] * len(self.gs.buckets)
        return times


def train_rank(ctx, mode: Mode, cfg: Config, seed: int, corpus, algorithm: str = "auto",
               block: int | None = None, mx_scale: str | None = None) -> tuple[list[dict], dict]:
    """One rank of one run (``algorithm``, ``block``: GradSync's; ``mx_scale``: the MX formats'
    scale rule, None the library's default). Returns (per-step rows, final numbers); identical
    on every rank."""
    import torch

    from giftcomm.adapters.torch import GradSync, KfacCapture, build_geometries
    from giftcomm.geometry import Geometry, SelectivePolicy

    rank, size = ctx.rank, ctx.size
    model = make_model(cfg, seed)
    if mode.perturb:
        perturb_one_ulp(model, seed)
    seq = cfg.seq_len
    opts = make_optimizers(model, mode.opt, cfg)
    from giftcomm.formats import get_format

    baseline = BASELINES.get(mode.fmt)
    fmt = get_format("fp32" if baseline else mode.fmt)
    if mx_scale is not None and fmt.scale_kind == "e8m0":
        fmt = fmt.with_scale_rule(mx_scale)
    # a baseline wire: GradSync holds the buckets, BaselineSync reduces them
    sync = GradSync(model, comm=ctx.transport, fmt=fmt, block=None if fmt.name in PASSTHROUGH else block,
                    op="avg", bucket_mb=cfg.bucket_mb, rounding=mode.rounding, algorithm=algorithm,
                    schedule=GiftSchedule(error_feedback=mode.ef and not baseline))
    reducer = BaselineSync(ctx, sync, baseline, mode.ef) if baseline else sync
    paper = PaperInputs(model, sync.layouts, cfg) if mode.preset == "paper" else None
    if paper is not None and mode.ef and not baseline:  # the paper: residuals on the transformed weights only
        from giftcomm.collectives.feedback import TransformedFeedback

        sync.feedback = TransformedFeedback(reexpress=True, euclidean=False)
    # every mode captures KFAC factors: GIFT for its geometry, all modes for the whitened-error metric
    capture = KfacCapture(model, every=cfg.kfac_every, tokens=cfg.kfac_tokens, seed=seed * 1000 + rank,
                          decay=cfg.kfac_decay)
    policy = SelectivePolicy(max_rank=cfg.max_rank)
    gkw = {} if mode.damping is None else {"damping": mode.damping}
    val_starts = np.random.default_rng([seed, 2]).integers(0, len(corpus.val) - seq - 1, cfg.val_batches)
    mine_val = val_starts[rank::size]
    metric = None
    chosen = ""

    def validate() -> float:
        model.eval()
        total = 0.0
        with torch.no_grad():
            for i in range(0, len(mine_val), cfg.batch):
                b = torch.from_numpy(corpus.batch("val", mine_val[i : i + cfg.batch], seq))
                total += float(model.loss(b)) * len(b)
        model.train()
        return float(sum(ctx.allgather(total))) / len(val_starts)

    rows = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for o in opts:
            for g in o.param_groups:
                g["lr"] = lr
        starts = batch_starts(seed, step, cfg.batch * size, len(corpus.train), seq)
        batch = torch.from_numpy(corpus.batch("train", starts[rank * cfg.batch : (rank + 1) * cfg.batch], seq))
        capture.step(step)
        capture.seconds = 0.0
        sync.zero_grad()
        loss = model.loss(batch)
        loss.backward()
        t_fwbw = time.perf_counter() - t0
        t_geo = capture.seconds
        if paper is not None:
            t_geo, paper.seconds = t_geo + paper.seconds, 0.0
        if step % cfg.refresh == 0:
            tg = time.perf_counter()
            capture.estimator.sync(ctx.transport)
            factors = [{n: (sa, sg) for n, (sg, sa) in capture.estimator.spectra.items() if n in lay}
                       for lay in sync.layouts]
            metric = [Geometry.from_kfac(lay, f, damping=MEASURE_DAMPING) for lay, f in zip(sync.layouts, factors)]
            if mode.gift and paper is None:
                if mode.full:
                    geoms = [Geometry.from_kfac(lay, f, **gkw) for lay, f in zip(sync.layouts, factors)]
                else:
                    geoms = build_geometries(capture.estimator, sync.layouts, policy, **gkw)
                sync.set_geometries(geoms)
                chosen = " | ".join(g.summary().replace("\n", "; ") for g in geoms)
            t_geo += time.perf_counter() - tg
        if paper is not None:  # the profile window scores this rank's gradients; then the maps when due
            tg = time.perf_counter()
            paper.observe(sync.flat_grads(), step)
            if paper.due(step):
                geoms = paper.refresh(ctx.transport, step)
                sync.set_geometries(geoms)
                chosen = " | ".join(g.summary().replace("\n", "; ") for g in geoms)
            t_geo += time.perf_counter() - tg
        measure = step % cfg.val_every == 0 or step == cfg.steps - 1
        local = [b.copy() for b in sync.flat_grads()] if measure else None
        times = reducer.sync(step)
        e2 = ew = float("nan")
        if measure:
            allg = ctx.allgather(local)
            n2 = d2 = nw = dw = 0.0
            for i, (red, geo) in enumerate(zip(sync.flat_grads(), metric)):
                exact = np.zeros(red.size, np.float64)
                for r in range(size):
                    exact += allg[r][i]
                exact /= size
                n2 += float(np.sum((red - exact) ** 2))
                d2 += float(np.sum(exact**2))
                we = geo.forward(exact.astype(np.float32)).astype(np.float64)
                wr = geo.forward(np.array(red, np.float32)).astype(np.float64)
                nw += float(np.sum((wr - we) ** 2))
                dw += float(np.sum(we**2))
            e2, ew = math.sqrt(n2 / d2), math.sqrt(nw / dw)
        tc = time.perf_counter()
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        for o in opts:
            o.step()
        t_step = time.perf_counter() - t0
        mine = [t_step, t_fwbw + time.perf_counter() - tc - capture.seconds, times.transform, times.comm, t_geo,
                float(loss.detach())]
        every = np.array(ctx.allgather(mine))
        worst = every[:, :5].max(axis=0)
        train_loss = float(np.sum(every[:, 5])) / size
        val = validate() if measure else float("nan")
        rows.append(dict(mode=mode.name, world=size, seed=seed, step=step, train_loss=train_loss, val_loss=val, lr=lr,
                         err_l2=e2, err_white=ew, **dict(zip(COLUMNS[9:14], worst.tolist())),
                         algorithm="+".join(sorted({a or "-" for a in sync.algorithms}))))
    capture.remove()
    if paper is not None:
        paper.remove()
        chosen = f"paper selected {list(paper.selected or ())} by E5M2 saturation: {chosen}"
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    used = sorted({r["algorithm"] for r in rows})
    final = dict(mode=mode.name, world=size, seed=seed, val_loss=rows[-1]["val_loss"], digest=h.hexdigest(),
                 geometry=chosen, algorithm="+".join(used), asked_algorithm=algorithm, block=block,
                 mx_scale=sync.options.format.scale_rule or None)
    return rows, final


def write_run(out: str, rows: list[dict], final: dict) -> None:
    stem = os.path.join(out, f"P{final['world']}-s{final['seed']}-{final['mode']}")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.7g}" if isinstance(v, float) else v) for k, v in r.items()})
    with open(stem + ".json", "w") as f:
        json.dump(final, f, indent=1)


def run_exists(out: str, world: int, seed: int, mode: str, steps: int) -> bool:
    """Whether ``out`` already holds this run complete: its .json and a .csv of ``steps`` rows
    (``--skip-existing``; a run of another length is not the same run and is redone)."""
    stem = os.path.join(out, f"P{world}-s{seed}-{mode}")
    if not (os.path.exists(stem + ".json") and os.path.exists(stem + ".csv")):
        return False
    with open(stem + ".csv") as f:
        return sum(1 for _ in csv.DictReader(f)) == steps


def run_loopback(mode: Mode, cfg: Config, seed: int, world: int, corpus, algorithm: str = "auto",
                 block: int | None = None, mx_scale: str | None = None):
    from giftcomm import LoopbackGroup

    group = LoopbackGroup(world, timeout=3600.0)
    ex = Exchange(world)
    results: list = [None] * world
    errors: list = []

    def body(r: int) -> None:
        try:
            results[r] = train_rank(LoopCtx(group, ex, r), mode, cfg, seed, corpus, algorithm, block, mx_scale)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)
            ex.barrier.abort()

    # giftcomm matches calls across ranks by the calling thread's name: every virtual rank uses the same one
    threads = [threading.Thread(target=body, args=(r,), daemon=True, name="giftcomm-train") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    digests = {res[1]["digest"] for res in results}
    if len(digests) != 1:
        raise RuntimeError(f"{mode.name}: virtual ranks ended with different weights")
    return results[0]


# ---------------------------------------------------------------- statistics and plots


def load_runs(out: str) -> dict:
    """(world, mode) -> {seed: rows}."""
    runs: dict = {}
    for path in sorted(glob.glob(os.path.join(out, "P*-s*-*.csv"))):
        with open(path) as f:
            rows = [{k: (v if k in ("mode", "algorithm") else float(v)) for k, v in r.items()} for r in csv.DictReader(f)]
        if rows:
            runs.setdefault((int(rows[0]["world"]), rows[0]["mode"]), {})[int(rows[0]["seed"])] = rows
    return runs


def _mean_measured(rows, key):
    v = [r[key] for r in rows if not math.isnan(r[key])]
    return float(np.mean(v)) if v else float("nan")


def stats(runs: dict) -> list[dict]:
    """Per (world, mode): mean/std over seeds of the final validation loss, of its paired gap to
    fp32 (same seed), of the gradient errors; and the share of the Euclidean twin's gap GIFT recovers."""
    out = []
    for (world, mode), by_seed in sorted(runs.items(), key=lambda kv: (kv[0][0], _order(kv[0][1]))):
        ref = runs.get((world, parse_mode(mode).reference), {})
        seeds = sorted(s for s in by_seed if s in ref)
        final = np.array([by_seed[s][-1]["val_loss"] for s in seeds])
        gaps = np.array([by_seed[s][-1]["val_loss"] - ref[s][-1]["val_loss"] for s in seeds])
        l2 = np.array([_mean_measured(by_seed[s], "err_l2") for s in seeds])
        wh = np.array([_mean_measured(by_seed[s], "err_white") for s in seeds])
        comm = np.array([np.mean([r["t_comm"] + r["t_transform"] for r in by_seed[s][1:]]) for s in seeds])
        fp32_final = np.array([ref[s][-1]["val_loss"] for s in seeds])
        # a second, less noisy loss: training loss over the last 20 steps (20 x P x batch sequences)
        tail = lambda rows: float(np.mean([r["train_loss"] for r in rows[-20:]]))  # noqa: E731
        tgaps = np.array([tail(by_seed[s]) - tail(ref[s]) for s in seeds])
        sd = lambda a: float(np.std(a, ddof=1)) if len(a) > 1 else float("nan")  # noqa: E731
        algos = sorted({r.get("algorithm", "?") or "?" for s in seeds for r in by_seed[s]})
        out.append(dict(world=world, mode=mode, algorithm="+".join(algos), n=len(seeds), val=float(final.mean()), val_sd=sd(final),
                        gap=float(gaps.mean()), gap_sd=sd(gaps), gap_pct=100 * float(gaps.mean() / fp32_final.mean()),
                        l2=float(l2.mean()), l2_sd=sd(l2), white=float(wh.mean()), white_sd=sd(wh),
                        tgap=float(tgaps.mean()), tgap_sd=sd(tgaps), comm_ms=1e3 * float(comm.mean()), gaps=gaps,
                        by_seed=dict(zip(seeds, gaps.tolist()))))
    index = {(s["world"], s["mode"]): s for s in out}
    for s in out:
        m = parse_mode(s["mode"])
        s["recovered"] = float("nan")
        s["vs_euclid"] = ""
        if m.gift:
            twin = index.get((s["world"], m.twin))
            common = sorted(set(twin["by_seed"]) & set(s["by_seed"])) if twin is not None else []
            if common:
                # paired over seeds: > 0 GIFT better
                d = np.array([twin["by_seed"][k] - s["by_seed"][k] for k in common])
                tg = float(np.mean([twin["by_seed"][k] for k in common]))
                s["recovered"] = 100 * float(d.mean() / tg) if tg > 0 else float("nan")
                sd_d = float(np.std(d, ddof=1)) if len(d) > 1 else float("nan")
                s["vs_euclid"] = f"{d.mean():+.4f} ± {sd_d:.4f}" + (" *" if abs(d.mean()) > 2 * sd_d else "")
    return out


def _order(mode: str) -> tuple:
    m = parse_mode(mode)
    fmts = ["fp32", "bf16", "fp16", "e4m3", "e5m2", "mxfp8", "mxfp8_e5m2", "nvfp4", "mxfp4"]
    return (m.opt, fmts.index(m.fmt) if m.fmt in fmts else 99, m.rounding, m.ef, m.gift, m.full, m.damping or 0.0)


def summary_table(st: list[dict]) -> str:
    lines = ["| P | mode | algorithm | seeds | final val loss | gap to fp32 (paired) | gap % | gap > 2 sd? | L2 grad err "
             "| whitened grad err | train-loss gap (last 20 steps) | GIFT − Euclid gap (paired) | share of gap recovered | comm ms/step |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in st:
        sig = "" if s["mode"] == parse_mode(s["mode"]).reference else ("yes" if abs(s["gap"]) > 2 * s["gap_sd"] else "no")
        rec = "-" if math.isnan(s["recovered"]) else f"{s['recovered']:.0f}%"
        lines.append(f"| {s['world']} | {s['mode']} | {s['algorithm']} | {s['n']} | {s['val']:.4f} ± {s['val_sd']:.4f} | "
                     f"{s['gap']:+.4f} ± {s['gap_sd']:.4f} | {s['gap_pct']:+.2f}% | {sig} | "
                     f"{s['l2']:.4f} ± {s['l2_sd']:.4f} | {s['white']:.3f} ± {s['white_sd']:.3f} | "
                     f"{s['tgap']:+.4f} ± {s['tgap_sd']:.4f} | "
                     f"{s['vs_euclid'] or '-'} | {rec} | {s['comm_ms']:.1f} |")
    return "\n".join(lines)


def plot(st: list[dict], out: str) -> None:
    from studies.plotting import pyplot, save

    plt = pyplot()
    worlds = sorted({s["world"] for s in st})
    fig, axes = plt.subplots(1, len(worlds), figsize=(7 * len(worlds), 4.8), squeeze=False)
    for ax, w in zip(axes[0], worlds):
        rows = [s for s in st if s["world"] == w and s["mode"] != parse_mode(s["mode"]).reference]
        x = np.arange(len(rows))
        colors = ["tab:green" if parse_mode(s["mode"]).gift else "tab:gray" for s in rows]
        ax.bar(x, [s["gap"] for s in rows], yerr=[s["gap_sd"] for s in rows], color=colors, capsize=3)
        for xi, s in zip(x, rows):
            ax.plot([xi] * len(s["gaps"]), s["gaps"], "k.", ms=4)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks(x, [s["mode"] for s in rows], rotation=60, ha="right", fontsize=8)
        ax.set(title=f"P = {w}: final val loss − fp32 (same seed), mean ± sd, dots = seeds", ylabel="nats/byte")
        ax.grid(alpha=0.3, axis="y")
    save(fig, os.path.join(out, "train-gap.png"))
    fig, axes = plt.subplots(1, len(worlds), figsize=(7 * len(worlds), 4.5), squeeze=False)
    runs = load_runs(out)
    for ax, w in zip(axes[0], worlds):
        rows = [s for s in st if s["world"] == w]
        parts = {"t_comm": [], "t_transform": []}
        for s in rows:
            by_seed = runs[(w, s["mode"])]
            for k in parts:
                parts[k].append(1e3 * np.mean([np.mean([r[k] for r in rr[1:]]) for rr in by_seed.values()]))
        x = np.arange(len(rows))
        ax.bar(x, parts["t_comm"], label="collective (codec + transfers)")
        ax.bar(x, parts["t_transform"], bottom=parts["t_comm"], label="GIFT transform")
        ax.set_xticks(x, [s["mode"] for s in rows], rotation=60, ha="right", fontsize=8)
        ax.set(title=f"P = {w} (loopback threads): communication ms/step, compute excluded", ylabel="ms")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    save(fig, os.path.join(out, "train-comm.png"))


def report(out: str, header: str = "", no_plot: bool = False) -> str:
    st = stats(load_runs(out))
    table = summary_table(st)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("# giftcomm training grid\n\n" + header + table + "\n")
    if not no_plot:
        plot(st, out)
    return table


# ---------------------------------------------------------------- CLI

# the training comparison's model (--size medium): 4 blocks of width 128, ~0.8M parameters
MEDIUM = Config(dim=128, layers=4, heads=4, ffn=344, seq_len=64, steps=100, val_every=20, val_batches=64,
                refresh=25, warmup=8)
# the training comparison on the larger model (--size large): 4 blocks of width 192 (head width 32
# as medium's), ~1.8M parameters, medium's schedule (100 steps: what fits the seeds on this CPU)
LARGE = Config(dim=192, layers=4, heads=6, ffn=512, seq_len=64, steps=100, val_every=20, val_batches=64,
               refresh=25, warmup=8)
# the powered comparison: medium's model and schedule, 4,096 held-out sequences (256 KiB) per
# evaluation, the metric averaged over the last 3 evaluations (steps 60, 80 and 99)
POWERED = Config(**{**asdict(MEDIUM), "val_batches": 4096, "val_last": 3})
SIZES = {"grid": Config(), "medium": MEDIUM, "large": LARGE, "powered": POWERED}
QUICK = Config(dim=64, layers=1, heads=2, ffn=128, seq_len=32, steps=12, batch=2, val_every=4, val_batches=8,
               kfac_every=2, kfac_tokens=32, refresh=4, paper_refresh=4, paper_profile=3, warmup=2,
               corpus_bytes=1_000_000)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies train", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated modes (default {DEFAULT_MODES})")
    p.add_argument("--world", default="4,16", help="comma-separated world sizes (default 4,16)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--transport", choices=["loopback", "mpi"], default="loopback")
    p.add_argument("--algorithm", default="auto", help="GradSync's allreduce algorithm (default auto; e.g. ring)")
    p.add_argument("--block", type=int, default=None, help="block size of the scaled formats (default: each format's own)")
    p.add_argument("--mx-scale", choices=["ceil", "floor"], default=None,
                   help="scale rule of the MX formats (default: the library's, ceil; floor = OCP MX v1.0)")
    p.add_argument("--size", choices=sorted(SIZES), default="grid",
                   help="model and schedule preset (default grid: ~246k parameters; medium: ~0.8M; large: ~1.8M)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--val-every", type=int, default=None, help="validate every N steps (default: the preset's)")
    p.add_argument("--quick", action="store_true", help="tiny model, 12 steps (CI)")
    p.add_argument("--out", default=None, help="default perf/results/train-grid (--quick: perf/results/train-quick)")
    p.add_argument("--report", action="store_true", help="only recompute summary.md and the plots from --out")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--skip-existing", action="store_true",
                   help="skip a run whose .csv (of --steps rows) and .json are already in --out")
    a = p.parse_args(argv)
    if a.out is None:
        a.out = "perf/results/train-quick" if a.quick else "perf/results/train-grid"
    if a.report:
        print(report(a.out, no_plot=a.no_plot))
        return 0
    import torch

    from studies.workloads.corpus import load_corpus

    torch.set_num_threads(1)
    cfg = Config(**asdict(QUICK if a.quick else SIZES[a.size]))
    if a.steps is not None:
        cfg.steps = a.steps
    if a.val_every is not None:
        cfg.val_every = a.val_every
    modes = [parse_mode(m.strip()) for m in a.modes.split(",") if m.strip()]
    worlds = [int(w) for w in a.world.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    corpus = load_corpus(max_bytes=cfg.corpus_bytes)
    mpi_ctx = None
    if a.transport == "mpi":
        from mpi4py import MPI

        mpi_ctx = MpiCtx(MPI.COMM_WORLD)
        if worlds != [mpi_ctx.size]:
            p.error(f"--transport mpi runs at the number of processes ({mpi_ctx.size}); got --world {a.world}")
    lead = mpi_ctx is None or mpi_ctx.rank == 0
    if lead:
        os.makedirs(a.out, exist_ok=True)
        n = make_model(cfg, 0).num_parameters()
        print(f"giftcomm train: {a.transport}, {n / 1e3:.0f}k params, {cfg.steps} steps x {cfg.batch} seqs/rank, "
              f"worlds {worlds}, seeds {seeds}, {len(modes)} modes", file=sys.stderr)
    t_all = time.perf_counter()
    for world in worlds:
        for seed in seeds:
            for mode in modes:
                if a.skip_existing and run_exists(a.out, world, seed, mode.name, cfg.steps):
                    if lead:
                        print(f"P={world} seed={seed} {mode.name:<16} exists, skipped", file=sys.stderr, flush=True)
                    continue
                t0 = time.perf_counter()
                if mpi_ctx is not None:
                    rows, final = train_rank(mpi_ctx, mode, cfg, seed, corpus, a.algorithm, a.block, a.mx_scale)
                else:
                    rows, final = run_loopback(mode, cfg, seed, world, corpus, a.algorithm, a.block, a.mx_scale)
                if lead:
                    write_run(a.out, rows, final)
                    print(f"P={world} seed={seed} {mode.name:<16} {final['algorithm']:<8} val {final['val_loss']:.4f} "
                          f"l2 {_mean_measured(rows, 'err_l2'):.4f} white {_mean_measured(rows, 'err_white'):.4f} "
                          f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    if lead:
        cost = time.perf_counter() - t_all
        print(f"giftcomm train: grid took {cost:.0f} s", file=sys.stderr)
        header = (f"Command: `python -m studies train {' '.join(argv if argv is not None else sys.argv[1:])}` "
                  f"({a.transport}; this invocation {cost:.0f} s wall). Config: {asdict(cfg)}\n\n")
        print(report(a.out, header, no_plot=a.no_plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
