"""DDP step time with giftcomm's e4m3 hook against torch's default allreduce and fp16_compress_hook, side by side.

    torchrun --nproc_per_node 4 perf/ddp_step.py [--width 2048] [--layers 4] [--steps 5] [--rounds 5]
    # under mpiexec (e.g. the netbed, docs/netbed.md): ranks from MPI, rendezvous through a shared file
    perf/netbed run --hosts 4 --rate 1gbit -- env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
        python perf/ddp_step.py --rendezvous /tmp/ddp-step.rdzv [--bucket-mb 64]

The model is perf/torch_bench.py's stack of ``--layers`` bias-free nn.Linear(width, width) (width
2048 and 4 layers: 16.8M parameters, 64 MiB of float32 gradients), wrapped in
DistributedDataParallel on CPU with gloo, ``bucket_cap_mb=--bucket-mb`` (default: DDP's own, 25 MiB
with a first bucket of 1 MiB: buckets of 16, 32 and 16 MiB for that model; an explicit cap drops
the first-bucket rule, so 25 makes buckets of 32 and 32 MiB and 64 one bucket). Three configurations train
the same model on the same data, interleaved round by round so that load drift hits all three
alike:

- ``gloo fp32``: DDP's default hook (``dist.all_reduce`` of the float32 bucket);
- ``fp16 hook``: torch's ``default_hooks.fp16_compress_hook`` (the bucket cast to float16, gloo's
  allreduce of 2 bytes per value, cast back);
- ``giftcomm e4m3``: ``GiftState(fmt="e4m3")`` with ``gift_hook`` (1.0156 bytes per value).

Steps are timed with giftcomm.perf.timing.time_rounds (the configurations in turns, ``--steps``
back-to-back steps a round after a barrier, one warm-up step each). Every hook call is timed
too: from the hook's call until its future completes (decompression included); the
communication time of a step is the union of those intervals (time during which at least one
bucket is in flight, overlapped with backward or not). Rank 0 prints, per configuration, the
median over rounds of the step time, the median communication time per step, its share of the
step, and the ratios against the fp16 hook and DDP's default; then giftcomm's algorithm per
bucket size and where its worker's time went per step (perf/torch_bench.py: codec, waits on
the gloo sends and receives, posting them, the agreement, the rest).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch_bench  # perf/torch_bench.py (this script's directory is on sys.path)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from giftcomm.perf.timing import time_rounds

NAMES = ["gloo fp32", "fp16 hook", "giftcomm e4m3"]


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
    from giftcomm.adapters.torch import GiftState, gift_hook

    model = torch_bench.linear_stack(args.width, args.layers)
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_mb)
    state: object = None
    if name == "gloo fp32":
        hook, state = default_hooks.allreduce_hook, dist.group.WORLD  # DDP's default, as a hook
    elif name == "fp16 hook":
        hook, state = default_hooks.fp16_compress_hook, dist.group.WORLD
    else:
        hook, state = gift_hook, GiftState(fmt="e4m3")
    spans: list[tuple[float, float]] = []
    algorithms: dict[int, str] | None = {} if name == "giftcomm e4m3" else None
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
    args = ap.parse_args()
    torch_bench.init_process_group(args.rendezvous, "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    built = {n: _build(args, n) for n in NAMES}
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    comm_ms: dict[str, list[float]] = {n: [] for n in NAMES}
    phases: list[dict[str, float]] = []  # giftcomm e4m3's steps: where its worker's time went
    torch_bench.install()

    def step_of(name: str):
        ddp, opt, spans, state, _ = built[name]
        gift = name == "giftcomm e4m3"

        def step() -> None:
            spans.clear()
            if gift:
                torch_bench.reset()
                worker0 = state.stats().comm_seconds
            ddp(x).square().mean().backward()  # returns once every bucket's future is done
            opt.step()
            opt.zero_grad()
            comm_ms[name].append(1e3 * _union(spans))
            if gift:
                parts = torch_bench.milliseconds()
                parts["worker"] = 1e3 * (state.stats().comm_seconds - worker0)
                phases.append(parts)
        return step

    seconds = time_rounds([step_of(n) for n in NAMES], args.rounds, calls=args.steps, warmup=1,
                          barrier=dist.barrier)
    step_ms = {n: 1e3 * s for n, s in zip(NAMES, seconds)}
    buckets = len(built[NAMES[0]][2])
    gift_state, algorithms = built["giftcomm e4m3"][3], built["giftcomm e4m3"][4]
    stats = gift_state.stats()  # type: ignore[attr-defined]
    agree_ranks = torch_bench.agreement_per_rank(phases)
    if rank == 0:
        params = sum(p.numel() for p in built[NAMES[0]][0].parameters())
        cap = "DDP's default" if args.bucket_mb is None else f"{args.bucket_mb:g}"
        print(f"DDP step, P = {world}, {params / 1e6:.1f}M parameters ({4 * params / 2**20:.0f} MiB fp32 gradients, "
              f"{buckets} buckets, bucket_cap_mb {cap}), CPU/gloo; medians over {args.rounds} rounds of "
              f"{args.steps} steps")
        med_comm = {k: statistics.median(comm_ms[k][1:]) for k in NAMES}  # [0]: the warm-up step
        print(f"{'config':<15} {'step ms':>9} {'comm ms/step':>13} {'comm share':>11} {'comm vs fp16':>13} "
              f"{'step vs fp16':>13} {'step vs fp32':>13}")
        for n in NAMES:
            s, c = step_ms[n], med_comm[n]
            print(f"{n:<15} {s:>9.1f} {c:>13.1f} {c / s:>10.0%} {torch_bench.ratio(med_comm['fp16 hook'], c):>13} "
                  f"{step_ms['fp16 hook'] / s:>12.2f}x {step_ms['gloo fp32'] / s:>12.2f}x")
        print(f"giftcomm hook: {stats.host_buckets} host buckets, {sum(stats.bytes_sent.values()) / max(stats.bytes_in, 1):.4f} "
              f"bytes sent per input byte, {stats.comm_seconds:.2f} s on its worker in all; algorithm per bucket: "
              + ", ".join(f"{b / 2**20:.0f} MiB {a}" for b, a in sorted(algorithms.items())))
        med = {k: statistics.median(p[k] for p in phases[1:]) for k in phases[0]}
        print(f"giftcomm e4m3 per step (medians, rank 0): worker busy {med['worker']:.1f} ms, of which codec "
              f"{med['codec']:.1f}, waiting on gloo sends/receives {med['wait']:.1f}, posting them {med['post']:.1f}, "
              f"agreement {med['agree']:.1f} (per rank {agree_ranks}), other "
              f"{med['worker'] - med['codec'] - med['wait'] - med['post'] - med['agree']:.1f}")
    gift_state.shutdown()  # type: ignore[attr-defined]
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
