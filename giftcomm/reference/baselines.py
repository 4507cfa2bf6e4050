"""The baseline wires peers run (not giftcomm's), in plain NumPy: definitions and simulation.

BASELINE_WIRES names them ``"<fp8 format>/tensor-<scale>"``:

- ``e5m2/tensor-nccl`` (and ``e4m3/tensor-nccl``): **one scale per tensor agreed by a MAX
  allreduce**, the FP8 codes summed the way NCCL's native FP8 allreduce (NCCL >= 2.24) sums:
  each addition converts both operands to fp16, adds in fp16 (one rounding to nearest even) and
  rounds the partial sum back to FP8. The GIFT paper's wire.
- ``e5m2/tensor-local`` (and ``e4m3/tensor-local``): the same sum, but each rank encodes and
  decodes with its **own local** per-tensor scale (no MAX allreduce): what the paper's artifact
  does on the steps between scale refreshes. Ranks end with different results (the codes of
  differently scaled tensors are added, and each rank decodes the sum with its own scale).

Definitions (``P`` ranks, ``x_r`` rank r's float32 vector of n values, ``F`` the FP8 format):

- scale: ``s_r = max|x_r| / F.max`` (local), ``s = max_r s_r`` (agreed); a zero scale becomes 1.
- encode: ``q_r = fp8(clip(x_r / s, -F.max, F.max))``, round to nearest even (float32 division).
- add: ``a (+) b = fp8(clip(fp16(fp16(a) + fp16(b)), -F.max, F.max))`` (saturating: an overflow
  gives +-F.max, never Inf; NCCL's own conversion is not specified here).
- ring order: the n values are cut into P chunks, chunk c = ``[c n // P, (c + 1) n // P)``;
  chunk c's sum starts at rank c + 1 and travels right, each rank adding its own codes to the
  partial sum it receives, rank c last:
  ``S_c = (((q_{c+1} (+) q_{c+2}) (+) ...) (+) q_c)`` (indices mod P); then the FP8 sums are
  gathered unchanged, so every rank holds the same codes ``S``.
- decode: ``y = float32(S) * s`` (agreed), or ``float32(S) * s_r`` on rank r (local); ``op="avg"``
  divides by P. The result has the input's dtype.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..formats import Format, get_format

__all__ = ["BASELINE_WIRES", "BaselineWire", "baseline_wire", "ring_bounds", "fp8_codes", "fp8_add",
           "local_scale", "simulate_baseline_allreduce"]


@dataclass(frozen=True)
class BaselineWire:
    """One baseline wire: name, FP8 element format, and whether each rank keeps its local scale."""

    name: str
    fmt: Format
    local_scale: bool


BASELINE_WIRES: dict[str, BaselineWire] = {
    f"{f}/tensor-{kind}": BaselineWire(f"{f}/tensor-{kind}", get_format(f), kind == "local")
    for f in ("e5m2", "e4m3") for kind in ("nccl", "local")
}
"""Every baseline wire by name (module doc): e5m2/tensor-nccl, e5m2/tensor-local, e4m3/tensor-nccl,
e4m3/tensor-local."""


def baseline_wire(wire: str | BaselineWire) -> BaselineWire:
    """The BaselineWire of a name (ValueError naming the known ones)."""
    if isinstance(wire, BaselineWire):
        return wire
    try:
        return BASELINE_WIRES[wire]
    except (KeyError, TypeError):
        raise ValueError(f"unknown baseline wire {wire!r}; known: {', '.join(BASELINE_WIRES)}") from None


def ring_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """The P chunks of n values: chunk c is ``[c n // P, (c + 1) n // P)``."""
    return [(c * n // p, (c + 1) * n // p) for c in range(p)]


def local_scale(x: np.ndarray, fmt: Format) -> float:
    """``max|x| / fmt.max_value`` (float64; 0 for an all-zero or empty x)."""
    return float(np.max(np.abs(x))) / fmt.max_value if x.size else 0.0


def fp8_codes(values: np.ndarray, fmt: Format) -> np.ndarray:
    """FP8 elements (``fmt.wire_dtype``) of float values: clipped to +-max, then rounded to nearest even."""
    v = np.clip(np.asarray(values, np.float32), -fmt.max_value, fmt.max_value)
    return v.astype(fmt.wire_dtype)


def fp8_add(a: np.ndarray, b: np.ndarray, fmt: Format) -> np.ndarray:
    """NCCL's FP8 sum of two FP8 arrays: fp16 operands, fp16 addition, rounded back to FP8."""
    with np.errstate(over="ignore", invalid="ignore"):  # an fp16 overflow is Inf, then saturated
        s = a.astype(np.float16) + b.astype(np.float16)  # fp16 + fp16 in NumPy: one rounding to fp16
        return fp8_codes(s.astype(np.float32), fmt)


def simulate_baseline_allreduce(inputs: Sequence[np.ndarray], wire: str | BaselineWire = "e5m2/tensor-nccl",
                                op: str = "sum") -> list[np.ndarray]:
    """Every rank's output of the baseline wire ``wire`` (module doc), from every rank's input
    (same element count and dtype; any shape; finite values). Ranks differ for the ``-local`` wires."""
    w = baseline_wire(wire)
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    arrays = [np.asarray(x) for x in inputs]
    if not arrays or any(a.size != arrays[0].size or a.dtype != arrays[0].dtype for a in arrays):
        raise ValueError("need at least one rank's input, all of the same element count and dtype")
    flat = [a.reshape(-1).astype(np.float32) for a in arrays]
    if not all(np.all(np.isfinite(x)) for x in flat):
        raise ValueError(f"baseline wire {w.name}: non-finite input values")
    p, n = len(flat), flat[0].size
    local = [local_scale(x, w.fmt) for x in flat]
    agreed = max(local)
    scales = [(s if s > 0 else 1.0) for s in local] if w.local_scale else [agreed if agreed > 0 else 1.0] * p
    codes = [fp8_codes(x / np.float32(s), w.fmt) for x, s in zip(flat, scales)]
    total = np.empty(n, w.fmt.wire_dtype)
    for c, (lo, hi) in enumerate(ring_bounds(n, p)):
        acc = codes[(c + 1) % p][lo:hi]
        for k in range(2, p + 1):
            acc = fp8_add(acc, codes[(c + k) % p][lo:hi], w.fmt)
        total[lo:hi] = acc
    out = []
    for r in range(p):
        y = total.astype(np.float32) * np.float32(scales[r])
        if op == "avg":
            y = y / np.float32(p)
        out.append(y.astype(arrays[0].dtype).reshape(arrays[0].shape))
    return out
