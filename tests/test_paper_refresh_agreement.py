"""The paper preset's refresh inside the call agreement, its checkpoints and its float32 limits,
for the mpiexec-style adapters (GradSync, ShardedGradSync) on in-process ranks:

- ranks that disagree on when or how to refresh (a sync counter off by one, refresh_every, any
  other setting) raise the same ValueError on every rank at once, before any refresh collective;
- a state_dict saved at any sync (a refresh sync or between two) and loaded into a fresh adapter
  continues bit-identical to the uninterrupted run;
- a factor that is not finite in float32 is a ValueError naming the layer.
"""
from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
import torch
from conftest import assert_same_error, outcomes, same, torch_seeded

from giftcomm import GiftSchedule, LoopbackGroup
from giftcomm.geometry import Geometry, Layout
from giftcomm.geometry.paper import PaperOptions, agree_refresh

torch.set_num_threads(1)
TIMEOUT = 20.0  # seconds: a rank left waiting would fail the test well before GIFTCOMM_TIMEOUT


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(40, 24)
        self.down = torch.nn.Linear(24, 40)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def make_model(seed):
    with torch_seeded(seed):
        return Mlp()


def batch(seed, rank, step, rows=32):
    g = np.random.default_rng([seed, rank, step])
    scale = np.exp(np.random.default_rng([seed, rank]).uniform(-2, 2, 40))
    return torch.from_numpy((g.standard_normal((rows, 40)) * scale).astype(np.float32))


def group(p):
    return LoopbackGroup(p, timeout=TIMEOUT)


# ------------------------------------------------------------------ the agreement itself
@pytest.mark.parametrize("change", [
    {"sync": 1}, {"refresh_every": 3}, {"rank": 8}, {"damping": 1e-2}, {"decay": 0.9}, {"factor_decay": 0.5},
    {"factor": "symmetric"}, {"names": ("up.weight",)}, {"top_n": 2}, {"threshold": 0.5}, {"profile_steps": 7}, {"top_fraction": 0.5},
    {"reexpress": False}])
def test_agree_refresh_names_the_field_on_every_rank(change):
    key = next(iter(change))

    def body(t):
        o, sync = PaperOptions(), 50
        if t.rank == 1:
            sync = sync + change["sync"] if key == "sync" else sync
            o = PaperOptions.of(o, **change) if key != "sync" else o
        agree_refresh(t, "probe", sync, o)

    errors = outcomes(3, body, lambda p: group(p))
    assert_same_error(errors, ValueError, "probe: the ranks disagree on when or how to refresh", f"{key} (rank 0:")
    # the same everywhere: nothing raised, and the transport still works
    assert LoopbackGroup(3).run(lambda t: agree_refresh(t, "probe", 4, PaperOptions())) == [None] * 3


def test_agree_refresh_covers_every_setting_of_the_preset():
    """A PaperOptions field the agreement left out would let ranks build different maps unseen."""
    from dataclasses import fields

    from giftcomm.geometry.paper import REFRESH_FIELDS, refresh_signature

    assert {f.name for f in fields(PaperOptions)} <= set(REFRESH_FIELDS)
    base = refresh_signature(PaperOptions(), 0)
    for change in ({"damping": 2e-3}, {"names": ("a",)}, {"names": ("b",)}, {"threshold": 0.25}):
        assert refresh_signature(PaperOptions.of(None, **change), 0) != base, change


def test_agree_refresh_extra_fields_and_one_rank():
    errors = outcomes(2, lambda t: agree_refresh(t, "probe", 0, PaperOptions(), {"warmup": t.rank}), group)
    assert_same_error(errors, ValueError, "warmup (rank 0: 0, rank 1: 1)")
    assert agree_refresh(None, "probe", 3, PaperOptions()) is None  # this process alone: nothing to agree


