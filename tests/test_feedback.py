"""Error feedback (giftcomm.collectives.feedback): the residual is exactly this rank's own encoding error, and
feeding it back removes the bias of repeated quantization."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import PASS_THROUGH_FORMATS, SCALED_SAMPLE, torch_seeded

import giftcomm as gc
from giftcomm import GiftSchedule
from giftcomm.collectives.feedback import ErrorFeedback, check_feedback_format, direct_pieces, own_quantization_error
from giftcomm.formats import FORMATS, get_format, resolve_block

SCALED = [name for name, f in FORMATS.items() if f.scaled]


def run(p, fn):
    return gc.LoopbackGroup(p).run(fn)


@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_residual_is_the_exact_error_of_what_direct_sends(rng, fmt, rounding):
    """Each rank's contribution is quantized once, by its rank, in the one-shot allreduce and in the
    direct reduce-scatter: the sum of every rank's (values - residual), in rank order in float32,
    equals the one-shot result and the direct owner's shard to float32 rounding (``x - err`` is
    the decoded value up to one rounding of the float32 subtraction)."""
    p, n = 3, 1000
    f = get_format(fmt)
    block = resolve_block(f, None)
    seed = 7 if rounding == "stochastic" else None
    xs = [rng.standard_normal(n).astype(np.float32) * np.float32(rng.uniform(0.1, 10)) for _ in range(p)]
    sent = [x - own_quantization_error(x, f, block, seed, r) for r, x in enumerate(xs)]
    total = sent[0].copy()
    for s in sent[1:]:
        total += s
    outs = run(p, lambda t: gc.allreduce(xs[t.rank], comm=t, fmt=fmt, algorithm="oneshot", rounding=rounding,
                                         seed=seed))
    tol = dict(rtol=1e-6, atol=1e-6 * max(float(np.abs(x).max()) for x in xs))
    np.testing.assert_allclose(outs[0], total, **tol)
    sent = [x - own_quantization_error(x, f, block, seed, r, direct_pieces(n, p, r, block)) for r, x in enumerate(xs)]
    total = sent[0].copy()
    for s in sent[1:]:
        total += s
    shards = run(p, lambda t: gc.reduce_scatter(xs[t.rank], comm=t, fmt=fmt, algorithm="direct", rounding=rounding,
                                                seed=seed))
    np.testing.assert_allclose(np.concatenate(shards), total, **tol)
    # and a wrong piece list is caught: the owner's own chunk was never quantized
    wrong = [x - own_quantization_error(x, f, block, seed, r) for r, x in enumerate(xs)]
    assert not np.allclose(sum(wrong[1:], wrong[0]), np.concatenate(shards), **tol)


@pytest.mark.parametrize("fmt", SCALED_SAMPLE)
def test_feedback_makes_the_mean_of_repeated_reductions_converge(rng, fmt):
    """A fixed gradient reduced T times with rounding to nearest: without feedback every step has
    the same error (the mean keeps it); with feedback the mean's error shrinks like 1/T."""
    p, n, steps = 2, 512, 64
    f = get_format(fmt)
    block = resolve_block(f, None)
    gs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    exact = np.sum([g.astype(np.float64) for g in gs], axis=0)

    def train(feedback: bool):
        fbs = [ErrorFeedback() for _ in range(p)]

        def step(t):
            g = gs[t.rank].copy()
            if feedback:
                fbs[t.rank].compensate(0, g)
                fbs[t.rank].record(0, g, f, block, None, t.rank)
            return gc.allreduce(g, comm=t, fmt=fmt, algorithm="oneshot")

        results = [run(p, step)[0].astype(np.float64) for _ in range(steps)]
        return np.linalg.norm(np.mean(results, axis=0) - exact) / np.linalg.norm(exact)

    without, with_fb = train(False), train(True)
    assert without > 1e-3  # the format loses something on this data
    assert with_fb < without / 10


