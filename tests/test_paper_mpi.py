"""MPI tests of the paper preset and the baseline wires: every rank's map identical after the
data-parallel average; errors on every rank; the live baseline wire matches the simulation.

Run: mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_paper_mpi.py (any P >= 2)
"""
from __future__ import annotations

import numpy as np
import pytest

from giftcomm.baselines import baseline_allreduce
from giftcomm.geometry import Geometry, InputFactorEstimator, Layout, refresh_geometry
from giftcomm.reference.simulate import simulate_allreduce

MPI = pytest.importorskip("mpi4py.MPI")

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
