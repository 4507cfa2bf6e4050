"""The GIFT paper's method as a preset (giftcomm.geometry.paper), its error feedback in the
transformed coordinates (giftcomm.collectives.feedback.TransformedFeedback) and the baseline wires peers run
(giftcomm.reference.baselines, giftcomm.collectives.baselines). Definitions are restated here in plain NumPy,
independently of the library's code."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import torch_seeded

from giftcomm import GiftSchedule, LoopbackGroup
from giftcomm.collectives.baselines import BASELINE_WIRES, baseline_allreduce
from giftcomm.collectives.feedback import ErrorFeedback, TransformedFeedback, own_quantization_error
from giftcomm.formats import get_format
from giftcomm.geometry import Geometry, InputFactorEstimator, Layout, PaperOptions, paper_sharded, refresh_geometry
from giftcomm.geometry.paper import SaturationProfile, saturation_fraction, select_saturated
from giftcomm.geometry.sharded import restrict
from giftcomm.reference.simulate import simulate_allreduce

LAYOUT = Layout([("up", (24, 40)), ("up.bias", (24,)), ("down", (40, 24)), ("norm", (40,))])


def covariance(rng, n, rows=300, spread=30.0):
    """An anisotropic input covariance a^T a / rows: feature scales over ``spread``, a few outliers."""
    scales = np.geomspace(1.0, spread, n)
    rng.shuffle(scales)
    a = rng.standard_normal((rows, n)) * scales + 0.3 * rng.standard_normal((rows, 1))
    return a.T @ a / rows


# ---------------------------------------------------------------- the definitions, restated
def paper_map_reference(w, a, r, d, factor="cholesky"):
    """W~ = W L^-T with L = chol(A^ + dI), A^ = U_r diag(l_r) U_r^T + diag(max(diag(A - that), d))
    (or W S, S = (A^ + dI)^-1/2). Float64. Returns (W~, M) with W = W~ M^T the inverse."""
    lam, u = np.linalg.eigh(a)
    top = np.argsort(lam)[::-1][:r]
    low = u[:, top] @ np.diag(lam[top]) @ u[:, top].T
    a_hat = low + np.diag(np.maximum(np.diag(a - low), d))
    m = a_hat + d * np.eye(a.shape[0])
    if factor == "cholesky":
        chol = np.linalg.cholesky(m)
        return np.linalg.solve(chol, w.T).T, chol
    vals, vecs = np.linalg.eigh(m)
    return w @ (vecs @ np.diag(vals**-0.5) @ vecs.T), vecs @ np.diag(vals**0.5) @ vecs.T


@pytest.mark.parametrize("factor", ["cholesky", "symmetric"])
@pytest.mark.parametrize("rank", [4, 32, 100])
def test_paper_maps_match_numpy_definition_and_invert(factor, rank):
    rng = np.random.default_rng()
    factors = {"up": covariance(rng, 40), "down": covariance(rng, 24)}
    geo = Geometry.preset("paper", LAYOUT, factors, rank=rank, factor=factor)
    x = rng.standard_normal(LAYOUT.size).astype(np.float32)
    y = geo.forward(x)
    for name, a in factors.items():
        seg = LAYOUT[name]
        w = x[seg.offset : seg.stop].reshape(seg.matrix_shape).astype(np.float64)
        want, back = paper_map_reference(w, a, rank, 1e-3, factor)
        got = y[seg.offset : seg.stop].reshape(seg.matrix_shape)
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want), name
        inv = geo.inverse(y)[seg.offset : seg.stop]
        assert np.linalg.norm(inv.reshape(seg.matrix_shape) - w) <= 1e-5 * np.linalg.norm(w), name
        assert np.allclose(want @ back.T, w, rtol=0, atol=1e-9 * np.abs(w).max())  # the restatement is consistent
    for name in ("up.bias", "norm"):  # not matrices: untouched
        seg = LAYOUT[name]
        assert np.array_equal(y[seg.offset : seg.stop], x[seg.offset : seg.stop])
    z = geo.inverse(y)
    assert np.linalg.norm(z - x) <= 1e-5 * np.linalg.norm(x)


def test_paper_options_defaults_and_validation():
    o = PaperOptions()
    assert (o.rank, o.damping, o.decay, o.refresh_every, o.factor, o.reexpress) == (32, 1e-3, 0.95, 50, "cholesky", True)
    for bad in ({"rank": 0}, {"damping": -1.0}, {"decay": 1.0}, {"factor": "lu"}, {"refresh_every": 0},
                {"threshold": 2.0}, {"top_n": 0}):
        with pytest.raises(ValueError):
            PaperOptions(**bad)
    with pytest.raises(TypeError, match="unknown option"):
        Geometry.preset("paper", LAYOUT, {}, rnk=3)
    with pytest.raises(ValueError, match="unknown geometry preset"):
        Geometry.preset("papers", LAYOUT, {})


def test_paper_bad_input_is_a_clear_error():
    rng = np.random.default_rng()
    good = covariance(rng, 40)
    with pytest.raises(ValueError, match="not positive definite"):
        Geometry.preset("paper", LAYOUT, {"up": -np.eye(40)})  # not PSD: -1 + 1e-3 + 1e-3 < 0
    with pytest.raises(ValueError, match="not positive definite"):
        Geometry.preset("paper", LAYOUT, {"up": np.zeros((40, 40))}, damping=0.0)
    with pytest.raises(ValueError, match="non-finite"):
        Geometry.preset("paper", LAYOUT, {"up": np.full((40, 40), np.nan)})
    with pytest.raises(ValueError, match="no factor A"):
        Geometry.preset("paper", LAYOUT, {"up": good}, names=("up", "down"))
    with pytest.raises(ValueError, match="needs A of shape"):
        Geometry.preset("paper", LAYOUT, {"up": np.eye(24)})
    with pytest.raises(ValueError, match="not a segment"):
        Geometry.preset("paper", LAYOUT, {"nope": good})
    # names restricts the transform to the chosen segments
    geo = Geometry.preset("paper", LAYOUT, {"up": good, "down": covariance(rng, 24)}, names=("down",))
    assert geo["up"].is_identity and not geo["down"].is_identity


def test_paper_map_is_row_local_under_sharding():
    """FSDP2 row shards: every shard's map applied to its rows alone equals the full map's rows."""
    rng = np.random.default_rng()
    factors = {"up": covariance(rng, 40), "down": covariance(rng, 24)}
    for shards in (2, 3, 5):
        sg = paper_sharded(LAYOUT, factors, shards)
        x = rng.standard_normal(LAYOUT.size).astype(np.float32)
        full_y = sg.full().forward(x)
        for r in range(shards):
            mine = restrict(LAYOUT, x, shards, r)
            y = sg.shard(r).forward(mine)
            want = restrict(LAYOUT, full_y, shards, r)
            np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
            np.testing.assert_allclose(sg.shard(r).inverse(y), mine, rtol=1e-4, atol=1e-5 * np.abs(mine).max())


# ---------------------------------------------------------------- estimation and agreement
def test_estimator_ema_matches_definition():
    rng = np.random.default_rng()
    est = InputFactorEstimator(LAYOUT, decay=0.95)
    want = None
    for _ in range(4):
        a = rng.standard_normal((3, 17, 40))
        est.update("up", a)
        b = a.reshape(-1, 40)
        batch = b.T @ b / b.shape[0]
        want = batch if want is None else 0.95 * want + 0.05 * batch
    np.testing.assert_allclose(est.factors()["up"], want, rtol=1e-12, atol=1e-13)  # entries near 0: float64 rounding of O(1) sums
    with pytest.raises(ValueError):
        est.update("up", rng.standard_normal((4, 24)))


def _every_rank(group, fn):
    """Run fn(transport) on every rank; each rank's result or exception."""
    def body(t):
        try:
            return fn(t)
        except Exception as exc:  # collected per rank: every rank must raise
            return exc
    return group.run(body)


