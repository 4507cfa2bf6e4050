"""Hierarchical allreduce: high precision inside a node, FP8 across nodes.

With L ranks per node and N nodes (every node the same size):
1. inside each node, a ring reduce-scatter in a pass-through format (``local_fmt``, fp32 by
   default): local rank l ends with chunk l of ``chunk_bounds(n, L, block)`` summed over the node;
2. across nodes, the ranks with local index l allreduce that chunk with the FP8 ring (or direct)
   reduce-scatter plus the ring allgather: each of them then holds the same decoded bytes;
3. inside each node, a ring allgather of those float32 values in fp32 (exact), so every rank of
   every node ends with the same result.
Only step 2 crosses the network, with 1/L of the buffer per rank. The steps are the ring and
direct algorithms of this package over sub-transports, so any schedule and backend they run on
works here too.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..algorithms.partition import shared_chunk_bounds
from ..formats import Format, get_format
from ..transport import Transport
from . import ring
from .wire import Wire

ReduceScatter = Callable[..., tuple[Any, Any]]
"""ring.reduce_scatter's signature (direct.reduce_scatter has the same)."""


def node_groups(node_of: np.ndarray) -> list[list[int]]:
    """Ranks grouped by node, each group in rank order, groups ordered by their lowest rank."""
    groups: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of.tolist()):
        groups.setdefault(node, []).append(rank)
    return sorted(groups.values(), key=lambda g: g[0])


def check_uniform(node_of: np.ndarray) -> int:
    """The ranks per node; ValueError if nodes differ in size."""
    sizes = {len(g) for g in node_groups(node_of)}
    if len(sizes) != 1:
        raise ValueError(f"hierarchical allreduce needs the same number of ranks on every node, got {sorted(sizes)}")
    return sizes.pop()


def contiguous_nodes(p: int, local_size: int) -> np.ndarray:
    """Node ids when each run of ``local_size`` consecutive ranks is one node."""
    if local_size < 1 or p % local_size:
        raise ValueError(f"local_size={local_size} must divide the number of ranks ({p})")
    return np.arange(p, dtype=np.int64) // local_size


def allreduce(
    t: Transport, x: Any, node_of: np.ndarray, wire: Wire, acc_t: np.dtype,
    slice_elems: int, local_fmt: Format = get_format("fp32"), scatter: ReduceScatter = ring.reduce_scatter,
    local_own: Callable[[Wire], ring.Own] | None = None,
) -> Any:
    """Sum of the flat vector ``x`` over all ranks (float32, identical on every rank);
    ``scatter``: the cross-node reduce-scatter (ring's, or direct's for hierarchical_direct).
    ``local_own(local_wire)``: where the node-local ring reads this rank's values (ring.Own;
    default: ``x``; the fused GIFT path computes them in its hops)."""
    groups = node_groups(node_of)
    local_size = check_uniform(node_of)
    mine = next(g for g in groups if t.rank in g)
    lr = mine.index(t.rank)
    local = t.split(mine, "hier-local")
    cross = t.split([g[lr] for g in groups], "hier-cross")
    local_wire = wire.with_format(local_fmt)
    local_bounds = shared_chunk_bounds(x.size, local_size, wire.block)
    node_sum, _ = ring.reduce_scatter(local, x, local_bounds, local_wire, acc_t, slice_elems,
                                      own=None if local_own is None else local_own(local_wire))
    cross_bounds = shared_chunk_bounds(node_sum.size, cross.size, wire.block)
    cross_wire = wire.at(base=wire.base + int(local_bounds[lr]))  # node_sum[0] is that element of x
    _, own = scatter(cross, node_sum, cross_bounds, cross_wire, acc_t, slice_elems)
    chunk_values = ring.allgather(cross, own, np.diff(cross_bounds), cross_wire, slice_elems)
    f32 = wire.with_format(get_format("fp32"))
    sliced = ring.slice_chunk(chunk_values.size, f32.fmt, wire.block, slice_elems)
    msg = ring.encode_sliced(f32, chunk_values, sliced, f32.empty(sliced.nbytes))
    return ring.allgather(local, msg, np.diff(local_bounds), f32, slice_elems)
