"""A plain PyTorch loop under mpiexec: GradSync (FP8 gradient buckets) + KFAC geometry (GIFT).

    mpiexec -n 2 python examples/gradsync_kfac_mpi.py --quick

Every ``.grad`` is a view of a flat bucket; ``sync.sync()`` reduces each bucket in place. A
KfacCapture feeds KFAC factors from the nn.Linear layers on capture steps; every ``--refresh``
steps the factors are synced over MPI and the per-bucket geometries rebuilt. Works for CPU
models of any float dtype, and CUDA models (NCCL over the MPI ranks).
"""
from __future__ import annotations

import argparse
import time

import torch
from mpi4py import MPI

from giftcomm.adapters.torch import GradSync, KfacCapture, build_geometries
from giftcomm.geometry import SelectivePolicy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--refresh", type=int, default=20)
    args = p.parse_args()
    if args.quick:
        args.steps, args.width, args.refresh = 6, 64, 2
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = torch.nn.Sequential(torch.nn.Linear(32, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, args.width),
                                torch.nn.Tanh(), torch.nn.Linear(args.width, 1)).to(dtype)
    sync = GradSync(model, comm=comm, fmt="e4m3", bucket_mb=1)
    capture = KfacCapture(model, every=2, tokens=128, seed=rank)
    policy = SelectivePolicy() if not args.quick else SelectivePolicy(min_size=0, min_gain=0.0, flops_per_gain=1e9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    t0 = time.perf_counter()
    for step in range(args.steps):
        capture.step(step)
        x = torch.randn(64, 32, generator=gen)
        loss = (model(x.to(dtype)).float() - x @ w_true).pow(2).mean()
        sync.zero_grad()
        loss.backward()
        if step > 0 and step % args.refresh == 0:
            capture.estimator.sync(comm)  # averaged factors, identical on every rank
            sync.set_geometries(build_geometries(capture.estimator, sync.layouts, policy))
        times = sync.sync()
        opt.step()
        if rank == 0 and (step % max(1, args.steps // 5) == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {loss.item():.4f} sync {times.total * 1e3:.1f} ms "
                  f"(transform {times.transform * 1e3:.1f} ms)", flush=True)
    geos = [g for g in sync.geometries if g is not None]
    transformed = sum(sum(not t.is_identity for t in g.transforms) for g in geos)
    if rank == 0:
        print(f"{comm.Get_size()} ranks, {args.steps} steps in {time.perf_counter() - t0:.2f} s; "
              f"{transformed} transformed segments", flush=True)


if __name__ == "__main__":
    main()
