"""GIFT's schedule as one record (giftcomm.GiftSchedule): validation in one place, taken whole by
every adapter, and the previous release's keywords converted by one function with a
DeprecationWarning into the same record."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import torch_seeded

import giftcomm as gc
from giftcomm import GiftSchedule
from giftcomm.geometry import PaperOptions, SelectivePolicy, schedule_of
from giftcomm.geometry.schedule import SCHEDULE_NAMES


@pytest.mark.parametrize("knob, bad", [("geometry", "kfca"), ("warmup", -1), ("estimate_every", 0), ("refresh_every", 0),
                                       ("refresh_every", 1.5), ("rebuild_lag", -1), ("decay", 1.0), ("damping", -0.1),
                                       ("damping", float("nan")), ("feedback", "sideways"), ("estimate_every", True)])
def test_each_bad_knob_raises_naming_it(knob, bad):
    with pytest.raises(ValueError, match=f"GiftSchedule: {knob}"):
        GiftSchedule(**{knob: bad})


@pytest.mark.parametrize("knob, bad", [("policy", "utility"), ("paper", 3), ("error_feedback", 1)])
def test_each_badly_typed_knob_raises_naming_it(knob, bad):
    with pytest.raises(TypeError, match=f"GiftSchedule: {knob}"):
        GiftSchedule(**({"geometry": "paper"} if knob == "paper" else {}), **{knob: bad})


def test_paper_settings_go_with_the_paper_geometry_and_set_its_cadence():
    with pytest.raises(ValueError, match='paper= goes with geometry="paper"'):
        GiftSchedule(paper={"rank": 4})
    with pytest.raises(TypeError, match="unknown option"):
        GiftSchedule(geometry="paper", paper={"ranks": 4})
    s = GiftSchedule(geometry="paper", paper={"rank": 4, "refresh_every": 7}, refresh_every=3)
    assert s.paper == PaperOptions(rank=4, refresh_every=7) and s.refresh_period == 7
    assert GiftSchedule(geometry="paper").paper == PaperOptions()
    assert GiftSchedule(geometry="kfac", refresh_every=3).refresh_period == 3
    assert s == GiftSchedule(geometry="paper", paper=PaperOptions(rank=4, refresh_every=7), refresh_every=3)
    assert hash(s) == hash(GiftSchedule(geometry="paper", paper=PaperOptions(rank=4, refresh_every=7), refresh_every=3))


def test_feedback_kind_rule():
    assert GiftSchedule().feedback_kind == "ordinary"
    assert GiftSchedule(geometry="paper").feedback_kind == "transformed"
    assert GiftSchedule(geometry="paper", paper={"reexpress": False}).feedback_kind == "transformed-kept"
    assert GiftSchedule(feedback="transformed").feedback_kind == "transformed"


def test_record_is_frozen_and_replace_validates():
    s = GiftSchedule(refresh_every=5)
    with pytest.raises(AttributeError):
        s.refresh_every = 6  # type: ignore[misc]
    assert s.replace(damping=0.1).damping == 0.1 and s.replace(damping=0.1).refresh_every == 5
    with pytest.raises(ValueError, match="rebuild_lag"):
        s.replace(rebuild_lag=-2)
    assert gc.GiftSchedule is GiftSchedule and "GiftSchedule" in gc.__all__


def test_converter_takes_the_old_keywords_out_and_warns_with_the_replacement():
    given = {"refresh_every": 7, "start_gift_iter": 3, "fmt": "e5m2", "geometry": None}
    default = GiftSchedule(refresh_every=50)
    with pytest.warns(DeprecationWarning, match=r"schedule=giftcomm\.GiftSchedule\(.*warmup="):
        got = schedule_of("Owner", None, given, default, {"start_gift_iter": "warmup"})
    assert given == {"fmt": "e5m2"}  # the call options stay
    assert got == GiftSchedule(refresh_every=7, warmup=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert schedule_of("Owner", None, {"fmt": "e5m2"}, default) is default  # nothing old: no warning
        s = GiftSchedule(damping=0.2)
        assert schedule_of("Owner", s, {}, default) is s
    with pytest.raises(TypeError, match="Owner: give schedule= or the keyword"):
        schedule_of("Owner", s, {"damping": 0.1}, default)
    with pytest.raises(TypeError, match="Owner: schedule must be a giftcomm.GiftSchedule"):
        schedule_of("Owner", {"damping": 0.1}, {}, default)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Owner: .*damping"), pytest.warns(DeprecationWarning):
        schedule_of("Owner", None, {"damping": -1.0}, default)
    assert set(SCHEDULE_NAMES) >= {"geometry", "warmup", "refresh_every", "damping", "paper", "error_feedback"}


def _model() -> torch.nn.Module:
    with torch_seeded(0):
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_adapters_take_the_record_whole_and_the_old_keywords_build_the_same_one():
    from giftcomm.adapters.torch import GiftReduceScatter, GiftState, GradSync, ShardedGradSync

    pol = SelectivePolicy(min_size=0)
    new = GiftState(schedule=GiftSchedule(warmup=2, geometry="reduced", refresh_every=3, policy=pol, damping=0.1))
    with pytest.warns(DeprecationWarning, match="GiftState: the keyword"):
        old = GiftState(start_gift_iter=2, geometry="reduced", refresh_every=3, policy=pol, damping=0.1)
    assert old.schedule == new.schedule
    new.shutdown()
    old.shutdown()
    with pytest.warns(DeprecationWarning, match="GradSync"):
        assert GradSync(_model(), error_feedback=True, geometry=None).schedule == GiftSchedule(error_feedback=True)
    with pytest.warns(DeprecationWarning, match="ShardedGradSync"):
        assert ShardedGradSync(_model(), comm=gc.LoopbackGroup(1).transports[0], error_feedback=True).schedule \
            == GiftSchedule(error_feedback=True)
    with pytest.warns(DeprecationWarning, match="GiftReduceScatter"):
        old_fsdp = GiftReduceScatter(warmup=2, damping=0.1)
    assert old_fsdp.schedule == GiftSchedule(warmup=2, damping=0.1, refresh_every=50)  # the comm's own default
    assert GiftReduceScatter().schedule.refresh_every == 50


@pytest.mark.parametrize("make, knob", [
    (lambda s: __import__("giftcomm.adapters.torch", fromlist=["GradSync"]).GradSync(_model(), schedule=s), "warmup"),
    (lambda s: __import__("giftcomm.adapters.torch", fromlist=["x"]).GiftReduceScatter(schedule=s), "estimate_every"),
])
def test_a_knob_the_adapter_does_not_read_is_an_error(make, knob):
    with pytest.raises(ValueError, match=f"schedule.{knob} is not used here"):
        make(GiftSchedule(**{knob: 5}))


def test_a_geometry_the_adapter_does_not_implement_is_an_error():
    from giftcomm.adapters.torch import GiftReduceScatter, GradSync, ShardedGradSync

    with pytest.raises(ValueError, match="GradSync: schedule.geometry must be one of"):
        GradSync(_model(), schedule=GiftSchedule(geometry="kfac"))
    with pytest.raises(ValueError, match="ShardedGradSync: schedule.geometry must be one of"):
        ShardedGradSync(_model(), schedule=GiftSchedule(geometry="reduced"))
    with pytest.raises(ValueError, match="GiftReduceScatter: schedule.geometry must be one of"):
        GiftReduceScatter(schedule=GiftSchedule(geometry="reduced"))


def test_grad_sync_old_keywords_and_record_give_the_same_bytes():
    """Error feedback through the record and through the deprecated keyword: the same reduced
    gradients, bit for bit, over two in-process ranks."""
    from giftcomm.adapters.torch import GradSync

    def run(make):
        def body(t):
            model = _model()
            sync = make(model, t)
            rng = np.random.default_rng(t.rank)
            out = []
            for _ in range(3):
                sync.zero_grad()
                model(torch.from_numpy(rng.standard_normal((4, 8)).astype(np.float32))).pow(2).mean().backward()
                sync.sync()
                out.append(np.concatenate([p.grad.numpy().ravel() for p in model.parameters()]))
            return out
        return gc.LoopbackGroup(2).run(body)

    new = run(lambda m, t: GradSync(m, comm=t, fmt="e4m3", schedule=GiftSchedule(error_feedback=True)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = run(lambda m, t: GradSync(m, comm=t, fmt="e4m3", error_feedback=True))
    for a, b in zip(new, old):
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()
    assert not np.array_equal(new[0][0], new[0][1])  # the steps differ


def test_gift_state_pickles_its_schedule_and_restores_states_of_the_previous_layout():
    """A checkpoint holds the record; one pickled before it (the knobs as separate entries)
    restores to the same record."""
    import pickle

    from giftcomm.adapters.torch import GiftState

    st = GiftState(schedule=GiftSchedule(warmup=2, geometry="reduced", refresh_every=3, damping=0.1))
    back = pickle.loads(pickle.dumps(st))
    assert back.schedule == st.schedule
    old = {k: v for k, v in st.__getstate__().items() if k != "schedule"}
    old.update(geometry="reduced", start_gift_iter=2, estimate_every=10, refresh_every=3, rebuild_lag=10,
               policy=SelectivePolicy(), damping=0.1, paper=None)
    restored = GiftState.__new__(GiftState)
    restored.__setstate__(old)
    assert restored.schedule == st.schedule and restored.feedback is None
    for s in (st, back, restored):
        s.shutdown()
