"""What the cost model knows of the machine: the measured constants (:class:`Calibration`, one
:class:`LinkCost` per link class, :data:`BOUNDS` for checking a calibration file) and the rank
layout (:class:`Topology`), plus the two helpers every algorithm's cost formula shares.

giftcomm.cost.calibration reads and writes the calibration file; giftcomm.cost.model predicts with the
algorithm table (giftcomm.algorithms), whose formulas take these records.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LinkCost", "Calibration", "BUILT_IN", "BOUNDS", "Topology", "overlapped", "nic_share"]


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
    #: the share of a network link's bandwidth an all-to-all phase gets (direct's reduce-scatter,
    #: oneshot's exchange across nodes: every rank sends to and receives from P-1 peers at once),
    #: against one stream per link (the ring); 1 = the same. Not measured by calibrate (kept from
    #: the calibration in force); not applied on one node
    alltoall_efficiency: float = 1.0
    #: seconds per call of the transport's own allreduce (``algorithm="native"``) besides its
    #: bytes: its latency and its software (MPI_Allreduce or torch's all_reduce of a few values)
    native_alpha: float = 40e-6
    #: seconds per byte that the transport's own allreduce spends besides moving its bytes over
    #: the link (its reduction and copies), per byte of the (P-1)/P share a rank reduces
    native_beta: float = 0.25e-9
    #: ``native_beta`` for the 16-bit kinds (bf16, fp16): MPICH has no 16-bit sum, so over MPI
    #: giftcomm's operation adds them in Python (the default: this machine's MPICH, measured);
    #: NCCL's and gloo's own bf16 sums are calibrated lower
    native_half_beta: float = 8e-9
    source: str = "built-in defaults"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        """From a parsed calibration file; keys that are not fields (e.g. "measured") are ignored,
        and optional fields a file lacks (those of :data:`BOUNDS` but the links', e.g. the
        native path's, which older files do not have) keep their defaults.
        ValueError naming the first bad entry when a field is missing, not a finite number or
        outside :data:`BOUNDS`."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        values: dict[str, Any] = {}  # the keywords of Calibration(...)
        for name in ("shm", "net"):
            link = d.get(name)
            if not isinstance(link, dict):
                raise ValueError(f"{name!r} must be an object with 'alpha' and 'beta', got {_short(link)}")
            values[name] = LinkCost(alpha=_bounded(link, "alpha", name), beta=_bounded(link, "beta", name))
        for key in BOUNDS:
            if key in d and key not in ("alpha", "beta"):
                values[key] = _bounded(d, key)
        if "nics_per_node" in values:
            values["nics_per_node"] = int(values["nics_per_node"])
        return cls(**values)


BUILT_IN = Calibration(
    shm=LinkCost(alpha=1.1e-6, beta=1 / 14.3e9),
    encode_rate=4.2e9, decode_rate=5.0e9, fused_rate=2.9e9, accumulate_rate=5.85e9,
    call_overhead=14.5e-6, step_overhead=15.5e-6, overlap=0.0,
    native_alpha=8.2e-6, native_beta=0.38e-9, native_half_beta=3.7e-9, alltoall_efficiency=0.75,
    source="built-in defaults",
)
"""The calibration used when there is no calibration file: ``python -m giftcomm.perf calibrate
--stat min`` at P = 2 on the 2-core development VM (MPICH 5 over shared memory, AVX-512 codec),
rounded (perf/results/calibration-shm-p2-builtin.json); ``net`` keeps the field default (a
10 Gbit/s link); ``alltoall_efficiency`` 0.75: on the 1 Gbit/s netbed at P = 4 the direct
algorithm's wire rate was 0.86x the ring's (perf/results/netbed-allreduce-1gbit-p4.txt), which
this value gives. The field defaults of :class:`Calibration` are what a file lacking a field gets."""

BOUNDS: dict[str, tuple[float, float]] = {
    "alpha": (1e-9, 1.0),  # seconds per message
    "beta": (1e-14, 1e-3),  # seconds per byte: 1 kB/s .. 100 TB/s
    "encode_rate": (1e3, 1e14), "decode_rate": (1e3, 1e14), "fused_rate": (1e3, 1e14),
    "accumulate_rate": (1e3, 1e14),  # values per second
    "call_overhead": (0.0, 1.0), "step_overhead": (0.0, 1.0),  # seconds
    "overlap": (0.0, 1.0),
    "nics_per_node": (0, 4096),
    "alltoall_efficiency": (0.01, 1.0),
    "native_alpha": (0.0, 1.0),  # seconds per call
    "native_beta": (0.0, 1e-3), "native_half_beta": (0.0, 1e-3),  # seconds per byte
}
"""The accepted range of every calibration value (inclusive); a file outside them is not used."""


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


def overlapped(cal: Calibration, wire: float, codec: float) -> float:
    """One pipelined phase: max(wire, codec) + (1 - overlap) * min(wire, codec)."""
    return max(wire, codec) + (1.0 - cal.overlap) * min(wire, codec)


def nic_share(cal: Calibration, topo: Topology) -> float:
    """How many of a node's ranks share one NIC when all of them send across the network."""
    if cal.nics_per_node <= 0 or topo.nodes < 2 or topo.local_size <= 1:
        return 1.0
    return max(1.0, topo.local_size / cal.nics_per_node)
