"""What giftcomm sent on a group, and the one warning when a call goes uncompressed.

:func:`stats` returns, for every call giftcomm made on a group -- the plain calls (allreduce,
gift_allreduce, reduce_scatter, allgather), persistent plans (each execution), baseline wires
(giftcomm.collectives.baselines) and the adapters' calls, whatever transport they ran on -- since the group
was first used or :func:`reset_stats`::

    {"calls": int,                              # calls that ran
     "bytes_sent": {fmt_or_"native": int, ...}, # bytes this rank's messages carried, per format
     "algorithms": {name: count, ...},          # the algorithm each call ran ("auto" resolved;
                                                #   allgather calls: "allgather")
     "fallbacks": {reason: count, ...}}         # calls sent uncompressed where a format was set

The group: every transport over torch.distributed's default process group (the adapters' private
gloo groups over it included) counts under that group, every transport over MPI.COMM_WORLD
(host and device) under MPI's world; :func:`stats` of ``comm=None`` is the group ``comm=None``
means (torchrun: torch's default group; else MPI's world), of a torch ProcessGroup that group's,
of an mpi4py communicator or a transport its group's. Another transport (a loopback's, one over
a sub-communicator) is a group of its own. Asking never communicates.

bytes_sent counts, per call, the encoded bytes (values and block scales) of the messages the
agreed algorithm addresses from this rank to its peers, from the agreed algorithm, format, block
and chunk layout (:func:`sent_bytes`); on MPI's shared-memory paths the same messages are
written to node-shared memory for the peers to read instead of being sent. "native" (the
transport's own collective, which giftcomm cannot look inside): the payload bytes a ring moves
from this rank (:func:`native_sent_bytes`): ``2 * (P - 1) / P * n * itemsize`` for an allreduce,
half that for a reduce-scatter (itemsize: 4 for a block-scaled format, whose values go as
float32; the pass-through format's otherwise; an adapter's warm-up: the tensor's own). A
reduce-scatter on giftcomm's ring or direct row sends one message of every chunk but this
rank's (:func:`scatter_sent_bytes`), half an allreduce's. A baseline wire counts under its own
name (e.g. "e5m2/tensor-nccl") in both bytes_sent and algorithms. The agreement's control words
are not counted (they are no payload).

Counting costs one attribute increment per call: a call's counts go to a :class:`Slot` of its
(format, algorithm, bytes, fallback) kept per transport (a plan keeps its slot), and
:func:`stats` adds up the slots of every transport of the group.

Uncompressed where a format was set (:func:`fallback`, the one rule for every route): one
``logging.WARNING`` on the "giftcomm" logger per group and reason, and every such call counted
under ``bytes_sent["native"]`` and ``fallbacks[reason]``. Reasons: :data:`AUTO_NATIVE` (the
caller named a block-scaled format explicitly and ``algorithm="auto"`` chose the transport's own
uncompressed collective; the warning names ``allow_native=False``; docs/scaling.md, "When auto
sends uncompressed"), :data:`WARMUP` (an adapter's warm-up the caller asked for, ``start_gift_iter``
/ ``warmup``: counted, not warned).
"""
from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Hashable
from typing import Any

from .algorithms import AUTO, BY_NAME, row
from .formats import Format, get_format, message_nbytes

__all__ = ["stats", "reset_stats", "Slot", "Tally", "sent_bytes", "scatter_sent_bytes", "native_sent_bytes", "count",
           "fallback", "DEFAULT_FMT", "AUTO_NATIVE", "WARMUP", "MPI_WORLD"]

log = logging.getLogger("giftcomm")

AUTO_NATIVE = "auto_native"
"""The fallback reason: ``auto`` predicted the transport's own uncompressed collective faster
than every compressed algorithm for this size (giftcomm.cost.model.auto_algorithm)."""
WARMUP = "warmup"
"""The fallback reason of an adapter's warm-up calls (the DDP hook's ``start_gift_iter``, the
FSDP comm's ``warmup``): the framework's own uncompressed collective, as the caller asked; counted,
not warned."""
MPI_WORLD = ("mpi", "COMM_WORLD")
"""The group key of every transport over MPI.COMM_WORLD."""


class _DefaultFormat(str):
    """The ``fmt`` default of the public calls: equal to "e4m3", but told apart from a caller's
    explicit ``fmt="e4m3"`` by identity (only an explicit format's fallback is warned about)."""


DEFAULT_FMT = _DefaultFormat("e4m3")


