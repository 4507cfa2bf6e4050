"""Where the GIFT paper's input-side gain comes from: the input / Euclidean RelL2 ratio of Table I
per layer against what should predict it, across captures (training phases, models), and its trend
with the tokens each gradient averages.

``python -m studies.paper_gain CAPTURE.npz ... [--out perf/results/paper-gain.md] [--wires e5m2/tensor,e4m3/256]
[--kind mlp.down]``

(``--kind``: only the layers of that kind, e.g. the MLP down projections the paper transforms.)

For each capture (``studies.gradients`` / ``studies.pretrained_gradients`` .npz) and each 2-D weight
with factors (EMA factors, damping 1e-3, definitions of ``studies.paper_tables``):

- ``ratio``: RelL2(input side) / RelL2(Euclidean) of the mean gradient of the last step's ranks,
  per wire; ``pooled`` the same with the layers pooled (paper_tables' pooling).
- Predictors, from A (in x in) and the gradient W (out x in): ``cond`` the condition number of
  A + 1e-3 I; ``top32`` the fraction of trace(A) in its 32 largest eigenvalues; ``erank`` the
  effective rank exp(entropy of eig(A) / trace(A)); ``align32`` the fraction of ||W||^2 in the span
  of A's top-32 eigenvectors (||W U_32||^2 / ||W||^2: how much of the gradient's rows lie where A is
  large, i.e. what the input-side map shrinks least); ``outlier`` max(diag A) / median(diag A);
  ``gcrest`` the crest factor of W (max|W| / rms(W), what a per-tensor scale suffers from) and
  ``tcrest`` the same of W L_A^-T; ``model`` the ratio a floating-point wire would give if each
  value carried an independent error proportional to its own magnitude (relative error e, the same
  in both coordinates): error energy e^2 sum_ij W~_ij^2 (L_A^T L_A)_jj in ordinary coordinates
  against e^2 ||W||^2, so model = sqrt(sum_ij W~_ij^2 (L_A^T L_A)_jj / ||W||^2). For W's rows along
  A's top eigenvector it is about sqrt(mean eigenvalue / top eigenvalue) (a gain); for rows spread
  evenly over A's eigenvectors it is >= 1 (a loss).
- Token scan: the pooled ratio of the mean of the last K shards, K = 1, 2, 4, ... up to all
  (steps x ranks) shards of the capture: tokens per gradient K x (batch / ranks) x seq_len.

Writes ``OUT`` (markdown tables) and beside it ``.json`` (all numbers) and ``.png`` (figure).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import scipy.linalg as sla

from studies.paper_tables import DAMPING, _pool, _sides, chol, kind, load, single_threaded_blas

__all__ = ["predictors", "layer_ratio", "study", "main"]


def predictors(w: np.ndarray, a: np.ndarray, damping: float = DAMPING) -> dict:
    """The per-layer predictors of the module doc (floats)."""
    lam, u = np.linalg.eigh(0.5 * (a + a.T))
    lam, u = np.clip(lam[::-1], 0.0, None), u[:, ::-1]
    tr = float(lam.sum())
    p = lam / tr if tr > 0 else np.full_like(lam, 1.0 / lam.size)
    nz = p[p > 0]
    d = np.diag(a)
    la = chol(a, damping)
    t = sla.solve_triangular(la, w.T, lower=True).T
    ww = float(np.sum(w * w))
    col = np.sum(la * la, axis=0)  # (L_A^T L_A)_jj
    model = float(np.sqrt(np.sum(t * t * col[None, :]) / ww)) if ww > 0 else 0.0
    return {"model": model, "cond": float((lam[0] + damping) / (lam[-1] + damping)), "top32": float(p[:32].sum()),
            "erank": float(np.exp(-np.sum(nz * np.log(nz)))),
            "align32": float(np.sum((w @ u[:, :32]) ** 2) / ww) if ww > 0 else 0.0,
            "outlier": float(d.max() / max(np.median(d), 1e-30)),
            "gcrest": float(np.abs(w).max() / np.sqrt(ww / w.size)) if ww > 0 else 0.0,
            "tcrest": float(np.abs(t).max() / np.sqrt(np.mean(t * t))) if ww > 0 else 0.0}


def layer_ratio(w: np.ndarray, a: np.ndarray, wire: str, damping: float = DAMPING) -> tuple[tuple, tuple]:
    """(Euclidean stats, input-side stats), each (err^2, g^2, <q, w>, q^2), of one layer."""
    la = chol(a, damping)
    out = []
    for side in (None, la):
        q = _sides(w, side, None, wire)
        out.append((float(np.sum((q - w) ** 2)), float(np.sum(w * w)), float(np.sum(q * w)), float(np.sum(q * q))))
    return out[0], out[1]


def _ratio(stats: list[tuple[tuple, tuple]]) -> float:
    return _pool([s[1] for s in stats])["rel_l2"] / _pool([s[0] for s in stats])["rel_l2"]


def _of_kind(grads: dict, layer_kind: str | None) -> dict:
    return grads if layer_kind is None else {n: w for n, w in grads.items() if kind(n) == layer_kind}


def study(path: str, wires: tuple[str, ...], log=sys.stderr, layer_kind: str | None = None) -> dict:
    """All numbers for one capture (module doc); ``layer_kind``: only that kind's layers."""
    grads, facs, info = load(path, "ema", 0)
    grads = _of_kind(grads, layer_kind)
    if not grads:
        raise ValueError(f"{path}: no layer of kind {layer_kind!r}")
    z = np.load(path)
    steps, ranks = z["grads"].shape[:2]
    label = f"{info['config']} {info.get('optimizer', 'adamw')} step {info['train_steps']}"
    layers = {}
    for nm, w in grads.items():
        row = {"kind": kind(nm), **predictors(w, facs[nm][0])}
        for wire in wires:
            e, i = layer_ratio(w, facs[nm][0], wire)
            row[f"ratio {wire}"] = _ratio([(e, i)])
            row[f"euclid {wire}"] = _pool([e])["rel_l2"]
        layers[nm] = row
    pooled = {}
    for wire in wires:
        pooled[wire] = _ratio([layer_ratio(grads[nm], facs[nm][0], wire) for nm in grads])
    scan = []
    k = 1
    while k <= steps * ranks:
        g_k, f_k, inf_k = load(path, "ema", k)
        g_k = _of_kind(g_k, layer_kind)
        entry = {"shards": k, "tokens": inf_k["tokens_per_gradient"]}
        for wire in wires:
            st = [layer_ratio(g_k[nm], f_k[nm][0], wire) for nm in g_k]
            entry[f"ratio {wire}"] = _ratio(st)
            entry[f"euclid {wire}"] = _pool([s[0] for s in st])["rel_l2"]
            entry[f"input {wire}"] = _pool([s[1] for s in st])["rel_l2"]
        scan.append(entry)
        if log:
            print(f"{label}: {k} shards, {entry['tokens']} tokens: {entry}", file=log, flush=True)
        k = k * 2 if k * 2 <= steps * ranks or k == steps * ranks else steps * ranks
    return {"label": label, "path": os.path.basename(path), "tokens_per_gradient": info["tokens_per_gradient"],
            "train_loss_last": info.get("train_loss_last"), "pooled": pooled, "layers": layers, "scan": scan}