# ------------------------------------------------------------------ GradSync / ShardedGradSync
def _adapter(kind, t, seed, paper, **kw):
    from giftcomm.adapters.torch import GradSync, ShardedGradSync

    model = make_model(seed)
    cls = GradSync if kind == "grad" else ShardedGradSync
    paper = {"profile_steps": 0, **paper}  # every layer from sync 0: the refresh's mechanics
    knobs = {k: kw.pop(k) for k in ("error_feedback", "feedback") if k in kw}
    return model, cls(model, comm=t, fmt="e4m3", schedule=GiftSchedule(geometry="paper", paper=paper, **knobs), **kw)


def _step(model, sync, x):
    sync.zero_grad()
    model(x).pow(2).mean().backward()
    return sync.sync()


@pytest.mark.parametrize("kind", ["grad", "sharded"])
def test_sync_counters_off_by_one_raise_the_same_error_at_once(rng, kind):
    """A rank one sync ahead (a checkpoint of another step, a skipped sync) meets the others at the
    agreement of its refresh sync: the same ValueError on every rank, naming the sync counts."""
    seed = int(rng.integers(2**31))

    def body(t):
        model, sync = _adapter(kind, t, seed, {"refresh_every": 2, "rank": 4})
        _step(model, sync, batch(seed, t.rank, 0))
        if t.rank == 0:
            sync.calls += 1  # rank 0 skipped a sync: its next one (2) refreshes, rank 1's (1) does not
        return _step(model, sync, batch(seed, t.rank, 1))

    errors = outcomes(2, body, group)
    what = "GradSync" if kind == "grad" else "ShardedGradSync"
    assert_same_error(errors, ValueError, f"{what}: the ranks disagree on when or how to refresh",
                      "sync (rank 0: 2, rank 1: 1)")


@pytest.mark.parametrize("kind", ["grad", "sharded"])
@pytest.mark.parametrize("setting", [{"refresh_every": 3}, {"damping": 0.1}, {"names": ("up.weight",)}])
def test_settings_that_differ_raise_the_same_error_at_the_first_sync(rng, kind, setting):
    seed = int(rng.integers(2**31))
    key = next(iter(setting))

    def body(t):
        paper = dict({"refresh_every": 2, "rank": 4}, **(setting if t.rank == 1 else {}))
        model, sync = _adapter(kind, t, seed, paper)
        return _step(model, sync, batch(seed, t.rank, 0))

    errors = outcomes(2, body, group)
    assert_same_error(errors, ValueError, "disagree on when or how to refresh", f"{key} (rank 0:")


def _run(kind, t, seed, steps, paper, state=None, start=0, save_at=None, **kw):
    """Steps ``start .. steps-1`` of a paper-preset adapter on rank t.rank (SGD, no momentum);
    returns each step's result bytes and, at ``save_at``, the pickled (model, adapter) state."""
    model, sync = _adapter(kind, t, seed, paper, **kw)
    if state is not None:
        params, st = pickle.loads(state)
        model.load_state_dict(params)
        sync.load_state_dict(st)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out, saved = [], None
    for step in range(start, steps):
        if step == save_at:
            saved = pickle.dumps((model.state_dict(), sync.state_dict()))
        got = _step(model, sync, batch(seed, t.rank, step))
        if kind == "grad":
            out.append(b"".join(p.grad.numpy().tobytes() for p in model.parameters()))
        else:
            out.append(got.numpy().tobytes())
            sync.gather_params(sync.param_shard() - 0.05 * got)  # a sharded SGD step
        if kind == "grad":
            opt.step()
    return out, saved


@pytest.mark.parametrize("kind", ["grad", "sharded"])
@pytest.mark.parametrize("save_at", [3, 4])  # refresh_every 2: 3 between refreshes, 4 a refresh sync
def test_state_dict_resumes_bit_identical_at_any_sync(rng, kind, save_at):
    seed, steps = int(rng.integers(2**31)), 7
    paper = {"refresh_every": 2, "rank": 4}
    kw = dict(error_feedback=True, capture_tokens=16)
    whole = group(2).run(lambda t: _run(kind, t, seed, steps, paper, save_at=save_at, **kw))
    resumed = group(2).run(lambda t: _run(kind, t, seed, steps, paper, state=whole[t.rank][1], start=save_at, **kw))
    for r in range(2):
        assert resumed[r][0] == whole[r][0][save_at:], f"rank {r}: the resumed run differs"
    # the checkpoint mattered: without the paper state (captured A, factor EMA, map), refreshing
    # from this step's A alone, the same step differs
    def fresh(t):
        model, sync = _adapter(kind, t, seed, paper, **kw)
        params, st = pickle.loads(whole[t.rank][1])
        model.load_state_dict(params)
        sync.calls = st["calls"] - st["calls"] % 2  # the refresh sync at or before save_at
        got = _step(model, sync, batch(seed, t.rank, save_at))
        return b"".join(p.grad.numpy().tobytes() for p in model.parameters()) if kind == "grad" else got.numpy().tobytes()

    lost = group(2).run(fresh)
    assert all(lost[r] != whole[r][0][save_at] for r in range(2))


