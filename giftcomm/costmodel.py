"""Alpha-beta-plus-codec cost model of each allreduce algorithm, and the ``auto`` choice.

Constants (seconds per message, seconds per byte per link class, codec values per second) come
from a small JSON file written by ``python -m giftcomm.perf calibrate``: the file named by the
environment variable GIFTCOMM_CALIBRATION, else $XDG_CACHE_HOME/giftcomm/calibration.json
(~/.cache/giftcomm/calibration.json when XDG_CACHE_HOME is unset), else the defaults below
(measured on a 2-core development VM over MPICH shared memory; a 10 Gbit/s network link for
"net"). A file that cannot be used -- unreadable, not a regular file, too large, not JSON, missing
fields, values that are not finite numbers within :data:`BOUNDS` -- gives one warning naming the
file and the reason, and the built-in defaults are used (never an exception: the file is read
while planning every ``algorithm="auto"`` call, on every rank).

Predictions assume a pipelined implementation: per phase, time = latency terms + max(wire time,
codec time), plus (1 - overlap) times the smaller of the two (docs/scaling.md has the formulas).
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import stat
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import config
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
    #: how far the pipelined phases hide the codec behind the wire (or the reverse): 1 = fully
    #: (time = max(wire, codec)), 0 = not at all (time = wire + codec, e.g. when one CPU core
    #: both copies the messages and runs the codec)
    overlap: float = 1.0
    #: network interfaces per node; 0 = one per rank (GPU nodes with a NIC per GPU). With fewer
    #: NICs than ranks, the phases in which every rank of a node sends across the network at
    #: once (direct's all-to-all, doubling, the hierarchical cross-node phase) share them.
    nics_per_node: int = 0
    source: str = "built-in defaults"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        """From a parsed calibration file; keys that are not fields (e.g. "measured") are ignored.
        ValueError naming the first bad entry when a field is missing, not a finite number or
        outside :data:`BOUNDS`."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        values: dict[str, object] = {}
        for name in ("shm", "net"):
            link = d.get(name)
            if not isinstance(link, dict):
                raise ValueError(f"{name!r} must be an object with 'alpha' and 'beta', got {_short(link)}")
            values[name] = LinkCost(alpha=_bounded(link, "alpha", name), beta=_bounded(link, "beta", name))
        for key in BOUNDS:
            if key in d and key not in ("alpha", "beta"):
                values[key] = _bounded(d, key)
        if "nics_per_node" in values:
            values["nics_per_node"] = int(values["nics_per_node"])  # type: ignore[call-overload]
        return cls(**values)  # type: ignore[arg-type]


BOUNDS: dict[str, tuple[float, float]] = {
    "alpha": (1e-9, 1.0),  # seconds per message
    "beta": (1e-14, 1e-3),  # seconds per byte: 1 kB/s .. 100 TB/s
    "encode_rate": (1e3, 1e14), "decode_rate": (1e3, 1e14), "fused_rate": (1e3, 1e14),
    "accumulate_rate": (1e3, 1e14),  # values per second
    "call_overhead": (0.0, 1.0), "step_overhead": (0.0, 1.0),  # seconds
    "overlap": (0.0, 1.0),
    "nics_per_node": (0, 4096),
}
"""The accepted range of every calibration value (inclusive); a file outside them is not used."""
MAX_FILE_BYTES = 1 << 20
"""A calibration file is a few hundred bytes (plus the raw measurements): larger ones are refused."""


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bounded(d: dict, key: str, parent: str = "") -> float:
    where = f"{parent}.{key}" if parent else key
    if key not in d:
        raise ValueError(f"{where} is missing")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where} must be a number, got {_short(v)}")
    lo, hi = BOUNDS[key]
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ValueError(f"{where} = {_short(v)} is outside [{lo:g}, {hi:g}]")
    if key == "nics_per_node" and v != int(v):
        raise ValueError(f"{where} must be a whole number, got {_short(v)}")
    return float(v)


def calibration_path() -> Path:
    """Where the calibration file is read from (and written to by the calibrate command)."""
    return Path(_calibration_file())


def _calibration_file() -> str:
    # plain strings: pathlib costs ~0.1 ms
    return (config.path("GIFTCOMM_CALIBRATION")
            or _default_calibration_file(os.environ.get("XDG_CACHE_HOME", ""), os.environ.get("HOME")))


@functools.lru_cache(maxsize=8)
def _default_calibration_file(xdg_cache: str, home: str | None) -> str:
    """giftcomm/calibration.json under $XDG_CACHE_HOME when it is an absolute path (the XDG base
    directory rule: relative values are ignored), else under ~/.cache (``home``: $HOME; the
    password entry's home when unset, as expanduser). Cached: expanduser costs ~10 us a call."""
    if xdg_cache and os.path.isabs(xdg_cache):
        return os.path.join(xdg_cache, "giftcomm", "calibration.json")
    return os.path.join(home or os.path.expanduser("~"), ".cache", "giftcomm", "calibration.json")


