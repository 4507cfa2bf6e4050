"""Flat gradient buckets: one flat tensor per bucket whose views are the parameters' ``.grad``.

A bucket is a contiguous 1-D torch tensor (the parameters' dtype: float32, float64, float16 or
bfloat16, on their device: CPU or CUDA) holding the gradients of a run of parameters back to
back, in row-major order, with no gaps, so its geometry layout is simply ``[(name, shape), ...]``.
Each parameter's ``.grad`` is bound to a view of it: autograd then accumulates straight into the
bucket and the collective reads and writes it in place. On the CPU, ``buffer`` is the NumPy view
of the same memory (bfloat16 as ``ml_dtypes.bfloat16``); on a GPU it is the tensor itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import torch

from ...geometry import Layout

__all__ = ["GradBucket", "make_buckets", "named_trainable", "numpy_view"]

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                 torch.bfloat16: ml_dtypes.bfloat16}


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """The NumPy array sharing memory with a CPU tensor (via DLPack; no copy); bfloat16 tensors
    give an ``ml_dtypes.bfloat16`` array.

    Raises TypeError for device tensors or other dtypes."""
    if t.device.type != "cpu":
        raise TypeError(f"numpy_view needs a CPU tensor, got one on {t.device}")
    if t.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"numpy_view supports float32/float64/float16/bfloat16 tensors, got {t.dtype}")
    if t.dtype == torch.bfloat16:
        return np.from_dlpack(t.detach().view(torch.int16)).view(ml_dtypes.bfloat16)
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
    """One flat bucket. buffer: what the collective reduces (the NumPy view of ``tensor`` on the
    CPU, ``tensor`` itself on a GPU); tensor: the flat torch tensor (the params' dtype and
    device); names/params: the parameters in buffer order; offsets: first element of each."""

    index: int
    names: list[str]
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: Any
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
        self.tensor.zero_()
        self.bind()


def make_buckets(named_params, bucket_mb: float = 25.0) -> list[GradBucket]:
    """Pack the trainable parameters (in the given order) into buckets of at most ``bucket_mb``
    MiB each (a parameter larger than that gets a bucket of its own); parameters of different
    dtypes or devices go to different buckets. Binds every ``.grad`` to its view."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    cap = int(bucket_mb * 2**20)
    groups: list[list[tuple[str, torch.nn.Parameter]]] = []
    current: list[tuple[str, torch.nn.Parameter]] = []
    nbytes = 0
    for name, p in named_trainable(named_params):
        if p.device.type not in ("cpu", "cuda") or p.dtype not in _NUMPY_DTYPES:
            raise TypeError(f"parameter {name!r}: need a CPU or CUDA float32/float64/float16/bfloat16 tensor, "
                            f"got {p.dtype} on {p.device}")
        size = p.numel() * p.element_size()
        if current and (nbytes + size > cap or current[0][1].dtype != p.dtype or current[0][1].device != p.device):
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
        first = group[0][1]
        tensor = torch.zeros(int(sum(counts)), dtype=first.dtype, device=first.device)
        buf = numpy_view(tensor) if tensor.device.type == "cpu" else tensor
        b = GradBucket(k, [n for n, _ in group], [p for _, p in group], offsets, buf, tensor)
        b.bind()
        buckets.append(b)
    return buckets
