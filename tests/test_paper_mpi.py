"""MPI tests of the paper preset and the baseline wires: every rank's map identical after the
data-parallel average; errors on every rank; the live baseline wire matches the simulation.

Run: mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_paper_mpi.py (any P >= 2)
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from giftcomm import GiftSchedule
from giftcomm.collectives.baselines import baseline_allreduce
from giftcomm.geometry import Geometry, InputFactorEstimator, Layout, refresh_geometry
from giftcomm.reference.simulate import simulate_allreduce

LAYOUT = Layout([("up", (24, 40)), ("up.bias", (24,)), ("down", (40, 24))])


def shared_rng(comm):
    seed = comm.bcast(int(np.random.SeedSequence().entropy % 2**63) if comm.Get_rank() == 0 else None)
    return np.random.default_rng(seed)


@pytest.mark.mpi
def test_paper_map_identical_on_every_rank():
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rng = np.random.default_rng([rank, int(shared_rng(comm).integers(2**31))])
    est = InputFactorEstimator(LAYOUT)
    for _ in range(3):
        for name in est.segments:
            n = LAYOUT[name].matrix_shape[1]
            est.update(name, rng.standard_normal((30 + 5 * rank, n)) * np.linspace(0.2, 4.0 + rank, n))
    geo = refresh_geometry(comm, LAYOUT, est.factors(), step=50)
    assert len(set(comm.allgather(geo.fingerprint()))) == 1
    probe = shared_rng(comm).standard_normal(LAYOUT.size).astype(np.float32)
    ys = comm.allgather(geo.forward(probe).tobytes())
    assert all(y == ys[0] for y in ys)
    every = comm.allgather(est.factors())
    mean = {n: sum(f[n] for f in every) / len(every) for n in every[0]}
    np.testing.assert_allclose(geo.forward(probe), Geometry.preset("paper", LAYOUT, mean).forward(probe), rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
@pytest.mark.multirank  # ranks that differ: needs P >= 2
def test_paper_refresh_errors_on_every_rank():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    a = np.eye(40)
    factors = {"up": a} if rank == size - 1 else {"up": a, "down": np.eye(24)}
    with pytest.raises(RuntimeError, match="disagree"):
        refresh_geometry(comm, LAYOUT, factors, step=50)
    with pytest.raises(RuntimeError, match="disagree"):
        refresh_geometry(comm, LAYOUT, {"up": a}, step=50 + (rank == 0))
    with pytest.raises(ValueError, match="not positive definite"):
        refresh_geometry(comm, LAYOUT, {"up": -a * (1 + rank)}, step=50)


@pytest.mark.mpi
@pytest.mark.parametrize("wire", ["e5m2/tensor-nccl", "e5m2/tensor-local"])
def test_baseline_wire_live_matches_simulation(wire):
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rng = shared_rng(comm)
    xs = [(rng.standard_normal(1001) * (1 + r)).astype(np.float32) for r in range(comm.Get_size())]
    got = baseline_allreduce(xs[rank], wire, comm=comm, op="avg")
    np.testing.assert_array_equal(got, simulate_allreduce(xs, wire, op="avg")[rank])
    same = comm.allgather(got.tobytes())
    # the "local" wire's ranks decode with their own scales, so they disagree once there are two
    agree = all(s == same[0] for s in same)
    assert agree == (wire.endswith("nccl") or comm.Get_size() == 1)


# ------------------------------------------------------------ the preset from the entry points
def _mlp(seed, skip_down=False):
    import torch

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(40, 24), torch.nn.Linear(24, 40)

        def forward(self, x):
            h = torch.relu(self.up(x))
            return h.sum(-1, keepdim=True) if skip_down else self.down(h)

    torch.manual_seed(seed)
    return Mlp()


@pytest.mark.mpi
@pytest.mark.parametrize("sharded", [False, True])
def test_paper_from_grad_sync_one_map_on_every_rank(sharded):
    """GradSync / ShardedGradSync(geometry="paper") under MPI: every rank the same map at every
    step (refreshed every 2 syncs), the same reduced gradients (GradSync)."""
    import torch

    from giftcomm.adapters.torch import GradSync, ShardedGradSync

    comm = MPI.COMM_WORLD
    seed = int(shared_rng(comm).integers(2**31))
    model = _mlp(seed)
    cls = ShardedGradSync if sharded else GradSync
    sync = cls(model, comm=comm, fmt="e4m3", geometry="paper", paper={"refresh_every": 2, "rank": 4, "profile_steps": 0})
    rng = np.random.default_rng([seed, comm.Get_rank()])
    fps = []
    for _ in range(3):
        sync.zero_grad()
        x = torch.from_numpy((rng.standard_normal((32, 40)) * np.linspace(0.1, 5, 40)).astype(np.float32))
        model(x).pow(2).mean().backward()
        got = sync.sync()
        geo = sync.geometry_of if sharded else sync.geometries[0]
        fps.append(geo.fingerprint())
        if not sharded:
            grads = b"".join(p.grad.numpy().tobytes() for p in model.parameters())
            assert len(set(comm.allgather(grads))) == 1
        else:
            assert got.shape == (sync.hi - sync.lo,)
    every = comm.allgather(fps)
    assert all(f == every[0] for f in every)
    assert fps[0] == fps[1] != fps[2]


@pytest.mark.mpi
@pytest.mark.multirank  # ranks that differ: needs P >= 2
def test_paper_from_grad_sync_missing_factor_raises_on_every_rank():
    import torch

    from giftcomm.adapters.torch import GradSync

    comm = MPI.COMM_WORLD
    model = _mlp(0, skip_down=comm.Get_rank() == comm.Get_size() - 1)
    sync = GradSync(model, comm=comm, schedule=GiftSchedule(geometry="paper", paper={"profile_steps": 0}))
    sync.zero_grad()
    model(torch.ones(4, 40)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="disagree on the factor refresh"):
        sync.sync()


@pytest.mark.mpi
def test_paper_plan_bit_identical_to_gift_allreduce():
    import giftcomm as gc

    comm = MPI.COMM_WORLD
    rng = np.random.default_rng([int(shared_rng(comm).integers(2**31)), comm.Get_rank()])
    est = InputFactorEstimator(LAYOUT)
    for name in est.segments:
        est.update(name, rng.standard_normal((64, LAYOUT[name].matrix_shape[1])))
    geo = refresh_geometry(comm, LAYOUT, est.factors(), step=0)
    x = rng.standard_normal(LAYOUT.size).astype(np.float32)
    plan = gc.plan_allreduce(x, comm=comm, geometry=geo, op="avg")
    want = gc.gift_allreduce(x, geo, comm=comm, op="avg", algorithm=plan.algorithm)
    got = plan(x)
    assert got.tobytes() == want.tobytes()
    assert len(set(comm.allgather(got.tobytes()))) == 1
    with pytest.raises(ValueError, match="Geometry.preset"):
        gc.gift_allreduce(x, "paper", comm=comm)


# ------------------------------------------------------------ the refresh inside the agreement
@pytest.mark.mpi
@pytest.mark.multirank  # ranks that differ: needs P >= 2
@pytest.mark.parametrize("sharded", [False, True])
def test_paper_sync_counters_off_by_one_raise_the_same_error_on_every_rank(sharded):
    """A rank one sync ahead (checkpoints of different steps, a skipped sync): every rank raises
    the same ValueError at the refresh's agreement, at once (no MPI error, no deadline wait)."""
    import time

    import torch

    from giftcomm.adapters.torch import GradSync, ShardedGradSync

    comm = MPI.COMM_WORLD
    seed = int(shared_rng(comm).integers(2**31))
    model = _mlp(seed)
    cls = ShardedGradSync if sharded else GradSync
    sync = cls(model, comm=comm, fmt="e4m3", geometry="paper", paper={"refresh_every": 2, "rank": 4, "profile_steps": 0}, timeout=30)
    x = torch.from_numpy(np.random.default_rng([seed, comm.Get_rank()]).standard_normal((16, 40)).astype(np.float32))
    sync.zero_grad()
    model(x).pow(2).mean().backward()
    sync.sync()
    if comm.Get_rank() == 0:
        sync.calls += 1  # rank 0 skipped a sync: its next one (2) refreshes, the others' (1) do not
    sync.zero_grad()
    model(x).pow(2).mean().backward()
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="the ranks disagree on when or how to refresh") as err:
        sync.sync()
    assert time.perf_counter() - t0 < 10
    assert "sync (rank 0: 2, rank 1: 1" in str(err.value)
    assert len(set(comm.allgather(str(err.value)))) == 1
    comm.Barrier()  # the communicator is still usable


