"""The paper's preset from every entry point that takes a geometry (issue 36 item 1): the plain
call and plans refuse the word on every rank (a flat buffer has no layers) and take the built
geometry (a plan bit-identical to gift_allreduce); GradSync and ShardedGradSync build it from
the model (every rank the same map, refreshed from A averaged over the ranks); the factor EMA
and the error feedback's re-expression at a refresh.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_same_error, outcomes, same

import giftcomm as gc
from giftcomm import LoopbackGroup
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
