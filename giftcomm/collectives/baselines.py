"""Baseline wires as live collectives: what peers run, to compare giftcomm's wire against.

Not giftcomm's method and never a default: ``baseline_allreduce(x, "e5m2/tensor-nccl", comm=...)``
runs one of giftcomm.reference.baselines.BASELINE_WIRES (its module doc states the definitions:
one scale per tensor agreed by a MAX allreduce, FP8 codes summed pairwise in fp16 and rounded
back to FP8 after every addition in NCCL's ring order; the ``-local`` wires decode with each
rank's own scale) over any giftcomm transport, with the same bytes as the reference simulation
:func:`~giftcomm.reference.baselines.simulate_baseline_allreduce`. Reference speed: NumPy
arithmetic, a ring of ``2 (P - 1)`` sendrecv hops of FP8 codes on the host, the scale through
the transport's control gather.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..reference.baselines import (
    BASELINE_WIRES,
    BaselineWire,
    baseline_wire,
    fp8_add,
    fp8_codes,
    local_scale,
    ring_bounds,
    simulate_baseline_allreduce,
)
from ..transport.base import wait_all

__all__ = ["BASELINE_WIRES", "BaselineWire", "baseline_allreduce", "baseline_sent_bytes", "simulate_baseline_allreduce"]

_TAG = 7351


def baseline_sent_bytes(wire: str | BaselineWire, n: int, p: int, rank: int) -> int:
    """Bytes of the messages :func:`baseline_allreduce` sends from ``rank`` of ``p`` for ``n``
    values: its ring passes every chunk but this rank's own in the reduce-scatter and every chunk
    but the next rank's in the allgather (``ring_bounds`` chunks, one FP8 code per value); 0 on
    one rank. The per-tensor scale goes through the transport's control gather, with the
    agreement's words, and is not counted (giftcomm.stats counts no control words)."""
    w = baseline_wire(wire)
    if p <= 1:
        return 0
    sizes = [hi - lo for lo, hi in ring_bounds(n, p)]
    return (2 * n - sizes[rank] - sizes[(rank + 1) % p]) * w.fmt.wire_dtype.itemsize


def _host(x: Any) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        if x.device.type != "cpu":
            raise TypeError("baseline_allreduce runs on host arrays (NumPy, CPU torch tensors)")
        return x.detach().numpy()
    return np.asarray(x)


def _hop(t: Any, send: np.ndarray, dest: int, nrecv: int, source: int) -> np.ndarray | None:
    """One ring hop: ``send`` to ``dest`` and ``nrecv`` bytes from ``source`` (the received
    bytes, None when nothing comes); an empty chunk (fewer values than ranks) is neither sent nor
    awaited, so both ends of a hop skip it alike."""
    reqs = []
    got = np.empty(nrecv, np.uint8) if nrecv else None
    if got is not None:
        reqs.append(t.irecv(got, source, _TAG))
    if send.size:
        reqs.append(t.isend(np.ascontiguousarray(send), dest, _TAG))
    wait_all(reqs)
    return got


def baseline_allreduce(x: Any, wire: str | BaselineWire = "e5m2/tensor-nccl", *, comm: Any = None, op: str = "sum",
                       geometry: Any = None, out: Any = None, own_error: bool = False) -> Any:
    """Allreduce ``x`` (NumPy array or CPU torch tensor, float32/64/16; read only) with a baseline
    wire; returns a NumPy array of x's shape and dtype (``out``, a NumPy array or CPU tensor of
    x's shape, is filled instead and returned as a NumPy view).

    comm: a giftcomm Transport, an mpi4py communicator or None (as :func:`giftcomm.allreduce`:
    MPI.COMM_WORLD, or torch's default group under torchrun). geometry: None or
    a Geometry: the values are mapped by ``geometry.forward`` before encoding and the decoded sum
    by ``geometry.inverse`` (the paper's GIFT on this wire). Collective; ranks must agree on the
    wire, element count, dtype, op and geometry fingerprint, else ValueError on every rank (also
    for non-finite input on any rank). The ``-local`` wires leave the ranks with different results
    by design (the artifact's defect). own_error: return ``(result, e)`` instead, ``e`` the float32
    (n,) error of this rank's own encoding in the geometry's coordinates, ``y - float32(q) s`` (what
    error feedback keeps: giftcomm.collectives.feedback.TransformedFeedback.record_error). Each call counts in
    giftcomm.stats under the wire's name (bytes_sent and algorithms; :func:`baseline_sent_bytes`)."""
    from .. import accounting
    from ..transport import resolve

    w = baseline_wire(wire)
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    t = resolve(comm)
    src = _host(x)
    flat = np.ascontiguousarray(src.reshape(-1), dtype=np.float32)
    if geometry is not None:
        flat = np.asarray(geometry.forward(flat), np.float32)
    finite = bool(np.all(np.isfinite(flat)))
    amax = local_scale(flat, w.fmt) if finite else 0.0
    fp = None if geometry is None else geometry.fingerprint()
    head = (w.name, int(flat.size), op, src.dtype.str, fp)
    p, rank = t.size, t.rank
    rows = t.allgather_object((head, finite, amax)) if p > 1 else [(head, finite, amax)]
    if any(h != rows[0][0] for h, _, _ in rows):
        raise ValueError("baseline_allreduce: the ranks disagree on (wire, count, op, dtype, geometry): "
                         + "; ".join(f"rank {r}: {h}" for r, (h, _, _) in enumerate(rows)))
    bad = [r for r, (_, ok, _) in enumerate(rows) if not ok]
    if bad:
        raise ValueError(f"baseline_allreduce ({w.name}): non-finite input values on rank(s) {bad}")
    scale = amax if w.local_scale else max(a for _, _, a in rows)
    scale = scale if scale > 0 else 1.0
    buf = fp8_codes(flat / np.float32(scale), w.fmt)
    err = flat - buf.astype(np.float32) * np.float32(scale) if own_error else None
    n = flat.size
    if p > 1:
        bounds = ring_bounds(n, p)
        raw = buf.view(np.uint8)
        right, left = (rank + 1) % p, (rank - 1) % p
        for k in range(p - 1):  # reduce-scatter: chunk c starts at rank c + 1, rank c adds last
            (slo, shi), (rlo, rhi) = bounds[(rank - k - 1) % p], bounds[(rank - k - 2) % p]
            got = _hop(t, raw[slo:shi], right, rhi - rlo, left)
            if got is not None:
                buf[rlo:rhi] = fp8_add(got.view(w.fmt.wire_dtype), buf[rlo:rhi], w.fmt)
        for k in range(p - 1):  # allgather of the FP8 sums, unchanged
            (slo, shi), (rlo, rhi) = bounds[(rank - k) % p], bounds[(rank - k - 1) % p]
            got = _hop(t, raw[slo:shi], right, rhi - rlo, left)
            if got is not None:
                raw[rlo:rhi] = got
    accounting.count(t, w.name, w.name, baseline_sent_bytes(w, n, p, rank))
    y = buf.astype(np.float32) * np.float32(scale)
    if geometry is not None:
        y = np.asarray(geometry.inverse(y), np.float32)
    if op == "avg":
        y = y / np.float32(p)
    result = y.astype(src.dtype).reshape(src.shape)
    if out is not None:
        dst = _host(out)
        if dst.shape != src.shape:
            raise ValueError(f"out must have x's shape {src.shape}, got {dst.shape}")
        dst[...] = result
        result = dst
    return (result, err) if own_error else result
