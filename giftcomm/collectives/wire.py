"""The wire format of one call, bound to the codec kernels of its array backend.

A :class:`Wire` is made once per call, after the call's arguments were checked and agreed on;
the algorithms run their per-slice loops on its methods, which check nothing and read no
environment (giftcomm.codec's trusted kernels).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..codec import Kernels, kernels_for
from ..formats import Format, message_nbytes


@dataclass(frozen=True)
class Wire:
    """fmt, block: the message format. xp: the array backend (numpy or cupy). kernels: its codec."""

    fmt: Format
    block: int
    xp: Any
    kernels: Kernels

    @classmethod
    def of(cls, fmt: Format, block: int, xp: Any = np) -> "Wire":
        return cls(fmt, block, xp, kernels_for(xp))

    def with_format(self, fmt: Format) -> "Wire":
        """The same backend and block with another format (the hierarchical algorithm's fp32)."""
        return Wire(fmt, self.block, self.xp, self.kernels)

    def nbytes(self, count: int) -> int:
        """Bytes of one message of ``count`` values."""
        return message_nbytes(count, self.fmt, self.block)

    def empty(self, nbytes: int) -> Any:
        """A fresh uint8 buffer of this backend (results and messages that outlive the call)."""
        return self.xp.empty(nbytes, np.uint8)

    def encode(self, values: Any, out: Any) -> Any:
        """Encode ``values`` (1-D contiguous, any float dtype: cast to float32) into ``out``."""
        return self.kernels.encode(values.astype(np.float32, copy=False), self.fmt, self.block, out)

    def decode(self, message: Any, count: int, out: Any = None) -> Any:
        """The float32 values of a message (into ``out`` when given)."""
        res = self.xp.empty(count, np.float32) if out is None else out
        return self.kernels.decode(message, count, self.fmt, self.block, res)

    def accumulate(self, message: Any, acc: Any) -> Any:
        """``acc += decode(message)`` (float32 ``acc``)."""
        return self.kernels.decode_accumulate(message, acc, self.fmt, self.block)

    def hop(self, recv: Any, local: Any, out: Any, sum_out: Any = None) -> None:
        """Decode ``recv``, add ``local`` (the accumulation dtype), encode into ``out``; write the
        sum into ``sum_out`` if given. float32 runs fused; float64 sums in float64."""
        if local.dtype == np.float32:
            self.kernels.decode_add_encode(recv, local, self.fmt, self.block, out, sum_out)
            return
        with np.errstate(invalid="ignore", over="ignore"):
            total = self.decode(recv, local.size).astype(local.dtype) + local
        self.encode(total, out)
        if sum_out is not None:
            sum_out[...] = total
