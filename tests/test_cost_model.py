"""The cost model and error model ``algorithm="auto"`` relies on (giftcomm.cost.model, read from
the algorithm table), and the cached planning helpers (chunk bounds, the ring's layout).

Each algorithm against its simulation is tests/test_collectives.py; the table itself is
tests/test_algorithm_table.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import giftcomm as gc
from giftcomm.cost.model import Calibration, LinkCost, Topology, choose, predict, quantizations
from giftcomm.formats import get_format
from giftcomm.reference import simulate_allreduce

E4M3 = get_format("e4m3")  # the cost and byte formulas take the Format


def relative_error(xs, **kw):
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    y = simulate_allreduce(xs, **kw)[0].astype(np.float64)
    return np.linalg.norm(y - exact) / np.linalg.norm(exact)


def test_error_grows_with_p_for_the_ring_but_not_for_direct(rng):
    """The ring requantizes P-1 times, direct once: at P = 16 direct is clearly more faithful."""
    xs = [rng.standard_normal(1 << 14).astype(np.float32) for _ in range(16)]
    ring, direct = relative_error(xs, algorithm="ring"), relative_error(xs, algorithm="direct")
    hier = relative_error(xs, algorithm="hierarchical", local_size=4)
    assert direct < 0.8 * ring
    assert direct <= hier < ring  # 4 nodes: 4 requantizations instead of 16


def test_cost_model_shapes():
    cal = Calibration(shm=LinkCost(1e-5, 1 / 5e9), net=LinkCost(5e-5, 1 / 1.25e8))
    one_node, two_nodes = Topology(8, 1, 8), Topology(8, 2, 4)
    # latency-bound sizes favour one exchange or recursive doubling, bandwidth-bound ones neither
    assert choose(64, one_node, E4M3, cal=cal) in ("oneshot", "doubling")
    assert choose(1 << 24, one_node, E4M3, cal=cal) not in ("oneshot", "doubling")
    # the one-shot exchange's bytes grow with P: many ranks move it to doubling sooner
    assert choose(1 << 14, Topology(2, 1, 2), E4M3, cal=cal) == "oneshot"
    assert choose(1 << 14, Topology(64, 1, 64), E4M3, cal=cal) != "oneshot"
    # over a slow network, the hierarchical algorithms win for large buffers
    assert choose(1 << 24, two_nodes, E4M3, cal=cal).startswith("hierarchical")
    # bytes matter: e4m3 is predicted faster than fp32 on a slow link
    assert predict("ring", 1 << 24, two_nodes, E4M3, cal=cal) < predict("ring", 1 << 24, two_nodes, get_format("fp32"), cal=cal) / 3
    assert quantizations("direct", one_node) < quantizations("ring", one_node)


def test_chunk_bounds_is_a_fresh_array_and_the_cached_copy_is_read_only():
    from giftcomm.algorithms.partition import shared_chunk_bounds

    mine = gc.chunk_bounds(1000, 3, 256)
    mine[0] = 7  # the public function hands out the caller's own array
    shared = shared_chunk_bounds(1000, 3, 256)
    assert shared[0] == 0 and not shared.flags.writeable
    assert np.array_equal(gc.chunk_bounds(1000, 3, 256), shared)


@pytest.mark.parametrize("counts", [[512, 512], [768, 512, 0, 3], [1]])
def test_ring_layout_is_cached_and_agrees_with_slice_chunk(counts):
    from giftcomm.collectives import ring

    f = E4M3
    layout = ring.layout_of(np.array(counts), f, 256, 256)
    assert ring.layout_of(np.array(counts, np.int32), f, 256, 256) is layout  # same key whatever the int dtype
    sizes = [ring.slice_chunk(n, f, 256, 256).nbytes for n in counts]
    assert list(np.diff(layout.msg_offs)) == sizes and list(np.diff(layout.elem_offs)) == counts
    assert not layout.msg_offs.flags.writeable and not layout.elem_offs.flags.writeable


def test_an_alltoall_across_nodes_gets_its_share_of_the_link():
    """alltoall_efficiency slows direct's all-to-all (and oneshot's exchange) across nodes only:
    on one node, and for the ring, nothing changes; below 1 the ring takes large buffers across
    nodes that direct took at 1."""
    from dataclasses import replace

    base = Calibration(net=LinkCost(10e-6, 1 / 0.12e9), overlap=0.0)
    lossy = replace(base, alltoall_efficiency=0.75)
    nodes, one = Topology(4, 4, 1), Topology(4, 1, 4)
    n = 1 << 24
    for algo in ("direct", "oneshot"):
        assert predict(algo, n, nodes, E4M3, cal=lossy) > predict(algo, n, nodes, E4M3, cal=base)
        assert predict(algo, n, one, E4M3, cal=lossy) == predict(algo, n, one, E4M3, cal=base)
    assert predict("ring", n, nodes, E4M3, cal=lossy) == predict("ring", n, nodes, E4M3, cal=base)
    assert choose(n, nodes, E4M3, 256, base) == "direct" and choose(n, nodes, E4M3, 256, lossy) == "ring"
    with pytest.raises(ValueError, match="alltoall_efficiency"):
        Calibration.from_dict({**json.loads(base.to_json()), "alltoall_efficiency": 0.0})


def test_over_the_channel_the_oneshot_and_native_rows_pay_no_call_overhead():
    """A cached call of the one-shot or native row skips the engine: predict(channel=True) leaves
    call_overhead out for them and keeps it for the rows that still run the engine's steps."""
    from dataclasses import replace

    cal = Calibration(call_overhead=0.0)
    heavy = replace(cal, call_overhead=1e-3)
    topo, n = Topology(2, 1, 2), 256
    for algo in ("oneshot", "native"):
        assert predict(algo, n, topo, E4M3, cal=heavy, channel=True) == predict(algo, n, topo, E4M3, cal=cal,
                                                                                  channel=True)
        assert predict(algo, n, topo, E4M3, cal=heavy) == pytest.approx(predict(algo, n, topo, E4M3, cal=cal) + 1e-3)
    assert predict("ring", n, topo, E4M3, cal=heavy, channel=True) == pytest.approx(
        predict("ring", n, topo, E4M3, cal=cal, channel=True) + 1e-3)
