"""Hugging Face Accelerate with giftcomm's DDP communication hook: ``prepare``, then ``register_comm_hook``.

    torchrun --nproc_per_node 2 examples/accelerate_ddp.py --quick       # CPU: 2 processes, gloo
    accelerate launch --multi_gpu --num_processes 8 examples/accelerate_ddp.py --fmt nvfp4   # GPUs: NCCL
    python examples/accelerate_ddp.py --quick                            # one process: nothing to reduce

``accelerator.prepare(model, ...)`` wraps the model in DistributedDataParallel when there are
several processes; the hook goes on that wrapper: ``model.register_comm_hook(GiftState(...),
gift_hook)``. (``DistributedDataParallelKwargs(comm_hook=...)`` takes only Accelerate's own
``DDPCommunicationHookType`` enum, not a hook function.) Rank 0 prints the hook's statistics
and whether every rank ends with the same parameters.
"""
from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

from giftcomm import GiftSchedule
from giftcomm.adapters.torch import GiftState, gift_hook


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few small steps (CI)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--fmt", default="e4m3")
    p.add_argument("--start", type=int, default=2, help="iterations of plain allreduce first")
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    args = p.parse_args()
    if args.quick:
        args.steps, args.width, args.batch = 6, 48, 16
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, args.width),
                                torch.nn.Tanh(), torch.nn.Linear(args.width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(args.steps * args.batch * accelerator.num_processes, 32, generator=gen)
    y = x @ torch.randn(32, 1, generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    state = GiftState(fmt=args.fmt, schedule=GiftSchedule(warmup=args.start), param_names=model)
    if isinstance(model, DistributedDataParallel):  # several processes: the wrapper carries the hook
        model.register_comm_hook(state, gift_hook)

    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()

    s = state.stats()
    digest = torch.tensor([sum(float(q.detach().double().sum()) for q in model.parameters())], dtype=torch.float64,
                          device=accelerator.device)
    digests = accelerator.gather(digest)
    if accelerator.is_main_process:
        print(f"accelerate: {accelerator.num_processes} processes ({accelerator.distributed_type}), {args.fmt}, "
              f"{s.iterations} iterations, {s.warmup_buckets} warm-up / {s.host_buckets} host / {s.device_buckets} "
              f"device buckets, {s.bytes_saved / 2**10:.1f} KiB saved; parameters identical on every rank: "
              f"{bool((digests == digests[0]).all())}", flush=True)
    state.shutdown()
    accelerator.wait_for_everyone()  # every rank done before any tears its connections down
    # the DDP wrapper goes before the process group: dropped after it, torch's DDP Reducer drops the
    # last reference to the gloo group while holding the GIL and waits for gloo's worker threads,
    # one of which may still be freeing a finished collective's tensors and need the GIL (a hang
    # at exit, seen in 2 runs of 29 on a busy CPU)
    model, opt, loader = accelerator.free_memory(model, opt, loader)
    accelerator.end_training()


if __name__ == "__main__":
    main()
