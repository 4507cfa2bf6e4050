"""DDP communication hook: giftcomm's FP8 allreduce (optionally GIFT) for DistributedDataParallel.

::

    state = GiftState(fmt="e4m3", start_gift_iter=10)        # collective: call on every rank
    ddp.register_comm_hook(state, gift_hook)

What ``gift_hook(state, bucket)`` does, per gradient bucket:

1. While ``state.iter < start_gift_iter``: plain ``dist.all_reduce`` of the bucket divided by the
   world size (DDP's default hook), returned as its own future.
2. Otherwise: hand the bucket to the state's single worker thread and return a fresh
   ``torch.futures.Future`` at once; the hook never waits.
3. The worker (one thread, so buckets are reduced in the order DDP launched them, the same on
   every rank) reads the bucket as a NumPy view (a host copy for GPU buckets), runs
   ``giftcomm.gift_allreduce(op="avg")`` over a ``TorchDistTransport`` (a private gloo group on
   the same ranks), writes the result back into the bucket and completes the future with it
   (or with the exception, which DDP re-raises in ``backward``).
4. With ``geometry="reduced"`` the worker also feeds the reduced bucket to a
   ``GradientFactorEstimator`` every ``estimate_every`` iterations and rebuilds the bucket's
   geometry with the selective policy every ``refresh_every`` iterations. The reduced bucket
   is identical on every rank, so every rank builds the same geometry without communicating.
5. After the last bucket of an iteration, ``state.iter`` advances.
"""
# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run time.
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ... import api
from ...formats import DEFAULT_BLOCK
from ...geometry import GradientFactorEstimator, Layout, SelectivePolicy

__all__ = ["GiftState", "gift_hook"]

_GEOMETRIES = ("none", "reduced")


class _Runtime:
    """Internal buffers of a GiftState: the transport, the worker thread, per-bucket estimators
    and geometries. Not part of the user's settings."""

    def __init__(self, group) -> None:
        from ...transport.torch_dist import TorchDistTransport

        self.transport = TorchDistTransport(group)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="giftcomm-ddp")
        self.layouts: dict[int, Layout] = {}
        self.estimators: dict[int, GradientFactorEstimator] = {}
        self.geometries: dict[int, Any] = {}


class GiftState:
    """Settings of the giftcomm DDP hook (plus, apart, its internal runtime).

    process_group: the DDP process group (None: the default group). fmt, block: wire format and
    values per scale (as ``giftcomm.allreduce``). start_gift_iter: iterations of plain
    ``dist.all_reduce`` before switching to giftcomm (warm-up). geometry: "none" (FP8 in plain
    coordinates) or "reduced" (GIFT with factors estimated from the reduced gradients).
    estimate_every / refresh_every: iterations between estimator updates / geometry rebuilds.
    policy, damping: the selective policy and damping of the geometry. param_names: optional
    {parameter: name} used to name layout segments. Building a GiftState is collective over
    the group (it creates the private gloo group of the transport).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, fmt: str = "e4m3",
                 block: int = DEFAULT_BLOCK, start_gift_iter: int = 0, geometry: str = "none",
                 estimate_every: int = 1, refresh_every: int = 100, policy: SelectivePolicy | None = None,
                 damping: float = 1e-3, param_names: dict | None = None) -> None:
        if geometry not in _GEOMETRIES:
            raise ValueError(f"geometry must be one of {_GEOMETRIES}, got {geometry!r}")
        if start_gift_iter < 0 or estimate_every < 1 or refresh_every < 1:
            raise ValueError("start_gift_iter must be >= 0, estimate_every and refresh_every >= 1")
        # the user's settings
        self.process_group = process_group
        self.fmt, self.block = fmt, int(block)
        self.start_gift_iter = int(start_gift_iter)
        self.geometry = geometry
        self.estimate_every, self.refresh_every = int(estimate_every), int(refresh_every)
        self.policy, self.damping = policy or SelectivePolicy(), float(damping)
        self.param_names = {id(p): n for p, n in (param_names or {}).items()}
        # progress and internal buffers
        self.iter = 0
        self.runtime = _Runtime(process_group)

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Advance the iteration counter after the last bucket of a backward pass."""
        if bucket.is_last():
            self.iter += 1

    def geometry_of(self, index: int):
        """The geometry currently used for bucket ``index`` (None: plain coordinates)."""
        return self.runtime.geometries.get(index)

    def shutdown(self) -> None:
        """Stop the worker thread (after the last backward)."""
        self.runtime.executor.shutdown(wait=True)


def _bucket_layout(state: GiftState, bucket: dist.GradBucket, numel: int) -> Layout | None:
    """Segments of the bucket (one per parameter, in buffer order), or None if the gradients
    are not packed back to back from the start of the buffer."""
    params, grads = bucket.parameters(), bucket.gradients()
    base, item = bucket.buffer().data_ptr(), bucket.buffer().element_size()
    entries, expect = [], 0
    for i, (p, g) in enumerate(zip(params, grads)):
        if (g.data_ptr() - base) // item != expect:
            return None
        entries.append((state.param_names.get(id(p), f"bucket{bucket.index()}.p{i}"), tuple(p.shape)))
        expect += p.numel()
    return Layout(entries) if expect == numel else None


def _reduce(state: GiftState, index: int, it: int, buf: torch.Tensor, event, layout, fut: torch.futures.Future) -> None:
    """Worker-thread body: reduce one bucket in place and complete ``fut``."""
    try:
        rt = state.runtime
        if event is not None:
            event.synchronize()  # the gradients are ready on the GPU
        host = buf if buf.device.type == "cpu" else buf.to("cpu")
        arr = host.detach().numpy()
        geo = rt.geometries.get(index) if state.geometry == "reduced" else None
        if geo is not None and geo.size != arr.size:
            geo = None
        api.gift_allreduce(arr, geo, comm=rt.transport, op="avg", fmt=state.fmt, block=state.block, out=arr)
        if state.geometry == "reduced" and layout is not None:
            _update_geometry(state, index, it, arr, layout)
        if host is not buf:
            buf.copy_(host)
        fut.set_result(buf)
    except BaseException as exc:  # DDP re-raises it from backward / the next wait
        fut.set_exception(exc)


def _update_geometry(state: GiftState, index: int, it: int, reduced: np.ndarray, layout: Layout) -> None:
    rt = state.runtime
    if rt.layouts.get(index) != layout:  # new or rebuilt bucket (DDP rebuilds after iteration 0)
        rt.layouts[index] = layout
        rt.estimators[index] = GradientFactorEstimator(layout)
        rt.geometries.pop(index, None)
    est = rt.estimators[index]
    if it % state.estimate_every == 0:
        est.update(reduced)
    if est.count > 0 and (it + 1) % state.refresh_every == 0:
        rt.geometries[index] = est.geometry(policy=state.policy, damping=state.damping)


def gift_hook(state: GiftState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: returns a Future of the averaged bucket (see module doc)."""
    buf = bucket.buffer()
    it = state.iter
    state.maybe_increase_iter(bucket)
    if it < state.start_gift_iter:
        group = state.process_group
        buf.div_(dist.get_world_size(group))
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    fut: torch.futures.Future = torch.futures.Future()
    event = None
    if buf.device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(buf.device))
    layout = _bucket_layout(state, bucket, buf.numel()) if state.geometry == "reduced" else None
    state.runtime.executor.submit(_reduce, state, bucket.index(), it, buf, event, layout, fut)
    return fut
