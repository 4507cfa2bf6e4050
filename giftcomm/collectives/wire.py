"""The wire format of one call, bound to the codec kernels of its array backend.

A :class:`Wire` is made once per call, after the call's arguments were checked and agreed on;
the algorithms run their per-slice loops on its methods, which check nothing and read no
environment (giftcomm.codec's trusted kernels). With stochastic rounding (``seed`` not None) the
wire also carries what decides each encode's random bits (giftcomm.reference.rounding): the
encoding party (this rank, by default), a stage, and the offset of the buffer it works on within
the caller's flat buffer (``base``: the hierarchical algorithm's cross-node rings work on a part).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .. import _xp
from ..codec import Kernels, kernels_for
from ..formats import Format, message_nbytes
from ..reference.rounding import call_key


@dataclass(frozen=True)
class Wire:
    """fmt, block: the message format. xp: the array backend (numpy or cupy). kernels: its codec.
    seed: None (round to nearest) or the call's stochastic-rounding seed; party, stage, base: see
    the module docstring."""

    fmt: Format
    block: int
    xp: Any
    kernels: Kernels
    seed: int | None = None
    party: int = 0
    stage: int = 0
    base: int = 0

    @classmethod
    def of(cls, fmt: Format, block: int, xp: Any = np, seed: int | None = None, party: int = 0) -> "Wire":
        return _wire(fmt, block, xp, kernels_for(xp, cached=True), seed if fmt.scaled else None, party)  # type: ignore[arg-type]

    def with_format(self, fmt: Format) -> "Wire":
        """The same backend, block and rounding with another format (the hierarchical algorithm's
        fp32; pass-through formats always round to nearest)."""
        return replace(self, fmt=fmt, seed=self.seed if fmt.scaled else None)

    def at(self, party: int | None = None, stage: int | None = None, base: int | None = None) -> "Wire":
        """This wire with another party, stage or base offset; itself when it rounds to nearest
        (they decide only the random bits of stochastic rounding)."""
        if self.seed is None:
            return self
        return replace(self, party=self.party if party is None else party, stage=self.stage if stage is None else stage,
                       base=self.base if base is None else base)

    def _key(self) -> int | None:
        return None if self.seed is None else call_key(self.seed, self.party, self.stage)

    def nbytes(self, count: int) -> int:
        """Bytes of one message of ``count`` values."""
        return message_nbytes(count, self.fmt, self.block)

    def empty(self, nbytes: int) -> Any:
        """A fresh uint8 buffer of this backend (results and messages that outlive the call)."""
        return self.xp.empty(nbytes, np.uint8)

    def encode(self, values: Any, out: Any, offset: int = 0) -> Any:
        """Encode ``values`` (1-D contiguous, any float dtype: cast to float32) into ``out``;
        ``offset``: the index of ``values[0]`` in the buffer the algorithm works on."""
        return self.kernels.encode(_xp.astype(values, np.float32, copy=False), self.fmt, self.block, out, self._key(),
                                   int(self.base + offset))

    def decode(self, message: Any, count: int, out: Any = None) -> Any:
        """The float32 values of a message (into ``out`` when given)."""
        res = self.xp.empty(count, np.float32) if out is None else out
        return self.kernels.decode(message, count, self.fmt, self.block, res)

    def accumulate(self, message: Any, acc: Any) -> Any:
        """``acc += decode(message)`` (float32 ``acc``)."""
        return self.kernels.decode_accumulate(message, acc, self.fmt, self.block)

    def hop(self, recv: Any, local: Any, out: Any, sum_out: Any = None, offset: int = 0) -> None:
        """Decode ``recv``, add ``local`` (the accumulation dtype), encode into ``out``; write the
        sum into ``sum_out`` if given. float32 runs fused; float64 sums in float64. ``offset``
        as for :meth:`encode`."""
        if local.dtype == np.float32:
            self.kernels.decode_add_encode(recv, local, self.fmt, self.block, out, sum_out, self._key(),
                                           int(self.base + offset))
            return
        with np.errstate(invalid="ignore", over="ignore"):
            total = _xp.astype(self.decode(recv, local.size), local.dtype) + local
        self.encode(total, out, offset)
        if sum_out is not None:
            sum_out[...] = total


@functools.lru_cache(maxsize=256)
def _wire(fmt: Format, block: int, xp: Any, kernels: Kernels, seed: int | None, party: int) -> Wire:
    """One shared Wire per distinct call format (a training loop repeats a few): made once."""
    return Wire(fmt, block, xp, kernels, seed, party)
