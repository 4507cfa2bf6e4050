"""Megatron-core DDP step time with the giftcomm process group as its data-parallel group against
its own uncompressed gloo group, all-reduce and distributed-optimizer (reduce-scatter) modes.

    torchrun --nproc_per_node 2 perf/megatron_step.py [--width 2048] [--layers 4] [--steps 3] [--rounds 3] \\
        [--fmts e4m3,nvfp4] [--modes allreduce,dist-opt,allreduce-overlap,dist-opt-overlap] [--json OUT]
    # under mpiexec on the netbed (docs/netbed.md): ranks from MPI, rendezvous through a shared file
    perf/netbed run --hosts 2 --rate 1gbit -- env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \\
        python perf/megatron_step.py --rendezvous /tmp/megatron-step.rdzv

The model is perf/torch_bench.py's stack of ``--layers`` bias-free nn.Linear(width, width) (width
2048, 4 layers: 16.8M parameters, 64 MiB of float32 gradients) in megatron.core's
DistributedDataParallel, on the CPU. Modes: "allreduce" (overlap off: one bucket, reduced in
``finish_grad_sync``), "dist-opt" (``use_distributed_optimizer=True``: the gradient buffer
reduce-scattered), and "allreduce-overlap", "dist-opt-overlap": the same with
``overlap_grad_reduce=True`` and one bucket per layer (``bucket_size`` = width^2), each bucket's
collective issued asynchronously from the backward hooks as soon as its layer's gradients are
ready, ``finish_grad_sync`` waiting for them (the giftcomm group runs its compressed calls on
its worker thread, gloo on its own). The configurations ``--modes x {compute-only, gloo,
giftcomm FMT for each of --fmts}`` train it on the same data, interleaved round by round (giftcomm.perf.timing.time_rounds,
one warm-up step each); giftcomm's groups are ``new_group(fmt=FMT)`` (its defaults otherwise). A step is
forward, backward, ``finish_grad_sync`` and an SGD update of the parameters from ``main_grad`` (the
distributed optimizer's parameter all-gather is not run: it is the inner gloo group's in both);
"compute-only" is the same step with overlap off and without ``finish_grad_sync`` (no gradient
communication).

Rank 0 prints, per configuration, the median step time, the communication overhead (step minus
the compute-only step of the same mode) and its ratio to gloo's, and the bytes a step sent from a
rank: giftcomm's from ``giftcomm.stats`` of the group's transport (the encoded messages), gloo's as
a ring moves float32 (allreduce ``2 (P-1)/P n 4``, reduce-scatter ``(P-1)/P n 4``). ``--json OUT``
writes the same rows (perf/torch_bench.py's write_rows).

CPU-only shim (a benchmark's, never the library's): ``torch.cuda.current_device`` returns "cpu",
where Megatron allocates its gradient buffers. ``--cuda``: no shim; NCCL as the default and the
uncompressed group (its row keeps the name "gloo", the trainer's uncompressed group), the model on
``cuda:LOCAL_RANK``, each step ending with ``torch.cuda.synchronize()``; giftcomm's bytes are then
its CUDA transport's::

    torchrun --nproc_per_node 8 perf/megatron_step.py --cuda --fmts e4m3,nvfp4 --json OUT
"""
from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch_bench  # perf/torch_bench.py (this script's directory is on sys.path)

import giftcomm
from giftcomm.perf.timing import load_average, time_rounds

MODES = ["allreduce", "dist-opt", "allreduce-overlap", "dist-opt-overlap"]


def _build(args, mode: str, group, one, overlap: bool, device: torch.device):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    pgc = ProcessGroupCollection(dp=group, tp=one, pp=one, ep=one, expt_dp=one)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1)
    model = torch_bench.linear_stack(args.width, args.layers).to(device)
    dcfg = DistributedDataParallelConfig(use_distributed_optimizer=mode.startswith("dist-opt"),
                                         overlap_grad_reduce=overlap,
                                         bucket_size=args.width * args.width if overlap else None)
    return DistributedDataParallel(cfg, dcfg, model, pg_collection=pgc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    torch_bench.step_arguments(ap, steps=3, rounds=3)
    torch_bench.output_arguments(ap)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    ap.add_argument("--cuda", action="store_true", help="CUDA tensors, NCCL (one GPU per rank: LOCAL_RANK)")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: a comma-separated subset of {MODES}, got {args.modes!r}")
    warnings.simplefilter("ignore")
    if args.cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]  # the CPU shim
    backend = "nccl" if args.cuda else "gloo"
    torch_bench.init_process_group(args.rendezvous, backend)
    from giftcomm.adapters.torch import new_group

    rank, world = dist.get_rank(), dist.get_world_size()
    fmts = [f for f in args.fmts.split(",") if f]
    gifts = {f"giftcomm {f}": new_group(fmt=f) for f in fmts}
    plain = dist.new_group(backend=backend)
    one = dist.new_group(ranks=[rank], use_local_synchronization=True)
    groups = ["compute-only", "gloo", *gifts]
    names = [(m, g) for m in modes for g in groups]
    built = {(m, g): _build(args, m, gifts.get(g, plain), one, m.endswith("overlap") and g != "compute-only", device)
             for m, g in names}
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank)).to(device)
    steps = {n: 0 for n in names}
    sent_bytes = {n: 0 for n in names}

    def sent(group: str) -> int:
        if group not in gifts:
            return 0
        return sum(giftcomm.stats(gifts[group].transport(device.type))["bytes_sent"].values())

    def step_of(name):
        ddp = built[name]
        mode, group = name

        def step() -> None:
            ddp.zero_grad_buffer()
            before = sent(group)
            ddp(x).square().mean().backward()
            if group != "compute-only":  # compute-only: the gradients stay unreduced
                ddp.finish_grad_sync()
            with torch.no_grad():
                for p in ddp.module.parameters():
                    p -= 1e-3 * p.main_grad
            if args.cuda:
                torch.cuda.synchronize()
            sent_bytes[name] += sent(group) - before
            steps[name] += 1
        return step

    seconds = time_rounds([step_of(n) for n in names], args.rounds, calls=args.steps, warmup=1, barrier=dist.barrier)
    if rank == 0:
        n = sum(p.numel() for p in built[names[0]].module.parameters())
        rows = []
        for (m, g), s in zip(names, seconds):
            fp32 = 4 * n * (world - 1) / world * (1 if m.startswith("dist-opt") else 2)  # a ring of float32
            per_step = {"compute-only": 0.0, "gloo": fp32}.get(g, sent_bytes[(m, g)] / max(steps[(m, g)], 1))
            rows.append({"mode": m, "group": g, "step_ms": 1e3 * s, "bytes_per_step": per_step})
        rows = torch_bench.write_rows(args.json, "megatron_step", rows, world=world, parameters=n,
                                      rounds=args.rounds, steps=args.steps, load=load_average())
        print(f"Megatron-core DDP step, P = {world}, {n / 1e6:.1f}M parameters ({4 * n / 2**20:.0f} MiB fp32 "
              f"gradients; one bucket, or one per layer with overlap), {'CUDA/NCCL' if args.cuda else 'CPU/gloo'}; "
              f"medians over {args.rounds} rounds of {args.steps} steps; "
              f"giftcomm groups: new_group(fmt=...) for {fmts}; load {load_average()}")
        torch_bench.print_overheads(rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
