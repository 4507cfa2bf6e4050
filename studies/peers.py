"""Quality per bit: giftcomm's wire rows against the peers' reduction semantics on the same gradients.

``python -m studies peers --data FILE [--P 2,4,8,16,32,64] [--segments REGEX] [--step N]
[--algos ring,direct] [--rounding nearest] [--only NAMES] [--json F] [--png F] [--out F]``

Every *semantics* is one way an allreduce turns P ranks' float32 gradients into a sum: each row
of ``giftcomm.formats.FORMATS`` under giftcomm's reference simulation (``simulate_allreduce``,
ring and direct), and the peers' reductions in :data:`PEERS`, emulated here in NumPy from their
public descriptions (docs/fidelity.md, *Quality per bit*, states each source and assumption).
On the same inputs each semantics' sum is compared with the float64 sum ``S`` (metrics in
:func:`fidelity`) and put against the bits per value it sends (:func:`bits_per_value`), counted
from the messages the emulation builds (giftcomm's rows: ``giftcomm.accounting.sent_bytes``, the
library's own count), scales and headers included.

Inputs: a capture of ``studies.gradients`` (``load_case``); P ranks' inputs are the first P
per-rank gradients of one captured step (``--step``, default the last), cut to the parameters
matching ``--segments`` (default: the embedding and block 3, a representative tenth of the
model). A capture with fewer ranks than the largest P is refused (capture one with
``--ranks 64``).

NaN and Inf: every emulation refuses non-finite inputs with ValueError (the peers differ in how
they propagate them, and none of it is modelled); giftcomm's rows carry them as giftcomm does.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from giftcomm.accounting import sent_bytes
from giftcomm.algorithms.partition import chunk_bounds
from giftcomm.formats import FORMATS, ROUNDINGS, Format, get_format, message_nbytes, resolve_block
from giftcomm.perf.common import add_json, add_out, parent_parser, split_list
from giftcomm.perf.timing import load_average
from giftcomm.reference import simulate_allreduce
from giftcomm.reference.baselines import fp8_add, fp8_codes, ring_bounds, simulate_baseline_allreduce
from studies.cases import load_case, subset_case
from studies.fidelity import cosine, relative_l2

__all__ = ["Reduction", "Semantics", "PEERS", "giftcomm_semantics", "bits_per_value", "fidelity", "ADAM_EPS",
           "DEFAULT_SEGMENTS", "run", "main"]

ADAM_EPS = 1e-8
"""Adam's default epsilon, in the per-coordinate metric of :func:`fidelity`."""

DEFAULT_SEGMENTS = r"^embed\.|^blocks\.3\."
"""The parameters the study reduces by default: the tied embedding and one middle block."""

_E4M3 = get_format("e4m3")
_E5M2 = get_format("e5m2")
_BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class Reduction:
    """One simulated allreduce. total: (n,) rank 0's sum (float32 or float64; rank 0's, where
    ranks differ); wire_bytes: bytes every rank together sent (messages to other ranks only)."""

    total: np.ndarray
    wire_bytes: int


Tensors = Sequence[tuple[int, int]]
"""The parameter tensors of the flat buffer, as [lo, hi) value ranges (per-tensor semantics)."""


@dataclass(frozen=True)
class Semantics:
    """One reduction semantics.

    name: short label. family: "giftcomm" or the peer's name. source: the public description it
    follows. claimed_bits(n, P, tensors): the wire bits per value its definition sends
    (:func:`bits_per_value`'s normalisation). simulate(inputs, tensors, seed): the sum of P
    float32 vectors (same length n; the caller's arrays are not modified). assumptions: what
    the emulation had to choose where the source says nothing.
    """

    name: str
    family: str
    source: str
    claimed_bits: Callable[[int, int, Tensors], float]
    simulate: Callable[[Sequence[np.ndarray], Tensors, int], Reduction]
    assumptions: str = ""


def bits_per_value(wire_bytes: int, n: int, p: int) -> float:
    """Wire bits per value: ``8 * wire_bytes / (2 (P - 1) n)``, the bytes every rank sent against
    a bandwidth-optimal allreduce's volume (each rank sends ``2 (P-1)/P n`` values, half in a
    reduce-scatter, half in an allgather), so that a ring of a format sending b bits per value
    scores b whatever P. NaN for P < 2 or n = 0 (nothing is sent)."""
    if p < 2 or n == 0:
        return math.nan
    return 8.0 * wire_bytes / (2.0 * (p - 1) * n)


