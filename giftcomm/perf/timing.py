"""The one timing helper of every benchmark and study: warm-up calls, timed repeats (each of one
or more back-to-back calls, after an optional barrier), contenders timed in interleaved rounds,
and a statistic over the repeats; the answer is seconds per call.

    seconds, last = time_calls(fn, 20, warmup=2)                     # median of 20 timed calls
    seconds, _ = time_calls(fn, 7, calls=100, barrier=comm.Barrier)  # median of 7 means of 100
    a, b = time_rounds([fn_a, fn_b], 9, calls=400, barrier=comm.Barrier)

With ``comm`` (an mpi4py communicator) every repeat starts after ``comm.Barrier()`` and counts
as the slowest rank's time for it, so every rank returns the same number (collective: every rank
calls alike). With only ``barrier`` (any callable) each rank keeps its own times.

``clock`` measures one repeat: ``clock(run) -> (seconds, result of run())``; the default is the
host's ``time.perf_counter`` around ``run()``. A device timer (CUDA events, or the host clock up
to a device synchronize) is such a function (giftcomm.perf.device_bench).

This module imports nothing from giftcomm, so the worker that times an older giftcomm tree side
by side (giftcomm/perf/side_by_side_worker.py, ``python -m giftcomm.perf side-by-side``) loads
it from its own checkout by path.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

__all__ = ["STATS", "Clock", "wall_clock", "time_calls", "time_rounds", "load_average"]

T = TypeVar("T")

#: the statistic over repeats, by name: ``median`` (the default: robust to the rare long stall of
#: a shared machine), ``min`` (the least disturbed repeat) or ``mean``
STATS: dict[str, Callable[[Any], float]] = {
    "median": lambda ts: float(np.median(ts)),
    "min": lambda ts: float(np.min(ts)),
    "mean": lambda ts: float(np.mean(ts)),
}

#: runs one timed repeat and returns (seconds, its result)
Clock = Callable[[Callable[[], Any]], "tuple[float, Any]"]


def wall_clock(run: Callable[[], T]) -> tuple[float, T]:
    """Seconds of ``run()`` by the host's ``time.perf_counter``, and its result."""
    t0 = time.perf_counter()
    result = run()
    return time.perf_counter() - t0, result


def _check_stat(stat: str) -> Callable[[Any], float]:
    if stat not in STATS:
        raise ValueError(f"stat must be one of {sorted(STATS)}; got {stat!r}")
    return STATS[stat]


def _repeat(fn: Callable[[], T], calls: int) -> Callable[[], T]:
    """``calls`` back-to-back calls of ``fn``, returning the last result."""
    if calls == 1:
        return fn

    def run() -> T:
        result = fn()
        for _ in range(calls - 1):
            result = fn()
        return result
    return run


def _slowest(comm: Any, times: list[float]) -> np.ndarray:
    """Element-wise max over the ranks of ``comm`` (same length on every rank)."""
    from mpi4py import MPI  # lazily: local timings need no MPI

    arr = np.asarray(times, dtype=np.float64)
    out = np.empty_like(arr)
    comm.Allreduce(arr, out, op=MPI.MAX)
    return out


def time_calls(fn: Callable[[], T], iters: int, *, warmup: int = 1, calls: int = 1,
               barrier: Callable[[], object] | None = None, comm: Any = None, stat: str = "median",
               budget_s: float | None = None, min_iters: int | None = None,
               clock: Clock = wall_clock) -> tuple[float, T]:
    """Seconds per call of ``fn()`` (a statistic over timed repeats) and the last call's result.

    iters: timed repeats; each repeat is ``calls`` back-to-back calls (its time / calls counts).
    warmup: untimed calls first. barrier: called before every repeat, untimed. comm: an mpi4py
    communicator (its Barrier is the default ``barrier``; a repeat's time is the slowest rank's).
    budget_s: stop once the timed repeats add up to ``budget_s`` seconds and at least
    ``min_iters`` (default ``min(3, iters)``) ran; ``iters`` is then the most. With ``comm``
    the stop decision agrees on every rank. stat: a key of :data:`STATS`.
    """
    reduce = _check_stat(stat)
    iters, calls = max(int(iters), 1), max(int(calls), 1)
    least = min(3, iters) if min_iters is None else max(1, min(int(min_iters), iters))
    if barrier is None and comm is not None:
        barrier = comm.Barrier
    for _ in range(warmup):
        fn()
    run = _repeat(fn, calls)
    times: list[float] = []
    spent = 0.0
    while True:  # iters >= 1 repeats, fewer within budget_s
        if barrier is not None:
            barrier()
        dt, result = clock(run)
        dt /= calls
        if comm is not None and budget_s is not None:  # the stop decision must agree on every rank
            from mpi4py import MPI

            dt = comm.allreduce(dt, op=MPI.MAX)
        times.append(dt)
        spent += dt * calls
        if len(times) >= iters or (budget_s is not None and len(times) >= least and spent >= budget_s):
            break
    arr = _slowest(comm, times) if comm is not None and budget_s is None else np.asarray(times)
    return reduce(arr), result


def time_rounds(fns: Sequence[Callable[[], object]], rounds: int, *, calls: int = 1, warmup: int = 0,
                barrier: Callable[[], object] | None = None, comm: Any = None, stat: str = "median",
                clock: Clock = wall_clock) -> list[float]:
    """Seconds per call of each of ``fns``, timed in turns so that a busy moment of the machine
    falls on all of them: every round times each function once (``calls`` back-to-back calls after
    the barrier); then the statistic over the rounds, one number per function.

    warmup: untimed calls of each function first. barrier, comm, stat, clock: as in
    :func:`time_calls` (with ``comm`` each round's time is the slowest rank's)."""
    reduce = _check_stat(stat)
    rounds, calls = max(int(rounds), 1), max(int(calls), 1)
    if barrier is None and comm is not None:
        barrier = comm.Barrier
    for fn in fns:
        for _ in range(warmup):
            fn()
    runs = [_repeat(fn, calls) for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for run, got in zip(runs, times):
            if barrier is not None:
                barrier()
            got.append(clock(run)[0] / calls)
    return [reduce(_slowest(comm, t) if comm is not None else np.asarray(t)) for t in times]


def load_average() -> str:
    """The machine's 1-, 5- and 15-minute load averages as text ("2.01 1.53 0.98"), which every
    benchmark prints beside its figures; "unknown" where the OS keeps none."""
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"
