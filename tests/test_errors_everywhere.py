"""Invariant 5 (tests/README.md): a call with bad input -- on one rank or on all -- raises the
same clear exception on every rank, on either schedule (pipelined loopback, grouped device
loopback), and no rank hangs; the transport stays usable afterwards.

Covered here over the in-process loopbacks: every field of the agreement that a rank can get
wrong (count, fmt, block, op, dtype, algorithm, slice, unknown names, fixed-block and rounding
rules), bad ``out=``, a geometry that differs or fails on one rank after the agreement, any
exception while preparing, an unknown schedule or memory kind, and a per-call deadline on a
peer that never comes. Under mpiexec the field-by-field agreement is tests/test_agreement_mpi.py;
failures injected mid-call are tests/test_fault_injection.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import UNKNOWN_FORMAT, assert_same_error, same
from conftest import outcomes as shared_outcomes

import giftcomm as gc
from giftcomm.reference import simulate_allreduce, simulate_reduce_scatter
from giftcomm.transport import Transport
from giftcomm.transport.device_loopback import DeviceLoopbackGroup
from studies.device.collective_check import KFAC_LAYOUT, random_kfac_geometry

SIZE = sum(int(np.prod(shape)) for _, shape in KFAC_LAYOUT)


def inputs(rng, p, n, dtype, spread=8.0):
    return [(rng.standard_normal(n) * np.exp(rng.uniform(-spread, spread, n) / 4)).astype(dtype) for _ in range(p)]


def outcomes(p, fn, group=DeviceLoopbackGroup):
    """Every rank's result or exception, on the grouped schedule unless told otherwise."""
    return shared_outcomes(p, fn, group)


def test_bad_out_raises_on_every_rank(rng):
    p, n = 3, 100
    xs = inputs(rng, p, n, np.float32)

    def wrong_shape_on_rank_1(t):
        out = np.empty(n + (t.rank == 1), np.float32)
        return gc.allreduce(xs[t.rank], comm=t, block=32, out=out, algorithm="ring")

    assert_same_error(outcomes(p, wrong_shape_on_rank_1), ValueError, "rank(s) 1", "out must have shape (100,)")
    errors = outcomes(p, lambda t: gc.allreduce(xs[t.rank], comm=t, block=32, out=np.empty(n, np.float64)))
    assert_same_error(errors, ValueError, "dtype float32")
    errors = outcomes(p, lambda t: gc.allgather(xs[t.rank], comm=t, block=32, out=np.empty(n * p - t.rank, np.float32)))
    assert_same_error(errors, ValueError, "out on rank(s) [1, 2]")



# --------------------------------------------------- agreement: one message, both schedules
MISMATCHES = {
    # name: (kwargs of rank 1 that differ, expected error class, fragment)
    "count": (dict(n=65), ValueError, "ranks disagree on count"),
    "fmt": (dict(fmt="e5m2"), ValueError, "ranks disagree on fmt (rank 0: e4m3, rank 1: e5m2"),
    "block": (dict(block=32), ValueError, "ranks disagree on block"),
    "op": (dict(op="avg"), ValueError, "ranks disagree on op"),
    "dtype": (dict(dtype=np.float16), ValueError, "ranks disagree on dtype"),
    "int input": (dict(dtype=np.int32), TypeError, "x must be float32, float64, float16 or bfloat16, got dtype int32"),
    "algorithm": (dict(algorithm="direct"), ValueError, "ranks disagree on algorithm"),
    "slice": (dict(slice_elems=512), ValueError, "ranks disagree on slice"),
    "bad op": (dict(op="max"), ValueError, "op must be 'sum' or 'avg'"),
    "bad block": (dict(block=0), ValueError, "rank(s) 1"),
    "unknown fmt": (dict(fmt=UNKNOWN_FORMAT), ValueError, "unknown format"),
}


