"""Single-process simulations of the collectives: every rank's inputs in, every rank's outputs out.

Written as plain loops over the algorithm's steps, independent of the distributed code, so that
the distributed result can be checked against them bit for bit (DESIGN invariant 2).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..formats import check_block, get_format
from ..partition import accumulation_dtype, chunk_bounds
from .codec import decode, encode

__all__ = ["simulate_allreduce", "simulate_reduce_scatter", "simulate_allgather"]


def _flat_inputs(inputs: Sequence[np.ndarray]) -> tuple[list[np.ndarray], np.dtype, tuple]:
    if len(inputs) < 1:
        raise ValueError("need at least one rank's input")
    arrays = [np.asarray(x) for x in inputs]
    shape, dtype = arrays[0].shape, arrays[0].dtype
    for a in arrays:
        if a.size != arrays[0].size or a.dtype != dtype:
            raise ValueError("all ranks' inputs must have the same element count and dtype")
    return [a.reshape(-1) for a in arrays], dtype, shape


def _ring_chunk_sums(flat: list[np.ndarray], fmt: str, block: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The owner's high-precision sum of each chunk, after the ring reduce-scatter."""
    p = len(flat)
    acc_t = accumulation_dtype(flat[0].dtype)
    bounds = chunk_bounds(flat[0].size, p, block)
    sums = []
    with np.errstate(invalid="ignore", over="ignore"):
        for c in range(p):
            lo, hi = bounds[c], bounds[c + 1]
            part = [x[lo:hi].astype(acc_t) for x in flat]
            if p == 1:
                sums.append(part[0])
                continue
            # Chunk c starts at rank c+1 and travels right; rank c adds last.
            msg = encode(part[(c + 1) % p].astype(np.float32), fmt, block)
            for k in range(2, p + 1):
                acc = decode(msg, hi - lo, fmt, block).astype(acc_t) + part[(c + k) % p]
                if k < p:
                    msg = encode(acc.astype(np.float32), fmt, block)
            sums.append(acc)
    return sums, bounds


def _finish(values: np.ndarray, op: str, p: int, dtype: np.dtype) -> np.ndarray:
    if op == "avg":
        values = values / values.dtype.type(p)
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(dtype)


def simulate_reduce_scatter(
    inputs: Sequence[np.ndarray], fmt: str = "e4m3", block: int = 256, op: str = "sum"
) -> list[np.ndarray]:
    """Every rank's reduce_scatter shard (1-D, input dtype), from every rank's input."""
    get_format(fmt)
    block = check_block(block)
    flat, dtype, _ = _flat_inputs(inputs)
    sums, _ = _ring_chunk_sums(flat, fmt, block)
    return [_finish(s, op, len(flat), dtype) for s in sums]


def simulate_allreduce(
    inputs: Sequence[np.ndarray], fmt: str = "e4m3", block: int = 256, op: str = "sum"
) -> list[np.ndarray]:
    """Every rank's allreduce output (input shape and dtype), from every rank's input.

    Ring reduce-scatter with in-ring requantization, then the owner of each chunk encodes its
    sum once and every rank decodes those same bytes.
    """
    get_format(fmt)
    block = check_block(block)
    flat, dtype, shape = _flat_inputs(inputs)
    p = len(flat)
    sums, bounds = _ring_chunk_sums(flat, fmt, block)
    acc_t = accumulation_dtype(dtype)
    result = np.empty(flat[0].size, acc_t)
    for c, s in enumerate(sums):
        msg = encode(s.astype(np.float32), fmt, block)
        result[bounds[c] : bounds[c + 1]] = decode(msg, s.size, fmt, block)
    out = _finish(result, op, p, dtype).reshape(shape)
    return [out.copy() for _ in range(p)]


def simulate_allgather(shards: Sequence[np.ndarray], fmt: str = "e4m3", block: int = 256) -> list[np.ndarray]:
    """Every rank's allgather output: the concatenation of every shard, each encoded once."""
    get_format(fmt)
    block = check_block(block)
    arrays = [np.asarray(s).reshape(-1) for s in shards]
    dtype = arrays[0].dtype
    pieces = [decode(encode(a.astype(np.float32), fmt, block), a.size, fmt, block) for a in arrays]
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.concatenate(pieces).astype(dtype)
    return [out.copy() for _ in arrays]
