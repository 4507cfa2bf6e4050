"""Every entry point takes the call options whole (giftcomm.options.options_of_call): each option
name as a keyword, or one CallOptions record as ``options=``; an unknown keyword raises the same
TypeError everywhere (its owner's name in front)."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
from conftest import UNKNOWN_FORMAT

import giftcomm as gc
from giftcomm.options import OPTION_NAMES, CallOptions, options_of_call

UNKNOWN = "unknown option(s) bogus; options are " + ", ".join(OPTION_NAMES)


def _plain(fn, **kw):
    """``fn`` (a collective taking a transport) on 2 loopback ranks; every rank's outcome."""
    x = np.arange(64, dtype=np.float32)

    def body(t):
        try:
            return fn(x + t.rank, comm=t, **kw)
        except (TypeError, ValueError) as exc:
            return exc

    return gc.LoopbackGroup(2).run(body)


def _model():
    return torch.nn.Linear(4, 3)


def _jit(name, **kw):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import giftcomm.adapters.jax as gj

    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
    fn = functools.partial(getattr(gj, name), axis_name="d", **kw)
    x = jax.device_put(np.ones((1, 8), np.float32), NamedSharding(mesh, P("d")))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)


def _tree(**kw):
    from giftcomm.adapters.jax import allreduce_tree

    return gc.LoopbackGroup(1).run(lambda t: allreduce_tree({"w": np.ones(8, np.float32)}, comm=t, **kw))


def _tree_sync(**kw):
    from giftcomm.adapters.jax import TreeSync

    return TreeSync(**kw)


def _register(**kw):
    """register_reduce_scatter on a model without FSDP modules: it checks the options first,
    then raises RuntimeError for the missing FSDP2 modules (or the missing torch API)."""
    from giftcomm.adapters.torch.fsdp import register_reduce_scatter

    try:
        register_reduce_scatter(_model(), **kw)
    except RuntimeError as exc:
        return exc
    raise AssertionError("register_reduce_scatter registered on a model without FSDP2 modules")


def _callback(**kw):
    from giftcomm.adapters.lightning import GiftCommCallback

    return GiftCommCallback(**kw).state


def _state(**kw):
    from giftcomm.adapters.torch import GiftState

    return GiftState(**kw)


def _grad_sync(**kw):
    from giftcomm.adapters.torch import GradSync

    return GradSync(_model(), comm=gc.LoopbackGroup(1).transports[0], **kw)


def _sharded(**kw):
    from giftcomm.adapters.torch import ShardedGradSync

    return ShardedGradSync(_model(), comm=gc.LoopbackGroup(1).transports[0], **kw)


def _fsdp_comm(**kw):
    from giftcomm.adapters.torch.fsdp import GiftReduceScatter

    return GiftReduceScatter(**kw)


# name: (call, the op it takes: the one it decides or defaults to)
ENTRIES = {
    "allreduce": (functools.partial(_plain, gc.allreduce), "sum"),
    "gift_allreduce": (functools.partial(_plain, gc.gift_allreduce), "sum"),
    "reduce_scatter": (functools.partial(_plain, gc.reduce_scatter), "sum"),
    "allgather": (functools.partial(_plain, gc.allgather), "sum"),
    "plan_allreduce": (functools.partial(_plain, gc.plan_allreduce), "sum"),
    "GiftState": (_state, "avg"),
    "GiftCommCallback": (_callback, "avg"),
    "GradSync": (_grad_sync, "avg"),
    "ShardedGradSync": (_sharded, "avg"),
    "GiftReduceScatter": (_fsdp_comm, "sum"),
    "register_reduce_scatter": (_register, "sum"),
    "allreduce_tree": (_tree, "avg"),
    "TreeSync": (_tree_sync, "avg"),
    "psum": (functools.partial(_jit, "psum"), "sum"),
    "pmean": (functools.partial(_jit, "pmean"), "avg"),
    "psum_scatter": (functools.partial(_jit, "psum_scatter"), "sum"),
}
DEFAULTS = CallOptions()