@pytest.mark.parametrize("name", sorted(MISMATCHES))
@pytest.mark.parametrize("what", ["allreduce", "reduce_scatter"])
def test_mismatch_raises_the_same_message_on_either_schedule(rng, name, what):
    p = 3
    diff, cls, fragment = MISMATCHES[name]
    base = dict(n=64, dtype=np.float32, fmt="e4m3", block=16, op="sum", algorithm="ring", slice_elems=None)
    data = [rng.standard_normal(70) for _ in range(p)]

    def call(t):
        a = dict(base, **(diff if t.rank == 1 else {}))
        x = data[t.rank][: a.pop("n")].astype(a.pop("dtype"))
        return getattr(gc, what)(x, comm=t, **a)

    grouped, pipelined = outcomes(p, call), outcomes(p, call, gc.LoopbackGroup)
    assert_same_error(grouped, cls, fragment)
    assert str(grouped[0]) == str(pipelined[0]) and type(grouped[0]) is type(pipelined[0])
    # and the same transports are still usable afterwards
    xs = inputs(rng, p, 50, np.float32)
    want = (simulate_allreduce if what == "allreduce" else simulate_reduce_scatter)(xs)

    def fail_then_call(t):
        with pytest.raises(cls):
            call(t)
        return getattr(gc, what)(xs[t.rank], comm=t)

    for group in (gc.LoopbackGroup, DeviceLoopbackGroup):
        assert all(same(g, w) for g, w in zip(group(p).run(fail_then_call), want))


def test_geometry_mismatch_raises_on_every_rank(rng):
    p = 3
    geos = [random_kfac_geometry(rng, rank=4)] * 2 + [random_kfac_geometry(rng, rank=4)]
    xs = inputs(rng, p, SIZE, np.float32)
    errors = outcomes(p, lambda t: gc.gift_allreduce(xs[t.rank], geos[t.rank], comm=t, block=64))
    assert_same_error(errors, ValueError, "giftcomm.allreduce: ranks disagree on geometry")
    small = random_kfac_geometry(rng, rank=4)
    errors = outcomes(p, lambda t: gc.gift_allreduce(xs[t.rank][:-1] if t.rank == 2 else xs[t.rank], small, comm=t))
    assert_same_error(errors, ValueError, "rank(s) 2", f"geometry covers {SIZE} elements but x has {SIZE - 1}")


def test_unknown_algorithm_names_every_one(rng):
    xs = inputs(rng, 2, 100, np.float32)
    errors = outcomes(2, lambda t: gc.allreduce(xs[t.rank], comm=t, algorithm="nonsense"))
    assert_same_error(errors, ValueError, ", ".join(gc.api.ALGORITHMS), "'nonsense'")
    errors = outcomes(2, lambda t: gc.reduce_scatter(xs[t.rank], comm=t, algorithm="doubling"))
    assert_same_error(errors, ValueError, "auto, ring, direct")


class _Unscheduled(Transport):
    """A transport that declares a schedule the algorithms do not know."""

    schedule = "lockstep"

    def __init__(self, inner):
        self.inner, self.rank, self.size = inner, inner.rank, inner.size

    def isend(self, buf, dest, tag=0):
        raise AssertionError("no data may move")

    irecv = isend

    def allgather_int64(self, vec):
        return self.inner.allgather_int64(vec)

    def allgather_object(self, obj):
        return self.inner.allgather_object(obj)


def test_unknown_schedule_and_wrong_memory_raise_before_data_moves(rng):
    xs = inputs(rng, 2, 100, np.float32)
    errors = outcomes(2, lambda t: gc.allreduce(xs[t.rank], comm=_Unscheduled(t)), gc.LoopbackGroup)
    assert_same_error(errors, TypeError, "'lockstep'")
    t = DeviceLoopbackGroup(1).transports[0]
    t.memory = "device"  # as NCCL: host arrays are refused with a clear error
    with pytest.raises(TypeError, match="moves device buffers but the input is a host array"):
        gc.allreduce(xs[0], comm=t)



# ------------------------------------------------- failures on some ranks; threads; odd inputs
class _FlakyGeometry:
    """A geometry-like object whose forward fails (``mode="raise"``) or returns the wrong length
    (``mode="short"``) on rank ``bad`` only: after the agreement, so the peers must learn it."""

    is_identity = False

    def __init__(self, size, rank, bad, mode):
        self.size, self.rank, self.bad, self.mode = size, rank, bad, mode

    def fingerprint(self):
        return 1234

    def forward(self, flat):
        if self.rank == self.bad and self.mode == "raise":
            raise ZeroDivisionError("boom in forward")
        return flat[:-1] if self.rank == self.bad else flat

    def inverse(self, flat):
        return flat


