"""The public collectives: allreduce, gift_allreduce, reduce_scatter, allgather.

One code path for every array: NumPy, CuPy, torch tensors (CPU or CUDA), JAX arrays and other
DLPack producers are imported zero-copy (giftcomm._xp) and the result goes back in the caller's
framework. This module is the face: it resolves the communicator, gathers the keywords into one
:class:`~giftcomm.options.CallOptions` and hands the call to the engine
(giftcomm.collectives.engine), which

1. validates and agrees on every rank in one small collective: bad input on any rank raises
   the same exception on every rank;
2. runs the chosen algorithm (a row of giftcomm.algorithms) over the transport,
   with the codec kernels of the array's backend (native C or NumPy on the host, CUDA on the
   device); the transport's schedule (pipelined or grouped) decides how each hop's messages are
   posted;
3. applies ``avg``, casts to the input's dtype and writes ``out`` or returns a new array.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._xp import is_device_array
from .algorithms import CHOICES
from .collectives import engine
from .collectives.gift import GeometryLike
from .options import CallOptions, Entry, call_options
from .plans import cache as plan_cache
from .transport import resolve

__all__ = ["last_algorithm", "allreduce", "gift_allreduce", "reduce_scatter", "allgather", "GeometryLike", "ALGORITHMS"]

ALGORITHMS = CHOICES
"""The ``algorithm=`` values of allreduce and gift_allreduce (giftcomm.algorithms)."""


_SCATTER = Entry(defaults={"algorithm": "ring"})
"""reduce_scatter's options: algorithm "ring" unless given."""
_GATHER = Entry(defaults={"op": "sum", "algorithm": "auto"}, fixed=("op", "algorithm"))
"""allgather's options: nothing reduced, so op and algorithm stay at their defaults."""


def _explicit(given: dict[str, Any], options: CallOptions | None) -> bool:
    """Whether the caller chose the format (giftcomm.stats warns of its fallback to native)."""
    return options is not None or "fmt" in given


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
    out: Any = None,
    local_size: int | None = None,
    options: CallOptions | None = None,
    **opts: Any,
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
    kernels (giftcomm.collectives.gift; docs/gpu.md "Fused transform"). The options as for
    :func:`allreduce`.
    """
    t = resolve(comm, device=is_device_array(x))
    o = call_options(opts, options)
    t = t.enter_call(t is not comm)  # a release on another thread lets the same calls in on every rank
    try:
        # without a geometry exactly allreduce, its plan cache included (the same auto choice)
        return plan_cache.allreduce(t, x, out, o, local_size, _explicit(opts, options), geometry)
    finally:
        t.exit_call()


def allreduce(
    x: Any,
    *,
    comm: Any = None,
    out: Any = None,
    local_size: int | None = None,
    options: CallOptions | None = None,
    **opts: Any,
) -> Any:
    """Sum (or average) ``x`` over all ranks with FP8 wire messages and fp32 accumulation.

    x: float32/float64/float16/bfloat16 array, any shape and size, of any framework (NumPy, CuPy,
    torch CPU/CUDA, JAX; the result comes back in the same one). comm: an mpi4py communicator, a
    giftcomm Transport, or None: torch.distributed's default group when it is initialised with
    several ranks and MPI's COMM_WORLD is one process (torchrun; CUDA tensors then go over the
    group's own backend, NCCL), else MPI.COMM_WORLD (mpiexec, or one process; device arrays then
    go over NCCL on the same ranks). None raises RuntimeError on every rank when both worlds have
    several ranks (ambiguous: pass ``comm=``) and when a launcher started several ranks
    (``WORLD_SIZE`` > 1) while neither world has them (no ``init_process_group``): it never
    reduces over one rank alone.
    options / ``**opts``: the call options (fmt, block, rounding, seed, algorithm, slice_elems,
    timeout, op, mx_scale, allow_native) as keywords, or whole as one
    :class:`~giftcomm.options.CallOptions` (``options=``; keywords given beside it replace its
    fields): docs/api.md, "Call options", says what each means. algorithm: a row of
    giftcomm.algorithms ("oneshot" for small messages; "native" the transport's own
    allreduce, uncompressed) or "auto" (the cost model's choice; "native" only where predicted
    faster than every compressed algorithm, never with ``allow_native=False``).
    local_size: ranks per node for the hierarchical algorithms (default: from the transport).
    Returns an array of x's shape and dtype, bit-identical on every rank and equal to
    ``giftcomm.reference.simulate_allreduce`` of all ranks' inputs with the same algorithm.
    Repeated calls with one signature reuse a cached plan where the ranks share a node's memory
    (docs/api.md, Plan cache); ``auto`` there predicts the plans' channel, as
    :func:`giftcomm.plan_allreduce` does.
    """
    t = resolve(comm, device=type(x) is not np.ndarray and is_device_array(x))
    o = call_options(opts, options)
    t = t.enter_call(t is not comm)  # a release on another thread lets the same calls in on every rank (docs/robustness.md)
    try:
        return plan_cache.allreduce(t, x, out, o, local_size, _explicit(opts, options))
    finally:
        t.exit_call()

def reduce_scatter(
    x: Any,
    *,
    comm: Any = None,
    out: Any = None,
    layout: str = "blocks",
    options: CallOptions | None = None,
    **opts: Any,
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
    layout. The options as for :func:`allreduce`; algorithm: one of
    giftcomm.algorithms.SCATTER_CHOICES ("ring" unless given as a keyword; "native"
    is this rank's shard of the transport's own allreduce).
    """
    t = resolve(comm, device=is_device_array(x))
    o = call_options(opts, options, _SCATTER)
    t = t.enter_call(t is not comm)
    try:
        return plan_cache.reduce_scatter(t, x, out, layout, o, _explicit(opts, options))
    finally:
        t.exit_call()


def allgather(
    shard: Any,
    *,
    comm: Any = None,
    out: Any = None,
    options: CallOptions | None = None,
    **opts: Any,
) -> Any:
    """Concatenate every rank's shard (read flat; lengths may differ) into one 1-D array.

    Each shard is encoded once by its owner; every rank decodes the same bytes, so the result is
    bit-identical everywhere. The inverse of :func:`reduce_scatter`'s layout. ``out``: a 1-D
    array of the shard's dtype and framework holding all the gathered values. Options: the call
    options (docs/api.md); it reduces nothing, so ``op`` and ``algorithm`` stay at their
    defaults ("sum", "auto"; ValueError otherwise) and ``allow_native`` is not used.
    """
    t = resolve(comm, device=is_device_array(shard))
    o = call_options(opts, options, _GATHER)
    t = t.enter_call(t is not comm)
    try:
        return plan_cache.collective(t, engine.ALLGATHER, shard, out, o)
    finally:
        t.exit_call()
