"""Alpha-beta-plus-codec cost model of each allreduce algorithm, and the ``auto`` choice.

Constants (seconds per message, seconds per byte per link class, codec values per second) come
from a small JSON file written by ``python -m giftcomm.perf calibrate``: the file named by the
environment variable GIFTCOMM_CALIBRATION, else ~/.cache/giftcomm/calibration.json, else the
defaults below (measured on a 2-core development VM over MPICH shared memory; a 10 Gbit/s
network link for "net").

Predictions assume a pipelined implementation: per phase, time = latency terms + max(wire time,
codec time).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .formats import bytes_per_value, get_format


@dataclass
class LinkCost:
    """alpha: seconds per message; beta: seconds per byte (1 / bandwidth)."""

    alpha: float
    beta: float


@dataclass
class Calibration:
    """Measured constants. Codec rates are values per second on one core."""

    shm: LinkCost = field(default_factory=lambda: LinkCost(alpha=20e-6, beta=1 / 3.0e9))
    net: LinkCost = field(default_factory=lambda: LinkCost(alpha=60e-6, beta=1 / 1.15e9))
    encode_rate: float = 1.5e9
    decode_rate: float = 2.0e9
    fused_rate: float = 1.0e9
    accumulate_rate: float = 1.5e9
    #: seconds per call spent outside the messages (argument agreement, planning, finishing)
    call_overhead: float = 0.0
    #: seconds per algorithm step (ring hop, doubling round) of software work besides alpha
    step_overhead: float = 0.0
    source: str = "built-in defaults"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        """From a parsed calibration file; keys that are not fields (e.g. "measured") are ignored."""
        known = {f for f in cls.__dataclass_fields__} - {"shm", "net"}
        return cls(shm=LinkCost(**d["shm"]), net=LinkCost(**d["net"]),
                   **{k: v for k, v in d.items() if k in known})


def calibration_path() -> Path:
    """Where the calibration file is read from (and written to by the calibrate command)."""
    env = os.environ.get("GIFTCOMM_CALIBRATION")
    return Path(env) if env else Path.home() / ".cache" / "giftcomm" / "calibration.json"


_cached: tuple[Path, float, Calibration] | None = None


def load_calibration() -> Calibration:
    """The calibration in force (re-read when the file changes)."""
    global _cached
    path = calibration_path()
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return Calibration()
    if _cached is None or _cached[0] != path or _cached[1] != mtime:
        cal = Calibration.from_dict(json.loads(path.read_text()))
        cal.source = str(path)
        _cached = (path, mtime, cal)
    return _cached[2]


@dataclass(frozen=True)
class Topology:
    """P ranks on ``nodes`` nodes of ``local_size`` ranks each (local_size 0: uneven nodes)."""

    ranks: int
    nodes: int
    local_size: int


def _codec_rate(cal: Calibration, fmt: str) -> float:
    return cal.fused_rate if get_format(fmt).scaled else cal.fused_rate * 4


def predict(algorithm: str, n: int, topo: Topology, fmt: str, block: int = 256,
            cal: Calibration | None = None) -> float:
    """Predicted seconds for one allreduce of ``n`` values (float32 input) with this algorithm.

    ``call_overhead + steps * (alpha + step_overhead) + max(wire time, codec time)`` per phase;
    the formulas are written out in docs/scaling.md. ``inf`` for a hierarchical algorithm on a
    topology without at least 2 nodes of at least 2 ranks."""
    cal = cal or load_calibration()
    t = _predict_messages(algorithm, n, topo, fmt, block, cal)
    return t if math.isinf(t) else cal.call_overhead + t


def _predict_messages(algorithm: str, n: int, topo: Topology, fmt: str, block: int, cal: Calibration) -> float:
    """predict() without the per-call overhead."""
    p = topo.ranks
    if p == 1:
        return n / cal.encode_rate + n / cal.decode_rate
    link = cal.net if topo.nodes > 1 else cal.shm
    bpv = bytes_per_value(fmt, block)
    fused = _codec_rate(cal, fmt)
    step = link.alpha + cal.step_overhead
    if algorithm == "ring":
        wire = 2 * (p - 1) / p * n * bpv * link.beta
        codec = (p - 1) / p * n / fused + n / p / cal.encode_rate + n / cal.decode_rate
        return 2 * (p - 1) * step + max(wire, codec)
    if algorithm == "direct":
        wire = 2 * (p - 1) / p * n * bpv * link.beta
        codec = n / cal.encode_rate + (p - 1) / p * n / cal.accumulate_rate + n / cal.decode_rate
        return 2 * (p - 1) * step + max(wire, codec)
    if algorithm == "doubling":
        p2 = 1 << (p.bit_length() - 1)
        rounds = int(math.log2(p2)) + (2 if p2 != p else 0)
        return rounds * (step + n * bpv * link.beta + n / cal.encode_rate + 2 * n / cal.decode_rate)
    if algorithm in ("hierarchical", "hierarchical_direct"):
        if topo.nodes < 2 or topo.local_size < 2:
            return math.inf
        loc, nn = topo.local_size, topo.nodes
        local = 2 * ((loc - 1) * (cal.shm.alpha + cal.step_overhead) + (loc - 1) / loc * n * 4 * cal.shm.beta)
        inner = "direct" if algorithm == "hierarchical_direct" else "ring"
        cross = _predict_messages(inner, math.ceil(n / loc), Topology(nn, nn, 1), fmt, block, cal)
        return local + cross
    raise ValueError(f"unknown algorithm {algorithm!r}")


def quantizations(algorithm: str, topo: Topology) -> int:
    """How many times a value is (re)quantized on its way, at most: the error-growth driver."""
    p = topo.ranks
    if algorithm == "ring":
        return p
    if algorithm in ("direct", "hierarchical_direct"):
        return 2
    if algorithm == "hierarchical":
        return topo.nodes
    p2 = 1 << (p.bit_length() - 1)
    return int(math.log2(p2)) + 2


FIDELITY_SLACK = 1.10  # accept up to 10% more predicted time for fewer quantizations


def choose(n: int, topo: Topology, fmt: str, block: int = 256, cal: Calibration | None = None) -> str:
    """The ``auto`` algorithm: among those predicted within FIDELITY_SLACK of the fastest, the one
    that quantizes each value the fewest times (ties: the faster)."""
    candidates = ["ring", "direct", "doubling"]
    if topo.nodes > 1 and topo.local_size > 1:
        candidates += ["hierarchical", "hierarchical_direct"]
    times = {a: predict(a, n, topo, fmt, block, cal) for a in candidates}
    best = min(times.values())
    near = [a for a in candidates if times[a] <= best * FIDELITY_SLACK]
    return min(near, key=lambda a: (quantizations(a, topo), times[a]))
