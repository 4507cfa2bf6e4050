"""FSDP2 step time with giftcomm e4m3 against FSDP2's own fp32 and bf16 reduce-scatter, side by side.

    torchrun --nproc_per_node 4 perf/fsdp_step.py [--width 2048] [--layers 4] [--steps 10] [--rounds 3] \
        [--fmts e4m3,nvfp4] [--json OUT]
    # across hosts: torchrun --nnodes 4 --nproc_per_node 1 --rdzv_endpoint HOST:PORT perf/fsdp_step.py
    # under mpiexec (e.g. the netbed, docs/netbed.md): ranks from MPI, rendezvous through a shared file
    perf/netbed run --hosts 4 --rate 1gbit -- env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
        python perf/fsdp_step.py --rendezvous /tmp/fsdp-step.rdzv

perf/torch_bench.py's stack of ``--layers`` bias-free nn.Linear(width, width) (width 2048 and 4
layers: 16.8M parameters, 64 MiB of float32 gradients), each layer a ``fully_shard`` unit, on CPU with
gloo (CUDA with NCCL when ``--cuda``). The configurations train the same model on the same data,
interleaved round by round so that load drift hits all of them alike:

- ``compute-only``: the same FSDP2 model and step with a reduce-scatter that communicates nothing
  (each rank keeps its own rows: perf/torch_bench.py's LocalReduceScatter); the parameter
  all-gathers still run;
- ``fsdp fp32``: FSDP2's own reduce-scatter, reduce dtype float32;
- ``fsdp bf16``: FSDP2's own reduce-scatter, ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``;
- ``giftcomm FMT`` for each of ``--fmts`` (default e4m3): ``register_reduce_scatter(model, fmt=FMT)``,
  reduce dtype float32.

Steps are timed with giftcomm.perf.timing.time_rounds (the configurations in turns, ``--steps``
back-to-back steps a round after a barrier, one warm-up step each); every reduce-scatter call is
timed too (wall clock around the comm, which FSDP2 calls synchronously on CPU; on CUDA the timer
synchronises the stream first and after). Rank 0 prints, per configuration, the median over
rounds of the step time and the median reduce-scatter time per step, the reduce-scatter's share
of the step, and the ratios against FSDP's fp32 and bf16; then giftcomm's algorithm per unit and
where its reduce-scatter time went per step (perf/torch_bench.py: codec, waits on the gloo sends
and receives, posting them, the agreement, the rest). Bytes per value on the wire: fp32 4,
bf16 2, e4m3 1.0156 (docs/wire-format.md). Numbers from a loaded machine are not results: run
it on a quiet one or the netbed (docs/netbed.md). ``--json OUT`` writes one row per configuration
(group "gloo" is FSDP2's own fp32 reduce-scatter) with its communication overhead, step minus the
compute-only step (perf/torch_bench.py's write_rows).
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch_bench  # perf/torch_bench.py (this script's directory is on sys.path)

from giftcomm.perf.timing import load_average, time_rounds, wall_clock


def _sent(comm) -> int:
    """Bytes a giftcomm reduce-scatter comm sent so far (its ``stats()``), 0 for another comm."""
    return sum(comm.stats()["bytes_sent"].values()) if hasattr(comm, "stats") else 0


class _Timed:
    """A reduce-scatter comm (FSDP's own call, or a GiftReduceScatter) that adds its wall time to
    ``seconds``."""

    def __init__(self, inner, cuda: bool) -> None:
        self.inner, self.cuda, self.seconds = inner, cuda, 0.0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        def run() -> None:
            if self.inner is None:
                dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            else:
                self.inner(output_tensor, input_tensor, group, op)
            if self.cuda:
                torch.cuda.current_stream().synchronize()

        if self.cuda:
            torch.cuda.current_stream().synchronize()
        self.seconds += wall_clock(run)[0]


def _build(args, name: str, device: torch.device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from giftcomm.adapters.torch import register_reduce_scatter
    from giftcomm.adapters.torch.fsdp import fsdp_modules

    model = torch_bench.linear_stack(args.width, args.layers).to(device)
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if name == "fsdp bf16" else torch.float32)
    for layer in model[::2]:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    units = [m for m in fsdp_modules(model) if m._get_fsdp_state()._fsdp_param_groups]
    if name.startswith("giftcomm"):
        comms: list = register_reduce_scatter(model, fmt=name.removeprefix("giftcomm "))
    elif name == "compute-only":  # no gradient communication: each rank keeps its own shard's rows
        comms = [torch_bench.LocalReduceScatter() for _ in units]
    else:
        comms = [None for _ in units]
    timers = []
    for i, module in enumerate(units):
        timer = _Timed(comms[i], device.type == "cuda")
        module.set_custom_reduce_scatter(timer)
        timers.append(timer)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), timers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cuda", action="store_true")
    torch_bench.step_arguments(ap, steps=10, rounds=3)
    torch_bench.output_arguments(ap)
    args = ap.parse_args()
    cuda = args.cuda
    torch_bench.init_process_group(args.rendezvous, "nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    gifts = [f"giftcomm {f}" for f in args.fmts.split(",") if f]
    names = ["compute-only", "fsdp fp32", "fsdp bf16", *gifts]
    primary = gifts[0]  # where the reduce-scatters' time goes is broken down for this one
    built = {n: _build(args, n, device) for n in names}
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank)).to(device)
    rs_ms: dict[str, list[float]] = {n: [] for n in names}
    phases: list[dict[str, float]] = []  # the primary giftcomm row's steps: where its reduce-scatters' time went
    sent = {n: 0 for n in gifts}
    steps = {n: 0 for n in names}
    torch_bench.install()

    def step_of(name: str):
        model, opt, timers = built[name]

        def step() -> None:
            for t in timers:
                t.seconds = 0.0
            before = sum(_sent(t.inner) for t in timers) if name in sent else 0
            torch_bench.reset()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            rs_ms[name].append(1e3 * sum(t.seconds for t in timers))
            if name in sent:
                sent[name] += sum(_sent(t.inner) for t in timers) - before
            if name == primary:
                phases.append(torch_bench.milliseconds())
            steps[name] += 1
        return step

    seconds = time_rounds([step_of(n) for n in names], args.rounds, calls=args.steps, warmup=1, barrier=dist.barrier)
    step_ms = {n: 1e3 * s for n, s in zip(names, seconds)}
    agree_ranks = torch_bench.agreement_per_rank(phases)
    if rank == 0:
        params = sum(p.numel() for p in built[names[0]][0].parameters())
        fp32 = (world - 1) / world * 4 * params  # a ring reduce-scatter of float32
        per_step = {"compute-only": 0.0, "fsdp fp32": fp32, "fsdp bf16": fp32 / 2,
                    **{n: sent[n] / max(steps[n], 1) for n in gifts}}
        rows = torch_bench.write_rows(
            args.json, "fsdp_step",
            [{"mode": "fsdp2", "group": "gloo" if n == "fsdp fp32" else n, "step_ms": step_ms[n],
              "bytes_per_step": per_step[n]} for n in names],
            world=world, parameters=params, rounds=args.rounds, steps=args.steps, load=load_average(),
            device="cuda" if cuda else "cpu")
        torch_bench.print_overheads(rows)
        print(f"FSDP2 step, P = {world}, {params / 1e6:.1f}M parameters ({4 * params / 2**20:.0f} MiB fp32 gradients), "
              f"{'CUDA/NCCL' if cuda else 'CPU/gloo'}; medians over {args.rounds} rounds of {args.steps} steps")
        base = {k: statistics.median(rs_ms[k][1:]) for k in names}  # [0]: the warm-up step
        print(f"{'config':<15} {'step ms':>9} {'RS ms/step':>11} {'RS share':>9} {'RS vs fp32':>11} {'RS vs bf16':>11} "
              f"{'step vs fp32':>13}")
        step_fp32 = step_ms["fsdp fp32"]
        for n in names[1:]:
            s, r = step_ms[n], base[n]
            print(f"{n:<15} {s:>9.1f} {r:>11.1f} {r / s:>8.0%} {torch_bench.ratio(base['fsdp fp32'], r):>11} "
                  f"{torch_bench.ratio(base['fsdp bf16'], r):>11} {step_fp32 / s:>12.2f}x")
        comms = [t.inner for t in built[primary][2]]
        print(f"{primary} reduce-scatter algorithm per FSDP unit (last call): "
              + ", ".join(str(c.algorithm_used) for c in comms))
        med = {k: statistics.median(p[k] for p in phases[1:]) for k in phases[0]}
        r = base[primary]
        print(f"{primary} reduce-scatter per step (medians, rank 0): {r:.1f} ms, of which codec {med['codec']:.1f}, "
              f"waiting on gloo sends/receives {med['wait']:.1f}, posting them {med['post']:.1f}, agreement "
              f"{med['agree']:.1f} (per rank {agree_ranks}), other {r - sum(med.values()):.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