def test_residual_layout_change_and_state_dict(rng):
    fb = ErrorFeedback()
    f = get_format("e4m3")
    x = rng.standard_normal(300).astype(np.float32)
    fb.record("b0", x, f, 256, None, 0)
    saved = fb.state_dict()
    restored = ErrorFeedback()
    restored.load_state_dict(saved)
    a, b = x.copy(), x.copy()
    fb.compensate("b0", a)
    restored.compensate("b0", b)
    assert a.tobytes() == b.tobytes() and not np.array_equal(a, x)
    # another size under the same key: a new layout, the residual is dropped, values untouched
    y = rng.standard_normal(200).astype(np.float32)
    assert fb.compensate("b0", y.copy()).tobytes() == y.tobytes()
    assert "b0" not in fb.residuals


def test_nonfinite_blocks_get_no_feedback(rng):
    fb = ErrorFeedback()
    x = rng.standard_normal(64).astype(np.float32)
    x[3] = np.inf
    fb.record(0, x, get_format("e4m3"), 32, None, 0)
    assert np.isfinite(fb.residuals[0]).all()


@pytest.mark.parametrize("fmt", PASS_THROUGH_FORMATS)
def test_feedback_with_a_pass_through_format_raises(fmt):
    with pytest.raises(ValueError, match="pass-through"):
        check_feedback_format(fmt, "GradSync")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_ring_residual_is_the_exact_error_of_its_first_hop(rng, rounding):
    """At P = 2 the ring reduce-scatter sends each rank's own chunk ``rank - 1`` once and the owner
    adds it to its own values in float32: ``own_pieces("ring")`` is exactly what was quantized."""
    from giftcomm.collectives.feedback import own_pieces

    p, n, fmt = 2, 700, get_format("nvfp4")
    block = resolve_block(fmt, None)
    seed = 11 if rounding == "stochastic" else None
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    shards = run(p, lambda t: gc.reduce_scatter(xs[t.rank], comm=t, fmt="nvfp4", algorithm="ring",
                                                rounding=rounding, seed=seed))
    sent = []
    for r, x in enumerate(xs):
        pieces, stage = own_pieces("ring", n, p, r, block)
        sent.append(x - own_quantization_error(x, fmt, block, seed, r, pieces, stage))
    np.testing.assert_allclose(np.concatenate(shards), sent[0] + sent[1], rtol=1e-6, atol=1e-5)


def _linear(seed=0):
    import torch

    with torch_seeded(seed):
        return torch.nn.Linear(24, 20)


def _fixed_grads(model, rank):
    """Rank-dependent fixed gradients, the same every step (heavy-tailed, so 4 bits lose a lot)."""
    g = np.random.default_rng(100 + rank)
    return [(g.standard_normal(p.numel()) ** 3).astype(np.float32) for p in model.parameters()]


def _grad_sync_run(steps, fb, algorithm="oneshot", state=None, start=0):
    """Mean of the reduced gradient over ``steps`` steps of GradSync on fixed gradients (P = 2
    loopback), the state_dicts after, and the algorithms recorded."""
    import torch

    from giftcomm.adapters.torch import GradSync

    def body(t):
        model = _linear()
        sync = GradSync(model, comm=t, fmt="nvfp4", algorithm=algorithm, schedule=GiftSchedule(error_feedback=fb))
        if state is not None:
            sync.load_state_dict(state[t.rank])
        fixed = _fixed_grads(model, t.rank)
        outs = []
        for _ in range(steps):
            sync.zero_grad()
            with torch.no_grad():
                for prm, g in zip(model.parameters(), fixed):
                    prm.grad.copy_(torch.from_numpy(g).view_as(prm))
            sync.sync()
            outs.append(np.concatenate([prm.grad.numpy().ravel() for prm in model.parameters()]))
        return outs, sync.state_dict(), list(sync.algorithms)

    return run(2, body)


def test_grad_sync_feedback_converges_to_the_true_mean_and_checkpoints():
    model = _linear()
    exact = np.mean([np.concatenate(_fixed_grads(model, r)).astype(np.float64) for r in range(2)], axis=0)
    err = {}
    for fb in (False, True):
        res = _grad_sync_run(32, fb)
        assert res[0][2] == ["oneshot"] and res[1][2] == ["oneshot"]
        assert res[0][0][-1].tobytes() == res[1][0][-1].tobytes()
        err[fb] = np.linalg.norm(np.mean(res[0][0], axis=0) - exact) / np.linalg.norm(exact)
    assert err[False] > 0.02  # nvfp4 nearest: the same error every step
    assert err[True] < err[False] / 10
    # checkpoint: 6 steps, each rank's state_dict, 6 more == 12 uninterrupted, bit for bit
    whole = _grad_sync_run(12, True)
    first = _grad_sync_run(6, True)
    residuals = [first[r][1]["error_feedback"]["residuals"] for r in range(2)]
    assert not np.array_equal(residuals[0][0], residuals[1][0])  # each rank's own
    rest = _grad_sync_run(6, True, state=[first[r][1] for r in range(2)])
    for r in range(2):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(whole[r][0][6:], rest[r][0]))