_cached: tuple[str, tuple, Calibration] | None = None
_BUILT_IN = Calibration()  # returned while no file exists; shared, so never modify what you get
log = logging.getLogger("giftcomm")


_RECHECK_S = 1.0  # "auto" asks on every call: stat the same file at most once a second
_last: tuple[str, float, Calibration] | None = None


def load_calibration() -> Calibration:
    """The calibration in force (re-read when the file changes, noticed within a second, or at
    once when the path changes or :func:`write_calibration` wrote it; the built-in defaults
    without one, or with one that cannot be used: then one warning naming the file and why).

    The object is shared by every caller: copy it (``build_calibration``) before changing it."""
    global _last
    path = _calibration_file()
    now = time.monotonic()
    if _last is not None and _last[0] == path and now - _last[1] < _RECHECK_S:
        return _last[2]
    cal = _load_calibration(path)
    _last = (path, now, cal)
    return cal


def _in_force() -> Calibration:
    """:func:`load_calibration` for the per-call path of ``auto`` (:func:`choose`): at most once a
    second; in between, the calibration it gave last, without reading the environment or the
    file (so a changed GIFTCOMM_CALIBRATION, like a changed file, is noticed within a second)."""
    last = _last
    if last is not None and time.monotonic() - last[1] < _RECHECK_S:
        return last[2]
    return load_calibration()


def forget_calibration() -> None:
    """Make the next :func:`load_calibration` look at the file now (after writing it, or after
    changing GIFTCOMM_CALIBRATION)."""
    global _last
    _last = None


def _load_calibration(path: str) -> Calibration:
    global _cached
    try:
        st = os.stat(path)
    except OSError:
        return _BUILT_IN
    key = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)
    if _cached is None or _cached[0] != path or _cached[1] != key:
        try:
            cal = _read_calibration(path, st)
            cal.source = path
        except Exception as exc:  # noqa: BLE001 - any bad file means: defaults, and say so once
            cal = _BUILT_IN
            msg = (f"giftcomm: ignoring the calibration file {path}: {exc}; the cost model uses its built-in "
                   f"constants (rewrite it with `python -m giftcomm.perf calibrate`, or point "
                   f"GIFTCOMM_CALIBRATION elsewhere)")
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        _cached = (path, key, cal)
    return _cached[2]


def _read_calibration(path: str, st: os.stat_result) -> Calibration:
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_size > MAX_FILE_BYTES:
        raise ValueError(f"{st.st_size} bytes, more than the {MAX_FILE_BYTES} a calibration file may have")
    with open(path, "rb") as fh:
        data = fh.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"more than {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    return Calibration.from_dict(doc)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a usable calibration value")


def write_calibration(path: str | os.PathLike, text: str) -> None:
    """Write a calibration file atomically: a temporary file in the same directory, flushed to
    disk, then renamed over ``path`` (a reader sees the old file or the new one, never a part)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".calibration.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        forget_calibration()
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@dataclass(frozen=True)
class Topology:
    """P ranks on ``nodes`` nodes of ``local_size`` ranks each (local_size 0: uneven nodes)."""

    ranks: int
    nodes: int
    local_size: int

    @classmethod
    def of(cls, nodes: Iterable[int]) -> Topology:
        """Rank r on node ``nodes[r]`` (any ids; local_size 0 when the nodes differ in size)."""
        sizes = list(Counter(int(v) for v in nodes).values())
        return cls(sum(sizes), len(sizes), sizes[0] if len(set(sizes)) == 1 else 0)


def _overlapped(cal: Calibration, wire: float, codec: float) -> float:
    """One pipelined phase: max(wire, codec) + (1 - overlap) * min(wire, codec)."""
    return max(wire, codec) + (1.0 - cal.overlap) * min(wire, codec)


def _nic_share(cal: Calibration, topo: Topology) -> float:
    """How many of a node's ranks share one NIC when all of them send across the network."""
    if cal.nics_per_node <= 0 or topo.nodes < 2 or topo.local_size <= 1:
        return 1.0
    return max(1.0, topo.local_size / cal.nics_per_node)


