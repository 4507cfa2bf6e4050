"""giftcomm.stats / reset_stats of the plain calls, and the one WARNING when ``auto`` replaces an
explicitly requested block-scaled format by the transport's own uncompressed collective.

Nodes of one rank (``local_size=1``) make ``auto`` choose ``native`` for small buffers with the
built-in calibration (giftcomm.resolve_algorithm says so; the test checks that first).
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import torch_seeded

import giftcomm as gc
from giftcomm import GiftSchedule
from giftcomm.accounting import AUTO_NATIVE, scatter_sent_bytes, sent_bytes
from giftcomm.collectives import engine
from giftcomm.collectives.hold import held
from giftcomm.formats import get_format, message_nbytes
from giftcomm.options import call_options

E4M3 = get_format("e4m3")  # the cost and byte formulas take the Format


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
                                        "e4m3": sent_bytes(forced, n, p, r, E4M3, 256)}


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
        # the reduce-scatter: every chunk's message but this rank's; the allgather: every shard but the next rank's
        assert st["bytes_sent"]["e5m2"] == sum(msgs) - msgs[r] + sum(msgs) - msgs[(r + 1) % p]


@pytest.mark.mpi
@pytest.mark.multirank
def test_stats_count_a_real_run_under_mpi():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p = comm.size
    gc.reset_stats(comm)
    x = np.ones(1024, np.float32)
    for _ in range(4):  # the first agrees, the rest run the cached plan
        gc.allreduce(x, comm=comm, fmt="e4m3")
    st = gc.stats(comm)
    algo = gc.resolve_algorithm("auto", 1024, p, None, "e4m3")
    assert st["calls"] == 4 and st["algorithms"] == {algo: 4}
    assert st["bytes_sent"] == {"e4m3": 4 * sent_bytes(algo, 1024, p, comm.rank, E4M3, 256)}
    assert sent_bytes(algo, 1024, p, comm.rank, E4M3, 256) > 0


@pytest.mark.mpi
@pytest.mark.multirank
def test_persistent_plans_count_every_execution_under_mpi():
    """A plan counts each call, through every path of its call (the node-shared channel's C fast
    path, the native row's, the engine's), under MPI's world as comm=None and COMM_WORLD ask."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p, r = comm.size, comm.rank
    gc.reset_stats()
    x = np.ones(1024, np.float32)
    fast = gc.plan_allreduce(x, fmt="e4m3", algorithm="oneshot")  # float32, nearest: C through the channel
    native = gc.plan_allreduce(x, fmt="e4m3", algorithm="native")
    ring = gc.plan_allreduce(x.astype(np.float64), fmt="e5m2", algorithm="ring")
    for _ in range(3):
        fast(x)
        native(x)
    ring(x.astype(np.float64))
    st = gc.stats()
    assert st == gc.stats(comm)
    assert st["calls"] == 7 and st["algorithms"] == {"oneshot": 3, "native": 3, "ring": 1} and st["fallbacks"] == {}
    assert st["bytes_sent"] == {"e4m3": 3 * sent_bytes("oneshot", 1024, p, r, E4M3, 256),
                                "native": 3 * (2 * (p - 1) * 1024 * 4 // p),
                                "e5m2": sent_bytes("ring", 1024, p, r, get_format("e5m2"), 256)}


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
        assert st["bytes_sent"] == {"e4m3": 3 * sent_bytes(algo, 1024, 2, r, E4M3, 256)}


def _model(seed: int):
    import torch

    with torch_seeded(seed):
        return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 7))


def test_adapters_count_what_they_sent_and_warn_once(caplog):
    """GradSync, ShardedGradSync and TreeSync: stats() counts their own calls only (a plain call on
    the same communicator is not theirs), nodes of one rank make auto go native and warn once."""
    import torch

    from giftcomm.adapters.jax import TreeSync
    from giftcomm.adapters.torch import GradSync, ShardedGradSync

    p = 2
    models = [_model(1) for _ in range(p)]
    n = sum(q.numel() for q in models[0].parameters())

    def body(t):
        torch.set_num_threads(1)
        model = models[t.rank]
        for q in model.parameters():
            q.grad = torch.ones_like(q)
        sync = GradSync(model, comm=t, fmt="e4m3", bucket_mb=1)  # one bucket
        for _ in range(2):
            sync.sync()
        gc.allreduce(np.ones(10, np.float32), comm=t)  # not GradSync's
        sharded = ShardedGradSync(_model(1), comm=t, fmt="e5m2", allow_native=False)
        sharded.sync()
        sharded.gather_params(sharded.param_shard())
        tree = TreeSync(comm=t, fmt="e4m3", schedule=GiftSchedule(geometry="reduced", refresh_every=10**6,
                        estimate_every=1))
        tree({"w": np.ones(50, np.float32)})
        return sync.stats(), sharded.stats(), tree.stats(), gc.stats(t)

    with caplog.at_level(logging.WARNING, logger="giftcomm"):
        res = gc.LoopbackGroup(p).run(body)
    for r, (grad, sharded, tree, plain) in enumerate(res):
        algo = gc.resolve_algorithm("auto", n, p, None, "e4m3")
        assert grad["calls"] == 2 and grad["algorithms"] == {algo: 2}
        key = "native" if algo == "native" else "e4m3"
        assert grad["bytes_sent"] == {key: 2 * sent_bytes(algo, n, p, r, E4M3, 256)} and grad["bytes_sent"][key] > 0
        assert sharded["calls"] == 2 and sharded["fallbacks"] == {} and sharded["algorithms"]["allgather"] == 1
        assert sum(sharded["algorithms"].get(a, 0) for a in ("ring", "direct")) == 1  # allow_native=False
        assert set(sharded["bytes_sent"]) == {"e5m2", "fp32"}  # its parameters gather on the fp32 wire
        assert tree["calls"] == 1 and set(tree) == {"calls", "bytes_sent", "algorithms", "fallbacks"}
        assert plain["calls"] == grad["calls"] + sharded["calls"] + tree["calls"] + 1
    assert not _warnings(caplog)  # one node: auto compresses these sizes


