"""A completed torch.distributed ``Work``: what the torch adapters' collectives return once
giftcomm's call has run. The one place that reaches torch's private
``_create_work_from_future`` (torch's type stubs do not declare it)."""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["completed_work"]


def completed_work(tensors: list[torch.Tensor]) -> dist.Work:
    """A ``Work`` that has finished, whose ``wait()`` returns True and whose future holds
    ``tensors`` (the collective's outputs)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensors)
    return torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]
