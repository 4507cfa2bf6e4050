"""A ZeRO-1-style loop under mpiexec: FP8 gradient reduce-scatter into each rank's shard, Adam on
the shard only, exact allgather of the updated parameters (ShardedGradSync).

    mpiexec -n 2 python examples/zero_sharded_adam.py --quick

Each rank keeps the optimizer state of 1/P of the parameters (the ZeRO partition: the flat
gradient buffer padded to a multiple of P, rank r owning elements [r*n/P, (r+1)*n/P)); the
gradient shard arrives reduced over all ranks by ``giftcomm.reduce_scatter(layout="equal")``.
The parameters stay identical on every rank, which the script checks at the end.
"""
from __future__ import annotations

import argparse
import hashlib

import torch
from mpi4py import MPI

from giftcomm.adapters.torch import ShardedGradSync


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--width", type=int, default=257)
    p.add_argument("--fmt", default="e4m3")
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    if args.quick:
        args.steps, args.width = 8, 37
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(19, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 3))
    sync = ShardedGradSync(model, comm=comm, fmt=args.fmt)
    master = sync.param_shard()            # this rank's fp32 master weights
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    b1, b2, eps = 0.9, 0.999, 1e-8
    gen = torch.Generator().manual_seed(100 + rank)
    w_true = torch.randn(19, 3, generator=torch.Generator().manual_seed(7))
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 19, generator=gen)
        sync.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ w_true))
        loss.backward()
        g = sync.sync().float()            # the averaged gradient, this rank's shard only
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        master -= args.lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
        sync.gather_params(master)         # every rank gets every updated parameter
        losses = comm.allgather(loss.item())
        if rank == 0 and (step == 1 or step % max(args.steps // 4, 1) == 0):
            print(f"step {step}: mean loss {sum(losses) / len(losses):.4f}")
    digest = hashlib.sha256(torch.cat([q.detach().reshape(-1) for q in model.parameters()]).numpy().tobytes()).hexdigest()
    same = len(set(comm.allgather(digest))) == 1
    if rank == 0:
        print(f"{comm.size} ranks, {sync.numel} parameters padded to {sync.buffer.numel()}, shard "
              f"{sync.hi - sync.lo} per rank, fmt {args.fmt}; parameters identical on every rank: {same}")


if __name__ == "__main__":
    main()