@pytest.mark.parametrize("mode", ["raise", "short"])
@pytest.mark.parametrize("group", [gc.LoopbackGroup, DeviceLoopbackGroup])
def test_geometry_forward_failing_on_one_rank_raises_on_every_rank(rng, mode, group):
    p, n = 3, 500
    xs = inputs(rng, p, n, np.float32)
    errors = outcomes(p, lambda t: gc.gift_allreduce(xs[t.rank], _FlakyGeometry(n, t.rank, 1, mode), comm=t), group)
    if mode == "raise":
        assert_same_error(errors, RuntimeError, "geometry.forward", "rank(s) 1", "ZeroDivisionError: boom in forward")
    else:
        assert_same_error(errors, ValueError, "rank(s) 1", f"returned shape ({n - 1},)")


class _BadArray:
    """An array-like whose conversion fails."""

    dtype = np.dtype(np.float32)

    def __array__(self, *args, **kwargs):
        raise KeyError("no values here")


def test_any_exception_while_preparing_on_one_rank_raises_everywhere(rng):
    p = 3
    xs = inputs(rng, p, 64, np.float32)
    errors = outcomes(p, lambda t: gc.allreduce(_BadArray() if t.rank == 2 else xs[t.rank], comm=t))
    assert_same_error(errors, RuntimeError, "rank(s) 2", "KeyError")

    class NoIdentity:  # a geometry without is_identity
        size = 64

    errors = outcomes(p, lambda t: gc.gift_allreduce(xs[t.rank], NoIdentity() if t.rank == 0 else None, comm=t))
    assert_same_error(errors, RuntimeError, "rank(s) 0", "AttributeError")



def test_op_none_masked_arrays_and_grad_tensors(rng):
    p = 2
    xs = inputs(rng, p, 64, np.float32)
    errors = outcomes(p, lambda t: gc.allreduce(xs[t.rank], comm=t, op=None))
    assert_same_error(errors, ValueError, "op must be 'sum' or 'avg', got None")
    masked = [np.ma.masked_array(x, mask=x > 0) for x in xs]
    errors = outcomes(p, lambda t: gc.allreduce(masked[t.rank], comm=t))
    assert_same_error(errors, TypeError, "masked array", ".filled(0)")
    import torch
    ts = [torch.from_numpy(x.copy()).requires_grad_(True) for x in xs]
    got = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(ts[t.rank], comm=t))
    want = simulate_allreduce(xs)
    assert all(same(g.numpy(), w) for g, w in zip(got, want))



def test_timeout_per_call_bounds_a_wait_for_a_peer_that_never_comes(rng):
    """``timeout=`` on a call bounds its waits (here: rank 1 never calls); the transport's own
    deadline is restored afterwards."""
    import time

    from giftcomm.errors import CommTimeout

    x = rng.standard_normal(100).astype(np.float32)

    def body(t):
        if t.rank == 1:
            return None
        before = t.timeout
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            gc.allreduce(x, comm=t, timeout=0.3)
        assert time.monotonic() - t0 < 5 and t.timeout == before
        return True

    assert gc.LoopbackGroup(2).run(body)[0] is True
    assert issubclass(CommTimeout, TimeoutError)


BAD = {
    "block of a fixed-block format": (dict(fmt="nvfp4", block=32), ValueError, "block"),
    "stochastic on a pass-through format": (dict(fmt="bf16", rounding="stochastic", seed=1), ValueError, "stochastic"),
    "stochastic without a seed": (dict(fmt="e4m3", rounding="stochastic"), ValueError, "seed"),
    "unknown rounding": (dict(rounding="up"), ValueError, "rounding"),
    "negative seed": (dict(rounding="stochastic", seed=-1), ValueError, "rank(s) 1"),
    "local_size that does not divide P": (dict(algorithm="hierarchical", local_size=2), ValueError, "must divide"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_combinations_on_one_rank_raise_on_every_rank(rng, name):
    p = 3
    kw, cls, fragment = BAD[name]
    xs = inputs(rng, p, 200, np.float32)
    errors = outcomes(p, lambda t: gc.allreduce(xs[t.rank], comm=t, **(kw if t.rank == 1 else {})))
    assert_same_error(errors, cls, fragment, "rank(s) 1")


def test_comm_of_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="comm must be"):
        gc.allreduce(np.zeros(3, np.float32), comm="world")