def test_sharded_state_dict_refuses_a_state_of_another_kind(rng):
    from giftcomm.adapters.torch import ShardedGradSync

    t = LoopbackGroup(1).transports[0]
    plain = ShardedGradSync(make_model(0), comm=t)
    paper = ShardedGradSync(make_model(0), comm=t, schedule=GiftSchedule(geometry="paper"))
    with pytest.raises(ValueError, match="paper preset"):
        plain.load_state_dict(paper.state_dict())
    with pytest.raises(ValueError, match="paper preset"):
        paper.load_state_dict(plain.state_dict())


# ------------------------------------------------------------------ float32 limits of the factor
@pytest.mark.parametrize("factor", ["cholesky", "symmetric"])
@pytest.mark.parametrize("scale,part", [(1e80, "the factor F"), (1e-90, "the inverse factor F^-1")])
def test_factor_not_finite_in_float32_is_a_value_error_naming_the_layer(rng, factor, scale, part):
    layout = Layout([("w0", (8, 6)), ("w1", (5, 6))])
    a = rng.standard_normal((20, 6))
    good = a.T @ a / 20
    bad = scale * np.eye(6)  # finite, positive definite; its factor (or inverse) overflows float32
    with pytest.raises(ValueError, match=re.escape(f"{part} of 'w1' is not finite in float32")):
        Geometry.preset("paper", layout, {"w0": good, "w1": bad}, factor=factor, damping=0.0 if scale < 1 else 1e-3)
    geo = Geometry.preset("paper", layout, {"w0": good, "w1": good}, factor=factor)  # the good one works
    x = rng.standard_normal(layout.size).astype(np.float32)
    assert np.all(np.isfinite(geo.forward(x)))


def test_factor_not_finite_raises_on_every_rank_of_a_refresh(rng):
    from giftcomm.geometry.paper import refresh_geometry

    layout = Layout([("w", (4, 6))])
    errors = outcomes(2, lambda t: refresh_geometry(t, layout, {"w": 1e80 * np.eye(6)}, 0), group)
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1 and "'w' is not finite in float32" in str(errors[0])


