"""reduce_scatter's shard layout in one call: the bounds of every rank's shard, and the field
that makes every rank agree on the layout (giftcomm.algorithms.partition has the layouts themselves).

A reduce-scatter's agreed signature is the collectives' (call.FIELDS) plus ``layout``, so that
ranks asking for different layouts raise on every rank instead of exchanging mismatched chunks.
"""
from __future__ import annotations

import numpy as np

from ..algorithms import BY_CODE, Algorithm
from ..algorithms.partition import LAYOUTS, shard_bounds
from .call import MATCH, Call

__all__ = ["LAYOUTS", "SCATTER_FIELDS", "SCATTER_MATCH", "plan_layout", "chosen_algorithm", "unknown_layout"]

SCATTER_MATCH: tuple[str, ...] = (*MATCH, "layout")
SCATTER_FIELDS: tuple[str, ...] = (*SCATTER_MATCH, "chosen")
"""reduce_scatter's agreed signature: every field must match but "chosen" (rank 0's wins)."""


def plan_layout(call: Call, nranks: int, layout: str) -> np.ndarray:
    """The shard offsets (int64, ``nranks + 1``; shared, read-only) of ``layout`` for this call,
    recorded in its signature; ValueError for an "equal" layout that does not divide."""
    bounds = shard_bounds(int(call.arr.size), nranks, call.block, layout)
    call.sig["layout"] = LAYOUTS.index(layout)
    return bounds


def chosen_algorithm(table: np.ndarray) -> Algorithm:
    """The algorithm rank 0 chose, from a reduce-scatter's agreed table."""
    return BY_CODE[int(table[0, SCATTER_FIELDS.index("chosen")])]


def unknown_layout(layout: object) -> ValueError:
    return ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}; got {layout!r}")
