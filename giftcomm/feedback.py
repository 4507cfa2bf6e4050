"""Error feedback: each rank keeps what its own quantization lost and adds it back next step.

Compressed-gradient training below 16 bits keeps the local quantization residual and adds it to
the next step's gradient (PowerSGD, 1-bit Adam, ZeRO++'s LoCo). giftcomm's residual is the error
of *this rank's own encoding of its contribution*, computed locally with the exact wire the call
uses (same format, block, rounding key and element offsets), so it costs one local encode and
decode per step and no communication:

- ``direct``, ``oneshot`` (and the shared-window direct path): each contribution is quantized
  exactly once, by its rank, before it is summed in fp32: the residual is that whole error, and
  with feedback the running sum of the results telescopes to the running sum of the gradients
  (minus the last step's residuals);
- ``doubling``: the first round's message is the rank's own values (the residual covers it); later
  rounds re-encode partial sums shared by a group of ranks and are not compensated;
- ``ring``: a rank's own values are quantized alone only in the first hop of the reduce-scatter;
  every later hop re-encodes a partial sum (in-ring requantization) and the allgather phase
  re-encodes the owner's total. Those errors are introduced by one rank each but belong to the
  sum, not to a contribution, and are not compensated: the residual here is the error the rank's
  contribution would have had on its own, which removes the contribution's share of the bias
  and leaves the requantization noise;
- ``hierarchical``: nodes reduce in fp32 first; the residual is the error of the rank's values
  encoded alone, as for the ring (an upper estimate of its share).

With a geometry (GIFT) quantization happens in the transformed coordinates ``y = T(g)``; the
residual is mapped back with the geometry's inverse (linear, the same on every rank) and kept in
gradient coordinates, so it stays valid when the geometry is rebuilt between steps.

Residuals are float32 (the accumulation precision), one per key (the caller's bucket index), and
are dropped when the key's size changes (a new bucket layout). :meth:`ErrorFeedback.state_dict`
holds them for checkpoints.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from ._xp import array_module
from .collectives.wire import Wire
from .formats import Format, get_format
from .partition import shared_chunk_bounds

__all__ = ["ErrorFeedback", "own_quantization_error", "direct_pieces", "check_feedback_format"]


def check_feedback_format(fmt: str | Format, owner: str = "") -> Format:
    """``fmt`` as a Format when error feedback applies to it; ValueError for a pass-through
    format (bf16, fp16 and fp32 have no block quantization whose error could be fed back)."""
    f = get_format(fmt)
    if not f.scaled:
        raise ValueError(f"{owner + ': ' if owner else ''}error_feedback=True needs a block-scaled format; "
                         f"{f.name} is a pass-through format (nothing to feed back)")
    return f


def own_quantization_error(values: Any, fmt: Format, block: int, seed: int | None, rank: int,
                           pieces: Sequence[tuple[int, int]] | None = None) -> Any:
    """``values - decode(encode(values))`` (float32, values' backend) for what ``rank`` encodes of
    its own flat contribution in a call with ``seed`` (None: round to nearest), with the same key
    and element offsets as the collectives. pieces: the element ranges [lo, hi) the algorithm
    encodes as separate messages (None: the whole buffer as one, as ``oneshot`` does; ``direct``:
    :func:`direct_pieces`); elements outside every piece are summed unquantized and get error 0.
    For ``oneshot`` and ``direct``'s reduce-scatter it is exactly what this rank's contribution
    lost. values: 1-D contiguous float32."""
    xp = array_module(values)
    wire = Wire.of(fmt, block, xp, seed, party=rank)
    if pieces is None:
        pieces = [(0, int(values.size))]
    err = xp.zeros(values.size, np.float32)
    for lo, hi in pieces:
        part = values[lo:hi]
        message = xp.empty(wire.nbytes(part.size), np.uint8)
        wire.encode(part, message, lo)
        with np.errstate(invalid="ignore", over="ignore"):
            err[lo:hi] = part - wire.decode(message, part.size)
    return err


def direct_pieces(n: int, p: int, rank: int, block: int) -> list[tuple[int, int]]:
    """The messages ``rank`` encodes of its own values in ``direct``'s reduce-scatter over ``p``
    ranks: every chunk of ``giftcomm.chunk_bounds(n, p, block)`` but its own, which its owner
    sums in full precision."""
    bounds = shared_chunk_bounds(n, p, block)
    return [(int(bounds[c]), int(bounds[c + 1])) for c in range(p) if c != rank]


class ErrorFeedback:
    """The residuals of one rank, by key (e.g. bucket index).

    Use per step and key: ``g = fb.compensate(key, g)`` (adds the stored residual in place into
    ``g``, a float32 1-D array the caller owns, and returns it), reduce ``g``, then
    ``fb.record(key, g, fmt, block, seed, rank, geometry)`` before ``g`` is overwritten by the
    result. A residual whose size no longer matches its key's array is dropped (bucket layout
    changed). Non-finite residuals are never kept: a block that held NaN/Inf gets no feedback.
    """

    def __init__(self) -> None:
        self.residuals: dict[Hashable, Any] = {}

    def compensate(self, key: Hashable, values: Any) -> Any:
        """``values += residual[key]`` in place (float32 1-D ``values``); returns ``values``."""
        res = self.residuals.get(key)
        if res is None:
            return values
        if res.size != values.size:
            del self.residuals[key]  # a new layout: the old residual describes other values
            return values
        xp = array_module(values)
        if array_module(res) is not xp:  # restored from a checkpoint onto the other kind of memory
            res = self.residuals[key] = xp.asarray(res.get() if hasattr(res, "get") else res)
        values += res.astype(values.dtype, copy=False)
        return values

    def record(self, key: Hashable, sent: Any, fmt: Format, block: int, seed: int | None, rank: int,
               geometry: Any = None, pieces: Sequence[tuple[int, int]] | None = None) -> None:
        """Keep the own-encoding error of ``sent`` (the compensated values this rank is about to
        reduce; 1-D, any float dtype) under ``key``. With ``geometry`` (not identity) the error is
        taken in its coordinates and mapped back with ``geometry.inverse``. ``pieces``: see
        :func:`own_quantization_error`."""
        xp = array_module(sent)
        flat = xp.ascontiguousarray(sent.reshape(-1), dtype=np.float32)
        if geometry is not None and not getattr(geometry, "is_identity", False):
            y = xp.ascontiguousarray(xp.asarray(geometry.forward(flat), dtype=np.float32))
            err = xp.ascontiguousarray(xp.asarray(geometry.inverse(own_quantization_error(y, fmt, block, seed, rank, pieces)),
                                                  dtype=np.float32))
        else:
            err = own_quantization_error(flat, fmt, block, seed, rank, pieces)
        err[~xp.isfinite(err)] = 0
        self.residuals[key] = err

    def reset(self) -> None:
        """Forget every residual."""
        self.residuals.clear()

    def state_dict(self) -> dict[str, Any]:
        """The residuals as host float32 arrays (for checkpoints)."""
        out = {}
        for k, v in self.residuals.items():
            out[k] = np.array(v.get() if hasattr(v, "get") else v, dtype=np.float32, copy=True)
        return {"residuals": out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s residuals (host arrays; each moves to the device at its
        first :meth:`compensate` with a device array)."""
        self.residuals = {k: np.array(v, dtype=np.float32, copy=True) for k, v in state["residuals"].items()}
