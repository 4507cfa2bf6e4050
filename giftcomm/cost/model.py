"""Alpha-beta-plus-codec cost model of each allreduce algorithm, and the ``auto`` choice.

Constants (seconds per message, seconds per byte per link class, codec values per second) are
the calibration in force: the file that ``python -m giftcomm.perf calibrate`` writes, read by
giftcomm.cost.calibration (which says where it is and what happens to a file that cannot be used),
else the built-in calibration (giftcomm.algorithms.machine.BUILT_IN).

The formulas are the algorithm table's (giftcomm.algorithms; docs/scaling.md writes
them out): per pipelined phase, time = latency terms + max(wire time, codec time), plus
(1 - overlap) times the smaller of the two. The calibration and topology records live in
giftcomm.algorithms.machine and the calibration file's functions in giftcomm.cost.calibration; both are
re-exported here.
"""
from __future__ import annotations

import math

from .. import algorithms
from ..algorithms.machine import BOUNDS, Calibration, LinkCost, Topology
from ..formats import Format, get_format
from .calibration import MAX_FILE_BYTES, calibration_path, forget_calibration, in_force, load_calibration, write_calibration

__all__ = ["Calibration", "LinkCost", "Topology", "BOUNDS", "MAX_FILE_BYTES", "calibration_path", "load_calibration",
           "forget_calibration", "write_calibration", "predict", "quantizations", "error_growth", "choose", "candidate_times",
           "FIDELITY_SLACK", "auto_algorithm", "ONE_NODE_CHANNEL_VALUES"]


def predict(algorithm: str, n: int, topo: Topology, fmt: Format, block: int = 256,
            cal: Calibration | None = None, channel: bool = False) -> float:
    """Predicted seconds for one allreduce of ``n`` values (float32 input) of wire format ``fmt``
    (giftcomm.formats.get_format gives it from a name) with this algorithm.

    ``call_overhead`` plus the algorithm's formula (:attr:`Algorithm.time`, or with ``channel``
    -- a persistent plan's calls through the node-shared channel -- :attr:`Algorithm.channel_time`
    where the row has one; docs/scaling.md); ``inf`` for a hierarchical algorithm on a topology
    without at least 2 nodes of at least 2 ranks. ValueError for a name not in the table. With
    ``channel``, the rows whose cached calls skip the engine -- the one-shot row (its channel
    formula: the call in C) and the native row (``native_alpha`` is then that whole call's fixed
    cost, as calibrate measures it) -- pay no ``call_overhead``."""
    row = algorithms.row(algorithm)
    cal = cal or load_calibration()
    if topo.ranks == 1:
        t = n / cal.encode_rate + n / cal.decode_rate
    else:
        formula = row.channel_time if channel and row.channel_time is not None else row.time
        t = formula(n, topo, fmt, block, cal)
    lean = channel and (row.channel_time is not None or row.native)
    return t if math.isinf(t) or lean else cal.call_overhead + t


def quantizations(algorithm: str, topo: Topology) -> int:
    """How many times a value is (re)quantized on its way, at most: the error-growth driver."""
    return algorithms.row(algorithm).quantizations(topo)


def error_growth(algorithm: str, topo: Topology) -> float:
    """Predicted squared relative error of the allreduce, in units of one quantization of one
    rank's values: relative L2 error ~ eps * sqrt(error_growth) for P independent contributions
    of equal scale (eps: the format's relative rounding error with block scaling). The formulas
    are the table's (:attr:`Algorithm.growth`; docs/scaling.md): ring (P + 1) / 2, direct
    2 - 1/P, doubling log2(P2) + 1 + (P - P2) / P, hierarchical (N + 1) / 2, hierarchical_direct
    2 - 1/N, oneshot 1 (P2: the largest power of two <= P; N: nodes); 1 on one rank."""
    row = algorithms.row(algorithm)
    return 1.0 if topo.ranks == 1 else row.growth(topo)


_choices: dict[tuple, str] = {}  # choose() memo for the loaded calibration (key holds its id)
FIDELITY_SLACK = 1.10  # accept up to 10% more predicted time for fewer quantizations


