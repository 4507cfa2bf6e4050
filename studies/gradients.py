"""Capture real data-parallel gradients and KFAC factors from the small Llama-style model.

``python -m studies.gradients [--config small] [--train-steps 120] [--capture-steps 3]
[--ranks 4] [--batch 16] [--capture-batch N] [--out PATH] [--capture-at 30,120,240] [--optimizer adamw|muon]``

(``--capture-at``: several training phases of one run, one file each; see ``capture``.
``--capture-batch``: sequences per capture step, split over the ranks (default ``--batch``): more
tokens per captured gradient without more training cost.)

1. Train ``studies.workloads.llama.Llama`` (config ``small`` by default: dim 256, 7 blocks,
   SwiGLU 688, tied embedding, ~5.3M parameters) with AdamW (lr 3e-3, warm-up 20 steps, weight
   decay 0.1 on matrices; ``--optimizer muon``: ``torch.optim.Muon`` on the blocks' 2-D weights,
   ``adjust_lr_fn="match_rms_adamw"``, weight decay 0.1, with AdamW on the embedding and norms, the
   split of ``studies.train``'s ``-muon`` modes; the same schedule) on the byte-level stdlib corpus (``studies.workloads.corpus``),
   ``batch`` sequences of the config's ``seq_len`` tokens per step, float32, one thread.
   Forward/backward hooks on every ``nn.Linear`` feed running KFAC factors
   ``A = E[a a^T]`` (inputs, in x in) and ``G = E[d d^T]`` (gradients w.r.t. the outputs,
   out x out), from ``kfac_rows`` random rows of each layer per step, EMA decay 0.95: the
   factors a geometry would be built from (``factors``).
2. Then ``capture_steps`` more steps: each batch is split into ``ranks`` equal shards (data
   parallel); each shard's gradient (mean loss over its tokens) is kept, flat, in
   ``named_parameters`` order (float32, shape (steps, ranks, n)); the optimiser steps on the
   mean of the shards (= the full-batch gradient). The KFAC factors of exactly these batches
   (all rows, all shards, plain mean over the capture steps) are kept as ``metric``: the
   curvature of the gradients being sent. ``factors`` are frozen at the start of the capture.

The ``.npz`` holds: names, shapes (JSON), grads, and per Linear weight ``A/<name>``,
``G/<name>`` (EMA, float32) and ``MA/<name>``, ``MG/<name>`` (capture batches, float32),
plus ``info`` (JSON: config, losses, timings). ``load_case(path)`` turns it into a
``studies.cases.Case``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

from studies.cases import DEFAULT_PATH, load_case  # the capture file's reader lives with Case (studies.cases)

__all__ = ["capture", "load_case", "main", "DEFAULT_PATH"]


class _KfacHooks:
    """Forward hooks on every nn.Linear: on active steps keep ``rows`` random rows of the input
    a (..., in) and of the output gradient d (..., out), and accumulate ``a^T a / rows`` and
    ``d^T d / rows`` (float64) into running EMAs (``ema``) or plain sums (``total``)."""

    def __init__(self, model, rows: int, seed: int, decay: float = 0.95):
        import torch

        self.torch = torch
        self.decay, self.rows = decay, rows
        self.gen = torch.Generator().manual_seed(seed)
        self.mode = None  # None | "ema" | "total"
        self.ema: dict[str, list] = {}
        self.total: dict[str, list] = {}
        self.count: dict[str, int] = {}
        names = {id(p): n for n, p in model.named_parameters()}
        self.handles = []
        for _, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                self.handles.append(mod.register_forward_hook(self._hook(names[id(mod.weight)])))

    def _hook(self, name: str):
        torch = self.torch

        def hook(module, inputs, output):
            if self.mode is None or not output.requires_grad:
                return
            a = inputs[0].detach().reshape(-1, module.in_features)
            idx = None
            if self.mode == "ema" and a.shape[0] > self.rows:
                idx = torch.randperm(a.shape[0], generator=self.gen)[: self.rows]
                a = a[idx]
            fa = (a.T @ a).double() / a.shape[0]
            mode = self.mode

            def grad_hook(grad):
                d = grad.detach().reshape(-1, module.out_features)
                if idx is not None:
                    d = d[idx]
                fg = (d.T @ d).double() / d.shape[0]
                self._add(name, fa.cpu().numpy(), fg.cpu().numpy(), mode)

            output.register_hook(grad_hook)

        return hook

    def _add(self, name, fa, fg, mode):
        if mode == "ema":
            if name not in self.ema:
                self.ema[name] = [fa.copy(), fg.copy()]
            else:
                for old, new in zip(self.ema[name], (fa, fg)):
                    old *= self.decay
                    old += (1 - self.decay) * new
        else:
            if name not in self.total:
                self.total[name] = [np.zeros_like(fa), np.zeros_like(fg)]
                self.count[name] = 0
            self.total[name][0] += fa
            self.total[name][1] += fg
            self.count[name] += 1

    def remove(self):
        for h in self.handles:
            h.remove()


class _Optimizers:
    """The training run's optimizers as one: ``adamw`` (AdamW, weight decay 0.1 on matrices) or
    ``muon`` (torch.optim.Muon on the blocks' 2-D weights, AdamW on the rest; module doc)."""

    def __init__(self, model, name: str, lr: float) -> None:
        import torch

        adamw = dict(lr=lr, betas=(0.9, 0.95))
        if name == "adamw":
            hidden: list = []
        elif name == "muon":
            hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
        else:
            raise ValueError(f"unknown optimizer {name!r} (adamw, muon)")
        ids = {id(p) for p in hidden}
        decay = [p for p in model.parameters() if p.ndim >= 2 and id(p) not in ids]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        self.opts = [torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                        {"params": no_decay, "weight_decay": 0.0}], **adamw)]
        if hidden:
            self.opts.append(torch.optim.Muon(hidden, lr=lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"))

    def schedule(self, factor) -> _Schedules:
        """One LambdaLR of ``factor`` per optimizer, stepped together."""
        import torch

        return _Schedules([torch.optim.lr_scheduler.LambdaLR(o, factor) for o in self.opts])

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


class _Schedules:
    def __init__(self, scheds: list) -> None:
        self.scheds = scheds

    def step(self) -> None:
        for s in self.scheds:
            s.step()


def capture(config: str = "small", train_steps: int = 120, capture_steps: int = 3, ranks: int = 4,
            batch: int = 16, lr: float = 3e-3, kfac_rows: int = 512, seed: int = 0,
            out: str = DEFAULT_PATH, log=sys.stderr, capture_at: list[int] | None = None,
            capture_batch: int | None = None, optimizer: str = "adamw", device: str = "cpu") -> str | list[str]:
    """Train, capture (see the module doc) and save to ``out`` (.npz); returns the path.

    ``capture_at`` (training phases, e.g. [30, 120, 240]): one training run whose cosine schedule
    spans ``max(capture_at)`` plus all capture steps; after each listed number of training steps
    (counting the earlier phases' capture steps, which also step the optimiser) the capture block
    runs and is saved to ``<out stem>-step<N>.npz`` (written as soon as it is taken, so a study can
    start on it); returns the list of paths. ``train_steps`` is ignored then.

    ``capture_batch`` (default ``batch``): sequences per capture step, ``capture_batch // ranks``
    per rank; training steps keep ``batch``. ``optimizer``: "adamw" or "muon" (module doc).
    ``device``: where the model trains ("cpu"; "cuda" for the scale of perf/paper_scale.sh); the
    capture is kept on the host either way."""
    import torch

    from studies.workloads.corpus import load_corpus
    from studies.workloads.llama import CONFIGS, Llama

    capture_batch = batch if capture_batch is None else capture_batch
    if capture_batch % ranks:
        raise ValueError(f"capture batch {capture_batch} must be a multiple of ranks {ranks}")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    cfg = CONFIGS[config]
    model = Llama(cfg).to(device)
    corpus = load_corpus()
    rng = np.random.default_rng(seed)
    opt = _Optimizers(model, optimizer, lr)
    phases = sorted(set(capture_at)) if capture_at else [train_steps]
    total_steps = phases[-1] + capture_steps * len(phases)
    sched = opt.schedule(lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    hooks = _KfacHooks(model, kfac_rows, seed)
    params = list(model.named_parameters())
    n = sum(p.numel() for _, p in params)
    losses, t0 = [], time.perf_counter()

    def get_batch(size: int = batch):
        starts = rng.integers(0, corpus.train.size - cfg.seq_len - 1, size=size)
        return torch.from_numpy(corpus.batch("train", starts, cfg.seq_len)).to(device)

    paths, done = [], 0
    stem = out[:-4] if out.endswith(".npz") else out
    for phase in phases:
        hooks.mode = "ema"
        for step in range(done, phase):
            opt.zero_grad(set_to_none=True)
            loss = model.loss(get_batch())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if log and (step % 20 == 0 or step == phase - 1):
                print(f"train step {step}: loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)", file=log, flush=True)
        done = phase
        path = out if capture_at is None else f"{stem}-step{phase}.npz"
        paths.append(_capture_block(model, opt, sched, hooks, params, n, get_batch, capture_steps, ranks,
                                    capture_batch, losses, t0, log, path, dict(
                                        config=config, cfg=cfg, train_steps=phase, train_batch=batch, lr=lr, kfac_rows=kfac_rows,
                                        seed=seed, corpus=corpus.digest, schedule_steps=total_steps,
                                        optimizer=optimizer)))
    hooks.remove()
    return paths if capture_at is not None else paths[0]


def _capture_block(model, opt, sched, hooks, params, n, get_batch, capture_steps, ranks, batch, losses, t0, log,
                   out, meta) -> str:
    import torch

    ema = {k: (a.copy(), g.copy()) for k, (a, g) in hooks.ema.items()}
    hooks.mode = "total"
    hooks.total.clear()
    hooks.count.clear()
    first = len(losses)
    grads = np.empty((capture_steps, ranks, n), np.float32)
    shard = batch // ranks
    for s in range(capture_steps):
        tokens = get_batch(batch)
        mean = [torch.zeros_like(p) for _, p in params]
        for r in range(ranks):
            model.zero_grad(set_to_none=True)
            loss = model.loss(tokens[r * shard:(r + 1) * shard])
            loss.backward()
            grads[s, r] = torch.cat([p.grad.reshape(-1) for _, p in params]).cpu().numpy()
            for acc, (_, p) in zip(mean, params):
                acc += p.grad / ranks
            losses.append(loss.item())
        for acc, (_, p) in zip(mean, params):
            p.grad = acc
        opt.step()
        sched.step()
        if log:
            print(f"capture step {s}: shard losses {losses[-ranks:]}", file=log, flush=True)
    hooks.mode = None
    metric = {k: (a / hooks.count[k], g / hooks.count[k]) for k, (a, g) in hooks.total.items()}
    arrays = {"grads": grads}
    for k in ema:
        arrays[f"A/{k}"], arrays[f"G/{k}"] = (x.astype(np.float32) for x in ema[k])
        arrays[f"MA/{k}"], arrays[f"MG/{k}"] = (x.astype(np.float32) for x in metric[k])
    cfg = meta["cfg"]
    info = {"config": meta["config"], "model": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
            "parameters": n, "train_steps": meta["train_steps"], "capture_steps": capture_steps, "ranks": ranks,
            "batch": batch, "train_batch": meta["train_batch"], "lr": meta["lr"],
            "optimizer": meta["optimizer"], "kfac_rows": meta["kfac_rows"], "seed": meta["seed"],
            "corpus": meta["corpus"], "schedule_steps": meta["schedule_steps"],
            "train_loss_first": losses[0], "train_loss_last": float(np.mean(losses[max(0, first - 5):first])),
            "capture_losses": losses[first:], "seconds": time.perf_counter() - t0,
            "torch": torch.__version__}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    np.savez(out, names=np.array([k for k, _ in params]),
             shapes=np.array(json.dumps([list(p.shape) for _, p in params])),
             info=np.array(json.dumps(info)), **arrays)
    if log:
        print(f"saved {out}", file=log, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.gradients", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="small")
    p.add_argument("--train-steps", type=int, default=120)
    p.add_argument("--capture-steps", type=int, default=3)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--capture-batch", type=int, default=None,
                   help="sequences per capture step, split over the ranks (default: --batch)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--kfac-rows", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"),
                   help="adamw, or muon (torch.optim.Muon on the blocks' 2-D weights, AdamW on the rest)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the capture is kept on the host)")
    p.add_argument("--out", default=DEFAULT_PATH)
    p.add_argument("--capture-at", default=None,
                   help="training phases of one run, e.g. 30,120,240: capture after each (files <out>-step<N>.npz)")
    a = p.parse_args(argv)
    at = [int(x) for x in a.capture_at.split(",")] if a.capture_at else None
    path = capture(a.config, a.train_steps, a.capture_steps, a.ranks, a.batch, a.lr, a.kfac_rows, a.seed, a.out,
                   capture_at=at, capture_batch=a.capture_batch, optimizer=a.optimizer,
                   device=a.device)
    print("\n".join(path) if isinstance(path, list) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
