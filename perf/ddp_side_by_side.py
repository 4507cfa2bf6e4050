"""DDP on the CPU (gloo), side by side in one run: DDP's default allreduce against giftcomm's hook
with ``algorithm="auto"`` (the native path allowed: the default) and with compression forced
(``allow_native=False``), in interleaved rounds so that a loaded machine slows all alike::

    torchrun --nproc_per_node 2 perf/ddp_side_by_side.py [--width 1024 --depth 6 --batch 64]
             [--rounds 5 --steps 8] [--fmt e4m3] [--show-paths]

Each configuration trains its own copy of the same MLP (depth x Linear(width, width) + GELU, then
Linear(width, 16)) with SGD on the same data; a round runs ``--steps`` timed steps of each, one
configuration after the other (the order rotating per round). Prints, per configuration, the
median over rounds of the mean seconds per step (the slowest rank's), and ``default/this``: DDP's
default hook's time over this one's (>= 1: at least as fast as the default). ``--show-paths`` shows at
INFO which path each bucket size took and why (giftcomm.adapters). The cost model reads the
calibration in force (GIFTCOMM_CALIBRATION).
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from giftcomm.adapters.torch import GiftState, gift_hook
from giftcomm.perf.timing import load_average


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(depth):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 16))


class Config:
    """One configuration: its DDP model, optimizer, data generator and hook state (or None)."""

    def __init__(self, name: str, args: argparse.Namespace, state: GiftState | None) -> None:
        self.name, self.state, self.times = name, state, []  # type: ignore[var-annotated]
        self.ddp = DDP(_model(args.width, args.depth), gradient_as_bucket_view=True)
        if state is not None:
            self.ddp.register_comm_hook(state, gift_hook)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(1000 + dist.get_rank())
        self.batch, self.width = args.batch, args.width

    def steps(self, n: int) -> float:
        """Mean seconds per step of ``n`` steps, the slowest rank's."""
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            x = torch.randn(self.batch, self.width, generator=self.gen)
            loss = self.ddp(x).pow(2).mean()
            self.opt.zero_grad(set_to_none=False)
            loss.backward()
            self.opt.step()
        mine = torch.tensor([(time.perf_counter() - t0) / n], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return float(mine)




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration and round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration first")
    ap.add_argument("--fmt", default="e4m3")
    ap.add_argument("--show-paths", action="store_true", help="INFO logs of giftcomm.adapters (the path of each bucket)")
    args = ap.parse_args()
    if args.show_paths:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    configs = [Config("DDP default (gloo allreduce)", args, None),
               Config(f"giftcomm auto ({args.fmt}, native allowed)", args, GiftState(fmt=args.fmt)),
               Config(f"giftcomm {args.fmt} (allow_native=False)", args, GiftState(fmt=args.fmt, allow_native=False))]
    load = load_average()
    for c in configs:
        c.steps(args.warmup)
    for r in range(args.rounds):
        for c in configs[r % len(configs):] + configs[: r % len(configs)]:
            c.times.append(c.steps(args.steps))
    if rank == 0:
        params = sum(p.numel() for p in configs[0].ddp.parameters())
        print(f"# DDP side by side: P={dist.get_world_size()} gloo, MLP width {args.width} depth {args.depth} "
              f"({params / 1e6:.2f} M parameters, {params * 4 / 2**20:.1f} MiB of float32 gradients), batch "
              f"{args.batch}; {args.rounds} interleaved rounds of {args.steps} steps; loadavg {load} -> {load_average()}; "
              f"calibration {os.environ.get('GIFTCOMM_CALIBRATION', '(default path or built-in)')}")
        base = statistics.median(configs[0].times)
        for c in configs:
            med = statistics.median(c.times)
            print(f"{c.name:>44}: {med * 1e3:8.2f} ms/step (rounds {', '.join(f'{t * 1e3:.1f}' for t in c.times)})"
                  f"   default/this {base / med:5.2f}x", flush=True)
    for c in configs:
        if c.state is not None:
            c.state.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
