"""PyTorch adapter: torch.distributed transport, DDP comm hook, GradSync, KFAC capture, DLPack.

Worlds of torch.distributed (gloo) ranks are separate processes started here (spawn), joined by
a ``file://`` rendezvous; each writes its verdicts to a pickle that the test reads back.
"""
from __future__ import annotations

import datetime
import os
import pickle

import numpy as np
import pytest
import torch
from conftest import spawn_ranks, torch_seeded

import giftcomm
from giftcomm import GiftSchedule
from giftcomm.adapters.torch import GradSync, KfacCapture, build_geometries, make_buckets, model_layout, numpy_view
from giftcomm.geometry import Geometry, KfacEstimator, SelectivePolicy
from giftcomm.reference import simulate_allreduce

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- helpers
def _mlp(seed: int, widths=(24, 40, 16)) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    with torch_seeded(seed):
        for i in range(len(widths) - 1):
            layers += [torch.nn.Linear(widths[i], widths[i + 1]), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _spawn_world(target, world: int, tmp_path, *args) -> list[dict]:
    """Run target(rank, world, init_file, out_file, *args) in ``world`` spawned processes."""
    init = os.path.join(tmp_path, "rendezvous")
    return spawn_ranks(world, tmp_path, lambda r, out: (target, (r, world, init, out, *args)))


def _init(rank: int, world: int, init: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


# ----------------------------------------------------------------------------- transport
def _transport_worker(rank, world, init, out, seed, sizes):
    _init(rank, world, init)
    import torch.distributed as dist

    from giftcomm.transport.torch_dist import TorchDistTransport

    t = TorchDistTransport()
    res = {"nodes": t.node_ids()}
    for n in sizes:
        for fmt in ("e4m3", "bf16"):
            x = np.random.default_rng([seed, n, rank]).standard_normal(n).astype(np.float32)
            # giftcomm's own rows (gloo's own allreduce adds in its ring order, not the reference's)
            res[(n, fmt)] = giftcomm.allreduce(x, comm=t, fmt=fmt, slice_elems=1024, allow_native=False)
    with open(out, "wb") as f:
        pickle.dump(res, f)
    dist.destroy_process_group()


def test_torch_dist_transport_matches_reference(tmp_path, rng):
    world = 3
    seed = int(rng.integers(2**31))
    sizes = [0, 1, int(rng.integers(2, 700)), int(rng.integers(3000, 9000))]
    results = _spawn_world(_transport_worker, world, str(tmp_path), seed, sizes)
    for r in range(world):  # one host: one node
        np.testing.assert_array_equal(results[r]["nodes"], np.zeros(world, np.int64))
    for n in sizes:
        xs = [np.random.default_rng([seed, n, r]).standard_normal(n).astype(np.float32) for r in range(world)]
        for fmt in ("e4m3", "bf16"):
            ref = simulate_allreduce(xs, fmt, 256, "sum", allow_native=False)
            for r in range(world):
                np.testing.assert_array_equal(results[r][(n, fmt)], ref[r], err_msg=f"n={n} fmt={fmt} rank={r}")


# ----------------------------------------------------------------------------- DDP hook
def _ddp_worker(rank, world, init, out, seed, iters, start, fmt):
    _init(rank, world, init)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from giftcomm.adapters.torch import GiftState, gift_hook
    from giftcomm.transport.torch_dist import TorchDistTransport

    model = _mlp(seed, (24, 64, 48, 8))
    names = {p: n for n, p in model.named_parameters()}
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets
    schedule = GiftSchedule(warmup=start, geometry="reduced", refresh_every=2, estimate_every=1, rebuild_lag=0,
                            policy=SelectivePolicy(min_size=0, min_gain=0.0, flops_per_gain=1e9))
    state = GiftState(fmt=fmt, schedule=schedule, param_names=names)
    records = []

    def recording_hook(state, bucket):
        rec = dict(it=state.iter, index=bucket.index(), inp=bucket.buffer().clone(),
                   grads=[g.data_ptr() for g in bucket.gradients()])
        fut = gift_hook(state, bucket)  # adopts due geometries first: read the one it used after
        rec["geo"] = state.geometry_of(bucket.index()) if rec["it"] >= start else None

        def keep(f):
            rec["out"] = f.value().clone()
            return f.value()

        records.append(rec)
        return fut.then(keep)

    ddp.register_comm_hook(state, recording_hook)
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    grads_after = []
    for _ in range(iters):
        x = torch.randn(32, 24, generator=gen)
        ddp(x).pow(2).mean().backward()
        grads_after.append({n: p.grad.clone() for n, p in model.named_parameters()})
        ddp.zero_grad()
    state.shutdown()
    # recompute every giftcomm bucket with the NumPy API over a fresh transport, same inputs
    check = TorchDistTransport()
    verdict = {"records": len(records), "gift_equal": [], "warm_close": [], "geometries": 0, "digests": []}
    for rec in records:
        inp, outp = rec["inp"].numpy(), rec["out"].numpy()
        verdict["digests"].append(outp.tobytes())
        if rec["it"] < start:
            everyone = [None] * world
            dist.all_gather_object(everyone, inp)
            verdict["warm_close"].append(bool(np.allclose(outp, np.mean(everyone, axis=0), rtol=1e-5, atol=1e-7)))
            continue
        verdict["geometries"] += rec["geo"] is not None and not rec["geo"].is_identity
        ref = giftcomm.gift_allreduce(inp, rec["geo"], comm=check, op="avg", fmt=fmt)
        verdict["gift_equal"].append(bool(np.array_equal(ref, outp)))
    # the last iteration's .grad are the reduced buckets
    last = [r for r in records if r["it"] == iters - 1]
    flat_out = np.concatenate([r["out"].numpy() for r in last])
    flat_grads = np.concatenate([grads_after[-1][n].reshape(-1).numpy() for n, _ in model.named_parameters()])
    verdict["grads_are_buckets"] = bool(np.array_equal(np.sort(flat_out), np.sort(flat_grads)))
    with open(out, "wb") as f:
        pickle.dump(verdict, f)
    del ddp  # before the process group: see examples/accelerate_ddp.py (torch's DDP Reducer, last to let go of the group, can hang at exit)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3])  # 1: one rank is no special case (docs/adapters.md, "One process")
def test_ddp_hook_equals_numpy_api(tmp_path, rng, world):
    iters, start = 5, 1
    seed = int(rng.integers(2**20))
    res = _spawn_world(_ddp_worker, world, str(tmp_path), seed, iters, start, "e4m3")
    for v in res:
        assert v["records"] > iters  # several buckets per iteration
        assert v["warm_close"] and all(v["warm_close"]), "warm-up steps must be the plain mean"
        assert v["gift_equal"] and all(v["gift_equal"]), "hook result != giftcomm.gift_allreduce of the same bucket"
        assert v["geometries"] > 0, "the reduced-gradient geometry was never used"
        assert v["grads_are_buckets"]
    for v in res[1:]:
        assert v["digests"] == res[0]["digests"], "ranks returned different reduced buckets"


# ----------------------------------------------------------------------------- GradSync
def _local_grads(seed: int, x: torch.Tensor, widths) -> list[np.ndarray]:
    """Per-parameter gradients of an identical model without GradSync (the expected bucket content)."""
    m = _mlp(seed, widths)
    m(x).pow(2).mean().backward()
    return [p.grad.reshape(-1).numpy().copy() for p in m.parameters()]


@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("with_geometry", [False, True])
def test_grad_sync_equals_flat_allreduce(rng, P, with_geometry):
    widths = (24, 40, 32, 16)
    seed = int(rng.integers(2**20))
    xs = [torch.from_numpy(rng.standard_normal((8, widths[0])).astype(np.float32)) for _ in range(P)]
    factors_rng = np.random.default_rng(seed)

    def random_geometry(layout):
        fac = {}
        for seg in layout:
            if seg.ndim == 2:
                m, n = seg.matrix_shape
                a, g = factors_rng.standard_normal((2 * n, n)), factors_rng.standard_normal((2 * m, m))
                fac[seg.name] = (a.T @ a, g.T @ g)
        return Geometry.from_kfac(layout, fac)

    probe = GradSync(_mlp(seed, widths), comm=giftcomm.LoopbackGroup(1).transports[0], bucket_mb=0.004)
    geoms = [random_geometry(lay) for lay in probe.layouts] if with_geometry else None

    models = [_mlp(seed, widths) for _ in range(P)]  # built here: torch.manual_seed is process-global

    def rank_fn(t):
        torch.set_num_threads(1)
        model = models[t.rank]
        sync = GradSync(model, comm=t, fmt="e4m3", bucket_mb=0.004)  # ~1000 floats: several buckets
        assert len(sync.buckets) > 1
        sync.set_geometries(geoms)
        out = []
        for it in range(2):
            if it == 0:
                sync.zero_grad()
            else:  # the optimizer's zero_grad(set_to_none=True) replaces the views: sync rebinds
                for p in model.parameters():
                    p.grad = None
            model(xs[t.rank]).pow(2).mean().backward()
            local = [b.copy() for b in sync.flat_grads()]
            sync.sync()
            for b in sync.buckets:  # zero-copy: every .grad is a view of its bucket
                for i, p in enumerate(b.params):
                    assert p.grad.data_ptr() == b.buffer.ctypes.data + b.offsets[i] * b.buffer.itemsize
            refs = [giftcomm.gift_allreduce(loc, None if geoms is None else geoms[k], comm=t, op="avg", fmt="e4m3")
                    for k, loc in enumerate(local)]
            out.append((local, [b.buffer.copy() for b in sync.buckets], refs))
        return out

    results = giftcomm.LoopbackGroup(P).run(rank_fn)
    for r, per_iter in enumerate(results):
        expect = np.concatenate(_local_grads(seed, xs[r], widths))
        for local, reduced, refs in per_iter:
            np.testing.assert_array_equal(np.concatenate(local), expect)  # buckets held the local grads
            for red, ref in zip(reduced, refs):
                np.testing.assert_array_equal(red, ref)
        for (_, red, _), (_, red0, _) in zip(per_iter, results[0]):
            for a, b in zip(red, red0):
                np.testing.assert_array_equal(a, b)  # identical on every rank


@pytest.mark.mpi
def test_grad_sync_mpi_bit_identical(rng):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    seed = comm.bcast(int(rng.integers(2**20)))
    widths = (16, 48, 8)
    model = _mlp(seed, widths)
    sync = GradSync(model, comm=comm, fmt="e4m3", bucket_mb=0.002)
    sync.zero_grad()
    x = torch.from_numpy(np.random.default_rng([seed, comm.rank]).standard_normal((4, 16)).astype(np.float32))
    model(x).pow(2).mean().backward()
    local = np.concatenate([b.buffer for b in sync.buckets])
    sync.sync()
    mine = np.concatenate([b.buffer for b in sync.buckets])
    everyone = comm.allgather(mine)
    for other in everyone:
        np.testing.assert_array_equal(other, mine)
    ref = np.concatenate([giftcomm.allreduce(b, comm=comm, op="avg") for b in
                          np.split(local, np.cumsum([b.buffer.size for b in sync.buckets])[:-1])])
    np.testing.assert_array_equal(mine, ref)


# ----------------------------------------------------------------------------- KFAC capture
def test_kfac_capture_feeds_estimator(rng):
    widths = (12, 20, 6)
    model = _mlp(int(rng.integers(2**20)), widths)
    cap = KfacCapture(model, every=2, tokens=10_000)
    assert set(cap.layers.values()) == {"0.weight", "2.weight"}
    x = torch.from_numpy(rng.standard_normal((3, 5, widths[0])).astype(np.float32))
    # expected factors, from a hand-made forward/backward
    h0 = model[0](x)
    h0.retain_grad()
    a1 = model[1](h0)
    h2 = model[2](a1)
    h2.retain_grad()
    h2.pow(2).mean().backward()
    acts = {"0.weight": x.reshape(-1, 12).double(), "2.weight": a1.detach().reshape(-1, 20).double()}
    grads = {"0.weight": h0.grad.reshape(-1, 20).double(), "2.weight": h2.grad.reshape(-1, 6).double()}
    model.zero_grad()
    assert cap.step(0)
    model(x).pow(2).mean().backward()
    assert not cap.step(1)
    model(x).pow(2).mean().backward()  # not captured
    fac = cap.estimator.factors()
    for name in ("0.weight", "2.weight"):
        a, d = acts[name], grads[name]
        np.testing.assert_allclose(fac[name][0], (a.T @ a / a.shape[0]).numpy(), rtol=1e-5, atol=1e-12)
        np.testing.assert_allclose(fac[name][1], (d.T @ d / d.shape[0]).numpy(), rtol=1e-5, atol=1e-18)
        assert cap.estimator.counts[name] == 1
    # subsampled capture: still symmetric PSD factors of the right size, one more update
    cap.tokens = 4
    cap.step(2)
    model(x).pow(2).mean().backward()
    assert cap.estimator.counts["0.weight"] == 2
    cap.remove()
    cap.estimator.sync(None)
    buckets = make_buckets(model, bucket_mb=0.0008)
    geoms = build_geometries(cap.estimator, [b.layout for b in buckets],
                             SelectivePolicy(min_size=0, min_gain=0.0, flops_per_gain=1e9))
    assert [g.size for g in geoms] == [b.buffer.size for b in buckets]
    transformed = {t.segment.name for g in geoms for t in g.transforms if not t.is_identity}
    assert transformed == {"0.weight", "2.weight"}
    for g, b in zip(geoms, buckets):  # the transform is invertible on fresh data
        v = rng.standard_normal(b.buffer.size).astype(np.float32)
        np.testing.assert_allclose(g.inverse(g.forward(v)), v, rtol=1e-3, atol=1e-3)


def test_kfac_estimator_layout_matches_linear_weights():
    model = _mlp(0, (8, 8, 8))
    est = KfacEstimator(model_layout(model), segments=["0.weight"])
    cap = KfacCapture(model, est, every=1)
    cap.step(0)
    with pytest.raises(ValueError, match="not an estimated segment"):
        model(torch.ones(2, 8)).sum().backward()


# ----------------------------------------------------------------------------- DLPack
def test_dlpack_zero_copy(rng):
    t = torch.from_numpy(rng.standard_normal(1000).astype(np.float32))
    a = numpy_view(t)
    assert a.ctypes.data == t.data_ptr()
    a[3] = 42.0
    assert float(t[3]) == 42.0
    back = torch.from_dlpack(a)
    assert back.data_ptr() == a.ctypes.data
    tb = t.to(torch.bfloat16)
    ab = numpy_view(tb)  # bfloat16: an ml_dtypes view of the same memory
    assert ab.ctypes.data == tb.data_ptr() and ab.dtype.name == "bfloat16"
    with pytest.raises(TypeError):
        numpy_view(t.to(torch.int32))
    # bucket buffers are shared with .grad
    model = _mlp(1)
    (b,) = make_buckets(model)
    for i, p in enumerate(b.params):
        assert p.grad.data_ptr() == b.buffer.ctypes.data + b.offsets[i] * 4
    b.buffer[:] = 1.5
    assert all(bool((p.grad == 1.5).all()) for p in b.params)


def test_grad_sync_takes_every_call_option(rng):
    """Options checked when GradSync is built (naming it); nvfp4 with the format's own block and
    stochastic rounding seeded step_seed(seed, step, bucket) equals the reference simulation."""
    from giftcomm.adapters.calls import step_seed

    t1 = giftcomm.LoopbackGroup(1).transports[0]
    for kwargs, words in [(dict(fmt="mxfp4", block=256), "fixed block"), (dict(algorithm="rnig"), "algorithm"),
                          (dict(rounding="stochastic", fmt="fp16"), "stochastic"), (dict(timeout=-1), "timeout"),
                          (dict(op="max"), "op"), (dict(bucket_mb=0), "bucket_mb")]:
        with pytest.raises(ValueError, match=words) as err:
            GradSync(_mlp(0), comm=t1, **kwargs)
        assert str(err.value).startswith("GradSync: ")
    P, seed, widths = 2, int(rng.integers(2**40)), (24, 40, 16)
    xs = [torch.from_numpy(rng.standard_normal((4, 24)).astype(np.float32)) for _ in range(P)]
    models = [_mlp(3, widths) for _ in range(P)]

    def rank_fn(t):
        sync = GradSync(models[t.rank], comm=t, fmt="nvfp4", rounding="stochastic", seed=seed, bucket_mb=0.004)
        sync.zero_grad()
        models[t.rank](xs[t.rank]).pow(2).mean().backward()
        local = [b.copy() for b in sync.flat_grads()]
        sync.sync(step=5)
        return local, [b.buffer.copy() for b in sync.buckets]

    res = giftcomm.LoopbackGroup(P).run(rank_fn)
    assert len(res[0][1]) > 1
    for i, reduced in enumerate(res[0][1]):
        ref = simulate_allreduce([res[r][0][i] for r in range(P)], "nvfp4", None, "avg", rounding="stochastic",
                                 seed=step_seed(seed, 5, i))[0]
        np.testing.assert_array_equal(reduced, ref)
        np.testing.assert_array_equal(reduced, res[1][1][i])
