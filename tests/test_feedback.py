"""Error feedback (giftcomm.feedback): the residual is exactly this rank's own encoding error, and
feeding it back removes the bias of repeated quantization."""
from __future__ import annotations

import numpy as np
import pytest

import giftcomm as gc
from giftcomm.feedback import ErrorFeedback, check_feedback_format, direct_pieces, own_quantization_error
from giftcomm.formats import FORMATS, get_format, resolve_block

SCALED = [name for name, f in FORMATS.items() if f.scaled]


def run(p, fn):
    return gc.LoopbackGroup(p).run(fn)


@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_residual_is_the_exact_error_of_what_direct_sends(rng, fmt, rounding):
    """Each rank's contribution is quantized once, by its rank, in the one-shot allreduce and in the
    direct reduce-scatter: the sum of every rank's (values - residual), in rank order in float32,
    equals the one-shot result and the direct owner's shard bit for bit."""
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
    np.testing.assert_array_equal(outs[0], total)  # equal values (a decoded -0 comes back as x - x = +0)
    sent = [x - own_quantization_error(x, f, block, seed, r, direct_pieces(n, p, r, block)) for r, x in enumerate(xs)]
    total = sent[0].copy()
    for s in sent[1:]:
        total += s
    shards = run(p, lambda t: gc.reduce_scatter(xs[t.rank], comm=t, fmt=fmt, algorithm="direct", rounding=rounding,
                                                seed=seed))
    np.testing.assert_array_equal(np.concatenate(shards), total)


@pytest.mark.parametrize("fmt", ["e4m3", "mxfp8", "nvfp4", "mxfp4"])
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


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
def test_feedback_with_a_pass_through_format_raises(fmt):
    with pytest.raises(ValueError, match="pass-through"):
        check_feedback_format(fmt, "GradSync")
