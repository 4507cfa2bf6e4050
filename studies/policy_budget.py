"""The selective policy's time budget swept: whitened error recovered against transform cost.

For each budget ``f`` (a fraction of the FP8 ring allreduce's predicted wire time at P = 4 on a
1 Gbit/s link, ``SelectivePolicy(budget=f)``; 0.1 is the library's default), the per-segment rule
(``budget=None``) and full KFAC whitening of every Linear weight, on the real gradients of a
``python -m studies.gradients`` capture:

- the geometry: Linear weights transformed (of those with factors), share of the values, the
  ranks chosen (out/in per transformed segment), GFLOP of forward + inverse;
- its cost: the time the policy's ``TransformTimeModel`` predicts (what the budget is spent by),
  as a share of the FP8 collective's wire time, and the measured forward + inverse time on this
  machine (a reused output buffer and the in-place inverse, the pattern the model assumes; the
  minimum of ``--repeats`` calls);
- per wire format (each with its own block, ring, P = the capture's ranks, round to nearest,
  the reference simulator): the whitened-norm relative error, both as ``studies.fidelity``
  reports it (``whitened``: the element-weighted RMS of the per-weight ratios) and pooled over
  the buffer (``pooled``: ``||W e|| / ||W s||`` summed over the weights with factors, the norm
  ``studies train`` reports), the relative L2 error, and the **share of full whitening's
  reduction** the geometry recovers, ``(euclid - geometry) / (euclid - full)``, of each.

Then, for the default budget, the per-segment choice (``Geometry.summary``): which weights stay
identity and why, and the ranks it affords.

    python -m studies policy-budget --data ~/.cache/giftcomm/gradients-small.npz \\
        [--fmt e4m3,nvfp4,mxfp4] [--budgets 0.05,0.1,0.2,0.3,0.5,1,2] [--out FILE.md] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from giftcomm.formats import bytes_per_value, resolve_block
from giftcomm.geometry import Geometry, SelectivePolicy, select
from giftcomm.geometry.policy import collective_seconds
from giftcomm.options import DEFAULT_DAMPING

__all__ = ["geometries", "measure", "main"]

DEFAULT_BUDGETS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0)


def geometries(case, spectra: dict, budgets, damping: float, max_rank: int | None) -> dict[str, tuple]:
    """label -> (Geometry, policy or None): the budgets, the per-segment rule, full whitening."""
    out: dict[str, tuple] = {}
    for f in budgets:
        pol = SelectivePolicy(budget=f, max_rank=max_rank)
        out[f"budget {f:g}" + (" (default)" if f == 0.1 else "")] = (select(case.layout, spectra, pol, damping), pol)
    pol = SelectivePolicy(budget=None, max_rank=max_rank)
    out["per-segment rule"] = (select(case.layout, spectra, pol, damping), pol)
    out["full whitening"] = (Geometry.from_kfac(case.layout, spectra, damping=damping), None)
    return out


def _ranks(geo: Geometry) -> str:
    """The ranks chosen, 'out/in' per transformed segment, counted: e.g. '-/4 x5, 8/8 x1'."""
    counts: dict[str, int] = {}
    for t in geo.transforms:
        if t.is_identity:
            continue
        k = "/".join("-" if s.is_identity else (str(s.rank) if s.rank is not None else s.kind) for s in (t.left, t.right))
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def measure(case, fmts, budgets=DEFAULT_BUDGETS, damping: float = DEFAULT_DAMPING, max_rank: int | None = 128,
            metric_damping: float = 1e-3, repeats: int = 3, progress: bool = False) -> dict:
    """The sweep's numbers (module doc): {"geometries": [...], "errors": [...], "default": summary}."""
    from studies.fidelity import Method, _spectra, evaluate, time_geometry

    spectra = _spectra(case.factors)
    geos = geometries(case, spectra, budgets, damping, max_rank)
    n = case.layout.size
    fp8 = collective_seconds(n, case.ranks, 125e6)
    model = SelectivePolicy().time_model
    eligible = [s for s in case.layout if s.name in spectra and s.ndim == 2]
    x = np.ascontiguousarray(case.grads[0][0], dtype=np.float32)
    rows = []
    for label, (geo, _pol) in geos.items():
        done = [t for t in geo.transforms if not t.is_identity]
        rows.append({"geometry": label, "transformed": len(done), "eligible": len(eligible),
                     "share": sum(t.segment.size for t in done) / n, "ranks": _ranks(geo) if label != "full whitening"
                     else "full/full", "gflop": geo.flops() / 1e9,
                     "predicted_ms": 1e3 * model.geometry_seconds(geo), "fp8_ms": 1e3 * fp8,
                     "measured_ms": 1e3 * time_geometry(geo, x, repeats, reuse=True) if not geo.is_identity else 0.0})
        if progress:
            r = rows[-1]
            print(f"{label:<22} {r['transformed']}/{r['eligible']} weights, predicted {r['predicted_ms']:.3g} ms, "
                  f"measured {r['measured_ms']:.3g} ms", file=sys.stderr, flush=True)
    errors = []
    for fmt in fmts:
        blk = resolve_block(fmt, None)
        methods = [Method(f"{fmt} euclid", fmt=fmt, block=blk)]
        methods += [Method(f"{fmt} {label}", fmt=fmt, block=blk, build=lambda c, sp, g=geo: g)
                    for label, (geo, _p) in geos.items()]
        res = evaluate(case, methods, None, metric_damping, "ring", progress=progress)
        assert res is not None  # no comm: this process is the root
        euclid, full = res[0], res[-1]
        for r, label in zip(res, ["euclid", *geos]):
            span = euclid["whitened"] - full["whitened"]
            pspan = euclid["whitened_pooled"] - full["whitened_pooled"]
            errors.append({"fmt": fmt, "geometry": label, "whitened": r["whitened"], "rel_l2": r["rel_l2"],
                           "whitened_pooled": r["whitened_pooled"],
                           "recovered_pooled": (euclid["whitened_pooled"] - r["whitened_pooled"]) / pspan
                           if pspan > 0 else float("nan"),
                           "whitened_steps": r["per_step_whitened"],
                           "recovered": (euclid["whitened"] - r["whitened"]) / span if span > 0 else float("nan"),
                           "collective_ms": 1e3 * collective_seconds(n, case.ranks, 125e6, bytes_per_value(fmt, blk))})
    default = next(g for lab, (g, _p) in geos.items() if "(default)" in lab) if 0.1 in budgets else None
    return {"geometries": rows, "errors": errors, "default": default.summary() if default is not None else "",
            "weights": per_weight(case, geos, fmts[0], metric_damping) if default is not None else []}


