"""Flat gradient buckets: one NumPy buffer per bucket whose views are the parameters' ``.grad``.

A bucket is a contiguous 1-D NumPy array (the parameters' dtype: float32, float64 or float16)
holding the gradients of a run of parameters back to back, in row-major order, with no gaps, so
its geometry layout is simply ``[(name, shape), ...]``. ``torch.from_numpy`` gives a tensor
sharing that memory, and each parameter's ``.grad`` is bound to a view of it: autograd then
accumulates straight into the bucket and the collective reads and writes it in place.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...geometry import Layout

__all__ = ["GradBucket", "make_buckets", "named_trainable", "numpy_view"]

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """The NumPy array sharing memory with a contiguous CPU tensor (via DLPack; no copy).

    Raises TypeError for device tensors or dtypes NumPy lacks (bfloat16)."""
    if t.device.type != "cpu":
        raise TypeError(f"numpy_view needs a CPU tensor, got one on {t.device}")
    if t.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"numpy_view supports float32/float64/float16 tensors, got {t.dtype}")
    return np.from_dlpack(t.detach())


def named_trainable(model_or_named) -> list[tuple[str, torch.nn.Parameter]]:
    """``[(name, parameter)]`` of the parameters that require grad, from a module or an iterable
    of (name, parameter) pairs; shared (tied) parameters appear once."""
    items = model_or_named.named_parameters() if isinstance(model_or_named, torch.nn.Module) else model_or_named
    seen: set[int] = set()
    out = []
    for name, p in items:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


@dataclass
class GradBucket:
    """One flat bucket. buffer: 1-D NumPy array (the params' dtype); tensor: torch view of it;
    names/params: the parameters in buffer order; offsets: first element of each (int)."""

    index: int
    names: list[str]
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: np.ndarray
    tensor: torch.Tensor = field(repr=False)

    @property
    def layout(self) -> Layout:
        """The geometry layout of the buffer: one segment per parameter, shape as the param."""
        return Layout([(n, tuple(p.shape)) for n, p in zip(self.names, self.params)])

    def view(self, i: int) -> torch.Tensor:
        """Parameter i's slice of the bucket, shaped like the parameter."""
        p = self.params[i]
        return self.tensor[self.offsets[i] : self.offsets[i] + p.numel()].view(p.shape)

    def bind(self) -> None:
        """Make every ``.grad`` a view of the bucket, keeping the current gradient values
        (copied in if a grad was replaced, zero if a grad is None)."""
        for i, p in enumerate(self.params):
            v = self.view(i)
            g = p.grad
            if g is not None and g.data_ptr() == v.data_ptr() and g.shape == v.shape:
                continue
            if g is None:
                v.zero_()
            else:
                v.copy_(g.detach())
            p.grad = v

    def zero(self) -> None:
        """Zero the whole buffer (all gradients of the bucket) and bind the views."""
        self.buffer.fill(0)
        self.bind()


def make_buckets(named_params, bucket_mb: float = 25.0) -> list[GradBucket]:
    """Pack the trainable parameters (in the given order) into buckets of at most ``bucket_mb``
    MiB each (a parameter larger than that gets a bucket of its own); parameters of different
    dtypes go to different buckets. CPU parameters only. Binds every ``.grad`` to its view."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    cap = int(bucket_mb * 2**20)
    groups: list[list[tuple[str, torch.nn.Parameter]]] = []
    current: list[tuple[str, torch.nn.Parameter]] = []
    nbytes = 0
    for name, p in named_trainable(named_params):
        if p.device.type != "cpu" or p.dtype not in _NUMPY_DTYPES:
            raise TypeError(f"parameter {name!r}: need a CPU float32/float64/float16 tensor, got {p.dtype} on {p.device}")
        size = p.numel() * p.element_size()
        if current and (nbytes + size > cap or current[0][1].dtype != p.dtype):
            groups.append(current)
            current, nbytes = [], 0
        current.append((name, p))
        nbytes += size
    if current:
        groups.append(current)
    buckets = []
    for k, group in enumerate(groups):
        counts = [p.numel() for _, p in group]
        offsets = list(np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int))
        buf = np.zeros(int(sum(counts)), _NUMPY_DTYPES[group[0][1].dtype])
        b = GradBucket(k, [n for n, _ in group], [p for _, p in group], offsets, buf, torch.from_numpy(buf))
        b.bind()
        buckets.append(b)
    return buckets
