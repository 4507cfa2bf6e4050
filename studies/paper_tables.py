"""The GIFT paper's Tables I and II on a gradient capture of ``studies.gradients``.

``python -m studies.paper_tables GRADS.npz [--json OUT] [--factors ema|capture] [--shards K]
[--wires e5m2/tensor,e4m3/256,mxfp8,nvfp4] [--factor cholesky|symmetric]``

What is measured (the definitions of the paper, arXiv 2607.07494):

- The gradient: the mean over the ranks of the capture's last step (``--shards K``: the mean of the
  last K shards, counting back through the steps: fewer or more tokens per gradient).
- The weights: every 2-D parameter with KFAC factors in the capture, W (out, in), A (in, in) the
  input covariance, G (out, out) the output-gradient covariance (``--factors ema``: the training
  run's EMA ``A/``, ``G/``, what a geometry would be built from; ``capture``: the capture batches'
  own ``MA/``, ``MG/``).
- Factors: L = chol(M + d I), lower Cholesky, damping d = 1e-3 absolute (the paper's);
  ``--factor symmetric``: L = (M + d I)^1/2, the symmetric square root, instead (every row, both
  tables: the map W L^-T is then the symmetric inverse root, giftcomm's KFAC convention).
- Table I rows: euclidean W~ = W; output W~ = L_G^-1 W; input W~ = W L_A^-T; full W~ = L_G^-1 W L_A^-T.
  The round trip quantizes W~ with the wire and maps back (W^ = W~^ L_A^T, L_G W~^, L_G W~^ L_A^T).
- Table II rows (input side, A replaced by an approximation before the damped Cholesky): full A;
  diag (diag(A)); block-b (A's b x b diagonal blocks, b = 32, 64, 128, the last one partial);
  lowrank-r (U_r diag(l_r) U_r^T + diag(max(diag(A - U_r diag(l_r) U_r^T), d)), r = 8, 16, 32,
  the top-r eigenpairs of A).
- Wires, each tensor (W~ flattened row-major) on its own: ``e5m2/tensor`` the paper's (FP8 E5M2,
  ONE scale per tensor: x * (57344 / amax) rounded to nearest even, decoded times amax / 57344);
  giftcomm's ``e4m3/256`` (one fp32 scale per 256 values), ``mxfp8``, ``nvfp4`` through
  ``giftcomm.reference.codec``'s encode/decode (round to nearest).
- Pooling over layers (the paper's single number per row): RelL2 = sqrt(sum_l ||W^_l - W_l||^2 /
  sum_l ||W_l||^2), the relative error of all the layers' gradients concatenated; Cos = the cosine of
  the concatenated round-tripped and true gradients. A layer kind (``kind``: the name's part after
  its block index, e.g. ``mlp.down``) pools its layers the same way.

JSON: {"table1": {WIRE: {ROW: {"rel_l2", "cos"}}}, "table2": {...}, "per_kind": {"table1": {WIRE:
{KIND: {ROW: ...}}}, "table2": ...}, "per_layer": {NAME: {"table1": {WIRE: {ROW: ...}}, "table2":
...}}, "info": {...}}.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Callable

import ml_dtypes
import numpy as np
import scipy.linalg as sla

__all__ = ["FACTORS", "WIRES", "TABLE1_ROWS", "TABLE2_ROWS", "DAMPING", "load", "roundtrip", "approximate", "chol",
           "layer_errors", "tables", "kind", "main"]

DAMPING = 1e-3
WIRES = ("e5m2/tensor", "e4m3/256", "mxfp8", "nvfp4")
TABLE1_ROWS = ("euclidean", "output", "input", "full")
TABLE2_ROWS = ("full", "diag", "block-32", "block-64", "block-128", "lowrank-8", "lowrank-16", "lowrank-32")
_E5M2_MAX = 57344.0


def kind(name: str) -> str:
    """The layer kind of a parameter name: what follows its last numeric component, without
    ``.weight`` (``blocks.3.mlp.down.weight`` -> ``mlp.down``); the name itself when it has none."""
    parts = name.removesuffix(".weight").split(".")
    idx = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[idx[-1] + 1:]) if idx else ".".join(parts)


def load(path: str, factors: str = "ema", shards: int = 0) -> tuple[dict, dict, dict]:
    """(grads {name: (out, in) float64}, factors {name: (A, G) float64}, info) from a capture.
    ``shards`` 0: the mean over the ranks of the last step; K: the mean of the last K shards of
    (steps x ranks) in step-major order."""
    if factors not in ("ema", "capture"):
        raise ValueError(f"factors must be 'ema' or 'capture', got {factors!r}")
    z = np.load(path)
    names = [str(x) for x in z["names"]]
    shapes = json.loads(str(z["shapes"]))
    info = json.loads(str(z["info"]))
    g = z["grads"]
    steps, ranks = g.shape[:2]
    if shards == 0:
        flat = g[-1].astype(np.float64).mean(0)
    else:
        if not 1 <= shards <= steps * ranks:
            raise ValueError(f"shards must be in [1, {steps * ranks}] for this capture, got {shards}")
        flat = g.reshape(steps * ranks, -1)[-shards:].astype(np.float64).mean(0)
    pa, pg = ("A/", "G/") if factors == "ema" else ("MA/", "MG/")
    grads, facs, off = {}, {}, 0
    for nm, sh in zip(names, shapes):
        size = int(np.prod(sh))
        if len(sh) == 2 and f"{pa}{nm}" in z.files:
            grads[nm] = flat[off:off + size].reshape(sh)
            facs[nm] = (z[f"{pa}{nm}"].astype(np.float64), z[f"{pg}{nm}"].astype(np.float64))
        off += size
    if not grads:
        raise ValueError(f"{path}: no 2-D weight has factors ({pa}*) in this capture")
    info["tokens_per_gradient"] = (info["batch"] // ranks) * (ranks if shards == 0 else shards) * \
        int(info["model"].get("seq_len", 0))
    return grads, facs, info


def roundtrip(x: np.ndarray, wire: str) -> np.ndarray:
    """Quantize and decode ``x`` (any shape, float64) as one tensor on ``wire``; float64 back."""
    v = np.ascontiguousarray(x, np.float32).reshape(-1)
    if wire == "e5m2/tensor":
        amax = float(np.max(np.abs(v))) if v.size else 0.0
        if amax == 0.0:
            return np.zeros_like(x)
        scale = np.float32(amax / _E5M2_MAX)
        y = np.clip(v / scale, -_E5M2_MAX, _E5M2_MAX).astype(ml_dtypes.float8_e5m2).astype(np.float32) * scale
    else:
        from giftcomm.reference import codec

        fmt, block = {"e4m3/256": ("e4m3", 256), "mxfp8": ("mxfp8", None), "nvfp4": ("nvfp4", None)}[wire]
        y = codec.decode(codec.encode(v, fmt, block), v.size, fmt, block)
    return y.astype(np.float64).reshape(x.shape)


def approximate(a: np.ndarray, row: str, damping: float = DAMPING) -> np.ndarray:
    """A (n, n) replaced by Table II's approximation ``row`` (before damping; module doc)."""
    n = a.shape[0]
    if row == "full":
        return a
    if row == "diag":
        return np.diag(np.diag(a))
    if row.startswith("block-"):
        b = int(row.split("-")[1])
        out = np.zeros_like(a)
        for s in range(0, n, b):
            out[s:s + b, s:s + b] = a[s:s + b, s:s + b]
        return out
    if row.startswith("lowrank-"):
        r = min(int(row.split("-")[1]), n)
        lam, u = np.linalg.eigh(a)
        lam, u = lam[::-1][:r], u[:, ::-1][:, :r]
        low = (u * lam) @ u.T
        return low + np.diag(np.maximum(np.diag(a - low), damping))
    raise ValueError(f"unknown approximation {row!r}; known: {', '.join(TABLE2_ROWS)}")


