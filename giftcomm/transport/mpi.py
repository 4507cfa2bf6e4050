"""Transport over an mpi4py communicator (host memory buffers).

Waiting (docs/robustness.md). Every blocking wait -- a message, the agreement's gathers, the
shared window's fence, the creation of the private communicator, its splits and the window --
is an MPI nonblocking operation polled with ``Test``: a short spin, then sleeps that grow with
the time already waited (at most 0.2 ms), so a rank waiting for a slow peer does not burn a core,
and a signal (Ctrl-C) is handled within a millisecond. Each wait has a deadline of
``transport.timeout`` seconds (``$GIFTCOMM_TIMEOUT``, default 600; 0: none). At the deadline the
policy ``on_timeout`` (``$GIFTCOMM_ON_TIMEOUT``) applies: ``"abort"`` (default) prints the error,
naming the operation and the peers waited for, to stderr and calls ``MPI_Abort``, so the whole
job ends and mpiexec returns; ``"raise"`` raises :class:`~giftcomm.errors.CommTimeout` and marks
the transport unusable (later calls raise :class:`~giftcomm.errors.CommAborted` at once).

An interrupt (KeyboardInterrupt, or any exception a signal handler raises) during a wait also
marks the transport unusable; when such an exception ends the program, the job is ended with
``MPI_Abort`` at exit instead of ``MPI_Finalize`` (which would wait for peers that may be gone).

Lifetime: the transport of a user communicator (:func:`transport_for`) is kept in an MPI
attribute of that communicator; freeing the communicator (``comm.Free()``) runs the attribute's
delete callback, which closes everything the transport owns (its TransportState: the plan
channel, the shared window, the splits) and frees the private duplicate. :func:`release` does the
same explicitly (collective; after the call in flight on another thread). Afterwards the
transport and its plans raise :class:`~giftcomm.errors.CommClosed`.
"""
from __future__ import annotations

import atexit
import logging
import os
import pickle
import sys
import threading
import time
import warnings
from typing import Any, Callable, cast

import numpy as np
from mpi4py import MPI

from .. import config
from ..errors import CommAborted, CommClosed, CommTimeout
from .base import LIVE_TRANSPORTS, Request, Transport
from .shared_window import SHM_DIR, SharedWindow, enabled_by_env, populate, shm_room, window_footprint

__all__ = ["MpiTransport", "MpiRequest", "transport_for", "release", "half_sum", "TIMEOUT_EXIT_CODE", "INTERRUPT_EXIT_CODE"]

log = logging.getLogger("giftcomm")

TIMEOUT_EXIT_CODE = 124  # as timeout(1)
INTERRUPT_EXIT_CODE = 130  # as a shell reports SIGINT
_SPIN_S = 2e-3  # poll without sleeping this long first: the waits of a healthy collective keep their latency
_YIELD_AFTER_S = 5e-5  # a peer later than this is likely waiting for a core (other jobs): spin yielding it
_TESTS_PER_CHECK = 16  # MPI tests between two looks at the clock (and yields): each look costs progress
_MAX_SLEEP_S = 2e-4  # the longest sleep between two polls: a late peer is noticed within ~0.3 ms
_ALL = None  # "peers": every other rank (a collective)


class _Health:
    """Shared by a transport and its MPI splits: the first failure, and the requests left in
    flight by it (kept alive so MPI never writes into freed memory)."""

    __slots__ = ("failure", "orphans")

    def __init__(self) -> None:
        self.failure: str | None = None
        self.orphans: list[Any] = []


_interrupted = False  # an interrupt left some transport with messages in flight
_created = False  # some transport exists (or existed) in this process


@atexit.register
def _abort_if_interrupted() -> None:
    """Runs before mpi4py's MPI_Finalize: after an interrupt inside a wait, peers may never
    complete their side, and MPI_Finalize could wait for them for ever; end the job instead.
    The same when the program ends with an uncaught KeyboardInterrupt that came outside a wait
    (during the codec, say) while giftcomm transports exist: the peers may be inside one."""
    uncaught = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
    if (_interrupted or (uncaught and _created)) and MPI.Is_initialized() and not MPI.Is_finalized():
        try:
            sys.stderr.flush()
        finally:
            MPI.COMM_WORLD.Abort(INTERRUPT_EXIT_CODE)


