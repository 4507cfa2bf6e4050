"""The few point-to-point and control operations the collectives and the geometry need.

A transport connects ``size`` ranks and declares, as class attributes, how data may move:

- ``schedule``: :data:`PIPELINED` (nonblocking sends and receives complete independently, so a
  collective may post the next hop's receives early and forward each slice as soon as it is
  ready: MPI, the host loopback, torch gloo) or :data:`GROUPED` (operations only queue, and a
  wait issues everything queued as one group, stream-ordered: NCCL, CUDA-aware MPI, the device
  loopback; each hop queues its receives and sends, then waits);
- ``memory``: where its message buffers may live, :data:`HOST`, :data:`DEVICE` or :data:`ANY`.

The collectives (giftcomm.collectives) read these two attributes and never talk to MPI, NCCL or
torch directly. Control operations (agreement, object broadcast, float64 sums) run in host memory
on every transport. State a transport keeps between calls (topology, workspaces, the shared
window, sub-transports) lives in one declared :class:`TransportState`.
"""
from __future__ import annotations

import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from ..errors import CommClosed, CommTimeout
from .channel import PlanChannel, channel_window_nbytes, native_channel
from .shared_window import SharedWindow, grown_size

PIPELINED, GROUPED = "pipelined", "grouped"
_STATE_LOCK = threading.Lock()
HOST, DEVICE, ANY = "host", "device", "any"

__all__ = ["Request", "Transport", "TransportState", "SubTransport", "GroupedTransport", "QueuedOp", "wait_all", "tree_sum",
           "PIPELINED", "GROUPED", "HOST", "DEVICE", "ANY"]


class Request(ABC):
    """A pending nonblocking send or receive.

    Deadline contract: :meth:`wait` returns once the operation completed, or, when the owning
    transport's :attr:`Transport.timeout` is positive and that many seconds pass without
    completion, applies the transport's timeout policy: it raises
    :class:`giftcomm.errors.CommTimeout` (a TimeoutError naming the operation and the peer), or
    ends the job (``GIFTCOMM_ON_TIMEOUT=abort``, MPI transports). After a timeout or an interrupt
    a transport may be unusable: its later operations raise :class:`giftcomm.errors.CommAborted`
    at once. Waiting should not spin a core (MPI transports poll with a backoff sleep).
    """

    @abstractmethod
    def wait(self) -> None:
        """Block until the operation completes (GROUPED transports: until it is issued, in stream
        order)."""


@dataclass
class TransportState:
    """What a transport keeps between calls; created on first use, released by
    :meth:`Transport.release_state`.

    topology: per ``local_size`` argument, (node id of every rank, costmodel.Topology).
    workspaces: reusable scratch buffers per array backend name ("numpy", "cupy").
    window: the node-shared window, or None. splits: sub-transports by (name, members).
    lock: held by a collective for its whole duration (calls from several threads run one at a
    time). plans: how many persistent plans were made over this transport (giftcomm.plans.persistent).
    channel: the persistent plans' one-shot channel in node-shared memory, or None.
    plan_cache: the plain calls' cached plans by call signature (giftcomm.plans.cache; each plan's
    ``used`` stamp orders them for eviction).
    fused: the fused GIFT transforms' device state per geometry (giftcomm.collectives.gift).
    native: per (count, kind) the native path has run, whether this transport's own allreduce
    gave every rank the same bytes when first checked (giftcomm.collectives.native).
    pid: the process that created it. closed: None while alive; once :meth:`close` ran, why (what
    a stale user -- a plan holding this state -- raises as :class:`~giftcomm.errors.CommClosed`).

    This is the one registry of what a transport owns: everything a communicator's lifetime must
    end (a future cache of plans included) is a field here and is released by :meth:`close`.
    """

    topology: dict[Any, Any] = field(default_factory=dict)
    workspaces: dict[str, Any] = field(default_factory=dict)
    window: SharedWindow | None = None
    splits: dict[tuple[str, tuple[int, ...]], "Transport"] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    plans: int = 0
    channel: PlanChannel | None = None
    plan_cache: OrderedDict[Any, Any] = field(default_factory=OrderedDict)
    fused: OrderedDict[Any, Any] = field(default_factory=OrderedDict)
    native: dict[tuple[int, str], bool] = field(default_factory=dict)
    pid: int = field(default_factory=os.getpid)
    closed: str | None = None

    def close(self, reason: str, collective: bool = True) -> None:
        """Release everything this state owns and mark it closed with ``reason``: the plan
        channel (closed first, so a plan holding it refuses at once), the shared window, the
        sub-transports, the workspaces. Takes :attr:`lock`, so a call in flight on another thread
        finishes first. ``collective``: free the MPI windows (collective, the same order on every
        rank); False (after a failure, in a forked child): only drop the references. Idempotent."""
        if not collective:  # a fork()ed child may hold the lock copied from a parent's thread
            self._close(reason, False)
            return
        with self.lock:
            self._close(reason, True)

    def _close(self, reason: str, collective: bool) -> None:
        if self.closed is not None:
            return
        self.closed = reason
        channel, window, splits = self.channel, self.window, list(self.splits.values())
        self.channel = self.window = None
        self.splits.clear()
        self.plan_cache.clear()
        self.fused.clear()
        self.native.clear()
        self.workspaces.clear()
        self.topology.clear()
        if channel is not None:
            channel.native.close()
            if collective:
                channel.window.release()
        if window is not None and collective:
            window.release()
        for sub in splits:
            sub.close(reason, collective)