def test_an_adapter_warns_once_when_auto_goes_native(caplog):
    """Nodes of one rank (local_size=1 through the transport's node layout is not an adapter
    option, so: a transport whose nodes are one rank each) make auto go native."""
    import torch

    from giftcomm.adapters.torch import GradSync

    p = 2
    models = [_model(2) for _ in range(p)]
    n = sum(q.numel() for q in models[0].parameters())
    assert gc.resolve_algorithm("auto", n, p, 1, "e4m3") == "native"

    def body(t):
        torch.set_num_threads(1)
        t.node_ids = lambda: np.arange(t.size)  # every rank its own node (as on p hosts)
        for q in models[t.rank].parameters():
            q.grad = torch.ones_like(q)
        sync = GradSync(models[t.rank], comm=t, fmt="e4m3", bucket_mb=1)
        for _ in range(3):
            sync.sync()
        return sync.stats()

    with caplog.at_level(logging.WARNING, logger="giftcomm"):
        res = gc.LoopbackGroup(p).run(body)
    assert len(_warnings(caplog)) == p  # once per rank's communicator, not per call
    for st in res:
        assert st["fallbacks"] == {AUTO_NATIVE: 3} and st["bytes_sent"] == {"native": 3 * (2 * (p - 1) * n * 4 // p)}


@pytest.mark.parametrize("p", [2, 3, 5])
def test_sent_bytes_is_what_the_message_path_sends(rng, p):
    """sent_bytes of giftcomm's rows equals the bytes each rank's isend calls carry over the
    loopback transport's messages (no shared window)."""
    n = int(rng.integers(3000, 9000))
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    algos = ("ring", "direct", "oneshot", "doubling")

    def body(t):
        sent = [0]
        isend = t.isend

        def counting(buf, dest, tag=0):
            sent[0] += buf.nbytes
            return isend(buf, dest, tag)

        t.isend = counting
        got = {}
        for algo in algos:
            gc.allreduce(xs[t.rank], comm=t, fmt="e4m3", algorithm=algo)  # agree first: its words are not data
            before = sent[0]
            with held(t, None):
                job = engine.agree_call(t, engine.ALLREDUCE, xs[t.rank], None, gc_opts(algo))
                mid = sent[0]
                engine.ALLREDUCE.run(t, job, None)
            got[algo] = sent[0] - mid, mid - before
        return got

    for r, got in enumerate(gc.LoopbackGroup(p).run(body)):
        for algo in algos:
            assert got[algo][0] == sent_bytes(algo, n, p, r, E4M3, 256), (algo, r, got[algo])


def gc_opts(algo):
    return call_options({"fmt": "e4m3", "algorithm": algo})


@pytest.mark.parametrize("p", [2, 3, 5])
def test_reduce_scatter_counts_what_its_message_path_sends(rng, p):
    """A reduce-scatter (ring, direct; both layouts) counts one message of every chunk but this
    rank's -- the bytes its isend calls carry over the loopback transport, half an allreduce's
    (it used to be counted as a whole allreduce) -- and giftcomm.stats reports that."""
    n = int(rng.integers(3000, 9000)) * p
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    cases = [(algo, layout) for algo in ("ring", "direct") for layout in ("blocks", "equal")]

    def body(t):
        sent = [0]
        isend = t.isend

        def counting(buf, dest, tag=0):
            sent[0] += buf.nbytes
            return isend(buf, dest, tag)

        t.isend = counting
        got = {}
        for algo, layout in cases:
            kind = engine.REDUCE_SCATTERS[layout]
            gc.reset_stats(t)
            with held(t, None):
                job = engine.agree_call(t, kind, xs[t.rank], None, gc_opts(algo))
                mid = sent[0]
                kind.run(t, job, None)
            ran = sent[0] - mid
            gc.reduce_scatter(xs[t.rank], comm=t, fmt="e4m3", algorithm=algo, layout=layout)
            got[algo, layout] = ran, tuple(int(b) for b in job.bounds), gc.stats(t)["bytes_sent"]
        return got

    for r, got in enumerate(gc.LoopbackGroup(p).run(body)):
        for case in cases:
            ran, bounds, counted = got[case]
            assert ran == scatter_sent_bytes(bounds, r, E4M3, 256) > 0, (case, r)
            assert counted == {"e4m3": ran}, (case, r)
            assert 2 * ran < sent_bytes(case[0], n, p, r, E4M3, 256) + 2 * message_nbytes(n // p + 256, "e4m3")
