"""Adaptive-precision rows: per super-block tiers of 8, 4 or 2 bits within a fixed bit budget.

An adaptive row (``Format.adaptive`` set, ``scale_kind == "adaptive"``) cuts a message into
*super-blocks* of ``block`` values (default 256; a multiple of 128) and those into *frames* of
``AdaptiveSpec.frame`` super-blocks (the last frame and the last super-block may be partial;
a partial super-block is encoded as if zero-padded to ``block`` values). Inside each frame the
super-blocks are ranked by their amax (the largest ``|x|``, compared on the float32 bit patterns:
NaN above Inf above every finite value; ties: the lower index first) and the top ``k8`` go at
8 bits, the next ``k4`` at 4 bits, the rest at 2 bits. ``k8`` and ``k4`` depend only on the
frame's super-block count and the row's budget (:meth:`AdaptiveSpec.tier_counts`), so every
message of ``count`` values has the same size, and each frame is encoded from its own values
alone: cutting a message at frame boundaries changes no byte.

Tiers (each super-block carries one float32 *super-scale*):

- T8 (choice 2): E4M3 elements, the e4m3 row's rule with the super-block as its block: scale
  ``amax / 448`` (1 when amax < 448 * 2**-126), elements ``round(clip(x * 448 / amax))``.
- T4 (choice 1; ``mid = "int4"``, both rows: INT4 elements -7..7, two's complement nibbles, the
  same rule with 7 for 6 and super-scale ``amax / (448 * 7)``) ``mid = "e2m1"``: NVFP4's rule
  with the super-block as its group: E2M1 elements, one E4M3 scale
  per 16 values, super-scale ``amax / 2688`` (1 for a tiny super-block, amax < 2**-100).
- T2 (choice 0): *INT2 midrise* elements, the odd integers {-3, -1, +1, +3} (code: bit 1 the
  sign, bit 0 set for magnitude 3), one E4M3 scale per 32 values, super-scale ``amax / 1344``
  (448 * 3); E4M3 scales rounded up as in NVFP4 so no element saturates. Rounding to nearest:
  magnitude 3 when ``|y| >= 2``, else 1 (there is no zero: a 2-bit tier's values are coarse and
  go only to the blocks with the least energy); stochastic rounding picks between the two
  neighbouring levels of -3, -1, 1, 3, unbiased on all of [-3, 3].

A non-finite super-block (amax NaN or Inf) is encoded with super-scale NaN and zero elements
and scales, whatever its tier: it decodes to NaN values (one bad value poisons its super-block).

Frame layout (bytes; ``n`` super-blocks, ``k8 + k4 + k2 = n``)::

    [choice bits: 2 per super-block, 4 per byte, super-block j at bits 2*(j%4) of byte j//4,
     padded to a multiple of 4 bytes] [n float32 super-scales, LE]
    [k8 T8 payloads: block E4M3 bytes]
    [k4 T4 payloads: block/2 packed E2M1 or INT4 bytes, block/16 E4M3 scale bytes]
    [k2 T2 payloads: block/4 packed INT2 bytes (value 4j+i in bits 2i of byte j), block/32 E4M3 scale bytes]

Within a tier the super-blocks go in index order. A message is its frames, back to back.

Budget: ``budget_mbits`` (thousandths of a bit per value). A frame of ``n`` super-blocks may take
``cap = floor(budget_mbits * n * block / 8000)`` bytes; every super-block first gets T2, then
``avail = cap - (T2 frame bytes)`` bytes buy upgrades: ``k8 = min(n, avail * share8_permille //
(1000 * (T8 - T2)))``, ``k4 = min(n - k8, (avail - k8 * (T8 - T2)) // (T4 - T2))``, with T8, T4, T2
the tiers' payload bytes per super-block. The frame bytes never exceed ``cap``. A budget below
the all-T2 cost of any frame the row can make is refused (ValueError).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["AdaptiveSpec", "TIER_T2", "TIER_T4", "TIER_T8", "BLOCK_MULTIPLE", "T2_MAX", "T2_GROUP",
           "T4_GROUP", "TOP_ELEMENTS", "T8_INT_GROUP", "T8_INT_MAX", "MID_ELEMENTS", "T4_INT_MAX"]

#: choice-bit codes
TIER_T2, TIER_T4, TIER_T8 = 0, 1, 2
#: an adaptive row's block (super-block) must be a multiple of this: every tier section stays
#: a whole number of 4-byte words
BLOCK_MULTIPLE = 128
#: values per E4M3 element scale of the 4-bit and 2-bit tiers
T4_GROUP, T2_GROUP = 16, 32
#: largest INT2 midrise element magnitude
T2_MAX = 3
#: the 8-bit tier's element: "e4m3" (one float32 scale per super-block) or "int8" (symmetric
#: integers -127..127, one E4M3 scale per T8_INT_GROUP values under the float32 super-scale)
TOP_ELEMENTS = ("e4m3", "int8")
T8_INT_GROUP = 32
T8_INT_MAX = 127
#: the 4-bit tier's element: "e2m1" (NVFP4's) or "int4" (symmetric integers -7..7, two's
#: complement nibbles); both under one E4M3 scale per T4_GROUP values and the float32 super-scale
MID_ELEMENTS = ("e2m1", "int4")
T4_INT_MAX = 7


@dataclass(frozen=True)
class AdaptiveSpec:
    """The parameters of an adaptive row.

    budget_mbits: the bit budget, thousandths of a bit per value, everything on the wire counted
    (elements, every scale, the choice bits, padding). frame: super-blocks per frame (the
    allocation unit). share8_permille: the share (per mille) of a frame's upgrade bytes spent on
    T8 super-blocks before the rest buys T4. top, mid: the 8-bit and 4-bit tiers' elements
    (TOP_ELEMENTS, MID_ELEMENTS).
    """

    budget_mbits: int
    frame: int = 64
    share8_permille: int = 1000
    top: str = "e4m3"
    mid: str = "e2m1"

    def __post_init__(self) -> None:
        if self.top not in TOP_ELEMENTS:
            raise ValueError(f"an adaptive row's 8-bit tier is one of {', '.join(TOP_ELEMENTS)}, got {self.top!r}")
        if self.mid not in MID_ELEMENTS:
            raise ValueError(f"an adaptive row's 4-bit tier is one of {', '.join(MID_ELEMENTS)}, got {self.mid!r}")
        if not 1 <= self.frame <= 1 << 16 or not 0 <= self.share8_permille <= 1000:
            raise ValueError(f"frame must be in [1, 65536] and share8_permille in [0, 1000], got {self.frame}, "
                             f"{self.share8_permille}")

    @property
    def budget(self) -> float:
        """The budget in bits per value."""
        return self.budget_mbits / 1000

    def tier_bytes(self, block: int) -> tuple[int, int, int]:
        """Payload bytes (elements and element scales, the super-scale left out) of one
        super-block of ``block`` values in T8, T4, T2."""
        t8 = block if self.top == "e4m3" else block + block // T8_INT_GROUP
        return t8, block // 2 + block // T4_GROUP, block // 4 + block // T2_GROUP

    @staticmethod
    def head_bytes(n: int) -> int:
        """Bytes of a frame's choice bits (padded to 4) and super-scales for ``n`` super-blocks."""
        return 4 * -(-n // 16) + 4 * n

    def check_block(self, block: int) -> None:
        """ValueError unless ``block`` fits the row: a multiple of BLOCK_MULTIPLE for which every
        frame the row can make (1 .. frame super-blocks) meets the budget with all of them at 2 bits."""
        if block % BLOCK_MULTIPLE:
            raise ValueError(f"an adaptive format's block must be a multiple of {BLOCK_MULTIPLE}, got {block}")
        n = np.arange(1, self.frame + 1, dtype=np.int64)
        floor = 4 * -(-n // 16) + 4 * n + n * self.tier_bytes(block)[2]
        if (self.budget_mbits * n * block // 8000 < floor).any():
            need = float((floor * 8 / (n * block)).max())
            raise ValueError(f"budget {self.budget:g} bits/value is below what an adaptive frame of blocks of {block} "
                             f"needs with every block at 2 bits ({need:.4f} bits/value)")

    def _cap(self, n: int, block: int) -> int:
        return self.budget_mbits * n * block // 8000

    def _floor_bytes(self, n: int, block: int) -> int:
        return self.head_bytes(n) + n * self.tier_bytes(block)[2]

    def tier_counts(self, n: int, block: int) -> tuple[int, int, int]:
        """(k8, k4, k2): super-blocks at 8, 4 and 2 bits in a frame of ``n`` super-blocks."""
        t8, t4, t2 = self.tier_bytes(block)
        avail = self._cap(n, block) - self._floor_bytes(n, block)
        if avail < 0:  # check_block refuses such rows; kept for direct callers
            raise ValueError(f"budget {self.budget:g} bits/value is too small for {n} super-blocks of {block}")
        k8 = min(n, avail * self.share8_permille // (1000 * (t8 - t2)))
        k4 = min(n - k8, (avail - k8 * (t8 - t2)) // (t4 - t2))
        return k8, k4, n - k8 - k4

    def frame_nbytes(self, n: int, block: int) -> int:
        """Bytes of a frame of ``n`` super-blocks."""
        k8, k4, k2 = self.tier_counts(n, block)
        t8, t4, t2 = self.tier_bytes(block)
        return self.head_bytes(n) + k8 * t8 + k4 * t4 + k2 * t2

    def message_nbytes(self, count: int, block: int) -> int:
        """Bytes of a message of ``count`` values."""
        nsb = -(-count // block)
        full, rest = divmod(nsb, self.frame)
        return full * self.frame_nbytes(self.frame, block) + (self.frame_nbytes(rest, block) if rest else 0)

    def max_message_nbytes(self, count: int, block: int) -> int:
        """The largest :meth:`message_nbytes` of any count up to ``count`` (a buffer that holds
        the message of any prefix: message bytes need not grow with every added super-block)."""
        nsb = np.arange(-(-count // block) + 1, dtype=np.int64)
        full, rest = np.divmod(nsb, self.frame)
        per = np.array([self.frame_nbytes(int(r), block) if r else 0 for r in range(min(self.frame, int(nsb[-1]) + 1))],
                       np.int64)
        return int((full * self.frame_nbytes(self.frame, block) + per[rest]).max())

    def bits_per_value(self, block: int) -> float:
        """Wire bits per value of a message of whole frames."""
        return self.frame_nbytes(self.frame, block) * 8 / (self.frame * block)
