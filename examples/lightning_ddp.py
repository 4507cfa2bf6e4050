"""PyTorch Lightning DDP with giftcomm's communication hook: the callback, or Lightning's strategy route.

    python examples/lightning_ddp.py --quick                    # CPU: Lightning starts 2 processes (gloo)
    python examples/lightning_ddp.py --quick --route strategy   # DDPStrategy(ddp_comm_state=GiftState(...))
    torchrun --nproc_per_node 2 examples/lightning_ddp.py --quick   # torchrun starts the processes instead
    python examples/lightning_ddp.py --devices 8 --fmt nvfp4    # GPUs: NCCL, CUDA buckets stay on the GPU

``--route callback`` passes ``GiftCommCallback(fmt=...)`` to the Trainer; ``--route strategy``
builds the ``GiftState`` before the Trainer (before any process group exists) and gives it to
``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=gift_hook)``: Lightning registers it on CUDA,
and ``GiftCommCallback()`` registers it on CPUs, where Lightning does not. Rank 0 prints the
hook's statistics and whether every rank ends with the same parameters.
"""
from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning.strategies import DDPStrategy  # type: ignore[no-redef]

from giftcomm import GiftSchedule
from giftcomm.adapters.lightning import GiftCommCallback
from giftcomm.adapters.torch import GiftState, gift_hook


class Regressor(pl.LightningModule):
    """A small MLP fitting a fixed random linear map (the same initial weights on every rank)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = [torch.nn.Linear(32, width), torch.nn.Tanh()]
        for _ in range(depth - 1):
            layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data(steps: int, batch: int, devices: int) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(steps * batch * devices, 32, generator=gen)
    y = x @ torch.randn(32, 1, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few small steps (CI)")
    p.add_argument("--route", default="callback", choices=["callback", "strategy"])
    p.add_argument("--devices", type=int, default=2, help="processes (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--fmt", default="e4m3")
    p.add_argument("--start", type=int, default=2, help="iterations of plain allreduce first")
    p.add_argument("--precision", default="32-true", help="Lightning's precision, e.g. bf16-mixed")
    args = p.parse_args()
    if args.quick:
        args.steps, args.width, args.depth, args.batch = 6, 48, 2, 16
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", args.devices))
    timeout = datetime.timedelta(seconds=120)
    if args.route == "strategy":
        state = GiftState(fmt=args.fmt, schedule=GiftSchedule(warmup=args.start))  # before any process group exists
        strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=gift_hook, timeout=timeout)
        callback = GiftCommCallback()  # registers the strategy's state where Lightning does not (CPU)
    else:
        strategy = DDPStrategy(timeout=timeout)
        callback = GiftCommCallback(fmt=args.fmt, schedule=GiftSchedule(warmup=args.start))
    trainer = pl.Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=devices,
                         strategy=strategy, callbacks=[callback], max_steps=args.steps, precision=args.precision,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    model = Regressor(args.width, args.depth)
    trainer.fit(model, data(args.steps, args.batch, devices))
    assert callback.state is not None
    s = callback.state.stats()
    digest = float(sum(float(q.detach().double().sum()) for q in model.parameters()))
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if args.route == "strategy":
        print(f"rank {trainer.global_rank}: the hook used the strategy's GiftState: {callback.state is state}", flush=True)
    if trainer.global_rank == 0:
        print(f"lightning {args.route} route: world {trainer.world_size}, {args.fmt}, {s.iterations} iterations, "
              f"{s.warmup_buckets} warm-up / {s.host_buckets} host / {s.device_buckets} device buckets, "
              f"{s.bytes_saved / 2**10:.1f} KiB saved; parameters identical on every rank: {len(set(digests)) == 1}",
              flush=True)
    callback.state.shutdown()
    dist.barrier()
    dist.destroy_process_group()  # every rank done (the barrier) before any tears its connections down


if __name__ == "__main__":
    main()