LIVE_TRANSPORTS: "weakref.WeakSet[Transport]" = weakref.WeakSet()  # transports with state or MPI objects (fork hook)


class CallGate:
    """Every public call on a transport passes here (:meth:`Transport.enter_call` /
    :meth:`Transport.exit_call`): ``started`` counts the calls admitted, ``inflight`` those not yet
    finished. A release (giftcomm.release) sets ``releasing``, agrees with its peers on
    ``limit``, the largest number of calls any rank has admitted, lets exactly that many
    calls run on every rank and waits for them to finish; calls beyond ``limit`` wait for the
    release and then run on the communicator's new transport (``replaced``), the same calls
    on every rank whatever the threads' interleaving."""

    __slots__ = ("cond", "started", "inflight", "releasing", "limit", "replaced")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.started = 0
        self.inflight = 0
        self.releasing = False
        self.limit: int | None = None
        self.replaced = False


class Transport(ABC):
    """Point-to-point messages plus small control collectives, for ``size`` ranks."""

    rank: int
    size: int
    schedule: str = PIPELINED
    memory: str = HOST
    shared_memory: bool = False
    """True when every rank can map every other rank's memory, so that :meth:`shared_window`
    gives a window (the same on every rank)."""
    crowded: bool = False
    """True when this node runs more of the ranks than it has cores: a waiting rank then yields
    its core while it spins."""
    _state: TransportState | None = None
    _timeout: float | None = None
    _closed: str | None = None
    """Why this transport is gone for good (its communicator freed, a forked child), or None."""
    last_run: "tuple[str, Any] | None" = None
    last_slot: Any = None  # the giftcomm.accounting slot the last counted plain call added to
    """(algorithm, chunk bounds or None) of the last allreduce / reduce-scatter agreed or run
    here (giftcomm.collectives.engine.last_algorithm)."""
    _gate: CallGate | None = None

    def gate(self) -> CallGate:
        """This transport's :class:`CallGate` (made on first use)."""
        g = self._gate
        if g is None:
            with _STATE_LOCK:
                if self._gate is None:
                    self._gate = CallGate()
                g = self._gate
        return g

    def enter_call(self, renew: bool = True) -> "Transport":
        """Admit one public call (pair with :meth:`exit_call` on the transport returned): this
        transport, or, when a release replaced it (:class:`CallGate`) and ``renew`` (the call
        named a communicator, not this Transport object), the communicator's new one
        (:meth:`renewed`); CommClosed when there is none or not ``renew``, CommTimeout when a
        release does not let the call in within the deadline."""
        g = self._gate or self.gate()
        with g.cond:
            if not (g.releasing or g.replaced):  # the common case: a counter and a lock
                g.started += 1
                g.inflight += 1
                return self
        return self._enter_slow(g, renew)

    def _enter_slow(self, g: CallGate, renew: bool) -> "Transport":
        import time

        limit = self.timeout
        deadline = time.monotonic() + limit if limit > 0 else None
        with g.cond:
            while g.releasing and (g.limit is None or g.started >= g.limit):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CommTimeout(f"giftcomm: a call waited {limit:g} s for a release of its communicator "
                                      f"on another thread (rank {self.rank} of {self.size}; GIFTCOMM_TIMEOUT / timeout=)")
                g.cond.wait(left)
            if not g.replaced:
                g.started += 1
                g.inflight += 1
                return self
        succ = self.renewed() if renew else None
        if succ is None or succ is self:
            raise CommClosed(self._closed or "giftcomm: this transport was released (giftcomm.release)")
        return succ.enter_call()

    def exit_call(self) -> None:
        """End a call admitted by :meth:`enter_call`."""
        g = self._gate
        assert g is not None
        with g.cond:
            g.inflight -= 1
            if g.releasing:
                g.cond.notify_all()

    def renewed(self) -> "Transport | None":
        """The transport a call admitted after this one's release runs on (collective where it
        is created); None here: such a call raises CommClosed."""
        return None

    @property
    def timeout(self) -> float:
        """Seconds every blocking wait of this transport (messages, control gathers, fences,
        communicator creation) waits for its peers before the timeout policy applies (see
        :class:`Request`); 0 means no deadline. Default: ``$GIFTCOMM_TIMEOUT`` (600), read on first
        use; assign a number to override it for this transport, or None to go back to the default."""
        if self._timeout is None:
            from .. import config

            self._timeout = config.number("GIFTCOMM_TIMEOUT")
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        if seconds is not None:
            seconds = float(seconds)
            if not (seconds >= 0 and seconds != float("inf")):
                raise ValueError(f"timeout must be a finite number of seconds >= 0 (0: none), got {seconds!r}")
        self._timeout = seconds

    @property
    def state(self) -> TransportState:
        """This transport's kept state (created on first use; CommClosed once the transport is
        gone for good)."""
        if self._state is None:
            with _STATE_LOCK:
                if self._closed is not None:
                    raise CommClosed(self._closed)
                if self._state is None:
                    self._state = TransportState()
                    LIVE_TRANSPORTS.add(self)
        return self._state

    def successor(self) -> "Transport | None":
        """The live transport that replaced this one over the same communicator (after
        :func:`giftcomm.release`), where a stale plan meets its peers' next call; None here."""
        return None

    @abstractmethod
    def isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        """Start sending ``buf`` (contiguous) to ``dest``; do not touch ``buf`` until waited."""

    @abstractmethod
    def irecv(self, buf: Any, source: int, tag: int = 0) -> Request:
        """Start receiving exactly ``buf.nbytes`` bytes from ``source`` into ``buf``."""

    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int, tag: int = 0) -> None:
        """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source``."""
        reqs = [self.irecv(recvbuf, source, tag), self.isend(sendbuf, dest, tag)]
        wait_all(reqs)

    # --- control operations (host memory, collective) ---------------------------------------
    @abstractmethod
    def allgather_int64(self, vec: np.ndarray) -> np.ndarray:
        """Gather every rank's int64 vector (same length everywhere): array of shape (size, len)."""

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object per rank."""

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """``root``'s picklable object on every rank."""
        return self.allgather_object(obj if self.rank == root else None)[root]

    def sum_float64(self, arr: np.ndarray) -> np.ndarray:
        """The elementwise sum over ranks of a float64 array (same shape everywhere), identical
        on every rank: a new array. The default adds the gathered arrays in rank order."""
        rows = self.allgather_object(np.ascontiguousarray(arr, dtype=np.float64))
        total = rows[0].copy()
        for row in rows[1:]:
            total += row
        return total

    def reduce_float64(self, arr: np.ndarray, root: int) -> np.ndarray | None:
        """The sum over ranks of a float64 array on ``root`` (None elsewhere)."""
        total = self.sum_float64(arr)
        return total if self.rank == root else None

    def broadcast_float64(self, buf: np.ndarray, root: int) -> None:
        """Overwrite ``buf`` (float64, same shape everywhere) with ``root``'s, in place."""
        got = self.broadcast_object(np.ascontiguousarray(buf) if self.rank == root else None, root)
        if self.rank != root:
            buf[...] = got

    # --- the transport's own reduction (algorithm="native": giftcomm.collectives.native) ------
    def native_sum(self, buf: Any, kind: str, into: Any = None) -> Any:
        """The elementwise sum over ranks of ``buf`` (contiguous, 1-D, the same length on every
        rank) by this transport's own allreduce: a new array like ``buf``, or ``into`` (an array
        like ``buf``, not sharing its memory) filled with it. kind: "float32",
        "float64", "float16" or "bfloat16" (host: ``ml_dtypes.bfloat16``; device: uint16 bits);
        a 16-bit kind adds in float32 and rounds every partial sum to the kind (nearest even).
        The order of the additions is the transport's, and that every rank gets the same bytes
        is not promised (giftcomm.collectives.native checks it). This default, for transports
        without an allreduce of their own (the loopback, sub-transports), gathers the arrays
        and adds them in MPICH's recursive-doubling order (:func:`tree_sum`)."""
        total = tree_sum(self.allgather_object(buf.copy()), kind)  # a copy: in-process peers read it later
        if into is None:
            return total
        into[...] = total
        return into

    def native_broadcast(self, buf: Any, root: int) -> None:
        """Overwrite ``buf`` (a :meth:`native_sum` result) with ``root``'s, in place."""
        got = self.broadcast_object(buf.copy() if self.rank == root else None, root)
        if self.rank != root:
            buf[...] = got

    # --- topology and kept state -----------------------------------------------------------
    def node_ids(self) -> np.ndarray:
        """Node index of every rank (int64, shape (size,)): ranks sharing memory share a node.

        The default is one node for all ranks; MPI transports ask the MPI library.
        """
        return np.zeros(self.size, np.int64)

    def allocate_window(self, nbytes: int) -> SharedWindow | None:
        """Collectively allocate a node-shared window of ``nbytes`` bytes per rank, or None when
        it cannot be had (then on every rank alike). Transports that set ``shared_memory``
        override this; the default has none."""
        return None

    def shared_window(self, nbytes: int) -> SharedWindow | None:
        """A window of at least ``nbytes`` bytes per rank that every rank maps, or None when the
        ranks do not share memory (``shared_memory`` False; the default).

        Collective, with the same ``nbytes`` on every rank. The window is kept and reused by
        later calls; it is reallocated (and earlier views become invalid) only to grow, in
        64 KiB steps (:func:`~giftcomm.transport.shared_window.grown_size`).
        """
        if not self.shared_memory:
            return None
        return self._kept("window", lambda w: w.nbytes >= nbytes, lambda: self.allocate_window(grown_size(nbytes)))

    def plan_channel(self, capacity: int) -> PlanChannel | None:
        """The persistent plans' channel (:class:`~giftcomm.transport.channel.PlanChannel`) with
        room for ``capacity`` payload bytes per message, or None when the ranks share no memory
        or this build has no native channel (then on every rank alike: the caller agrees on
        :func:`~giftcomm.transport.channel.native_channel` first). Collective, with the same
        ``capacity`` everywhere; kept and reused, and replaced (older references then closed)
        only to grow, in 64 KiB steps."""
        if not self.shared_memory or native_channel() is None:
            return None

        def make() -> PlanChannel | None:
            room = grown_size(capacity)
            win = self.allocate_window(channel_window_nbytes(room))
            return None if win is None else PlanChannel(win, self.rank, room, self.crowded)

        return self._kept("channel", lambda c: c.capacity >= capacity, make)

    def _kept(self, name: str, fits: Callable[[Any], bool], make: Callable[[], Any]) -> Any:
        """The state's ``name`` (the window or the channel) when it ``fits``; else it is released
        and replaced by ``make()`` (collective: every rank decides alike)."""
        st = self.state
        held = getattr(st, name)
        if held is None or not fits(held):
            if held is not None:
                held.release()
                setattr(st, name, None)
            setattr(st, name, make())
        return getattr(st, name)

    def expired(self, what: str, peers: tuple[int, ...], seconds: float) -> None:
        """Apply the timeout policy to a wait for ``peers`` that passed its deadline of
        ``seconds`` outside a :class:`Request` (the plan channel's): raise
        :class:`~giftcomm.errors.CommTimeout` (MPI transports may end the job instead)."""
        raise CommTimeout(f"giftcomm: {what} timed out on rank {self.rank} of {self.size} after {seconds:g} s "
                          f"waiting for rank(s) {', '.join(map(str, peers))}", what, peers, seconds, self.rank)

    def interrupted(self, what: str) -> None:
        """Note that an exception (KeyboardInterrupt) ended a wait of ``what`` outside a
        :class:`Request`: MPI transports become unusable, as after an interrupted message wait
        (the in-process transports have nothing to mark)."""
        return None

    def split(self, members: Sequence[int], name: str) -> "Transport":
        """A transport over the parent ranks ``members`` (which include this rank), cached by name.

        Every rank calls split with the same name at the same point of the program (like
        MPI_Comm_split); each rank passes the members of its own group.
        """
        key = (name, tuple(int(m) for m in members))
        splits = self.state.splits
        if key not in splits:
            splits[key] = self._new_split(key[1], len(splits))
        return splits[key]

    def _new_split(self, members: tuple[int, ...], index: int) -> "Transport":
        """A new sub-transport (``index``: how many this transport made before)."""
        return SubTransport(self, members, tag_base=TAG_SPAN * (1 + index))

    def release_state(self) -> None:
        """Free what this transport keeps (:meth:`TransportState.close`: the plan channel, the
        shared window, the splits: collective), so that it can be garbage-collected or reused
        from scratch; plans made before raise CommClosed."""
        self.close("giftcomm: the transport's state was released (giftcomm.release / release_state); "
                   "make a new plan", final=False)

    def close(self, reason: str, collective: bool = True, final: bool = True) -> None:
        """End this transport's state (:meth:`TransportState.close`, which waits for a call in
        flight); ``final``: the transport itself is gone too (later uses raise CommClosed)."""
        st = self._state
        if st is not None and collective:
            st.lock.acquire()  # the call in flight finishes first; no new call starts on st
        try:
            if not final and self._state is st:
                self._state = None  # the next call starts from a fresh state
            if st is not None:  # (its windows' collective frees still use this transport)
                st.close(reason, collective)
            if final:
                self._closed = reason  # st stays attached, closed: a waiting call sees it and raises
        finally:
            if st is not None and collective:
                st.lock.release()