FACTORS = ("cholesky", "symmetric")


def chol(m: np.ndarray, damping: float = DAMPING, factor: str = "cholesky") -> np.ndarray:
    """Lower Cholesky factor of m + damping I (symmetrised); ``factor="symmetric"``: its symmetric
    square root (eigh) instead. ValueError if not positive definite."""
    m = 0.5 * (m + m.T) + damping * np.eye(m.shape[0])
    if factor == "symmetric":
        lam, u = np.linalg.eigh(m)
        if not lam[0] > 0:
            raise ValueError(f"factor not positive definite after damping {damping}")
        r = (u * np.sqrt(lam)) @ u.T
        return 0.5 * (r + r.T)
    if factor != "cholesky":
        raise ValueError(f"factor must be one of {FACTORS}, got {factor!r}")
    try:
        return np.linalg.cholesky(m)
    except np.linalg.LinAlgError as e:
        raise ValueError(f"factor not positive definite after damping {damping}") from e


def _solve(f: np.ndarray, b: np.ndarray) -> np.ndarray:
    """f^-1 b for a factor of :func:`chol`: lower triangular, or symmetric (its upper triangle is
    non-zero then)."""
    if np.any(np.triu(f, 1)):
        return sla.solve(f, b, assume_a="pos")
    return sla.solve_triangular(f, b, lower=True)