def _setting(errors: list[str], read: Callable[[], Any], fallback: Any) -> Any:
    """``read()``, or ``fallback`` with its ValueError's message appended to ``errors``."""
    try:
        return read()
    except ValueError as exc:
        errors.append(str(exc))
        return fallback


class MpiRequest(Request):
    __slots__ = ("_req", "_t", "_what", "_peer")

    def __init__(self, req: MPI.Request, t: "MpiTransport", what: str, peer: int) -> None:
        self._req, self._t, self._what, self._peer = req, t, what, peer

    def wait(self) -> None:
        self._t.wait_for(self._req, self._what, (self._peer,))




# Tags of giftcomm's control messages on its private communicator, far above the hop indices the
# algorithms use as tags (and above every sub-transport's range).
_ALLGATHER_TAG = 30000
_BARRIER_TAG = 30001  # + round
_RELEASE_TAG = 29999  # release's agreement on the calls to let in (giftcomm.release, another thread may be in a call)
_DIRECT_CONTROL_MAX = 16  # up to this many ranks the agreement gather is point-to-point


_HALF_SUM_OPS: dict[str, MPI.Op] = {}


def half_sum(kind: str) -> MPI.Op:
    """The MPI operation that sums 16-bit floats of ``kind`` ("bfloat16", "float16") carried as
    MPI_UINT16_T: each pair added in float32 and rounded to the kind (nearest even), with the
    codec's pass-through kernels (giftcomm.codec: native when built; equal to ml_dtypes' casts)."""
    op = _HALF_SUM_OPS.get(kind)
    if op is None:
        from .. import codec

        fmt = "bf16" if kind == "bfloat16" else "fp16"

        def add(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            a, b = np.frombuffer(inbuf, np.uint8), np.frombuffer(inoutbuf, np.uint8)
            acc = codec.decode(b, b.size // 2, fmt)
            codec.decode_accumulate(a, acc, fmt, None)
            codec.encode(acc, fmt, out=b)

        op = _HALF_SUM_OPS[kind] = MPI.Op.Create(add, commute=True)
    return op


def _crowded(nodes: np.ndarray, rank: int) -> bool:
    """Whether this node runs more of the ranks than it has cores (then a waiting rank yields its
    core while it spins, as MPICH's heavy-yield waits do)."""
    here = int(np.count_nonzero(nodes == nodes[rank]))
    return here > (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class MpiTransport(Transport):
    """Point-to-point over a private duplicate of ``comm``, so our tags never meet the caller's.

    shared_memory: use a node-shared MPI window (MPI_Win_allocate_shared) for zero-copy
    allreduces when every rank is on one node. None (default): yes unless $GIFTCOMM_SHARED_MEMORY
    is 0; False: never; True: always (ValueError when the ranks span nodes). Pass the same value
    on every rank. timeout: seconds per wait (None: $GIFTCOMM_TIMEOUT; 0: none). on_timeout:
    "abort" or "raise" (None: $GIFTCOMM_ON_TIMEOUT). Creating a transport is collective.
    """

    crowded = True  # until the node layout is known: yield while spinning
    _token = np.zeros(2, np.uint8)  # the barrier's one-byte messages (in, out)

    def __init__(self, comm: MPI.Comm, shared_memory: bool | None = None, timeout: float | None = None,
                 on_timeout: str | None = None) -> None:
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise TypeError(f"MpiTransport needs an mpi4py communicator, got {comm!r}")
        # Settings are read before anything collective, and a bad one does not raise here: it is
        # agreed with the node layout (_find_nodes), so every rank raises the same ValueError at
        # once instead of one rank raising and its peers waiting out their deadline.
        errors: list[str] = []
        on_timeout = _setting(errors, lambda: on_timeout if on_timeout is not None else
                              config.choice("GIFTCOMM_ON_TIMEOUT"), "abort")
        if on_timeout not in ("abort", "raise"):
            errors.append(f"on_timeout must be 'abort' or 'raise', got {on_timeout!r}")
            on_timeout = "abort"
        self.on_timeout = on_timeout
        try:
            self.timeout = timeout  # None: the environment's default, read now
            self.timeout  # noqa: B018
        except ValueError as exc:
            errors.append(str(exc))
            self.timeout = float(config.VARIABLES["GIFTCOMM_TIMEOUT"].default or 0)
        want = shared_memory if shared_memory is not None else _setting(errors, enabled_by_env, False)
        _setting(errors, lambda: config.flag("GIFTCOMM_NATIVE"), True)  # read by every call's codec
        _setting(errors, lambda: config.choice("GIFTCOMM_NATIVE_ISA"), None)
        self._env_error = "; ".join(errors)
        self._health = _Health()
        global _created
        _created = True
        LIVE_TRANSPORTS.add(self)
        self.pid = os.getpid()
        self.user_comm = comm
        self.comm = comm  # until the duplicate exists: waits below name ranks of the same group
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        # MPI_Comm_idup, polled under the deadline: a rank whose deadline passes here has posted
        # nothing on the new communicator, so a late peer completes the duplicate and then times
        # out at its own next wait, instead of blocking in MPI_Comm_dup for ever
        dup, req = comm.Idup()
        try:
            self.wait_for(req, "creating giftcomm's private communicator (MPI_Comm_idup)")
        except BaseException:
            self._health.orphans.append(dup)
            raise
        self.comm = dup
        try:
            self._nodes = self._find_nodes()
        except ValueError:  # a bad setting, agreed: every rank is here
            self.comm.Free()
            raise
        self.crowded = _crowded(self._nodes, self.rank)
        one_node = bool((self._nodes == 0).all())
        if shared_memory and not one_node:
            raise ValueError(f"shared_memory=True needs every rank on one node; these span {self._nodes.max() + 1}")
        self.shared_memory = one_node and bool(want)

    # --- waiting ------------------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed is not None:
            raise CommClosed(self._closed)
        if self._health.failure is not None:
            raise CommAborted(f"giftcomm: this communicator's transport is unusable after an earlier failure "
                              f"({self._health.failure}); free it and use a new communicator")

    def _poll(self, req: MPI.Request | list[MPI.Request], what: str, peers: tuple[int, ...] | None) -> None:
        """Wait for ``req`` (or all of a list), polling with backoff, under the deadline."""
        test: Callable[[], bool] = (lambda: MPI.Request.Testall(req)) if isinstance(req, list) else req.Test
        limit = self.timeout
        start = time.monotonic()
        tests = 1 if self.crowded else _TESTS_PER_CHECK  # more ranks than cores: yield after every test
        try:
            while True:  # spin: short waits keep their latency (MPI progresses only inside Test)
                for _ in range(tests):
                    if test():
                        return
                spun = time.monotonic() - start
                if spun > _SPIN_S:
                    break
                if self.crowded or spun > _YIELD_AFTER_S:  # let a peer that waits for this core run
                    os.sched_yield()
            while True:
                waited = time.monotonic() - start
                if limit and waited > limit:
                    self._expired(req, what, peers, limit)
                time.sleep(min(_MAX_SLEEP_S, waited / 16))
                if test():
                    return
        except CommTimeout:
            raise
        except BaseException as exc:  # KeyboardInterrupt, a signal handler's exception, an MPI error
            self._fail(f"{type(exc).__name__} during {what}", req)
            if not isinstance(exc, Exception):
                global _interrupted
                _interrupted = True
            raise

    def wait_for(self, req: MPI.Request | list[MPI.Request], what: str, peers: tuple[int, ...] | None = _ALL) -> None:
        """Wait for an MPI request (or a list: all of them) under this transport's deadline and
        timeout policy. ``what`` names the operation and ``peers`` the ranks it waits for (None:
        a collective over every rank), for the error message."""
        done = MPI.Request.Testall(req) if isinstance(req, list) else req.Test()
        if not done:
            self._poll(req, what, peers)

    def _fail(self, why: str, req: Any = None) -> None:
        h = self._health
        if h.failure is None:
            h.failure = why
        if req is not None:
            h.orphans.append(req)
        if self._state is not None and self._state.channel is not None:  # the plans' channel refuses calls too
            self._state.channel.native.close()

    def _describe(self, peers: tuple[int, ...] | None) -> str:
        if peers is None:
            others = [q for q in range(self.size) if q != self.rank]
            return (f"ranks {self._names(others)} (a collective over all {self.size} ranks: "
                    f"at least one of them has not arrived)")
        return f"rank {self._names(list(peers))}"

    def _names(self, ranks: list[int]) -> str:
        """Ranks of this transport, with their COMM_WORLD ranks where those differ."""
        try:
            world = MPI.Group.Translate_ranks(self.comm.Get_group(), ranks, MPI.COMM_WORLD.Get_group())
        except Exception:
            world = ranks
        return ", ".join(str(r) if w == r or w < 0 else f"{r} (world rank {w})" for r, w in zip(ranks, world))

    def _expired(self, req: Any, what: str, peers: tuple[int, ...] | None, limit: float) -> None:
        msg = (f"giftcomm: {what} timed out on rank {self.rank} of {self.size} after {limit:g} s waiting for "
               f"{self._describe(peers)} (GIFTCOMM_TIMEOUT / timeout=)")
        self._fail(f"timeout: {what}", req)
        if self.on_timeout == "abort":
            sys.stderr.write(f"{msg}; GIFTCOMM_ON_TIMEOUT=abort: calling MPI_Abort to end the job\n")
            sys.stderr.flush()
            self.comm.Abort(TIMEOUT_EXIT_CODE)
        raise CommTimeout(f"{msg}; this transport is unusable from now on", what,
                          tuple(range(self.size)) if peers is None else peers, limit, self.rank)

    def expired(self, what: str, peers: tuple[int, ...], seconds: float) -> None:
        self._expired(None, what, peers, seconds)

    def interrupted(self, what: str) -> None:
        global _interrupted
        self._fail(f"interrupt during {what}")
        _interrupted = True

    def _arrive(self, comm: MPI.Comm, what: str) -> None:
        """A barrier with a deadline before a blocking collective that has no nonblocking form
        (Comm_dup, Comm_split, Win_allocate_shared, Win_free): once every rank has arrived, the
        blocking call completes promptly."""
        self._check()
        if comm.Get_size() > 1:
            self.wait_for(comm.Ibarrier(), what)

    # --- topology, splits, window --------------------------------------------------------------
    def _find_nodes(self) -> np.ndarray:
        """Node index per rank from MPI_COMM_TYPE_SHARED (collective; done once, at creation).
        A bad $GIFTCOMM_SHARED_MEMORY on any rank (``_env_error``) is agreed here: every rank
        raises the same ValueError."""
        env_error = self._env_error
        self._arrive(self.comm, "finding the node layout (MPI_Comm_split_type)")
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        lgroup, group = local.Get_group(), self.comm.Get_group()
        leader = MPI.Group.Translate_ranks(lgroup, [0], group)[0]  # key=rank: local rank 0 is the lowest
        lgroup.Free()
        group.Free()
        local.Free()
        table = self.allgather_int64(np.array([leader, 1 if env_error else 0], np.int64))
        bad = np.flatnonzero(table[:, 1])
        if bad.size:
            messages = self.allgather_object(env_error)
            raise ValueError(f"giftcomm: bad environment on rank(s) {', '.join(map(str, bad))}: "
                             f"{messages[int(bad[0])]}")
        return np.unique(table[:, 0], return_inverse=True)[1].astype(np.int64)

    def node_ids(self) -> np.ndarray:
        return self._nodes.copy()

    def _new_split(self, members: tuple[int, ...], index: int) -> Transport:
        """A real MPI sub-communicator (MPI_Comm_split, collective over this transport)."""
        self._arrive(self.comm, "splitting giftcomm's communicator (MPI_Comm_split)")
        sub = self.comm.Split(color=min(members), key=self.rank)
        t = type(self).__new__(type(self))  # a device MPI transport splits into device MPI ones
        t.user_comm, t.comm = sub, sub
        t.rank, t.size = sub.Get_rank(), sub.Get_size()
        t._nodes = self._nodes[list(members)]
        t.crowded = self.crowded
        t._health, t.on_timeout, t.timeout = self._health, self.on_timeout, self.timeout
        t._env_error, t.pid = "", self.pid
        LIVE_TRANSPORTS.add(t)
        return t

    def allocate_window(self, nbytes: int) -> SharedWindow | None:
        """MPI_Win_allocate_shared of ``nbytes`` per rank, in one passive-target epoch for its life
        (MPI_Win_lock_all): the fence is MPI_Win_sync, a barrier, MPI_Win_sync, the separate-memory
        -model-safe way to order plain loads and stores across ranks.

        None, with one warning (rank 0) and ``shared_memory`` switched off on every rank alike,
        when /dev/shm cannot hold the window: rank 0 first checks the free space against what MPI
        really takes (:func:`~giftcomm.transport.shared_window.window_footprint`); then every rank
        backs its part's pages at once, in a way that reports a full /dev/shm instead of dying of
        SIGBUS later (:func:`~giftcomm.transport.shared_window.populate`), so two jobs racing for
        the same /dev/shm both go on (one of them, or both, over messages)."""
        self._check()
        need = window_footprint(nbytes, self.size)
        room, free = shm_room(need) if self.rank == 0 else (True, 0)
        table = self.allgather_int64(np.array([int(room), free], np.int64))
        if not table[0, 0]:
            self._no_window(f"{SHM_DIR} has {int(table[0, 1]) >> 20} MiB free but the shared window "
                            f"needs {need >> 20} MiB")
            return None
        self._arrive(self.comm, "allocating the shared window (MPI_Win_allocate_shared)")
        # the window is only asked for on an intracommunicator (mpi4py raises TypeError otherwise)
        win = MPI.Win.Allocate_shared(nbytes, 1, comm=cast(MPI.Intracomm, self.comm))
        # through a memoryview: mpi4py's stubs declare its buffer's buffer protocol for Python >= 3.12 only
        views = [np.frombuffer(win.Shared_query(q)[0].cast("B"), np.uint8, nbytes) for q in range(self.size)]
        ok = populate(views[self.rank])
        backed = self.allgather_int64(np.array([0 if ok is False else 1], np.int64))[:, 0]
        if not backed.all():
            del views
            self._arrive(self.comm, "freeing the shared window (MPI_Win_free)")
            win.Free()
            short = ", ".join(str(q) for q in np.flatnonzero(backed == 0))
            self._no_window(f"{SHM_DIR} ran out of memory while rank(s) {short} backed the window's "
                            f"{need >> 20} MiB (another job is using it)")
            return None
        win.Lock_all(MPI.MODE_NOCHECK)
        comm = self.comm

        def fence() -> None:
            win.Sync()
            self._check()
            self._barrier("shared-window fence")
            win.Sync()

        def release() -> None:
            win.Unlock_all()
            self._arrive(comm, "freeing the shared window (MPI_Win_free)")
            win.Free()

        return SharedWindow(views, fence, release)

    def _no_window(self, why: str) -> None:
        """No window (every rank alike): say so once, on rank 0, and use messages from now on."""
        self.shared_memory = False
        if self.rank == 0:
            msg = (f"giftcomm: {why}; allreduces use MPI messages from now on (enlarge {SHM_DIR}, e.g. "
                   f"docker run --shm-size, or set GIFTCOMM_SHARED_MEMORY=0)")
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return None

    # --- messages ------------------------------------------------------------------------------
    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        self._check()
        return MpiRequest(self.comm.Isend([buf, MPI.BYTE], dest, tag), self, "send", dest)

    def irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Request:
        self._check()
        return MpiRequest(self.comm.Irecv([buf, MPI.BYTE], source, tag), self, "receive", source)

    def sendrecv(self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int, tag: int = 0) -> None:
        self._check()
        reqs = [self.comm.Irecv([recvbuf, MPI.BYTE], source, tag), self.comm.Isend([sendbuf, MPI.BYTE], dest, tag)]
        self.wait_for(reqs, f"sendrecv (to {dest}, from {source})", (source,) if source == dest else (source, dest))

    # --- control operations (deadline'd nonblocking collectives) -------------------------------
    def _barrier(self, what: str) -> None:
        """A dissemination barrier of one-byte point-to-point messages on the private
        communicator, under the deadline: ceil(log2 P) rounds. (MPICH's MPI_Ibarrier, polled,
        took ~15x longer than this on one node.)"""
        p, r = self.size, self.rank
        k, rnd = 1, 0
        while k < p:
            self.wait_for([self.comm.Irecv([self._token[:1], MPI.BYTE], (r - k) % p, _BARRIER_TAG + rnd),
                           self.comm.Isend([self._token[1:], MPI.BYTE], (r + k) % p, _BARRIER_TAG + rnd)], what)
            k, rnd = 2 * k, rnd + 1

    def allgather_int64(self, vec: np.ndarray) -> np.ndarray:
        self._check()
        vec = np.ascontiguousarray(vec, dtype=np.int64)
        table = np.empty((self.size, vec.size), np.int64)
        if self.size > _DIRECT_CONTROL_MAX:
            self.wait_for(self.comm.Iallgather([vec, MPI.INT64_T], [table, MPI.INT64_T]), "agreement (allgather)")
            return table
        # small worlds: every rank sends its row to every other (one round of point-to-point
        # messages, which MPICH completes several times faster than a polled MPI_Iallgather)
        table[self.rank] = vec
        peers = [q for q in range(self.size) if q != self.rank]
        reqs = [self.comm.Irecv([table[q], MPI.INT64_T], q, _ALLGATHER_TAG) for q in peers]
        reqs += [self.comm.Isend([vec, MPI.INT64_T], q, _ALLGATHER_TAG) for q in peers]
        if reqs:
            self.wait_for(reqs, "agreement (allgather)")
        return table

    def allgather_object(self, obj: Any) -> list[Any]:
        data = np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = self.allgather_int64(np.array([data.size], np.int64))[:, 0]
        displs = np.zeros_like(sizes)
        np.cumsum(sizes[:-1], out=displs[1:])
        got = np.empty(int(sizes.sum()), np.uint8)
        self.wait_for(self.comm.Iallgatherv([data, MPI.BYTE], [got, (sizes.tolist(), displs.tolist()), MPI.BYTE]),
                   "object allgather")
        return [pickle.loads(got[int(d) : int(d) + int(s)].tobytes()) for d, s in zip(displs, sizes)]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self._check()
        data = np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), np.uint8) if self.rank == root else None
        size = np.array([0 if data is None else data.size], np.int64)
        self.wait_for(self.comm.Ibcast([size, MPI.INT64_T], root=root), "object broadcast", (root,))
        buf = data if data is not None else np.empty(int(size[0]), np.uint8)
        self.wait_for(self.comm.Ibcast([buf, MPI.BYTE], root=root), "object broadcast", (root,))
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    def sum_float64(self, arr: np.ndarray) -> np.ndarray:
        self._check()
        arr = np.ascontiguousarray(arr, dtype=np.float64)
        total = np.empty_like(arr)
        self.wait_for(self.comm.Iallreduce(arr, total, op=MPI.SUM), "float64 sum (allreduce)")
        return total

    def reduce_float64(self, arr: np.ndarray, root: int) -> np.ndarray | None:
        self._check()
        arr = np.ascontiguousarray(arr, dtype=np.float64)
        total = np.empty_like(arr) if self.rank == root else None
        self.wait_for(self.comm.Ireduce(arr, total, op=MPI.SUM, root=root), "float64 reduce")
        return total

    def broadcast_float64(self, buf: np.ndarray, root: int) -> None:
        self._check()
        self.wait_for(self.comm.Ibcast(buf, root=root), "float64 broadcast", (root,))

    def native_sum(self, buf: np.ndarray, kind: str, into: np.ndarray | None = None) -> np.ndarray:
        """MPI_Allreduce (nonblocking, under the deadline); the 16-bit kinds through a
        commutative user-defined MPI operation that adds in float32 and rounds to the kind
        (MPICH has no 16-bit float sum)."""
        self._check()
        total = np.empty_like(buf) if into is None else into
        if kind in ("float32", "float64"):
            req = self.comm.Iallreduce(buf, total, op=MPI.SUM)
        else:
            req = self.comm.Iallreduce([buf.view(np.uint16), MPI.UINT16_T], [total.view(np.uint16), MPI.UINT16_T],
                                       op=half_sum(kind))
        self.wait_for(req, f"native allreduce ({kind})")
        return total

    def native_broadcast(self, buf: np.ndarray, root: int) -> None:
        self._check()
        self.wait_for(self.comm.Ibcast([buf.view(np.uint8), MPI.BYTE], root=root), "native broadcast", (root,))

    # --- lifetime ------------------------------------------------------------------------------
    def free(self) -> None:
        """Release everything this transport owns and its private communicator (collective;
        optional: MPI frees them at finalize); it and its plans raise CommClosed afterwards."""
        self.close(FREED)

    def close(self, reason: str, collective: bool = True, final: bool = True) -> None:
        """:meth:`Transport.close` (the channel, the window, the splits; after the call in flight),
        then the private communicator. After a failure (timeout, interrupt), or with
        ``collective`` False (a forked child), only the references are dropped: the peers may be
        gone, so nothing collective is attempted."""
        collective = collective and self._health.failure is None and self._closed is None
        super().close(reason, collective, final=True)
        if collective and self.comm != MPI.COMM_NULL:
            self.comm.Free()  # the private duplicate (a split's: its sub-communicator)

    def renewed(self) -> "MpiTransport | None":
        """The transport of this one's user communicator after :func:`release` (made, collectively,
        by the first call admitted after it), or None when the communicator is gone."""
        if self.pid != os.getpid() or self.user_comm == MPI.COMM_NULL:
            return None
        return transport_for(self.user_comm)

    def successor(self) -> "MpiTransport | None":
        """The cached transport that replaced this one over the same, still living, user
        communicator (after :func:`release`), or None."""
        comm = self.user_comm
        if self.pid != os.getpid() or comm == MPI.COMM_NULL:
            return None
        t = _cache.get(MPI.Comm.py2f(comm))
        return t if t is not None and t is not self and t._closed is None and t.user_comm == comm else None


FREED = ("giftcomm: this transport's communicator was freed or released (comm.Free() / giftcomm.release); "
         "make a new communicator (or call on the released one again) and new plans")


_cache: dict[int, MpiTransport] = {}
_cache_lock = threading.Lock()
_creation_locks: dict[int, threading.Lock] = {}
_keyval: int | None = None


def _on_comm_free(comm: MPI.Comm, keyval: int, t: MpiTransport) -> None:
    """The delete callback of our attribute: runs inside MPI_Comm_free (and Delete_attr) of the
    user's communicator, on every rank of it. Only giftcomm's own objects are freed here (the
    private duplicate, its splits, the window), never the communicator being freed; exceptions
    must not escape into MPI."""
    _forget(t)
    try:
        st = t._state
        if st is not None and not st.lock.acquire(blocking=False):
            # another thread is inside a call (comm.Free() under it: a program error); waiting for it
            # here, inside MPI_Comm_free, could deadlock MPI: only drop the references
            t.close(FREED, collective=False)
            return
        try:
            t.free()
        finally:
            if st is not None:
                st.lock.release()
    except BaseException as exc:  # noqa: BLE001 - reported, never raised into MPI_Comm_free
        log.warning("giftcomm: releasing the transport of a freed communicator failed: %s: %s",
                    type(exc).__name__, exc)


def _forget(t: MpiTransport) -> None:
    with _cache_lock:
        for key in [k for k, v in _cache.items() if v is t]:
            del _cache[key]


def _attr_key() -> int:
    global _keyval
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval(delete_fn=_on_comm_free)
    return _keyval


def _predefined(comm: MPI.Comm) -> bool:
    return comm == MPI.COMM_WORLD or comm == MPI.COMM_SELF


def cached_transport(key: int) -> MpiTransport | None:
    """The live cached transport of the communicator whose Fortran handle is ``key``
    (``MPI.Comm.py2f``), or None: the lookup behind ``comm=None`` once COMM_WORLD's is made."""
    return _cache.get(key)


def transport_for(comm: MPI.Comm | None) -> MpiTransport:
    """The cached transport of an mpi4py communicator (COMM_WORLD when None).

    The first call on a communicator duplicates it, which is collective: every rank of it makes
    that first call together, as with any collective. The transport is released when the
    communicator is freed (an MPI attribute's delete callback) or by :func:`release`.
    Thread-safe: two threads making a first call on one communicator get one transport.
    """
    if comm is None:
        comm = MPI.COMM_WORLD
    key = MPI.Comm.py2f(comm)
    t = _cache.get(key)
    if t is not None and t.user_comm == comm:
        return t
    with _cache_lock:
        lock = _creation_locks.setdefault(key, threading.Lock())
    with lock:
        t = _cache.get(key)
        if t is None or t.user_comm != comm:
            t = MpiTransport(comm)
            if not _predefined(comm):
                comm.Set_attr(_attr_key(), t)
            with _cache_lock:
                _cache[key] = t
    return t


def release(comm: MPI.Comm | None = None) -> None:
    """Free giftcomm's transport of ``comm`` (None: COMM_WORLD): its private communicator, splits,
    shared window and workspaces. Collective over ``comm``; a later call on ``comm`` builds a new
    transport. Freeing the communicator itself (``comm.Free()``) does the same by itself."""
    if comm is None:
        comm = MPI.COMM_WORLD
    if comm == MPI.COMM_NULL:
        return
    t = _cache.get(MPI.Comm.py2f(comm))
    gate = None
    if t is not None and t._closed is None and t._health.failure is None:
        gate = _drain(t)  # every rank lets the same calls in; they finish first
    st = None if t is None else t._state
    if st is not None:
        st.lock.acquire()  # (held by no call now)
    try:
        if not _predefined(comm) and _keyval is not None and comm.Get_attr(_keyval) is not None:
            comm.Delete_attr(_keyval)  # runs _on_comm_free
            return
        with _cache_lock:
            t = _cache.pop(MPI.Comm.py2f(comm), None)
        if t is not None:
            t.free()
    finally:
        if st is not None:
            st.lock.release()
        if gate is not None:
            with gate.cond:  # the calls waiting beyond the agreed number run on the new transport
                gate.replaced, gate.releasing = True, False
                gate.cond.notify_all()


def _drain(t: MpiTransport) -> Any:
    """Release's first step: agree with the peers (point-to-point on a tag of its own, so a call
    in flight on another thread is not disturbed) on the number of calls to let in (the largest
    any rank has admitted), let exactly that many run on this rank, and wait for them to finish,
    within the transport's deadline. Later calls wait in :meth:`Transport.enter_call` until the
    release is done. Returns the gate."""
    gate = t.gate()
    with gate.cond:
        if gate.releasing or gate.replaced:
            raise RuntimeError("giftcomm.release: this communicator is already being released on another thread")
        gate.releasing, gate.limit = True, None
        mine = np.array([gate.started], np.int64)
    try:
        table = np.empty((t.size, 1), np.int64)
        table[t.rank] = mine
        peers = [q for q in range(t.size) if q != t.rank]
        reqs = [t.comm.Irecv([table[q], MPI.INT64_T], q, _RELEASE_TAG) for q in peers]
        reqs += [t.comm.Isend([mine, MPI.INT64_T], q, _RELEASE_TAG) for q in peers]
        if reqs:
            t.wait_for(reqs, "release (agreeing on the calls in flight)")
        limit = int(table.max())
        seconds = t.timeout
        deadline = time.monotonic() + seconds if seconds > 0 else None
        with gate.cond:
            gate.limit = limit
            gate.cond.notify_all()
            while gate.started < limit or gate.inflight > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CommTimeout(
                        f"giftcomm.release: rank {t.rank} of {t.size} waited {seconds:g} s for its calls in flight "
                        f"({gate.inflight} running, {gate.started} of the {limit} the ranks agreed on started; "
                        f"GIFTCOMM_TIMEOUT / timeout=)")
                gate.cond.wait(left)
    except BaseException:
        with gate.cond:
            gate.releasing, gate.limit = False, None
            gate.cond.notify_all()
        raise
    return gate