@pytest.mark.mpi
@pytest.mark.parametrize("sharded", [False, True])
def test_paper_state_dict_resumes_bit_identical_under_mpi(sharded):
    """Saved between refreshes (sync 3 of refresh_every 2) and loaded into a fresh sync: the next
    syncs equal the uninterrupted run's bit for bit."""
    import pickle

    import torch

    from giftcomm.adapters.torch import GradSync, ShardedGradSync

    comm = MPI.COMM_WORLD
    seed = int(shared_rng(comm).integers(2**31))
    cls = ShardedGradSync if sharded else GradSync

    def run(start, stop, blob=None, save_at=None):
        model = _mlp(seed)
        sync = cls(model, comm=comm, fmt="e4m3", geometry="paper", paper={"refresh_every": 2, "rank": 4, "profile_steps": 0},
                   error_feedback=True)
        if blob is not None:
            params, state = pickle.loads(blob)
            model.load_state_dict(params)
            sync.load_state_dict(state)
        out, saved = [], None
        for step in range(start, stop):
            if step == save_at:
                saved = pickle.dumps((model.state_dict(), sync.state_dict()))
            x = torch.from_numpy(np.random.default_rng([seed, comm.Get_rank(), step]).standard_normal((16, 40))
                                 .astype(np.float32))
            sync.zero_grad()
            model(x).pow(2).mean().backward()
            got = sync.sync()
            out.append(got.numpy().tobytes() if sharded else b"".join(p.grad.numpy().tobytes()
                                                                      for p in model.parameters()))
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
        return out, saved

    whole, saved = run(0, 6, save_at=3)
    resumed, _ = run(3, 6, blob=saved)
    assert resumed == whole[3:]