class QueuedRequest(Request):
    """A queued operation of a :class:`GroupedTransport`; waiting issues the whole queue."""

    __slots__ = ("_t", "issued")

    def __init__(self, t: "GroupedTransport") -> None:
        self._t, self.issued = t, False

    def wait(self) -> None:
        if not self.issued:
            self._t.flush()


class QueuedOp(NamedTuple):
    """One queued send or receive: kind "send" or "recv", the buffer, the peer rank, the tag."""

    kind: str
    buf: Any
    peer: int
    tag: int
    request: QueuedRequest


class GroupedTransport(Transport):
    """A GROUPED transport: ``isend``/``irecv`` only queue; a wait on any queued request issues
    the whole queue, in order, as one group (:meth:`issue`). Subclasses define :meth:`issue` and
    may check buffers in :meth:`check_buffer`."""

    schedule = GROUPED
    _queue: list[QueuedOp] | None = None

    def isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        return self._enqueue("send", buf, dest, tag)

    def irecv(self, buf: Any, source: int, tag: int = 0) -> Request:
        return self._enqueue("recv", buf, source, tag)

    def check_buffer(self, buf: Any) -> None:
        """Raise for a buffer this transport cannot move (default: accept)."""

    def _enqueue(self, kind: str, buf: Any, peer: int, tag: int) -> Request:
        self.check_buffer(buf)
        if self._queue is None:
            self._queue = []
        req = QueuedRequest(self)
        self._queue.append(QueuedOp(kind, buf, int(peer), tag, req))
        return req

    def flush(self) -> None:
        """Issue every queued operation as one group."""
        ops, self._queue = self._queue or [], []
        if ops:
            self.issue(ops)
            for op in ops:
                op.request.issued = True

    @abstractmethod
    def issue(self, ops: list[QueuedOp]) -> None:
        """Issue ``ops`` (in queue order) as one group."""


