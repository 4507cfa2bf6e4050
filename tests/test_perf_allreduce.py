"""The allreduce sweep of ``python -m giftcomm.perf allreduce`` (the main job) under mpiexec."""
from __future__ import annotations

import numpy as np
import pytest

from giftcomm.perf.collective_bench import run_allreduce_sweep

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_sweep_rows_match_the_simulation(op):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    seed = comm.bcast(int(np.random.default_rng().integers(1 << 30)), root=0)
    sizes, fmts = [4096, 65536], ["e4m3", "bf16", "fp32"]
    seen = []
    rows = run_allreduce_sweep(comm, sizes, fmts, "float32", op, 256, iters=2, warmup=1, check=True,
                               seed=seed, progress=False, on_row=seen.append)
    assert rows == seen
    assert [(r.size, r.fmt) for r in rows] == [(s, f) for s in sizes for f in fmts + ["mpi"]]
    for r in rows:
        assert r.time_us > 0 and r.count == r.size // 4
        if r.fmt == "mpi":
            assert r.wrong is None and r.relerr < 1e-6
        else:
            assert r.wrong == 0  # equal to the reference simulation, bit for bit, on every rank
    err = {r.fmt: r.relerr for r in rows if r.size == 65536}
    # FP8 errs more than bf16, bf16 more than fp32 (random normal data, well above rounding)
    assert err["e4m3"] > err["bf16"] > err["fp32"] or comm.size == 1
    assert 0.005 < err["e4m3"] < 0.1 or comm.size == 1