def per_weight(case, geos: dict, fmt: str, metric_damping: float) -> list[dict]:
    """Per Linear weight, for ``fmt``: the policy's predicted Euclidean whitened error per element
    (``kappa``: anisotropy out x in of the geometry's factors at its damping, what the budget
    ranks by, times the elements), the default budget's choice, the measured whitened ratio of
    Euclidean and of the default, and the weight's share of the pooled Euclidean whitened
    squared error (last captured step)."""
    from studies.fidelity import Method, WhiteningMetric, _reduce_sim

    step = case.grads[-1]
    exact = np.mean([x.astype(np.float64) for x in step], axis=0)
    metric = WhiteningMetric(case.layout, case.metric, metric_damping)
    default = next(g for lab, (g, _p) in geos.items() if "(default)" in lab)
    rule = geos["per-segment rule"][0]  # every eligible weight carries its anisotropy here
    method = Method(fmt, fmt=fmt, block=resolve_block(fmt, None))
    red = {lab: _reduce_sim(method, geo, step, case.layout, "ring", len(case.grads) - 1)
           for lab, geo in (("euclid", None), ("default", default))}
    out = []
    for name in metric.sides:
        seg = case.layout[name]
        ex = exact[seg.offset:seg.stop]
        err2 = {lab: float(np.linalg.norm(metric.whiten(name, r[seg.offset:seg.stop] - ex)) ** 2) for lab, r in red.items()}
        sig = float(np.linalg.norm(metric.whiten(name, ex)))
        t = default[name]
        kap = rule[name].info.get("anisotropy")
        out.append({"weight": name, "elements": seg.size, "kappa": float(kap[0] * kap[1]) if kap else float("nan"),
                    "default": "identity" if t.is_identity else "/".join(
                        "-" if x.is_identity else str(x.rank) for x in (t.left, t.right)),
                    "euclid": np.sqrt(err2["euclid"]) / sig, "with_default": np.sqrt(err2["default"]) / sig,
                    "euclid_err2": err2["euclid"]})
    total = sum(r["euclid_err2"] for r in out)
    for r in out:
        r["share"] = r.pop("euclid_err2") / total if total > 0 else float("nan")
    return out


