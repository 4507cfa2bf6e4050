"""The public collectives: allreduce, gift_allreduce, reduce_scatter, allgather.

One code path for every array: NumPy, CuPy, torch tensors (CPU or CUDA), JAX arrays and other
DLPack producers are imported zero-copy (giftcomm._xp) and the result goes back in the caller's
framework. This module is the face: it resolves the communicator, gathers the keywords into one
:class:`~giftcomm.options.CallOptions` and hands the call to the engine
(giftcomm.collectives.engine), which

1. validates and agrees on every rank in one small collective: bad input on any rank raises
   the same exception on every rank;
2. runs the chosen algorithm (a row of giftcomm.collectives.algorithms) over the transport,
   with the codec kernels of the array's backend (native C or NumPy on the host, CUDA on the
   device); the transport's schedule (pipelined or grouped) decides how each hop's messages are
   posted;
3. applies ``avg``, casts to the input's dtype and writes ``out`` or returns a new array.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import plan_cache
from ._xp import is_device_array
from .accounting import DEFAULT_FMT
from .collectives import engine
from .collectives.algorithms import CHOICES
from .collectives.engine import GeometryLike, call_options
from .formats import Format
from .transport import resolve

__all__ = ["last_algorithm", "allreduce", "gift_allreduce", "reduce_scatter", "allgather", "GeometryLike", "ALGORITHMS"]

ALGORITHMS = CHOICES
"""The ``algorithm=`` values of allreduce and gift_allreduce (giftcomm.collectives.algorithms)."""


def last_algorithm(comm: Any = None, device: bool = False) -> tuple[str, Any] | None:
    """(algorithm, chunk bounds or None) of the last allreduce / gift_allreduce / reduce_scatter
    on ``comm``'s transport (``device``: its device transport), ``auto`` resolved; None before
    the first. Local and free (no communication); see engine.last_algorithm."""
    return engine.last_algorithm(resolve(comm, device=device))


def gift_allreduce(
    x: Any,
    geometry: GeometryLike | None = None,
    *,
    comm: Any = None,
    op: str = "sum",
    fmt: str | Format = DEFAULT_FMT,
    block: int | None = None,
    out: Any = None,
    algorithm: str = "auto",
    local_size: int | None = None,
    slice_elems: int | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
    timeout: float | None = None,
    mx_scale: str = "ceil",
    allow_native: bool = True,
) -> Any:
    """Allreduce ``x`` across ranks, quantizing in the geometry's coordinates.

    x: float32/float64/float16/bfloat16 array of any shape (NumPy, CuPy, torch, JAX or another
    DLPack producer; read as a flat vector; not modified unless it is ``out``). geometry: None or
    an identity geometry gives exactly :func:`allreduce`; otherwise ``inverse(sum(forward(x)))``
    with the transform in float32 on x's backend (then ``/ P`` for ``op="avg"``). Returns an
    array of x's shape and dtype in x's framework (``out`` if given), bit-identical on every
    rank. Raises TypeError/ValueError on every rank when any rank's input is bad or the ranks
    disagree (count, dtype, fmt, block, op, slice, algorithm, local_size, geometry). Device
    arrays with a low-rank / identity giftcomm Geometry: the transforms run inside the codec
    kernels (giftcomm.collectives.gift; docs/gpu.md "Fused transform").
    """
    t = resolve(comm, device=is_device_array(x))
    opts = call_options(fmt, block, rounding, seed, algorithm, slice_elems, timeout, op, mx_scale, allow_native)
    t = t.enter_call(t is not comm)  # a release on another thread lets the same calls in on every rank
    try:
        if geometry is None:  # exactly allreduce, its plan cache included (the same auto choice)
            return plan_cache.allreduce(t, x, out, opts, local_size, fmt is not DEFAULT_FMT)
        return engine.execute(t, engine.ALLREDUCE, x, out, opts, geometry, local_size, fmt is not DEFAULT_FMT)
    finally:
        t.exit_call()


def allreduce(
    x: Any,
    *,
    comm: Any = None,
    op: str = "sum",
    fmt: str | Format = DEFAULT_FMT,
    block: int | None = None,
    out: Any = None,
    algorithm: str = "auto",
    local_size: int | None = None,
    slice_elems: int | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
    timeout: float | None = None,
    mx_scale: str = "ceil",
    allow_native: bool = True,
) -> Any:
    """Sum (or average) ``x`` over all ranks with FP8 wire messages and fp32 accumulation.

    x: float32/float64/float16/bfloat16 array, any shape and size, of any framework (NumPy, CuPy,
    torch CPU/CUDA, JAX; the result comes back in the same one). fmt: "e4m3", "e5m2" (block-scaled
    FP8), "mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4" (microscaling and 4-bit) or "bf16", "fp16",
    "fp32" (raw values on the wire). block: elements per scale (None: the format's own, 16 for
    nvfp4, 32 for MX, 256 otherwise; MX and nvfp4 take only their own). rounding: "nearest" or
    "stochastic" (scaled formats; unbiased, with ``seed``, an int identifying the call such as the
    training step: the same seed gives the same bytes on every run and rank). comm:
    mpi4py communicator (None: MPI.COMM_WORLD; device arrays then go over NCCL), or a giftcomm
    Transport. algorithm: "ring", "direct", "doubling", "hierarchical", "hierarchical_direct",
    "oneshot" (small messages: one exchange, each contribution quantized once), "native" (the
    transport's own allreduce, uncompressed: float32 values for a block-scaled format, a
    pass-through format's values otherwise; docs/api.md, Native path) or "auto" (the cost
    model's choice among the rows of giftcomm.collectives.algorithms it may take; it takes
    "native" only where that is predicted faster than every compressed algorithm, and never
    with ``allow_native=False``);
    local_size: ranks per node for the hierarchical algorithms (default: from the transport).
    timeout: seconds each wait of this call may wait for its peers (default: the transport's,
    $GIFTCOMM_TIMEOUT; docs/robustness.md). mx_scale: the MX formats' shared-exponent rule,
    "ceil" (default; no element saturates) or "floor" (OCP MX v1.0 bytes); "floor" with another
    format raises (docs/wire-format.md). Returns an
    array of x's shape and dtype, bit-identical on every rank and equal to
    ``giftcomm.reference.simulate_allreduce`` of all ranks' inputs with the same algorithm.
    Repeated calls with one signature reuse a cached plan where the ranks share a node's memory
    (docs/api.md, Plan cache); ``auto`` there predicts the plans' channel, as
    :func:`giftcomm.plan_allreduce` does.
    """
    t = resolve(comm, device=type(x) is not np.ndarray and is_device_array(x))
    opts = call_options(fmt, block, rounding, seed, algorithm, slice_elems, timeout, op, mx_scale, allow_native)
    t = t.enter_call(t is not comm)  # a release on another thread lets the same calls in on every rank (docs/robustness.md)
    try:
        return plan_cache.allreduce(t, x, out, opts, local_size, fmt is not DEFAULT_FMT)
    finally:
        t.exit_call()

def reduce_scatter(
    x: Any,
    *,
    comm: Any = None,
    op: str = "sum",
    fmt: str | Format = DEFAULT_FMT,
    block: int | None = None,
    out: Any = None,
    algorithm: str = "ring",
    slice_elems: int | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
    timeout: float | None = None,
    layout: str = "blocks",
    mx_scale: str = "ceil",
    allow_native: bool = True,
) -> Any:
    """This rank's shard of the sum of ``x`` over all ranks (1-D, x's dtype and framework).

    layout "blocks" (default): the shard is chunk ``rank`` of ``giftcomm.chunk_bounds(x.size, P,
    block)`` of the flattened buffer: whole blocks, dealt out evenly; then
    ``allgather(reduce_scatter(x))`` equals ``allreduce(x)`` (same algorithm, one of giftcomm's
    own rows) bit for bit for float32/float64 input and ``op="sum"``. layout "equal" (FSDP2, ZeRO, Megatron): x.size must
    be a multiple of P (ValueError on every rank otherwise) and the shard is elements
    ``[rank*n/P, (rank+1)*n/P)``; each shard's scale blocks count from the shard's start
    (docs/wire-format.md). Either way the shard is the owner's high-precision sum, not
    re-quantized, bit-identical to ``giftcomm.reference.simulate_reduce_scatter`` with the same
    layout. algorithm: "ring", "direct", "native" (the transport's own allreduce, this rank's
    shard of it) or "auto"; allow_native as for :func:`allreduce`.
    """
    t = resolve(comm, device=is_device_array(x))
    opts = call_options(fmt, block, rounding, seed, algorithm, slice_elems, timeout, op, mx_scale, allow_native)
    kind, opts = engine.scatter_kind(layout, opts)
    t = t.enter_call(t is not comm)
    try:
        return plan_cache.collective(t, kind, x, out, opts, fmt is not DEFAULT_FMT)
    finally:
        t.exit_call()


def allgather(
    shard: Any,
    *,
    comm: Any = None,
    fmt: str | Format = DEFAULT_FMT,
    block: int | None = None,
    out: Any = None,
    slice_elems: int | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
    timeout: float | None = None,
    mx_scale: str = "ceil",
) -> Any:
    """Concatenate every rank's shard (read flat; lengths may differ) into one 1-D array.

    Each shard is encoded once by its owner; every rank decodes the same bytes, so the result is
    bit-identical everywhere. The inverse of :func:`reduce_scatter`'s layout. ``out``: a 1-D
    array of the shard's dtype and framework holding all the gathered values.
    """
    t = resolve(comm, device=is_device_array(shard))
    opts = call_options(fmt, block, rounding, seed, "auto", slice_elems, timeout, "sum", mx_scale)
    t = t.enter_call(t is not comm)
    try:
        return plan_cache.collective(t, engine.ALLGATHER, shard, out, opts)
    finally:
        t.exit_call()