def _sides(w: np.ndarray, la: np.ndarray | None, lg: np.ndarray | None,
           wire: str) -> np.ndarray:
    """Round trip of w through the two-sided map (None = identity on that side)."""
    t = w
    if la is not None:  # W L_A^-T = (L_A^-1 W^T)^T
        t = _solve(la, t.T).T
    if lg is not None:
        t = _solve(lg, t)
    q = roundtrip(t, wire)
    if lg is not None:
        q = lg @ q
    if la is not None:
        q = q @ la.T
    return q


def layer_errors(w: np.ndarray, a: np.ndarray, g: np.ndarray, wires: tuple[str, ...] = WIRES,
                 damping: float = DAMPING, factor: str = "cholesky") -> dict:
    """{"table1"|"table2": {wire: {row: (err^2, g^2, <q, w>, q^2)}}} for one layer's gradient w."""
    la, lg = chol(a, damping, factor), chol(g, damping, factor)
    maps: dict[str, dict[str, Callable[[str], np.ndarray]]] = {
        "table1": {"euclidean": lambda wr: _sides(w, None, None, wr),
                   "output": lambda wr: _sides(w, None, lg, wr),
                   "input": lambda wr: _sides(w, la, None, wr),
                   "full": lambda wr: _sides(w, la, lg, wr)},
        "table2": {}}
    for row in TABLE2_ROWS:
        lr = la if row == "full" else chol(approximate(a, row, damping), damping, factor)
        maps["table2"][row] = (lambda lr_: lambda wr: _sides(w, lr_, None, wr))(lr)
    ww = float(np.sum(w * w))
    out: dict = {}
    for table, rows in maps.items():
        out[table] = {}
        for wire in wires:
            out[table][wire] = {}
            for row, fn in rows.items():
                q = fn(wire)
                out[table][wire][row] = (float(np.sum((q - w) ** 2)), ww, float(np.sum(q * w)), float(np.sum(q * q)))
    return out


def _pool(stats: list[tuple[float, float, float, float]]) -> dict:
    e, gg, qw, qq = (sum(s[i] for s in stats) for i in range(4))
    return {"rel_l2": float(np.sqrt(e / gg)) if gg > 0 else 0.0,
            "cos": float(qw / np.sqrt(qq * gg)) if qq > 0 and gg > 0 else 0.0}


