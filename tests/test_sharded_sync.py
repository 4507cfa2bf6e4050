"""ShardedGradSync: a model's gradients reduce-scattered into equal shards of one padded flat
buffer (layout="equal"), over in-process ranks, against the simulation; parameters gathered back
exactly; bad models and options raise at once."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import UNKNOWN_FORMAT, torch_seeded

import giftcomm as gc
from giftcomm.adapters.torch import ShardedGradSync  # noqa: E402
from giftcomm.reference import simulate_reduce_scatter


def _model(seed=0, dtype=torch.float32):
    with torch_seeded(seed):
        return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).to(dtype)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float32), ("nvfp4", torch.bfloat16)])
def test_sync_gives_this_ranks_shard_of_the_padded_buffer(p, fmt, dtype):
    models = [_model(dtype=dtype) for _ in range(p)]
    xs = [torch.randn(4, 7, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(p)]

    def body(t):
        sync = ShardedGradSync(models[t.rank], comm=t, fmt=fmt, allow_native=False)  # giftcomm's own shards
        sync.zero_grad()
        models[t.rank](xs[t.rank]).square().sum().backward()
        flat = sync.buffer.float().numpy().copy()
        return sync, flat, sync.sync()

    got = gc.LoopbackGroup(p).run(body)
    n = got[0][0].numel
    padded = -(-n // p) * p
    assert all(g[1].size == padded and not g[1][n:].any() for g in got)  # zero padding
    grads = [torch.cat([q.grad.reshape(-1) for q in m.parameters()]).float().numpy() for m in models]
    assert all(np.array_equal(g[1][:n], gr) for g, gr in zip(got, grads))  # .grad are views of the buffer
    want = simulate_reduce_scatter([g[1] for g in got], fmt, None, "avg", layout="equal")
    for r, (sync, _, shard) in enumerate(got):
        assert (sync.lo, sync.hi) == (r * padded // p, (r + 1) * padded // p)
        assert shard.dtype == dtype
        np.testing.assert_array_equal(shard.float().numpy(), torch.from_numpy(want[r]).to(dtype).float().numpy())


def test_gather_params_writes_every_rank_the_same_parameters():
    p = 3
    models = [_model() for _ in range(p)]

    def body(t):
        sync = ShardedGradSync(models[t.rank], comm=t, fmt="e4m3")
        shard = sync.param_shard() + float(t.rank + 1)  # each rank changes only its shard
        sync.gather_params(shard)
        return torch.cat([q.detach().reshape(-1) for q in models[t.rank].parameters()]).numpy()

    got = gc.LoopbackGroup(p).run(body)
    base = torch.cat([q.detach().reshape(-1) for q in _model().parameters()]).numpy()
    n, per = base.size, -(-base.size // p)
    want = base + np.repeat(np.arange(1, p + 1, dtype=np.float32), per)[:n]
    assert all(np.array_equal(g, want) for g in got)


def test_bad_models_and_options_raise_at_once():
    t = gc.LoopbackGroup(1)
    with pytest.raises(TypeError, match="one dtype"):
        m = _model()
        m[2].to(torch.float64)
        t.run(lambda tr: ShardedGradSync(m, comm=tr))
    with pytest.raises(ValueError, match="algorithm"):
        t.run(lambda tr: ShardedGradSync(_model(), comm=tr, algorithm="doubling"))
    with pytest.raises(ValueError, match="ShardedGradSync"):
        t.run(lambda tr: ShardedGradSync(_model(), comm=tr, fmt=UNKNOWN_FORMAT))


def _gather_with_one_bad_rank(t, bad_rank):
    """gather_params where rank ``bad_rank`` passes a 2-D shard: (exception type name, message, seconds)."""
    import time

    sync = ShardedGradSync(_model(), comm=t, fmt="e4m3", timeout=20.0)
    shard = sync.param_shard()
    if t.rank == bad_rank:
        shard = shard.reshape(1, -1)  # the right number of values, the wrong shape
    t0 = time.perf_counter()
    try:
        sync.gather_params(shard)
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        return type(e).__name__, str(e), time.perf_counter() - t0
    return None, "", time.perf_counter() - t0


@pytest.mark.parametrize("p", [2, 3])
def test_gather_params_with_a_bad_shard_on_one_rank_raises_on_every_rank_at_once(p):
    got = gc.LoopbackGroup(p).run(lambda t: _gather_with_one_bad_rank(t, p - 1))
    assert [g[0] for g in got] == ["ValueError"] * p, got
    assert "got (1, " in got[p - 1][1] and all("another rank" in g[1] for g in got[: p - 1]), got
    assert all(g[2] < 10.0 for g in got), got  # well inside the 20 s deadline: nobody waited it out


@pytest.mark.mpi
@pytest.mark.multirank
def test_gather_params_with_a_bad_shard_on_one_rank_raises_on_every_rank_under_mpi():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    kind, msg, secs = _gather_with_one_bad_rank(gc.transport.resolve(comm), comm.size - 1)
    every = comm.allgather((kind, secs))
    assert [k for k, _ in every] == ["ValueError"] * comm.size, every
    assert max(s for _, s in every) < 10.0, every