class Slot:
    """Calls of one (format key, algorithm, bytes per call, fallback reason) on one transport."""

    __slots__ = ("key", "algorithm", "nbytes", "reason", "calls")

    def __init__(self, key: str, algorithm: str, nbytes: int, reason: str | None) -> None:
        self.key, self.algorithm, self.nbytes, self.reason, self.calls = key, algorithm, nbytes, reason, 0


class _Group:
    """The counts of one group: the slot tables of its transports (and of calls made on the group
    without a giftcomm transport, ``direct``), and the (reason) warnings said."""

    __slots__ = ("tables", "warned", "direct", "__weakref__")

    def __init__(self) -> None:
        self.tables: list[dict[tuple, Slot]] = []
        self.warned: set[str] = set()
        self.direct: dict[tuple, Slot] = {}
        self.tables.append(self.direct)


class _Record:
    """One transport's slots, in its group."""

    __slots__ = ("slots", "group", "__weakref__")

    def __init__(self, group: _Group) -> None:
        self.slots: dict[tuple, Slot] = {}
        self.group = group
        group.tables.append(self.slots)


_RECORDS: "weakref.WeakKeyDictionary[Any, _Record]" = weakref.WeakKeyDictionary()
_GROUPS: dict[Hashable, _Group] = {}  # named groups (torch process groups, MPI's world): they outlive transports
_LOCK = threading.Lock()  # creating records and groups; the direct slots' counts


def group_key(t: Any) -> Hashable | None:
    """The named group ``t``'s calls count under: ``("torch", process group)`` for a transport over
    a torch.distributed group (None: the default group), :data:`MPI_WORLD` for one over
    MPI.COMM_WORLD, a device transport's host control transport's; None (a group of its own)
    otherwise. Local (no communication)."""
    torch_dist = sys.modules.get("giftcomm.transport.torch_dist")
    if torch_dist is not None:
        if isinstance(t, torch_dist.TorchDistTransport):
            return _torch_key(getattr(t, "user_group", None))
        if isinstance(t, torch_dist.TorchDistDeviceTransport):
            return _torch_key(t.group)
    mpi = sys.modules.get("giftcomm.transport.mpi")
    if mpi is not None and isinstance(t, mpi.MpiTransport):
        from mpi4py import MPI

        comm = getattr(t, "user_comm", None)
        return MPI_WORLD if comm is not None and comm == MPI.COMM_WORLD else None
    control = getattr(t, "control", None)
    if control is not None and control is not t and hasattr(control, "allgather_int64"):
        return group_key(control)
    return None


def _torch_key(group: Any) -> tuple[str, Any]:
    """The key of a torch.distributed process group (None: the default group, as it is now)."""
    if group is None:
        import torch.distributed as dist

        group = dist.GroupMember.WORLD
    return ("torch", group)


def _named(key: Hashable) -> _Group:
    g = _GROUPS.get(key)
    if g is None:
        with _LOCK:
            g = _GROUPS.get(key)
            if g is None:
                g = _GROUPS[key] = _Group()
    return g


def _record(t: Any) -> _Record:
    rec = _RECORDS.get(t)
    if rec is None:
        key = group_key(t)
        group = _named(key) if key is not None else _Group()
        with _LOCK:
            rec = _RECORDS.get(t)
            if rec is None:
                rec = _RECORDS[t] = _Record(group)
    return rec


def _group_of(where: Any, create: bool) -> _Group | None:
    """The group of a transport, a torch ProcessGroup, an mpi4py communicator or None (the
    group ``comm=None`` means); never communicates, creates nothing but the (empty) record when
    ``create``."""
    from .transport import Transport

    if isinstance(where, Transport):
        if create:
            return _record(where).group
        rec = _RECORDS.get(where)
        if rec is not None:
            return rec.group
        named = group_key(where)
        return None if named is None else _GROUPS.get(named)
    key: Hashable | None
    if where is None:
        key = _default_key()
    else:
        key = _comm_key(where)
        if key is None:  # an mpi4py communicator other than COMM_WORLD: its cached transport's group
            t = _mpi_cached(where)
            return None if t is None else _group_of(t, create)
    return _named(key) if create else _GROUPS.get(key)


def _default_key() -> Hashable:
    """The group ``comm=None`` means, without making its transport: torch's default group under
    torchrun (an initialised torch.distributed world of several ranks while MPI's is one
    process), else MPI's world (RuntimeError where both worlds have several ranks, as the calls)."""
    if "torch.distributed" in sys.modules:
        from .transport import torch_dist

        if torch_dist.torch_world_size() > 1:
            if torch_dist.mpi_world_size() > 1:
                torch_dist.default_transport()  # raises: comm=None is ambiguous
            return _torch_key(None)
    return MPI_WORLD


