"""What aligning GIFT with dim-0 shards costs: whitened and L2 error of e4m3 through the
shard-local geometry (giftcomm.geometry.ShardedGeometry, left factors block-diagonal along P
shards) against unsharded GIFT and plain e4m3, at P = 2, 4, 8.

``python -m studies sharded-gift [--case real|synthetic] [--path FILE] [--shards 2,4,8] [--json F]``

Case "real" reads the gradients and KFAC factors of ``python -m studies.gradients`` (default
path: ``studies.gradients.DEFAULT_PATH``); "synthetic" is ``studies.fidelity.synthetic_case``
(anisotropic Kronecker gradients, cond 1e4). Each method reduces the case's per-rank gradients
of its last step with the reference simulation (direct algorithm: each contribution quantized
once), through the geometry built from ``factors``; errors are measured against the exact sum in
the whitened norm of ``metric`` (element-weighted RMS over the measured segments) and in L2.
The shard count P changes only the geometry (its block structure); the ranks summed are the
case's. Every shard's inverse needs only that shard (tests/test_sharded_geometry.py), so the
numbers are what FSDP2 with ``geometry="kfac"`` pays for the alignment.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

__all__ = ["measure", "main"]


def measure(case, shards=(2, 4, 8), fmt: str = "e4m3") -> list[dict]:
    """Rows: method, shards (None: unsharded), whitened, rel_l2."""
    from giftcomm.geometry import Geometry, ShardedGeometry
    from giftcomm.reference import simulate_gift_allreduce
    from studies.fidelity import WhiteningMetric, relative_l2

    inputs = case.grads[-1]
    exact = np.sum(np.asarray(inputs, np.float64), axis=0)
    metric = WhiteningMetric(case.layout, case.metric)
    geometries = [("plain " + fmt, None, None), ("GIFT unsharded", None, Geometry.from_kfac(case.layout, case.factors))]
    geometries += [(f"GIFT sharded P={p}", p, ShardedGeometry.from_kfac(case.layout, case.factors, p).full())
                   for p in shards]
    rows = []
    for label, p, geo in geometries:
        got = simulate_gift_allreduce(inputs, geo, fmt, None, "sum", "direct")[0]
        rows.append({"method": label, "shards": p, "whitened": metric.aggregate(metric.ratios(got, exact)),
                     "rel_l2": relative_l2(got, exact)})
    return rows


def _table(name: str, rows: list[dict]) -> str:
    base = rows[1]
    out = [f"{name}", f"{'method':<22} {'whitened':>10} {'vs unsharded':>13} {'rel L2':>10} {'vs unsharded':>13}"]
    for r in rows:
        out.append(f"{r['method']:<22} {r['whitened']:>10.4g} {r['whitened'] / base['whitened']:>12.3f}x "
                   f"{r['rel_l2']:>10.4g} {r['rel_l2'] / base['rel_l2']:>12.3f}x")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies sharded-gift", description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=("real", "synthetic"), default="real")
    ap.add_argument("--path", default=None, help="gradients file of studies.gradients (case real)")
    ap.add_argument("--shards", default="2,4,8")
    ap.add_argument("--fmt", default="e4m3")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.case == "real":
        from studies.gradients import DEFAULT_PATH, load_case

        path = a.path or DEFAULT_PATH
        if not os.path.exists(path):
            ap.error(f"{path} not found: run python -m studies.gradients --out {path} first, or --case synthetic")
        case = load_case(path)
    else:
        from studies.fidelity import synthetic_case

        case = synthetic_case(shapes=((256, 512), (512, 256), (688, 256)))
    rows = measure(case, tuple(int(s) for s in a.shards.split(",")), a.fmt)
    print(_table(case.name, rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"case": case.name, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
