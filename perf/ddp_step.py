"""DDP step time with giftcomm's e4m3 hook against torch's default allreduce and fp16_compress_hook, side by side.

    torchrun --nproc_per_node 4 perf/ddp_step.py [--width 2048] [--layers 4] [--steps 5] [--rounds 5] \
        [--fmts e4m3,nvfp4] [--json OUT]
    # under mpiexec (e.g. the netbed, docs/netbed.md): ranks from MPI, rendezvous through a shared file
    perf/netbed run --hosts 4 --rate 1gbit -- env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
        python perf/ddp_step.py --rendezvous /tmp/ddp-step.rdzv [--bucket-mb 64]

The model is perf/torch_bench.py's stack of ``--layers`` bias-free nn.Linear(width, width) (width
2048 and 4 layers: 16.8M parameters, 64 MiB of float32 gradients), wrapped in
DistributedDataParallel on CPU with gloo, ``bucket_cap_mb=--bucket-mb`` (default: DDP's own, 25 MiB
with a first bucket of 1 MiB: buckets of 16, 32 and 16 MiB for that model; an explicit cap drops
the first-bucket rule, so 25 makes buckets of 32 and 32 MiB and 64 one bucket). The configurations train
the same model on the same data, interleaved round by round so that load drift hits all of them
alike:

- ``compute-only``: the bare model, no DDP (the same forward, backward and update with no
  gradient communication);
- ``gloo``: DDP's default hook (``dist.all_reduce`` of the float32 bucket);
- ``fp16 hook``: torch's ``default_hooks.fp16_compress_hook`` (the bucket cast to float16, gloo's
  allreduce of 2 bytes per value, cast back);
- ``giftcomm FMT`` for each of ``--fmts`` (default e4m3): ``GiftState(fmt=FMT)`` with ``gift_hook``
  (e4m3: 1.0156 bytes per value).

Steps are timed with giftcomm.perf.timing.time_rounds (the configurations in turns, ``--steps``
back-to-back steps a round after a barrier, one warm-up step each). Every hook call is timed
too: from the hook's call until its future completes (decompression included); the
communication time of a step is the union of those intervals (time during which at least one
bucket is in flight, overlapped with backward or not). Rank 0 prints, per configuration, the
median over rounds of the step time, the median communication time per step, its share of the
step, and the ratios against the fp16 hook and DDP's default; then giftcomm's algorithm per
bucket size and where its worker's time went per step (perf/torch_bench.py: codec, waits on
the gloo sends and receives, posting them, the agreement, the rest).

``--cuda``: NCCL, the model on ``cuda:LOCAL_RANK`` (DDP's ``device_ids``), each step ending with
``torch.cuda.synchronize()`` (the row "gloo" is then DDP's default NCCL allreduce, the trainer's
uncompressed group; giftcomm's hook takes its device route)::

    torchrun --nproc_per_node 8 perf/ddp_step.py --cuda --fmts e4m3,nvfp4 --json OUT
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch_bench  # perf/torch_bench.py (this script's directory is on sys.path)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from giftcomm.perf.timing import load_average, time_rounds


def _timed(hook, state, spans: list[tuple[float, float]], algorithms: dict[int, str] | None = None):
    """A comm hook (a plain function: DDP reads its ``__name__``) that runs ``hook(state,
    bucket)`` and appends the bucket's (call, completion) times to ``spans``; with
    ``algorithms``, records giftcomm's algorithm per bucket size (bytes)."""

    def timed_hook(_state, bucket):
        t0 = time.perf_counter()
        nbytes = bucket.buffer().numel() * bucket.buffer().element_size()

        def done(f):
            spans.append((t0, time.perf_counter()))
            if algorithms is not None and state.runtime.host is not None:  # on the hook's worker, after the call
                from giftcomm import api

                last = api.last_algorithm(state.runtime.host)
                algorithms[nbytes] = "?" if last is None else last[0]
            value = f.value()
            return value[0] if isinstance(value, list) else value
        return hook(state, bucket).then(done)
    return timed_hook


