"""The one CUDA stream helper of the torch adapters: giftcomm's CuPy kernels (and NCCL) on a torch
stream of the buffer's device, so they run in order with the model's work."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["on_stream"]


@contextlib.contextmanager
def on_stream(t: torch.Tensor, side_streams: dict[int, Any] | None = None) -> Iterator[Any]:
    """For a CUDA tensor ``t``: CuPy on a stream of ``t``'s device, yielded. Without
    ``side_streams``, torch's current stream (FSDP's reduce-scatter stream in its call, the
    caller's stream for GradSync and the giftcomm process group). With ``side_streams`` (a dict
    {device index: torch.cuda.Stream} the caller keeps, filled here), that device's side stream,
    which first waits for the current one and is made current for torch too (the DDP hook's
    device route). For a CPU tensor nothing changes and None is yielded."""
    if t.device.type != "cuda":
        yield None
        return
    import cupy

    dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_stream(dev)
    if side_streams is None:
        with cupy.cuda.Device(dev), cupy.cuda.ExternalStream(current.cuda_stream, dev):
            yield current
        return
    side = side_streams.get(dev)
    if side is None:
        side = side_streams[dev] = torch.cuda.Stream(device=dev)
    side.wait_stream(current)
    with torch.cuda.device(dev), torch.cuda.stream(side), cupy.cuda.Device(dev), \
            cupy.cuda.ExternalStream(side.cuda_stream, dev):
        yield side
