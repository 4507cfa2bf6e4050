"""The paper's preset from every entry point that takes a geometry: the plain
call and plans refuse the word on every rank (a flat buffer has no layers) and take the built
geometry (a plan bit-identical to gift_allreduce); GradSync and ShardedGradSync build it from
the model (every rank the same map, refreshed from A averaged over the ranks); the factor EMA
and the error feedback's re-expression at a refresh.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_same_error, outcomes, same, torch_seeded

import giftcomm as gc
from giftcomm import GiftSchedule, LoopbackGroup
from giftcomm.geometry import Geometry, Layout

LAYOUT = Layout([("up", (24, 40)), ("up.bias", (24,)), ("down", (40, 24))])


def random_factors(rng, layout=LAYOUT):
    out = {}
    for seg in layout:
        if seg.ndim >= 2:
            n = seg.matrix_shape[1]
            a = rng.standard_normal((3 * n, n)) * np.exp(rng.uniform(-2, 2, n))
            out[seg.name] = a.T @ a / (3 * n)
    return out


@pytest.mark.parametrize("p", [2, 3])
def test_plain_call_and_plan_refuse_the_word_on_every_rank(rng, p):
    x = rng.standard_normal(LAYOUT.size).astype(np.float32)
    errors = outcomes(p, lambda t: gc.gift_allreduce(x, "paper", comm=t))
    assert_same_error(errors, ValueError, "geometry='paper'", 'Geometry.preset(\'paper\'', "layout")
    errors = outcomes(p, lambda t: gc.plan_allreduce(x, comm=t, geometry="paper"))
    assert_same_error(errors, ValueError, "Geometry.preset('paper'")
    # the word on one rank only: still every rank
    geo = Geometry.preset("paper", LAYOUT, random_factors(rng))
    errors = outcomes(p, lambda t: gc.gift_allreduce(x, "paper" if t.rank == p - 1 else geo, comm=t))
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert all("Geometry.preset" in str(e) for e in errors)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_plan_with_the_paper_geometry_is_bit_identical_to_gift_allreduce(rng, p, op):
    geo = Geometry.preset("paper", LAYOUT, random_factors(rng))
    calls = [[(rng.standard_normal(LAYOUT.size) * rng.uniform(0.1, 10)).astype(np.float32) for _ in range(p)]
             for _ in range(3)]

    def body(t):
        plan = gc.plan_allreduce(calls[0][t.rank], comm=t, geometry=geo, op=op, fmt="e4m3")
        got = [plan(xs[t.rank]) for xs in calls]
        want = [gc.gift_allreduce(xs[t.rank], geo, comm=t, op=op, fmt="e4m3", algorithm=plan.algorithm)
                for xs in calls]
        return got, want

    res = LoopbackGroup(p).run(body)
    for got, want in res:
        assert all(same(g, w) for g, w in zip(got, want))
        assert all(same(g, r) for g, r in zip(got, res[0][0]))  # every rank alike
    # and the geometry mattered: the plan without it differs
    plain = LoopbackGroup(p).run(lambda t: gc.plan_allreduce(calls[0][t.rank], comm=t, op=op)(calls[0][t.rank]))
    assert not same(plain[0], res[0][0][0])


def test_plan_geometry_fingerprint_agreed_at_creation(rng):
    f = random_factors(rng)
    geos = [Geometry.preset("paper", LAYOUT, f), Geometry.preset("paper", LAYOUT, f, factor="symmetric")]
    x = rng.standard_normal(LAYOUT.size).astype(np.float32)
    errors = outcomes(2, lambda t: gc.plan_allreduce(x, comm=t, geometry=geos[t.rank]))
    assert_same_error(errors, ValueError, "ranks disagree on geometry")

    def rank_calls_another_plan(t):
        plans = [gc.plan_allreduce(x, comm=t, geometry=g) for g in geos]
        return plans[t.rank](x)

    errors = outcomes(2, rank_calls_another_plan)
    assert all(isinstance(e, (ValueError, RuntimeError)) for e in errors), errors
    assert len({str(e) for e in errors}) == 1


# ------------------------------------------------------------------ GradSync(geometry="paper")


class Mlp(torch.nn.Module):
    def __init__(self, skip_down: bool = False):
        super().__init__()
        self.up = torch.nn.Linear(40, 24)
        self.down = torch.nn.Linear(24, 40)
        self.skip_down = skip_down

    def forward(self, x):
        h = torch.relu(self.up(x))
        return h.sum(-1, keepdim=True) if self.skip_down else self.down(h)


def make_model(seed, **kw):
    with torch_seeded(seed):
        return Mlp(**kw)


def batches(seed, rank, steps, rows=32):
    g = np.random.default_rng([seed, rank])
    scale = np.exp(g.uniform(-2, 2, 40)) if rank >= 0 else None
    return [torch.from_numpy((g.standard_normal((rows, 40)) * scale).astype(np.float32)) for _ in range(steps)]


def train_grad_sync(t, seed, steps, model_kw=None, **kw):
    """``steps`` steps of GradSync(geometry="paper") on rank t.rank; per step the reduced
    gradients and every bucket geometry's fingerprint; the capture's A after the last step."""
    from giftcomm.adapters.torch import GradSync

    model = make_model(seed, **(model_kw(t.rank) if callable(model_kw) else model_kw or {}))
    knobs = {k: kw.pop(k) for k in ("paper", "error_feedback", "feedback") if k in kw}
    knobs["paper"] = {"profile_steps": 0, **knobs.get("paper", {})}  # every layer from sync 0: the map's mechanics
    sync = GradSync(model, comm=t, fmt="e4m3", schedule=GiftSchedule(geometry="paper", **knobs), **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for x in batches(seed, t.rank, steps):
        sync.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        sync.sync()
        out.append(([p.grad.numpy().copy() for p in model.parameters()],
                    [None if g is None else g.fingerprint() for g in sync.geometries]))
        opt.step()
    return out, sync


@pytest.mark.parametrize("p", [1, 2, 3])
def test_grad_sync_paper_trains_with_one_map_on_every_rank(rng, p):
    seed = int(rng.integers(2**31))
    res = LoopbackGroup(p).run(lambda t: train_grad_sync(t, seed, 5, paper={"refresh_every": 2, "rank": 4}))
    fps = [[step[1] for step in out] for out, _ in res]
    assert all(f == fps[0] for f in fps)  # every rank the same maps at every step
    assert fps[0][0] == fps[0][1] != fps[0][2] == fps[0][3] != fps[0][4]  # refreshed at syncs 0, 2, 4
    for out, _ in res:  # every rank the same reduced gradients
        for step, step0 in zip(out, res[0][0]):
            assert all(same(a, b) for a, b in zip(step[0], step0[0]))
    sync = res[0][1]
    geo = sync.geometries[0]
    kinds = {t.segment.name: (t.left.kind, t.right.kind) for t in geo.transforms if not t.is_identity}
    assert set(kinds) == {"up.weight", "down.weight"} and all(k == ("identity", "cholesky") for k in kinds.values())
    assert sync.refresh.refreshes == 3


def test_grad_sync_paper_first_map_is_the_preset_of_the_rank_mean(rng):
    """At sync 0 (no factor history) the map is Geometry.preset("paper") of the mean of the ranks'
    A, as a plain NumPy average gives it."""
    seed, p = int(rng.integers(2**31)), 3

    def body(t):
        out, sync = train_grad_sync(t, seed, 1, paper={"rank": 8})
        return sync.refresh.capture.estimator.factors(), sync.geometries[0], sync.layouts[0]

    res = LoopbackGroup(p).run(body)
    mean = {n: sum(r[0][n] for r in res) / p for n in res[0][0]}
    want = Geometry.preset("paper", res[0][2], mean, rank=8)
    probe = rng.standard_normal(want.size).astype(np.float32)
    np.testing.assert_allclose(res[0][1].forward(probe), want.forward(probe), rtol=2e-5, atol=2e-5)


def test_grad_sync_paper_factor_ema_blends_the_factors(rng):
    """With factor_decay the second map's factor is decay F_0 + (1 - decay) F_fresh, F_fresh the
    factor of the A captured by then; factor_decay=0 gives F_fresh."""
    from giftcomm.geometry.paper import input_factor

    seed = int(rng.integers(2**31))
    got = {}
    for decay in (0.0, 0.7):
        def body(t, decay=decay):
            out, sync = train_grad_sync(t, seed, 2, paper={"refresh_every": 1, "rank": 6, "factor_decay": decay})
            return sync.refresh.capture.estimator.factors(), sync.geometries[0], sync.refresh.factor_ema.factors
        got[decay] = LoopbackGroup(1).run(body)[0]
    a_last, geo0, ema0 = got[0.0]
    _, geo7, ema7 = got[0.7]
    opts = gc.geometry.PaperOptions(rank=6)
    for name in ("up.weight", "down.weight"):
        fresh = input_factor(a_last[name], opts)
        np.testing.assert_allclose(ema0[name][1], fresh, rtol=1e-12, atol=1e-12)
        assert not np.allclose(ema7[name][1], fresh)
        # the map uses the blended factor: x -> x F^-T
        lf = geo7[name].right
        np.testing.assert_allclose(lf.l, ema7[name][1].astype(np.float32), rtol=1e-6)
    assert geo0.fingerprint() != geo7.fingerprint()


def test_grad_sync_paper_errors_on_every_rank(rng):
    seed = int(rng.integers(2**31))
    # a rank whose down projection never fired: no factor for it there
    errors = outcomes(2, lambda t: train_grad_sync(t, seed, 1, model_kw=lambda r: {"skip_down": r == 1}))
    assert_same_error(errors, RuntimeError, "disagree on the factor refresh", "missing ['down.weight']")
    # ranks that would refresh at different syncs: the refresh's agreement, at the first sync
    errors = outcomes(2, lambda t: train_grad_sync(t, seed, 3, paper={"refresh_every": 2 + t.rank}))
    assert_same_error(errors, ValueError, "GradSync: the ranks disagree on when or how to refresh",
                      "refresh_every (rank 0: 2, rank 1: 3)")
    # bad settings, at once
    from giftcomm.adapters.torch import GradSync

    with pytest.raises(TypeError, match="GiftSchedule.*unknown option"):
        GradSync(make_model(0), comm=None, schedule=GiftSchedule(geometry="paper", paper={"ranks": 4}))
    with pytest.raises(ValueError, match="GradSync: schedule.geometry must be one of"):
        GradSync(make_model(0), comm=None, schedule=GiftSchedule(geometry="kfac"))
    with pytest.raises(TypeError, match="GradSync: .*pass the nn.Module"):
        GradSync(list(make_model(0).named_parameters()), comm=None, schedule=GiftSchedule(geometry="paper"))


@pytest.mark.parametrize("reexpress", [True, False])
def test_grad_sync_paper_error_feedback_re_expressed_at_a_refresh(rng, reexpress):
    """error_feedback=True with geometry="paper": the residual lives in the map's coordinates
    (TransformedFeedback); at a refresh (factor EMA on) it is re-expressed so that in ordinary
    coordinates it is unchanged to float32 rounding; reexpress=False keeps it as it is (moves)."""
    from giftcomm.collectives.feedback import TransformedFeedback

    seed = int(rng.integers(2**31))

    def body(t):
        out, sync = train_grad_sync(t, seed, 2, error_feedback=True,
                                    paper={"refresh_every": 100, "rank": 4, "reexpress": reexpress})
        assert isinstance(sync.feedback, TransformedFeedback) and sync.feedback.reexpress is reexpress
        old = sync.geometries[0]
        e_old = sync.feedback.residuals[0].copy()
        for x in batches(seed + 1, t.rank, 3):  # more A, then a refresh outside the schedule
            sync.zero_grad()
            up = next(iter(sync.refresh.capture.layers))  # its hook feeds A on this forward
            up(x).pow(2).mean().backward()
        sync._refresh(t, 100)
        new = sync.geometries[0]
        e_new = sync.feedback.residual(0, new)
        return old, new, e_old, e_new

    old, new, e_old, e_new = LoopbackGroup(2).run(body)[1]
    assert old.fingerprint() != new.fingerprint() and np.abs(e_old).max() > 0
    before, after = old.inverse(e_old), new.inverse(e_new)
    if reexpress:
        np.testing.assert_allclose(after, before, rtol=0, atol=1e-5 * np.abs(before).max())
    else:
        assert np.abs(after - before).max() > 1e-3 * np.abs(before).max()
        assert same(e_new, e_old)


# ------------------------------------------------------------------ ShardedGradSync(geometry="paper")
def test_inverse_flat_shard_equals_the_full_inverse_on_every_split(rng):
    """Equal shards that cut rows anywhere (P = 1..5, and shards shorter than a row): the shard
    inverse equals the full inverse's slice to float32 rounding; an output-side map is refused."""
    from giftcomm.geometry.sharded import inverse_flat_shard

    layout = Layout([("a", (7, 5)), ("b", (3,)), ("c", (4, 9)), ("d", (2, 13))])
    geo = Geometry.preset("paper", layout, random_factors(rng, layout), rank=3)
    for p in (1, 2, 3, 4, 5, 11):
        padded = -(-layout.size // p) * p
        y = np.zeros(padded, np.float32)
        y[: layout.size] = rng.standard_normal(layout.size)
        want = np.zeros(padded, np.float32)
        want[: layout.size] = geo.inverse(y[: layout.size])
        k = padded // p
        got = LoopbackGroup(p).run(lambda t: inverse_flat_shard(geo, y[t.rank * k: (t.rank + 1) * k], t.rank * k, t))
        np.testing.assert_allclose(np.concatenate(got)[: layout.size], want[: layout.size], rtol=1e-5, atol=1e-5)
    kfac = Geometry.from_kfac(layout, {"a": (np.eye(5), np.diag(np.arange(1.0, 8.0)))})
    with pytest.raises(ValueError, match="output side"):
        inverse_flat_shard(kfac, np.zeros(10, np.float32), 0)


def train_sharded(t, seed, steps, **kw):
    from giftcomm.adapters.torch import ShardedGradSync

    model = make_model(seed)
    knobs = {k: kw.pop(k) for k in ("paper", "error_feedback") if k in kw}
    knobs["paper"] = {"profile_steps": 0, **knobs.get("paper", {})}  # every layer from sync 0: the map's mechanics
    sync = ShardedGradSync(model, comm=t, fmt="e4m3", schedule=GiftSchedule(geometry="paper", **knobs),
                           algorithm="ring", allow_native=False, **kw)
    out = []
    for x in batches(seed, t.rank, steps):
        sync.zero_grad()
        model(x).pow(2).mean().backward()
        local = sync.buffer.numpy().copy()
        out.append((local, sync.sync().numpy().copy(), sync.geometry_of))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
    return out, sync


@pytest.mark.parametrize("p", [2, 3])
def test_sharded_grad_sync_paper_matches_the_reference(rng, p):
    """Every rank the same map; the shards concatenated equal inverse(simulated equal reduce-scatter
    of every rank's forward-mapped buffer), to float32 rounding; the map changes at a refresh."""
    from giftcomm.reference import simulate_reduce_scatter

    seed = int(rng.integers(2**31))
    res = LoopbackGroup(p).run(lambda t: train_sharded(t, seed, 3, paper={"refresh_every": 2, "rank": 4}))
    for step in range(3):
        geos = [r[0][step][2] for r in res]
        assert len({g.fingerprint() for g in geos}) == 1
        geo = geos[0]
        xs = [geo.forward(r[0][step][0]) for r in res]
        shards = simulate_reduce_scatter(xs, fmt="e4m3", op="avg", layout="equal", algorithm="ring")
        want = geo.inverse(np.concatenate(shards))
        got = np.concatenate([r[0][step][1] for r in res])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    fps = [r[0][s][2].fingerprint() for r in res[:1] for s in range(3)]
    assert fps[0] == fps[1] != fps[2]
    assert not res[0][0][0][2].is_identity


def test_sharded_grad_sync_paper_bad_input(rng):
    from giftcomm.adapters.torch import ShardedGradSync

    with pytest.raises(ValueError, match="needs a block-scaled format"):
        ShardedGradSync(make_model(0), comm=None, schedule=GiftSchedule(geometry="paper", error_feedback=True),
                        fmt="bf16")
    with pytest.raises(ValueError, match="ShardedGradSync: schedule.geometry must be one of"):
        ShardedGradSync(make_model(0), comm=None, schedule=GiftSchedule(geometry="kfac"))
    seed = int(rng.integers(2**31))

    def missing(t):
        from giftcomm.adapters.torch import ShardedGradSync

        model = make_model(seed, skip_down=t.rank == 0)
        sync = ShardedGradSync(model, comm=t, schedule=GiftSchedule(geometry="paper", paper={"profile_steps": 0}))
        sync.zero_grad()
        model(batches(seed, t.rank, 1)[0]).pow(2).mean().backward()
        return sync.sync()

    assert_same_error(outcomes(2, missing), RuntimeError, "disagree on the factor refresh")


def _own_error_direct(y, rank, p):
    """NumPy statement of what rank ``rank`` loses in direct's equal reduce-scatter: every chunk
    ``[c*k, (c+1)*k)`` but its own encoded alone (e4m3, block 256, nearest; the reference codec),
    its own chunk summed exactly."""
    from giftcomm.reference.codec import decode, encode

    k = y.size // p
    err = np.zeros_like(y)
    for c in range(p):
        if c != rank:
            part = y[c * k:(c + 1) * k]
            err[c * k:(c + 1) * k] = part - decode(encode(part, "e4m3"), part.size, "e4m3")
    return err


@pytest.mark.parametrize("p, reexpress", [(2, True), (3, True), (2, False)])
def test_sharded_grad_sync_paper_error_feedback_matches_numpy(rng, p, reexpress):
    """ShardedGradSync(geometry="paper", error_feedback=True, algorithm="direct") against a NumPy
    statement: per rank y = T(g) + e (e carried into T's coordinates: T_new(T_old^-1(e)) at a
    refresh, or kept as it is with reexpress=False), the shards = T^-1(reduce-scatter of the ys),
    then e = y's own-encoding error on the transformed weights (none on the identity ones). A
    refresh at sync 2 of 4; the statement that does the other thing with e at the refresh
    disagrees (the test can fail), and the residual left at the end is the statement's."""
    from giftcomm.adapters.torch import ShardedGradSync
    from giftcomm.reference import simulate_reduce_scatter

    seed, steps = int(rng.integers(2**31)), 4

    def body(t):
        model = make_model(seed)
        schedule = GiftSchedule(geometry="paper", error_feedback=True,
                                paper={"refresh_every": 2, "rank": 4, "reexpress": reexpress, "profile_steps": 0})
        sync = ShardedGradSync(model, comm=t, fmt="e4m3", schedule=schedule, algorithm="direct", allow_native=False)
        out = []
        for x in batches(seed, t.rank, steps):
            sync.zero_grad()
            model(x).pow(2).mean().backward()
            local = sync.buffer.numpy().copy()
            out.append((local, sync.sync().numpy().copy(), sync.geometry_of, sync.algorithm_used))
            with torch.no_grad():
                for q in model.parameters():
                    q -= 0.05 * q.grad
        return out, sync.feedback.residuals[0].copy(), sync.feedback.refreshes

    res = LoopbackGroup(p).run(body)

    def statement(carry_reexpressed, feedback=True):
        errs, prev, got_err = [np.zeros_like(res[0][0][0][0]) for _ in range(p)], None, []
        carried = {}
        for step in range(steps):
            geo = res[0][0][step][2]
            ys = []
            for r in range(p):
                e = errs[r]
                if prev is not None and prev.fingerprint() != geo.fingerprint() and carry_reexpressed:
                    e = np.asarray(geo.forward(np.asarray(prev.inverse(e), np.float32)), np.float32)
                    carried[r] = (errs[r], e)
                y = np.asarray(geo.forward(res[r][0][step][0]), np.float32) + e
                ys.append(y)
                errs[r] = _own_error_direct(y, r, p) if feedback else 0 * y
                for tr in geo.transforms:  # the paper: no residual on the weights it leaves Euclidean
                    if tr.is_identity:
                        errs[r][tr.segment.offset : tr.segment.stop] = 0
            want = geo.inverse(np.concatenate(simulate_reduce_scatter(ys, fmt="e4m3", op="avg", layout="equal",
                                                                      algorithm="direct")))
            got_err.append(want)
            prev = geo
        return got_err, errs, carried

    want, errs, carried = statement(reexpress)
    plain, _, _ = statement(reexpress, feedback=False)
    fps = [res[0][0][s][2].fingerprint() for s in range(steps)]
    assert fps[0] == fps[1] != fps[2] == fps[3] and all(r[0][s][3] == "direct" for r in res for s in range(steps))
    for step in range(steps):
        assert len({r[0][step][2].fingerprint() for r in res}) == 1
        got = np.concatenate([r[0][step][1] for r in res])
        np.testing.assert_allclose(got, want[step], rtol=1e-5, atol=1e-5 * np.abs(want[step]).max())
    for step in (1, 3):  # the feedback shows in the result, 100x the tolerance
        assert np.abs(plain[step] - want[step]).max() > 1e-3 * np.abs(want[step]).max()
    for e_old, e_new in carried.values():  # the re-expression is no identity (the implementation's own: below)
        assert np.abs(e_new - e_old).max() > 1e-3 * np.abs(e_old).max()
    for r in range(p):
        assert np.abs(errs[r]).max() > 0
        np.testing.assert_allclose(res[r][1], errs[r], rtol=1e-5, atol=1e-6 * np.abs(errs[r]).max())
        assert res[r][2] == 1  # one residual carried into a new map


@pytest.mark.parametrize("reexpress", [True, False])
def test_sharded_paper_feedback_reexpression_keeps_the_residual_in_ordinary_coordinates(rng, reexpress):
    """At a refresh the sharded sync's residual, mapped back with the new map's inverse, equals the
    old one mapped back with the old map's (float32 rounding), P = 2; reexpress=False keeps the
    residual's coordinates as they were (the artifact), which moves it in ordinary coordinates."""
    from giftcomm.adapters.torch import ShardedGradSync

    seed = int(rng.integers(2**31))

    def body(t):
        model = make_model(seed)
        schedule = GiftSchedule(geometry="paper", error_feedback=True,
                                paper={"refresh_every": 2, "rank": 4, "reexpress": reexpress, "profile_steps": 0})
        sync = ShardedGradSync(model, comm=t, fmt="e4m3", schedule=schedule, algorithm="direct", allow_native=False)
        for x in batches(seed, t.rank, 2):
            sync.zero_grad()
            model(x).pow(2).mean().backward()
            sync.sync()
        old, e_old = sync.geometry_of, sync.feedback.residuals[0].copy()
        sync.zero_grad()
        model(batches(seed, t.rank, 3)[2] * 3).pow(2).mean().backward()
        new = sync.refresh.geometries(sync.comm, {0: sync._padded_layout}, 2)[0]
        return old, new, e_old, sync.feedback.residual(0, new)

    for old, new, e_old, e_new in LoopbackGroup(2).run(body):
        assert old.fingerprint() != new.fingerprint() and np.abs(e_old).max() > 0
        before, after = old.inverse(e_old), new.inverse(e_new)
        if reexpress:
            np.testing.assert_allclose(after, before, rtol=0, atol=1e-5 * np.abs(before).max())
            assert np.abs(e_new - e_old).max() > 1e-3 * np.abs(e_old).max()  # re-expressed, not kept
        else:
            assert same(e_new, e_old) and np.abs(after - before).max() > 1e-3 * np.abs(before).max()


# ------------------------------------------------------------------ the factor EMA's agreement
def test_factor_ema_committed_only_when_every_rank_built_its_map(rng):
    """A refresh that fails (a singular averaged A with damping 0: not positive definite) raises
    on every rank and leaves every rank's FactorEMA as it was; a rank whose history differs takes
    rank 0's map and blended factors, so the histories agree afterwards."""
    from giftcomm.geometry.paper import FactorEMA, refresh_geometry

    f0, f1 = random_factors(rng), random_factors(rng)

    def body(t):
        ema = FactorEMA()
        g0 = refresh_geometry(t, LAYOUT, f0, 0, smoothing=ema, rank=4)
        before = {n: f.copy() for n, (_, f) in ema.factors.items()}
        singular = {n: np.zeros_like(a) for n, a in f1.items()}
        try:
            refresh_geometry(t, LAYOUT, singular, 1, smoothing=ema, rank=4, damping=0.0)
            err = None
        except ValueError as exc:
            err = str(exc)
        unchanged = all(np.array_equal(before[n], ema.factors[n][1]) for n in before) and not ema.staged
        if t.rank == 1:  # a history of its own
            ema.factors = {n: (k, f * 1.5) for n, (k, f) in ema.factors.items()}
        g2 = refresh_geometry(t, LAYOUT, f1, 2, smoothing=ema, rank=4)
        return err, unchanged, g0.fingerprint(), g2.fingerprint(), {n: f for n, (_, f) in ema.factors.items()}

    res = LoopbackGroup(2).run(body)
    assert all(r[0] is not None and "not positive definite" in r[0] for r in res)
    assert all(r[1] for r in res)
    assert res[0][2] == res[1][2] and res[0][3] == res[1][3]
    for n in res[0][4]:
        assert np.array_equal(res[0][4][n], res[1][4][n])
    # and the blend is what the EMA says: 0.95 F(f0) + 0.05 F(f1)
    from giftcomm.geometry.paper import PaperOptions, input_factor

    o = PaperOptions(rank=4)
    for n in res[0][4]:
        want = 0.95 * input_factor(f0[n], o) + 0.05 * input_factor(f1[n], o)
        np.testing.assert_allclose(res[0][4][n], want, rtol=1e-12, atol=1e-14)


def test_jax_tree_refuses_the_word_on_every_rank():
    from jax import numpy as jnp

    from giftcomm.adapters.jax import allreduce_tree

    errors = outcomes(2, lambda t: allreduce_tree({"w": jnp.ones((4, 4))}, comm=t, geometry="paper"))
    assert_same_error(errors, ValueError, "Geometry.preset('paper'")


def test_gift_state_pickles_its_factor_ema(rng):
    """The DDP hook's state keeps the factor EMA's history through a checkpoint (the next
    refresh blends as an uninterrupted run would)."""
    import pickle

    from giftcomm.adapters.torch import GiftState

    state = GiftState(schedule=GiftSchedule(geometry="paper", paper={"refresh_every": 3}), capture=make_model(0))
    f = {"up.weight": ("cholesky", np.tril(rng.standard_normal((40, 40))))}
    state.factor_ema.factors = dict(f)
    back = pickle.loads(pickle.dumps(state))
    state.shutdown()
    assert np.array_equal(back.factor_ema.factors["up.weight"][1], f["up.weight"][1])
    assert back.schedule.paper.refresh_every == 3 and back.schedule.paper.factor_decay == 0.95
    back.shutdown()
