"""Error feedback: each rank keeps what its own quantization lost and adds it back next step.

Compressed-gradient training below 16 bits keeps the local quantization residual and adds it to
the next step's gradient (PowerSGD, 1-bit Adam, ZeRO++'s LoCo). giftcomm's residual is the error
of *this rank's own encoding of its contribution*, computed locally with the exact wire the call
uses (same format, block, rounding key and element offsets), so it costs one local encode and
decode per step and no communication:

- ``oneshot``: each contribution is quantized exactly once, by its rank, before it is summed in
  fp32: the residual is that whole error, and with feedback the running sum of the results
  telescopes to the running sum of the gradients (minus the last step's residuals);
- ``direct``: the rank encodes every chunk but its own (the owner sums that in fp32): exact for
  the reduce-scatter; an allreduce's allgather re-encodes the owner's total (not compensated);
- ``ring``: a rank's own values are encoded alone only in hop 0 (chunk ``rank - 1``); later hops
  re-encode partial sums and the allgather the owner's total: not compensated;
- ``doubling``: round 0's message is the rank's own vector (P a power of two, stage 1; a
  folded-in rank's, stage 0); later rounds carry partial sums: not compensated;
- ``hierarchical``: nodes reduce in fp32 first: nothing of a rank's own is encoded alone.

:func:`own_pieces` reads it from the algorithm table (giftcomm.algorithms, each row's
``own_pieces``); docs/method.md ("Error feedback") says the same.

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

from .._xp import array_module
from ..algorithms import row
from ..algorithms.partition import shared_chunk_bounds
from ..formats import Format, get_format
from .wire import Wire

__all__ = ["ErrorFeedback", "TransformedFeedback",
           "own_quantization_error", "own_pieces", "direct_pieces", "feedback_view", "reordered", "check_feedback_format"]


def feedback_view(buffer: Any) -> Any:
    """``buffer`` as an array the residual arithmetic works on, sharing its memory: a NumPy or
    CuPy array as is; a torch tensor as a NumPy view (CPU) or a CuPy view (CUDA,
    ``__cuda_array_interface__``). float32, float64 or float16 (TypeError for bfloat16 torch
    tensors, which NumPy cannot view)."""
    if type(buffer).__module__.startswith("torch"):
        if buffer.device.type == "cuda":
            import cupy

            return cupy.asarray(buffer.detach())
        return buffer.detach().numpy()
    return buffer


def check_feedback_format(fmt: str | Format, owner: str = "") -> Format:
    """``fmt`` as a Format when error feedback applies to it; ValueError for a pass-through
    format (bf16, fp16 and fp32 have no block quantization whose error could be fed back)."""
    f = get_format(fmt)
    if not f.scaled:
        raise ValueError(f"{owner + ': ' if owner else ''}error_feedback=True needs a block-scaled format; "
                         f"{f.name} is a pass-through format (nothing to feed back)")
    return f


def own_quantization_error(values: Any, fmt: Format, block: int, seed: int | None, rank: int,
                           pieces: Sequence[tuple[int, int]] | None = None, stage: int = 0) -> Any:
    """``values - decode(encode(values))`` (float32, values' backend) for what ``rank`` encodes of
    its own flat contribution in a call with ``seed`` (None: round to nearest), with the same key
    and element offsets as the collectives. pieces: the element ranges [lo, hi) the algorithm
    encodes as separate messages (None: the whole buffer as one, as ``oneshot`` does; ``direct``:
    :func:`direct_pieces`); elements outside every piece are summed unquantized and get error 0.
    For ``oneshot`` and ``direct``'s reduce-scatter it is exactly what this rank's contribution
    lost. stage: the wire's stage key (stochastic rounding; see :func:`own_pieces`).
    values: 1-D contiguous float32."""
    xp = array_module(values)
    wire = Wire.of(fmt, block, xp, seed, party=rank).at(stage=stage)
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


def own_pieces(algorithm: str, n: int, p: int, rank: int, block: int,
               bounds: Any = None) -> tuple[list[tuple[int, int]], int]:
    """(pieces, stage): the element ranges [lo, hi) of its own (n,) values that ``rank`` encodes
    alone, unsummed, in a call of ``algorithm`` over ``p`` ranks, and the wire stage they are
    keyed with. bounds: the call's chunk bounds (a reduce-scatter's agreed ones); None: an
    allreduce's, ``shared_chunk_bounds(n, p, block)``.

    The algorithm table's row says (giftcomm.algorithms, ``Algorithm.own_pieces``): oneshot
    (and P = 1): everything. direct / reduce-scatter direct: every chunk but its own. ring:
    chunk ``rank - 1`` (hop 0; later hops carry partial sums). doubling: everything when P is a
    power of two (round 0, stage 1) or the rank folds in (stage 0); nothing for a rank that
    first adds a folded rank's values. hierarchical, hierarchical_direct: nothing (the node
    sums in fp32 before anything is encoded). native: nothing (the transport's own allreduce
    encodes nothing; with a 16-bit pass-through format its rounding is not compensated).
    ValueError for an unknown algorithm."""
    if bounds is None:
        bounds = shared_chunk_bounds(n, p, block)
    return row(algorithm).own_pieces(n, p, rank, lambda c: (int(bounds[c]), int(bounds[c + 1])))


def reordered(residual: Any, old: Any, new: Any) -> Any:
    """``residual`` rearranged from layout ``old`` to layout ``new`` when both are tuples of
    ``(name, numel)`` pieces (back to back) with unique names, the same set in another order;
    else None (the residual cannot be carried over)."""
    def pieces(sig: Any) -> dict | None:
        if not isinstance(sig, tuple) or not all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str)
                                                 and isinstance(e[1], int) for e in sig):
            return None
        names = [e[0] for e in sig]
        return dict(sig) if len(set(names)) == len(names) else None

    a, b = pieces(old), pieces(new)
    if a is None or b is None or a != b:
        return None
    xp = array_module(residual)
    starts, off = {}, 0
    for name, n in old:
        starts[name] = off
        off += n
    return xp.concatenate([residual[starts[name] : starts[name] + n] for name, n in new]) if new else residual


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
        self.signatures: dict[Hashable, Any] = {}  # what the caller says a key's layout is (None: its size)

    def compensate(self, key: Hashable, values: Any, signature: Any = None) -> Any:
        """``values += residual[key]`` in place (1-D float ``values``); returns ``values``.
        signature: a picklable description of the key's layout (e.g. its parameter shapes); a
        residual recorded under another signature or size is dropped (a new bucket layout)."""
        res = self.residuals.get(key)
        if res is None:
            return values
        old = self.signatures.get(key)
        if old != signature and res.size == values.size:
            moved = reordered(res, old, signature)
            if moved is not None:  # the same named pieces in another order (DDP's bucket rebuild)
                res = self.residuals[key] = moved
                self.signatures[key] = old = signature
        if res.size != values.size or old != signature:
            self.residuals.pop(key, None)  # a new layout: the old residual describes other values
            self.signatures.pop(key, None)
            return values
        xp = array_module(values)
        if array_module(res) is not xp:  # restored from a checkpoint onto the other kind of memory
            res = self.residuals[key] = xp.asarray(res.get() if hasattr(res, "get") else res)
        values += res.astype(values.dtype, copy=False)
        return values

    def record(self, key: Hashable, sent: Any, fmt: Format, block: int, seed: int | None, rank: int,
               geometry: Any = None, pieces: Sequence[tuple[int, int]] | None = None, stage: int = 0) -> None:
        """Keep the own-encoding error of ``sent`` (the compensated values this rank is about to
        reduce; 1-D, any float dtype) under ``key``. With ``geometry`` (not identity) the error is
        taken in its coordinates and mapped back with ``geometry.inverse``. ``pieces``: see
        :func:`own_quantization_error`."""
        xp = array_module(sent)
        flat = xp.ascontiguousarray(sent.reshape(-1), dtype=np.float32)
        if geometry is not None and not getattr(geometry, "is_identity", False):
            y = xp.ascontiguousarray(xp.asarray(geometry.forward(flat), dtype=np.float32))
            err_y = own_quantization_error(y, fmt, block, seed, rank, pieces, stage)
            err = xp.ascontiguousarray(xp.asarray(geometry.inverse(err_y), dtype=np.float32))
        else:
            err = own_quantization_error(flat, fmt, block, seed, rank, pieces, stage)
        err[~xp.isfinite(err)] = 0
        self.residuals[key] = err

    def around(self, key: Hashable, buffer: Any, reduce: Any, transport: Any, fmt: Format, block: int,
               seed: int | None, geometry: Any = None, signature: Any = None, in_place: bool = True) -> str:
        """The whole step for one buffer: add the residual (into ``buffer`` itself when
        ``in_place``, which suits a buffer the result overwrites; else into a float32 copy, so the
        caller's buffer is left alone), run ``reduce(values)`` (the collective of the compensated
        values: ``buffer``'s view or the copy; NumPy/CuPy), then :meth:`record_call` with
        ``transport()`` (the Transport the call ran on). buffer: a 1-D NumPy/CuPy array or torch
        tensor. Returns the algorithm the call ran."""
        values = feedback_view(buffer)
        if not in_place:
            values = values.astype(np.float32, copy=True)
        self.compensate(key, values, signature)
        sent = values.astype(np.float32, copy=True) if in_place else values
        reduce(values)
        name = self.record_call(key, sent, transport(), fmt, block, seed, geometry)
        self.signatures[key] = signature
        return name

    def record_call(self, key: Hashable, sent: Any, t: Any, fmt: Format, block: int, seed: int | None,
                    geometry: Any = None) -> str:
        """:meth:`record` for the call just made on transport ``t`` with ``sent`` (this rank's
        compensated values, as passed to it): the pieces follow the algorithm that call really
        ran (:func:`giftcomm.collectives.engine.last_algorithm`). Returns that algorithm's name."""
        from .engine import last_algorithm

        last = last_algorithm(t)
        if last is None:
            raise RuntimeError("ErrorFeedback.record_call: no collective has run on this transport")
        name, bounds = last
        pieces, stage = own_pieces(name, int(sent.size), t.size, t.rank, block, bounds)
        self.record(key, sent, fmt, block, seed, t.rank, geometry, pieces, stage)
        return name

    def reset(self) -> None:
        """Forget every residual."""
        self.residuals.clear()
        self.signatures.clear()

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals as host float32 arrays, and their layout signatures (for a
        per-rank checkpoint: residuals differ by rank by nature)."""
        out = {}
        for k, v in self.residuals.items():
            out[k] = np.array(v.get() if hasattr(v, "get") else v, dtype=np.float32, copy=True)
        return {"residuals": out, "signatures": dict(self.signatures)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s residuals (host arrays; each moves to the device at its
        first :meth:`compensate` with a device array)."""
        self.residuals = {k: np.array(v, dtype=np.float32, copy=True) for k, v in state["residuals"].items()}
        self.signatures = dict(state.get("signatures") or {})


class TransformedFeedback:
    """Error feedback kept in the geometry's coordinates (the GIFT paper's), by key.

    The residual of key k is ``e = y - Q(y)``, ``y = T(g)`` the compensated values in the
    coordinates of the geometry ``T`` the call used (this rank's own-encoding error, the same
    pieces as :class:`ErrorFeedback`), stored with ``T``. The next call adds it back in those
    coordinates: :meth:`compensate` adds ``T.inverse(e)`` to the ordinary-coordinate buffer, so
    that the call's own ``T.forward`` quantizes ``T(g) + e``.

    When the geometry changes (a factor refresh: another fingerprint) the residual is
    re-expressed, ``e_new = T_new(T_old^-1(e_old))`` -- for the paper's input-side map
    ``e_new = e_old L_old^T L_new^-T`` -- which keeps the residual in ordinary coordinates,
    ``T_new^-1(e_new) = T_old^-1(e_old)``, exactly up to float32 rounding. ``reexpress=False``
    keeps ``e_old`` as it is in the new coordinates (the paper's artifact; what it costs is
    ``|T_new^-1(e_old) - T_old^-1(e_old)|``). ``euclidean=False`` keeps no residual on the
    geometry's identity segments, and none at all under an identity geometry or None (the
    artifact's Euclidean branch has none); the default keeps it
    there too, which is then exactly :class:`ErrorFeedback`'s. A geometry of None is the identity.
    Residuals are float32; a key's residual is dropped when its size or signature changes.
    """

    def __init__(self, reexpress: bool = True, euclidean: bool = True) -> None:
        if not isinstance(reexpress, bool) or not isinstance(euclidean, bool):
            raise TypeError("TransformedFeedback: reexpress and euclidean must be bools")
        self.reexpress, self.euclidean = reexpress, euclidean
        self.residuals: dict[Hashable, Any] = {}  # key -> residual in the coordinates of geometries[key]
        self.geometries: dict[Hashable, Any] = {}
        self.signatures: dict[Hashable, Any] = {}
        self.refreshes = 0  # residuals carried into a new geometry (re-expressed or not)

    @staticmethod
    def _fp(geometry: Any) -> Any:
        return None if geometry is None or getattr(geometry, "is_identity", False) else geometry.fingerprint()

    @staticmethod
    def _map(geometry: Any, v: Any, inverse: bool) -> Any:
        if geometry is None or getattr(geometry, "is_identity", False):
            return v
        xp = array_module(v)
        return xp.ascontiguousarray(xp.asarray(geometry.inverse(v) if inverse else geometry.forward(v), dtype=np.float32))

    def residual(self, key: Hashable, geometry: Any = None) -> Any:
        """The residual of ``key`` in ``geometry``'s coordinates (carried over as the next
        :meth:`compensate` with that geometry would: re-expressed or not); None if none."""
        e = self.residuals.get(key)
        if e is None:
            return None
        old = self.geometries.get(key)
        if self._fp(old) != self._fp(geometry):
            if self.reexpress:
                e = self._map(geometry, self._map(old, e, inverse=True), inverse=False)
            self.residuals[key], self.geometries[key] = e, geometry
            self.refreshes += 1
        return e

    def _live_residual(self, key: Hashable, size: int, geometry: Any, signature: Any) -> Any:
        """The key's residual carried into ``geometry`` (:meth:`residual`), or None when none is
        kept or the kept one is of another size or signature (then it is dropped)."""
        e = self.residuals.get(key)
        if e is None:
            return None
        if e.size != size or self.signatures.get(key) != signature:
            self.residuals.pop(key, None)
            self.geometries.pop(key, None)
            self.signatures.pop(key, None)
            return None
        return self.residual(key, geometry)

    def compensate(self, key: Hashable, values: Any, geometry: Any = None, signature: Any = None) -> Any:
        """``values += T^-1(e)`` in place (1-D float ordinary-coordinate ``values``), ``e`` the
        key's residual carried into ``geometry`` (:meth:`residual`); returns ``values``."""
        e = self._live_residual(key, values.size, geometry, signature)
        if e is None:
            return values
        back = self._map(geometry, e, inverse=True)
        values += back.astype(values.dtype, copy=False)
        return values

    def compensate_mapped(self, key: Hashable, mapped: Any, geometry: Any = None, signature: Any = None) -> Any:
        """``mapped += e`` in place, ``mapped`` (1-D float32) already in ``geometry``'s coordinates
        (the caller ran ``T.forward``) and ``e`` the key's residual carried into them
        (:meth:`residual`: re-expressed at a refresh); no inverse map. Returns ``mapped``. A
        residual of another size or signature is dropped, as in :meth:`compensate`."""
        e = self._live_residual(key, mapped.size, geometry, signature)
        if e is None:
            return mapped
        mapped += e.astype(mapped.dtype, copy=False)
        return mapped

    def record(self, key: Hashable, sent: Any, fmt: Format, block: int, seed: int | None, rank: int,
               geometry: Any = None, pieces: Sequence[tuple[int, int]] | None = None, stage: int = 0,
               signature: Any = None) -> None:
        """Keep the own-encoding error of ``T(sent)`` (``sent``: this rank's compensated values in
        ordinary coordinates, 1-D) in ``T``'s coordinates. pieces, stage: as for
        :func:`own_quantization_error`."""
        xp = array_module(sent)
        flat = xp.ascontiguousarray(sent.reshape(-1), dtype=np.float32)
        y = self._map(geometry, flat, inverse=False)
        self.record_error(key, own_quantization_error(y, fmt, block, seed, rank, pieces, stage), geometry, signature)

    def record_error(self, key: Hashable, err: Any, geometry: Any = None, signature: Any = None) -> None:
        """Keep ``err`` (1-D float32, already in ``geometry``'s coordinates: e.g. the own-encoding
        error a baseline wire returns) as the key's residual."""
        xp = array_module(err)
        e = xp.array(err, dtype=np.float32, copy=True).reshape(-1)
        e[~xp.isfinite(e)] = 0
        if not self.euclidean:
            if geometry is None or getattr(geometry, "is_identity", False):  # nothing transformed: no residual
                for kept in (self.residuals, self.geometries, self.signatures):
                    kept.pop(key, None)
                return
            for t in geometry.transforms:
                if t.is_identity:
                    e[t.segment.offset : t.segment.stop] = 0
        self.residuals[key], self.geometries[key], self.signatures[key] = e, geometry, signature

    def around(self, key: Hashable, buffer: Any, reduce: Any, transport: Any, fmt: Format, block: int,
               seed: int | None, geometry: Any = None, signature: Any = None, in_place: bool = True) -> str:
        """As :meth:`ErrorFeedback.around` (same arguments), with the residual in ``geometry``'s
        coordinates. Returns the algorithm the call ran."""
        from .engine import last_algorithm

        values = feedback_view(buffer)
        if not in_place:
            values = values.astype(np.float32, copy=True)
        self.compensate(key, values, geometry, signature)
        sent = values.astype(np.float32, copy=True) if in_place else values
        reduce(values)
        t = transport()
        last = last_algorithm(t)
        if last is None:
            raise RuntimeError("TransformedFeedback.around: no collective has run on this transport")
        name, bounds = last
        pieces, stage = own_pieces(name, int(sent.size), t.size, t.rank, block, bounds)
        self.record(key, sent, fmt, block, seed, t.rank, geometry, pieces, stage, signature)
        return name

    def reset(self) -> None:
        """Forget every residual."""
        self.residuals.clear()
        self.geometries.clear()
        self.signatures.clear()

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals (host float32, in their geometries' coordinates), the geometries
        they are in, and the layout signatures (a per-rank checkpoint)."""
        res = {k: np.array(v.get() if hasattr(v, "get") else v, dtype=np.float32, copy=True)
               for k, v in self.residuals.items()}
        return {"residuals": res, "geometries": dict(self.geometries), "signatures": dict(self.signatures),
                "reexpress": self.reexpress, "euclidean": self.euclidean}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.residuals = {k: np.array(v, dtype=np.float32, copy=True) for k, v in state["residuals"].items()}
        self.geometries = dict(state.get("geometries") or {})
        self.signatures = dict(state.get("signatures") or {})
        self.reexpress = bool(state.get("reexpress", self.reexpress))
        self.euclidean = bool(state.get("euclidean", self.euclidean))
