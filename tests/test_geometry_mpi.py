"""MPI tests of giftcomm.geometry: every rank ends up with the same geometry.

Run: mpiexec -n 3 python -m pytest -m mpi --with-mpi tests/test_geometry_mpi.py
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from giftcomm.geometry import Geometry, KfacEstimator, Layout, SelectivePolicy

LAYOUT = Layout([("q", (48, 40)), ("q.bias", (48,)), ("up", (72, 40)), ("down", (40, 72)), ("norm", (40,))])


def comm_world():
    return MPI.COMM_WORLD


def shared_seed(comm) -> int:
    """A fresh seed drawn on rank 0 and shared, printed for reproduction."""
    seed = comm.bcast(int(np.random.SeedSequence().entropy % 2**63) if comm.Get_rank() == 0 else None)
    print(f"shared seed = {seed}")
    return seed


def feed_different_batches(est: KfacEstimator, rng, steps=4):
    """Each rank feeds its own random batches (rank-dependent count of rows and scales)."""
    r = MPI.COMM_WORLD.Get_rank()
    for _ in range(steps):
        for name in est.segments:
            m, n = LAYOUT[name].matrix_shape
            rows = 20 + 7 * r
            a = rng.standard_normal((rows, n)) * np.linspace(0.1, 3.0 + r, n)
            d = rng.standard_normal((rows, m)) @ rng.standard_normal((m, m)) / np.sqrt(m)
            est.update(name, a, d)


def assert_same_everywhere(comm, geo: Geometry, probe: np.ndarray):
    fps = comm.allgather(geo.fingerprint())
    assert len(set(fps)) == 1, fps
    y = geo.forward(probe)
    z = geo.inverse(y)
    ys = comm.allgather(y.tobytes())
    zs = comm.allgather(z.tobytes())
    assert all(b == ys[0] for b in ys) and all(b == zs[0] for b in zs)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["allreduce", "broadcast"])
@pytest.mark.parametrize("rank", [None, 6])
def test_sync_gives_identical_geometry(mode, rank):
    comm = comm_world()
    seed = shared_seed(comm)
    local = np.random.default_rng([seed, comm.Get_rank()])  # different data on every rank
    est = KfacEstimator(LAYOUT, decay=0.8, mode=mode)
    feed_different_batches(est, local)
    # the local factors really differ between ranks
    a_q = est.factors()["q"][0]
    assert len(set(comm.allgather(a_q.tobytes()))) == comm.Get_size()
    report = est.sync(comm)
    assert report.mode == mode and report.factors == 2 * len(est.segments)
    # MPICH's SUM on doubles is bit-identical on all ranks: the allreduce path needs no repair
    assert report.repaired == 0
    geo = est.geometry(rank=rank)
    assert [t.kind for t in geo.transforms].count("identity") == 2  # bias and norm
    probe = np.random.default_rng(seed).standard_normal(LAYOUT.size).astype(np.float32)
    assert_same_everywhere(comm, geo, probe)
    pol = est.geometry(policy=SelectivePolicy(min_size=100, max_rank=8, flops_per_gain=1e6))
    assert_same_everywhere(comm, pol, probe)


@pytest.mark.mpi
def test_both_modes_give_the_same_factor_average():
    comm = comm_world()
    seed = shared_seed(comm)
    geos = {}
    for mode in ("allreduce", "broadcast"):
        est = KfacEstimator(LAYOUT, decay=0.8)
        feed_different_batches(est, np.random.default_rng([seed, comm.Get_rank()]))
        est.sync(comm, mode=mode)
        geos[mode] = est.geometry()
    # the synced factors are the mean of every rank's local factors
    est = KfacEstimator(LAYOUT, decay=0.8)
    feed_different_batches(est, np.random.default_rng([seed, comm.Get_rank()]))
    mean = {k: tuple(sum(comm.allgather(f)) / comm.Get_size() for f in pair) for k, pair in est.factors().items()}
    ref = Geometry.from_kfac(LAYOUT, mean)
    probe = np.random.default_rng(seed).standard_normal(LAYOUT.size).astype(np.float32)
    for mode, geo in geos.items():
        np.testing.assert_allclose(geo.forward(probe), ref.forward(probe), rtol=1e-4, atol=1e-4, err_msg=mode)


@pytest.mark.mpi
def test_segments_fed_on_some_ranks_only():
    comm = comm_world()
    rng = np.random.default_rng([shared_seed(comm), comm.Get_rank()])
    est = KfacEstimator(LAYOUT, decay=0.8, segments=["q", "up"])
    if comm.Get_rank() == 0:  # only rank 0 feeds "up"; every rank feeds "q"
        est.update("up", rng.standard_normal((30, 40)), rng.standard_normal((30, 72)))
    est.update("q", rng.standard_normal((30, 40)), rng.standard_normal((30, 48)))
    for mode in ("allreduce", "broadcast"):
        est.sync(comm, mode=mode)
        geo = est.geometry()
        assert geo["q"].kind == "kfac-full" and geo["up"].kind == "kfac-full"
        assert_same_everywhere(comm, geo, np.ones(LAYOUT.size, np.float32))


@pytest.mark.mpi
def test_agree_repairs_a_diverging_rank():
    comm = comm_world()
    rng = np.random.default_rng(shared_seed(comm))
    factors = {"q": (np.eye(40) + 0.1 * np.diag(rng.random(40)), np.eye(48))}
    if comm.Get_rank() == comm.Get_size() - 1:
        factors["q"][0][0, 0] += 1e-3  # the last rank diverges (at P = 1 there is nothing to repair)
    geo = Geometry.from_kfac(LAYOUT, factors)
    assert len(set(comm.allgather(geo.fingerprint()))) == min(comm.Get_size(), 2)
    fixed = geo.agree(comm, root=0)
    assert_same_everywhere(comm, fixed, np.ones(LAYOUT.size, np.float32))
    assert comm.allgather(fixed.fingerprint())[0] == comm.bcast(geo.fingerprint(), root=0)
