"""An algorithm is one row: a row registered here, in this file only, runs through allreduce,
reduce_scatter, a persistent plan, error feedback, the stats, the cost model and the reference
simulation (giftcomm.algorithms.register).

The throwaway row is "direct" under another name and code, carrying its data movement itself as
functions (giftcomm's built-in rows name theirs as "module:function" references): the row's
runner is what runs, since no other table knows its name. The choice lists copied at import
(giftcomm.api.ALGORITHMS, the adapters' SCATTER_CHOICES) see it: they are live views."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import giftcomm as gc
from giftcomm import GiftSchedule, algorithms, api
from giftcomm.accounting import sent_bytes
from giftcomm.algorithms.machine import Topology
from giftcomm.collectives.feedback import own_pieces
from giftcomm.cost.model import load_calibration, predict
from giftcomm.formats import get_format
from giftcomm.reference import simulate

try:  # imported before the row is registered: their choice lists are copies taken at import
    from giftcomm.adapters.torch import fsdp, process_group, sharded_sync
except ImportError:  # no torch: the adapters' lists are not checked
    fsdp = process_group = sharded_sync = None

E4M3 = get_format("e4m3")  # the cost and byte formulas take the Format

NAME = "direct_again"


@pytest.fixture
def row():
    base = algorithms.BY_NAME["direct"]
    pieces = {p: base.part(p) for p in ("runner", "scatter_runner", "simulation", "scatter_simulation")}
    assert all(callable(f) for f in pieces.values())
    new = dataclasses.replace(base, name=NAME, code=90, auto=False, **pieces)
    algorithms.register(new)
    try:
        yield new
    finally:
        algorithms.unregister(NAME)
    assert NAME not in algorithms.CHOICES and NAME not in algorithms.BY_NAME and 90 not in algorithms.BY_CODE


def test_the_row_runs_every_collective_as_its_twin(row, rng):
    p = 3
    xs = [rng.standard_normal(4099).astype(np.float32) for _ in range(p)]

    def body(t):
        a = gc.allreduce(xs[t.rank], comm=t, algorithm=NAME, rounding="stochastic", seed=5)
        ran = api.last_algorithm(t)[0]
        twin = gc.allreduce(xs[t.rank], comm=t, algorithm="direct", rounding="stochastic", seed=5)
        shard = gc.reduce_scatter(xs[t.rank], comm=t, algorithm=NAME, layout="blocks")
        plan = gc.plan_allreduce(xs[t.rank], comm=t, algorithm=NAME)
        planned = plan(xs[t.rank])
        return a, ran, twin, shard, planned, plan.algorithm, gc.stats(t)

    got = gc.LoopbackGroup(p, shared_memory=True).run(body)
    sim = gc.reference.simulate_allreduce(xs, algorithm=NAME, rounding="stochastic", seed=5)
    sim_nearest = gc.reference.simulate_allreduce(xs, algorithm=NAME)
    shards = gc.reference.simulate_reduce_scatter(xs, algorithm=NAME)
    for r, (a, ran, twin, shard, planned, plan_algorithm, stats) in enumerate(got):
        assert ran == plan_algorithm == NAME
        assert a.tobytes() == twin.tobytes() == sim[r].tobytes()
        assert planned.tobytes() == sim_nearest[r].tobytes()
        assert shard.tobytes() == shards[r].tobytes()
        assert stats["algorithms"].get(NAME, 0) >= 2
    assert sent_bytes(NAME, 4099, p, 1, E4M3, 256) == sent_bytes("direct", 4099, p, 1, E4M3, 256) > 0


def test_error_feedback_reads_the_row(row, rng):
    import torch

    from giftcomm.adapters.torch import GradSync

    for p, rank in ((1, 0), (3, 0), (3, 2), (4, 1)):
        assert own_pieces(NAME, 1000, p, rank, 32) == own_pieces("direct", 1000, p, rank, 32)
    grads = [[torch.from_numpy(rng.standard_normal(300).astype(np.float32)) for _ in range(3)] for _ in range(2)]

    def body(t, algorithm):
        model = torch.nn.Linear(20, 15)
        sync = GradSync(model, comm=t, algorithm=algorithm, schedule=GiftSchedule(error_feedback=True))
        out = []
        for step in range(3):
            for prm, g in zip(model.parameters(), (grads[t.rank][step][:300].view(15, 20), grads[t.rank][step][:15])):
                prm.grad = g.clone()
            sync.sync(step)
            out.append(b"".join(prm.grad.numpy().tobytes() for prm in model.parameters()))
        return out, list(sync.algorithms)

    mine = gc.LoopbackGroup(2).run(lambda t: body(t, NAME))
    twin = gc.LoopbackGroup(2).run(lambda t: body(t, "direct"))
    for (m, used), (w, _) in zip(mine, twin):
        assert m == w and set(used) == {NAME}


def test_the_cost_model_reads_the_row(row):
    topo = Topology(4, 1, 4)
    cal = load_calibration()
    assert predict(NAME, 1 << 20, topo, E4M3, 256, cal) == predict("direct", 1 << 20, topo, E4M3, 256, cal)
    assert simulate.resolve_algorithm("auto", 1 << 20, 4, None, "e4m3") != NAME  # auto=False: never chosen


def test_register_refuses_a_taken_name_or_a_row_without_its_code(row):
    with pytest.raises(ValueError, match="taken"):
        algorithms.register(row)
    with pytest.raises(ValueError, match="needs runner"):
        algorithms.register(dataclasses.replace(row, name="other", code=91, runner=None))
    with pytest.raises(ValueError, match="not a registered row"):
        algorithms.unregister("ring")


def test_the_choice_lists_copied_at_import_see_the_row(row):
    assert NAME in api.ALGORITHMS and NAME in gc.api.ALGORITHMS and api.ALGORITHMS == algorithms.CHOICES
    assert api.ALGORITHMS[-1] == NAME and NAME in algorithms.SCATTER_CHOICES and NAME in algorithms.NAMES
    assert row in algorithms.TABLE
    assert simulate.resolve_algorithm(NAME, 100, 2, None, "e4m3", kind="reduce_scatter") == NAME
    for adapter in (fsdp, process_group, sharded_sync):
        if adapter is not None:
            assert NAME in adapter.SCATTER_CHOICES, adapter.__name__
    if fsdp is not None:
        assert fsdp.GiftReduceScatter(algorithm=NAME).options.algorithm == NAME  # accepted where it is checked


def test_a_row_without_a_piece_says_so():
    lacking = dataclasses.replace(algorithms.BY_NAME["doubling"], name="other", code=91)
    with pytest.raises(ValueError, match="has no scatter_runner"):
        lacking.part("scatter_runner")
