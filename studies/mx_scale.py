"""The MX scale rules measured: error and bias of ``mx_scale="ceil"`` against OCP's ``"floor"``.

For every E8M0 format (mxfp8, mxfp8_e5m2, mxfp4; e4m3 and nvfp4 as references), each rule and
each algorithm (direct, ring), P ranks allreduce their gradients (loopback transport, the native
codec) and the result is compared with the exact float64 sum ``s``:

- ``err``: relative L2 error of one call, ``||y - s|| / ||s||``, nearest and stochastic rounding;
- ``mean``: the relative L2 error of the mean of K stochastic calls (seeds 0..K-1). Unbiased
  rounding leaves ``err_stochastic / sqrt(K)`` of it; a deterministic bias (the floor rule's clamp)
  stays whatever K;
- ``shrink``: the bias along the sum, ``<mean - s, s> / <s, s>`` (a clamp makes it negative).

Data: ``--data PATH`` a capture of ``python -m studies.gradients`` (capture step 0: one gradient
per rank); without it, heavy-tailed synthetic gradients (Student t with 3 degrees of freedom
times a per-64k-segment log-uniform scale over 2^-8..2^4, one vector per rank).

    python -m studies mx-scale [--data ~/.cache/giftcomm/gradients-small.npz] [--ranks 4] [--calls 16]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

import giftcomm as gc
from giftcomm.formats import get_format

__all__ = ["measure", "main"]

FORMATS = ("mxfp8", "mxfp8_e5m2", "mxfp4", "e4m3", "nvfp4")


def synthetic(ranks: int, n: int, seed: int = 0) -> list[np.ndarray]:
    """Heavy-tailed gradient-like vectors (module docstring), float32."""
    rng = np.random.default_rng(seed)
    seg = 1 << 16
    scale = np.repeat(np.exp2(rng.uniform(-8, 4, -(-n // seg))), seg)[:n]
    return [(rng.standard_t(3, n) * scale).astype(np.float32) for _ in range(ranks)]


def captured(path: str, ranks: int, limit: int | None) -> list[np.ndarray]:
    """Capture step 0's per-rank gradients of a studies.gradients file (the first ``limit`` values)."""
    g = np.load(path)["grads"]
    if ranks > g.shape[1]:
        raise SystemExit(f"{path} holds {g.shape[1]} ranks' gradients, asked for {ranks}")
    return [np.ascontiguousarray(g[0, r, :limit], dtype=np.float32) for r in range(ranks)]


def measure(xs: list[np.ndarray], calls: int = 16) -> list[dict]:
    """One row per format, rule and algorithm (module docstring)."""
    p = len(xs)
    s = np.sum([x.astype(np.float64) for x in xs], axis=0)
    ns = float(np.dot(s, s))

    def run(f, algorithm, **kw):
        return gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt=f, algorithm=algorithm,
                                                              **kw))[0].astype(np.float64)

    rows = []
    for name in FORMATS:
        base = get_format(name)
        for rule in ("ceil", "floor") if base.scale_kind == "e8m0" else ("",):
            f = base.with_scale_rule(rule) if rule else base
            for algorithm in ("direct", "ring"):
                near = run(f, algorithm)
                stoch = [run(f, algorithm, rounding="stochastic", seed=k) for k in range(calls)]
                mean = np.mean(stoch, axis=0)
                rel = lambda y: float(np.linalg.norm(y - s) / np.sqrt(ns))  # noqa: E731
                rows.append({"fmt": name, "mx_scale": rule or "-", "algorithm": algorithm, "err_nearest": rel(near),
                             "err_stochastic": float(np.mean([rel(y) for y in stoch])), "mean": rel(mean),
                             "unbiased_mean": float(np.mean([rel(y) for y in stoch])) / np.sqrt(calls),
                             "shrink_nearest": float(np.dot(near - s, s) / ns),
                             "shrink_stochastic": float(np.dot(mean - s, s) / ns)})
    return rows


def table(rows: list[dict], calls: int) -> str:
    head = (f"| fmt | mx_scale | algorithm | err nearest | err stochastic | mean of {calls} stochastic | "
            f"(unbiased: err / sqrt({calls})) | shrink nearest | shrink stochastic |")
    out = [head, "|" + " --- |" * 9]
    for r in rows:
        out.append(f"| {r['fmt']} | {r['mx_scale']} | {r['algorithm']} | {r['err_nearest']:.4f} | "
                   f"{r['err_stochastic']:.4f} | {r['mean']:.4f} | {r['unbiased_mean']:.4f} | "
                   f"{r['shrink_nearest']:+.4f} | {r['shrink_stochastic']:+.4f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies mx-scale", description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="a studies.gradients capture (.npz); default: synthetic heavy-tailed data")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--calls", type=int, default=16, help="stochastic calls averaged (default 16)")
    ap.add_argument("--limit", type=int, default=None, help="values per rank (default: all; synthetic: 2^21)")
    a = ap.parse_args(argv)
    xs = captured(a.data, a.ranks, a.limit) if a.data else synthetic(a.ranks, a.limit or 1 << 21)
    what = a.data or "synthetic Student-t(3) x log-uniform segment scales"
    print(f"data: {what}; P = {a.ranks}; {xs[0].size} values per rank\n")
    print(table(measure(xs, a.calls), a.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
