"""``python -m giftcomm.perf <command> ...`` (or ``giftcomm-perf <command> ...``): the benchmarks
that ship with giftcomm, one subcommand each, like mpi4py.bench.

allreduce  nccl-tests all_reduce_perf-style sweep with fidelity columns (run under mpiexec)
codec      codec kernel throughput: native vs NumPy reference vs a memory copy
calibrate  measure the cost model's constants (run under mpiexec, >= 2 ranks)
device     GPU codec / transform / gift_allreduce vs the copy roofline (one CUDA GPU)
geometry-cost  the GIFT geometry's cost: forward + inverse time per segment, K-FAC sync modes
side-by-side   one measurement on two source trees (old, new) in one run, with same-run baselines

``python -m giftcomm.perf <command> -h`` lists a command's options. The studies (training,
fidelity, error growth, the cost-model validation and projection, the netbed, plots) live in the
source tree's studies/ package: ``python -m studies --help`` from a checkout.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "allreduce": ("giftcomm.perf.collective_bench", "nccl-tests-style allreduce sweep with fidelity columns"),
    "codec": ("giftcomm.perf.codec_bench", "codec kernel throughput"),
    "calibrate": ("giftcomm.perf.calibrate", "measure the cost model's constants"),
    "device": ("giftcomm.perf.device_bench", "GPU codec / transform / gift_allreduce vs the copy roofline (one CUDA GPU)"),
    "geometry-cost": ("giftcomm.perf.geometry_cost", "GIFT geometry cost: transform time per segment, sync modes"),
    "side-by-side": ("giftcomm.perf.side_by_side", "two source trees in one run (allreduce, per-call, auto, ddp)"),
}
# Commands that moved to the studies/ tree of a source checkout (python -m studies <command>).
MOVED = ("netbed", "model", "errors", "fidelity", "train", "plot", "gradients")


def _version() -> str:
    from giftcomm import __version__

    return __version__


def _usage() -> str:
    lines = ["usage: python -m giftcomm.perf [--version] <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", f"moved to studies/ (python -m studies <command>, from a source checkout): {', '.join(MOVED)}"]
    return "\n".join(lines)


def _end_the_job(cmd: str) -> None:
    """An error on one rank of a multi-rank run: print it, naming the rank, and end every rank with
    MPI_Abort (exit code 1), so that the peers, inside a barrier or a measurement, do not wait for
    this rank for ever (and this rank not in MPI_Finalize for them). Single-process runs raise."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() < 2:
        return
    import traceback

    world = mpi.COMM_WORLD
    sys.stderr.write(f"giftcomm.perf {cmd}: rank {world.Get_rank()} of {world.Get_size()} failed; ending the "
                     f"job (MPI_Abort):\n{traceback.format_exc()}")
    sys.stderr.flush()
    world.Abort(1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "--version":
        print(f"giftcomm {_version()}")
        return 0
    if cmd in COMMANDS:
        module = importlib.import_module(COMMANDS[cmd][0])
        try:
            return int(module.main(rest) or 0)
        except Exception:
            _end_the_job(cmd)
            raise
    if cmd in MOVED:
        print(f"giftcomm.perf: the '{cmd}' command moved out of the installed package into the source "
              f"tree's studies/ package; from a checkout run:\n    python -m studies {cmd} "
              + " ".join(rest) + "\n(its extra dependencies: pip install -e '.[studies]')", file=sys.stderr)
        return 2
    print(f"giftcomm.perf: unknown command '{cmd}'\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
