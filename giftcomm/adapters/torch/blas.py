"""BLAS threads of the adapters' estimator and eigendecomposition work, and a warning when the
ranks of a node would oversubscribe its cores.

Several ranks per node each running a BLAS with one thread per core make the factor products and
``eigh`` calls of KFAC fight over the cores (measured: 4 ranks on 2 cores, eigh ~100x slower).
:func:`blas_limit` caps the BLAS threads around that work (``threadpoolctl``, when installed;
otherwise it does nothing), and :func:`warn_oversubscription` warns once per process when
ranks x threads exceed the cores.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Iterator

__all__ = ["blas_limit", "warn_oversubscription", "local_world_size", "blas_threads"]

_WARNED = False


@contextlib.contextmanager
def blas_limit(threads: int | None) -> Iterator[None]:
    """Cap the BLAS libraries' threads (NumPy's OpenBLAS/MKL) at ``threads`` inside the block
    (threadpoolctl; a no-op without it or with ``threads`` None). The cap is process-wide while
    the block runs, as BLAS thread counts are."""
    if threads is None:
        yield
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=int(threads), user_api="blas"):
        yield


def blas_threads() -> int:
    """The largest thread count of the loaded BLAS libraries (threadpoolctl), or
    ``$OMP_NUM_THREADS`` / the core count when threadpoolctl is missing."""
    try:
        from threadpoolctl import threadpool_info

        counts = [int(i.get("num_threads", 1)) for i in threadpool_info() if i.get("user_api") == "blas"]
        if counts:
            return max(counts)
    except ImportError:
        pass
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() else (os.cpu_count() or 1)


def local_world_size() -> int:
    """Ranks on this node as the launcher says (torchrun's LOCAL_WORLD_SIZE, Open MPI's, MPICH's
    Hydra MPI_LOCALNRANKS), or 1."""
    for key in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 1


def warn_oversubscription(ranks: int | None = None) -> bool:
    """Warn (once per process; RuntimeWarning) when ranks on this node x threads per rank
    (torch's intra-op threads, the BLAS threads) exceed the cores. Returns whether it would."""
    global _WARNED
    import torch

    ranks = local_world_size() if ranks is None else int(ranks)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(torch.get_num_threads(), blas_threads())
    over = ranks > 1 and ranks * threads > cores
    if over and not _WARNED:
        _WARNED = True
        warnings.warn(f"giftcomm: {ranks} ranks x {threads} threads each on {cores} cores oversubscribe this node "
                      f"(steps and KFAC eigendecompositions slow down many times); set OMP_NUM_THREADS="
                      f"{max(1, cores // ranks)} (torchrun sets 1 unless told otherwise)", RuntimeWarning, stacklevel=3)
    return over
