"""The paper preset's selection, as the artifact runs it: with no names given, GradSync and
ShardedGradSync(geometry="paper") run the first profile_steps syncs Euclidean while scoring each
Linear weight's gradient (share of FP8 E5M2 codes at a bound, one scale per tensor), then
transform the top-scoring weights only (scores averaged over the ranks), and keep error feedback
on those weights only. A layer made to saturate (one gradient entry 1e11 x the rest: every other
value underflows E5M2's per-tensor range) is selected, benign ones are not.

The MPI case (every rank the same selection from different local scores) is in
tests/test_paper_mpi.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_same_error, outcomes, torch_seeded

from giftcomm import GiftSchedule, LoopbackGroup
from giftcomm.geometry.paper import PaperOptions, saturation_fraction, select_for

WIDTH, LAYERS = 16, 4


class Stack(torch.nn.Module):
    """LAYERS Linear(WIDTH, WIDTH) with ReLU between: weights ``layers.i.weight``, biases 1-D."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x):
        for i, lin in enumerate(self.layers):
            x = lin(x) if i == LAYERS - 1 else torch.relu(lin(x))
        return x


def saturate(weight: torch.nn.Parameter, fraction: float = 1.0, seed: int = 0) -> None:
    """Make about ``fraction`` of ``weight``'s gradient entries underflow E5M2 under a per-tensor
    scale: 1.0: one entry becomes 1e11 x the largest (every other one underflows); < 1: that
    share of the entries (seeded) is scaled by 1e-13."""
    def hook(g):
        flat = g.clone().view(-1)
        if fraction >= 1.0:
            flat[0] = float(flat.abs().max()) * 1e11 + 1.0
        else:
            pick = np.random.default_rng(seed).random(flat.numel()) < fraction
            flat[torch.from_numpy(pick)] *= 1e-13
        return flat.view_as(g)
    weight.register_hook(hook)


def run(t, seed, spiked, steps, sync_cls="grad", **paper):
    """``steps`` syncs of ``sync_cls`` (GradSync or ShardedGradSync) with geometry="paper" and
    error feedback on a Stack whose layer ``spiked`` saturates; no optimizer step (the spike's
    gradient is not for training). Per sync: the transformed segment names; the sync object."""
    from giftcomm.adapters.torch import GradSync, ShardedGradSync

    with torch_seeded(seed):
        model = Stack()
    if spiked is not None:
        saturate(model.layers[spiked].weight)
    kw = dict(comm=t, fmt="e4m3", schedule=GiftSchedule(geometry="paper", error_feedback=True, paper={"rank": 4, **paper}))
    sync = GradSync(model, **kw) if sync_cls == "grad" else ShardedGradSync(model, algorithm="direct",
                                                                            allow_native=False, **kw)
    g = np.random.default_rng([seed, t.rank])
    moved, residuals = [], []
    for _ in range(steps):
        sync.zero_grad()
        model(torch.from_numpy(g.standard_normal((32, WIDTH)).astype(np.float32))).pow(2).mean().backward()
        sync.sync()
        geos = sync.geometries if sync_cls == "grad" else [sync.geometry_of]
        moved.append(sorted(tr.segment.name for geo in geos if geo is not None for tr in geo.transforms
                            if not tr.is_identity))
        residuals.append({k: np.array(v, copy=True) for k, v in sync.feedback.residuals.items()})
    return moved, residuals, sync


@pytest.mark.parametrize("sync_cls", ["grad", "sharded"])
def test_the_saturating_layer_is_selected_after_the_profile_window(rng, sync_cls):
    seed, spiked, window = int(rng.integers(2**31)), int(rng.integers(LAYERS)), int(rng.integers(2, 5))
    res = LoopbackGroup(2).run(lambda t: run(t, seed, spiked, window + 2, sync_cls, profile_steps=window))
    name = f"layers.{spiked}.weight"
    for moved, residuals, sync in res:
        # the window: nothing transformed, no residual anywhere (the artifact's Euclidean branch has none)
        assert all(m == [] for m in moved[:window]) and all(r == {} for r in residuals[:window])
        # then the saturating layer alone (default rule: the top quarter of 4 weights = 1), on every rank
        assert moved[window] == moved[window + 1] == [name]
        assert sync.refresh.selected == (name,)
        scores = sync.refresh.profile.scores()
        # every nonzero entry but one underflows; ReLU's dead units leave exact zeros, which do not
        # count, so the share depends on the seed (0.47 seen): well above any benign layer's
        assert scores[name] > 0.2
        assert all(s < 0.05 for n, s in scores.items() if n != name)  # benign layers: not selected
    assert len({tuple(r[2].refresh.selected) for r in res}) == 1


