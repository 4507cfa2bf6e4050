"""What every perf tool (and every study in studies/) shares: one timing helper, one progress
line, the node layout as the cost model sees it, and the command-line options that mean the
same thing in every tool.

One spelling per idea across the tools:

==================  =================================================================
``--fmt A,B``       wire formats (e4m3, e5m2, bf16, fp16, fp32), comma-separated
``--json FILE``     machine-readable results
``--out FILE``      the human-readable report (markdown or text); a plot goes beside it
                    (same name, ``.png``) unless the tool has its own ``--png``
``--seed N``        the random inputs
``--no-progress``   no progress line (there is none anyway unless stderr is a terminal)
==================  =================================================================
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO, TypeVar

import numpy as np

from ..costmodel import Topology

__all__ = ["time_calls", "Progress", "topology", "split_list", "parent_parser", "add_fmt", "add_json",
           "add_out", "STATS"]

T = TypeVar("T")

STATS: dict[str, Callable[[Any], float]] = {
    "median": lambda ts: float(np.median(ts)),
    "min": lambda ts: float(np.min(ts)),
    "mean": lambda ts: float(np.mean(ts)),
}


def time_calls(fn: Callable[[], T], iters: int, *, warmup: int = 1, comm: Any = None, stat: str = "median",
               budget_s: float | None = None, min_iters: int | None = None) -> tuple[float, T]:
    """Seconds per call of ``fn()`` (a statistic over timed calls) and the last call's result.

    comm: an mpi4py communicator, or None for a local measurement. With a communicator every
    call starts after a barrier and a call's time is the slowest rank's time for it, so every
    rank returns the same number (collective: every rank must call this alike).
    iters: timed calls; with ``budget_s``, the most timed calls: timing stops once the calls
    add up to ``budget_s`` seconds and at least ``min_iters`` (default ``min(3, iters)``) ran.
    stat: ``median`` (the default: robust to the rare long stall of a shared machine), ``min``
    or ``mean``.
    """
    if stat not in STATS:
        raise ValueError(f"stat must be one of {sorted(STATS)}; got {stat!r}")
    iters = max(int(iters), 1)
    least = min(3, iters) if min_iters is None else max(1, min(int(min_iters), iters))
    result: T | None = None
    for _ in range(warmup):
        result = fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < iters:
        if comm is not None:
            comm.Barrier()
        t0 = time.perf_counter()
        result = fn()
        dt = time.perf_counter() - t0
        if comm is not None and budget_s is not None:  # the stop decision must agree on every rank
            from mpi4py import MPI

            dt = comm.allreduce(dt, op=MPI.MAX)
        times.append(dt)
        spent += dt
        if budget_s is not None and len(times) >= least and spent >= budget_s:
            break
    arr = np.asarray(times)
    if comm is not None and budget_s is None:
        from mpi4py import MPI

        slowest = np.empty_like(arr)
        comm.Allreduce(arr, slowest, op=MPI.MAX)
        arr = slowest
    return STATS[stat](arr), result  # type: ignore[return-value]


class Progress:
    """A one-line progress display on stderr for long tools.

    It draws only when enabled and the stream is a terminal: a log captured with ``2>&1`` or
    redirected to a file gets no carriage returns. Use as a context manager or call close()."""

    def __init__(self, total: int, label: str = "", enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(enabled and isatty is not None and isatty())
        self.total, self.label, self.done = max(int(total), 0), label, 0
        self.t0 = time.perf_counter()
        self._width = 0

    def update(self, info: str = "", advance: int = 1) -> None:
        """Count ``advance`` more steps done and redraw with ``info`` (what is running now)."""
        self.done += advance
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        text = f"{self.label}[{self.done}/{self.total}] {info} {elapsed:.0f}s<{eta:.0f}s".strip()
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = max(self._width, len(text))

    def clear(self) -> None:
        """Erase the line (before printing a result line to the same terminal)."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()

    def close(self) -> None:
        self.clear()
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def topology(transport: Any, local_size: int | None = None) -> tuple[np.ndarray, Topology]:
    """The node of every rank and the cost model's Topology for a giftcomm Transport.

    Nodes come from ``transport.node_ids()``, or with ``local_size`` K each run of K consecutive
    ranks is one node (as the API's ``local_size=`` does). Uneven nodes give local_size 0."""
    nodes = np.arange(transport.size) // int(local_size) if local_size else np.asarray(transport.node_ids())
    return nodes, Topology.of(nodes)


def split_list(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [s.strip() for s in text.split(",") if s.strip()]


def parent_parser(seed: int | None = 0, progress: bool = True) -> argparse.ArgumentParser:
    """Options every tool spells alike (for ``ArgumentParser(parents=[...])``)."""
    p = argparse.ArgumentParser(add_help=False)
    if seed is not None:
        p.add_argument("--seed", type=int, default=seed, help=f"seed of the random inputs (default {seed})")
    if progress:
        p.add_argument("--no-progress", action="store_true",
                       help="no progress line (drawn only when stderr is a terminal)")
    return p


def add_fmt(p: argparse.ArgumentParser, default: str, help: str = "comma-separated wire formats") -> None:
    p.add_argument("--fmt", default=default, help=f"{help} (default {default})")


def add_json(p: argparse.ArgumentParser, help: str = "also write the results as JSON here", **kw: Any) -> None:
    p.add_argument("--json", metavar="FILE", help=help, **kw)


def add_out(p: argparse.ArgumentParser, default: str | None = None,
            help: str = "also write the report here", **kw: Any) -> None:
    p.add_argument("--out", metavar="FILE", default=default,
                   help=help + (f" (default {default})" if default else ""), **kw)
