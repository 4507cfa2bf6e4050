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

from .. import _xp
from .base import ANY, GroupedTransport, QueuedOp
from .loopback import LoopbackGroup, LoopbackTransport, PendingRecv


class DeviceLoopbackTransport(GroupedTransport, LoopbackTransport):
    """One virtual rank of a :class:`DeviceLoopbackGroup`; buffers: CuPy (or NumPy) arrays."""

    memory = ANY

    def issue(self, ops: list[QueuedOp]) -> None:
        """Deliver the group's sends, then complete its receives."""
        for op in ops:
            if op.kind == "send":
                xp = _xp.array_module(op.buf)
                data = xp.array(op.buf, copy=True).reshape(-1).view("uint8")
                _xp.synchronize(data)
                self.group.box(self.rank, op.peer, op.tag).put(data)
        for op in ops:
            if op.kind == "recv":
                PendingRecv(self.group.box(op.peer, self.rank, op.tag), op.buf, self, op.peer).wait()


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
