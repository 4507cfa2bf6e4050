"""What every perf tool (and every study in studies/) shares: the timing helper (re-exported from
giftcomm.perf.timing), one progress line, the node layout as the cost model sees it, and the
command-line options that mean the same thing in every tool.

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
from typing import Any, TextIO

import numpy as np

from ..cost.model import Topology
from .timing import STATS, time_calls, time_rounds

__all__ = ["time_calls", "time_rounds", "Progress", "topology", "split_list", "parent_parser", "add_fmt", "add_json",
           "add_out", "STATS"]


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