# A transport over a subset of another transport's ranks (the hierarchical algorithm's node and
# cross-node groups): point-to-point messages go through the parent with ranks translated and tags
# moved into a range of their own, so the subgroup's traffic never matches the parent's or a
# sibling subgroup's.
TAG_SPAN = 4096  # tags a subgroup may use; hop indices stay far below it


class SubTransport(Transport):
    """Ranks ``members`` of ``parent`` (in that order) as a transport of ``len(members)`` ranks."""

    def __init__(self, parent: Transport, members: Sequence[int], tag_base: int) -> None:
        self.parent = parent
        self.members = [int(m) for m in members]
        self.rank = self.members.index(parent.rank)
        self.size = len(self.members)
        self.tag_base = tag_base
        self.schedule, self.memory = parent.schedule, parent.memory

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        return self.parent.isend(buf, self.members[dest], self.tag_base + tag)

    def irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Request:
        return self.parent.irecv(buf, self.members[source], self.tag_base + tag)

    def allgather_int64(self, vec: np.ndarray) -> np.ndarray:
        """Ring allgather over point-to-point (control path: a few int64 per rank)."""
        vec = np.ascontiguousarray(vec, dtype=np.int64)
        table = np.empty((self.size, vec.size), np.int64)
        table[self.rank] = vec
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        for step in range(self.size - 1):
            send_row, recv_row = (self.rank - step) % self.size, (self.rank - step - 1) % self.size
            reqs = [self.irecv(table[recv_row], left, TAG_SPAN - 1), self.isend(table[send_row], right, TAG_SPAN - 1)]
            wait_all(reqs)
        return table

    def allgather_object(self, obj: Any) -> list[Any]:
        raise NotImplementedError("subgroup transports carry data only; errors are agreed on the parent")