def test_refresh_agrees_on_every_rank_loopback():
    rng = np.random.default_rng()
    p = 3
    local = [{"up": covariance(rng, 40), "down": covariance(rng, 24)} for _ in range(p)]
    geos = _every_rank(LoopbackGroup(p), lambda t: refresh_geometry(t, LAYOUT, local[t.rank], step=50))
    assert all(isinstance(g, Geometry) for g in geos), geos
    assert len({g.fingerprint() for g in geos}) == 1
    mean = {n: sum(f[n] for f in local) / p for n in ("up", "down")}
    x = rng.standard_normal(LAYOUT.size).astype(np.float32)
    np.testing.assert_allclose(geos[0].forward(x), Geometry.preset("paper", LAYOUT, mean).forward(x), rtol=1e-5, atol=1e-5)


def test_refresh_errors_on_every_rank_loopback():
    rng = np.random.default_rng()
    p = 3
    local = [{"up": covariance(rng, 40), "down": covariance(rng, 24)} for _ in range(p)]
    # a rank missing a factor
    missing = [dict(f) for f in local]
    del missing[1]["down"]
    out = _every_rank(LoopbackGroup(p), lambda t: refresh_geometry(t, LAYOUT, missing[t.rank], step=50))
    assert all(isinstance(e, RuntimeError) and "rank 1" in str(e) and "down" in str(e) for e in out), out
    # a refresh that only some ranks reach at this step
    out = _every_rank(LoopbackGroup(p), lambda t: refresh_geometry(t, LAYOUT, local[t.rank], step=50 if t.rank else 49))
    assert all(isinstance(e, RuntimeError) and "[49, 50]" in str(e) for e in out), out
    # A not positive definite after damping (the average of the ranks' A)
    neg = [dict(f, up=-10 * np.eye(40)) for f in local]
    out = _every_rank(LoopbackGroup(p), lambda t: refresh_geometry(t, LAYOUT, neg[t.rank], step=50))
    assert all(isinstance(e, ValueError) and "not positive definite" in str(e) for e in out), out


