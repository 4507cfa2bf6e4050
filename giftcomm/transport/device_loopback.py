"""The in-process loopback for device arrays: P virtual ranks (threads) sharing one GPU, with the
GROUPED semantics of NCCL.

Same mailboxes as :class:`~giftcomm.transport.loopback.LoopbackGroup`. As on NCCL, ``isend`` and
``irecv`` only queue; waiting on any queued request issues the whole queue as one group: its
sends are delivered (copied on the buffer's own backend, ``xp.array(buf, copy=True)``, after the
sender's current stream is synchronized) and then the group's receives complete, blocking until
their messages arrive, which stands in for NCCL blocking the stream. So a collective that would
deadlock on NCCL (a group holding a receive whose send the peer can only issue after its own next
wait) deadlocks here too, and the loopback's timeout turns that into an error. NumPy buffers work
as well: the CPU tests drive the grouped schedule with them.
"""
from __future__ import annotations

from typing import Any

from .. import _xp
from .base import ANY, GROUPED, Request
from .loopback import LoopbackGroup, LoopbackTransport, PendingRecv


class _Queued(Request):
    """A queued send/recv; waiting issues the transport's whole queue as one group."""

    __slots__ = ("_t", "issued")

    def __init__(self, t: "DeviceLoopbackTransport") -> None:
        self._t, self.issued = t, False

    def wait(self) -> None:
        if not self.issued:
            self._t.flush()


class DeviceLoopbackTransport(LoopbackTransport):
    """One virtual rank of a :class:`DeviceLoopbackGroup`; buffers: CuPy (or NumPy) arrays."""

    schedule = GROUPED
    memory = ANY

    def __init__(self, group: LoopbackGroup, rank: int) -> None:
        super().__init__(group, rank)
        self._queue: list[tuple[str, Any, int, int, _Queued]] = []

    def isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        req = _Queued(self)
        self._queue.append(("send", buf, dest, tag, req))
        return req

    def irecv(self, buf: Any, source: int, tag: int = 0) -> Request:
        req = _Queued(self)
        self._queue.append(("recv", buf, source, tag, req))
        return req

    def flush(self) -> None:
        """Issue the queue as one group: deliver its sends, then complete its receives."""
        ops, self._queue = self._queue, []
        for kind, buf, peer, tag, req in ops:
            if kind == "send":
                xp = _xp.array_module(buf)
                data = xp.array(buf, copy=True).reshape(-1).view("uint8")
                _xp.synchronize(data)
                self.group.box(self.rank, peer, tag).put(data)
                req.issued = True
        for kind, buf, peer, tag, req in ops:
            if kind == "recv":
                PendingRecv(self.group.box(peer, self.rank, tag), buf).wait()
                req.issued = True


class DeviceLoopbackGroup(LoopbackGroup):
    """P virtual ranks on the current device: ``DeviceLoopbackGroup(P).run(fn)``.

    Each rank's thread runs on the device that was current when the group was created.
    """

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.transports = [DeviceLoopbackTransport(self, r) for r in range(size)]
        self.device_id = None
        import sys

        cp = sys.modules.get("cupy")
        if cp is not None:
            try:
                self.device_id = cp.cuda.Device().id
            except Exception:
                self.device_id = None

    def run(self, fn):
        if self.device_id is None:
            return super().run(fn)
        import cupy

        def on_device(t):
            with cupy.cuda.Device(self.device_id):
                return fn(t)

        return super().run(on_device)
