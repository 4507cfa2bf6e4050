"""torchtitan's training step with giftcomm's FSDP2 reduce-scatter (giftcomm.recipes.torchtitan)
against torchtitan's stock FSDP2 (gloo, float32) and a compute-only step, side by side.

    torchrun --nproc_per_node 2 perf/torchtitan_step.py [--config llama3_debugmodel] [--seq-len 256] \\
        [--batch 2] [--steps 3] [--rounds 3] [--json OUT]
    # under mpiexec on the netbed (docs/netbed.md): ranks from MPI, rendezvous through a shared file
    perf/netbed run --hosts 2 --rate 1gbit -- env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \\
        python perf/torchtitan_step.py --rendezvous /tmp/torchtitan-step.rdzv

torchtitan 0.3.0 builds two trainers in the same processes, from its own configs: ``--module llama3
--config CONFIG`` (stock) and ``--module giftcomm.recipes.torchtitan --config CONFIG`` with
``GIFTCOMM_FMT=--fmt`` (the recipe: torchtitan's parallelisation, then giftcomm's reduce-scatter on
every FSDP2 module). Both train torchtitan's model of ``CONFIG`` (default its Llama-3 debug model:
6 layers, dim 256, vocabulary 2048, 6.2M parameters, 23.5 MiB of float32 gradients; 9 FSDP2 units:
the embeddings, the 6 blocks, the final norm with the output layer, the root) at dp_shard = P on
the CPU over gloo, from the same seed and data (perf/torchtitan_cpu.py's tokenizer and text set,
its CPU shims; none in the library). A step is torchtitan's own ``Trainer.train_step``: forward,
backward with FSDP2's reduce-scatter of the gradients, gradient clipping, AdamW and the loss
logging; FSDP2's parameter all-gathers are gloo's float32 in both. A third trainer, "compute-only",
is the stock one with a reduce-scatter that communicates nothing (perf/torch_bench.py's
LocalReduceScatter): the same step without gradient communication. The configurations are timed
in turns (giftcomm.perf.timing.time_rounds: ``--steps`` steps a round after a barrier, one warm-up
step each).

Rank 0 prints the median step time per configuration, its communication overhead (step minus
the compute-only step) and that against stock's, giftcomm's step ratio against stock, and
the bytes a step's gradient reduce-scatters sent from a rank: giftcomm's from its comms'
``stats()`` (every call, the few small ones it sends uncompressed included), stock's as a ring
moves float32, ``(P-1)/P n 4`` for n parameters.

Where numbers are results: on a quiet machine or the netbed (docs/netbed.md); the ratios are
from one interleaved run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch_bench  # perf/torch_bench.py (this script's directory is on sys.path)
import torchtitan_cpu  # perf/torchtitan_cpu.py

from giftcomm.perf.timing import load_average, time_rounds

CONFIGS = ["compute-only", "torchtitan stock", "giftcomm"]


def _communicate_nothing(model_parts) -> None:
    """Every FSDP2 module of the parts reduce-scatters nothing (perf/torch_bench.py's
    LocalReduceScatter): the compute-only step."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for m in part.modules():
            if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_groups:
                m.set_custom_reduce_scatter(torch_bench.LocalReduceScatter())


