"""The fused GIFT transform + codec kernels (giftcomm/cuda/kernels/gc_fused.cu) on the CPU: the
real kernel bodies through the SIMT shim and the CuPy stand-in (tests/emulator), against

- the host model of the same operation order (giftcomm.geometry.fused_model): bit for bit;
- the exact transform (float64, the geometry's own float32 parameters) within the rounding bound
  of docs/gpu.md "Fused transform" (gamma_K times the transform evaluated in absolute values),
  and giftcomm.geometry + giftcomm.reference within that bound plus one FP8 step.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import ANY_BLOCK_FORMATS, native_only

from giftcomm.formats import get_format, message_nbytes
from giftcomm.geometry import Geometry
from giftcomm.geometry import fused as cuda_fused
from giftcomm.geometry.fused_model import FusedLayout, apply_model, project
from giftcomm.geometry.layout import Layout
from giftcomm.geometry.spectral import Spectrum
from giftcomm.geometry.transform import identity_transform, kfac_transform
from giftcomm.reference.codec import decode, decode_add_encode, encode
from tests.test_gpu_emulated import install

pytestmark = pytest.mark.emulated_gpu

U = 2.0**-24


@pytest.fixture
def cp(monkeypatch):
    """The CuPy stand-in; with GIFTCOMM_FUSED_ON_GPU=1 (perf/device_check.sh) real CuPy on a GPU."""
    if os.environ.get("GIFTCOMM_FUSED_ON_GPU") == "1":
        import giftcomm.cuda

        if not giftcomm.cuda.available():
            pytest.skip("no CUDA GPU (GIFTCOMM_FUSED_ON_GPU=1 asks for one)")
        import cupy

        return cupy
    return install(monkeypatch)


def _spec(rng, d):
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    v = np.logspace(0, -3, d)
    return Spectrum(v / v.mean(), q, 1.0)


def geometry(rng):
    """Two-sided segments of one shape (batched, B = 2), a right-only one, a left-only one with
    two rank tiles (k = 9 > 8), identity segments and pieces between them."""
    layout = Layout([("w1", (24, 40)), ("b1", (24,)), ("w2", (24, 40)), ("w3", (16, 48)), ("w4", (40, 16)),
                     ("norm", (7,))])
    choice = {"w1": (5, 3), "w2": (5, 3), "w3": (None, 4), "w4": (9, None)}
    ts = []
    for seg in layout:
        if seg.name not in choice:
            ts.append(identity_transform(seg))
            continue
        m, n = seg.matrix_shape
        cg, ca = choice[seg.name]
        ts.append(kfac_transform(seg, _spec(rng, m) if cg else None, _spec(rng, n) if ca else None, cg, ca, 0.03))
    return Geometry(layout, ts)


def exact(geo, x, inverse=False, absolute=False):
    """The transform in float64 from the sides' float32 parameters (``absolute``: every parameter
    and value replaced by its absolute value: the magnitude the rounding bound scales with)."""
    a = (np.abs if absolute else (lambda v: v))
    y = a(np.asarray(x, np.float64)).copy()
    for t in geo.transforms:
        if t.is_identity:
            continue
        s = t.segment
        m, n = s.matrix_shape
        xs = a(np.asarray(x[s.offset : s.stop], np.float64).reshape(m, n))

        def side(sd):
            if sd.is_identity:
                return np.eye(sd.dim)
            c = float(sd.c_inv if inverse else sd.c_fwd)
            d = np.asarray(sd.delta_inv if inverse else sd.delta_fwd, np.float64)
            u = np.asarray(sd.u, np.float64)
            if absolute:
                return abs(c) * np.eye(sd.dim) + np.abs(u) @ np.diag(np.abs(d)) @ np.abs(u).T
            return c * np.eye(sd.dim) + u @ np.diag(d) @ u.T

        y[s.offset : s.stop] = (side(t.left) @ xs @ side(t.right)).reshape(-1)
    return y


def bound(geo, x, inverse=False):
    """Per-element bound on |fused - exact|: gamma_K times the absolute-value transform, K the
    longest chain of roundings (docs/gpu.md: n/32 + 5 for P, m for W, k_R for R2, k_L + k_R for
    the update, and a few single roundings)."""
    k = max(t.segment.matrix_shape[1] // 32 + t.segment.matrix_shape[0] + 2 * (t.right.rank or 0)
            + (t.left.rank or 0) + 24 for t in geo.transforms)
    g = k * U / (1 - k * U)
    return g * exact(geo, x, inverse, absolute=True)


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def random_x(rng, n):
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-3, 3, n))).astype(np.float32)
    x[rng.integers(0, n, 5)] *= np.float32(2.0**-130)  # a few subnormals
    return x


def test_pass_a_batched_projections_bit_exact(cp, rng, monkeypatch):
    geo = geometry(rng)
    x = random_x(rng, geo.size)
    lay = FusedLayout.build(geo, inverse=False)
    assert any(g.b == 2 for g in lay.groups)  # the two equal segments go in one launch
    host = lay.pool.copy()
    project(lay, host, x)
    for grid in (cuda_fused.MAX_GRID, 2):  # 2 CTAs: the grid-stride loops iterate
        monkeypatch.setattr(cuda_fused, "MAX_GRID", grid)
        plan = cuda_fused.FusedPlan(geo, cp)
        plan.project(cp.asarray(x))
        assert np.array_equal(bits(plan.pool.get()), bits(host)), f"grid cap {grid}"


@pytest.mark.parametrize("fmt", native_only(ANY_BLOCK_FORMATS))
def test_fused_encode_bit_exact_and_within_bound(cp, rng, fmt, monkeypatch):
    geo = geometry(rng)
    n = geo.size
    f = get_format(fmt)
    x = random_x(rng, n)
    lay = FusedLayout.build(geo, inverse=False)
    host = lay.pool.copy()
    project(lay, host, x)
    y_model = apply_model(lay, host, x)
    y_exact = exact(geo, x)
    assert np.all(np.abs(y_model - y_exact) <= bound(geo, x))
    monkeypatch.setattr(cuda_fused, "MAX_GRID", 3)
    plan = cuda_fused.FusedPlan(geo, cp)
    xd = cp.asarray(x)
    plan.project(xd)
    # chunk ranges not at row or segment boundaries (slices are cut at scale blocks of the buffer)
    for lo, count, block in ((0, n, 256), (37, 1001, 32), (961, 600, 7), (n - 5, 5, 16), (100, 1, 1)):
        msg = cp.zeros(message_nbytes(count, f, block), np.uint8)
        y_out = cp.zeros(count, np.float32)
        plan.encode(xd, lo, count, f, block, msg, y_out=y_out)
        want = encode(y_model[lo : lo + count], f, block)
        assert np.array_equal(msg.get(), want), (lo, count, block)
        assert np.array_equal(bits(y_out.get()), bits(y_model[lo : lo + count]))
        # against giftcomm.geometry.forward + giftcomm.reference.encode: one FP8 step apart at most
        ref = decode(encode(geo.forward(x)[lo : lo + count], f, block), count, f, block)
        got = decode(msg.get(), count, f, block)
        amax = np.abs(ref).max()
        assert np.all(np.abs(got - ref) <= 2.0 ** -(3 if f.name == "e4m3" else 2)
                      * np.abs(ref) + 1e-3 * amax + 1e-30), (lo, count, block)
    # one ring hop: decode(incoming) + Y, encoded
    lo, count, block = 123, 700, 32
    incoming = encode(random_x(rng, count), f, block)
    out = cp.zeros(incoming.size, np.uint8)
    plan.decode_add_encode(xd, lo, count, cp.asarray(incoming), f, block, out)
    assert np.array_equal(out.get(), decode_add_encode(incoming, y_model[lo : lo + count], f, block))


@pytest.mark.parametrize("divisor", [None, 3.0])
def test_fused_inverse_decode_bit_exact_and_within_bound(cp, rng, divisor):
    geo = geometry(rng)
    n = geo.size
    f, block = get_format("e4m3"), 32
    msg = encode(random_x(rng, n), f, block)
    z = decode(msg, n, f, block)
    lay = FusedLayout.build(geo, inverse=True)
    host = lay.pool.copy()
    project(lay, host, z)
    want = apply_model(lay, host, z)
    if divisor is not None:
        want = want / np.float32(divisor)
    assert np.all(np.abs(apply_model(lay, host, z) - exact(geo, z, inverse=True)) <= bound(geo, z, inverse=True))
    plan = cuda_fused.FusedPlan(geo, cp, inverse=True)
    md = cp.asarray(msg)
    out = cp.empty(n, np.float32)
    plan.project_wire(md, f, block)
    plan.decode(md, f, block, out, divisor)
    assert np.array_equal(bits(out.get()), bits(want))
    # the float32 route (direct's and oneshot's sums): the same bits from the decoded values
    out2 = cp.empty(n, np.float32)
    plan.apply(cp.asarray(z), out2, divisor)
    assert np.array_equal(bits(out2.get()), bits(want))
    if hasattr(cp, "runtime_state"):  # steady state: a second call allocates nothing (the stand-in counts)
        before = cp.runtime_state.allocations
        plan.project_wire(md, f, block)
        plan.decode(md, f, block, out, divisor)
        assert cp.runtime_state.allocations == before


def test_fused_rejects_what_it_does_not_implement(cp, rng):
    geo = geometry(rng)
    plan = cuda_fused.FusedPlan(geo, cp)
    x = cp.zeros(geo.size, np.float32)
    with pytest.raises(ValueError, match="block <= 256"):
        plan.encode(x, 0, 10, get_format("e4m3"), 512, cp.zeros(message_nbytes(10, "e4m3", 512), np.uint8))
    with pytest.raises(ValueError, match="supports e4m3, e5m2"):
        plan.encode(x, 0, 10, get_format("nvfp4"), 16, cp.zeros(message_nbytes(10, "nvfp4", 16), np.uint8))
    with pytest.raises(ValueError, match="float32"):
        plan.project(cp.zeros(geo.size + 1, np.float32))
    with pytest.raises(ValueError, match="low-rank or identity"):
        cuda_fused.FusedPlan(Geometry.hadamard(geo.layout, seed=1), cp)


def test_fused_ring_device_steps_equal_host_model(cp, rng):
    """A 3-rank ring of the fused device steps on one emulated device: each chunk starts at the
    rank after its owner with a fused encode of that rank's transformed values, every later rank
    adds its own with a fused decode-add-encode hop, and every rank decodes all chunks (codec
    kernel) and applies the fused inverse (op="avg"). Equal bit for bit to the host model of the
    same steps (so every rank, running the same kernels on the same bytes, gets the same bits), and
    inverse(sum(forward)) / P close to the average."""
    from giftcomm.cuda.codec import CudaKernels

    geo, nr = geometry(rng), 3
    n, f, block = geo.size, get_format("e4m3"), 32
    xs = [random_x(rng, n) for _ in range(nr)]
    cuts = [0, (n // 3 // block) * block, (2 * n // 3 // block) * block, n]  # at scale blocks, not rows
    lay_f, lay_i = FusedLayout.build(geo, False), FusedLayout.build(geo, True)
    fwd, inv = cuda_fused.FusedPlan(geo, cp), cuda_fused.FusedPlan(geo, cp, inverse=True)
    ys = []
    for x in xs:
        pool = lay_f.pool.copy()
        project(lay_f, pool, x)
        ys.append(apply_model(lay_f, pool, x))
    z_dev, z_host = cp.empty(n, np.float32), np.empty(n, np.float32)
    for c in range(nr):
        lo, count = cuts[c], cuts[c + 1] - cuts[c]
        order = [(c + 1 + h) % nr for h in range(nr)]  # the owner c adds last
        host = encode(ys[order[0]][lo : lo + count], f, block)
        fwd.project(xd := cp.asarray(xs[order[0]]))
        dev = fwd.encode(xd, lo, count, f, block, cp.zeros(host.size, np.uint8))
        for r in order[1:]:
            host = decode_add_encode(host, ys[r][lo : lo + count], f, block)
            fwd.project(xd := cp.asarray(xs[r]))
            dev = fwd.decode_add_encode(xd, lo, count, dev, f, block, cp.zeros(host.size, np.uint8))
        assert np.array_equal(dev.get(), host), f"chunk {c}"
        CudaKernels.decode(dev, count, f, block, z_dev[lo : lo + count])
        z_host[lo : lo + count] = decode(host, count, f, block)
    out = cp.empty(n, np.float32)
    inv.apply(z_dev, out, float(nr))
    pool = lay_i.pool.copy()
    project(lay_i, pool, z_host)
    want = apply_model(lay_i, pool, z_host) / np.float32(nr)
    assert np.array_equal(bits(out.get()), bits(want))
    avg = np.mean(np.stack(xs).astype(np.float64), axis=0)
    assert np.linalg.norm(want - avg) <= 0.2 * np.linalg.norm(avg)


# ---------------------------------------------------------------- gift_allreduce on device arrays
# (giftcomm.collectives.gift): P virtual ranks over the device loopback on the stand-in.

def _sim_bound(geo, xs, fmt, algorithm, p, nodes, op):
    """Per-element bound on |device result - simulate_gift_allreduce(xs, geo)| (the unfused
    reference: giftcomm.geometry's transforms + giftcomm.reference's codec; docs/gpu.md "Fused
    transform", gift_allreduce): each rank's transformed values differ by at most beta (both
    transforms within gamma_K of exact, K the fused chain plus the dense one, m + n); each of the
    algorithm's Q quantizations adds at most one FP8 step of its scale block (s amax, s = 2^-3
    e4m3, 2^-2 e5m2) on top of the difference it is given; the inverse maps the difference with
    |S^-1| and adds its own rounding (both inverses)."""
    from giftcomm.algorithms import BY_NAME
    from giftcomm.algorithms.machine import Topology

    q = BY_NAME[algorithm].quantizations(Topology(p, nodes, p // nodes))
    s = 2.0 ** (-3 if fmt == "e4m3" else -2)
    block = 32
    k = max(t.segment.matrix_shape[1] // 32 + 3 * sum(t.segment.matrix_shape) + 2 * (t.right.rank or 0)
            + (t.left.rank or 0) + 24 for t in geo.transforms)
    g = k * U / (1 - k * U)
    ys = [np.abs(exact(geo, x)) for x in xs]
    beta = sum(g * exact(geo, x, absolute=True) for x in xs)
    mag = sum(ys) + beta
    nb = -(-geo.size // block)
    amax = np.pad(mag, (0, nb * block - geo.size)).reshape(nb, block).max(axis=1).repeat(block)[: geo.size]
    dz = beta + q * s * (1 + s) ** q * amax + 2.0**-20 * mag
    zmax = mag + dz
    bound = exact(geo, dz, inverse=True, absolute=True) + 2 * g * exact(geo, zmax, inverse=True, absolute=True)
    return bound / p if op == "avg" else bound


GIFT_CASES = [  # algorithm, P, local_size, fmt, dtype, op, rounding
    ("ring", 3, None, "e4m3", np.float32, "avg", "nearest"),
    ("direct", 3, None, "e5m2", np.float64, "sum", "nearest"),
    ("oneshot", 3, None, "e4m3", np.float32, "sum", "nearest"),
    ("doubling", 3, None, "e4m3", np.float32, "avg", "nearest"),
    ("hierarchical", 4, 2, "e4m3", np.float32, "avg", "nearest"),
    ("hierarchical_direct", 4, 2, "e5m2", np.float32, "sum", "nearest"),
    ("ring", 2, None, "mxfp8", np.float32, "avg", "stochastic"),
]


@pytest.mark.parametrize("algorithm,p,local_size,fmt,dtype,op,rounding", GIFT_CASES,
                         ids=[f"{c[0]}-{c[3]}-{c[6]}" for c in GIFT_CASES])
def test_gift_allreduce_device_equals_host_model(cp, rng, monkeypatch, algorithm, p, local_size, fmt, dtype, op,
                                                 rounding):
    """gift_allreduce of device arrays over P device-loopback ranks: every rank bit-identical;
    equal bit for bit to the host model (simulate_gift_allreduce with the fused kernels'
    arithmetic, fused_model.ModelGeometry); within the stated bound of the unfused reference
    (giftcomm.geometry + giftcomm.reference); the forward inside the encodes where the algorithm
    takes it (gc_fz_enc/dae launched; hierarchical: the node ring's fp32 ones), else written
    once by the apply kernel; the inverse inside the final decode for ring and direct."""
    import giftcomm as gc
    from giftcomm.collectives import gift
    from giftcomm.geometry.fused_model import ModelGeometry
    from giftcomm.reference import simulate_gift_allreduce
    from giftcomm.transport.device_loopback import DeviceLoopbackGroup

    monkeypatch.setattr(cuda_fused, "MAX_GRID", 4)
    geo = geometry(rng)
    xs = [random_x(rng, geo.size).astype(dtype) for _ in range(p)]
    args = [cp.asarray(x) for x in xs]
    seed = 7 if rounding == "stochastic" else None
    block = None if fmt == "mxfp8" else 32
    kw = dict(op=op, fmt=fmt, block=block, algorithm=algorithm, local_size=local_size, rounding=rounding, seed=seed)
    got = DeviceLoopbackGroup(p).run(lambda t: gc.gift_allreduce(args[t.rank], geo, comm=t, slice_elems=256, **kw))
    res = [cp.asnumpy(g) for g in got]
    for r in range(p):
        assert res[r].dtype == dtype and res[r].tobytes() == res[0].tobytes(), f"rank {r} differs from rank 0"
    sim = dict(op=op, algorithm=algorithm, local_size=local_size, rounding=rounding, seed=seed)
    want = simulate_gift_allreduce(xs, ModelGeometry(geo), fmt, block, **sim)[0]
    assert res[0].tobytes() == want.tobytes(), "device result != host model"
    if hasattr(cp, "runtime_state"):  # the stand-in counts launches per kernel
        launched = cp.runtime_state.launches
        fused = gift.fused_encode(algorithm, get_format(fmt), block or 32, seed)
        node = gc.algorithms.row(algorithm).fused == "nodes"  # fused into the node-local fp32 ring
        fp8 = fused and not node
        assert bool(launched.get(f"gc_fz_enc_{fmt}")) == fp8
        folds = algorithm == "doubling" and p & (p - 1)  # a rank folds into another: a hop
        assert bool(launched.get(f"gc_fz_dae_{fmt}")) == (fp8 and (algorithm == "ring" or bool(folds)))
        assert bool(launched.get(f"gc_fz_dec_{fmt}")) == (fp8 and gc.algorithms.row(algorithm).fused == "scatter")
        assert bool(launched.get("gc_fz_enc_fp32")) == bool(launched.get("gc_fz_dae_fp32")) == node
        # the apply kernel: direct's own values, the float32 route's inverse, the unfused route
        assert bool(launched.get("gc_fz_apply_f32")) == (not fused or algorithm != "ring")
    ref = simulate_gift_allreduce(xs, geo, fmt, block, **sim)[0].astype(np.float64)
    if fmt in ANY_BLOCK_FORMATS:
        nodes = p // (local_size or p)
        assert np.all(np.abs(res[0] - ref) <= _sim_bound(geo, xs, fmt, algorithm, p, nodes, op)), \
            "device result outside the bound of the unfused reference"


def test_gift_allreduce_device_steady_state(cp, rng, monkeypatch):
    """A repeated device gift_allreduce (ring, fused route, out= given) allocates nothing on the
    device and never waits on it or copies to the host, apart from the device loopback's own
    message copies (which NCCL does not make): the call's device work is a fixed launch sequence
    on the current stream (docs/gpu.md, graph capture)."""
    import giftcomm as gc
    from giftcomm.transport.device_loopback import DeviceLoopbackGroup, DeviceLoopbackTransport

    geo, p = geometry(rng), 3
    args = [cp.asarray(random_x(rng, geo.size)) for _ in range(p)]
    outs = [cp.empty(geo.size, np.float32) for _ in range(p)]
    import threading

    rt = cp.runtime_state
    counted = {"allocations": 0, "syncs": 0}
    in_transport = threading.local()  # the loopback ranks are threads: count per thread
    issue, alloc = DeviceLoopbackTransport.issue, rt.alloc

    def counting_issue(self, ops):  # the transport's own copies are not the collective's
        in_transport.on = True
        try:
            issue(self, ops)
        finally:
            in_transport.on = False

    def counting_alloc(*a, **k):
        if not getattr(in_transport, "on", False):
            counted["allocations"] += 1
        return alloc(*a, **k)

    monkeypatch.setattr(DeviceLoopbackTransport, "issue", counting_issue)
    monkeypatch.setattr(rt, "alloc", counting_alloc)

    def counting(fn):  # a device-to-host read or a wait on the device, outside the transport
        def wrapped(*a, **k):
            if not getattr(in_transport, "on", False):
                counted["syncs"] += 1
            return fn(*a, **k)

        return wrapped

    for name in ("get", "item", "__float__", "__int__", "__bool__", "__index__"):
        monkeypatch.setattr(cp.ndarray, name, counting(getattr(cp.ndarray, name)))
    for owner in (type(cp.cuda.get_current_stream()), cp.cuda.Device):
        monkeypatch.setattr(owner, "synchronize", counting(owner.synchronize))
    monkeypatch.setattr(cp.cuda.runtime, "deviceSynchronize", counting(cp.cuda.runtime.deviceSynchronize))
    group = DeviceLoopbackGroup(p)

    def call(t):
        return gc.gift_allreduce(args[t.rank], geo, comm=t, op="avg", block=32, algorithm="ring",
                                 out=outs[t.rank], slice_elems=512)

    group.run(call)
    assert counted["allocations"] > 0  # the counter sees the first call's workspaces
    first = [o.get() for o in outs]
    counted["syncs"] = counted["allocations"] = 0
    group.run(call)
    assert counted == {"allocations": 0, "syncs": 0}
    for r in range(p):
        assert np.array_equal(outs[r].get(), first[r])


def test_gift_allreduce_host_and_device_ranks_disagree(cp, rng):
    """The route (fused kernels for a device array, giftcomm.geometry for a host one) is agreed:
    ranks mixing the two would round differently, so every rank raises instead."""
    import giftcomm as gc
    from giftcomm.transport.device_loopback import DeviceLoopbackGroup

    geo = geometry(rng)
    xs = [random_x(rng, geo.size) for _ in range(2)]
    args = [xs[0], cp.asarray(xs[1])]  # rank 0 host, rank 1 device

    def call(t):
        try:
            gc.gift_allreduce(args[t.rank], geo, comm=t, block=32)
        except ValueError as exc:
            return str(exc)
        return None

    got = DeviceLoopbackGroup(2).run(call)
    assert all(g is not None and "geometry" in g for g in got), got


def test_device_bench_gift_section_on_the_stand_in(cp, rng, monkeypatch):
    """``python -m giftcomm.perf device --sections gift``'s measuring code runs end to end (every
    call it times, the fused vs unfused comparison) with a timer that calls once; the unfused
    route's transforms go through the host (the stand-in has no matmul)."""
    import types

    from giftcomm.perf import device_bench as db

    monkeypatch.setattr(cp, "random", types.SimpleNamespace(
        standard_normal=lambda n, dtype=np.float32: cp.asarray(rng.standard_normal(n).astype(dtype))), raising=False)
    monkeypatch.setattr(cp, "linalg", types.SimpleNamespace(
        norm=lambda a: cp.asarray(np.array(np.linalg.norm(a.get()), np.float32))), raising=False)
    geo = geometry(rng)
    fwd, inv = geo.forward, geo.inverse
    monkeypatch.setattr(geo, "forward", lambda x, **k: cp.asarray(fwd(x.get())))
    monkeypatch.setattr(geo, "inverse", lambda x, **k: cp.asarray(inv(x.get())))
    calls = []
    res = db.measure_gift(cp, lambda fn: (calls.append(fn()), 1.0)[1], lambda fn: (fn(), 2.0)[1], geo)
    assert len(calls) == 4 and res["gift"] == res["plain"] == 2.0
    assert 0 < res["diff"] < 0.1  # fused vs unfused gift_allreduce at P = 1: one e4m3 quantization apart at most
    assert "| 400 |" in db.format_gift(res, geo.size, 4000.0)
