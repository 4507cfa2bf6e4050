"""Persistent allreduce plans: check and agree once, then repeat the same call cheaply.

Like MPI's persistent collectives (``MPI_Allreduce_init``) and an NCCL communicator, a plan does
the per-call work of :func:`giftcomm.allreduce` that does not change between calls of a training
loop — validating the arguments, agreeing on them across ranks, choosing the algorithm, the slice
and the layouts — once, when it is made (collectively). Each call then checks locally that its
array matches the plan (shape, dtype, kind) and that every rank is running the same plan, with
four int64 words per rank (error code, plan, calling thread, seed) that travel with the data:

- on one node with host arrays, through the transport's plan channel in node-shared memory
  (giftcomm.transport.channel): each rank posts its words and its encoded message in its own
  slot and reads everyone's in place after one handshake; float32 NumPy arrays rounded to
  nearest with the one-shot algorithm run the whole call in C;
- elsewhere, with the one-shot algorithm on host arrays, ahead of the data in the same message;
- otherwise in one small gather before the data (the cost of the agreement, without
  re-planning).

A call with a bad array on any rank, or ranks calling different plans, raises the same exception
on every rank, as the plain functions do. Results equal ``simulate_allreduce(..., algorithm=
plan.algorithm)`` bit for bit.
"""
from __future__ import annotations

import zlib
from dataclasses import replace
from typing import Any

import numpy as np

from .. import _xp
from .. import accounting as _stats
from ..algorithms import Algorithm
from ..algorithms.partition import accumulation_dtype
from ..codec import native_available, native_code, native_supports
from ..collectives import call as calls
from ..collectives import engine, native, oneshot
from ..collectives.agree import error_code, meet_plans, raise_failures
from ..collectives.call import Call, Job
from ..collectives.hold import held
from ..errors import CommAborted, CommClosed, CommError
from ..formats import check_key
from ..options import CallOptions, Entry, call_options
from ..transport import HOST, Transport, resolve
from ..transport.channel import CACHED, PLAIN_WORD, STALE_WORD, WORDS, PlanChannel, native_channel, plain_words

__all__ = ["AllreducePlan", "JobPlan", "plan_allreduce", "plan_of", "job_plan_of", "able", "Missed"]


class Missed(Exception):
    """A cached plan's call (giftcomm.plans.cache) met plain calls or other cached plans on some
    ranks: every rank falls back to the agreement of a plain call."""


class _ChannelCalls:
    """What the calls through the node-shared plan channel share: after the handshake, the check
    of every rank's words, and the error every rank then raises alike. A subclass sets
    ``transport``, ``_owner`` (the transport's state it belongs to), ``_what`` (its name in
    errors) and ``_cached`` (a plain call's cached plan: a peer's plain call makes every rank
    agree afresh, :class:`Missed`)."""

    transport: Transport
    _owner: Any
    _what: str
    _cached: bool
    _word: int

    def _stale(self) -> None:
        """Raise CommClosed: the transport's state this plan belongs to was closed (its
        communicator freed or released, or this is a forked child). After giftcomm.release the
        communicator lives on: when its new transport has a plan channel, this call first meets
        the peers' next call there, so a new plan (or plain call) on another rank raises "ranks
        disagree" at once instead of waiting for this rank until the deadline."""
        succ = self.transport.successor()
        st = None if succ is None else succ._state
        if succ is not None and st is not None and st.channel is not None:
            try:
                with held(succ, None, plain=False):
                    if st.channel is not None:
                        meet_plans(succ, st.channel, STALE_WORD, calls.caller(), "giftcomm plan")
            except CommError:
                raise
            except Exception:  # noqa: BLE001 - the peers raise theirs; this rank's error is below
                pass
        raise CommClosed(f"giftcomm plan: {self._owner.closed}")

    def _post(self, channel: PlanChannel, code: int = 0, seed: int = 0, x: Any = None, out: Any = None,
              fmt_code: int = 0, block: int = 1, avg: bool = False) -> int:
        """One call of the channel (its C ``call``, module docstring of giftcomm.transport.channel):
        this rank's words [error code, plan word, caller, seed] and, on the one-shot fast path,
        ``x`` and ``out``; the status. An interrupt while waiting closes the channel: the transport
        learns it and the exception propagates."""
        t = self.transport
        try:
            return channel.native.call(code, self._word, calls.caller(), seed, x, out, fmt_code, block, None, avg,
                                       t.timeout)
        except BaseException:
            t.interrupted("giftcomm plan (shared-memory channel)")
            raise

    def _failed(self, channel: PlanChannel, status: int, error: Exception | None) -> None:
        """Raise what a channel call's status says (on every rank alike): the deadline passed
        (2), the channel is closed after an earlier failure (4), or some rank failed or ran
        another plan (1, read from the headers)."""
        if status == 4 and self._owner.closed is not None:
            self._stale()
        if status == 4:
            raise CommAborted("giftcomm plan: the shared-memory channel is unusable after an earlier timeout or "
                              "interrupt (or its transport's state was released); make a new communicator and plan")
        if status == 2:
            late = tuple(int(q) for q in np.flatnonzero(channel.table[:, 0] == -1))
            self.transport.expired("giftcomm plan (shared-memory channel)", late, self.transport.timeout)
        self._check(channel.table, error)

    def _check(self, table: np.ndarray, error: Exception | None) -> None:
        """Raise on every rank when any rank failed locally or ran another plan / thread; a
        cached plan raises :class:`Missed` when a peer is about to agree on a plain call (every
        rank then agrees)."""
        if table[:, 0].any():
            raise_failures(self.transport, self._what, table, error)
        if (table[1:] != table[0]).any():  # one test; name the column only then
            if self._cached and (plain_words(table[:, 1]) == PLAIN_WORD).all() and (table[:, 2] == table[0, 2]).all():
                raise Missed  # plain calls elsewhere, or cached plans made apart: every rank agrees afresh
            for col, what in ((1, "plan"), (2, "caller"), (3, "seed")):
                if (table[:, col] != table[0, col]).any():
                    raise ValueError(f"{self._what}: ranks disagree on {what} (ranks called different plans, "
                                     f"from differently named threads, or with different seeds)")


