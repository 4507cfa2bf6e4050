"""FSDP2 (fully_shard) with giftcomm's reduce-scatter, run for real: torchrun-style spawned ranks
over gloo at P = 2 and 3, on a model whose widths are multiples of neither P nor any block.

Every case trains the same model on the same seed and data twice, with FSDP2's own
reduce-scatter and with :func:`register_reduce_scatter`, and compares the sharded gradients;
the comm's own inputs and outputs are recorded so the parent can check every shard against the
reference simulation of ``reduce_scatter(layout="equal")`` bit for bit. On a CUDA machine one more
test runs FSDP2 at world size 1 over NCCL and giftcomm's CUDA route (perf/device_check.sh step 4).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import UNKNOWN_FORMAT
from test_torchrun import _spawn
from torch.distributed.fsdp import fully_shard

from giftcomm import GiftSchedule
from giftcomm.reference import simulate_reduce_scatter

# one xdist worker runs every test here (--dist loadgroup): the module-scoped fixture (each world size's training runs)
# is then made once, not once per worker
pytestmark = pytest.mark.xdist_group("fsdp")

WIDTHS = (13, 37, 11)  # multiples of neither 2, 3 nor any block


def _model():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTHS[0], WIDTHS[1]), nn.Tanh(), nn.LayerNorm(WIDTHS[1]),
                         nn.Linear(WIDTHS[1], WIDTHS[2]))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, WIDTHS[0], generator=g), torch.randn(8, WIDTHS[2], generator=g)


class _Recorder:
    """Wraps a comm, keeping (input, output, op name) of each call as float32 NumPy copies."""

    def __init__(self, comm):
        self.comm, self.calls = comm, []

    def allocate(self, *a, **k):
        return self.comm.allocate(*a, **k)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        x = input_tensor.detach().float().numpy().copy()
        res = self.comm(output_tensor, input_tensor, group, op, async_op)
        self.calls.append((x, output_tensor.detach().float().numpy().copy(), str(getattr(op, "op", op))))
        return res


def _train(rank, world, steps, gift=None, reduce_dtype=None, factor=None, record=False, grads_at=0):
    """Sharded gradients of step ``grads_at`` (local shards, float32) and the losses."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from giftcomm.adapters.torch import register_reduce_scatter
    from giftcomm.adapters.torch.fsdp import fsdp_modules

    model = _model()
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype is not None else MixedPrecisionPolicy()
    for layer in (model[0], model[3]):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if factor is not None:
        for m in (model[0], model[3], model):
            m.set_gradient_divide_factor(factor)
    comms, recorders = [], []
    if gift is not None:
        opts = {"allow_native": False, **gift}  # giftcomm's own wire (auto takes gloo's allreduce for these sizes)
        if opts.get("capture") == "model":
            opts["capture"] = model
        comms = register_reduce_scatter(model, **opts)
        if record:
            for m, c in zip(fsdp_modules(model), comms):
                rec = _Recorder(c)
                m.set_custom_reduce_scatter(rec)
                recorders.append(rec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads, losses = None, []
    for step in range(steps):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step == grads_at:
            grads = {n: p.grad.to_local().detach().float().numpy().copy() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    out = {"grads": grads, "losses": losses, "gift_calls": [c.gift_calls for c in comms],
           "calls": [r.calls for r in recorders], "geometries": [c.geometry for c in comms],
           "stats": comms.stats() if gift is not None else None}
    return out


CASES = {
    "fp32": dict(fmt="fp32"),
    "e4m3": dict(fmt="e4m3"),
    "e4m3-direct-stochastic": dict(fmt="e4m3", algorithm="direct", rounding="stochastic", seed=3),
    "nvfp4": dict(fmt="nvfp4"),
}


def _worker(rank, world):
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    res: dict = {"own": _train(rank, world, 1)}
    for name, gift in CASES.items():
        res[name] = _train(rank, world, 1, gift=gift, record=True)
    res["own-bf16"] = _train(rank, world, 1, reduce_dtype=torch.bfloat16)
    res["bf16"] = _train(rank, world, 1, gift=dict(fmt="e4m3"), reduce_dtype=torch.bfloat16, record=True)
    res["own-fp16"] = _train(rank, world, 1, reduce_dtype=torch.float16)
    res["fp16"] = _train(rank, world, 1, gift=dict(fmt="e4m3"), reduce_dtype=torch.float16, record=True)
    res["premul"] = _train(rank, world, 1, gift=dict(fmt="fp32"), factor=7.0, record=True)
    res["warmup"] = _train(rank, world, 2, gift=dict(fmt="e4m3", schedule=GiftSchedule(warmup=1)))
    # GIFT: KFAC captured on the first forward, geometry built at the first reduce-scatter
    res["gift"] = _train(rank, world, 3, gift=dict(fmt="e4m3", schedule=GiftSchedule(geometry="kfac", refresh_every=50),
                                                   capture="model", capture_every=1),
                         grads_at=2, record=True)
    res["own3"] = _train(rank, world, 3, grads_at=2)
    # the GIFT paper's preset in one word: input side only, Cholesky factor, A averaged over the group
    res["paper"] = _train(rank, world, 3, gift=dict(fmt="e4m3", schedule=GiftSchedule(geometry="paper", paper={"rank": 4}),
                                                    capture="model", capture_every=1), grads_at=2)
    res["errors"] = _bad_inputs(rank, world)
    return res


def _bad_inputs(rank, world):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from giftcomm.adapters.torch import GiftReduceScatter, register_reduce_scatter
    from giftcomm.geometry import ShardedGeometry

    errors = {}
    model = _model()
    fully_shard(model)
    wrong = ShardedGeometry.identity([("0.weight", (5, 5))], world)
    for key, fn in {
        "geometry": lambda: register_reduce_scatter(model, geometry=wrong),
        "option": lambda: register_reduce_scatter(model, fmt=UNKNOWN_FORMAT),
        "algorithm": lambda: GiftReduceScatter(algorithm="doubling"),
        "op": lambda: GiftReduceScatter()(torch.zeros(2), torch.zeros(2 * world), dist.group.WORLD,
                                          dist.ReduceOp.MAX),
        "divide": lambda: GiftReduceScatter()(torch.zeros(2), torch.zeros(2 * world + 1), dist.group.WORLD,
                                              dist.ReduceOp.SUM),
        "no-fsdp": lambda: register_reduce_scatter(_model()),
        "history": lambda: _train_after_uneven_groups(rank),  # last: it leaves rank 0 a group ahead
    }.items():
        try:
            fn()
            errors[key] = None
        except (ValueError, TypeError, RuntimeError) as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
    return errors


def _train_after_uneven_groups(rank):
    """A backward through giftcomm's comms after rank 0 alone joined one more process group."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from giftcomm.adapters.torch import register_reduce_scatter

    if rank == 0:
        dist.new_group(ranks=[0], use_local_synchronization=True)
    model = _model()
    fully_shard(model)
    register_reduce_scatter(model, fmt="e4m3")
    x, y = _batch(rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _check_calls(results, fmt, algorithm="ring", rounding="nearest", seed=None, dtype=None):
    """Every recorded call's shards equal the simulation of the same layout from all ranks' inputs
    (``dtype``: the reduce dtype, to which the simulated float32 shard is rounded)."""
    world = len(results)
    for k in range(len(results[0]["calls"])):
        for j in range(len(results[0]["calls"][k])):
            xs = [r["calls"][k][j][0] for r in results]
            op = results[0]["calls"][k][j][2]
            how = "avg" if "AVG" in op else "sum"
            s = None if seed is None else ((seed + j) * (1 << 16) + k) % (1 << 64)
            want = simulate_reduce_scatter(xs, fmt, None, how, algorithm, rounding=rounding, seed=s, layout="equal")
            if dtype is not None:
                want = [torch.from_numpy(w).to(dtype).float().numpy() for w in want]
            for r in range(world):
                got = results[r]["calls"][k][j][1]
                assert got.tobytes() == want[r].tobytes(), (fmt, k, j, r)


@pytest.fixture(scope="module", params=[2, 3])
def fsdp_results(request, tmp_path_factory):
    return _spawn(_worker, request.param, tmp_path_factory.mktemp(f"fsdp{request.param}"))


def test_fsdp2_with_giftcomm_against_fsdp2_own_reduce_scatter(fsdp_results):
    for r in fsdp_results:
        own = r["own"]["grads"]
        for name, p in own.items():
            assert _rel(r["fp32"]["grads"][name], p) < 1e-6, name  # fp32 wire: only the summation order differs
            assert 0 < _rel(r["e4m3"]["grads"][name], p) < 0.08, name
            assert _rel(r["e4m3-direct-stochastic"]["grads"][name], p) < 0.1, name
            assert _rel(r["nvfp4"]["grads"][name], p) < 0.3, name
            assert _rel(r["bf16"]["grads"][name], r["own-bf16"]["grads"][name]) < 0.08, name
            assert _rel(r["fp16"]["grads"][name], r["own-fp16"]["grads"][name]) < 0.08, name
        st = r["e4m3"]["stats"]  # register_reduce_scatter(...).stats(): what the comms sent
        assert st["calls"] == sum(len(c) for c in r["e4m3"]["calls"]) > 0 and st["fallbacks"] == {}
        assert set(st["bytes_sent"]) == {"e4m3"} and st["bytes_sent"]["e4m3"] > 0  # allow_native=False
        for case in ("fp32", "e4m3", "nvfp4", "warmup"):
            assert abs(r[case]["losses"][0] - r["own"]["losses"][0]) < 1e-6  # the same first forward
        assert abs(r["warmup"]["losses"][1] - r["own3"]["losses"][1]) < 1e-3  # a warm-up step ran FSDP's own


def test_every_shard_equals_the_simulation_of_the_equal_layout(fsdp_results):
    for case in ("fp32", "e4m3", "nvfp4"):
        _check_calls([{"calls": r[case]["calls"]} for r in fsdp_results], case)
    _check_calls([{"calls": r["e4m3-direct-stochastic"]["calls"]} for r in fsdp_results], "e4m3", "direct",
                 "stochastic", 3)
    _check_calls([{"calls": r["bf16"]["calls"]} for r in fsdp_results], "e4m3", dtype=torch.bfloat16)
    _check_calls([{"calls": r["fp16"]["calls"]} for r in fsdp_results], "e4m3", dtype=torch.float16)
    assert all("SUM" in c[2] for r in fsdp_results for calls in r["fp16"]["calls"] for c in calls)  # FSDP divides


def test_premul_sum_from_set_gradient_divide_factor(fsdp_results):
    world = len(fsdp_results)
    for r in fsdp_results:
        for name, p in r["own"]["grads"].items():
            assert _rel(r["premul"]["grads"][name], p * world / 7.0) < 1e-5, name
        assert all("PREMUL_SUM" in c[2] for calls in r["premul"]["calls"] for c in calls)


def test_gift_kfac_geometry_trains_close_to_fsdp2_own(fsdp_results):
    for r in fsdp_results:
        assert sum(r["gift"]["gift_calls"]) > 0  # the geometry was built and used
        for a, b in zip(r["gift"]["losses"], r["own3"]["losses"]):
            assert abs(a - b) < 0.05 * abs(b)
        for name, p in r["own3"]["grads"].items():
            assert _rel(r["gift"]["grads"][name], p) < 0.2, name


def test_paper_geometry_in_one_word_trains_close_to_fsdp2_own(fsdp_results):
    for r in fsdp_results:
        assert sum(r["paper"]["gift_calls"]) > 0
        kinds = {t.right.kind for g in r["paper"]["geometries"] if g is not None
                 for t in g.full().transforms if not t.is_identity}
        assert kinds == {"cholesky"}
        assert all(g is None or t.left.is_identity for g in r["paper"]["geometries"] if g is not None
                   for t in g.full().transforms)
        for a, b in zip(r["paper"]["losses"], r["own3"]["losses"]):
            assert abs(a - b) < 0.05 * abs(b)
        for name, p in r["own3"]["grads"].items():
            assert _rel(r["paper"]["grads"][name], p) < 0.2, name
    fps = {tuple(None if g is None else g.fingerprint() for g in r["paper"]["geometries"]) for r in fsdp_results}
    assert len(fps) == 1  # every rank the same map


def test_gift_shards_are_the_inverse_of_the_reduced_forward_rows(fsdp_results):
    """Each GIFT call: shard r == geometry.shard(r).inverse(simulated equal-layout reduce-scatter of
    every rank's forward_rows) (to float32 rounding: the BLAS of this process may sum in another order)."""
    world = len(fsdp_results)
    geos = fsdp_results[0]["gift"]["geometries"]
    assert any(g is not None for g in geos)
    for k, geo in enumerate(geos):
        for j in range(len(fsdp_results[0]["gift"]["calls"][k])):
            xs = [r["gift"]["calls"][k][j][0] for r in fsdp_results]
            if geo is None:
                want = simulate_reduce_scatter(xs, "e4m3", None, "avg", layout="equal")
            else:
                rows = [geo.forward_rows(x.reshape(world, -1)).reshape(-1) for x in xs]
                sums = simulate_reduce_scatter(rows, "e4m3", None, "avg", layout="equal")
                want = [geo.shard(r).inverse(sums[r]) for r in range(world)]
            for r in range(world):
                got = fsdp_results[r]["gift"]["calls"][k][j][1]
                np.testing.assert_allclose(got, want[r], rtol=1e-4, atol=1e-6 * np.abs(want[r]).max())


def test_bad_input_raises_on_every_rank_before_data_moves(fsdp_results):
    errors = [r["errors"] for r in fsdp_results]
    assert all(e == errors[0] for e in errors)  # the same message on every rank
    e = errors[0]
    assert "ValueError" in e["geometry"] and "the geometry covers" in e["geometry"]
    assert "ValueError" in e["option"] and UNKNOWN_FORMAT in e["option"]
    assert "algorithm" in e["algorithm"]
    assert "SUM, AVG or PREMUL_SUM" in e["op"]
    assert "must hold" in e["divide"]
    assert "RuntimeError" in e["no-fsdp"] and "fully_shard" in e["no-fsdp"]
    assert "RuntimeError" in e["history"] and "different numbers of process groups" in e["history"]


# ------------------------------------------------------------------------------------ HSDP
def _hsdp_worker(rank, world):
    """A (replicate 2, shard 2) mesh: giftcomm reduce-scatters within each shard group; FSDP's own
    all-reduce across the replicas follows."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from giftcomm.adapters.torch import register_reduce_scatter

    warnings.filterwarnings("ignore", category=FutureWarning)
    out = {}
    for case in ("own", "fp32", "e4m3"):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        model = _model()
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if case != "own":
            register_reduce_scatter(model, fmt=case, allow_native=False)
        x, y = _batch(rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        out[case] = {n: p.grad.to_local().detach().numpy().copy() for n, p in model.named_parameters()}
    return out


def test_hsdp_two_dimensional_mesh(tmp_path):
    for r in _spawn(_hsdp_worker, 4, tmp_path):
        for name, p in r["own"].items():
            assert _rel(r["fp32"][name], p) < 1e-6, name
            assert 0 < _rel(r["e4m3"][name], p) < 0.08, name


# ------------------------------------------------------------------------ CUDA, world size 1
def _dtoh_copies(events) -> list[str]:
    """Names of the device-to-host copies among profiler events: Kineto's GPU memcpy activities
    ("Memcpy DtoH (Device -> Pageable)" / "(Device -> Pinned)") and the ops that read a device
    scalar back (``aten::item`` / ``aten::_local_scalar_dense``)."""
    return [e.name for e in events
            if "dtoh" in e.name.lower() or e.name in ("aten::item", "aten::_local_scalar_dense")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_fsdp2_on_cuda_at_world_size_1_device_route_without_host_copy(rng, tmp_path):
    """FSDP2 at world size 1 on CUDA (NCCL, in process, FileStore), giftcomm's comms installed.

    At world size 1 FSDP2 never calls the reduce-scatter comm (``foreach_reduce`` copies its input
    to its output; the comm only allocates), so training checks only that installing giftcomm
    changes nothing: no comm call, two steps' gradients and parameters equal FSDP2's own to
    float32 rounding. giftcomm's device route is then exercised by calling a registered comm
    directly, as FSDP2 does at P >= 2 (on a side stream like its reduce-scatter stream, op AVG,
    the FSDP group):
    the CUDA transport is used, the shard equals the equal-layout simulation bit for bit (at P = 1
    that is the input itself: the owner's own values are summed unquantized, only encoded for the
    wire), the input is untouched, and under torch.profiler (CUDA activity) the call makes no
    device-to-host copy (a ``.cpu()`` in the same filter is seen: the filter works).
    Not covered here: P >= 2 over NCCL, bf16/fp16 reduce dtypes on the device route, GIFT on CUDA.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from giftcomm.adapters.torch import register_reduce_scatter
    from giftcomm.transport.torch_dist import TorchDistDeviceTransport

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            device_id=dev)
    try:
        mesh = init_device_mesh("cuda", (1,))
        runs = {}
        for case in ("own", "gift"):
            model = _model().to(dev)
            for layer in (model[0], model[3]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            comms = register_reduce_scatter(model, fmt="e4m3") if case == "gift" else []
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            grads = []
            for step in range(2):
                x, y = (t.to(dev) for t in _batch(0, step))
                torch.nn.functional.mse_loss(model(x), y).backward()
                grads.append({n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
            params = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
            runs[case] = (grads, params, comms)
        (own_grads, own_params, _), (grads, params, comms) = runs["own"], runs["gift"]
        assert comms and [c.calls for c in comms] == [0] * len(comms)  # FSDP2 skips the comm at P = 1
        for step in range(2):
            for name, g in own_grads[step].items():
                assert grads[step][name].device == dev
                assert _rel(grads[step][name].cpu().numpy(), g.cpu().numpy()) < 1e-6, (step, name)
        for name, p in own_params.items():
            assert _rel(params[name].cpu().numpy(), p.cpu().numpy()) < 1e-6, name

        # the device route, called as FSDP2 calls it at P >= 2
        comm, group = comms[0], mesh.get_group()
        n = WIDTHS[1] * WIDTHS[0] + WIDTHS[1]  # model[0]'s weight and bias: no whole number of blocks
        host = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
        x = torch.from_numpy(host).to(dev)
        before = x.clone()
        side = torch.cuda.Stream(dev)

        def reduce_scatter():
            out = comm.allocate((n,), dtype=torch.float32, device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                comm(out, x, group, dist.ReduceOp.AVG)
            torch.cuda.current_stream(dev).wait_stream(side)
            return out

        reduce_scatter()  # the first call builds the transports and loads the kernels
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = reduce_scatter()
            torch.cuda.synchronize(dev)
        copies = _dtoh_copies(prof.events())
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as control:
            x.cpu()
            torch.cuda.synchronize(dev)
        assert _dtoh_copies(control.events()), "the profiler filter saw no copy in x.cpu()"
        assert copies == [], copies
        assert isinstance(comm._device.get(group), TorchDistDeviceTransport)  # the CUDA route ran
        assert out.device == dev and torch.equal(x, before)
        want = simulate_reduce_scatter([host], "e4m3", None, "avg", comm.algorithm_used or "ring", layout="equal")
        assert out.cpu().numpy().tobytes() == want[0].tobytes() == host.tobytes()
    finally:
        dist.destroy_process_group()