def fidelity(total: np.ndarray, exact: np.ndarray, p: int) -> dict[str, float]:
    """Error of a reduced sum ``total`` against the float64 sum ``exact`` (both (n,)) of P ranks.

    rel_l2 ``||total - exact|| / ||exact||``; vnmse its square; cosine; adam_median / adam_p90:
    median / 90th percentile over the coordinates of ``|t_i - s_i| / (|s_i| + eps)`` with
    ``t = total / P``, ``s = exact / P`` (the averages Adam is fed) and eps = :data:`ADAM_EPS`:
    the error of the first Adam step from fresh moments, ``m / (sqrt(v) + eps)``, when its
    second moment v is the exact one (``v = s**2``) and only the first moment m comes from the
    reduction. Non-finite totals give inf/NaN metrics."""
    t = np.asarray(total, np.float64).ravel()
    s = np.asarray(exact, np.float64).ravel()
    with np.errstate(invalid="ignore", over="ignore"):
        rel = relative_l2(t, s)
        adam = np.abs(t - s) / p / (np.abs(s) / p + ADAM_EPS)
        median = float(np.median(adam)) if adam.size else 0.0
        p90 = float(np.quantile(adam, 0.9)) if adam.size else 0.0
    finite = bool(np.all(np.isfinite(t)))
    return {"rel_l2": rel, "vnmse": rel * rel, "cosine": cosine(t, s) if finite else math.nan,
            "adam_median": median, "adam_p90": p90}


# ----------------------------------------------------------------------------- shared pieces

