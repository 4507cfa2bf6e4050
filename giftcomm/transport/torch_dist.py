"""Transports over a torch.distributed process group (for users who already have one).

- :class:`TorchDistTransport` (PIPELINED, host memory): messages are CPU ``torch.uint8`` tensors
  that share memory with the NumPy buffers (``torch.from_numpy``), so nothing is copied on our
  side. Point-to-point traffic goes through a *private* gloo group over the same ranks, created
  when the transport is built (a collective call, like ``MPI_Comm_dup``): our tags never meet the
  caller's messages, whatever the backend of the caller's group is. The control operations
  (agreement, object gathers, float64 sums for KFAC factor sync) run on that gloo group too.
  :meth:`TorchDistTransport.of_members` builds one over a group that only its members create
  (FSDP2's shard groups, the giftcomm process group's private gloo group).
  Every wait is bounded by :attr:`Transport.timeout` (``GIFTCOMM_TIMEOUT`` / a call's
  ``timeout``; gloo's collectives get it as their per-operation timeout): a wait past it raises
  :class:`~giftcomm.errors.CommTimeout`, and gloo closes the connection it waited on. From then on
  the transport is unusable: its later operations raise :class:`~giftcomm.errors.CommAborted` at
  once, and a peer whose wait fails on the closed connection raises CommAborted too (and is
  marked unusable alike).
- :class:`TorchDistDeviceTransport` (GROUPED, device memory): giftcomm's device path over the
  caller's own group (NCCL for CUDA tensors). ``isend``/``irecv`` only queue; a wait issues the
  queue as one ``dist.batch_isend_irecv`` (``ncclGroupStart/End`` on NCCL), stream-ordered after
  the current stream's work, and then makes the current stream wait for it (no host
  synchronisation on NCCL). Buffers are CuPy arrays (taken zero-copy by ``torch.from_dlpack``)
  or torch tensors. Control operations go to a host :class:`TorchDistTransport`.
- :func:`default_transport`: what ``comm=None`` means under torchrun (torch.distributed
  initialised with several ranks while MPI's world is a single process).
"""
from __future__ import annotations

import os
import pickle
import socket
import threading
import warnings
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CommAborted, CommClosed, CommTimeout
from .base import ANY, DEVICE, GroupedTransport, QueuedOp, Request, Transport, wait_all

_ALLGATHER_TAG = 30000  # the agreement's messages (giftcomm's data messages use small tags)
_OBJECT_TAG = 30001  # allgather_object's pickled bytes
_DIRECT_CONTROL_MAX = 16  # up to this many ranks the agreement is one round of direct messages

__all__ = ["TorchDistTransport", "TorchDistDeviceTransport", "default_transport", "reset_default_transport",
           "torch_world_size"]


class _TorchRequest(Request):
    """A gloo send or receive, waited under the transport's deadline (gloo's work-level timeout)."""

    __slots__ = ("_work", "_keep", "_owner", "_what")

    def __init__(self, work, keep: Any, owner: "TorchDistTransport", what: str) -> None:
        self._work, self._keep = work, keep  # keep the tensor alive until the wait
        self._owner, self._what = owner, what

    def wait(self) -> None:
        self._owner._wait(self._work, self._what)
        self._keep = None


def _timed_out(exc: BaseException) -> bool:
    """Whether a gloo error is its deadline passing (not a closed connection or a bad call)."""
    text = str(exc).lower()
    return "timed out" in text or ("timeout" in text and "pair closure" not in text)


def _as_tensor(buf: np.ndarray) -> torch.Tensor:
    """A uint8 CPU tensor sharing memory with the contiguous NumPy array ``buf``."""
    flat = buf.reshape(-1).view(np.uint8)
    if not flat.flags.writeable:  # torch.from_numpy warns on read-only arrays; we only read them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(flat)
    return torch.from_numpy(flat)