class AllreducePlan(_ChannelCalls):
    """A planned allreduce over one transport; call it with arrays shaped like the template.

    Attributes: ``algorithm`` (what every call runs), ``shape``, ``dtype`` (the template's
    logical dtype name), ``transport``.
    """

    def __init__(self, t: Transport, job: Job, word: int, channel: bool, cached: bool = False) -> None:
        call, algorithm = job.call, job.algorithm
        assert algorithm is not None
        self._cached = cached  # a plain call's cached plan (giftcomm.plans.cache): its word carries CACHED
        self._what = "giftcomm (cached plan)" if cached else "giftcomm plan"
        self.transport, self.algorithm, self._row, self._job = t, algorithm.name, algorithm, job
        self.shape, self.dtype = tuple(call.arr.shape), call.imp.logical
        self._template, self._word = call, word
        self._wire = call.wire(t.rank)
        self._stochastic = call.seed is not None
        self._acc = accumulation_dtype(calls.flat_values(call).dtype)
        self._header = np.zeros(WORDS, np.int64)
        # the one-shot message carries the check words: not with a geometry (transforms around the sum)
        self._piggyback = algorithm.one_exchange and t.memory == HOST and not call.imp.device and job.geometry is None
        self._zeros = call.xp.zeros(call.arr.size, self._acc)  # what a failing rank sends
        self._owner = t.state  # the transport's state this plan belongs to: closed with it (CommClosed)
        self._state = self._owner if channel else None
        self.through_channel = channel  # whether the calls go through the node-shared plan channel
        # the native fast path: float32 NumPy arrays, one-shot, rounding to nearest
        self._fast = (channel and algorithm.one_exchange and not self._stochastic and call.imp.source == "numpy"
                      and call.arr.dtype == np.float32 and native_supports(self._wire.fmt))
        # the code the C kernels take (an adaptive row's: with its registered spec's slot)
        self._fmt_code, self._block, self._avg = native_code(self._wire.fmt), self._wire.block, call.op == "avg"
        self.last_run = (algorithm.name, None)  # what engine.last_algorithm reports after a call
        self.used = 0  # a cached plan's last use (giftcomm.plans.cache's eviction order)
        # its giftcomm.stats slot, where every call counts (giftcomm.accounting; plan_allreduce and
        # first_allreduce set it, after the agreement)
        self.slot: Any = _stats.slot_of(t, call.fmt.name, algorithm.name, call.arr.size, call.block, None)
        # the native row's fast path: NumPy arrays of the dtype the transport sums (float32 for a
        # block-scaled format or fp32, float64 input for a block-scaled format), no seed
        kind = native.kind_of(self._wire.fmt, self._acc) if algorithm.native else ""
        self._native_dtype = (np.dtype(kind) if channel and not self._stochastic and call.imp.source == "numpy"
                              and kind in ("float32", "float64") and call.arr.dtype == np.dtype(kind) else None)

    def __repr__(self) -> str:
        return (f"<AllreducePlan {self.shape} {self.dtype} {self._wire.fmt.name}/{self._wire.block} "
                f"op={self._template.op} algorithm={self.algorithm} P={self.transport.size}>")

    def _local(self, x: Any, out: Any, seed: int | None) -> Call:
        """This call's record: ``x`` (and ``out``, ``seed``) checked against the template, locally."""
        if self._stochastic and seed is None:
            raise ValueError("this plan rounds stochastically: pass seed= (an int identifying the call)")
        if not self._stochastic and seed is not None:
            raise ValueError("seed= is for plans made with rounding='stochastic'")
        imp = calls.import_checked(x, "x")  # as the plain call: TypeError for a non-float dtype, a masked array
        tpl = self._template
        if imp.logical != tpl.imp.logical or tuple(imp.array.shape) != self.shape or imp.device != tpl.imp.device:
            raise ValueError(f"this plan takes {self.dtype} arrays of shape {self.shape} "
                             f"({'device' if tpl.imp.device else 'host'}); got {imp.logical} {tuple(imp.array.shape)}")
        call = Call(imp, tpl.fmt, tpl.block, tpl.op, tpl.sig, seed=None if seed is None else check_key(seed))
        calls.check_out(call, out, self.shape)
        return call

    def __call__(self, x: Any, out: Any = None, seed: int | None = None, timeout: float | None = None) -> Any:
        """The allreduce of ``x`` (the template's shape, dtype and kind) with the planned
        arguments: an array of x's shape and dtype in x's framework (``out`` if given); ``seed``
        (stochastic plans: this call's) and ``timeout`` as for :func:`giftcomm.allreduce`."""
        state = self._state
        dt = self._native_dtype
        if (dt is not None and seed is None and timeout is None and state is not None and type(x) is np.ndarray
                and x.shape == self.shape and x.dtype == dt and x.flags.c_contiguous
                and (out is None or (type(out) is np.ndarray and out.shape == self.shape and out.dtype == dt
                                     and out.flags.c_contiguous and out.flags.writeable))):
            channel = state.channel
            if channel is not None:
                res = self._native_call(state, channel, x, out)
                self._counted()
                return res
        if (self._fast and seed is None and timeout is None and state is not None and type(x) is np.ndarray
                and x.shape == self.shape and (out is None or (type(out) is np.ndarray and out.shape == self.shape))):
            channel = state.channel
            if channel is not None:
                # every check of the slow path, in C or above: dtype, contiguity, writability, shape
                res = np.empty(self.shape, np.float32) if out is None else out
                with state.lock:
                    status = self._post(channel, x=x, out=res, fmt_code=self._fmt_code, block=self._block,
                                        avg=self._avg)
                    if status == 0:
                        self._counted()
                        return res
                    if status != 3:  # 3: not for the fast path; nothing was posted
                        self._failed(channel, status, None)
        channel = None if state is None else state.channel
        if self._owner.closed is not None:
            self._stale()
        with held(self.transport, timeout, plain=False):
            result = self._call(x, out, seed, channel)
        self._counted()
        return result

    def _counted(self) -> None:
        """Count the call that just ran in giftcomm.stats (its slot, set when the plan was made)."""
        slot = self.slot
        slot.calls += 1
        self.transport.last_slot = slot  # what an adapter's accounting.Tally adds

    def _native_call(self, state: Any, channel: PlanChannel, x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """The native row's call on checked NumPy arrays: the check words through the channel
        (one handshake), then the transport's own allreduce straight into ``out``."""
        t = self.transport
        with state.lock:
            status = self._post(channel, fmt_code=self._fmt_code, block=self._block)
            if status != 0:
                self._failed(channel, status, None)
            into = None if out is None else out.reshape(-1)
            total = native.allreduce(t, x.reshape(-1), self._wire, self._acc, into)
            if self._avg:
                total = calls.divide(total, t.size)  # ``out`` or the transport's new array
            if out is None:
                return total.reshape(self.shape)
            if total is not into:
                out[...] = total.reshape(self.shape)
            return out

    def _call(self, x: Any, out: Any, seed: int | None, channel: PlanChannel | None) -> Any:
        t = self.transport
        if self._owner.closed is not None:  # closed while this call waited for the lock
            self._stale()
        error: Exception | None = None
        call = None
        try:
            call = self._local(x, out, seed)
        except Exception as exc:  # joins the check below: every rank raises it
            error = exc
        head = self._header
        head[0] = 0 if error is None else error_code(error)
        head[1], head[2] = self._word, calls.caller()
        head[3] = 0 if call is None or call.seed is None else call.seed - (1 << 64) * (call.seed >= 1 << 63)
        wire = self._wire if call is None or call.seed is None else replace(self._wire, seed=call.seed)
        if channel is not None:
            return self._over_channel(channel, call, error, wire, out)
        if self._piggyback:
            flat = self._zeros if call is None else calls.flat_values(call)
            got = oneshot.exchange(t, flat, wire, head)
            self._check(got.headers(), error)
            assert call is not None
            return self._reduce([got.message(q) for q in range(t.size)], call, wire, out)
        self._check(t.allgather_int64(head), error)
        assert call is not None
        return engine.run_allreduce(t, self._job, out, call)

    def _over_channel(self, channel: PlanChannel, call: Call | None, error: Exception | None, wire: Any,
                      out: Any) -> Any:
        """One call through the node-shared channel, the message encoded here (any dtype, any
        rounding; a failing rank posts its header alone)."""
        t = self.transport
        parity, nbytes = channel.native.parity(), wire.nbytes(self._zeros.size)
        head = self._header
        if call is not None and self._row.one_exchange:
            try:  # a failure here still posts (the error code): no rank is left waiting
                wire.encode(calls.flat_values(call), channel.payload(t.rank, parity, nbytes))
            except Exception as exc:
                error, head[0] = exc, error_code(exc)
        status = self._post(channel, int(head[0]), int(head[3]), fmt_code=self._fmt_code, block=wire.block)
        self._failed(channel, status, error)
        assert call is not None
        if not self._row.one_exchange:
            return engine.run_allreduce(t, self._job, out, call)
        return self._reduce([channel.payload(q, parity, nbytes) for q in range(t.size)], call, wire, out)

    def _reduce(self, messages: list[Any], call: Call, wire: Any, out: Any) -> Any:
        """The one-shot sum of every rank's message, finished like :func:`giftcomm.allreduce`."""
        t = self.transport
        into = calls.direct_out(call) if self._acc == np.float32 else None
        total = oneshot.reduce(messages, self._zeros.size, wire, self._acc, into)
        return calls.finish_reduction(t.size, call, total, into, out, self.shape)

class JobPlan(_ChannelCalls):
    """A plain reduce-scatter's or allgather's agreed job, kept for repeated calls with its
    signature (giftcomm.plans.cache). Each call checks its array locally (the collective's own
    checks, without the agreement), posts four check words in the plans' channel (one handshake,
    as a plan's call does, flagged as cached: a plain call, or a call of another signature, on any
    rank makes every rank agree afresh) and runs the agreed algorithm, layout and slicing on it."""

    def __init__(self, t: Transport, kind: engine.Kind, job: Job, word: int) -> None:
        self.transport, self._kind, self._job, self._word = t, kind, job, word
        self._owner, self._what, self._cached = t.state, f"{kind.what} (cached plan)", True
        self.last_run = None if job.algorithm is None else (job.algorithm.name, job.bounds)
        self.used = 0  # its last use (giftcomm.plans.cache's eviction order)
        self.slot: Any = None  # its giftcomm.stats slot (giftcomm.accounting; set by giftcomm.plans.cache)

    def __call__(self, x: Any, out: Any, opts: Any) -> Any:
        """The collective of ``x`` with the cached options ``opts`` (collective)."""
        t, kind, agreed = self.transport, self._kind, self._job
        if self._owner.closed is not None:
            self._stale()
        with held(t, opts.timeout, plain=False):
            channel = self._owner.channel
            if self._owner.closed is not None or channel is None:
                self._stale()
            assert channel is not None
            job, error = None, None
            try:
                call = calls.validate(x, kind.arg, opts, reduces=kind.reduces)
                calls.check_transport(t, call)
                job = Job(call, opts)
                kind.prepare(t, job, out, None, None)  # this rank's checks (out, the layout), nothing agreed
            except Exception as exc:  # joins the check below: every rank raises it
                error = exc
            status = self._post(channel, 0 if error is None else error_code(error))
            self._failed(channel, status, error)
            assert job is not None
            job.algorithm, job.nodes, job.slice_n = agreed.algorithm, agreed.nodes, agreed.slice_n
            job.bounds, job.counts, job.total = agreed.bounds, agreed.counts, agreed.total
            result = kind.run(t, job, out)
        slot = self.slot
        slot.calls += 1  # giftcomm.stats
        t.last_slot = slot  # what an adapter's accounting.Tally adds
        return result


def job_plan_of(t: Transport, kind: engine.Kind, job: Job) -> JobPlan | None:
    """A :class:`JobPlan` of an agreed reduce-scatter or allgather ``job`` (collective: every rank
    after the same agreement), or None where some rank cannot run calls through the channel."""
    if not t.allgather_int64(np.array([int(able(t, job.call.imp.device))], np.int64))[:, 0].all():
        return None
    if t.plan_channel(0) is None:
        return None
    t.state.plans += 1  # as plan_of: every rank counts alike
    sig = job.call.sig
    word = zlib.crc32(np.array([sig.get(k, 0) for k in kind.match] + [t.state.plans], np.int64).tobytes())
    return JobPlan(t, kind, job, word | CACHED)


_PLAN = Entry("plan_allreduce", fixed=("seed",))
"""plan_allreduce's options: the seed is per call."""


def plan_allreduce(
    x: Any,
    *,
    comm: Any = None,
    local_size: int | None = None,
    geometry: Any = None,
    options: CallOptions | None = None,
    **opts: Any,
) -> AllreducePlan:
    """Plan repeated allreduces of arrays like ``x`` (collective; the arguments and options of
    :func:`giftcomm.allreduce`, but ``seed``: with ``rounding="stochastic"`` every call passes
    its own ``seed=``, so the plan's stays None). ``algorithm="auto"`` is the plain call's choice
    (giftcomm.cost.model.auto_algorithm; giftcomm.resolve_algorithm says which).

    geometry: None, or a geometry as :func:`giftcomm.gift_allreduce` takes it (e.g.
    ``Geometry.preset("paper", layout, factors)``): every call is then that call,
    ``inverse(sum(forward(x)))``, bit-identical to ``gift_allreduce(x, geometry, ...)`` with the
    same arguments and the algorithm the plan chose; the ranks agree on its fingerprint when the
    plan is made (a rank with another geometry raises on every rank), and the plan word carries
    it. A word (``geometry="paper"``) is a ValueError on every rank: a flat buffer has no layer
    structure to build a map from. Such a plan checks each call with one small gather (no
    node-shared channel fast path). Raises on every rank as :func:`giftcomm.allreduce` does."""
    t = resolve(comm, device=_xp.is_device_array(x))
    o = call_options(opts, options, _PLAN)
    if not isinstance(o, Exception) and o.rounding == "stochastic":
        o = o.replace(seed=0)  # a stand-in: the agreement's signature; each call gives its own
    with held(t, None if isinstance(o, Exception) else o.timeout):
        job = engine.agree_call(t, engine.ALLREDUCE, x, None, o, geometry, local_size)
        plan = plan_of(t, job)
        plan.slot = _stats.agreed(t, job, options is not None or "fmt" in opts)  # each call counts here
        return plan


def plan_of(t: Transport, job: Job, cached: bool = False) -> AllreducePlan:
    """The plan of an agreed allreduce ``job`` without geometry (collective: every rank makes it
    after the same agreement). ``cached``: a plain call's plan (giftcomm.plans.cache), whose
    word carries :data:`~giftcomm.transport.channel.CACHED`."""
    call, chosen = job.call, job.algorithm
    assert chosen is not None and (job.geometry is None or not cached)
    # the same word on every rank: the agreed signature and the plan's number on this transport
    # (plans are made collectively, so every rank counts them alike)
    t.state.plans += 1
    word = zlib.crc32(np.array([call.sig[k] for k in calls.MATCH] + [t.state.plans], np.int64).tobytes())
    # a geometry's plan: its calls run engine.run_allreduce (the transforms around the agreed
    # algorithm, as gift_allreduce), checked by one small gather, never through the channel
    channel = job.geometry is None and _channel(t, call, chosen)
    return AllreducePlan(t, job, word | (CACHED if cached else 0), channel, cached)


def able(t: Transport, device: bool) -> bool:
    """Whether this rank could run a plan's calls through the node-shared channel: host arrays on
    a host shared-memory transport, with the native channel built."""
    return (t.memory == HOST and not device and bool(t.shared_memory) and native_channel() is not None
            and native_available())


def _channel(t: Transport, call: Call, algorithm: Algorithm) -> bool:
    """Whether the plan's calls go through the node-shared channel (collective: every rank
    alike): host arrays, every rank able to run the native channel, and a channel to be had."""
    if not t.allgather_int64(np.array([int(able(t, call.imp.device))], np.int64))[:, 0].all():
        return False
    wire = call.wire(t.rank)
    return t.plan_channel(wire.nbytes(call.arr.size) if algorithm.one_exchange else 0) is not None