def test_paper_map_of_a_large_but_representable_factor_stays_finite(rng):
    """The check is no blanket refusal: A = 1e60 I (factor 1e30) maps and inverts finitely."""
    layout = Layout([("w", (4, 6))])
    geo = Geometry.preset("paper", layout, {"w": 1e60 * np.eye(6)})
    x = rng.standard_normal(layout.size).astype(np.float32)
    y = geo.forward(x)
    assert np.all(np.isfinite(y)) and np.abs(y).max() < 1e-20
    np.testing.assert_allclose(geo.inverse(y), x, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ GiftState (the DDP hook)
def _state(t, sync_t, seed, paper, **kw):
    from giftcomm.adapters.torch import GiftState

    model = make_model(seed)
    knobs = {k: kw.pop(k) for k in ("error_feedback",) if k in kw}
    st = GiftState(transport=t, sync_transport=sync_t, schedule=GiftSchedule(geometry="paper", rebuild_lag=1, paper=paper,
                   **knobs), capture=model, capture_every=1, capture_tokens=16, fmt="e4m3", **kw)
    return model, st


def _steps_until_error(model, state, seed, rank, steps=4):
    """Run ``steps`` hook iterations; None, or (iteration, ValueError) where one raised. The
    state's geometry thread is shut down either way."""
    try:
        for it in range(steps):
            _hook_step(model, state, batch(seed, rank, it))
        return None
    except ValueError as exc:
        return it, exc
    finally:
        state.shutdown()


def _hook_step(model, state, x):
    """One DDP iteration driven by hand: backward, the hook on one bucket of every gradient, the
    reduced gradients written back; returns the reduced bucket's bytes."""
    from test_ddp_hook import FakeBucket

    from giftcomm.adapters.torch import gift_hook

    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    params = list(model.parameters())
    buf = torch.cat([p.grad.reshape(-1) for p in params])
    out = gift_hook(state, FakeBucket(buf, params=params)).wait()
    off = 0
    for p in params:
        p.grad.copy_(out[off : off + p.numel()].view_as(p))
        off += p.numel()
    return out.numpy().tobytes()


def _two_groups(p, body):
    """Run ``body(t, sync_t)`` on P in-process ranks with two groups (the hook's and the geometry
    thread's), each with a short deadline."""
    sync_group = group(p)
    return group(p).run(lambda t: body(t, sync_group.transports[t.rank]))


@pytest.mark.parametrize("setting", [{"refresh_every": 3}, {"decay": 0.5}])
def test_gift_state_settings_that_differ_raise_the_same_error_on_every_rank(rng, setting):
    seed = int(rng.integers(2**31))
    key = next(iter(setting))

    def body(t, sync_t):
        model, st = _state(t, sync_t, seed, dict({"refresh_every": 2, "rank": 4}, **(setting if t.rank else {})))
        return _steps_until_error(model, st, seed, t.rank)

    res = _two_groups(2, body)
    assert all(r is not None for r in res), res
    assert res[0][0] == res[1][0] == 2  # iteration 0's agreement, adopted at 0 + 1 + rebuild_lag on both
    assert_same_error([r[1] for r in res], ValueError, "GiftState: the ranks disagree on when or how to refresh",
                      f"{key} (rank 0:")


def test_gift_state_iterations_that_differ_raise_the_same_error_on_every_rank(rng):
    seed = int(rng.integers(2**31))

    def body(t, sync_t):
        model, st = _state(t, sync_t, seed, {"refresh_every": 2, "rank": 4})
        st.iter = 7 + t.rank  # restored from checkpoints of different steps
        st.runtime.adopted_iter = st.iter - 1
        return _steps_until_error(model, st, seed, t.rank)

    res = _two_groups(2, body)
    assert all(r is not None and r[0] == 2 for r in res), res
    assert_same_error([r[1] for r in res], ValueError, "sync (rank 0: 7, rank 1: 8)")


def _run_state(t, sync_t, seed, steps, paper, blob=None, start=0, save_at=None, keep_capture=True):
    """Iterations ``start .. steps-1`` of GiftState(geometry="paper") driven by hand; restored from
    ``blob`` (pickled (model params, state)) when given; returns the reduced buckets' bytes and,
    at ``save_at``, the pickled (model params, state)."""
    if blob is None:
        model, st = _state(t, sync_t, seed, paper, error_feedback=True)
    else:
        params, st = pickle.loads(blob)
        model = make_model(seed)
        model.load_state_dict(params)
        if keep_capture:
            st.bind(model)  # the capture's every / tokens: the checkpoint's
        else:
            st._capture_state = None
            st.bind(model, every=1, tokens=16)
        st.runtime.given = st.runtime.host = t  # the test's in-process ranks instead of a process group
        st.runtime.sync_transport = sync_t
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out, saved = [], None
    try:
        for it in range(start, steps):
            if it == save_at:
                saved = pickle.dumps((model.state_dict(), st))
            out.append(_hook_step(model, st, batch(seed, t.rank, it)))
            opt.step()
    finally:
        st.shutdown()
    return out, saved


@pytest.mark.parametrize("save_at", [3, 4])  # refresh_every 2, rebuild_lag 1: rebuilds adopted at 3, 5, ...
def test_gift_state_checkpoint_resumes_bit_identical_at_any_iteration(rng, save_at):
    seed, steps, paper = int(rng.integers(2**31)), 8, {"refresh_every": 2, "rank": 4}
    whole = _two_groups(2, lambda t, s: _run_state(t, s, seed, steps, paper, save_at=save_at))
    resumed = _two_groups(2, lambda t, s: _run_state(t, s, seed, steps, paper, whole[t.rank][1], save_at))
    for r in range(2):
        assert resumed[r][0] == whole[r][0][save_at:], f"rank {r}: the resumed run differs"
    # without the captured factors the next refresh is built from the restart's A alone: it differs
    lost = _two_groups(2, lambda t, s: _run_state(t, s, seed, steps, paper, whole[t.rank][1], save_at,
                                                  keep_capture=False))
    assert all(lost[r][0] != whole[r][0][save_at:] for r in range(2))


# ------------------------------------------------------------------ the baseline wire on GiftState
@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("wire", ["e5m2/tensor-nccl", "e5m2/tensor-local"])
def test_gift_state_baseline_wire_is_the_simulation_bit_for_bit(rng, p, wire):
    from test_ddp_hook import FakeBucket

    from giftcomm.adapters.torch import GiftState, gift_hook
    from giftcomm.reference.baselines import simulate_baseline_allreduce

    n = int(rng.integers(500, 3000))
    xs = [(rng.standard_normal(n) * rng.uniform(0.1, 10)).astype(np.float32) for _ in range(p)]

    def body(t):
        st = GiftState(transport=t, baseline=wire)
        try:
            return gift_hook(st, FakeBucket(torch.from_numpy(xs[t.rank].copy()))).wait().numpy()
        finally:
            st.shutdown()

    got = group(p).run(body)
    want = simulate_baseline_allreduce(xs, wire, op="avg")
    for r in range(p):
        assert same(got[r], want[r]), f"rank {r}"
    assert not same(got[0], (sum(xs) / np.float32(p)).astype(np.float32))  # the wire rounded: no float32 sum


def test_gift_state_baseline_wire_with_the_paper_geometry(rng):
    """GiftState(geometry="paper", baseline=...): the bucket is mapped by the adopted map, sent
    through the wire and mapped back: ``T^-1(wire_sum(T(x_r))) / P`` bit for bit."""
    from giftcomm.reference.baselines import simulate_baseline_allreduce

    seed, p, wire = int(rng.integers(2**31)), 2, "e5m2/tensor-nccl"
    inputs: dict = {}

    def body(t, sync_t):
        model, st = _state(t, sync_t, seed, {"refresh_every": 2, "rank": 4}, baseline=wire)
        try:
            out = []
            for it in range(4):
                model.zero_grad(set_to_none=True)
                model(batch(seed, t.rank, it)).pow(2).mean().backward()
                inputs[(t.rank, it)] = torch.cat([q.grad.reshape(-1) for q in model.parameters()]).numpy().copy()
                out.append((_hook_step(model, st, batch(seed, t.rank, it)), st.geometry_of(0)))
            return out
        finally:
            st.shutdown()

    res = _two_groups(p, body)
    for it in range(4):
        geo = res[0][it][1]
        xs = [inputs[(r, it)] for r in range(p)]
        if geo is None:
            want = simulate_baseline_allreduce(xs, wire, op="avg")[0]
        else:
            ys = simulate_baseline_allreduce([np.asarray(geo.forward(x), np.float32) for x in xs], wire, op="sum")
            want = (np.asarray(geo.inverse(ys[0]), np.float32) / np.float32(p)).astype(np.float32)
        for r in range(p):
            assert res[r][it][0] == want.tobytes(), f"iteration {it}, rank {r}"
    assert res[0][0][1] is None and res[0][3][1] is not None  # both cases ran (adopted at iteration 3)


def test_gift_state_baseline_refusals():
    from giftcomm.adapters.torch import GiftState

    with pytest.raises(ValueError, match="unknown baseline wire"):
        GiftState(baseline="e5m2")
    with pytest.raises(ValueError, match='needs geometry="paper"'):
        GiftState(baseline="e5m2/tensor-nccl", schedule=GiftSchedule(error_feedback=True))
