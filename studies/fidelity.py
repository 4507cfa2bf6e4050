"""GIFT fidelity study: GIFT vs Euclidean FP8 (and BF16) allreduce on the same gradients.

``python -m studies fidelity [synthetic|real|cost] [options]``

- ``synthetic``: per-rank gradients ``G^1/2 Z A^1/2`` (Z iid normal) of Kronecker-structured
  covariance, factor spectra power-law or exponential (log-spaced) with chosen condition numbers.
- ``real``: per-rank gradients of 4 data-parallel shards of a batch, and KFAC factors, captured
  from the small Llama-style model by ``studies.gradients`` (a ``.npz`` file).
- ``cost``: forward + inverse time of the geometries against the predicted time of the FP8
  collective (see ``cost_main``).

Every method reduces the same per-rank float32 buffers at P ranks (``op="avg"``, the ring
algorithm unless ``--algos`` names others: ring, direct, doubling, hierarchical:L for nodes of L
ranks) and is compared with the float64 mean. ``--fmt A,B --rounding nearest,stochastic`` runs
the formats study instead of the default method list: per wire format and rounding, Euclidean,
GIFT full, GIFT low rank and the default policy at the same bytes (stochastic rounding seeded
with ``--seed`` + the step index). With ``--mpi`` (under ``mpiexec -n P``) the reductions run
through ``giftcomm.allreduce`` / ``giftcomm.gift_allreduce`` over MPI and every result is checked,
bit for bit, against ``giftcomm.reference.simulate_*`` of the same inputs (column ``mpi==sim``);
without it the reference simulator alone is used.

Metrics (all float64, against the exact mean ``S`` and the method's result ``S~``, ``E = S~ - S``):

- ``rel L2``: ``||E||_2 / ||S||_2`` over the whole buffer;
- ``whitened``: per matrix segment ``||P_G^-1/2 E P_A^-1/2||_F / ||P_G^-1/2 S P_A^-1/2||_F`` with
  the *metric* factors (normalised to unit mean eigenvalue, damped by ``--metric-damping``
  relative to it, as in docs/method.md), then the element-weighted RMS over segments;
- ``flipped``: fraction of entries with ``S != 0`` whose sign is reversed (``S~ * S < 0``);
- ``zeroed``: fraction of entries with ``S != 0`` that come back exactly 0;
- ``Adam cos``: cosine between the Adam update after the last of the ``steps`` reductions
  (fresh moments at the first, beta1 0.9, beta2 0.999, eps 1e-8, bias-corrected), each method's
  Adam fed its own reduced gradients, and the update of the same Adam fed the exact means.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import giftcomm
from giftcomm.formats import bytes_per_value, check_block, get_format, message_nbytes, resolve_block
from giftcomm.geometry import Geometry, Layout, SelectivePolicy, select
from giftcomm.perf.common import add_json, add_out, parent_parser
from giftcomm.perf.timing import load_average, time_calls
from giftcomm.reference import simulate_allreduce, simulate_gift_allreduce
from studies.cases import Case, subset_case

__all__ = [
    "MAX_BLOCK",
    "WhiteningMetric",
    "relative_l2",
    "sign_flip_fraction",
    "zeroed_fraction",
    "adam_update",
    "cosine",
    "Case",
    "Method",
    "synthetic_case",
    "kron_factor",
    "default_methods",
    "evaluate",
    "format_table",
    "main",
]

MAX_BLOCK = 1 << 20  # the largest block the codec allows (values per scale)


def _emit(text: str, md_path: str | None, json_path: str | None, payload: object) -> None:
    """Print a report; also write it as markdown and its data as JSON where asked."""
    print(text)
    if md_path:
        with open(md_path, "w") as f:
            f.write(text + "\n")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=1)


# ----------------------------------------------------------------------------------- metrics

def relative_l2(approx: np.ndarray, exact: np.ndarray) -> float:
    """``||approx - exact||_2 / ||exact||_2`` in float64 (0 when both are 0; inf when only exact is)."""
    a = np.asarray(approx, np.float64).ravel()
    s = np.asarray(exact, np.float64).ravel()
    num = float(np.linalg.norm(a - s))
    den = float(np.linalg.norm(s))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def sign_flip_fraction(approx: np.ndarray, exact: np.ndarray) -> float:
    """Fraction of the entries with ``exact != 0`` whose sign ``approx`` reverses (``approx*exact < 0``)."""
    a = np.asarray(approx, np.float64).ravel()
    s = np.asarray(exact, np.float64).ravel()
    nz = np.count_nonzero(s)
    return float(np.count_nonzero(a * s < 0) / nz) if nz else 0.0


def zeroed_fraction(approx: np.ndarray, exact: np.ndarray) -> float:
    """Fraction of the entries with ``exact != 0`` that ``approx`` has exactly 0."""
    a = np.asarray(approx).ravel()
    s = np.asarray(exact).ravel()
    nz = np.count_nonzero(s)
    return float(np.count_nonzero((a == 0) & (s != 0)) / nz) if nz else 0.0


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine of the angle between two vectors (float64; 1.0 when both are 0, 0.0 when one is)."""
    x = np.asarray(a, np.float64).ravel()
    y = np.asarray(b, np.float64).ravel()
    nx, ny = float(np.linalg.norm(x)), float(np.linalg.norm(y))
    if nx == 0.0 or ny == 0.0:
        return 1.0 if nx == ny else 0.0
    return float(np.dot(x, y) / (nx * ny))


def adam_update(grads: Sequence[np.ndarray], beta1: float = 0.9, beta2: float = 0.999,
                eps: float = 1e-8) -> np.ndarray:
    """The Adam step direction after feeding ``grads`` (a sequence of equal-shape arrays, one per
    step) into fresh moments: ``m_hat / (sqrt(v_hat) + eps)`` at the last step, bias-corrected,
    float64, learning rate 1 (multiply by -lr for the parameter change)."""
    m = v = None
    t = 0
    for g in grads:
        g = np.asarray(g, np.float64)
        t += 1
        m = (1 - beta1) * g if m is None else beta1 * m + (1 - beta1) * g
        v = (1 - beta2) * g * g if v is None else beta2 * v + (1 - beta2) * g * g
    if t == 0:
        raise ValueError("adam_update needs at least one gradient")
    return (m / (1 - beta1**t)) / (np.sqrt(v / (1 - beta2**t)) + eps)


def _metric_side(f, damping: float) -> np.ndarray:
    """``P^-1/2`` (d, d) float64 of one factor: normalised to unit mean eigenvalue, damped."""
    f = np.asarray(f, np.float64)
    if f.ndim == 1:
        f = np.diag(f)
    f = 0.5 * (f + f.T)
    w, u = np.linalg.eigh(f)
    w = np.maximum(w, 0.0)
    mean = w.mean()
    w = w / mean if mean > 0 else np.ones_like(w)
    p = (w + damping) / (1.0 + damping)
    return (u * p**-0.5) @ u.T