def _comm_key(comm: Any) -> Hashable | None:
    """The named group of a torch ProcessGroup or an mpi4py communicator (None: a communicator
    other than COMM_WORLD); TypeError for anything else."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if isinstance(comm, dist.ProcessGroup):
            return _torch_key(comm)
    mpi4py = sys.modules.get("mpi4py.MPI")
    if mpi4py is not None and isinstance(comm, mpi4py.Comm):
        return MPI_WORLD if comm == mpi4py.COMM_WORLD else None
    raise TypeError(f"comm must be None, a giftcomm Transport, an mpi4py communicator or a torch.distributed "
                    f"ProcessGroup, got {type(comm).__name__}")


def _mpi_cached(comm: Any) -> Any:
    """The cached transport of an mpi4py communicator (None: none made yet, or COMM_NULL)."""
    from mpi4py import MPI

    from .transport import mpi

    return None if comm == MPI.COMM_NULL else mpi.cached_transport(MPI.Comm.py2f(comm))


def sent_bytes(algorithm: str, n: int, p: int, rank: int, fmt: Format, block: int) -> int:
    """Bytes of the messages ``algorithm`` sends from ``rank`` of ``p`` for ``n`` values of
    ``fmt`` / ``block`` (see the module docstring; 0 on one rank): the algorithm table's row
    says (giftcomm.algorithms, ``Algorithm.sent_bytes``). ring, direct, oneshot and doubling:
    exactly what their message path sends (tests/test_stats_fallback.py counts it);
    hierarchical rows: counted as the ring over all ranks (an estimate: they send float32 inside
    nodes and the compressed format across). ValueError for an unknown algorithm."""
    if p <= 1 or n == 0:
        return 0
    return row(algorithm).sent_bytes(n, p, rank, fmt, block)


def scatter_sent_bytes(bounds: tuple[int, ...] | list[int], rank: int, fmt: Format, block: int) -> int:
    """Bytes giftcomm's reduce-scatter (ring or direct) sends from ``rank`` for chunk bounds
    ``bounds`` (P + 1 ints, chunk c = values ``[bounds[c], bounds[c + 1])``, owned by rank c):
    one message of every chunk but its own (the ring passes each partial sum on once, the
    direct sends each chunk to its owner). Half of the allreduce's: no allgather follows. The
    native row runs the transport's whole allreduce and counts as :func:`sent_bytes`."""
    p = len(bounds) - 1
    if p <= 1:
        return 0
    return sum(message_nbytes(int(bounds[c + 1] - bounds[c]), fmt, block) for c in range(p) if c != rank)


def native_sent_bytes(n: int, p: int, itemsize: int, scatter: bool = False) -> int:
    """Bytes a ring of the transport's own collective moves from a rank for ``n`` values of
    ``itemsize`` bytes on ``p`` ranks: ``2 (P - 1) n itemsize // P`` for an allreduce, ``(P - 1) n
    itemsize // P`` for a reduce-scatter (``scatter``); 0 on one rank."""
    if p <= 1:
        return 0
    return (1 if scatter else 2) * (p - 1) * n * itemsize // p


def count(where: Any, key: str, algorithm: str, nbytes: int, reason: str | None = None) -> Slot:
    """Count one call that giftcomm made outside the engine (a baseline wire, an adapter's
    warm-up) on ``where`` -- a giftcomm Transport (which then holds the slot in ``last_slot`` for
    an adapter's :class:`Tally`) or a torch.distributed ProcessGroup (None: the default group ``comm=None``
    means) -- under format key ``key``, ``algorithm``, ``nbytes`` sent by this rank and the
    fallback ``reason`` (None: none); returns the call's slot."""
    from .transport import Transport

    if isinstance(where, Transport):
        table = _record(where).slots
    else:
        group = _group_of(where, create=True)
        assert group is not None
        table = group.direct
    skey = (key, algorithm, int(nbytes), reason, "counted")
    with _LOCK:
        slot = table.get(skey)
        if slot is None:
            slot = table[skey] = Slot(key, algorithm, int(nbytes), reason)
        slot.calls += 1
    if isinstance(where, Transport):
        where.last_slot = slot
    return slot