class TorchDistTransport(Transport):
    """A giftcomm Transport over the ranks of ``group`` (default: the default process group).

    Building one is collective over ``group`` (it creates the private gloo group). ``rank`` and
    ``size`` are the ranks within ``group``. torch.distributed must already be initialised.
    """

    _failure: str | None = None  # why this transport became unusable (a timeout, a closed connection)

    def __init__(self, group: dist.ProcessGroup | None = None, backend: str = "gloo") -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistTransport needs an initialised torch.distributed (init_process_group)")
        self.user_group = group
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self._global = list(ranks)
        self.group = dist.new_group(ranks=self._global, backend=backend)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self._nodes = self._find_nodes()

    @classmethod
    def of_members(cls, group: dist.ProcessGroup, control: dist.ProcessGroup | None = None,
                   device: torch.device | None = None) -> "TorchDistTransport":
        """A transport over ``group``'s members that only they build (collective over ``group``
        alone, unlike the constructor, which every rank of the default group calls through
        ``dist.new_group``): messages go over ``control``, a gloo group over the same ranks made
        beforehand on every rank (the giftcomm process group's), or, with None, over a new gloo
        group the members make here (``use_local_synchronization``: each FSDP2/HSDP shard group
        makes its own while the others make theirs). torch names such a group from its ranks and
        from how many groups the calling rank has joined, so the members first check, with one
        all-gather over ``group`` (a ``device`` tensor: its backend's; default CPU), that they
        have joined equally many: RuntimeError on every member otherwise (they would wait for each
        other under different names until the timeout). ValueError when ``control``'s ranks are
        not ``group``'s."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistTransport needs an initialised torch.distributed (init_process_group)")
        t = cls.__new__(cls)
        t.user_group = group
        t._global = list(dist.get_process_group_ranks(group))
        if control is None:
            _same_group_history(group, torch.device("cpu") if device is None else device)
            control = dist.new_group(ranks=t._global, backend="gloo", use_local_synchronization=True)
        elif list(dist.get_process_group_ranks(control)) != t._global:
            raise ValueError(f"TorchDistTransport.of_members: the control group's ranks "
                             f"{dist.get_process_group_ranks(control)} are not the group's {t._global}")
        t.group = control
        t.rank, t.size = dist.get_rank(control), dist.get_world_size(control)
        t._nodes = t._find_nodes()
        return t

    # ---------------------------------------------------------------- waiting, failure
    def _check(self) -> None:
        """CommClosed / CommAborted at once when this transport is gone or unusable."""
        if self._closed is not None:
            raise CommClosed(self._closed)
        if self._failure is not None:
            raise CommAborted(f"giftcomm: this torch.distributed transport (rank {self.rank} of {self.size}) is "
                              f"unusable after an earlier failure ({self._failure}); its gloo connections are "
                              "closed: make a new group (or transport)")

    def _deadline(self) -> timedelta | None:
        """The per-operation timeout gloo gets (None: no deadline, the group's own)."""
        limit = self.timeout
        return timedelta(seconds=limit) if limit else None

    def _wait(self, work: Any, what: str) -> None:
        """Wait for one gloo work under the deadline (:meth:`_failed` on an error)."""
        limit = self.timeout
        try:
            if limit:
                work.wait(timeout=timedelta(seconds=limit))
            else:
                work.wait()
        except RuntimeError as exc:
            raise self._failed(exc, what) from exc

    def _failed(self, exc: RuntimeError, what: str) -> Exception:
        """Mark this transport unusable after gloo's error ``exc`` in ``what`` and return what to
        raise: CommTimeout for its deadline, CommAborted for a failed connection (a peer's
        transport timed out or failed first, and gloo closed the connection)."""
        limit = self.timeout
        if _timed_out(exc):
            self._failure = f"{what} timed out after {limit:g} s"
            return CommTimeout(f"giftcomm: {what} timed out on rank {self.rank} of {self.size} after {limit:g} s "
                               f"(GIFTCOMM_TIMEOUT / timeout=; torch.distributed: {exc})", what, (), limit, self.rank)
        self._failure = f"{what} failed: {exc}"
        return CommAborted(f"giftcomm: {what} failed on rank {self.rank} of {self.size}: a peer's transport "
                           f"timed out or failed before (torch.distributed: {exc})")

    def _collective(self, what: str, issue: Any, opts: Any) -> None:
        """Issue one gloo collective of ``self.group`` (``issue(opts)`` returns its work) with
        the deadline as its timeout, and wait for it (:meth:`_wait`)."""
        self._check()
        deadline = self._deadline()
        if deadline is not None:
            opts.timeout = deadline
        try:
            work = issue(opts)
        except RuntimeError as exc:
            raise self._failed(exc, what) from exc
        self._wait(work, what)

    def _find_nodes(self) -> np.ndarray:
        """Node index per rank: ranks reporting the same host name share a node; nodes are
        numbered in the order of their lowest rank (collective; done once, at creation)."""
        hosts = self.allgather_object(socket.gethostname())
        leader = {h: min(r for r, x in enumerate(hosts) if x == h) for h in hosts}
        leaders = np.array([leader[h] for h in hosts], np.int64)
        return np.unique(leaders, return_inverse=True)[1].astype(np.int64)

    def node_ids(self) -> np.ndarray:
        """Node index of every rank (int64, shape (size,)), from the ranks' host names."""
        return self._nodes.copy()

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        return self._p2p(dist.isend, buf, dest, tag, f"send to rank {dest}")

    def irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Request:
        return self._p2p(dist.irecv, buf, source, tag, f"receive from rank {source}")

    def _p2p(self, post: Any, buf: np.ndarray, peer: int, tag: int, what: str) -> Request:
        self._check()
        t = _as_tensor(buf)
        try:
            work = post(t, self._global[peer], group=self.group, tag=tag)
        except RuntimeError as exc:  # gloo refuses to post on a connection it closed
            raise self._failed(exc, what) from exc
        return _TorchRequest(work, t, self, what)

    def allgather_int64(self, vec: np.ndarray) -> np.ndarray:
        mine = np.array(vec, dtype=np.int64, copy=True).reshape(-1)
        return self._gather_rows(mine, _ALLGATHER_TAG, "the agreement gather")

    def _gather_rows(self, mine: np.ndarray, tag: int, what: str) -> np.ndarray:
        """Every rank's 1-D row (the same length and dtype everywhere): (size, len) array."""
        self._check()
        out = np.empty((self.size, mine.size), mine.dtype)
        if self.size > _DIRECT_CONTROL_MAX:
            rows = [torch.from_numpy(r) for r in out]
            self._collective(what, lambda o: self.group.allgather([rows], [torch.from_numpy(mine)], o),
                             dist.distributed_c10d.AllgatherOptions())
            return out
        # small worlds: every rank sends its row to every other, one round of messages (gloo's
        # all_gather is a ring of P - 1 hops, each a scheduling delay when ranks share cores;
        # 1.4-3.8 ms against 1 hop on the 1 Gbit/s netbed at P = 4)
        out[self.rank] = mine
        peers = [q for q in range(self.size) if q != self.rank]
        reqs = [self.irecv(out[q], q, tag) for q in peers] + [self.isend(mine, q, tag) for q in peers]
        wait_all(reqs)
        return out

    def allgather_object(self, obj: Any) -> list[Any]:
        """One picklable object per rank: the lengths through the agreement gather, then the
        pickled bytes (padded to the longest), under the deadline like every wait here."""
        mine = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        lengths = self.allgather_int64(np.array([mine.size], np.int64))[:, 0]
        padded = np.zeros(int(lengths.max()), np.uint8)
        padded[: mine.size] = mine
        rows = self._gather_rows(padded, _OBJECT_TAG, "an object gather")
        return [pickle.loads(rows[q, : int(lengths[q])].tobytes()) for q in range(self.size)]

    # float64 control operations: one gloo collective each on a CPU tensor sharing memory with
    # the array (KFAC factor sync moves whole factor matrices through these).
    def sum_float64(self, arr: np.ndarray) -> np.ndarray:
        """Elementwise sum over ranks (``all_reduce`` on gloo: every rank gets the same bytes)."""
        total = np.array(arr, dtype=np.float64, copy=True, order="C")
        if self.size > 1:
            self._allreduce(torch.from_numpy(total.reshape(-1)), "a float64 sum")
        return total

    def reduce_float64(self, arr: np.ndarray, root: int) -> np.ndarray | None:
        """The sum over ranks on ``root`` (gloo's ``reduce``), None elsewhere."""
        total = np.array(arr, dtype=np.float64, copy=True, order="C")
        if self.size > 1:
            opts = dist.ReduceOptions()
            opts.reduceOp, opts.rootRank = dist.ReduceOp.SUM, int(root)  # type: ignore[assignment]  # RedOpType
            tensor = torch.from_numpy(total.reshape(-1))
            self._collective("a float64 reduce", lambda o: self.group.reduce([tensor], o), opts)
        return total if self.rank == root else None

    def broadcast_float64(self, buf: np.ndarray, root: int) -> None:
        """Overwrite ``buf`` with ``root``'s (gloo's ``broadcast``), in place."""
        if self.size == 1:
            return
        inplace = buf.dtype == np.float64 and buf.flags.c_contiguous and buf.flags.writeable
        tmp = buf if inplace else np.ascontiguousarray(buf, dtype=np.float64)
        self._broadcast(torch.from_numpy(tmp.reshape(-1)), root, "a float64 broadcast")
        if not inplace:
            buf[...] = tmp

    def native_sum(self, buf: np.ndarray, kind: str, into: np.ndarray | None = None) -> np.ndarray:
        """gloo's ``all_reduce`` (SUM) of a copy of ``buf`` (in ``into`` when given; its ring,
        in the kind's arithmetic)."""
        if into is None:
            total = np.array(buf, copy=True, order="C")
        else:
            total = into
            total[...] = buf
        if self.size > 1:
            self._allreduce(_kind_tensor(total, kind), "the native allreduce")
        return total

    def native_broadcast(self, buf: np.ndarray, root: int) -> None:
        if self.size > 1:
            self._broadcast(_as_tensor(buf.view(np.uint8)), root, "the native broadcast")

    def _allreduce(self, tensor: torch.Tensor, what: str) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # torch's RedOpType converts
        self._collective(what, lambda o: self.group.allreduce([tensor], o), opts)

    def _broadcast(self, tensor: torch.Tensor, root: int, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = int(root)
        self._collective(what, lambda o: self.group.broadcast([tensor], o), opts)

    def free(self) -> None:
        """Destroy the private group (optional; torch frees it at destroy_process_group)."""
        self.close("giftcomm: this transport was freed (its plans and state with it); make a new one")
        dist.destroy_process_group(self.group)


def _same_group_history(group: dist.ProcessGroup, device: torch.device) -> None:
    """Check, with one all-gather over ``group`` (a ``device`` tensor: the group's backend's),
    that its members have joined equally many process groups: torch names a group that only its
    members create from its ranks and that number, so members that differ would each wait in
    gloo's rendezvous under another name. RuntimeError on every member when they differ."""
    from torch.distributed import distributed_c10d as c10d

    mine = torch.tensor([len(c10d._world.pg_names)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    counts = [int(c) for c in torch.cat(every).tolist()]
    if len(set(counts)) > 1:
        raise RuntimeError(
            f"giftcomm: the ranks {dist.get_process_group_ranks(group)} of this group have joined different numbers "
            f"of process groups ({counts}); giftcomm's private gloo group over them, made by these ranks alone, takes "
            "its name from that number in torch, so they would wait for each other until the timeout. Make the "
            "same process groups on every rank (a rank outside a group calls dist.new_group for it too) before "
            "giftcomm's first call on the group")


_TORCH_KINDS = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                "bfloat16": torch.bfloat16}


def _kind_tensor(buf: Any, kind: str) -> torch.Tensor:
    """A flat torch tensor of ``kind`` over ``buf``'s memory (NumPy, torch or a DLPack producer;
    bfloat16 as ml_dtypes.bfloat16 or uint16 bits), no copy."""
    return _torch_view(buf).view(_TORCH_KINDS[kind])


# ---------------------------------------------------------------------------- device (grouped)
def _torch_view(buf: Any) -> torch.Tensor:
    """A flat uint8 torch tensor over ``buf``'s memory, no copy: torch tensors as they are,
    NumPy arrays through ``torch.from_numpy``, CuPy (and other DLPack producers) through
    ``torch.from_dlpack``."""
    if isinstance(buf, torch.Tensor):
        t = buf
    elif isinstance(buf, np.ndarray):
        return _as_tensor(buf)
    else:
        t = torch.from_dlpack(buf)
    if not t.is_contiguous():
        raise ValueError("torch.distributed device transport: buffers must be contiguous")
    return t.reshape(-1).view(torch.uint8)


class TorchDistDeviceTransport(GroupedTransport):
    """giftcomm's GROUPED device transport over a torch.distributed group (the caller's own,
    e.g. the NCCL group of a DDP model; default: the default group).

    ``isend``/``irecv`` queue; the first wait issues the queue as one ``dist.batch_isend_irecv``
    of ``dist.P2POp`` (one NCCL group, on the group's stream after the current stream's work)
    and waits on its works, which on NCCL only makes the current stream wait: the call returns
    at once and later kernels on the current stream see the received bytes. On gloo the wait
    blocks until the messages arrived (the CPU tests drive this class over gloo with
    ``memory="any"``).

    control: the host transport for agreement and object/float64 collectives (default: a new
    :class:`TorchDistTransport` over the same ranks, which is collective). memory: "device"
    (default) or "any" (also host buffers: for tests over gloo). Building one without
    ``control`` is collective over ``group``.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, control: TorchDistTransport | None = None,
                 memory: str = DEVICE) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistDeviceTransport needs an initialised torch.distributed (init_process_group)")
        if memory not in (DEVICE, ANY):
            raise ValueError(f"memory must be {DEVICE!r} or {ANY!r}, got {memory!r}")
        self.memory = memory
        self.group = group
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self._global = list(ranks)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.control = control if control is not None else TorchDistTransport(group)
        if self.control.size != self.size or self.control.rank != self.rank:
            raise ValueError("control transport must span the same ranks as the group")
        self.issued_groups = 0  # batches issued (observability; tests)

    def check_buffer(self, buf: Any) -> None:
        if self.memory == DEVICE and not _is_device(buf):
            raise TypeError(f"torch.distributed device transport: expected a device array, got {type(buf).__name__}")

    def issue(self, ops: list[QueuedOp]) -> None:
        """The queue as one ``dist.batch_isend_irecv``; then the current stream waits for it."""
        p2p = []
        for op in ops:
            fn = dist.isend if op.kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, _torch_view(op.buf), self._global[op.peer], group=self.group, tag=op.tag))
        if not p2p:
            return
        works = dist.batch_isend_irecv(p2p)
        for w in works:
            w.wait()  # NCCL: the current stream waits (no host sync); gloo: completes the transfer
        self.issued_groups += 1

    def node_ids(self) -> np.ndarray:
        return self.control.node_ids()

    def allgather_int64(self, vec: np.ndarray) -> np.ndarray:
        return self.control.allgather_int64(vec)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.control.allgather_object(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.control.broadcast_object(obj, root)

    def sum_float64(self, arr: np.ndarray) -> np.ndarray:
        return self.control.sum_float64(arr)

    def reduce_float64(self, arr: np.ndarray, root: int) -> np.ndarray | None:
        return self.control.reduce_float64(arr, root)

    def broadcast_float64(self, buf: np.ndarray, root: int) -> None:
        self.control.broadcast_float64(buf, root)

    def native_sum(self, buf: Any, kind: str, into: Any = None) -> Any:
        """``dist.all_reduce`` (SUM) of a copy of ``buf`` (in ``into`` when given) on the group
        (NCCL: after the current stream's work, and the current stream waits for it)."""
        self.flush()
        if into is None:
            total = buf.copy()
        else:
            total = into
            total[...] = buf
        if self.size > 1:
            dist.all_reduce(_kind_tensor(total, kind), op=dist.ReduceOp.SUM, group=self.group)
        return total

    def native_broadcast(self, buf: Any, root: int) -> None:
        self.flush()
        if self.size > 1:
            dist.broadcast(_torch_view(buf), self._global[root], group=self.group)


def _is_device(buf: Any) -> bool:
    if isinstance(buf, torch.Tensor):
        return buf.device.type == "cuda"
    from .. import _xp

    return _xp.is_device_array(buf)


# ---------------------------------------------------------------------------- comm=None
_DEFAULT: dict[str, Transport] = {}
_DEFAULT_LOCK = threading.Lock()
_DEFAULT_WORLD: list[Any] = [None]  # the default group _DEFAULT's transports were made over


def torch_world_size() -> int:
    """The default group's size when torch.distributed is initialised, else 0 (torch not
    imported or not initialised: nothing is imported or started here)."""
    try:
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:
        return 0
    return 0


def mpi_world_size() -> int:
    """MPI's COMM_WORLD size, without starting MPI when mpi4py was never imported and no MPI
    launcher variables are set (a torchrun process): then 1."""
    import sys

    launched = any(k in os.environ for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"))
    if "mpi4py.MPI" not in sys.modules and not launched:
        return 1
    from mpi4py import MPI

    return int(MPI.COMM_WORLD.Get_size())


def default_transport(device: bool = False) -> Transport | None:
    """The transport ``comm=None`` should use when torch.distributed is the launcher's world.

    Returns None when torch.distributed is not initialised or has one rank (then ``comm=None``
    means MPI.COMM_WORLD as before). When it is initialised with world size > 1 and MPI's
    COMM_WORLD is a single process (torchrun), returns a cached transport over the default
    group: a :class:`TorchDistTransport` (host arrays) or, with ``device``, a
    :class:`TorchDistDeviceTransport` (CUDA arrays) sharing its control group. Creating them is
    collective: every rank's first ``comm=None`` call makes them. Raises RuntimeError, naming
    the fix, when both worlds have several ranks (ambiguous: pass ``comm=`` explicitly).
    """
    n_torch = torch_world_size()
    if n_torch <= 1:
        return None
    n_mpi = mpi_world_size()
    if n_mpi > 1:
        if n_mpi == n_torch:
            raise RuntimeError(
                f"comm=None is ambiguous: both MPI.COMM_WORLD ({n_mpi} ranks) and torch.distributed's "
                f"default group ({n_torch} ranks) are initialised; pass comm=MPI.COMM_WORLD or "
                f"comm=giftcomm.transport.torch_dist.TorchDistTransport() explicitly")
        raise RuntimeError(
            f"comm=None is ambiguous: MPI.COMM_WORLD has {n_mpi} ranks but torch.distributed's default "
            f"group has {n_torch}; pass comm= explicitly (an mpi4py communicator or a TorchDistTransport)")
    key = "device" if device else "host"
    world = dist.GroupMember.WORLD
    if _DEFAULT_WORLD[0] is world:
        t = _DEFAULT.get(key)
        if t is not None:
            return t
    with _DEFAULT_LOCK:
        if _DEFAULT_WORLD[0] is not world:  # destroy_process_group + init_process_group: a new default group
            _drop_defaults()
            _DEFAULT_WORLD[0] = world
        if "host" not in _DEFAULT:
            _DEFAULT["host"] = TorchDistTransport()
        if device and "device" not in _DEFAULT:
            host = _DEFAULT["host"]
            assert isinstance(host, TorchDistTransport)
            _DEFAULT["device"] = TorchDistDeviceTransport(control=host)
        return _DEFAULT[key]


def reset_default_transport() -> None:
    """Forget the cached default transports (optional: ``comm=None`` notices a destroyed and
    re-created default group by itself and drops them then)."""
    with _DEFAULT_LOCK:
        _drop_defaults()
        _DEFAULT_WORLD[0] = None


def _drop_defaults() -> None:
    """Forget the default transports of a default group that was destroyed: their state is
    closed without communication (the group and its private gloo group are gone), so a plan
    made over them raises CommClosed."""
    for t in _DEFAULT.values():
        if t._state is not None:
            t.close("giftcomm: torch.distributed's default group was destroyed; comm=None now uses the new one",
                    collective=False)
    _DEFAULT.clear()
