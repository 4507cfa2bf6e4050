"""Allreduce error of the adaptive-precision rows against e4m3, nvfp4 and mxfp4 on captured gradients.

``python perf/adaptive_fidelity.py GRADS.npz [--ranks 4,8] [--fmts e4m3,nvfp4,mxfp4,ada4_5,ada4]
[--algos ring,direct] [--chunks]``

GRADS.npz: a capture of ``python -m studies.gradients`` (``grads``: float32 (steps, R, n), step 0
used). For each P the capture's R shard gradients are folded into P ranks (rank i: the float64 mean
of shards i*R/P .. (i+1)*R/P - 1, as float32), reduced by ``simulate_allreduce`` (op "sum") and
compared with the float64 sum: relative L2 error ``||out - exact|| / ||exact||`` and the wire
bits per value of one message of all n values (``message_nbytes(n, fmt) * 8 / n``).

``--chunks``: instead, per P, the share of the sum's energy in each of the P allreduce chunks
(giftcomm.algorithms.partition.chunk_bounds) and the relative L2 error of one encode/decode of the float32
sum, as one message and as the P chunk messages an allreduce sends: an adaptive row chooses its
tiers per message, so the second shows what the chunking costs it.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from giftcomm.algorithms.partition import chunk_bounds
from giftcomm.formats import get_format, message_nbytes, resolve_block
from giftcomm.reference import codec as ref
from giftcomm.reference import simulate_allreduce


def fold(grads: np.ndarray, p: int) -> list[np.ndarray]:
    """P float32 rank inputs from R shard gradients (R a multiple of P): means of consecutive shards."""
    r = grads.shape[0]
    if r % p:
        raise ValueError(f"{r} captured shards do not fold into {p} ranks")
    return [np.mean(grads[i * (r // p):(i + 1) * (r // p)].astype(np.float64), axis=0).astype(np.float32)
            for i in range(p)]


def rel_l2(out: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(out - exact) / np.linalg.norm(exact))


def chunked_error(v: np.ndarray, name: str, p: int) -> tuple[float, float]:
    """(error of v as one message, error of v cut into the P allreduce chunks) of format ``name``."""
    f = get_format(name)
    b = chunk_bounds(v.size, p, resolve_block(f))
    whole = ref.decode(ref.encode(v, f), v.size, f)
    parts = np.concatenate([ref.decode(ref.encode(v[b[c]:b[c + 1]], f), int(b[c + 1] - b[c]), f) for c in range(p)])
    return rel_l2(whole, v), rel_l2(parts, v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data")
    ap.add_argument("--ranks", default="4,8")
    ap.add_argument("--fmts", default="e4m3,nvfp4,mxfp4,ada4_5,ada4")
    ap.add_argument("--algos", default="ring,direct")
    ap.add_argument("--chunks", action="store_true", help="per-chunk energy and one-encode error, whole vs chunked")
    a = ap.parse_args(argv)
    grads = np.load(a.data)["grads"][0]
    n = grads.shape[1]
    print(f"{a.data}: {grads.shape[0]} shards of {n} values", flush=True)
    for p in (int(v) for v in a.ranks.split(",")):
        xs = fold(grads, p)
        exact = np.sum([v.astype(np.float64) for v in xs], axis=0)
        if a.chunks:
            b = chunk_bounds(n, p, 256)
            e = np.array([np.sum(exact[b[c]:b[c + 1]] ** 2) for c in range(p)])
            print(f"P={p} energy share per chunk: {' '.join(f'{v:.3f}' for v in e / e.sum())}", flush=True)
            for name in a.fmts.split(","):
                whole, parts = chunked_error(exact.astype(np.float32), name, p)
                print(f"P={p} one encode of the sum  {name:8s} whole {whole:.4f} chunked {parts:.4f}", flush=True)
            continue
        for algo in a.algos.split(","):
            for name in a.fmts.split(","):
                t = time.perf_counter()
                out = simulate_allreduce(xs, fmt=get_format(name), algorithm=algo)[0]
                err = np.linalg.norm(out - exact) / np.linalg.norm(exact)
                print(f"P={p} {algo:6s} {name:8s} bits/value {message_nbytes(n, name) * 8 / n:.3f} relL2 {err:.4f}"
                      f"  ({time.perf_counter() - t:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