# ---------------------------------------------------------------- error feedback, transformed
def test_feedback_reexpression_preserves_the_ordinary_residual():
    rng = np.random.default_rng()
    fmt = get_format("e5m2")
    g1 = Geometry.preset("paper", LAYOUT, {"up": covariance(rng, 40), "down": covariance(rng, 24)})
    g2 = Geometry.preset("paper", LAYOUT, {"up": covariance(rng, 40), "down": covariance(rng, 24)})
    x = rng.standard_normal(LAYOUT.size).astype(np.float32)
    costs = {}
    for reexpress in (True, False):
        fb = TransformedFeedback(reexpress=reexpress)
        fb.record("b", x, fmt, 256, None, 0, g1)
        e1 = fb.residuals["b"]
        np.testing.assert_array_equal(e1, own_quantization_error(g1.forward(x), fmt, 256, None, 0))  # in g1's coordinates
        ordinary = g1.inverse(e1)
        e2 = fb.residual("b", g2)
        carried = g2.inverse(e2)
        costs[reexpress] = float(np.linalg.norm(carried - ordinary) / np.linalg.norm(ordinary))
        # e_new = e_old L_old^T L_new^-T, segment by segment (restated with the sides' matrices)
        if reexpress:
            for name in ("up", "down"):
                seg = LAYOUT[name]
                old = e1[seg.offset : seg.stop].reshape(seg.matrix_shape).astype(np.float64)
                lo, ln = g1[name].right.l.astype(np.float64), g2[name].right.l.astype(np.float64)
                want = np.linalg.solve(ln, (old @ lo.T).T).T
                np.testing.assert_allclose(e2[seg.offset : seg.stop].reshape(seg.matrix_shape), want,
                                           rtol=1e-4, atol=1e-5 * np.abs(want).max())
    assert costs[True] < 1e-5, costs
    assert costs[False] > 1e-2, costs  # the artifact's choice changes the residual it feeds back
    print(f"ordinary-coordinate residual change at a refresh: re-expressed {costs[True]:.2e}, kept {costs[False]:.2e}")