def fallback(where: Any, reason: str, message: str, *args: Any) -> bool:
    """Warn once per group and ``reason`` (``logging.WARNING`` on the "giftcomm" logger) that a
    route sends uncompressed where a format was asked for: ``message % args``, followed by the
    reason and "Said once per group and reason." ``where``: a transport, a torch ProcessGroup or
    None, as :func:`count`. True when it warned now. The call itself is counted by its route
    (:func:`count`, or the engine's slot) under ``fallbacks[reason]``."""
    group = _group_of(where, create=True)
    assert group is not None
    with _LOCK:
        if reason in group.warned:
            return False
        group.warned.add(reason)
    log.warning("giftcomm: " + message + " (reason %s). Said once per group and reason.", *args, reason)
    return True


def slot_of(t: Any, fmt: str, algorithm: str, n: int, block: int, reason: str | None) -> Slot:
    """The slot a call of ``n`` values of ``fmt`` running ``algorithm`` on ``t`` counts in."""
    key = (fmt, algorithm, n, block, reason)
    rec = _record(t)
    slot = rec.slots.get(key)
    if slot is None:
        f = get_format(fmt)
        native = algorithm in BY_NAME and BY_NAME[algorithm].native and f.scaled
        nbytes = sent_bytes(algorithm, n, t.size, t.rank, f, block)
        slot = rec.slots[key] = Slot("native" if native else fmt, algorithm, nbytes, reason)
    return slot


def agreed(t: Any, job: Any, explicit: bool) -> Slot:
    """After a call's agreement: warn once per group when an explicit block-scaled format was
    replaced by the native collective (:func:`fallback`); the slot the call counts in (an
    allgather's: its algorithm named "allgather")."""
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
        if reason not in _record(t).group.warned:
            fallback(t, reason, "algorithm='auto' sends %d-value calls UNCOMPRESSED (float32, the transport's own "
                     "allreduce) instead of the %s you asked for on this group (predicted faster for this size); "
                     "pass allow_native=False to force compression (docs/scaling.md, 'When auto sends uncompressed')",
                     call.arr.size, call.fmt.name)
    if job.bounds is not None and not algorithm.native:  # a reduce-scatter (ring or direct)
        bounds = tuple(int(b) for b in job.bounds)
        skey = (call.fmt.name, algorithm.name, bounds, call.block, None)
        rec = _record(t)
        slot = rec.slots.get(skey)
        if slot is None:
            nbytes = scatter_sent_bytes(bounds, t.rank, call.fmt, call.block)
            slot = rec.slots[skey] = Slot(call.fmt.name, algorithm.name, nbytes, None)
        return slot
    return slot_of(t, call.fmt.name, algorithm.name, call.arr.size, call.block, reason)


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


def merged(*dicts: dict[str, Any]) -> dict[str, Any]:
    """Stats dicts added up (calls, and every key of bytes_sent, algorithms, fallbacks)."""
    out: dict[str, Any] = {"calls": 0, "bytes_sent": {}, "algorithms": {}, "fallbacks": {}}
    for d in dicts:
        out["calls"] += d["calls"]
        for part in ("bytes_sent", "algorithms", "fallbacks"):
            for k, v in d[part].items():
                out[part][k] = out[part].get(k, 0) + v
    return out


class Tally:
    """An adapter's own counts: :meth:`add` after each of its plain calls on a transport (that
    call's slot, which the call left in ``t.last_slot``), :meth:`add_slot` with the slot
    :func:`count` returned, :meth:`as_dict` the stats dict of those calls only, :meth:`reset`."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[Slot, int] = {}

    def add(self, comm: Any, device: bool = False) -> None:
        """Count the call just made on ``comm`` (a Transport, or what the call's ``comm=`` was)."""
        from .transport import resolve

        t = resolve(comm, device=device)
        slot = getattr(t, "last_slot", None)
        if slot is not None:
            self.add_slot(slot)
            t.last_slot = None  # counted once

    def add_slot(self, slot: Slot) -> None:
        """Count one call of ``slot``."""
        self.counts[slot] = self.counts.get(slot, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return _summary(list(self.counts.items()))

    def reset(self) -> None:
        self.counts.clear()


def stats(comm: Any = None) -> dict[str, Any]:
    """What giftcomm sent on ``comm``'s group (None: the group ``comm=None`` means; a Transport,
    an mpi4py communicator or a torch.distributed ProcessGroup): the dict described in the module
    docstring, summed over every transport of the group. Local: never communicates."""
    group = _group_of(comm, create=False)
    if group is None:
        return _summary([])
    return _summary([(s, s.calls) for table in list(group.tables) for s in list(table.values())])


def reset_stats(comm: Any = None) -> None:
    """Set every count of :func:`stats` on ``comm``'s group back to zero (the warnings are not
    repeated)."""
    group = _group_of(comm, create=False)
    for table in ([] if group is None else list(group.tables)):
        for s in list(table.values()):
            s.calls = 0