def tree_sum(rows: Sequence[Any], kind: str) -> Any:
    """The sum of ``rows`` (one array per rank, of ``kind`` as for :meth:`Transport.native_sum`)
    in the order of MPICH's recursive-doubling allreduce: with P2 the largest power of two <= P
    and R = P - P2, rows 2i and 2i+1 (i < R) are added first; then the P2 partial sums, in rank
    order, are added in adjacent pairs, level by level, until one is left. A new array."""
    if kind in ("float32", "float64"):
        add: Callable[[Any, Any], Any] = lambda a, b: a + b  # noqa: E731
    else:
        def add(a: Any, b: Any) -> Any:
            if kind == "bfloat16" and a.dtype == np.uint16:  # device bits
                from .._xp import from_float32, to_float32

                return from_float32(to_float32(a, kind) + to_float32(b, kind), kind)
            return (a.astype(np.float32) + b.astype(np.float32)).astype(a.dtype)
    p = len(rows)
    p2 = 1 << (p.bit_length() - 1)
    with np.errstate(over="ignore", invalid="ignore"):
        parts = [add(rows[2 * i], rows[2 * i + 1]) for i in range(p - p2)] + list(rows[2 * (p - p2):])
        while len(parts) > 1:
            parts = [add(parts[2 * j], parts[2 * j + 1]) for j in range(len(parts) // 2)]
    return parts[0].copy() if p == 1 else parts[0]


def wait_all(requests: Sequence[Request]) -> None:
    """Wait for every request in order."""
    for req in requests:
        req.wait()


def _after_fork_in_child() -> None:
    """Everything a transport owns belongs to the parent: its channel slots and windows are shared
    with the parent's peers. Close it all here, without any collective step, so the child's first
    use raises CommClosed at once instead of posting into the parent's slots."""
    pid = os.getpid()
    for t in list(LIVE_TRANSPORTS):
        st = t._state
        made = st.pid if st is not None else getattr(t, "pid", pid)
        t.close(f"giftcomm: this process (pid {pid}) is a fork()ed child of the process that created this "
                f"transport (pid {made}): its communicator, windows and plans belong to the parent; make new "
                f"ones in the child (or fork before using giftcomm)", collective=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