def _union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _build(args, name: str):
    """(model, optimizer, the comm spans, the hook's state, giftcomm's algorithm per bucket) of
    one configuration; "compute-only" is the bare model (no DDP: no gradient communication)."""
    from giftcomm.adapters.torch import GiftState, gift_hook

    model = torch_bench.linear_stack(args.width, args.layers).to(args.device)
    spans: list[tuple[float, float]] = []
    if name == "compute-only":
        return model, torch.optim.SGD(model.parameters(), lr=1e-3), spans, None, None
    ids = [args.device] if args.device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_mb)
    state: object = None
    if name == "gloo":
        hook, state = default_hooks.allreduce_hook, dist.group.WORLD  # DDP's default, as a hook
    elif name == "fp16 hook":
        hook, state = default_hooks.fp16_compress_hook, dist.group.WORLD
    else:
        hook, state = gift_hook, GiftState(fmt=name.removeprefix("giftcomm "))
    algorithms: dict[int, str] | None = {} if name.startswith("giftcomm") else None
    ddp.register_comm_hook(None, _timed(hook, state, spans, algorithms))
    return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), spans, state, algorithms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="DDP's bucket_cap_mb (default: DDP's own, 25 MiB with a first bucket of 1 MiB)")
    torch_bench.step_arguments(ap, steps=5, rounds=5)
    torch_bench.output_arguments(ap)
    ap.add_argument("--cuda", action="store_true", help="CUDA tensors, NCCL (one GPU per rank: LOCAL_RANK)")
    args = ap.parse_args()
    args.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(args.device)
    torch_bench.init_process_group(args.rendezvous, "nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gifts = [f"giftcomm {f}" for f in args.fmts.split(",") if f]
    names = ["compute-only", "gloo", "fp16 hook", *gifts]
    primary = gifts[0]  # where the worker's time goes is broken down for this one
    built = {n: _build(args, n) for n in names}
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank)).to(args.device)
    comm_ms: dict[str, list[float]] = {n: [] for n in names}
    phases: list[dict[str, float]] = []  # the primary giftcomm row's steps: where its worker's time went
    sent = {n: 0 for n in gifts}
    steps = {n: 0 for n in names}
    torch_bench.install()

    def sent_bytes(state) -> int:
        return sum(state.stats()["bytes_sent"].values())

    def step_of(name: str):
        model, opt, spans, state, _ = built[name]

        def step() -> None:
            spans.clear()
            if name in sent:
                before = sent_bytes(state)
            if name == primary:
                torch_bench.reset()
                worker0 = state.stats().comm_seconds
            model(x).square().mean().backward()  # under DDP: returns once every bucket's future is done
            opt.step()
            opt.zero_grad()
            if args.cuda:
                torch.cuda.synchronize()
            comm_ms[name].append(1e3 * _union(spans))
            if name in sent:
                sent[name] += sent_bytes(state) - before
            if name == primary:
                parts = torch_bench.milliseconds()
                parts["worker"] = 1e3 * (state.stats().comm_seconds - worker0)
                phases.append(parts)
            steps[name] += 1
        return step

    seconds = time_rounds([step_of(n) for n in names], args.rounds, calls=args.steps, warmup=1,
                          barrier=dist.barrier)
    step_ms = {n: 1e3 * s for n, s in zip(names, seconds)}
    buckets = len(built["gloo"][2])
    gift_state, algorithms = built[primary][3], built[primary][4]
    stats = gift_state.stats()  # type: ignore[attr-defined]
    agree_ranks = torch_bench.agreement_per_rank(phases)
    if rank == 0:
        params = sum(p.numel() for p in built["gloo"][0].parameters())
        fp32 = 2 * (world - 1) / world * 4 * params  # a ring allreduce of float32
        per_step = {"compute-only": 0.0, "gloo": fp32, "fp16 hook": fp32 / 2,
                    **{n: sent[n] / max(steps[n], 1) for n in gifts}}
        rows = torch_bench.write_rows(
            args.json, "ddp_step", [{"mode": "ddp", "group": n, "step_ms": step_ms[n], "bytes_per_step": per_step[n]}
                                    for n in names],
            world=world, parameters=params, rounds=args.rounds, steps=args.steps, load=load_average())
        cap = "DDP's default" if args.bucket_mb is None else f"{args.bucket_mb:g}"
        print(f"DDP step, P = {world}, {params / 1e6:.1f}M parameters ({4 * params / 2**20:.0f} MiB fp32 gradients, "
              f"{buckets} buckets, bucket_cap_mb {cap}), {'CUDA/NCCL' if args.cuda else 'CPU/gloo'}; "
              f"medians over {args.rounds} rounds of "
              f"{args.steps} steps; load {load_average()}")
        torch_bench.print_overheads(rows)
        med_comm = {k: statistics.median(comm_ms[k][1:]) for k in names}  # [0]: the warm-up step
        print(f"{'config':<16} {'step ms':>9} {'comm ms/step':>13} {'comm share':>11} {'comm vs fp16':>13} "
              f"{'step vs fp16':>13} {'step vs fp32':>13}")
        for n in names[1:]:
            s, c = step_ms[n], med_comm[n]
            print(f"{n:<16} {s:>9.1f} {c:>13.1f} {c / s:>10.0%} {torch_bench.ratio(med_comm['fp16 hook'], c):>13} "
                  f"{step_ms['fp16 hook'] / s:>12.2f}x {step_ms['gloo'] / s:>12.2f}x")
        print(f"{primary} hook: {stats.host_buckets} host buckets, {torch_bench.ratio(per_step[primary], fp32)} gloo's bytes a step, "
              f"{stats.comm_seconds:.2f} s on its worker in all; algorithm per bucket: "
              + ", ".join(f"{b / 2**20:.0f} MiB {a}" for b, a in sorted(algorithms.items())))
        med = {k: statistics.median(p[k] for p in phases[1:]) for k in phases[0]}
        print(f"{primary} per step (medians, rank 0): worker busy {med['worker']:.1f} ms, of which codec "
              f"{med['codec']:.1f}, waiting on gloo sends/receives {med['wait']:.1f}, posting them {med['post']:.1f}, "
              f"agreement {med['agree']:.1f} (per rank {agree_ranks}), other "
              f"{med['worker'] - med['codec'] - med['wait'] - med['post'] - med['agree']:.1f}")
    for n in gifts:
        built[n][3].shutdown()  # type: ignore[attr-defined]
    for n in names:
        del built[n]  # DDP wrappers let go before the group is destroyed
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