def test_feedback_identity_geometry_is_plain_error_feedback():
    rng = np.random.default_rng()
    fmt = get_format("e4m3")
    x = rng.standard_normal(1000).astype(np.float32)
    a, b = ErrorFeedback(), TransformedFeedback()
    a.record(0, x, fmt, 256, None, 0)
    b.record(0, x, fmt, 256, None, 0)
    np.testing.assert_array_equal(a.residuals[0], b.residuals[0])
    y1, y2 = x.copy(), x.copy()
    a.compensate(0, y1)
    b.compensate(0, y2)
    np.testing.assert_array_equal(y1, y2)


def test_feedback_euclidean_false_drops_identity_segments():
    rng = np.random.default_rng()
    geo = Geometry.preset("paper", LAYOUT, {"up": covariance(rng, 40)})
    fb = TransformedFeedback(euclidean=False)
    fb.record(0, rng.standard_normal(LAYOUT.size).astype(np.float32), get_format("e5m2"), 256, None, 0, geo)
    e = fb.residuals[0]
    for seg in LAYOUT:
        part = e[seg.offset : seg.stop]
        assert (np.any(part != 0) if seg.name == "up" else not np.any(part)), seg.name


def test_feedback_around_a_live_call():
    """With a fixed geometry the compensated sums telescope: the sum of the results equals the sum
    of the gradients minus the last residuals (mapped back), to float32 rounding."""
    rng = np.random.default_rng()
    import giftcomm

    geo = Geometry.preset("paper", LAYOUT, {"up": covariance(rng, 40), "down": covariance(rng, 24)})
    fmt = get_format("e5m2")
    steps = [[rng.standard_normal(LAYOUT.size).astype(np.float32) for _ in range(2)] for _ in range(6)]

    def body(t):
        fb = TransformedFeedback()
        total = np.zeros(LAYOUT.size)
        for s in steps:
            buf = s[t.rank].copy()
            fb.around(0, buf, lambda v: giftcomm.gift_allreduce(v, geo, comm=t, fmt=fmt, algorithm="oneshot", out=v),
                      lambda: t, fmt, 256, None, geo)
            total += buf
        return total, geo.inverse(fb.residuals[0]).astype(np.float64)

    got = LoopbackGroup(2).run(body)
    exact = sum(s[0].astype(np.float64) + s[1] for s in steps)
    left = got[0][1] + got[1][1]
    err = np.linalg.norm(got[0][0] - exact)
    assert np.linalg.norm(got[0][0] + left - exact) < 1e-4 * np.linalg.norm(exact)
    assert err > 10 * 1e-4 * np.linalg.norm(exact)  # the residual left is real quantization error


# ---------------------------------------------------------------- the paper's selection rule
def test_saturation_fraction_definition():
    rng = np.random.default_rng()
    for fmt in ("e5m2", "e4m3"):
        f = get_format(fmt)
        x = (rng.standard_normal(5000) * np.exp(rng.uniform(-12, 3, 5000))).astype(np.float32)
        x[:10] = 0.0
        s = np.abs(x).max() / f.max_value
        q = np.abs(np.clip(x / np.float32(s), -f.max_value, f.max_value).astype(f.wire_dtype).astype(np.float64))
        tiny = float(ml_dtypes.finfo(f.wire_dtype).smallest_subnormal)
        want = np.mean((q == f.max_value) | ((x != 0) & (q <= tiny)))
        assert saturation_fraction(x, fmt) == pytest.approx(want, abs=0)
        assert 0 < want < 1
    assert saturation_fraction(np.zeros(7)) == 0.0