def _bytes_sent(comms) -> int:
    return sum(comms.stats()["bytes_sent"].values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3_debugmodel", help="a torchtitan config function (its llama3 models)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2, help="torchtitan's local batch size")
    ap.add_argument("--fmt", default="e4m3", help="giftcomm's wire format (GIFTCOMM_FMT)")
    torch_bench.step_arguments(ap, steps=3, rounds=3)
    ap.add_argument("--json", metavar="OUT", default=None,
                    help="write the rows (mode, group, step_ms, bytes_per_step, overhead_ms) as JSON")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    work = Path(tempfile.mkdtemp(prefix="torchtitan-step-"))  # this rank's assets and caches
    os.environ["HF_DATASETS_CACHE"] = str(work / "hf-datasets")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        _run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> None:
    torchtitan_cpu.install()
    import torch.distributed as dist
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    import logging

    logging.getLogger().setLevel(logging.WARNING)  # torchtitan logs every step at INFO
    torch_bench.init_process_group(args.rendezvous, "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit("perf/torchtitan_step.py: needs P >= 2 ranks (FSDP2 shards over dp_shard = P)")
    for var, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", 0)):
        os.environ.setdefault(var, str(value))  # torchtitan reads them (mpiexec sets none)
    tok, data = torchtitan_cpu.write_assets(work)
    common = ["--config", args.config, "--training.steps", "100000", "--training.seq_len", str(args.seq_len),
              "--training.local_batch_size", str(args.batch),
              *torchtitan_cpu.flags(tok, data, work / "dump", dp_shard=world)]
    os.environ["GIFTCOMM_FMT"] = args.fmt
    modules = {"compute-only": "llama3", "torchtitan stock": "llama3", "giftcomm": "giftcomm.recipes.torchtitan"}
    trainers = {}
    for name in CONFIGS:
        config = ConfigManager().parse_args(["--module", modules[name], *common])
        trainers[name] = config.build()
        torchtitan_cpu.gloo_sum_unless_giftcomm(trainers[name].model_parts)
    _communicate_nothing(trainers["compute-only"].model_parts)
    comms = trainers["giftcomm"].model_parts[0].giftcomm_comms
    steps = {n: 0 for n in CONFIGS}
    gift_bytes = 0

    def step_of(name):
        trainer = trainers[name]
        batches = trainer.batch_generator(trainer.dataloader)

        def step() -> None:
            nonlocal gift_bytes
            before = _bytes_sent(comms)
            trainer.step += 1
            trainer.train_step(batches)
            if name == "giftcomm":
                gift_bytes += _bytes_sent(comms) - before
            steps[name] += 1
        return step

    seconds = time_rounds([step_of(n) for n in CONFIGS], args.rounds, calls=args.steps, warmup=1, barrier=dist.barrier)
    step_ms = {n: 1e3 * s for n, s in zip(CONFIGS, seconds)}
    model = trainers["giftcomm"].model_parts[0]
    n = sum(p.numel() for p in model.parameters())
    if rank == 0:
        stats = comms.stats()
        fp32 = 4 * n * (world - 1) / world  # a ring reduce-scatter of float32
        groups = {"compute-only": "compute-only", "torchtitan stock": "gloo", "giftcomm": f"giftcomm {args.fmt}"}
        per_step = {"compute-only": 0.0, "torchtitan stock": fp32, "giftcomm": gift_bytes / max(steps["giftcomm"], 1)}
        rows = torch_bench.write_rows(
            args.json, "torchtitan_step",
            [{"mode": "fsdp2", "group": groups[c], "step_ms": step_ms[c], "bytes_per_step": per_step[c]} for c in CONFIGS],
            world=world, parameters=n, config=args.config, rounds=args.rounds, steps=args.steps, load=load_average())
        print(f"torchtitan {args.config} training step (torchtitan 0.3.0 Trainer.train_step), P = {world}, "
              f"{n / 1e6:.1f}M parameters ({4 * n / 2**20:.1f} MiB fp32 gradients, {len(comms)} FSDP2 units), "
              f"seq_len {args.seq_len}, local batch {args.batch}, CPU/gloo; medians over {args.rounds} rounds of "
              f"{args.steps} steps; load {load_average()}")
        print(f"giftcomm: --module giftcomm.recipes.torchtitan, GIFTCOMM_FMT={args.fmt}; algorithms {stats['algorithms']}")
        torch_bench.print_overheads(rows)
        print(f"{'configuration':<17} {'step ms':>9} {'vs stock':>9} {'MB sent/step':>13} {'bytes vs stock':>15}")
        for name in CONFIGS[1:]:
            s = step_ms[name]
            print(f"{name:<17} {s:>9.1f} {step_ms['torchtitan stock'] / s:>8.2f}x {per_step[name] / 1e6:>13.2f} "
                  f"{per_step[name] / fp32:>14.3f}x")
    for trainer in trainers.values():
        trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