def tables(res: dict, fmts) -> str:
    g = res["geometries"]
    out = ["| geometry | weights transformed | share of values | ranks out/in (count) | GFLOP fwd+inv | "
           "predicted ms (share of FP8 collective) | measured ms |", "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in g:
        out.append(f"| {r['geometry']} | {r['transformed']}/{r['eligible']} | {100 * r['share']:.0f}% | {r['ranks'] or '-'} | "
                   f"{r['gflop']:.3g} | {r['predicted_ms']:.3g} ({100 * r['predicted_ms'] / r['fp8_ms']:.0f}%) | "
                   f"{r['measured_ms']:.3g} |")
    out += ["", f"FP8 (e4m3/256) ring collective, P = 4, 1 Gbit/s: {g[0]['fp8_ms']:.3g} ms predicted wire time.", ""]
    head = "| geometry | " + " | ".join(f"{f} whitened (recovered) | {f} pooled (recovered) | {f} rel L2"
                                       for f in fmts) + " |"
    out += [head, "| --- |" + " ---: |" * (3 * len(fmts))]
    by = {(e["fmt"], e["geometry"]): e for e in res["errors"]}
    for label in ["euclid", *[r["geometry"] for r in g]]:
        cells = []
        for f in fmts:
            e = by[(f, label)]
            rec, prec = ("", "") if label == "euclid" else (f" ({100 * e['recovered']:.0f}%)",
                                                           f" ({100 * e['recovered_pooled']:.0f}%)")
            cells.append(f"{e['whitened']:.4g}{rec} | {e['whitened_pooled']:.4g}{prec} | {e['rel_l2']:.4f}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    coll = {e["fmt"]: e["collective_ms"] for e in res["errors"]}
    out += ["", "Each format's own ring collective (wire time, same link): "
            + ", ".join(f"{f} {coll[f]:.3g} ms" for f in fmts) + "."]
    if res["weights"]:
        out += ["", f"Per Linear weight ({fmts[0]}, last captured step): the policy's ranking weight per element "
                "(anisotropy out x in at the geometry's damping), the default budget's choice (ranks out/in), the "
                "measured whitened error of Euclidean and of the default, and the weight's share of the pooled "
                "Euclidean whitened squared error:", "",
                "| weight | elements | kappa out x in | default | euclid whitened | default whitened | share of pooled error |",
                "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
        for r in sorted(res["weights"], key=lambda r: -r["share"]):
            out.append(f"| {r['weight']} | {r['elements']} | {r['kappa']:.0f} | {r['default']} | {r['euclid']:.3g} | "
                       f"{r['with_default']:.3g} | {100 * r['share']:.1f}% |")
    if res["default"]:
        out += ["", "The default budget's choice per segment:", "", "```", res["default"], "```"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies policy-budget", description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a studies.gradients capture (.npz)")
    ap.add_argument("--fmt", default="e4m3,nvfp4,mxfp4", help="wire formats (default e4m3,nvfp4,mxfp4)")
    ap.add_argument("--budgets", default=",".join(f"{b:g}" for b in DEFAULT_BUDGETS))
    ap.add_argument("--damping", type=float, default=DEFAULT_DAMPING, help="of the geometries (default: the library's)")
    ap.add_argument("--max-rank", type=int, default=128, help="SelectivePolicy.max_rank (default: the library's, 128)")
    ap.add_argument("--steps", type=int, default=None, help="use the first N captured steps (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="timed forward + inverse calls per geometry (minimum)")
    ap.add_argument("--out", default=None, help="also write the report here (markdown)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    from studies.gradients import load_case

    case = load_case(a.data)
    if a.steps:
        case.grads = case.grads[: a.steps]
    fmts = [f.strip() for f in a.fmt.split(",") if f.strip()]
    budgets = [float(b) for b in a.budgets.split(",") if b.strip()]
    t0 = time.perf_counter()
    load0 = " ".join(f"{v:.2f}" for v in os.getloadavg())
    res = measure(case, fmts, budgets, a.damping, a.max_rank, repeats=a.repeats, progress=not a.no_progress)
    head = [f"$ python -m studies policy-budget {' '.join(sys.argv[1:] if argv is None else argv)}",
            f"{case.name}; {len(case.grads)} captured step(s) (errors: the last); P = {case.ranks}, ring, "
            f"reference simulator, round to nearest; geometry damping {a.damping:g}, metric damping 1e-3, "
            f"max_rank {a.max_rank}; loadavg at start {load0}, at end "
            + " ".join(f"{v:.2f}" for v in os.getloadavg()) + f"; wall {time.perf_counter() - t0:.0f} s", ""]
    text = "\n".join(head) + "\n" + tables(res, fmts)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
