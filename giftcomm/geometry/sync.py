"""Making every rank hold the same factor spectra (collective over any giftcomm transport: MPI,
torch.distributed, NCCL, the loopback; an mpi4py communicator is wrapped in its MPI transport).

Two modes (docs/method.md reports which is cheaper as measured):

- ``"allreduce"``: every factor is summed over ranks (``Transport.sum_float64``: MPI_Allreduce
  on MPI), then every rank eigendecomposes every factor. The spectra agree when the sum is
  bit-identical on all ranks (it is in MPICH and Open MPI for SUM on doubles, and in the default
  rank-order sum of other transports) and eigh is deterministic; a BLAKE2b digest of all spectra
  is compared with one allgather, and if any rank differs every rank takes rank 0's spectra
  (counted in ``SyncReport.repaired``).
- ``"broadcast"``: factor j is summed onto its owner rank (``Transport.reduce_float64``; owners
  balance the ``d^3`` eigh work: largest factor first, each to the least-loaded rank), the owner
  eigendecomposes it, and ``Transport.broadcast_float64`` sends the eigenvalues and eigenvectors
  to all. The eigendecompositions are spread over the ranks, and every rank receives the same
  bytes.

Factors are averaged over the ranks that have fed at least one batch for that segment.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..transport.base import Transport
from .spectral import Spectrum

__all__ = ["SyncReport", "sync_spectra", "as_transport", "MODES"]

MODES = ("allreduce", "broadcast")


@dataclass
class SyncReport:
    """What one sync did. seconds: wall time (total, comm part, eigh part); bytes: float64 bytes
    this rank passed to the transport as send buffers; repaired: factors replaced by rank 0's."""

    mode: str
    seconds: float
    comm_seconds: float
    eigh_seconds: float
    bytes: int
    factors: int
    repaired: int = 0


def _digest(spectra: list[Spectrum | None]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for s in spectra:
        if s is None:
            h.update(b"none")
            continue
        h.update(s.values.tobytes())
        h.update(np.float64(s.scale).tobytes())
        h.update(b"diag" if s.vectors is None else s.vectors.tobytes())
    return h.digest()


def owners(sizes: list[int], nranks: int) -> list[int]:
    """Owner rank of each factor: largest first onto the least-loaded rank (load = sum d^3).
    Deterministic, so every rank computes the same assignment."""
    load = [0.0] * nranks
    out = [0] * len(sizes)
    for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        r = min(range(nranks), key=lambda r: (load[r], r))
        out[j] = r
        load[r] += float(sizes[j]) ** 3
    return out


def as_transport(comm: Any) -> Transport | None:
    """``comm`` as a giftcomm transport: a Transport as is, an mpi4py communicator wrapped in its
    cached MPI transport, None as None (this process alone)."""
    if comm is None or isinstance(comm, Transport):
        return comm
    from ..transport import resolve

    return resolve(comm)


def sync_spectra(comm: Any, mats: list[np.ndarray], counts: list[int], mode: str = "broadcast") -> tuple[list[Spectrum | None], SyncReport]:
    """Collective over ``comm`` (a giftcomm Transport, an mpi4py communicator, or None for this
    process alone). mats: this rank's factor matrices (float64 (d, d)), the same list of sizes on
    every rank; counts: batches each rank fed per factor. Returns (list of Spectrum or None for
    factors no rank fed, SyncReport), identical on every rank."""
    if mode not in MODES:
        raise ValueError(f"sync mode must be one of {MODES}, got {mode!r}")
    t0 = time.perf_counter()
    t_comm = t_eigh = 0.0
    nbytes = 0
    t = as_transport(comm)
    if t is None or t.size == 1:
        te = time.perf_counter()
        spectra: list[Spectrum | None] = [Spectrum.from_matrix(m) if c > 0 else None for m, c in zip(mats, counts)]
        t_eigh = time.perf_counter() - te
        return spectra, SyncReport(mode, time.perf_counter() - t0, 0.0, t_eigh, 0, len(mats))

    size, rank = t.size, t.rank
    tc = time.perf_counter()
    nfed = t.sum_float64(np.asarray([1.0 if c > 0 else 0.0 for c in counts])).astype(np.int64)
    t_comm += time.perf_counter() - tc
    spectra = [None] * len(mats)
    repaired = 0

    if mode == "allreduce":
        sums: list[np.ndarray | None] = []
        tc = time.perf_counter()
        for m, n in zip(mats, nfed):
            if n == 0:
                sums.append(None)
                continue
            sums.append(t.sum_float64(m))
            nbytes += m.nbytes
        t_comm += time.perf_counter() - tc
        te = time.perf_counter()
        spectra = [None if s is None else Spectrum.from_matrix(s / n) for s, n in zip(sums, nfed)]
        t_eigh += time.perf_counter() - te
        tc = time.perf_counter()
        digests = t.allgather_object(_digest(spectra))
        if any(d != digests[0] for d in digests):
            spectra = t.broadcast_object(spectra if rank == 0 else None, root=0)
            repaired = sum(s is not None for s in spectra)
        t_comm += time.perf_counter() - tc
    else:
        owned: dict[int, np.ndarray] = {}
        own = owners([m.shape[0] if n else 0 for m, n in zip(mats, nfed)], size)
        tc = time.perf_counter()
        for j, (m, n) in enumerate(zip(mats, nfed)):
            if n == 0:
                continue
            total = t.reduce_float64(m, own[j])
            nbytes += m.nbytes
            if rank == own[j]:
                assert total is not None  # reduce_float64 returns the sum on the root
                owned[j] = total
        t_comm += time.perf_counter() - tc
        te = time.perf_counter()
        mine = {j: Spectrum.from_matrix(buf / nfed[j]) for j, buf in owned.items()}
        t_eigh += time.perf_counter() - te
        tc = time.perf_counter()
        for j, (m, n) in enumerate(zip(mats, nfed)):
            if n == 0:
                continue
            owner = own[j]
            d = m.shape[0]
            head = np.empty(d + 1, np.float64)
            vecs = np.empty((d, d), np.float64)
            if rank == owner:
                s = mine[j]
                assert s.vectors is not None  # from_matrix always has eigenvectors
                head[:d], head[d] = s.values, s.scale
                vecs[...] = s.vectors
                nbytes += head.nbytes + vecs.nbytes
            t.broadcast_float64(head, owner)
            t.broadcast_float64(vecs, owner)
            spectra[j] = mine[j] if rank == owner else Spectrum(head[:d].copy(), vecs, float(head[d]))
        t_comm += time.perf_counter() - tc
    report = SyncReport(mode, time.perf_counter() - t0, t_comm, t_eigh, nbytes, len(mats), repaired)
    return spectra, report