def test_saturation_profile_selects_top_n_and_threshold():
    rng = np.random.default_rng()
    prof = SaturationProfile("e5m2", steps=3)
    layout = Layout([("a", (8, 64)), ("b", (8, 64)), ("c", (8, 64)), ("v", (8,))])
    for _ in range(5):  # steps beyond the window are ignored
        flat = rng.standard_normal(layout.size).astype(np.float32)
        flat[layout["b"].offset : layout["b"].stop] *= np.exp(rng.uniform(-20, 0, 512)).astype(np.float32)  # many underflow
        flat[layout["c"].offset] = 1e6  # one outlier: the rest underflow less
        prof.update_flat(layout, flat)
    assert prof.full and set(prof.scores()) == {"a", "b", "c"}
    sc = prof.scores()
    assert sc["b"] > sc["a"]
    assert prof.select(top_n=1) == ("b",)
    assert set(prof.select(threshold=sc["a"])) == {n for n in sc if sc[n] >= sc["a"]}
    assert select_saturated({"x": 0.1, "y": 0.1, "z": 0.3}, top_n=2) == ("z", "x")


# ---------------------------------------------------------------- baseline wires
def nccl_fp8_sum_reference(xs, fmt, local=False):
    """Per-tensor scale (MAX over ranks, or each rank's own), FP8 codes, ring sum with every
    partial sum in fp16 and rounded back to FP8 after each addition; chunk c starts at rank c+1."""
    f = get_format(fmt)
    p, n = len(xs), xs[0].size
    own = [float(np.abs(x).max()) / f.max_value for x in xs]
    sc = own if local else [max(own)] * p
    q = [np.clip(x / np.float32(s), -f.max_value, f.max_value).astype(f.wire_dtype) for x, s in zip(xs, sc)]
    total = np.zeros(n, np.float32)
    for c in range(p):
        lo, hi = c * n // p, (c + 1) * n // p
        acc = q[(c + 1) % p][lo:hi].astype(np.float32)
        for k in range(2, p + 1):
            with np.errstate(over="ignore"):
                h = (acc.astype(np.float16) + q[(c + k) % p][lo:hi].astype(np.float16)).astype(np.float32)
            acc = np.clip(h, -f.max_value, f.max_value).astype(f.wire_dtype).astype(np.float32)
        total[lo:hi] = acc
    return [total * np.float32(s) for s in sc]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
def test_baseline_wires_match_restatement(p, fmt):
    rng = np.random.default_rng()
    xs = [(rng.standard_normal(301) * rng.uniform(0.1, 3)).astype(np.float32) for _ in range(p)]
    for local in (False, True):
        wire = f"{fmt}/tensor-{'local' if local else 'nccl'}"
        want = nccl_fp8_sum_reference(xs, fmt, local)
        sim = simulate_allreduce(xs, wire)
        live = LoopbackGroup(p).run(lambda t: baseline_allreduce(xs[t.rank], wire, comm=t))
        for r in range(p):
            np.testing.assert_array_equal(sim[r], want[r])
            np.testing.assert_array_equal(live[r], want[r])
    assert set(BASELINE_WIRES) == {"e5m2/tensor-nccl", "e5m2/tensor-local", "e4m3/tensor-nccl", "e4m3/tensor-local"}


def test_local_scale_wire_makes_ranks_diverge():
    rng = np.random.default_rng()
    p = 4
    xs = [(rng.standard_normal(4096) * (1 + r)).astype(np.float32) for r in range(p)]
    agreed = LoopbackGroup(p).run(lambda t: baseline_allreduce(xs[t.rank], "e5m2/tensor-nccl", comm=t, op="avg"))
    local = LoopbackGroup(p).run(lambda t: baseline_allreduce(xs[t.rank], "e5m2/tensor-local", comm=t, op="avg"))
    assert all(np.array_equal(agreed[0], a) for a in agreed)
    spread = max(np.linalg.norm(a - local[0]) for a in local) / np.linalg.norm(local[0])
    assert spread > 0.1, spread
    print(f"e5m2/tensor-local over {p} ranks: ranks' results differ by up to {spread:.3f} (relative L2)")


