"""Test-only launcher: torchtitan's own ``torchtitan.train.main`` on the CPU over gloo, for
tests/torchtitan_train_check.py; torchrun runs this file in place of ``-m torchtitan.train`` and
torchtitan's command line follows. Shims for torchtitan 0.3.0 on torch 2.13 CPU, applied before
torchtitan loads (none of them is in the library):

- Triton: ``torchtitan.distributed.minimal_async_ep.kernels`` (Triton kernels every model's
  config registry imports) is a stub module whose kernels raise when called (none is, here).
- device type: torch's ``_get_available_device_type`` answers "cpu", so torchtitan picks
  ``torch.cpu`` as its device module and gloo as its backend.
- metrics: a memory monitor reporting zeros (``torch.cpu`` has no memory statistics).
- attention: FlexAttention has no backward on the CPU; its compiled call is replaced by dense
  SDPA with the block mask expanded (``create_mask``): the same attention, slower.
- barrier / timeouts: ``barrier(device_ids=...)`` drops ``device_ids`` (gloo rejects them) and
  ``set_pg_timeouts`` (after step 1; needs ``torch.distributed.set_timeout``, newer than 2.13)
  does nothing.
- ``TITAN_TEST_GLOO_SUM=1`` (the uncompressed run): FSDP2 reduces with SUM and scales after,
  since gloo has no PREMUL_SUM (torchtitan's divide factor 1.0 makes the two the same sum).

``TITAN_TEST_REPORT`` (a folder): at the trainer's close each rank writes ``rank<R>.json`` with
the logged ``[step, loss, grad_norm]`` rows, the number of giftcomm comms on the model (null
when none) and their ``stats()``.
"""
from __future__ import annotations

import json
import os
import sys
import types

import torch
import torch._utils


def _stub_triton_kernels() -> None:
    name = "torchtitan.distributed.minimal_async_ep.kernels"

    def missing(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        def kernel(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr}: a Triton kernel, stubbed by the CPU test launcher")
        return kernel

    mod = types.ModuleType(name)
    mod.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[name] = mod


def main() -> None:
    _stub_triton_kernels()
    torch._utils._get_available_device_type = lambda: "cpu"
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.models.common.attention import FlexAttention

    def dense_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        if score_mod is not None or return_aux.lse:
            raise NotImplementedError("the CPU test launcher's attention: no score_mod, no lse")
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                               enable_gqa=enable_gqa)
        return out, None

    FlexAttention._compiled_flex_attn = dense_attention
    import torchtitan.components.metrics as metrics

    class CPUMemoryMonitor:
        device_name = "cpu"
        device_capacity_gib = 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics.build_device_memory_monitor = CPUMemoryMonitor
    barrier = torch.distributed.barrier

    def cpu_barrier(*args, device_ids=None, **kwargs):
        return barrier(*args, **kwargs)

    torch.distributed.barrier = cpu_barrier
    if os.environ.get("TITAN_TEST_GLOO_SUM") == "1":
        from torch.distributed.fsdp import FSDPModule

        set_factor = FSDPModule.set_gradient_divide_factor

        def sum_then_scale(self, factor):
            set_factor(self, factor)
            self.set_force_sum_reduction_for_comms(True)

        FSDPModule.set_gradient_divide_factor = sum_then_scale
    import torchtitan.distributed.utils as dist_utils

    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None
    from torchtitan.trainer import Trainer

    losses: list[list[float]] = []
    log = metrics.MetricsProcessor.log

    def record(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        losses.append([step, float(global_avg_loss), float(grad_norm)])
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    metrics.MetricsProcessor.log = record
    close = Trainer.close

    def report(self):
        comms = getattr(self.model_parts[0], "giftcomm_comms", None)
        out = {"losses": losses, "comms": None if comms is None else len(comms),
               "stats": None if comms is None else comms.stats()}
        rank = torch.distributed.get_rank()
        with open(os.path.join(os.environ["TITAN_TEST_REPORT"], f"rank{rank}.json"), "w") as f:
            json.dump(out, f, default=str)
        return close(self)

    Trainer.close = report
    from torchtitan.train import main as titan_main
    titan_main()


if __name__ == "__main__":
    main()
