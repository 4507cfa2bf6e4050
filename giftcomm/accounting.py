"""What the plain calls sent on a communicator, and the one warning when ``auto`` sends uncompressed.

:func:`stats` returns, for the plain calls (allreduce, gift_allreduce, reduce_scatter,
allgather) made on a communicator since it was made or :func:`reset_stats`::

    {"calls": int,                              # calls that ran
     "bytes_sent": {fmt_or_"native": int, ...}, # bytes this rank's messages carried, per format
     "algorithms": {name: count, ...},          # the algorithm each call ran ("auto" resolved;
                                                #   allgather calls: "allgather")
     "fallbacks": {reason: count, ...}}         # calls where auto replaced an explicit format by native

bytes_sent counts, per call, the encoded bytes (values and block scales) of the messages the
agreed algorithm addresses from this rank to its peers, from the agreed algorithm, format, block
and chunk layout (:func:`sent_bytes`); on MPI's shared-memory paths the same messages are
written to node-shared memory for the peers to read instead of being sent. "native" (the
transport's own collective, which giftcomm cannot look inside): the payload bytes a ring
allreduce moves from this rank, ``2 * (P - 1) / P * n * itemsize`` (itemsize: 4 for a
block-scaled format, whose values go as float32; the pass-through format's otherwise). A
reduce-scatter on giftcomm's ring or direct row sends one message of every chunk but this
rank's (:func:`scatter_sent_bytes`), half an allreduce's.

Counting costs one attribute increment per call: a call's counts go to a :class:`Slot` of its
(format, algorithm, bytes, fallback) kept per communicator (a cached plan keeps its slot), and
:func:`stats` adds the slots up.

The fallback warning: when a caller named a block-scaled format explicitly (``fmt=`` given, not
the default) and ``algorithm="auto"`` chose the transport's own uncompressed collective (the
``native`` row), one ``logging.WARNING`` on the "giftcomm" logger per communicator and reason
says so and names the switch (``allow_native=False``); docs/scaling.md, "When auto sends
uncompressed".
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

from .algorithms import AUTO, BY_NAME, row
from .formats import get_format, message_nbytes

__all__ = ["stats", "reset_stats", "Slot", "Tally", "sent_bytes", "scatter_sent_bytes", "DEFAULT_FMT", "AUTO_NATIVE",
           "record_outside"]

log = logging.getLogger("giftcomm")

AUTO_NATIVE = "auto_native"
"""The fallback reason: ``auto`` predicted the transport's own uncompressed collective faster
than every compressed algorithm for this size (giftcomm.costmodel.auto_algorithm)."""


class _DefaultFormat(str):
    """The ``fmt`` default of the public calls: equal to "e4m3", but told apart from a caller's
    explicit ``fmt="e4m3"`` by identity (only an explicit format's fallback is warned about)."""


DEFAULT_FMT = _DefaultFormat("e4m3")


class Slot:
    """Calls of one (format key, algorithm, bytes per call, fallback reason) on one communicator."""

    __slots__ = ("key", "algorithm", "nbytes", "reason", "calls")

    def __init__(self, key: str, algorithm: str, nbytes: int, reason: str | None) -> None:
        self.key, self.algorithm, self.nbytes, self.reason, self.calls = key, algorithm, nbytes, reason, 0


class _Record:
    __slots__ = ("slots", "warned", "__weakref__")

    def __init__(self) -> None:
        self.slots: dict[tuple, Slot] = {}
        self.warned: set[str] = set()


_RECORDS: "weakref.WeakKeyDictionary[Any, _Record]" = weakref.WeakKeyDictionary()


def _record(t: Any) -> _Record:
    rec = _RECORDS.get(t)
    if rec is None:
        rec = _RECORDS[t] = _Record()
    return rec


def sent_bytes(algorithm: str, n: int, p: int, rank: int, fmt: str, block: int) -> int:
    """Bytes of the messages ``algorithm`` sends from ``rank`` of ``p`` for ``n`` values of
    ``fmt`` / ``block`` (see the module docstring; 0 on one rank): the algorithm table's row
    says (giftcomm.algorithms, ``Algorithm.sent_bytes``). ring, direct, oneshot and doubling:
    exactly what their message path sends (tests/test_stats_fallback.py counts it);
    hierarchical rows: counted as the ring over all ranks (an estimate: they send float32 inside
    nodes and the compressed format across). ValueError for an unknown algorithm."""
    if p <= 1 or n == 0:
        return 0
    return row(algorithm).sent_bytes(n, p, rank, fmt, block)


def scatter_sent_bytes(bounds: tuple[int, ...] | list[int], rank: int, fmt: str, block: int) -> int:
    """Bytes giftcomm's reduce-scatter (ring or direct) sends from ``rank`` for chunk bounds
    ``bounds`` (P + 1 ints, chunk c = values ``[bounds[c], bounds[c + 1])``, owned by rank c):
    one message of every chunk but its own (the ring passes each partial sum on once, the
    direct sends each chunk to its owner). Half of the allreduce's: no allgather follows. The
    native row runs the transport's whole allreduce and counts as :func:`sent_bytes`."""
    p = len(bounds) - 1
    if p <= 1:
        return 0
    return sum(message_nbytes(int(bounds[c + 1] - bounds[c]), fmt, block) for c in range(p) if c != rank)


def slot_of(t: Any, fmt: str, algorithm: str, n: int, block: int, reason: str | None) -> Slot:
    """The slot a call of ``n`` values of ``fmt`` running ``algorithm`` on ``t`` counts in."""
    native = algorithm in BY_NAME and BY_NAME[algorithm].native and get_format(fmt).scaled
    key = (fmt, algorithm, n, block, reason)
    rec = _record(t)
    slot = rec.slots.get(key)
    if slot is None:
        nbytes = sent_bytes(algorithm, n, t.size, t.rank, fmt, block)
        slot = rec.slots[key] = Slot("native" if native else fmt, algorithm, nbytes, reason)
    return slot


def agreed(t: Any, job: Any, explicit: bool) -> Slot:
    """After a call's agreement: warn once per communicator when an explicit block-scaled format
    was replaced by the native collective; the slot the call counts in (an allgather's: its
    algorithm named "allgather")."""
    algorithm = job.algorithm
    call = job.call
    if algorithm is None:  # allgather: the ring allgather sends every shard but the next rank's
        counts = [int(c) for c in job.counts]
        key = (call.fmt.name, "allgather", tuple(counts), call.block, None)
        rec = _record(t)
        slot = rec.slots.get(key)
        if slot is None:
            sizes = [message_nbytes(c, call.fmt, call.block) for c in counts]
            nbytes = 0 if t.size == 1 else sum(sizes) - sizes[(t.rank + 1) % t.size]
            slot = rec.slots[key] = Slot(call.fmt.name, "allgather", nbytes, None)
        return slot
    reason = None
    if algorithm.native and job.opts.algorithm == AUTO and call.fmt.scaled and explicit and t.size > 1:
        reason = AUTO_NATIVE
        rec = _record(t)
        if reason not in rec.warned:
            rec.warned.add(reason)
            log.warning("giftcomm: algorithm='auto' sends %d-value calls UNCOMPRESSED (float32, the transport's own "
                        "allreduce) instead of the %s you asked for on this communicator (reason %s: predicted "
                        "faster for this size); pass allow_native=False to force compression "
                        "(docs/scaling.md, 'When auto sends uncompressed'). Said once per communicator.",
                        call.arr.size, call.fmt.name, reason)
    if job.bounds is not None and not algorithm.native:  # a reduce-scatter (ring or direct)
        bounds = tuple(int(b) for b in job.bounds)
        skey = (call.fmt.name, algorithm.name, bounds, call.block, None)
        rec = _record(t)
        slot = rec.slots.get(skey)
        if slot is None:
            nbytes = scatter_sent_bytes(bounds, t.rank, call.fmt.name, call.block)
            slot = rec.slots[skey] = Slot(call.fmt.name, algorithm.name, nbytes, None)
        return slot
    return slot_of(t, call.fmt.name, algorithm.name, call.arr.size, call.block, reason)


def record_outside(t: Any, key: str, algorithm: str, nbytes: int, reason: str | None = None) -> Slot:
    """Count on ``t`` one call an adapter ran outside giftcomm's collectives (the giftcomm process
    group's inner group, a baseline wire): ``key`` its bytes_sent key ("native" uncompressed, a
    wire's name), ``algorithm`` what ran, ``nbytes`` what it sent from this rank, ``reason`` (a
    fallbacks key) why it was not giftcomm's; left in ``t.last_slot`` like a plain call's."""
    rec = _record(t)
    skey = (key, algorithm, nbytes, None, reason)
    slot = rec.slots.get(skey)
    if slot is None:
        slot = rec.slots[skey] = Slot(key, algorithm, nbytes, reason)
    slot.calls += 1
    t.last_slot = slot
    return slot


def _summary(counted: Any) -> dict[str, Any]:
    """The stats dict of (slot, calls) pairs."""
    out: dict[str, Any] = {"calls": 0, "bytes_sent": {}, "algorithms": {}, "fallbacks": {}}
    for s, calls in counted:
        if not calls:
            continue
        out["calls"] += calls
        out["bytes_sent"][s.key] = out["bytes_sent"].get(s.key, 0) + calls * s.nbytes
        out["algorithms"][s.algorithm] = out["algorithms"].get(s.algorithm, 0) + calls
        if s.reason is not None:
            out["fallbacks"][s.reason] = out["fallbacks"].get(s.reason, 0) + calls
    return out


class Tally:
    """An adapter's own counts: :meth:`add` after each of its plain calls on a transport (that
    call's slot, which the call left in ``t.last_slot``), :meth:`as_dict` the stats dict of
    those calls only, :meth:`reset`."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[Slot, int] = {}

    def add(self, comm: Any, device: bool = False) -> None:
        """Count the call just made on ``comm`` (a Transport, or what the call's ``comm=`` was)."""
        from .transport import resolve

        t = resolve(comm, device=device)
        slot = getattr(t, "last_slot", None)
        if slot is not None:
            self.counts[slot] = self.counts.get(slot, 0) + 1
            t.last_slot = None  # counted once

    def as_dict(self) -> dict[str, Any]:
        return _summary(list(self.counts.items()))

    def reset(self) -> None:
        self.counts.clear()


def stats(comm: Any = None) -> dict[str, Any]:
    """What the plain calls sent on ``comm`` (None: the default communicator, as the calls
    resolve it); the dict described in the module docstring."""
    rec = _RECORDS.get(_transport(comm))
    return _summary([] if rec is None else [(s, s.calls) for s in rec.slots.values()])


def reset_stats(comm: Any = None) -> None:
    """Set every count of :func:`stats` on ``comm`` back to zero (the warning is not repeated)."""
    rec = _RECORDS.get(_transport(comm))
    for s in ([] if rec is None else rec.slots.values()):
        s.calls = 0


def _transport(comm: Any) -> Any:
    from .transport import resolve

    return resolve(comm)