def predict(algorithm: str, n: int, topo: Topology, fmt: str, block: int = 256,
            cal: Calibration | None = None) -> float:
    """Predicted seconds for one allreduce of ``n`` values (float32 input) with this algorithm.

    ``call_overhead + steps * (alpha + step_overhead) + max(wire, codec) + (1 - overlap) *
    min(wire, codec)`` per pipelined phase;
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
    shared = LinkCost(link.alpha, link.beta * _nic_share(cal, topo))  # all ranks of a node send at once
    bpv = bytes_per_value(fmt, block)
    fused = cal.fused_rate if get_format(fmt).scaled else cal.fused_rate * 4
    step = link.alpha + cal.step_overhead
    if algorithm == "ring":
        wire = 2 * (p - 1) / p * n * bpv * link.beta
        codec = (p - 1) / p * n / fused + n / p / cal.encode_rate + n / cal.decode_rate
        return 2 * (p - 1) * step + _overlapped(cal, wire, codec)
    if algorithm == "direct":
        # all-to-all reduce-scatter (NICs shared), then the ring allgather (one stream per node)
        wire = (p - 1) / p * n * bpv * (shared.beta + link.beta)
        codec = n / cal.encode_rate + (p - 1) / p * n / cal.accumulate_rate + n / cal.decode_rate
        return 2 * (p - 1) * step + _overlapped(cal, wire, codec)
    if algorithm == "doubling":
        p2 = 1 << (p.bit_length() - 1)
        rounds = int(math.log2(p2)) + (2 if p2 != p else 0)
        return rounds * (step + n * bpv * shared.beta + n / cal.encode_rate + 2 * n / cal.decode_rate)
    if algorithm in ("hierarchical", "hierarchical_direct"):
        if topo.nodes < 2 or topo.local_size < 2:
            return math.inf
        loc, nn = topo.local_size, topo.nodes
        local = 2 * ((loc - 1) * (cal.shm.alpha + cal.step_overhead) + (loc - 1) / loc * n * 4 * cal.shm.beta)
        inner = "direct" if algorithm == "hierarchical_direct" else "ring"
        share = _nic_share(cal, topo)  # the L cross-node rings of a node run at once
        cross_cal = replace(cal, net=LinkCost(cal.net.alpha, cal.net.beta * share), nics_per_node=0)
        cross = _predict_messages(inner, math.ceil(n / loc), Topology(nn, nn, 1), fmt, block, cross_cal)
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


def error_growth(algorithm: str, topo: Topology) -> float:
    """Predicted squared relative error of the allreduce, in units of one quantization of one
    rank's values: relative L2 error ~ eps * sqrt(error_growth) for P independent contributions
    of equal scale (eps: the format's relative rounding error with block scaling).

    Each quantization of a partial sum of k contributions adds error variance ~ k (block scales
    follow the values), and the sum's variance is P, so the factor is
    (sum over quantizations of the partial sums' sizes) / P:

    - ring: hops quantize sums of 1, 2, .., P-1 ranks, then the owner's sum once: (P + 1) / 2;
    - direct: P-1 single contributions, then the sum: 2 - 1/P;
    - doubling (P2 = largest power of two <= P): every level of the exchange tree quantizes
      groups whose sizes add up to P, log2(P2) levels, plus the folded ranks and the final
      message: log2(P2) + 1 + (P - P2) / P;
    - hierarchical (fp32 inside nodes of L, ring across N nodes): (N + 1) / 2;
    - hierarchical_direct: 2 - 1/N.

    Checked against the simulation in perf/results/errors-study.md (docs/scaling.md)."""
    p = topo.ranks
    if p == 1:
        return 1.0
    if algorithm == "ring":
        return (p + 1) / 2
    if algorithm == "direct":
        return 2 - 1 / p
    if algorithm == "doubling":
        p2 = 1 << (p.bit_length() - 1)
        return math.log2(p2) + 1 + (p - p2) / p
    nodes = topo.nodes if topo.nodes >= 1 else p
    if algorithm == "hierarchical":
        return (nodes + 1) / 2
    if algorithm == "hierarchical_direct":
        return 2 - 1 / nodes
    raise ValueError(f"unknown algorithm {algorithm!r}")


_choices: dict[tuple, str] = {}  # choose() memo for the loaded calibration (key holds its id)
FIDELITY_SLACK = 1.10  # accept up to 10% more predicted time for fewer quantizations


def choose(n: int, topo: Topology, fmt: str, block: int = 256, cal: Calibration | None = None) -> str:
    """The ``auto`` algorithm: among those predicted within FIDELITY_SLACK of the fastest, the one
    with the smallest predicted error (:func:`error_growth`; ties: the faster)."""
    if cal is None:  # the calibration in force: remember the answers it gave
        cal = _in_force()
        key = (n, topo, fmt, block, id(cal))
        if key not in _choices:
            if len(_choices) > 4096:
                _choices.clear()
            _choices[key] = choose(n, topo, fmt, block, cal)
        return _choices[key]
    candidates = ["ring", "direct", "doubling"]
    if topo.nodes > 1 and topo.local_size > 1:
        candidates += ["hierarchical", "hierarchical_direct"]
    times = {a: predict(a, n, topo, fmt, block, cal) for a in candidates}
    best = min(times.values())
    near = [a for a in candidates if times[a] <= best * FIDELITY_SLACK]
    return min(near, key=lambda a: (round(error_growth(a, topo), 9), times[a]))
