"""The in-process loopback for device arrays: P virtual ranks (threads) sharing one GPU.

Same mailboxes as :class:`~giftcomm.transport.loopback.LoopbackGroup`; messages are copied on
the device (``xp.array(buf, copy=True)`` of the buffer's own backend, so NumPy buffers work too
and the CPU tests run it). A send synchronizes the sender's current stream after the copy, so a
queued message is complete whatever stream the receiver uses.
"""
from __future__ import annotations

from typing import Any

from .. import _xp
from .base import Request
from .loopback import LoopbackGroup, LoopbackTransport, _Done


class DeviceLoopbackTransport(LoopbackTransport):
    """One virtual rank of a :class:`DeviceLoopbackGroup`; buffers: CuPy (or NumPy) arrays."""

    def isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        xp = _xp.array_module(buf)
        data = xp.array(buf, copy=True).reshape(-1).view("uint8")
        _xp.synchronize(data)
        self.group.box(self.rank, dest, tag).put(data)
        return _Done()


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
