"""giftcomm.stats / reset_stats of the plain calls, and the one WARNING when ``auto`` replaces an
explicitly requested block-scaled format by the transport's own uncompressed collective.

Nodes of one rank (``local_size=1``) make ``auto`` choose ``native`` for small buffers with the
built-in calibration (giftcomm.resolve_algorithm says so; the test checks that first).
"""
from __future__ import annotations

import logging

import numpy as np
import pytest

import giftcomm as gc
from giftcomm.accounting import AUTO_NATIVE, sent_bytes
from giftcomm.formats import message_nbytes


def _warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and "allow_native=False" in r.getMessage()]


def test_fallback_warns_once_per_communicator_and_counts(caplog, rng):
    p, n = 2, 1000
    assert gc.resolve_algorithm("auto", n, p, 1, "e4m3") == "native"
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]

    def body(t):
        outs = [gc.allreduce(xs[t.rank], comm=t, fmt="e4m3", local_size=1) for _ in range(3)]
        gc.allreduce(xs[t.rank], comm=t, local_size=1)  # the default format: counted, not a fallback
        forced = gc.allreduce(xs[t.rank], comm=t, fmt="e4m3", local_size=1, allow_native=False)
        return outs, forced, gc.stats(t)

    for group in (gc.LoopbackGroup(p), gc.LoopbackGroup(p)):  # a second communicator warns again
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="giftcomm"):
            res = group.run(body)
        got = _warnings(caplog)
        assert len(got) == p, [r.getMessage() for r in got]  # one per rank's communicator, not per call
        assert all(AUTO_NATIVE in r.getMessage() and "e4m3" in r.getMessage() for r in got)
        want = gc.simulate_allreduce(xs, "e4m3", algorithm="native")[0]
        forced = gc.resolve_algorithm("auto", n, p, 1, "e4m3", allow_native=False)
        for r, (outs, out_forced, st) in enumerate(res):
            assert all(o.tobytes() == want.tobytes() for o in outs)
            assert out_forced.tobytes() == gc.simulate_allreduce(xs, "e4m3", algorithm=forced)[0].tobytes()
            assert st["calls"] == 5 and st["fallbacks"] == {AUTO_NATIVE: 3}
            assert st["algorithms"] == {"native": 4, forced: 1}
            assert st["bytes_sent"] == {"native": 4 * (2 * (p - 1) * n * 4 // p),
                                        "e4m3": sent_bytes(forced, n, p, r, "e4m3", 256)}


def test_no_warning_without_an_explicit_format_or_on_compressed_paths(caplog, rng):
    x = rng.standard_normal(500).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="giftcomm"):
        gc.LoopbackGroup(2).run(lambda t: [gc.allreduce(x, comm=t, local_size=1) for _ in range(2)])
        gc.LoopbackGroup(2).run(lambda t: gc.allreduce(x, comm=t, fmt="e4m3", algorithm="native", local_size=1))
        gc.LoopbackGroup(2).run(lambda t: gc.allreduce(x, comm=t, fmt="bf16", local_size=1))
    assert not _warnings(caplog)


def test_reset_and_reduce_scatter_allgather_counts(rng):
    p, n = 3, 3000
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]

    def body(t):
        gc.allreduce(xs[t.rank], comm=t, fmt="e4m3")
        gc.reset_stats(t)
        shard = gc.reduce_scatter(xs[t.rank], comm=t, fmt="e5m2", algorithm="ring")
        gc.allgather(shard, comm=t, fmt="e5m2")
        return shard.size, gc.stats(t)

    res = gc.LoopbackGroup(p).run(body)
    sizes = [s for s, _ in res]
    for r, (_, st) in enumerate(res):
        assert st["calls"] == 2 and st["algorithms"] == {"ring": 1, "allgather": 1} and st["fallbacks"] == {}
        msgs = [message_nbytes(s, "e5m2") for s in sizes]
        assert st["bytes_sent"]["e5m2"] == sent_bytes("ring", n, p, r, "e5m2", 256) + sum(msgs) - msgs[(r + 1) % p]


@pytest.mark.mpi
def test_stats_count_a_real_run_under_mpi():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.size != 2:
        pytest.skip("written for P = 2")
    gc.reset_stats(comm)
    x = np.ones(1024, np.float32)
    for _ in range(4):  # the first agrees, the rest run the cached plan
        gc.allreduce(x, comm=comm, fmt="e4m3")
    st = gc.stats(comm)
    algo = gc.resolve_algorithm("auto", 1024, 2, None, "e4m3")
    assert st["calls"] == 4 and st["algorithms"] == {algo: 4}
    assert st["bytes_sent"] == {"e4m3": 4 * sent_bytes(algo, 1024, 2, comm.rank, "e4m3", 256)}
    assert sent_bytes(algo, 1024, 2, comm.rank, "e4m3", 256) > 0


def _gloo_worker(rank, world):
    x = np.ones(1024, np.float32)
    for _ in range(3):
        gc.allreduce(x, fmt="e4m3")
    return gc.stats()


def test_stats_count_a_real_run_over_gloo(tmp_path):
    from test_torchrun import _spawn

    algo = gc.resolve_algorithm("auto", 1024, 2, None, "e4m3")
    for r, st in enumerate(_spawn(_gloo_worker, 2, str(tmp_path))):
        assert st["calls"] == 3 and st["algorithms"] == {algo: 3}
        assert st["bytes_sent"] == {"e4m3": 3 * sent_bytes(algo, 1024, 2, r, "e4m3", 256)}