def test_baseline_bad_input_everywhere():
    def body(t):
        x = np.ones(10 + t.rank, np.float32)
        return baseline_allreduce(x, "e5m2/tensor-nccl", comm=t)
    out = _every_rank(LoopbackGroup(2), body)
    assert all(isinstance(e, ValueError) and "disagree" in str(e) for e in out), out

    def nan(t):
        x = np.ones(10, np.float32)
        x[3] = np.nan if t.rank == 1 else 1.0
        return baseline_allreduce(x, "e5m2/tensor-nccl", comm=t)
    out = _every_rank(LoopbackGroup(2), nan)
    assert all(isinstance(e, ValueError) and "non-finite" in str(e) for e in out), out
    with pytest.raises(ValueError, match="unknown baseline wire"):
        baseline_allreduce(np.ones(3), "e5m2/tensor")
    with pytest.raises(ValueError, match="baseline wire"):
        simulate_allreduce([np.ones(3)], "e5m2/tensor-nccl", algorithm="direct")


# ---------------------------------------------------------------- GradSync: baseline wire, paper EF
def test_gradsync_baseline_wire_and_paper_geometry():
    """GradSync over a baseline wire equals baseline_allreduce of the same buckets; with the paper's
    geometry and transformed feedback it keeps a residual in the geometry's coordinates."""
    import torch

    from giftcomm.adapters.torch import GradSync
    from giftcomm.adapters.torch.kfac import model_layout

    rng = np.random.default_rng()
    seed = int(rng.integers(2**31))

    def body(t):
        with torch_seeded(seed):
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
        sync = GradSync(model, comm=t, op="avg", baseline="e5m2/tensor-nccl",
                        schedule=GiftSchedule(error_feedback=True, feedback="transformed"))
        lay = sync.layouts[0]
        a_in = {n: covariance(np.random.default_rng(seed), lay[n].matrix_shape[1]) for n in ("0.weight", "2.weight")}
        geo = Geometry.preset("paper", lay, a_in)
        sync.set_geometries([geo])
        sync.zero_grad()
        x = torch.from_numpy(np.random.default_rng([seed, t.rank]).standard_normal((5, 16)).astype(np.float32))
        model(x).pow(2).mean().backward()
        local = sync.flat_grads()[0].copy()
        sync.sync(0)
        want = baseline_allreduce(local, "e5m2/tensor-nccl", comm=t, op="avg", geometry=geo)
        return sync.flat_grads()[0].copy(), want, sync.feedback.residuals[0], model_layout(model) == lay

    out = LoopbackGroup(2).run(body)
    for got, want, res, same_layout in out:
        assert same_layout
        np.testing.assert_array_equal(got, want)
        assert np.any(res != 0)
    np.testing.assert_array_equal(out[0][0], out[1][0])
    with pytest.raises(ValueError, match="transformed"):
        GradSync(torch.nn.Linear(3, 3), comm=LoopbackGroup(1).transports[0], baseline="e5m2/tensor-nccl",
                 schedule=GiftSchedule(error_feedback=True))
    with pytest.raises(ValueError, match="unknown baseline wire"):
        GradSync(torch.nn.Linear(3, 3), comm=LoopbackGroup(1).transports[0], baseline="e5m2")


def test_one_word_in_the_ddp_state_and_lightning_callback():
    import torch

    from giftcomm.adapters.lightning import GiftCommCallback
    from giftcomm.adapters.torch import GiftState

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    st = GiftState(schedule=GiftSchedule(geometry="paper", paper={"rank": 4, "refresh_every": 7},
                   error_feedback=True), capture=model)
    assert st.schedule.paper == PaperOptions(rank=4, refresh_every=7) and st.schedule.refresh_period == 7
    assert isinstance(st.feedback, TransformedFeedback) and st.capture.estimator.decay == 0.95
    st.capture.remove()
    cb = GiftCommCallback(schedule=GiftSchedule(geometry="paper"), capture=model)
    assert cb.state.schedule.paper == PaperOptions()
    cb.state.capture.remove()
    with pytest.raises(ValueError, match="paper"):
        GiftState(schedule=GiftSchedule(geometry="kfac", paper={"rank": 4}), capture=model)
    with pytest.raises(TypeError, match="unknown option"):
        GiftState(schedule=GiftSchedule(geometry="paper", paper={"rnk": 4}), capture=model)
