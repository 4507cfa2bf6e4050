"""Test-only launcher: torchtitan's own ``torchtitan.train.main`` on the CPU over gloo, for
tests/test_torchtitan_train.py. torchrun runs this file in place of ``-m torchtitan.train``:

    torchrun --standalone --nproc_per_node 2 tests/_torchtitan_cpu.py FLAGS [--next FLAGS ...]

Each FLAGS is one torchtitan command line (``--module ... --config ...``); the runs go one after
another in the same processes and process group (torchtitan skips its own init when the group
exists; its teardown is held back to the end), which saves a launch and its imports per run.
Before torchtitan loads, perf/torchtitan_cpu.py's CPU shims are installed (none of them is in
the library), and at each run's training start the FSDP modules of a model without giftcomm's
comms reduce with SUM then scale (gloo has no PREMUL_SUM: ``gloo_sum_unless_giftcomm``).

``TITAN_TEST_REPORT`` (a folder): at each run's close every rank writes ``run<I>-rank<R>.json``
(I from 0) with the logged ``[step, loss, grad_norm]`` rows, the number of giftcomm comms on the
model (null when none) and their ``stats()``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
import torchtitan_cpu  # noqa: E402  (perf/torchtitan_cpu.py)


def main() -> None:
    argv, runs = sys.argv[1:], [[]]
    for arg in argv:
        if arg == "--next":
            runs.append([])
        else:
            runs[-1].append(arg)
    torchtitan_cpu.install()
    import torchtitan.components.metrics as metrics
    from torchtitan.train import main as titan_main
    from torchtitan.trainer import Trainer

    losses: list[list[float]] = []
    log, train, close = metrics.MetricsProcessor.log, Trainer.train, Trainer.close
    current = {"run": 0}

    def record(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        losses.append([step, float(global_avg_loss), float(grad_norm)])
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    def train_gloo(self):
        torchtitan_cpu.gloo_sum_unless_giftcomm(self.model_parts)
        return train(self)

    def report(self):
        out = {"losses": losses, **torchtitan_cpu.report(self)}
        with open(os.path.join(os.environ["TITAN_TEST_REPORT"], f"run{current['run']}-rank{dist.get_rank()}.json"), "w") as f:
            json.dump(out, f, default=str)
        return close(self)

    metrics.MetricsProcessor.log = record  # type: ignore[method-assign]
    Trainer.train = train_gloo  # type: ignore[method-assign]
    Trainer.close = report  # type: ignore[method-assign]
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None  # type: ignore[assignment]
    for i, flags in enumerate(runs):
        current["run"] = i
        losses.clear()
        sys.argv = [sys.argv[0], *flags]
        titan_main()
    dist.barrier()
    destroy()


if __name__ == "__main__":
    main()