def test_grad_sync_records_what_auto_ran():
    res = _grad_sync_run(1, True, algorithm="auto")
    from giftcomm.algorithms import NAMES

    assert res[0][2][0] in NAMES and res[0][2] == res[1][2]


def test_sharded_grad_sync_feedback_direct_converges_and_leaves_grads():
    import torch

    from giftcomm.adapters.torch import ShardedGradSync

    model = _linear()
    exact = np.mean([np.concatenate(_fixed_grads(model, r)).astype(np.float64) for r in range(2)], axis=0)

    def body(t, fb):
        m = _linear()
        sync = ShardedGradSync(m, comm=t, fmt="nvfp4", algorithm="direct", schedule=GiftSchedule(error_feedback=fb))
        fixed = np.concatenate(_fixed_grads(m, t.rank))
        outs = []
        for _ in range(32):
            sync.zero_grad()
            sync.buffer[: sync.numel].copy_(torch.from_numpy(fixed))
            outs.append(sync.sync().numpy().astype(np.float64))
            assert sync.buffer[: sync.numel].numpy().tobytes() == fixed.tobytes()  # the .grad views untouched
            assert sync.algorithm_used == "direct"
        return np.mean(outs, axis=0)

    err = {}
    for fb in (False, True):
        mean = np.concatenate(run(2, lambda t: body(t, fb)))[: exact.size]
        err[fb] = np.linalg.norm(mean - exact) / np.linalg.norm(exact)
    assert err[False] > 0.02
    assert err[True] < err[False] / 10


def test_every_entry_point_refuses_feedback_with_a_pass_through_format():
    from giftcomm.adapters.torch import GiftReduceScatter, GiftState, GradSync, ShardedGradSync

    t = gc.LoopbackGroup(1).transports[0]
    for build in (lambda: GradSync(_linear(), comm=t, fmt="bf16", schedule=GiftSchedule(error_feedback=True)),
                  lambda: ShardedGradSync(_linear(), comm=t, fmt="fp32", schedule=GiftSchedule(error_feedback=True)),
                  lambda: GiftState(fmt="fp16", schedule=GiftSchedule(error_feedback=True)),
                  lambda: GiftReduceScatter(fmt="bf16", schedule=GiftSchedule(error_feedback=True))):
        with pytest.raises(ValueError, match="pass-through"):
            build()
    with pytest.raises(TypeError, match="error_feedback"):
        GradSync(_linear(), comm=t, fmt="nvfp4", schedule=GiftSchedule(error_feedback=1))


def test_bad_feedback_combination_raises_the_same_error_on_every_rank():
    """P = 2: feedback with a pass-through format is refused before any communication, with one
    and the same message on both ranks (nothing rank-dependent in it), by every entry point."""
    from conftest import assert_same_error, outcomes

    from giftcomm.adapters.torch import GiftReduceScatter, GiftState, GradSync, ShardedGradSync

    for owner, build in (("GradSync", lambda t: GradSync(_linear(t.rank), comm=t, fmt="fp16",
                         schedule=GiftSchedule(error_feedback=True))),
                         ("ShardedGradSync", lambda t: ShardedGradSync(_linear(t.rank), comm=t, fmt="bf16",
                                                                       schedule=GiftSchedule(error_feedback=True))),
                         ("GiftState", lambda t: GiftState(fmt="fp32", transport=t,
                          schedule=GiftSchedule(error_feedback=True))),
                         ("GiftReduceScatter", lambda t: GiftReduceScatter(fmt="bf16",
                          schedule=GiftSchedule(error_feedback=True)))):
        assert_same_error(outcomes(2, build), ValueError, f"{owner}: error_feedback=True needs a block-scaled format",
                          "pass-through")