def _checked(inputs: Sequence[np.ndarray], name: str) -> list[np.ndarray]:
    """Float32 copies of the P flat inputs; ValueError for none, unequal sizes or non-finite values."""
    arrays = [np.asarray(x) for x in inputs]
    if not arrays:
        raise ValueError(f"{name}: need at least one rank's input")
    if any(a.size != arrays[0].size for a in arrays):
        raise ValueError(f"{name}: every rank's input must have the same number of values")
    flat = [a.reshape(-1).astype(np.float32) for a in arrays]
    if not all(bool(np.all(np.isfinite(x))) for x in flat):
        raise ValueError(f"{name}: non-finite input values (NaN/Inf): the emulations model finite gradients only")
    return flat


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    """x zero-padded to whole blocks, shape (ceil(n/block), block)."""
    nb = -(-x.size // block)
    pad = np.zeros(nb * block, x.dtype)
    pad[: x.size] = x
    return pad.reshape(nb, block)


def _scale_of(amax: np.ndarray, top: float) -> np.ndarray:
    """float32 ``amax / top`` per block, 1 where that is 0 (all-zero blocks)."""
    s = (amax.astype(np.float32) / np.float32(top)).astype(np.float32)
    return np.where(s > 0, s, np.float32(1)).astype(np.float32)


def _fp8_block_q(x: np.ndarray, fmt: Format, block: int) -> np.ndarray:
    """Encode-decode with one float32 scale ``amax / max`` per block of ``block`` values counted
    from x[0], elements rounded to nearest even (float32 in, float32 out)."""
    b = _blocks(x.astype(np.float32), block)
    s = _scale_of(np.abs(b).max(axis=1), fmt.max_value)
    codes = fp8_codes((b / s[:, None]).ravel(), fmt)
    return (codes.astype(np.float32).reshape(b.shape) * s[:, None]).ravel()[: x.size]


def _fp8_block_nbytes(count: int, block: int) -> int:
    """Bytes of count FP8 codes plus a float32 scale per block."""
    return count + 4 * -(-count // block)


def _int4_block_q(x: np.ndarray, block: int) -> np.ndarray:
    """Symmetric INT4 encode-decode: one float32 scale ``amax / 7`` per block counted from x[0],
    levels -7..7, rounded to nearest even (float32 in, float32 out)."""
    b = _blocks(x.astype(np.float32), block)
    s = _scale_of(np.abs(b).max(axis=1), 7.0)
    q = np.clip(np.rint(b / s[:, None]), -7, 7)
    return (q * s[:, None]).astype(np.float32).ravel()[: x.size]


def _int4_block_nbytes(count: int, block: int) -> int:
    """Bytes of count INT4 codes packed two per byte plus a float32 scale per block."""
    return (count + 1) // 2 + 4 * -(-count // block)


def _bf16_nearest(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(_BF16).astype(np.float32)


def _bf16_stochastic(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """float32 -> BF16 values (as float32) by stochastic rounding: 16 uniform random bits added to
    the low half of the float32 pattern, then truncated (rounds the magnitude up with probability
    equal to the dropped fraction); a finite value never becomes Inf (saturates at the BF16 max)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    noise = rng.integers(0, 1 << 16, size=bits.shape, dtype=np.uint32)
    out = ((bits + noise) & np.uint32(0xFFFF0000)).view(np.float32)
    top = np.float32(ml_dtypes.finfo(_BF16).max)
    return np.where(np.isinf(out), np.copysign(top, x), out).astype(np.float32)


# ------------------------------------------------------------------ the peers' emulations

def _nccl_fp8_raw(fmt: Format) -> Callable[[Sequence[np.ndarray], Tensors, int], Reduction]:
    def simulate(inputs: Sequence[np.ndarray], tensors: Tensors, seed: int) -> Reduction:
        flat = _checked(inputs, f"nccl-fp8-raw/{fmt.name}")
        p, n = len(flat), flat[0].size
        codes = [fp8_codes(x, fmt) for x in flat]  # the caller's cast: no scale
        total = np.empty(n, fmt.wire_dtype)
        for c, (lo, hi) in enumerate(ring_bounds(n, p)):
            acc = codes[(c + 1) % p][lo:hi]
            for k in range(2, p + 1):
                acc = fp8_add(acc, codes[(c + k) % p][lo:hi], fmt)
            total[lo:hi] = acc
        # each chunk's partial sum crosses P-1 links, then its result P-1 more (ring allgather)
        return Reduction(total.astype(np.float32), 2 * (p - 1) * n)

    return simulate


def _gift_artifact(wire: str) -> Callable[[Sequence[np.ndarray], Tensors, int], Reduction]:
    agreed = wire.endswith("-nccl")

    def simulate(inputs: Sequence[np.ndarray], tensors: Tensors, seed: int) -> Reduction:
        flat = _checked(inputs, f"gift-artifact/{wire}")
        p, n = len(flat), flat[0].size
        total = np.empty(n, np.float32)
        nbytes = 0
        for lo, hi in _whole(tensors, n):
            total[lo:hi] = simulate_baseline_allreduce([x[lo:hi] for x in flat], wire, "sum")[0]
            # FP8 codes both halves of the ring; the agreed scale: a MAX allreduce of one float32
            nbytes += 2 * (p - 1) * (hi - lo) + (2 * (p - 1) * 4 if agreed else 0)
        return Reduction(total, nbytes)

    return simulate


def _whole(tensors: Tensors, n: int) -> list[tuple[int, int]]:
    """The tensors, or the whole buffer as one when none are given."""
    return [(int(lo), int(hi)) for lo, hi in tensors] if tensors else [(0, n)]


DYNAMIQ_BLOCK = 32


def _dynamiq_mxfp8(inputs: Sequence[np.ndarray], tensors: Tensors, seed: int) -> Reduction:
    """MXFP8 (E4M3, 32 values per power-of-two scale) ring whose scale is shared by all ranks and
    leaves room for the sum: per block, the smallest power of two s with P * max_r amax_r <= 448 s
    (agreed by a MAX allreduce of the E8M0 codes), so no partial sum saturates."""
    flat = _checked(inputs, "dynamiq/mxfp8-shared")
    p, n = len(flat), flat[0].size
    nb = -(-n // DYNAMIQ_BLOCK)
    amax = np.max([np.abs(_blocks(x, DYNAMIQ_BLOCK)).max(axis=1) for x in flat], axis=0).astype(np.float64)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(p * amax / _E4M3.max_value)), 0.0)
    scale = np.repeat(np.exp2(np.clip(e, -127, 127)).astype(np.float32), DYNAMIQ_BLOCK)[:n]

    def q(v: np.ndarray, lo: int, hi: int) -> np.ndarray:  # the codes of a partial sum, decoded
        return fp8_codes(v / scale[lo:hi], _E4M3).astype(np.float32) * scale[lo:hi]

    total = np.empty(n, np.float32)
    bounds = chunk_bounds(n, p, DYNAMIQ_BLOCK)
    for c in range(p):
        lo, hi = int(bounds[c]), int(bounds[c + 1])
        acc = flat[(c + 1) % p][lo:hi]
        for k in range(2, p + 1):
            acc = q(acc, lo, hi) + flat[(c + k) % p][lo:hi]
        total[lo:hi] = q(acc, lo, hi)  # the owner encodes once; everybody decodes those codes
    return Reduction(total, 2 * (p - 1) * n + 2 * (p - 1) * nb)


FLASHINFER_GROUP = 256


def _flashinfer_two_shot(inputs: Sequence[np.ndarray], tensors: Tensors, seed: int) -> Reduction:
    """BF16 input; every rank quantizes to E4M3 with a float32 scale per 256 values; the owner of
    each stripe reads the P ranks' codes of it, sums their dequantized values in float32 (rank
    order), re-quantizes its stripe the same way; every rank dequantizes the stripes to BF16."""
    flat = _checked(inputs, "flashinfer/two-shot-fp8")
    p, n = len(flat), flat[0].size
    deq = [_fp8_block_q(_bf16_nearest(x), _E4M3, FLASHINFER_GROUP) for x in flat]
    total = np.empty(n, np.float32)
    bounds = chunk_bounds(n, p, FLASHINFER_GROUP)
    nbytes = 0
    for c in range(p):
        lo, hi = int(bounds[c]), int(bounds[c + 1])
        acc = deq[0][lo:hi].copy()
        for r in range(1, p):
            acc += deq[r][lo:hi]
        total[lo:hi] = _bf16_nearest(_fp8_block_q(acc, _E4M3, FLASHINFER_GROUP))
        nbytes += 2 * (p - 1) * _fp8_block_nbytes(hi - lo, FLASHINFER_GROUP)
    return Reduction(total, nbytes)


QGZ_BLOCK = 512
QGZ_NODE = 8


def _qgz(allgather: str) -> Callable[[Sequence[np.ndarray], Tensors, int], Reduction]:
    """ZeRO++ qgZ reduce-scatter, then an allgather of the owners' shards in ``allgather``
    ("fp16": the fp16 shard as it is; "int4": the same INT4 block quantizer)."""

    def simulate(inputs: Sequence[np.ndarray], tensors: Tensors, seed: int) -> Reduction:
        flat = _checked(inputs, f"zeropp/qgz-{allgather}")
        p, n = len(flat), flat[0].size
        local = QGZ_NODE if p > QGZ_NODE and p % QGZ_NODE == 0 else p  # ranks per node
        nodes = p // local
        bounds = chunk_bounds(n, p, QGZ_BLOCK)  # shard c is owned by rank c
        shards = [(int(bounds[c]), int(bounds[c + 1])) for c in range(p)]
        msg = [_int4_block_nbytes(hi - lo, QGZ_BLOCK) for lo, hi in shards]
        half = [x.astype(np.float16) for x in flat]  # fp16 gradients

        def q16(v: np.ndarray) -> np.ndarray:  # INT4 round trip, dequantized to fp16
            return _int4_block_q(v.astype(np.float32), QGZ_BLOCK).astype(np.float16)

        total = np.empty(n, np.float16)
        nbytes = 0
        for c, (lo, hi) in enumerate(shards):
            # hop 1: every node's members send shard c (INT4) to the member with c's local index,
            # which sums the dequantized fp16 values in rank order
            node_sums = []
            for j in range(nodes):
                acc = q16(half[j * local][lo:hi])
                for m in range(1, local):
                    acc = acc + q16(half[j * local + m][lo:hi])
                node_sums.append(acc)
                nbytes += (local - 1) * msg[c]
            if nodes == 1:
                total[lo:hi] = node_sums[0]
                continue
            # hop 2: the node sums, re-quantized, go to shard c's owner across the nodes
            acc = q16(node_sums[0])
            for j in range(1, nodes):
                acc = acc + q16(node_sums[j])
            total[lo:hi] = acc
            nbytes += (nodes - 1) * msg[c]
        out = total.astype(np.float32)
        for c, (lo, hi) in enumerate(shards):
            if allgather == "int4":
                out[lo:hi] = q16(total[lo:hi]).astype(np.float32)
                nbytes += (p - 1) * msg[c]
            else:
                nbytes += (p - 1) * 2 * (hi - lo)
        return Reduction(out, nbytes)

    return simulate


def _torchcomms_bf16_sr(order: str) -> Callable[[Sequence[np.ndarray], Tensors, int], Reduction]:
    """FP32 in and out, BF16 on the wire by stochastic rounding, float32 accumulation; ``order``
    "ring" (each partial sum rounded per hop) or "direct" (each contribution rounded once)."""

    def simulate(inputs: Sequence[np.ndarray], tensors: Tensors, seed: int) -> Reduction:
        flat = _checked(inputs, f"torchcomms/bf16-sr-{order}")
        p, n = len(flat), flat[0].size
        rng = np.random.default_rng(seed)
        total = np.empty(n, np.float32)
        for c, (lo, hi) in enumerate(ring_bounds(n, p)):
            if order == "ring":
                acc = flat[(c + 1) % p][lo:hi]
                for k in range(2, p + 1):
                    acc = _bf16_stochastic(acc, rng) + flat[(c + k) % p][lo:hi]
            else:
                acc = np.zeros(hi - lo, np.float32)
                for r in range(p):
                    acc = acc + (flat[r][lo:hi] if r == c else _bf16_stochastic(flat[r][lo:hi], rng))
            total[lo:hi] = _bf16_stochastic(acc, rng)  # the owner's sum, rounded once for the allgather
        return Reduction(total, 2 * (p - 1) * n * 2)

    return simulate


def _flat(bits: float) -> Callable[[int, int, Tensors], float]:
    return lambda n, p, tensors: bits


PEERS: dict[str, Semantics] = {s.name: s for s in (
    Semantics("nccl-fp8-raw/e4m3", "NCCL", "NCCL >= 2.24 allreduce of ncclFloat8e4m3 (ring)", _flat(8.0),
              _nccl_fp8_raw(_E4M3),
              "the caller casts float32 to E4M3 with no scale (clip to +-448, nearest even); each ring hop adds "
              "the received FP8 partial sum and its own FP8 codes in fp16 and rounds back to FP8 (saturating); "
              "chunk c of P starts at rank c+1; the FP8 result is gathered unchanged"),
    Semantics("nccl-fp8-raw/e5m2", "NCCL", "NCCL >= 2.24 allreduce of ncclFloat8e5m2 (ring)", _flat(8.0),
              _nccl_fp8_raw(_E5M2), "as nccl-fp8-raw/e4m3 with E5M2 codes (max 57344)"),
    Semantics("gift-artifact/e5m2-tensor-nccl", "GIFT artifact", "the GIFT paper's artifact: per-tensor E5M2 on "
              "NCCL's FP8 sum, scale agreed by a MAX allreduce (giftcomm.reference.baselines)",
              lambda n, p, tensors: 8.0 + 32.0 * len(_whole(tensors, n)) / n,
              _gift_artifact("e5m2/tensor-nccl"),
              "one scale per parameter tensor (max|x| over ranks / 57344, one float32 MAX allreduce per tensor); "
              "codes summed as nccl-fp8-raw"),
    Semantics("gift-artifact/e5m2-tensor-local", "GIFT artifact", "the GIFT artifact between scale refreshes: "
              "each rank encodes and decodes with its own per-tensor scale (giftcomm.reference.baselines)",
              _flat(8.0), _gift_artifact("e5m2/tensor-local"),
              "rank 0's result (ranks differ); no scale is exchanged"),
    Semantics("dynamiq/mxfp8-shared", "DynamiQ", "DynamiQ (Han et al., 2026), its MXFP8 multi-hop baseline: "
              "MXFP8 ring with a shared scale and 1/P headroom",
              lambda n, p, tensors: 8.0 + 8.0 * -(-n // DYNAMIQ_BLOCK) / n, _dynamiq_mxfp8,
              "E4M3 elements, 32 per power-of-two scale; the scale is the same on every rank and hop: per block the "
              "smallest power of two s with P max_r amax_r <= 448 s (agreed by a MAX allreduce of one E8M0 byte per "
              "block, counted); each hop decodes, adds its float32 value, re-encodes (nearest even); the owner "
              "encodes its sum once for the allgather"),
    Semantics("flashinfer/two-shot-fp8", "FlashInfer", "flashinfer.comm.quantized_all_reduce: FP8 two-shot "
              "allreduce with per-block scaling (scale_group=256)",
              lambda n, p, tensors: 8.0 + 32.0 / FLASHINFER_GROUP, _flashinfer_two_shot,
              "input cast to BF16 (its documented input dtype); E4M3 codes with a float32 scale amax/448 per 256 "
              "values; the stripe owner dequantizes all P ranks' codes, its own included, and sums in float32 in "
              "rank order, re-quantizes its stripe the same way; output BF16. Documented for P a power of two <= 16: "
              "larger P is an extrapolation"),
    Semantics("zeropp/qgz-fp16", "ZeRO++", "ZeRO++ (Wang et al., 2023) qgZ: all-to-all INT4 block-quantized "
              "reduce-scatter with fp16 sums, hierarchical across nodes of 8; then an fp16 allgather",
              lambda n, p, tensors: (4.0 + 32.0 / QGZ_BLOCK + 16.0) / 2, _qgz("fp16"),
              "fp16 gradients; symmetric INT4 (levels -7..7, scale amax/7 in float32) per 512 values; every "
              "rank's slices are quantized, its own included; dequantized to fp16 and summed in fp16 in rank "
              "order; for P > 8 (a multiple of 8) node sums are re-quantized for the inter-node all-to-all; "
              "qgZ is a reduce-scatter, completed here by an allgather of the fp16 shards"),
    Semantics("zeropp/qgz-int4", "ZeRO++", "ZeRO++ qgZ reduce-scatter, then the shards allgathered with the same "
              "INT4 block quantizer", lambda n, p, tensors: 4.0 + 32.0 / QGZ_BLOCK, _qgz("int4"),
              "as zeropp/qgz-fp16, but each owner INT4-quantizes its fp16 shard for the allgather"),
    Semantics("torchcomms/bf16-sr-ring", "torchcomms", "torchcomms (NCCLX) quantized reduce-scatter/allreduce: "
              "FP32 buffers, BF16 transport by stochastic rounding, FP32 accumulation; ring order",
              _flat(16.0), _torchcomms_bf16_sr("ring"),
              "every hop rounds its float32 partial sum to BF16 stochastically (16 random bits added below the "
              "BF16 mantissa, truncated); the owner's float32 sum is rounded once more for the allgather"),
    Semantics("torchcomms/bf16-sr-direct", "torchcomms", "torchcomms (NCCLX/MCCL) AllReduceDirect with BF16 "
              "transport quantization: stochastic rounding, FP32 accumulation", _flat(16.0),
              _torchcomms_bf16_sr("direct"),
              "each other rank's contribution is rounded once, the owner adds its own unrounded in rank order; "
              "the sum is rounded once for the allgather"),
)}
"""The peers' semantics, by name (module doc; docs/fidelity.md, *Quality per bit*)."""


# ------------------------------------------------------------------------ giftcomm's rows

def _chunk_message_bits(fmt: Format) -> Callable[[int, int, Tensors], float]:
    """A giftcomm row's claim: each of the P chunks (giftcomm.algorithms.partition.chunk_bounds) leaves
    some rank 2 (P - 1) times as one message (P - 1 times in the reduce-scatter, P - 1 in the
    allgather), so ``8 * sum(message_nbytes(chunk)) / n`` bits per value: the row's
    ``bytes_per_value`` where every chunk is whole blocks (and nvfp4 groups), and an adaptive
    row's per-frame budget rounding where its chunks are partial frames."""
    block = resolve_block(fmt)

    def claim(n: int, p: int, tensors: Tensors) -> float:
        lens = np.diff(chunk_bounds(n, p, block))
        return 8.0 * sum(message_nbytes(int(c), fmt, block) for c in lens) / n if n else math.nan

    return claim


def _giftcomm_simulate(fmt: Format, algorithm: str, rounding: str):
    block = resolve_block(fmt)

    def simulate(inputs: Sequence[np.ndarray], tensors: Tensors, seed: int) -> Reduction:
        flat = [np.asarray(x).reshape(-1) for x in inputs]
        p, n = len(flat), flat[0].size
        total = simulate_allreduce(flat, fmt.name, None, "sum", algorithm, rounding=rounding, seed=seed)[0]
        return Reduction(total, sum(sent_bytes(algorithm, n, p, r, fmt, block) for r in range(p)))

    return simulate


def giftcomm_semantics(algorithms: Sequence[str] = ("ring", "direct"),
                       roundings: Sequence[str] = ("nearest",)) -> list[Semantics]:
    """A semantics for every row of ``giftcomm.formats.FORMATS`` (read when called, so rows added
    to the table appear), its own block, under each algorithm and rounding (stochastic only
    for the block-scaled rows)."""
    rows = []
    for fmt in FORMATS.values():
        for rounding in roundings:
            if rounding not in ROUNDINGS:
                raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
            if rounding == "stochastic" and not fmt.scaled:
                continue
            for alg in algorithms:
                rows.append(Semantics(
                    f"giftcomm/{fmt.name}{'-sr' if rounding == 'stochastic' else ''}/{alg}", "giftcomm",
                    f"giftcomm.reference.simulate_allreduce(fmt={fmt.name!r}, algorithm={alg!r}, rounding={rounding!r})",
                    _chunk_message_bits(fmt), _giftcomm_simulate(fmt, alg, rounding),
                    f"block {resolve_block(fmt)}"))
    return rows


# ----------------------------------------------------------------------------- the study

def run(inputs: Sequence[np.ndarray], semantics: Sequence[Semantics], ps: Sequence[int], tensors: Tensors = (),
        seed: int = 0, progress: bool = False) -> list[dict]:
    """Every semantics at every P of ``ps`` on the first P of ``inputs`` (flat float32 vectors of
    one length); one dict per (P, semantics): name, family, P, bits (counted), claimed_bits,
    wire_bytes, seconds and the :func:`fidelity` metrics."""
    if max(ps) > len(inputs):
        raise ValueError(f"P = {max(ps)} needs {max(ps)} ranks' gradients; the data has {len(inputs)}")
    rows = []
    for p in ps:
        mine = list(inputs[:p])
        n = mine[0].size
        exact = np.sum([x.astype(np.float64) for x in mine], axis=0)
        for s in semantics:
            t0 = time.perf_counter()
            red = s.simulate(mine, tensors, seed + p)
            rows.append({"name": s.name, "family": s.family, "P": p, "bits": bits_per_value(red.wire_bytes, n, p),
                         "claimed_bits": s.claimed_bits(n, p, tensors), "wire_bytes": int(red.wire_bytes),
                         "seconds": time.perf_counter() - t0, **fidelity(red.total, exact, p)})
            if progress:
                r = rows[-1]
                print(f"  P={p:<3} {s.name:<34} {r['bits']:7.3f} bits  rel L2 {r['rel_l2']:.3e}  "
                      f"({r['seconds']:.1f} s)", file=sys.stderr, flush=True)
    return rows


def _by_name(rows: Sequence[dict]) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for r in rows:
        out.setdefault(r["name"], {})[r["P"]] = r
    return out


def _g(x: float, digits: int = 3) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.{digits}g}"


def format_report(rows: Sequence[dict], semantics: Sequence[Semantics]) -> str:
    """Markdown: per metric a table of the semantics (rows, by bits) against P (columns)."""
    table = _by_name(rows)
    ps = sorted({r["P"] for r in rows})
    order = sorted(table, key=lambda k: (table[k][ps[-1]]["bits"], table[k][ps[-1]]["rel_l2"]))
    out = []
    for key, title in (("rel_l2", "relative L2 error of the sum (vNMSE = its square)"),
                       ("one_minus_cos", "1 - cosine similarity with the exact sum"),
                       ("adam_median", "Adam, median per-coordinate relative error of the first step"),
                       ("adam_p90", "Adam, 90th percentile of the same")):
        out += [f"### {title}", "", "| semantics | bits/value | " + " | ".join(f"P={p}" for p in ps) + " |",
                "| --- | --- | " + " | ".join("---" for _ in ps) + " |"]
        for name in order:
            cells = []
            for p in ps:
                r = table[name].get(p)
                v = math.nan if r is None else (1.0 - r["cosine"] if key == "one_minus_cos" else r[key])
                cells.append(_g(v))
            bits = sorted({round(table[name][p]["bits"], 3) for p in ps if p in table[name]})
            shown = f"{bits[0]:g}" if len(bits) == 1 else f"{bits[0]:g}-{bits[-1]:g}"
            out.append(f"| {name} | {shown} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["### The semantics", "", "| semantics | source | assumptions |", "| --- | --- | --- |"]
    out += [f"| {s.name} | {s.source} | {s.assumptions} |" for s in semantics]
    return "\n".join(out)


def plot(rows: Sequence[dict], path: str, title: str) -> None:
    """One panel per P: relative L2 error against bits per value, giftcomm's rows a line per
    algorithm, every peer a marker; a last panel: the error against P, a line per semantics.
    fp32 (errors ~1e-7) is left out, so the 4- to 16-bit rows get the axis."""
    from studies.plotting import pyplot, save

    plt = pyplot()
    rows = [r for r in rows if "/fp32/" not in r["name"]]
    ps = sorted({r["P"] for r in rows})
    cols = 4
    nrows = -(-(len(ps) + 1) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    peers = sorted({r["name"] for r in rows if r["family"] != "giftcomm"})
    markers = "osD^v<>ph*XP"
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    style = {name: (markers[i % len(markers)], colors[i % len(colors)]) for i, name in enumerate(peers)}
    for ax, p in zip(axes.flat, ps):
        here = [r for r in rows if r["P"] == p and math.isfinite(r["rel_l2"]) and r["rel_l2"] > 0]
        for alg, ls in (("ring", "-"), ("direct", "--")):
            mine = sorted((r for r in here if r["family"] == "giftcomm" and r["name"].endswith("/" + alg)
                           and "-sr/" not in r["name"]), key=lambda r: r["bits"])
            if mine:
                ax.plot([r["bits"] for r in mine], [r["rel_l2"] for r in mine], ls, color="k", marker=".",
                        label=f"giftcomm rows, {alg}")
                for r in mine:
                    ax.annotate(r["name"].split("/")[1], (r["bits"], r["rel_l2"]), fontsize=6, alpha=0.7)
        for r in here:
            if r["family"] != "giftcomm":
                m, c = style[r["name"]]
                ax.plot([r["bits"]], [r["rel_l2"]], m, color=c, label=r["name"], alpha=0.85)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"P = {p}", fontsize=9)
        ax.set_xlabel("wire bits per value")
        ax.set_ylabel("relative L2 error")
        ax.grid(alpha=0.3)
    ax = axes.flat[len(ps)]
    for name, by_p in sorted(_by_name(rows).items()):
        if "-sr/" in name or name.endswith("/direct"):
            continue
        xs = [p for p in ps if p in by_p and math.isfinite(by_p[p]["rel_l2"]) and by_p[p]["rel_l2"] > 0]
        if not xs:
            continue
        m, c = style.get(name, (".", "k"))
        ax.plot(xs, [by_p[p]["rel_l2"] for p in xs], "-" + m, color=c, alpha=0.8 if name in style else 0.3,
                lw=1.2 if name in style else 0.8, ms=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title("error against P (giftcomm ring rows grey)", fontsize=9)
    ax.set_xlabel("P")
    ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for extra in axes.flat[len(ps) + 1:]:
        extra.axis("off")
    legend_ax = axes.flat[len(ps) + 1] if len(axes.flat) > len(ps) + 1 else axes.flat[len(ps)]
    legend_ax.legend(handles, labels, fontsize=7, loc="center")
    fig.suptitle(title, fontsize=10)
    save(fig, path, dpi=80)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies peers", description=(__doc__ or "").split("\n")[0],
                                parents=[parent_parser(seed=0)])
    p.add_argument("--data", required=True, help="a capture of `python -m studies.gradients` (.npz)")
    p.add_argument("--P", default="2,4,8,16,32,64", help="comma-separated rank counts (default 2,4,8,16,32,64)")
    p.add_argument("--segments", default=DEFAULT_SEGMENTS, metavar="REGEX",
                   help=f"the parameters reduced (re.search on their names; default {DEFAULT_SEGMENTS!r}; '' for all)")
    p.add_argument("--step", type=int, default=-1, help="the captured step whose per-rank gradients are used "
                   "(default -1, the last)")
    p.add_argument("--algos", default="ring,direct", help="giftcomm's algorithms (default ring,direct)")
    p.add_argument("--rounding", default="nearest", help="giftcomm's roundings: nearest, stochastic (default nearest)")
    p.add_argument("--only", default=None, help="comma-separated semantics names to run (default: all)")
    add_json(p, help="write the rows here")
    add_out(p, help="write the markdown report here")
    p.add_argument("--png", metavar="FILE", default=None, help="write the plot here")
    return p


def main(argv: list[str] | None = None) -> int:
    from studies.fidelity import _commit

    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    ps = sorted({int(x) for x in split_list(a.P)})
    if not ps or ps[0] < 1:
        raise SystemExit("--P needs rank counts >= 1")
    case = load_case(a.data)
    if a.segments:
        case = subset_case(case, a.segments)
    step = case.grads[a.step]
    if ps[-1] > len(step):
        raise SystemExit(f"--P {ps[-1]} needs {ps[-1]} ranks' gradients; {a.data} has {len(step)} per step "
                         f"(capture more: python -m studies.gradients --ranks {ps[-1]} ...)")
    semantics = giftcomm_semantics(split_list(a.algos), split_list(a.rounding)) + list(PEERS.values())
    if a.only:
        keep = set(split_list(a.only))
        unknown = keep - {s.name for s in semantics}
        if unknown:
            raise SystemExit(f"--only: unknown semantics {', '.join(sorted(unknown))}")
        semantics = [s for s in semantics if s.name in keep]
    tensors = [(seg.offset, seg.stop) for seg in case.layout]
    t0 = time.perf_counter()
    rows = run(step, semantics, ps, tensors, a.seed, progress=not a.no_progress)
    header = [f"$ python -m studies peers {' '.join(argv)}",
              f"machine: {platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}; loadavg at start "
              f"{load_average()}; {time.perf_counter() - t0:.0f} s",
              f"commit: {_commit()}",
              f"data: {case.name}; step {a.step} of {len(case.grads)}; {case.layout.size} values in "
              f"{len(tensors)} tensors; the P ranks' inputs are the capture's first P per-rank gradients; "
              f"seed {a.seed} (+ P)"]
    text = "\n".join(["# Quality per bit: giftcomm's rows and the peers' semantics", "", "```", *header, "```", "",
                      format_report(rows, semantics)])
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"header": header, "data": a.data, "segments": a.segments, "step": a.step,
                       "values": case.layout.size, "tensors": len(tensors),
                       "semantics": [{"name": s.name, "family": s.family, "source": s.source,
                                      "assumptions": s.assumptions} for s in semantics],
                       "rows": rows}, f, indent=1)
    if a.png:
        plot(rows, a.png, f"{case.name.split(' [')[0]}; {case.layout.size / 1e6:.2f}M values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
