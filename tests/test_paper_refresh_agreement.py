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
from conftest import assert_same_error, outcomes, same

from giftcomm import LoopbackGroup
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
    torch.manual_seed(seed)
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
    {"factor": "symmetric"}, {"names": ("up.weight",)}, {"top_n": 2}, {"threshold": 0.5}, {"profile_steps": 7},
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


def test_agree_refresh_extra_fields_and_one_rank():
    errors = outcomes(2, lambda t: agree_refresh(t, "probe", 0, PaperOptions(), {"warmup": t.rank}), group)
    assert_same_error(errors, ValueError, "warmup (rank 0: 0, rank 1: 1)")
    assert agree_refresh(None, "probe", 3, PaperOptions()) is None  # this process alone: nothing to agree


# ------------------------------------------------------------------ GradSync / ShardedGradSync
def _adapter(kind, t, seed, paper, **kw):
    from giftcomm.adapters.torch import GradSync, ShardedGradSync

    model = make_model(seed)
    cls = GradSync if kind == "grad" else ShardedGradSync
    return model, cls(model, comm=t, fmt="e4m3", geometry="paper", paper=paper, **kw)


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
    paper = ShardedGradSync(make_model(0), comm=t, geometry="paper")
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
