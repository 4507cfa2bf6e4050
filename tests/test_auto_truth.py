"""One truth for ``algorithm="auto"``: on every transport path the algorithm a call runs (what
``engine.last_algorithm`` reports) is ``giftcomm.resolve_algorithm`` of the call's arguments, and
the result equals ``giftcomm.simulate_allreduce(..., algorithm="auto")`` bit for bit.

Sizes 1..2^20 (powers of two and odd sizes), every format, sampled (each size meets a few
formats, rotating, so that every format meets small, middle and large sizes); each call is made
twice, so the second runs the plan the plain call cached where the ranks share a node's memory.
Under mpiexec (MPI's shared window and plan channel; P = 1..5 as tests/run_all.sh runs it) and
under torch.distributed over gloo (spawned ranks with torchrun's environment; P = 2..5, a random
half or third of the cases per run).
"""
from __future__ import annotations

import numpy as np
import pytest

import giftcomm as gc
from giftcomm.collectives import engine

FORMATS = list(gc.FORMATS)
SIZES = [1, 2, 3, 5, 8, 33, 64, 255, 256, 1000, 1024, 4097, 4099, 4100, 8192, 16383, 65536, 100_003, 262_144,
         262_145, 1 << 20]


def sweep(seed: int, p: int) -> list[tuple[int, str, list[np.ndarray]]]:
    """(n, fmt, every rank's input) of the sweep: 2 formats per size (1 above 2^18 values), rotating."""
    rng = np.random.default_rng(seed)
    cases = []
    for i, n in enumerate(SIZES):
        for k in range(1 if n > 1 << 18 else 2):
            fmt = FORMATS[(2 * i + k + seed) % len(FORMATS)]
            xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
            cases.append((n, fmt, xs))
    return cases


def _within_native_order(y: np.ndarray, xs: list[np.ndarray], want: np.ndarray, fmt: str) -> bool:
    """``y`` equals the simulation's recursive-doubling sum ``want`` up to the order of the
    additions: within P units of rounding (of the type the native path adds in: bf16, fp16, else
    float32) of the sum of magnitudes, element by element (the bound giftcomm.collectives.native
    states for gloo's ring and NCCL)."""
    eps = {"bf16": 2.0**-7, "fp16": 2.0**-10}.get(fmt, 2.0**-23)
    mags = np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)
    bound = len(xs) * eps * mags + float(np.finfo(np.float32).tiny)
    return bool(np.all(np.abs(y.astype(np.float64) - want.astype(np.float64)) <= bound))


def run_sweep(t, seed: int, largest: int = 1 << 20, every: int = 1,
              native_exact: bool = True) -> list[tuple[int, str, str, str, bool]]:
    """(n, fmt, algorithm run, resolve_algorithm's, result == simulation) for every ``every``-th
    case (counting from ``seed``) of at most ``largest`` values. ``native_exact`` False: a call
    that ran the transport's own allreduce (gloo's ring, whose order of additions is not MPICH's)
    counts as right within that order's rounding (:func:`_within_native_order`)."""
    got = []
    for i, (n, fmt, xs) in enumerate(sweep(seed, t.size)):
        if n > largest or (i + seed) % every:
            continue
        want = gc.simulate_allreduce(xs, fmt, algorithm="auto")[0]
        expect = gc.resolve_algorithm("auto", n, t.size, None, fmt)
        for _ in range(2 if t.shared_memory else 1):  # the second call: the plan the first one cached
            y = gc.allreduce(xs[t.rank], comm=t, fmt=fmt)
            ran = engine.last_algorithm(t)[0]
            right = y.tobytes() == want.tobytes()
            if not right and ran == "native" and not native_exact:
                right = _within_native_order(np.asarray(y), xs, want, fmt)
            got.append((n, fmt, ran, expect, right))
    return got


def check(got) -> None:
    wrong = [g for g in got if g[2] != g[3] or not g[4]]
    assert not wrong, wrong[:5]


@pytest.mark.mpi
def test_auto_runs_what_resolve_algorithm_says_under_mpi():
    from mpi4py import MPI

    from giftcomm.transport import resolve

    comm = MPI.COMM_WORLD
    seed = comm.bcast(int(np.random.SeedSequence().entropy % (2**16)) if comm.rank == 0 else None)
    check(run_sweep(resolve(comm), seed))


def _gloo_worker(rank, world, seed):
    from giftcomm.transport.torch_dist import default_transport

    # a share of the cases each, at random (every size up to 2^20 meets the sweep over the seeds;
    # gloo is slow on 2 cores, and the decision does not depend on the bytes)
    return run_sweep(default_transport(), seed, every=2 if world <= 3 else 3, native_exact=False)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_auto_runs_what_resolve_algorithm_says_over_gloo(tmp_path, world):
    from test_torchrun import _spawn

    seed = int(np.random.default_rng().integers(2**16))
    for got in _spawn(_gloo_worker, world, str(tmp_path), seed):
        check(got)


def test_resolve_algorithm_is_the_decision_of_every_call_kind():
    """reduce_scatter's auto chooses among its rows; allow_native=False never gives native."""
    for n in (1, 100, 5000, 1 << 16, 1 << 20):
        for p in (2, 3, 5):
            rs = gc.resolve_algorithm("auto", n, p, None, "e4m3", kind="reduce_scatter")
            assert rs in ("ring", "direct", "native")
            assert gc.resolve_algorithm("auto", n, p, None, "e4m3", allow_native=False) != "native"
    with pytest.raises(ValueError, match="kind"):
        gc.resolve_algorithm("auto", 10, 2, None, "e4m3", kind="allgather")
