"""How a flat buffer of ``n`` elements is split into ``P`` rank chunks (the shard layout).

The buffer's scale blocks (``ceil(n / block)`` of them) are dealt out in order, as evenly as
possible: rank ``r`` gets ``nb // P`` blocks, plus one more if ``r < nb % P``. Chunk ``r`` is
the element range of its blocks, clipped to ``n``. So every chunk starts on a block boundary,
the blocks of a chunk's wire messages are the buffer's own blocks, and rank ``r``'s
reduce_scatter shard is chunk ``r``. Chunks may be empty (fewer blocks than ranks).

That is the "blocks" layout. The "equal" layout (:func:`equal_bounds`) is FSDP's, ZeRO's and
Megatron's: ``n`` a multiple of ``P`` and rank ``r`` gets ``[r*n/P, (r+1)*n/P)``, whatever the
block; a chunk's wire messages then count their blocks from the chunk's own start
(docs/wire-format.md, "Shard layouts"). :func:`shard_bounds` gives either by name.
"""
from __future__ import annotations

import functools

import numpy as np

from ..formats import num_blocks


def chunk_bounds(n: int, nranks: int, block: int) -> np.ndarray:
    """Element offsets of the ``nranks`` chunks: int64 array of ``nranks + 1`` increasing values."""
    return shared_chunk_bounds(n, nranks, block).copy()


@functools.lru_cache(maxsize=1024)
def shared_chunk_bounds(n: int, nranks: int, block: int) -> np.ndarray:
    """:func:`chunk_bounds`, cached for the collectives' hot path: shared, so read-only."""
    nb = num_blocks(n, block)
    base, extra = divmod(nb, nranks)
    blocks = np.full(nranks, base, np.int64)
    blocks[:extra] += 1
    bounds = np.zeros(nranks + 1, np.int64)
    np.cumsum(blocks * block, out=bounds[1:])
    np.minimum(bounds, n, out=bounds)
    bounds.flags.writeable = False
    return bounds


LAYOUTS = ("blocks", "equal")
"""The shard layouts of reduce_scatter, by name (the index is the layout's code in agreements)."""


def equal_bounds(n: int, nranks: int) -> np.ndarray:
    """The "equal" layout: ``nranks + 1`` int64 offsets ``r * n / nranks``; ValueError unless
    ``nranks`` divides ``n``."""
    if n % nranks:
        raise ValueError(f"layout='equal' needs the element count to be a multiple of the number of ranks: "
                         f"{n} elements on {nranks} ranks (pad the buffer to {-(-n // nranks) * nranks})")
    return np.arange(nranks + 1, dtype=np.int64) * (n // nranks)


def shard_bounds(n: int, nranks: int, block: int, layout: str = "blocks") -> np.ndarray:
    """The chunk offsets of ``layout`` ("blocks": :func:`chunk_bounds`, shared and read-only;
    "equal": :func:`equal_bounds`) for ``n`` elements on ``nranks`` ranks; ValueError for an
    unknown layout or an "equal" one that does not divide."""
    if layout == "blocks":
        return shared_chunk_bounds(n, nranks, block)
    if layout == "equal":
        return _shared_equal_bounds(n, nranks)
    raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}; got {layout!r}")


@functools.lru_cache(maxsize=1024)
def _shared_equal_bounds(n: int, nranks: int) -> np.ndarray:
    bounds = equal_bounds(n, nranks)
    bounds.flags.writeable = False
    return bounds


def accumulation_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype in which sums are formed: float64 for float64 input, float32 for all else."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)