def _raised(result):
    """The exception an entry point's call gave (plain calls: every rank's, all alike), or None."""
    if isinstance(result, list) and result and isinstance(result[0], Exception):
        assert len({(type(e), str(e)) for e in result}) == 1, result
        return result[0]
    return result if isinstance(result, Exception) and not isinstance(result, RuntimeError) else None


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_entry_point_takes_every_option_name(entry):
    """Every option name at once (each at the value the entry point takes by default)."""
    call, op = ENTRIES[entry]
    given = {name: op if name == "op" else getattr(DEFAULTS, name) for name in OPTION_NAMES}
    got = call(**given)
    assert _raised(got) is None, (entry, got)
    if hasattr(got, "options"):
        assert {name: getattr(got.options, name) for name in OPTION_NAMES} == given


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_entry_point_takes_one_record(entry):
    call, op = ENTRIES[entry]
    record = CallOptions.of(fmt="e5m2", block=128, op=op)
    got = call(options=record)
    assert _raised(got) is None, (entry, got)
    if hasattr(got, "options"):
        assert got.options == record
        # keywords beside the record replace its fields
        assert call(options=record, fmt="e4m3").options == record.replace(fmt="e4m3")


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_entry_point_rejects_an_unknown_option_alike(entry):
    call, _ = ENTRIES[entry]
    try:
        got = call(bogus=1)
    except TypeError as exc:
        got = exc
    err = _raised(got)
    assert type(err) is TypeError, (entry, got)
    # the same words everywhere: an adapter names itself in front, a collective raises them on
    # every rank through its agreement (which names the ranks)
    assert str(err).endswith(UNKNOWN), (entry, str(err))


def test_giftstate_takes_mx_scale():
    from giftcomm.adapters.torch import GiftState

    state = GiftState(fmt="mxfp8", mx_scale="floor")
    assert state.options.mx_scale == "floor" and state.options.format.scale_rule == "floor"
    with pytest.raises(ValueError, match="GiftState: .*floor"):
        GiftState(fmt="e4m3", mx_scale="floor")


def test_an_entry_point_that_decides_an_option_rejects_another_value():
    from giftcomm.adapters.torch import GiftState

    with pytest.raises(ValueError, match="GiftState: op is 'avg' here"):
        GiftState(op="sum")
    with pytest.raises(ValueError, match="GiftState: op is 'avg' here"):
        GiftState(options=CallOptions.of(fmt="e5m2"))  # a record is taken whole: its op is "sum"
    errors = _plain(gc.allgather, op="avg")
    assert all(type(e) is ValueError and "op is 'sum' here" in str(e) for e in errors), errors


def test_a_record_and_keywords_agree_with_plain_keywords(rng):
    """``options=`` and keywords give the same bytes as the keywords alone."""
    xs = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    record = CallOptions.of(fmt="mxfp4", rounding="stochastic", seed=11, algorithm="direct")

    def body(t):
        a = gc.allreduce(xs[t.rank], comm=t, fmt="mxfp4", rounding="stochastic", seed=11, algorithm="direct")
        b = gc.allreduce(xs[t.rank], comm=t, options=record)
        c = gc.allreduce(xs[t.rank], comm=t, options=record.replace(seed=12), seed=11)
        return a, b, c

    for a, b, c in gc.LoopbackGroup(3).run(body):
        assert a.tobytes() == b.tobytes() == c.tobytes()


def test_options_of_call_rejects_a_record_of_another_type():
    with pytest.raises(TypeError, match="X: options must be a giftcomm.options.CallOptions"):
        not_a_record: Any = {"fmt": "e4m3"}
        options_of_call("X", not_a_record)


def test_an_unvalidated_record_is_validated():
    with pytest.raises(ValueError, match="X: .*format"):
        options_of_call("X", CallOptions(fmt=UNKNOWN_FORMAT))
    with pytest.raises(ValueError):
        _raise_first(_plain(gc.allreduce, options=CallOptions(block=True)))


def _raise_first(results):
    err = _raised(results)
    if err is not None:
        raise err


def test_keywords_are_validated_by_type_and_a_validated_record_is_taken_whole():
    """block=True and 64.0 are no blocks; a validated record passed whole is the call's record, and
    replacing its seed checks the seed (the adapters' per-call options)."""
    from giftcomm.options import call_options

    assert isinstance(call_options({"block": 1}), CallOptions)
    assert isinstance(call_options({"block": True}), ValueError)
    assert isinstance(call_options({"block": 64.0}), ValueError)
    o = CallOptions.of(fmt="e5m2", rounding="stochastic")
    assert call_options({}, o) is o
    seeded = o.replace(seed=7)
    assert seeded.seed == 7 and seeded == CallOptions.of(fmt="e5m2", rounding="stochastic", seed=7)
    assert call_options({}, seeded) is seeded
    for bad in (-1, 1 << 64, 1.5, True):
        with pytest.raises((TypeError, ValueError)):
            o.replace(seed=bad)