def _corr(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation."""
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1]) if len(x) > 2 else float("nan")


PRED = ("model", "cond", "top32", "erank", "align32", "outlier", "gcrest", "tcrest")


def _markdown(res: list[dict], wires: tuple[str, ...]) -> str:
    w0 = wires[0]
    out = ["## Pooled input / Euclidean RelL2 ratio (last step's ranks; paper: 0.335 on e5m2/tensor)\n",
           "| capture | tokens/gradient | " + " | ".join(wires) + " |", "|---|---:|" + "---:|" * len(wires)]
    for r in res:
        out.append(f"| {r['label']} | {r['tokens_per_gradient']} | " +
                   " | ".join(f"{r['pooled'][w]:.3f}" for w in wires) + " |")
    out += ["", f"## Ratio against tokens per gradient (mean of the last K shards; {w0})\n",
            "| capture | " + " | ".join("K tokens: ratio (Euclid RelL2)" for _ in [0]) + " |", "|---|---|"]
    for r in res:
        out.append(f"| {r['label']} | " + "; ".join(
            f"{s['tokens']}: {s['ratio ' + w0]:.3f} ({s['euclid ' + w0]:.2e})" for s in r["scan"]) + " |")
    out += ["", f"## Per layer kind (medians over the blocks; ratio on {w0})\n",
            "| capture | kind | ratio | " + " | ".join(PRED) + " |", "|---|---|---:|" + "---:|" * len(PRED)]
    for r in res:
        kinds = sorted({v["kind"] for v in r["layers"].values()})
        for k in kinds:
            rows = [v for v in r["layers"].values() if v["kind"] == k]
            med = {p: float(np.median([v[p] for v in rows])) for p in (f"ratio {w0}", *PRED)}
            out.append(f"| {r['label']} | {k} | {med['ratio ' + w0]:.3f} | " +
                       " | ".join(f"{med[p]:.3g}" for p in PRED) + " |")
    out += ["", f"## Spearman correlation of the per-layer ratio ({w0}) with each predictor, all layers of all captures\n",
            "| " + " | ".join(PRED) + " |", "|" + "---:|" * len(PRED)]
    allrows = [v for r in res for v in r["layers"].values()]
    out.append("| " + " | ".join(f"{_corr([v[p] for v in allrows], [v['ratio ' + w0] for v in allrows]):+.2f}"
                                 for p in PRED) + " |")
    return "\n".join(out) + "\n"


def _figure(res: list[dict], wires: tuple[str, ...], path: str) -> None:
    from studies.plotting import pyplot, save

    plt = pyplot()
    w0 = wires[0]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    for r in res:
        rows = list(r["layers"].values())
        y = [v[f"ratio {w0}"] for v in rows]
        for ax, p in zip(axes[:3], ("model", "align32", "outlier")):
            ax.scatter([v[p] for v in rows], y, s=14, label=r["label"])
        axes[3].plot([s["tokens"] for s in r["scan"]], [s[f"ratio {w0}"] for s in r["scan"]], marker="o",
                     label=r["label"])
    titles = ("model: relative-error prediction of the ratio", "gradient energy in A's top-32 eigenvectors",
              "outlier inputs: max / median of diag A", "tokens per gradient")
    for ax, t in zip(axes, titles):
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(0.335, color="red", lw=0.8, ls="--")
        ax.set_xlabel(t)
        ax.set_ylabel(f"input / Euclidean RelL2 ({w0})")
        ax.grid(True, alpha=0.3)
    axes[0].plot([0.3, 1.3], [0.3, 1.3], color="black", lw=0.6)
    axes[2].set_xscale("log")
    axes[3].set_xscale("log")
    axes[3].legend(fontsize=7)
    axes[0].set_title("per layer (red dashed: the paper's pooled 0.335)", fontsize=9)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.paper_gain", description=__doc__.split("\n")[0])
    p.add_argument("captures", nargs="+")
    p.add_argument("--out", default="perf/results/paper-gain.md")
    p.add_argument("--wires", default="e5m2/tensor,e4m3/256")
    p.add_argument("--kind", default=None, help="only the layers of this kind (e.g. mlp.down)")
    a = p.parse_args(argv)
    wires = tuple(a.wires.split(","))
    with single_threaded_blas():
        res = [study(c, wires, layer_kind=a.kind) for c in a.captures]
    from studies.plotting import sibling

    with open(sibling(a.out, ".json"), "w") as f:
        json.dump(res, f, indent=1)
    md = _markdown(res, wires)
    with open(a.out, "w") as f:
        f.write(f"# Where the paper's input-side gain comes from\n\n`python -m studies.paper_gain "
                f"{' '.join(os.path.basename(c) for c in a.captures)} --out {a.out} --wires {a.wires}"
                f"{'' if a.kind is None else ' --kind ' + a.kind}`\n\n" + md)
    _figure(res, wires, str(sibling(a.out, ".png")))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