def test_error_feedback_lives_on_the_transformed_weights_only(rng):
    seed, spiked = int(rng.integers(2**31)), int(rng.integers(LAYERS))
    res = LoopbackGroup(2).run(lambda t: run(t, seed, spiked, 4, profile_steps=2))
    name = f"layers.{spiked}.weight"
    for _, residuals, sync in res:
        assert residuals[0] == {} and residuals[1] == {}
        (b,) = [b for b in sync.buckets if name in b.layout]
        e = residuals[-1][b.index]
        for seg in b.layout:
            part = e[seg.offset : seg.stop]
            if seg.name == name:
                assert np.count_nonzero(part) > part.size // 2  # the transformed weight's residual
            else:
                assert not np.any(part), seg.name  # none on the Euclidean weights and biases
        for other in sync.buckets:
            if other.index != b.index:
                assert other.index not in residuals[-1]


def test_benign_model_selects_by_score_and_names_skip_the_profile(rng):
    """Without a saturating layer the rule still picks the top quarter by score; names given
    transform exactly those from sync 0 and score nothing."""
    seed = int(rng.integers(2**31))
    res = LoopbackGroup(1).run(lambda t: run(t, seed, None, 3, profile_steps=2))
    moved, _, sync = res[0]
    want = select_for(PaperOptions(), sync.refresh.profile.scores())
    assert len(want) == 1 and moved[2] == list(want)
    fixed = ("layers.1.weight", "layers.3.weight")
    res = LoopbackGroup(1).run(lambda t: run(t, seed, 0, 2, names=fixed))
    moved, residuals, sync = res[0]
    assert moved[0] == moved[1] == sorted(fixed) and sync.refresh.profile is None and residuals[0] != {}


def test_selection_rule_and_saturation_score():
    scores = {"a": 0.5, "b": 0.1, "c": 0.9, "d": 0.0, "e": 0.3}
    assert select_for(PaperOptions(), scores) == ("c", "a")  # ceil(0.25 x 5) = 2
    assert select_for(PaperOptions(top_n=3), scores) == ("c", "a", "e")
    assert select_for(PaperOptions(top_fraction=None), scores) == ("c", "a", "e", "b", "d")
    assert select_for(PaperOptions(top_fraction=1.0, threshold=0.3), scores) == ("c", "a", "e")
    g = np.random.default_rng(1).standard_normal(4096).astype(np.float32)
    assert saturation_fraction(g) < 0.01  # the max alone hits the upper bound
    g[0] = np.abs(g).max() * 1e11
    assert saturation_fraction(g) > 0.99
    with pytest.raises(ValueError, match="top_fraction"):
        PaperOptions(top_fraction=0.0)


def test_profile_state_resumes_the_selection(rng):
    """A GradSync restored from a state_dict taken inside the window selects what the
    uninterrupted one selects (the window's scores are in the state)."""
    from giftcomm.adapters.torch import GradSync

    seed, spiked = int(rng.integers(2**31)), int(rng.integers(LAYERS))
    whole = LoopbackGroup(1).run(lambda t: run(t, seed, spiked, 4, profile_steps=3))[0]

    def resumed(t):
        with torch_seeded(seed):
            model = Stack()
        saturate(model.layers[spiked].weight)
        mk = lambda: GradSync(model, comm=t, fmt="e4m3", schedule=GiftSchedule(  # noqa: E731
            geometry="paper", error_feedback=True, paper={"rank": 4, "profile_steps": 3}))
        sync, g = mk(), np.random.default_rng([seed, t.rank])
        for step in range(4):
            if step == 2:
                state = sync.state_dict()
                sync.refresh.capture.remove()
                sync = mk()
                sync.load_state_dict(state)
            sync.zero_grad()
            model(torch.from_numpy(g.standard_normal((32, WIDTH)).astype(np.float32))).pow(2).mean().backward()
            sync.sync()
        return sync.refresh.selected, sync.refresh.profile.scores()

    sel, scores = LoopbackGroup(1).run(resumed)[0]
    assert sel == whole[2].refresh.selected
    assert scores == whole[2].refresh.profile.scores()


def test_ranks_that_profiled_different_weights_raise_on_every_rank(rng):
    from giftcomm.geometry.paper import average_scores

    errors = outcomes(2, lambda t: average_scores(t, {"a": 0.1, **({"b": 0.2} if t.rank else {})}))
    assert_same_error(errors, RuntimeError, "profiled different weights")
