"""Type stubs of the C extension giftcomm._codec_native (sources: native/gc_module.c, native/gc_channel.c).

The kernels trust their arguments (giftcomm.codec checks them first): 1-D contiguous NumPy arrays,
float32 values, uint8 messages of ``message_nbytes(n)`` bytes, ``fmt_code`` a format variant's
code (giftcomm.codec.native_code: Format.variant_code, an adaptive row's with its spec's slot),
``block`` the values per scale; ``key`` (None or a
64-bit int): stochastic rounding's Philox key, counters ``offset + i``.
"""
from typing import Any

import numpy as np
import numpy.typing as npt

CHANNEL_PAYLOAD_OFFSET: int
"""Bytes from the start of a channel slot to its message (sequence word and header first)."""

def encode(x: npt.NDArray[np.float32], out: npt.NDArray[np.uint8], fmt_code: int, block: int,
           key: int | None = None, offset: int = 0) -> None: ...
def decode(msg: npt.NDArray[np.uint8], out: npt.NDArray[np.float32], fmt_code: int, block: int) -> None: ...
def decode_add_encode(msg_in: npt.NDArray[np.uint8], local: npt.NDArray[np.float32], msg_out: npt.NDArray[np.uint8],
                      sum_out: npt.NDArray[np.float32] | None, fmt_code: int, block: int, key: int | None = None,
                      offset: int = 0) -> None: ...
def decode_accumulate(msg: npt.NDArray[np.uint8], acc: npt.NDArray[np.float32], fmt_code: int, block: int) -> None: ...
def _formats() -> dict[str, Any]: ...
def _adaptive_slot(budget_mbits: int, frame: int, share8_permille: int, top: str, mid: str, block: int) -> int:
    """Register an adaptive row's spec (giftcomm.adaptive.AdaptiveSpec) for super-blocks of
    ``block``; the row's native code is its format code | slot << SCALE_RULE_SHIFT."""
def _isa() -> str: ...
def _isas() -> list[str]: ...
def _set_isa(name: str) -> None: ...

class Channel:
    """The one-shot exchange of persistent plans over node-shared memory (native/gc_channel.c)."""

    stride: int
    """Bytes from one slot to the next."""

    def __init__(self, views: list[Any], rank: int, capacity: int, crowded: bool, table: Any) -> None: ...
    def call(self, code: int, word: int, caller: int, seed: int, x: Any, out: Any, fmt_code: int, block: int,
             key: int | None, avg: bool, timeout: float) -> int:
        """status (see the module comment of native/gc_channel.c)"""
    def parity(self) -> int:
        """The slot (0 or 1) the next call writes."""
    def close(self) -> None:
        """Refuse every later call (status 4)."""
