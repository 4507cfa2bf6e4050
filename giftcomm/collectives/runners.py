"""The built-in rows' allreduce runners (giftcomm.algorithms names them: ``runner=
"giftcomm.collectives.runners:run_ring"``, ...) and the lookups of a row's runner and
reduce-scatter.

A runner moves one agreed allreduce's data: ``runner(t, flat, wire, acc_t, nodes, slice_n, out)``
returns the decoded sum of ``flat`` over all ranks (float32, or float64 for float64 input;
``out``, a float32 (n,) array, when it could decode into it). The engine
(giftcomm.collectives.engine) runs them for plain allreduces and plans; the GIFT routes
(giftcomm.collectives.gift) run them on transformed values. They sit on the algorithms' floor:
nothing here imports the engine.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..algorithms import BY_NAME, Algorithm
from ..algorithms.partition import shared_chunk_bounds
from ..transport import DEVICE, Transport
from . import direct, doubling, hierarchical, native, oneshot, ring, shared
from .wire import Wire

__all__ = ["Runner", "runner_of", "scatter_of", "run_ring", "run_direct", "run_doubling", "run_hierarchical",
           "run_hierarchical_direct", "run_oneshot", "run_native"]

Runner = Callable[[Transport, Any, Wire, Any, Any, int, Any], Any]
"""runner(t, flat, wire, acc_t, nodes, slice_n, out) -> the decoded sum of ``flat`` over all
ranks (float32, or float64 for float64 input; ``out``, a float32 (n,) array, when it could decode
into it)."""


def runner_of(algorithm: Algorithm) -> Runner:
    """The allreduce runner of a row (giftcomm.algorithms.Algorithm.part; its cache first)."""
    return algorithm.resolved.get("runner") or algorithm.part("runner")


def scatter_of(name: str) -> Callable[..., tuple[Any, Any]]:
    """The reduce-scatter of the row ``name`` (one with ``scatter``): ``(t, flat, bounds, wire,
    acc_t, slice_n) -> (total, shard)``. reduce_scatter runs it; so does the allreduce of that
    name, before the ring allgather, for giftcomm's own rows."""
    row = BY_NAME[name]
    return row.resolved.get("scatter_runner") or row.part("scatter_runner")


def _scatter_gather(name: str) -> Runner:
    """Reduce-scatter of the row ``name`` then the ring allgather; through the transport's shared
    window on host memory over shared-memory transports (when there is room for it: else
    messages)."""

    def run(t: Transport, flat: Any, wire: Wire, acc_t: Any, nodes: Any, slice_n: int, out: Any) -> Any:
        scatter = scatter_of(name)
        bounds = shared_chunk_bounds(flat.size, t.size, wire.block)
        if t.shared_memory and t.memory != DEVICE and wire.xp is np:
            total = shared.allreduce(t, flat, bounds, wire, acc_t, slice_n, direct=scatter is direct.reduce_scatter,
                                     out=out)
            if total is not None:  # None: no room for the window (every rank alike); send messages
                return total
        return ring.allreduce(t, flat, bounds, wire, acc_t, slice_n, out=out, scatter=scatter)

    return run


def run_doubling(t: Transport, flat: Any, wire: Wire, acc_t: Any, nodes: Any, slice_n: int, out: Any) -> Any:
    """The ``doubling`` row's runner."""
    return doubling.allreduce(t, flat, wire, acc_t, out=out)


def run_oneshot(t: Transport, flat: Any, wire: Wire, acc_t: Any, nodes: Any, slice_n: int, out: Any) -> Any:
    """The ``oneshot`` row's runner."""
    return oneshot.allreduce(t, flat, wire, acc_t, out=out if acc_t == np.float32 else None)


def run_native(t: Transport, flat: Any, wire: Wire, acc_t: Any, nodes: Any, slice_n: int, out: Any) -> Any:
    """The ``native`` row's runner."""
    return native.allreduce(t, flat, wire, acc_t, out)


def _hierarchical(name: str) -> Runner:
    """fp32 inside nodes, the reduce-scatter of the row ``name``'s ``cross`` (and the ring
    allgather) across them."""

    def run(t: Transport, flat: Any, wire: Wire, acc_t: Any, nodes: Any, slice_n: int, out: Any) -> Any:
        cross = BY_NAME[name].cross
        assert cross is not None
        return hierarchical.allreduce(t, flat, nodes, wire, acc_t, slice_n, scatter=scatter_of(cross))

    return run


run_ring = _scatter_gather("ring")
"""The ``ring`` row's runner (the rows name their runners: giftcomm.algorithms)."""
run_direct = _scatter_gather("direct")
"""The ``direct`` row's runner."""
run_hierarchical = _hierarchical("hierarchical")
"""The ``hierarchical`` row's runner (its ``cross``: ring)."""
run_hierarchical_direct = _hierarchical("hierarchical_direct")
"""The ``hierarchical_direct`` row's runner (its ``cross``: direct)."""
