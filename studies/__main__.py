"""``python -m studies <command> ...``: the studies about giftcomm (from a source checkout).

train         end-to-end data-parallel Llama training comparison (under mpiexec; torch)
train-compare the training comparison that decides the defaults (torch)
time-to-quality  seconds and steps to a target validation loss of runs on the netbed
fidelity      GIFT vs Euclidean FP8 on synthetic and real gradients
peers         quality per bit: every wire row against the peers' reduction semantics (real gradients)
gradients     capture real gradients and KFAC factors for ``fidelity real`` (torch)
pretrained-gradients  the same capture from all-MiniLM-L6-v2 continued on the corpus (transformers)
paper-tables  the GIFT paper's Tables I and II on a capture
paper-gain    where the paper's input-side gain comes from: predictors, tokens per gradient
sharded-gift  what aligning GIFT with FSDP's dim-0 shards costs (P = 2, 4, 8)
errors        allreduce error growth against P for every algorithm
mx-scale      error and bias of the MX scale rules (ceil vs OCP floor)
policy-budget the selective policy's time budget swept: whitened error recovered vs transform cost
model         validate the cost model against measurements; project to cluster scale
netbed        multi-host testbed: rate-shaped links in network namespaces (root)
plot          busbw-vs-size plots from ``giftcomm.perf allreduce --json`` files
device-check  the one-shot GPU check (perf/device_check.sh runs it)

The benchmarks a user runs stay in the package: ``python -m giftcomm.perf allreduce | codec |
calibrate``. ``python -m studies <command> -h`` lists a command's options.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": "studies.train",
    "train-compare": "studies.train_compare",
    "time-to-quality": "studies.time_to_quality",
    "fidelity": "studies.fidelity",
    "peers": "studies.peers",
    "gradients": "studies.gradients",
    "pretrained-gradients": "studies.pretrained_gradients",
    "paper-tables": "studies.paper_tables",
    "paper-gain": "studies.paper_gain",
    "sharded-gift": "studies.sharded_gift",
    "errors": "studies.errors",
    "mx-scale": "studies.mx_scale",
    "policy-budget": "studies.policy_budget",
    "model": "studies.model",
    "netbed": "studies.netbed",
    "plot": "studies.plot",
    "device-check": "studies.device.check",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print((__doc__ or "").strip())
        return 0
    if argv[0] == "--version":
        from giftcomm import __version__

        print(f"giftcomm {__version__} (studies)")
        return 0
    if argv[0] not in COMMANDS:
        print(f"studies: unknown command '{argv[0]}'\n\n{(__doc__ or '').strip()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