def choose(n: int, topo: Topology, fmt: Format, block: int = 256, cal: Calibration | None = None,
           channel: bool = False, native: bool = True) -> str:
    """The ``auto`` algorithm: among the table's rows that ``auto`` may choose and that can run on
    ``topo`` (the hierarchical ones need at least 2 nodes of at least 2 ranks), those predicted
    within FIDELITY_SLACK of the fastest; of those, the one with the smallest predicted error
    (:func:`error_growth`; ties: the faster, then a one-exchange row -- on one rank every
    algorithm is the same local encode and decode, and one exchange has no steps at all -- then
    table order). The transport's own allreduce (the ``native`` row) replaces that choice only
    where it is predicted strictly faster than every other candidate, and only with ``native``
    (the call's ``allow_native``). ``channel``: for a persistent plan whose calls go through the
    node-shared channel (:func:`predict`)."""
    if cal is None:  # the calibration in force: remember the answers it gave
        cal = in_force()
        key = (n, topo, fmt.name, block, id(cal), channel, native)
        if key not in _choices:
            if len(_choices) > 4096:
                _choices.clear()
            _choices[key] = choose(n, topo, fmt, block, cal, channel, native)
        return _choices[key]
    times = candidate_times(n, topo, fmt, block, cal, channel, native)
    own = {a: t for a, t in times.items() if not algorithms.BY_NAME[a].native}
    best = min(own.values())
    near = [a for a in own if own[a] <= best * FIDELITY_SLACK]
    pick = min(near, key=lambda a: (round(error_growth(a, topo), 9), own[a], not algorithms.BY_NAME[a].one_exchange))
    native_t = times.get(algorithms.NATIVE)
    return algorithms.NATIVE if native_t is not None and native_t < best else pick


def candidate_times(n: int, topo: Topology, fmt: str | Format, block: int = 256, cal: Calibration | None = None,
                    channel: bool = False, native: bool = True) -> dict[str, float]:
    """Predicted seconds (:func:`predict`) of every row ``auto`` considers for this call, in table
    order (``native``: with the transport's own allreduce): what :func:`choose` compares, and what
    the adapters log when they say which path a bucket took (``fmt``: a Format or its name)."""
    cal = cal or load_calibration()
    fmt = get_format(fmt)
    multi_node = topo.nodes > 1 and topo.local_size > 1
    return {a.name: predict(a.name, n, topo, fmt, block, cal, channel) for a in algorithms.TABLE
            if a.auto and (multi_node or not a.needs_nodes) and (native or not a.native)}


ONE_NODE_CHANNEL_VALUES = 1 << 18
"""Up to this many values (1 MiB of float32), ``auto`` on one node of at least 2 ranks predicts
the node-shared channel's cost (:func:`auto_algorithm`)."""


def auto_algorithm(n: int, topo: Topology, fmt: Format, block: int, *, allow_native: bool = True,
                   scatter: bool = False) -> str:
    """THE ``algorithm="auto"`` decision: every live call (giftcomm.allreduce, gift_allreduce,
    reduce_scatter, their cached plans and giftcomm.plan_allreduce, on every transport) and
    giftcomm.resolve_algorithm / the reference simulations ask this one function, with nothing
    but the call's own arguments, so that what a call runs is what they say.

    n: values in the call's buffer (any dtype). topo: the ranks and their nodes (the transport's
    node layout, or ``local_size`` when the call gives one). fmt, block: the wire format
    (giftcomm.formats.Format) and its resolved block. allow_native: the call's option (False: never the native row).
    scatter: a reduce_scatter, which chooses among the rows with a reduce-scatter (``ring``,
    ``direct``, ``native``; the first of them when the cost model's pick has none).

    On one node of at least 2 ranks, an allreduce of up to :data:`ONE_NODE_CHANNEL_VALUES`
    values is predicted as a repeated call through the plans' node-shared channel runs it
    (:func:`predict` with ``channel``: the one-shot row in C, the native row without the engine),
    which is how MPI's shared-memory path runs it. The choice does not depend on whether this
    transport has that channel (torch.distributed, NCCL and MPI with GIFTCOMM_SHARED_MEMORY=0
    choose alike and send the same algorithm's messages): otherwise the same call would run
    different algorithms, with different results, on different transports, and
    giftcomm.resolve_algorithm could not say which."""
    channel = not scatter and topo.nodes == 1 and topo.ranks > 1 and n <= ONE_NODE_CHANNEL_VALUES
    pick = choose(n, topo, fmt, block, channel=channel, native=allow_native)
    if scatter and not algorithms.BY_NAME[pick].scatter:
        return next(a.name for a in algorithms.TABLE if a.scatter)
    return pick