@pytest.mark.mpi
def test_paper_factor_not_finite_in_float32_raises_on_every_rank():
    comm = MPI.COMM_WORLD
    with pytest.raises(ValueError, match="'up' is not finite in float32") as err:
        refresh_geometry(comm, LAYOUT, {"up": 1e80 * np.eye(40)}, step=0)
    assert len(set(comm.allgather(str(err.value)))) == 1


@pytest.mark.mpi
def test_every_rank_selects_the_same_weights_from_its_own_scores():
    """GradSync(geometry="paper") under MPI, ranks with different local saturation: rank 0's
    layer a saturates fully, rank 1's layer b fully, and every other rank saturates layer a on 60%
    of its entries. The selection is the rule applied to the scores averaged over the ranks,
    identical on every rank, although rank 0's own scores pick a and rank 1's pick b (which of
    the two the average picks depends on the unsaturated layers' scores, so it is not fixed here)."""
    import torch
    from test_paper_selection import WIDTH, Stack, saturate

    from giftcomm.adapters.torch import GradSync
    from giftcomm.geometry.paper import PaperOptions, select_for

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rng = shared_rng(comm)
    seed = int(rng.integers(2**31))
    a, b = (int(x) for x in rng.choice(4, 2, replace=False))
    torch.manual_seed(seed)
    model = Stack()
    if rank == 0:
        saturate(model.layers[a].weight)
    elif rank == 1:
        saturate(model.layers[b].weight)
    else:
        saturate(model.layers[a].weight, fraction=0.6, seed=rank)
    sync = GradSync(model, comm=comm, fmt="e4m3",
                    schedule=GiftSchedule(geometry="paper", paper={"rank": 4, "profile_steps": 3, "top_n": 1}))
    g = np.random.default_rng([seed, rank])
    for _ in range(4):
        sync.zero_grad()
        model(torch.from_numpy(g.standard_normal((32, WIDTH)).astype(np.float32))).pow(2).mean().backward()
        sync.sync()
    local = sync.refresh.profile.scores()
    every = comm.allgather(local)
    mean = {n: sum(s[n] for s in every) / len(every) for n in local}
    chosen = comm.allgather(sync.refresh.selected)
    assert all(c == chosen[0] for c in chosen)
    assert chosen[0] == select_for(PaperOptions(top_n=1), mean)
    # the ranks' own scores pick different weights (rank 0 a, rank 1 b): only the average agrees
    own = comm.allgather(select_for(PaperOptions(top_n=1), local))
    assert own[0] == (f"layers.{a}.weight",)
    assert comm.Get_size() == 1 or own[1] == (f"layers.{b}.weight",)
    fps = comm.allgather([geo.fingerprint() for geo in sync.geometries])
    assert all(f == fps[0] for f in fps)
