"""DDP with giftcomm's FP8 communication hook, launched by torchrun.

    torchrun --nproc_per_node 2 examples/ddp_torchrun.py --quick            # CPU: gloo
    torchrun --nproc_per_node 8 examples/ddp_torchrun.py --dtype bfloat16    # GPUs: NCCL, device route

On CUDA the buckets stay on the GPU (giftcomm's CUDA codec on a side stream, NCCL point-to-point
over DDP's own group); on the CPU they go through a private gloo group on a worker thread.
``--geometry kfac`` turns on GIFT with KFAC factors captured from the nn.Linear layers, synced
and rebuilt on a side thread every ``--refresh`` steps. ``--compare`` also times DDP's default
allreduce on the same model. Prints the step time and the hook's statistics on rank 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from giftcomm import GiftSchedule
from giftcomm.adapters.torch import GiftState, gift_hook


def mlp(width: int, depth: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 16))
    return torch.nn.Sequential(*layers).to(device=device, dtype=dtype)


def run(args, hook: bool) -> float:
    """Train ``args.steps`` steps; returns seconds per step after ``args.warmup`` steps."""
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = mlp(args.width, args.depth, dtype, device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    state = None
    if hook:
        extra = dict(capture=model, capture_every=args.capture_every) if args.geometry == "kfac" else {}
        state = GiftState(fmt=args.fmt, schedule=GiftSchedule(warmup=args.start, geometry=args.geometry,
                          refresh_every=args.refresh, rebuild_lag=args.rebuild_lag), param_names=model, **extra)
        ddp.register_comm_hook(state, gift_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1000 + rank)
    t0 = None
    for step in range(args.steps):
        if step == args.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        x = torch.randn(args.batch, args.width, generator=gen).to(device=device, dtype=dtype)
        loss = ddp(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / max(1, args.steps - args.warmup)
    if state is not None:
        state.shutdown()
        if rank == 0:
            s = state.stats()
            print(f"giftcomm hook: loss {loss.item():.4f}, {s.device_buckets} device / {s.host_buckets} host buckets, "
                  f"{s.bytes_saved / 2**20:.1f} MiB saved, {s.rebuilds} geometry rebuilds "
                  f"({s.geometry_seconds:.2f} s on the geometry thread, {s.geometry_waits} waits), "
                  f"{s.transformed_segments} transformed segments", flush=True)
    return per_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few small steps (CI)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--fmt", default="e4m3")
    p.add_argument("--start", type=int, default=2, help="iterations of plain allreduce first")
    p.add_argument("--geometry", default="none", choices=["none", "reduced", "kfac"])
    p.add_argument("--refresh", type=int, default=20, help="iterations between geometry rebuilds")
    p.add_argument("--rebuild-lag", type=int, default=10, help="iterations a rebuild may take before it is used")
    p.add_argument("--capture-every", type=int, default=10)
    p.add_argument("--compare", action="store_true", help="also time DDP's default allreduce")
    p.add_argument("--log", action="store_true", help="INFO logs of giftcomm.adapters")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.width, args.depth, args.batch, args.refresh = 8, 2, 128, 2, 16, 3
        args.capture_every, args.rebuild_lag = 1, 1
    if args.log:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    gift = run(args, hook=True)
    base = run(args, hook=False) if args.compare else None
    if dist.get_rank() == 0:
        line = f"world {dist.get_world_size()} {args.dtype} geometry={args.geometry}: giftcomm {gift * 1e3:.1f} ms/step"
        if base is not None:
            line += f", default allreduce {base * 1e3:.1f} ms/step"
        print(line, flush=True)
    dist.barrier()  # every rank done before any tears its gloo/NCCL connections down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