def tables(grads: dict, facs: dict, wires: tuple[str, ...] = WIRES, damping: float = DAMPING,
           factor: str = "cholesky") -> dict:
    """Both tables, pooled, per kind and per layer (the JSON of the module doc, without info)."""
    per = {nm: layer_errors(grads[nm], facs[nm][0], facs[nm][1], wires=wires, damping=damping, factor=factor)
           for nm in grads}
    kinds = sorted({kind(nm) for nm in per})
    res: dict = {"table1": {}, "table2": {}, "per_kind": {"table1": {}, "table2": {}}, "per_layer": {}}
    for table in ("table1", "table2"):
        rows = TABLE1_ROWS if table == "table1" else TABLE2_ROWS
        for wire in wires:
            res[table][wire] = {r: _pool([per[nm][table][wire][r] for nm in per]) for r in rows}
            res["per_kind"][table][wire] = {
                k: {r: _pool([per[nm][table][wire][r] for nm in per if kind(nm) == k]) for r in rows} for k in kinds}
    for nm in per:
        res["per_layer"][nm] = {t: {wi: {r: _pool([s]) for r, s in d.items()} for wi, d in per[nm][t].items()}
                                for t in ("table1", "table2")}
    return res


def _print(res: dict, info: dict, out=sys.stdout) -> None:
    print(f"# {info.get('config')} after {info.get('train_steps')} steps; {info.get('layers')} weights pooled; "
          f"{info.get('tokens_per_gradient')} tokens per gradient; factors {info.get('factors')}; "
          f"factor {info.get('factor', 'cholesky')}", file=out)
    for table, rows, title in (("table1", TABLE1_ROWS, "Table I: RelL2 / Cos"),
                               ("table2", TABLE2_ROWS, "Table II: input side, A approximated: RelL2")):
        print(f"\n{title}\n| wire | " + " | ".join(rows) + " |\n|---|" + "---:|" * len(rows), file=out)
        for wire, d in res[table].items():
            cells = [f"{d[r]['rel_l2']:.3e} / {d[r]['cos']:.6f}" if table == "table1" else f"{d[r]['rel_l2']:.3e}"
                     for r in rows]
            print(f"| {wire} | " + " | ".join(cells) + " |", file=out)
    print("\nPer layer kind, Table I RelL2 (input / euclidean ratio in brackets)", file=out)
    for wire, kinds in res["per_kind"]["table1"].items():
        cells = [f"{k} {v['input']['rel_l2']:.2e} ({v['input']['rel_l2'] / v['euclidean']['rel_l2']:.2f})"
                 for k, v in kinds.items()]
        print(f"- {wire}: " + "; ".join(cells), file=out)


def single_threaded_blas():
    """A context in which BLAS/LAPACK run one thread: these matrices (<= a few thousand wide) are
    faster so, and a shared machine's idle-spinning BLAS threads cost several times the work."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with the torch/test extras
        import contextlib

        return contextlib.nullcontext()
    return threadpool_limits(1)


def main(argv: list[str] | None = None) -> int:
    with single_threaded_blas():
        return _main(argv)


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.paper_tables", description=__doc__.split("\n")[0])
    p.add_argument("grads", help="a .npz capture of python -m studies.gradients")
    p.add_argument("--json", default=None, help="write the tables as JSON here")
    p.add_argument("--factors", default="ema", choices=("ema", "capture"))
    p.add_argument("--shards", type=int, default=0, help="mean of the last K shards (0: the last step's ranks)")
    p.add_argument("--wires", default=",".join(WIRES))
    p.add_argument("--damping", type=float, default=DAMPING)
    p.add_argument("--factor", default="cholesky", choices=FACTORS,
                   help="the factor of the damped matrix: its Cholesky factor (the paper's) or symmetric square root")
    a = p.parse_args(argv)
    wires = tuple(w for w in a.wires.split(",") if w)
    bad = [w for w in wires if w not in WIRES]
    if bad:
        p.error(f"unknown wire(s) {bad}; known: {', '.join(WIRES)}")
    grads, facs, info = load(a.grads, a.factors, a.shards)
    res = tables(grads, facs, wires, a.damping, a.factor)
    info = {"config": info.get("config"), "train_steps": info.get("train_steps"), "layers": len(grads),
            "tokens_per_gradient": info["tokens_per_gradient"], "factors": a.factors, "damping": a.damping,
            "factor": a.factor,
            "shards": a.shards, "source": re.sub(r".*/", "", a.grads)}
    _print(res, info)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**res, "info": info}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
