"""``python -m giftcomm.perf <command> ...``: the perf tools, one subcommand each.

allreduce  nccl-tests-style sweep with fidelity columns (run under mpiexec)
codec      codec throughput, native vs NumPy vs memory copy
netbed     multi-host testbed: shaped links in network namespaces (root)
calibrate  measure the cost model's constants (under mpiexec)
model      validate the cost model against measurements; project to cluster scale
errors     error growth against P for every algorithm
fidelity   GIFT vs Euclidean FP8 on synthetic and real gradients
train      end-to-end data-parallel Llama training comparison (under mpiexec)
plot       busbw-vs-size plots from allreduce --json files
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "allreduce": "giftcomm.perf.collective_bench",
    "codec": "giftcomm.perf.codec_bench",
    "netbed": "giftcomm.perf.netbed",
    "calibrate": "giftcomm.perf.calibrate",
    "model": "giftcomm.perf.model",
    "errors": "giftcomm.perf.errors",
    "fidelity": "giftcomm.perf.fidelity",
    "train": "giftcomm.perf.train",
    "plot": "giftcomm.perf.plot",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