class WhiteningMetric:
    """The whitened norm ``||P_G^-1/2 X P_A^-1/2||_F`` per matrix segment, in float64.

    layout: the buffer layout. factors: name -> (A (n, n), G (m, m)) for the (m, n) matrix view
    (1-D vectors are diagonals); segments without factors are not measured. damping: relative to
    the mean eigenvalue, as in docs/method.md. Identity factors give the plain Frobenius norm.
    """

    def __init__(self, layout, factors: Mapping, damping: float = 1e-3):
        self.layout = layout if isinstance(layout, Layout) else Layout(layout)
        self.damping = float(damping)
        self.sides: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, (a, g) in factors.items():
            m, n = self.layout[name].matrix_shape
            wa, wg = _metric_side(a, self.damping), _metric_side(g, self.damping)
            if wa.shape != (n, n) or wg.shape != (m, m):
                raise ValueError(f"factors of {name!r} do not match its matrix view {(m, n)}")
            self.sides[name] = (wa, wg)

    def whiten(self, name: str, x: np.ndarray) -> np.ndarray:
        """(m, n) (or flat) segment values -> ``P_G^-1/2 x P_A^-1/2`` (m, n) float64."""
        wa, wg = self.sides[name]
        mat = np.asarray(x, np.float64).reshape(self.layout[name].matrix_shape)
        return wg @ mat @ wa

    def ratios(self, approx: np.ndarray, exact: np.ndarray) -> dict[str, float]:
        """name -> ``||W(approx - exact)|| / ||W(exact)||`` for every measured segment (flat
        buffers of ``layout.size`` elements in)."""
        a = np.asarray(approx, np.float64).ravel()
        s = np.asarray(exact, np.float64).ravel()
        out = {}
        for name in self.sides:
            seg = self.layout[name]
            ex = s[seg.offset:seg.stop]
            num = np.linalg.norm(self.whiten(name, a[seg.offset:seg.stop] - ex))
            den = np.linalg.norm(self.whiten(name, ex))
            out[name] = float(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
        return out

    def aggregate(self, ratios: Mapping[str, float]) -> float:
        """Element-weighted RMS of per-segment ratios: ``sqrt(sum n_s r_s^2 / sum n_s)``."""
        if not ratios:
            return float("nan")
        w = np.array([self.layout[k].size for k in ratios], np.float64)
        r = np.array(list(ratios.values()), np.float64)
        return float(np.sqrt(np.sum(w * r * r) / np.sum(w)))


# ----------------------------------------------------------------------------------- cases
def kron_factor(rng: np.random.Generator, d: int, cond: float, spectrum: str = "power") -> np.ndarray:
    """A (d, d) SPD float64 factor in a random orthonormal basis with eigenvalues from 1 down to
    ``1/cond``: ``power`` (``j^-alpha``, alpha = log(cond)/log(d)) or ``exp`` (log-spaced)."""
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    if spectrum == "power":
        alpha = math.log(cond) / math.log(d) if d > 1 else 0.0
        vals = np.arange(1, d + 1, dtype=np.float64) ** -alpha
    elif spectrum == "exp":
        vals = np.logspace(0.0, -math.log10(cond), d)
    else:
        raise ValueError(f"spectrum must be 'power' or 'exp', got {spectrum!r}")
    return (q * vals) @ q.T


def _sqrt_psd(f: np.ndarray) -> np.ndarray:
    w, u = np.linalg.eigh(f)
    return (u * np.sqrt(np.maximum(w, 0.0))) @ u.T


def synthetic_case(shapes: Sequence[tuple[int, int]] = ((256, 512), (512, 256)), cond: float = 1e4,
                   spectrum: str = "power", ranks: int = 4, steps: int = 3, seed: int = 0) -> Case:
    """Layers ``w{i}`` (out, in) with a bias ``b{i}`` (out,) each; per rank and step the weight
    gradient is ``G^1/2 Z A^1/2`` (Z iid standard normal), the bias gradient iid normal scaled to
    the weight's RMS. Geometry and metric both use the true factors A, G (float64)."""
    rng = np.random.default_rng([seed, int(cond), len(spectrum)])
    entries, factors, roots = [], {}, {}
    for i, (m, n) in enumerate(shapes):
        a, g = kron_factor(rng, n, cond, spectrum), kron_factor(rng, m, cond, spectrum)
        factors[f"w{i}"] = (a, g)
        roots[f"w{i}"] = (_sqrt_psd(a), _sqrt_psd(g))
        entries += [(f"w{i}", (m, n)), (f"b{i}", (m,))]
    layout = Layout(entries)
    grads = []
    for _ in range(steps):
        per_rank = []
        for _ in range(ranks):
            parts = []
            for i, (m, n) in enumerate(shapes):
                ra, rg = roots[f"w{i}"]
                w = rg @ rng.standard_normal((m, n)) @ ra
                parts += [w.ravel(), rng.standard_normal(m) * np.sqrt(np.mean(w * w))]
            per_rank.append(np.concatenate(parts).astype(np.float32))
        grads.append(per_rank)
    return Case(f"synthetic {spectrum} cond {cond:g}", layout, grads, factors, factors,
                {"spectrum": spectrum, "cond": cond, "shapes": [list(s) for s in shapes], "seed": seed})


# ----------------------------------------------------------------------------------- methods
@dataclass
class Method:
    """One way to reduce: a wire format, a block size, and a geometry (None: Euclidean).

    label: table name. fmt, block: as for giftcomm.allreduce. build: case, spectra -> Geometry
    (or None for the identity). per_tensor: one allreduce per segment with block = the
    segment's size (capped at MAX_BLOCK): one scale per tensor.
    """

    label: str
    fmt: str = "e4m3"
    block: int = 256
    build: Callable | None = None
    per_tensor: bool = False
    rounding: str = "nearest"  # or "stochastic": seeded per step (seed + step index)
    seed: int = 0
    geometry: str | None = None  # the geometry's name, shared by methods that build the same one (cached)


def _spectra(factors: Mapping) -> dict:
    from giftcomm.geometry import Spectrum

    return {k: (Spectrum.from_matrix(a), Spectrum.from_matrix(g)) for k, (a, g) in factors.items()}


def default_methods(ranks: Sequence[int] = (8, 32, 128), policy: SelectivePolicy | None = None,
                    extra_policies: Mapping[str, SelectivePolicy] | None = None,
                    damping: float = 1e-3) -> list[Method]:
    """BF16; Euclidean E4M3 per tensor and per block of 256; GIFT full, low-rank k (both sides,
    capped at the side), the selective policy (``policy``, default ``SelectivePolicy()``) and any
    ``extra_policies`` (label -> policy); diagonal KFAC and randomised Hadamard (all E4M3/256).
    damping: of the geometries (relative, docs/method.md)."""
    pol = policy or SelectivePolicy()
    dmp = float(damping)
    methods = [
        Method("bf16", "bf16", 256),
        Method("e4m3 per-tensor", per_tensor=True),
        Method("e4m3 block256"),
        Method("gift full", build=lambda c, sp: Geometry.from_kfac(c.layout, sp, damping=dmp)),
    ]
    for k in ranks:
        methods.append(Method(f"gift k={k}",
                              build=lambda c, sp, k=k: Geometry.from_kfac(c.layout, sp, rank=k, damping=dmp)))
    methods.append(Method("gift policy", build=lambda c, sp: select(c.layout, sp, pol, dmp)))
    for label, p in (extra_policies or {}).items():
        methods.append(Method(label, build=lambda c, sp, p=p: select(c.layout, sp, p, dmp)))
    methods += [
        Method("diagonal", build=lambda c, sp: Geometry.diagonal(
            c.layout, {k: (np.diag(a), np.diag(g)) for k, (a, g) in c.factors.items()}, damping=dmp)),
        Method("hadamard", build=lambda c, sp: Geometry.hadamard(c.layout, seed=0, min_size=4096)),
    ]
    return methods


ROUNDINGS = ("nearest", "stochastic")


def format_methods(fmts: Sequence[str], roundings: Sequence[str] = ("nearest",), ranks: Sequence[int] = (32,),
                   policy: SelectivePolicy | None = None, damping: float = 1e-3, seed: int = 0) -> list[Method]:
    """For each wire format and rounding: Euclidean, GIFT full, GIFT low rank k (each of ``ranks``)
    and the selective policy, all in that format with its own block (256 for e4m3/e5m2, 16 for
    nvfp4, 32 for the MX formats): the same bytes per value within a (format, rounding) group.
    Labels: "<fmt>[ sr] <geometry>", geometry one of euclid, gift full, gift k=K, gift policy.
    Stochastic rounding is seeded with ``seed`` + the step index."""
    pol = policy or SelectivePolicy()
    dmp = float(damping)
    for rnd in roundings:
        if rnd not in ROUNDINGS:
            raise ValueError(f"unknown rounding {rnd!r}; known: {ROUNDINGS}")
    out = []
    for fmt in fmts:
        blk = resolve_block(fmt, None)
        for rnd in roundings:
            tag = f"{fmt}{' sr' if rnd == 'stochastic' else ''}"
            kw = dict(fmt=fmt, block=blk, rounding=rnd, seed=int(seed))
            out.append(Method(f"{tag} euclid", geometry="euclid", **kw))
            out.append(Method(f"{tag} gift full", build=lambda c, sp: Geometry.from_kfac(c.layout, sp, damping=dmp),
                              geometry="gift full", **kw))
            for k in ranks:
                out.append(Method(f"{tag} gift k={k}", **kw, geometry=f"gift k={k}",
                                  build=lambda c, sp, k=k: Geometry.from_kfac(c.layout, sp, rank=k, damping=dmp)))
            out.append(Method(f"{tag} gift policy", build=lambda c, sp: select(c.layout, sp, pol, dmp),
                              geometry="gift policy", **kw))
    return out


def _alg(algorithm: str) -> tuple[str, dict]:
    """"hierarchical:2" -> ("hierarchical", {"local_size": 2}); other names as they are"""
    name, _, ls = algorithm.partition(":")
    return name, ({"local_size": int(ls)} if ls else {})


def _rkw(method: Method, step: int) -> dict:
    """rounding / seed keywords of one step's reduction"""
    if method.rounding == "stochastic":
        return {"rounding": "stochastic", "seed": method.seed + step}
    return {}


def _method_bytes(method: Method, layout: Layout) -> float:
    """Wire bytes per value of one allreduce message."""
    if method.per_tensor:
        total = sum(message_nbytes(s.size, method.fmt, min(max(s.size, 1), MAX_BLOCK)) for s in layout)
        return total / max(layout.size, 1)
    return bytes_per_value(method.fmt, method.block)


def _reduce_sim(method: Method, geo, inputs: list[np.ndarray], layout: Layout, algorithm: str,
                step: int = 0) -> np.ndarray:
    """The reference simulator's result (rank 0's; all ranks are identical), flat float32."""
    alg, lkw = _alg(algorithm)
    if method.per_tensor:
        out = np.empty(layout.size, np.float32)
        for s in layout:
            blk = check_block(min(max(s.size, 1), MAX_BLOCK))
            out[s.offset:s.stop] = simulate_allreduce([x[s.offset:s.stop] for x in inputs], method.fmt, blk,
                                                      "avg", alg, **lkw, **_rkw(method, step))[0]
        return out
    return simulate_gift_allreduce(inputs, geo, method.fmt, method.block, "avg", alg, **lkw,
                                   **_rkw(method, step))[0]


def _reduce_mpi(method: Method, geo, mine: np.ndarray, layout: Layout, comm, algorithm: str,
                step: int = 0) -> np.ndarray:
    """This rank's result of giftcomm.allreduce / gift_allreduce over ``comm``, flat float32."""
    alg, lkw = _alg(algorithm)
    if method.per_tensor:
        out = np.empty(layout.size, np.float32)
        for s in layout:
            blk = min(max(s.size, 1), MAX_BLOCK)
            out[s.offset:s.stop] = giftcomm.allreduce(mine[s.offset:s.stop], comm=comm, op="avg", fmt=method.fmt,
                                                      block=blk, algorithm=alg, **lkw, **_rkw(method, step))
        return out
    return giftcomm.gift_allreduce(mine, geo, comm=comm, op="avg", fmt=method.fmt, block=method.block,
                                   algorithm=alg, **lkw, **_rkw(method, step))


def evaluate(case: Case, methods: Sequence[Method], comm=None, metric_damping: float = 1e-3,
             algorithm: str = "ring", progress: bool = False, cache: dict | None = None) -> list[dict] | None:
    """Run every method on every step of ``case``; return one dict of metrics per method.

    comm: None (reference simulator only) or an mpi4py communicator of ``case.ranks`` ranks
    (collective; each rank reduces its own buffers, rank 0 also simulates and compares bit for
    bit; only rank 0 returns the rows, other ranks return None). algorithm: ring, direct,
    doubling, hierarchical:L (nodes of L ranks). cache: a dict kept across calls on the same
    ``case`` (e.g. one per algorithm): the factor spectra and the geometries of methods with a
    ``geometry`` name are computed once.
    Row keys: method, fmt, rounding, algorithm, geometry, bytes_per_value, rel_l2, whitened, whitened_pooled, flipped, zeroed,
    adam_cos, transformed (fraction of elements), gflop (forward + inverse, whole buffer),
    per_segment_whitened (name -> ratio), per_segment_l2, mpi_equals_sim (None without comm),
    per_step_rel_l2 / per_step_whitened (one value per step of ``case.grads``; the other error
    columns are the last step's).
    """
    root = comm is None or comm.Get_rank() == 0
    if comm is not None and comm.Get_size() != case.ranks:
        raise ValueError(f"case has {case.ranks} ranks of data but the communicator has {comm.Get_size()}")
    cache = {} if cache is None else cache
    if cache.get("case") is not case:
        cache.clear()
        cache["case"] = case
    if "spectra" not in cache:
        cache["spectra"] = _spectra(case.factors)
    spectra = cache["spectra"]
    metric = WhiteningMetric(case.layout, case.metric, metric_damping) if root else None
    exact = [np.mean([x.astype(np.float64) for x in step], axis=0) for step in case.grads]
    exact_update = adam_update(exact) if root else None
    rows = []
    for method in methods:
        t0 = time.perf_counter()
        if method.build is None:
            geo = None
        elif method.geometry is None:
            geo = method.build(case, spectra)
        else:
            key = ("geometry", method.geometry)
            if key not in cache:
                cache[key] = method.build(case, spectra)
            geo = cache[key]
        results, equal = [], True
        for si, step in enumerate(case.grads):
            if comm is None:
                results.append(_reduce_sim(method, geo, step, case.layout, algorithm, si))
                continue
            mine = _reduce_mpi(method, geo, step[comm.Get_rank()], case.layout, comm, algorithm, si)
            digests = comm.gather(hashlib.sha256(mine.tobytes()).hexdigest(), root=0)
            if root:
                want = _reduce_sim(method, geo, step, case.layout, algorithm, si)
                equal &= mine.tobytes() == want.tobytes() and len(set(digests)) == 1
                results.append(mine)
        if not root:
            continue
        ratios = metric.ratios(results[-1], exact[-1])
        num = sum(np.linalg.norm(metric.whiten(k, (results[-1] - exact[-1])[case.layout[k].offset:case.layout[k].stop]))**2
                  for k in ratios)
        den = sum(np.linalg.norm(metric.whiten(k, exact[-1][case.layout[k].offset:case.layout[k].stop]))**2
                  for k in ratios)
        transformed = 0 if geo is None else sum(t.segment.size for t in geo.transforms if not t.is_identity)
        rows.append({
            "method": method.label,
            "fmt": method.fmt,
            "rounding": method.rounding,
            "algorithm": algorithm,
            "geometry": method.geometry or method.label,
            "bytes_per_value": _method_bytes(method, case.layout),
            "rel_l2": relative_l2(results[-1], exact[-1]),
            "whitened": metric.aggregate(ratios),
            "whitened_pooled": float(np.sqrt(num / den)) if den > 0 else float("nan"),
            "flipped": sign_flip_fraction(results[-1], exact[-1]),
            "zeroed": zeroed_fraction(results[-1], exact[-1]),
            "adam_cos": cosine(adam_update(results), exact_update),
            "transformed": transformed / case.layout.size,
            "gflop": 0.0 if geo is None else geo.flops() / 1e9,
            "per_segment_whitened": ratios,
            "per_segment_l2": {s.name: relative_l2(results[-1][s.offset:s.stop], exact[-1][s.offset:s.stop])
                               for s in case.layout},
            "mpi_equals_sim": None if comm is None else bool(equal),
            # every captured step on its own (the columns above are the last step's)
            "per_step_rel_l2": [relative_l2(r, e) for r, e in zip(results, exact)],
            "per_step_whitened": [metric.aggregate(metric.ratios(r, e)) for r, e in zip(results, exact)],
        })
        if progress:
            r = rows[-1]
            print(f"  {method.label:<18} whitened {r['whitened']:.4g} l2 {r['rel_l2']:.4g} "
                  f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return rows if root else None


def format_table(rows: Sequence[dict], reference: str = "e4m3 block256") -> str:
    """Markdown table of evaluate()'s rows; 'x ref' columns divide by the ``reference`` row."""
    ref = next((r for r in rows if r["method"] == reference), None)
    out = ["| method | B/value | rel L2 | L2 / ref | whitened | ref / whitened | flipped | zeroed | "
           "Adam cos | transformed | GFLOP fwd+inv | mpi==sim |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        l2x = f"{r['rel_l2'] / ref['rel_l2']:.2f}" if ref and ref["rel_l2"] > 0 else "-"
        wx = f"{ref['whitened'] / r['whitened']:.2f}" if ref and r["whitened"] > 0 else "-"
        eq = "-" if r["mpi_equals_sim"] is None else ("yes" if r["mpi_equals_sim"] else "**NO**")
        out.append(f"| {r['method']} | {r['bytes_per_value']:.4f} | {r['rel_l2']:.3e} | {l2x} | "
                   f"{r['whitened']:.3e} | {wx} | {r['flipped']:.2e} | {r['zeroed']:.2e} | "
                   f"{r['adam_cos']:.6f} | {r['transformed']:.0%} | {r['gflop']:.3g} | {eq} |")
    return "\n".join(out)


def format_per_step(rows: Sequence[dict], reference: str = "e4m3 block256") -> str:
    """Markdown table: per captured step, each method's whitened-error gain (ref / whitened) and L2
    ratio (L2 / ref) against the ``reference`` row, then min / median / max over the steps."""
    ref = next((r for r in rows if r["method"] == reference), None)
    if ref is None or "per_step_whitened" not in ref:
        return ""
    steps = len(ref["per_step_whitened"])
    out = ["| method | " + " | ".join(f"step {i} gain / L2x" for i in range(steps)) + " | gain min-median-max | L2x min-median-max |",
           "| --- |" + " ---: |" * (steps + 2)]
    for r in rows:
        g = [rw / w if w > 0 else float("nan") for rw, w in zip(ref["per_step_whitened"], r["per_step_whitened"])]
        l2 = [x / rx if rx > 0 else float("nan") for x, rx in zip(r["per_step_rel_l2"], ref["per_step_rel_l2"])]
        cells = " | ".join(f"{a:.2f}x / {b:.2f}" for a, b in zip(g, l2))
        out.append(f"| {r['method']} | {cells} | {min(g):.2f} - {float(np.median(g)):.2f} - {max(g):.2f} | "
                   f"{min(l2):.2f} - {float(np.median(l2)):.2f} - {max(l2):.2f} |")
    return "\n".join(out)


def _variants(rows: Sequence[dict]) -> list[tuple[str, dict, dict]]:
    """(label prefix, euclid row, geometry -> GIFT row) per (format, rounding) group of
    format_methods()'s rows; geometry one of "gift full", "gift k=K", "gift policy"."""
    by = {r["method"]: r for r in rows}
    out = []
    for lab in [r["method"][: -len(" euclid")] for r in rows if r["method"].endswith(" euclid")]:
        gifts = {m[len(lab) + 1:]: r for m, r in by.items() if m.startswith(f"{lab} gift ")}
        out.append((lab, by[lab + " euclid"], gifts))
    return out


def _fmt_rounding(lab: str, row: dict) -> tuple[str, str]:
    """(format, rounding) of a row (older rows without the keys: from the label)."""
    if "fmt" in row:
        return row["fmt"], row["rounding"]
    return lab.removesuffix(" sr"), "stochastic" if lab.endswith(" sr") else "nearest"


def format_summary(blocks: Sequence[tuple[str, str, Sequence[dict]]]) -> str:
    """One line per (case, algorithm, format, rounding) of format_methods()'s rows: the Euclidean
    whitened and L2 errors, and for each GIFT geometry its gain (Euclidean whitened / GIFT
    whitened: > 1 is better) and its L2 ratio (GIFT L2 / Euclidean L2: > 1 is worse), at the
    same bytes per value. blocks: (case name, algorithm, rows)."""
    out = ["| case | algorithm | format | rounding | B/value | euclid whitened | euclid L2 | full: gain / L2x | "
           "low rank: gain / L2x | policy: gain / L2x |",
           "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for case, alg, rows in blocks:
        for lab, e, gifts in _variants(rows):
            cells = []
            for geo in ("gift full", "gift k=", "gift policy"):
                name = next((m for m in gifts if m.startswith(geo)), None)
                g = gifts.get(name)
                if g is None or g["whitened"] <= 0 or e["rel_l2"] <= 0:
                    cells.append("-")
                    continue
                tag = f"{name.removeprefix('gift ')}: " if geo == "gift k=" else ""
                cells.append(f"{tag}{e['whitened'] / g['whitened']:.2f}x / {g['rel_l2'] / e['rel_l2']:.2f}")
            fmt, rnd = _fmt_rounding(lab, e)
            out.append(f"| {case} | {alg} | {fmt} | {rnd} | {e['bytes_per_value']:.4f} | {e['whitened']:.3e} | "
                       f"{e['rel_l2']:.3e} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def format_errors(blocks: Sequence[tuple[str, str, Sequence[dict]]]) -> str:
    """The absolute errors behind format_summary(): per format, rounding and algorithm (rows
    grouped by format and rounding, algorithms side by side), the whitened-norm and the relative
    L2 error of Euclidean, GIFT full, GIFT low rank and the default policy. One case only (the
    first block's)."""
    if not blocks:
        return ""
    case = blocks[0][0]
    lines: dict[tuple[str, str], list[str]] = {}
    head = None
    for c, alg, rows in blocks:
        if c != case:
            continue
        for lab, e, gifts in _variants(rows):
            names = ["euclid"] + [m.removeprefix("gift ") for m in gifts]
            head = head or names
            fmt, rnd = _fmt_rounding(lab, e)
            cols = [e] + list(gifts.values())
            w = " | ".join(f"{r['whitened']:.3g}" for r in cols)
            l2 = " | ".join(f"{r['rel_l2']:.3g}" for r in cols)
            best = min(gifts.values(), key=lambda r: r["whitened"]) if gifts else None
            gain = f"{e['whitened'] / best['whitened']:.2f}x ({best['method'][len(lab) + 6:]})" if best else "-"
            lines.setdefault((fmt, rnd), []).append(
                f"| {fmt} | {rnd} | {e['bytes_per_value']:.4f} | {alg} | {w} | {l2} | {gain} |")
    if head is None:
        return ""
    out = ["| format | rounding | B/value | algorithm | " + " | ".join(f"whitened {n}" for n in head) + " | "
           + " | ".join(f"L2 {n}" for n in head) + " | best GIFT gain |",
           "| --- | --- | ---: | --- |" + " ---: |" * (2 * len(head)) + " ---: |"]
    for v in lines.values():
        out += v
    return "\n".join(out)


# ----------------------------------------------------------------------------------- plots
def plot_synthetic(results: Sequence[dict], path: str) -> None:
    """Whitened-norm error against condition number, one panel per spectrum, one line per method."""
    from studies.plotting import pyplot, save

    plt = pyplot()

    spectra = sorted({r["case"]["spectrum"] for r in results})
    fig, axes = plt.subplots(1, len(spectra), figsize=(6 * len(spectra), 4.5), squeeze=False)
    for ax, sp in zip(axes[0], spectra):
        sel = sorted([r for r in results if r["case"]["spectrum"] == sp], key=lambda r: r["case"]["cond"])
        conds = [r["case"]["cond"] for r in sel]
        names = [row["method"] for row in sel[0]["rows"]]
        for j, name in enumerate(names):
            ys = [next(x["whitened"] for x in r["rows"] if x["method"] == name) for r in sel]
            ax.plot(conds, ys, marker="osD^v<>ph*Xd"[j % 12], ms=5, color=plt.cm.tab20(j / max(len(names), 1)),
                    ls="-" if name.startswith("gift") else "--", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("condition number of each factor")
        ax.set_ylabel("whitened-norm relative error")
        ax.set_title(f"synthetic Kronecker gradients, {sp} spectrum, P={sel[0]['ranks']}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    save(fig, path)


def plot_rows(rows: Sequence[dict], title: str, path: str) -> None:
    """Bars of the whitened and the plain relative L2 error per method (log scale)."""
    from studies.plotting import pyplot, save

    plt = pyplot()

    names = [r["method"] for r in rows]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(max(7, 0.75 * len(names)), 4.5))
    ax.bar(x - 0.2, [r["whitened"] for r in rows], 0.4, label="whitened-norm error")
    ax.bar(x + 0.2, [r["rel_l2"] for r in rows], 0.4, label="relative L2 error")
    ax.set_yscale("log")
    ax.set_xticks(x, names, rotation=35, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)


# ----------------------------------------------------------------------------------- CLI


def _commit() -> str:
    """The checkout's HEAD commit (short), '+dirty' when tracked files under studies/ or giftcomm/
    differ from it; 'unknown' outside git."""
    import subprocess

    from studies import ROOT

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "studies", "giftcomm"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty (studies/ or giftcomm/)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies fidelity", description=__doc__.split("\n")[0],
                                parents=[parent_parser(seed=0)])
    p.add_argument("what", nargs="?", default="synthetic", choices=["synthetic", "real", "cost"])
    p.add_argument("--mpi", action="store_true", help="reduce over MPI.COMM_WORLD and check against the simulator")
    p.add_argument("--ranks", type=int, default=4, help="simulated ranks (synthetic, without --mpi)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps of gradients (Adam state length): synthetic: generated (default 3); real: the "
                        "first N captured steps (default: all)")
    p.add_argument("--conds", type=float, nargs="+", default=[1e2, 1e3, 1e4, 1e5])
    p.add_argument("--spectra", nargs="+", default=["power", "exp"], choices=["power", "exp"])
    p.add_argument("--shapes", type=_shapes, default=[(256, 512), (512, 256)], help="e.g. 256x512,512x256")
    p.add_argument("--ks", type=int, nargs="+", default=[8, 32, 128], help="low-rank k of the GIFT rows")
    p.add_argument("--data", default=None, help="real: the .npz from `python -m studies.gradients`")
    p.add_argument("--segments", default=None, metavar="REGEX",
                   help="real: only the parameters whose name matches this regular expression (e.g. "
                        "'blocks\\.[036]\\.' for 3 of the 7 blocks; default: all)")
    p.add_argument("--metric-damping", type=float, default=1e-3)
    p.add_argument("--damping", type=float, default=1e-3, help="damping of the geometries")
    p.add_argument("--geometry-factors", default="ema", choices=["ema", "capture"],
                   help="real: build geometries from the EMA factors before the capture (default) or from "
                        "the capture batches' own factors (the metric's: an oracle)")
    p.add_argument("--methods", default=None, help="comma-separated labels to run (default: all)")
    p.add_argument("--algos", default="ring",
                   help="comma-separated algorithms, each run on every case: ring, direct, doubling, "
                        "hierarchical:L (nodes of L ranks) (default ring)")
    p.add_argument("--fmt", default=None,
                   help="formats study: comma-separated wire formats (e.g. e4m3,nvfp4,mxfp4,mxfp8); each gets euclid, "
                        "gift full, gift k (the first of --ks) and gift policy with the format's own block, per "
                        "--rounding, plus a summary table (default: the default method list, all e4m3/256)")
    p.add_argument("--rounding", default="nearest",
                   help="formats study: comma-separated roundings: nearest, stochastic (seeded with --seed + the "
                        "step index) (default nearest)")
    # the spellings of earlier runs (perf/results); one spelling per idea across the studies
    p.add_argument("--algorithm", "--algorithms", dest="algos", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--fmts", dest="fmt", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--roundings", dest="rounding", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    add_json(p, help="write the results here")
    add_out(p, help="write the markdown tables here")
    p.add_argument("--png", metavar="FILE", default=None, help="write a PNG plot here")
    p.add_argument("--budget", type=float, default=None,
                   help="also run the budget-aware policy with this fraction of the collective time")
    p.add_argument("--models", nargs="+", default=["llama-small", "llama-300m", "llama-600m"],
                   help="cost: models (llama-small uses --data for its real factors when given)")
    p.add_argument("--repeats", type=int, default=3, help="cost: timed repeats (median) after a warm-up")
    p.add_argument("--bandwidth", type=float, default=125e6, help="cost: link bytes/s (1 Gbit/s = 125e6)")
    p.add_argument("--energy-rule", action="store_true",
                   help="also run the selective policy with the old energy rank rule")
    return p


def _policies(a) -> tuple[SelectivePolicy, dict]:
    extra = {}
    extra["gift policy fresh buffers"] = fresh_buffer_policy()
    extra["gift policy per-segment"] = SelectivePolicy(budget=None)  # the default before the time budget
    if a.energy_rule:
        extra["gift policy energy-rule"] = SelectivePolicy(budget=None, rank_rule="energy")
    if a.budget is not None:
        extra[f"gift budget {a.budget:g}"] = SelectivePolicy.budgeted(fraction=a.budget)
    return SelectivePolicy(), extra


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if a.what == "cost":
        return cost_main(a)
    comm = None
    if a.mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    root = comm is None or comm.Get_rank() == 0
    ranks = comm.Get_size() if comm is not None else a.ranks
    policy, extra = _policies(a)
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    if a.fmt:
        methods = format_methods(split(a.fmt), split(a.rounding), a.ks[:1], policy, a.damping, a.seed)
    else:
        methods = default_methods(a.ks, policy, extra, a.damping)
    algorithms = split(a.algos)
    summary = []
    if a.methods:
        keep = [x.strip() for x in a.methods.split(",")]
        methods = [m for m in methods if m.label in keep]
    header = [f"$ {'mpiexec -n %d ' % ranks if comm is not None else ''}python -m studies fidelity "
              + " ".join(sys.argv[1:] if argv is None else argv),
              f"machine: {platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}; P = {ranks}; "
              f"{'MPI (checked against the simulator)' if comm is not None else 'reference simulator'}; "
              f"algorithm{'s' if len(algorithms) > 1 else ''} {', '.join(algorithms)}; damping {a.damping:g}; "
              f"metric damping {a.metric_damping:g}; seed {a.seed}; loadavg at start {load_average()}",
              f"commit: {_commit()}"]
    t_start = time.perf_counter()
    results, md = [], list(header)
    if a.what == "synthetic":
        cases = [(sp, c) for sp in a.spectra for c in a.conds]
        for sp, cond in cases:
            case = synthetic_case(a.shapes, cond, sp, ranks, a.steps or 3, a.seed)
            if root and not a.no_progress:
                print(f"[{case.name}]", file=sys.stderr, flush=True)
            cache: dict = {}
            for alg in algorithms:
                rows = evaluate(case, methods, comm, a.metric_damping, alg, progress=root and not a.no_progress,
                                cache=cache)
                if root:
                    results.append({"case": case.info | {"name": case.name}, "ranks": ranks, "algorithm": alg,
                                    "rows": rows})
                    summary.append((case.name, alg, rows))
                    md += ["", f"### {case.name} (shapes {a.shapes}, {a.steps or 3} steps), {alg}", "",
                           format_table(rows, rows[0]["method"] if a.fmt else "e4m3 block256")]
    else:
        from studies.cases import load_case

        if not a.data:
            raise SystemExit("real: give --data PATH (capture it with `python -m studies.gradients`)")
        case = load_case(a.data)
        if a.geometry_factors == "capture":
            case.factors = case.metric
            case.name += " [geometry from the capture batches' factors]"
        if a.segments:
            case = subset_case(case, a.segments)
        if a.steps:
            case.grads = case.grads[: a.steps]
            case.name += f" [first {len(case.grads)} captured step{'s' if len(case.grads) > 1 else ''}]"
        if comm is None and case.ranks != a.ranks and root:
            print(f"note: the data has {case.ranks} ranks' gradients; simulating P = {case.ranks}", file=sys.stderr)
        cache = {}
        for alg in algorithms:
            rows = evaluate(case, methods, comm, a.metric_damping, alg, progress=root and not a.no_progress,
                            cache=cache)
            if root:
                results.append({"case": case.info | {"name": case.name}, "ranks": case.ranks, "algorithm": alg,
                                "rows": rows})
                summary.append((case.name, alg, rows))
                refname = rows[0]["method"] if a.fmt else "e4m3 block256"
                md += ["", f"### {case.name}, {alg}", "", format_table(rows, refname)]
                per_step = format_per_step(rows, refname)
                if per_step:
                    md += ["", f"Per captured step (gain = {refname} whitened / method whitened; "
                           f"L2x = method rel L2 / {refname} rel L2):", "", per_step]
    if not root:
        return 0
    if a.fmt:
        md[len(header):len(header)] = ["", "### Summary: GIFT vs Euclidean at the same bytes per value "
                                       "(gain = euclid whitened / gift whitened; L2x = gift L2 / euclid L2)", "",
                                       format_summary(summary), "",
                                       f"### Errors per format, rounding and algorithm ({summary[0][0]}; whitened = "
                                       "whitened-norm relative error, L2 = relative L2 error; best GIFT gain = "
                                       "euclid whitened / the smallest GIFT whitened)", "",
                                       format_errors(summary)]
    md.append("")
    md.append(f"wall {time.perf_counter() - t_start:.0f} s; loadavg at end {load_average()}")
    _emit("\n".join(md), a.out, a.json, {"header": header, "results": results})
    if a.png:
        if a.what == "synthetic":
            plot_synthetic(results, a.png)
        else:
            plot_rows(results[0]["rows"], f"{results[0]['case']['name']}, P={results[0]['ranks']}", a.png)
    if comm is not None and not all(r["mpi_equals_sim"] for res in results for r in res["rows"]):
        print("MPI result differs from the simulator", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------------- cost
def _orthonormal(rng, d: int, cache: dict) -> np.ndarray:
    if d not in cache:
        cache[d], _ = np.linalg.qr(rng.standard_normal((d, d)))
    return cache[d]


def _synthetic_spectrum(rng, d: int, cond: float, cache: dict):
    from giftcomm.geometry import Spectrum

    vals = np.arange(1, d + 1, dtype=np.float64) ** -(math.log(cond) / math.log(d))
    return Spectrum(vals / vals.mean(), _orthonormal(rng, d, cache), 1.0)


def cost_models(names: Sequence[str], data: str | None, cond: float = 1e4, seed: int = 0) -> list[dict]:
    """Per model: layout of what is timed, factor spectra, repeat count (blocks), total values.

    llama-300m / llama-600m: one transformer block (giftcomm.perf.geometry_cost.block_shapes),
    synthetic power-law spectra of condition number ``cond``, x blocks. llama-small: the whole
    workload model, with the captured EMA factors from ``data`` when given (else synthetic)."""
    from giftcomm.geometry import Spectrum
    from giftcomm.perf.geometry_cost import MODELS, block_shapes

    rng = np.random.default_rng(seed)
    cache: dict = {}
    out = []
    for name in names:
        if name == "llama-small":
            if data:
                from studies.cases import load_case

                case = load_case(data)
                spectra = {k: (Spectrum.from_matrix(a), Spectrum.from_matrix(g)) for k, (a, g) in case.factors.items()}
                out.append({"model": name, "layout": case.layout, "spectra": spectra, "repeat": 1,
                            "factors": "captured KFAC (EMA)"})
                continue
            import torch

            from studies.workloads.llama import CONFIGS, Llama

            model = Llama(CONFIGS["small"])
            entries = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
            layout = Layout(entries)
            lin = {n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
            spectra = {f"{n}.weight": (_synthetic_spectrum(rng, layout[f"{n}.weight"].matrix_shape[1], cond, cache),
                                       _synthetic_spectrum(rng, layout[f"{n}.weight"].matrix_shape[0], cond, cache))
                       for n in lin}
            out.append({"model": name, "layout": layout, "spectra": spectra, "repeat": 1,
                        "factors": f"synthetic power-law cond {cond:g}"})
            continue
        entries = []
        for names_, shape, count in block_shapes(name):
            parts = names_.split("/")
            entries += [(parts[j] if len(parts) == count else f"{names_}{j}", shape) for j in range(count)]
        layout = Layout(entries)
        spectra = {n: (_synthetic_spectrum(rng, shp[1], cond, cache), _synthetic_spectrum(rng, shp[0], cond, cache))
                   for n, shp in entries}
        out.append({"model": name, "layout": layout, "spectra": spectra, "repeat": MODELS[name]["blocks"],
                    "factors": f"synthetic power-law cond {cond:g}, one block x {MODELS[name]['blocks']}"})
    return out


# extra seconds per element of forward + inverse writing fresh output arrays on the development
# VM: the page faults of two fresh buffers (~0.4 ns/value each, no transparent huge pages) plus
# the inverse's copies of the identity segments (perf/results/gift-cost.md)
FRESH_OUTPUT_SECONDS_DEV_VM = 1.2e-9


def fresh_buffer_policy(bandwidth: float = 125e6) -> SelectivePolicy:
    """The default policy with the time model charging fresh output buffers (how gift_allreduce
    called the geometry when this was written: ``forward(x)``, ``inverse(result)``)."""
    from giftcomm.geometry import TransformTimeModel

    return SelectivePolicy(bandwidth=bandwidth, time_model=TransformTimeModel(fresh_output_seconds=FRESH_OUTPUT_SECONDS_DEV_VM))


def cost_geometries(layout: Layout, spectra: Mapping, ks: Sequence[int], budget: float | None,
                    bandwidth: float) -> dict:
    """label -> Geometry of the variants compared in the cost table."""
    from giftcomm.geometry import Spectrum

    geos = {"gift full": Geometry.from_kfac(layout, spectra)}
    for k in ks:
        geos[f"gift k={k}"] = Geometry.from_kfac(layout, spectra, rank=k)
    geos["gift policy (default)"] = select(layout, spectra, SelectivePolicy(bandwidth=bandwidth))
    geos["gift policy fresh buffers"] = select(layout, spectra, fresh_buffer_policy(bandwidth))
    geos["gift policy per-segment"] = select(layout, spectra, SelectivePolicy(budget=None))
    if budget is not None:
        geos[f"gift policy budget {budget:g}"] = select(layout, spectra, SelectivePolicy.budgeted(budget, 4, bandwidth))
    diag = {}
    for k, (sa, sg) in spectra.items():
        diag[k] = tuple(Spectrum.from_diagonal(np.einsum("ij,j,ij->i", s.vectors, s.values, s.vectors)) for s in (sa, sg))
    geos["diagonal"] = Geometry.diagonal(layout, diag)
    geos["hadamard"] = Geometry.hadamard(layout, seed=0, min_size=4096)
    return geos


def _min_time(run, repeats: int) -> float:
    """The minimum of ``repeats`` timed runs after a warm-up (the least disturbed run)."""
    return time_calls(run, repeats, warmup=1, stat="min")[0]


def time_geometry(geo: Geometry, x: np.ndarray, repeats: int, reuse: bool = False) -> float:
    """Seconds of ``geo.inverse(geo.forward(x))`` as gift_allreduce calls them (fresh output
    buffers), or (``reuse``) forward into a reused buffer and inverse in place on it (what a
    collective that keeps a workspace and owns its result buffer can do: no fresh pages, and the
    inverse skips the identity segments)."""
    if not reuse:
        return _min_time(lambda: geo.inverse(geo.forward(x)), repeats)
    y = np.empty(geo.size, np.float32)
    return _min_time(lambda: geo.inverse(geo.forward(x, out=y), out=y), repeats)


def _single(t) -> Geometry:
    """A one-segment Geometry holding transform ``t`` (for timing a segment alone)."""
    from giftcomm.geometry.transform import SegmentTransform

    seg = t.segment
    lay = Layout([(seg.name, seg.shape)])
    return Geometry(lay, [SegmentTransform(lay[seg.name], t.left, t.right, t.info)])


def cost_main(a) -> int:
    """The ``cost`` subcommand: forward + inverse time per segment and per model for each
    geometry variant, against the FP8 ring allreduce's predicted time at P = 4 on a
    ``--bandwidth`` link (giftcomm.cost.model.predict, and the wire-only formula); fits the
    policy's TransformTimeModel to the measurements."""
    from giftcomm.cost.model import Calibration, LinkCost, Topology, predict
    from giftcomm.geometry import TransformTimeModel, collective_seconds

    rng = np.random.default_rng(a.seed)
    tm = TransformTimeModel()
    cal = Calibration(net=LinkCost(alpha=60e-6, beta=1.0 / a.bandwidth))
    lines = [f"$ {os.environ.get('OPENBLAS_NUM_THREADS') and 'OPENBLAS_NUM_THREADS=' + os.environ['OPENBLAS_NUM_THREADS'] + ' ' or ''}"
             f"python -m studies fidelity {' '.join(getattr(a, 'argv', ['cost']))}",
             f"machine: {platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}, BLAS threads "
             f"{os.environ.get('OPENBLAS_NUM_THREADS', 'default')}; times: min of {a.repeats} after a warm-up; "
             f"loadavg at start {load_average()}",
             f"collective: FP8 E4M3 ring allreduce, block 256 ({bytes_per_value('e4m3', 256):.4f} B/value), "
             f"P = 4, {a.bandwidth * 8 / 1e9:g} Gbit/s links: costmodel.predict (alpha 60 us, codec rates of the "
             f"built-in calibration) and wire only 2(P-1)/P n B / bw", ""]
    seg_rows, model_rows, fit = [], [], []
    summary = {}
    for mdl in cost_models(a.models, a.data, seed=a.seed):
        layout, rep = mdl["layout"], mdl["repeat"]
        n_total = layout.size * rep
        t_pred = predict("ring", n_total, Topology(4, 4, 1), get_format("e4m3"), 256, cal)
        t_wire = collective_seconds(n_total, 4, a.bandwidth)
        geos = cost_geometries(layout, mdl["spectra"], a.ks, a.budget, a.bandwidth)
        if a.methods:
            keep = [m.strip() for m in a.methods.split(",")]
            geos = {k: g for k, g in geos.items() if k in keep}
        x = rng.standard_normal(layout.size).astype(np.float32)
        timed: dict = {}
        for label, geo in geos.items():
            for t in geo.transforms:
                seg = t.segment
                key = (seg.shape, t.left.kind, t.right.kind, t.left.rank, t.right.rank)
                if t.is_identity or key in timed:
                    continue
                secs = timed[key] = time_geometry(_single(t), x[: seg.size], a.repeats, reuse=True)
                ks = "/".join("-" if s.is_identity else str(s.rank) for s in (t.left, t.right))
                pred = tm.transform_seconds(t)
                seg_rows.append(f"| {mdl['model']} | {label} | {seg.name} | {'x'.join(map(str, seg.shape))} | "
                                f"{t.kind} | {ks} | {t.flops() / seg.size:.0f} | {secs * 1e3:.2f} | "
                                f"{pred * 1e3:.2f} | {secs / seg.size * 1e9:.2f} |")
                fit.append((seg.size, tm.passes(t.left.kind, t.right.kind), t.flops(), secs))
            # the whole geometry as gift_allreduce runs it (identity: skipped, no cost)
            total = 0.0 if geo.is_identity else time_geometry(geo, x, a.repeats) * rep
            reused = 0.0 if geo.is_identity else time_geometry(geo, x, a.repeats, reuse=True) * rep
            predicted = tm.geometry_seconds(geo) * rep
            frac = sum(t.segment.size for t in geo.transforms if not t.is_identity) / layout.size
            model_rows.append(f"| {mdl['model']} | {label} | {frac:.0%} | {geo.flops() * rep / 1e9:.3g} | "
                              f"{total:.3f} | {reused:.3f} | {predicted:.3f} | {t_pred:.3f} | {total / t_pred:.1%} | "
                              f"{reused / t_pred:.1%} |")
            summary.setdefault(mdl["model"], {})[label] = {
                "transform_s": total, "transform_out_reused_s": reused, "predicted_s": predicted,
                "collective_s": t_pred, "wire_s": t_wire, "transformed": frac, "gflop": geo.flops() * rep / 1e9}
            if not a.no_progress:
                print(model_rows[-1], file=sys.stderr, flush=True)
        lines.append(f"- {mdl['model']}: {n_total / 1e6:.1f}M values in the timed matrices "
                     f"({mdl['factors']}); collective {t_pred * 1e3:.1f} ms predicted, {t_wire * 1e3:.1f} ms wire only")
    lines += ["", "| model | geometry | transformed | GFLOP fwd+inv | measured s fwd+inv | same, workspace + in-place inverse | "
              "time model s | collective s (P=4) | measured / collective | workspace / collective |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
              *model_rows, "", "| model | geometry | segment | out x in | transform | k out/in | flop/elem | "
              "ms fwd+inv | time model ms | ns/elem |", "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
              *seg_rows]
    if len(fit) >= 4:
        arr = np.array(fit)
        small = arr[:, 0] <= tm.cache_elements
        cols = np.stack([arr[:, 1] * arr[:, 0] * small, arr[:, 1] * arr[:, 0] * ~small, arr[:, 2],
                         np.ones(len(fit))], axis=1)
        w = 1.0 / arr[:, 3]  # fit relative errors
        coef, *_ = np.linalg.lstsq(cols * w[:, None], np.ones(len(fit)), rcond=None)
        lines += ["", f"time model fit (least squares on relative error over the segment rows; passes incl. the "
                      f"output write): seconds_per_pass {coef[0]:.3g}, seconds_per_pass_large {coef[1]:.3g}, "
                      f"flops_per_second {1 / coef[2] if coef[2] > 0 else float('inf'):.3g}, seconds_per_segment "
                      f"{coef[3]:.3g} (in force: {tm.seconds_per_pass:.3g}, {tm.seconds_per_pass_large:.3g}, "
                      f"{tm.flops_per_second:.3g}, {tm.seconds_per_segment:.3g})"]
    lines.append(f"loadavg at end {load_average()}")
    _emit("\n".join(lines), a.out, a.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
