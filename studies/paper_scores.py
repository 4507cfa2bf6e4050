"""What the paper's selection rule scores on a gradient capture: each 2-D weight's share of FP8
E5M2 codes at a bound under one scale per tensor (``giftcomm.geometry.paper.saturation_fraction``,
the score of ``SaturationProfile``), averaged over every captured shard (each rank's own gradient,
what a rank scores before the wire), beside 1 / size (the share the largest value alone gives),
and the weights ``geometry="paper"``'s default rule would select (``select_for``, top quarter).

``python -m studies.paper_scores CAPTURE.npz ... [--out FILE.md]``
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from giftcomm.geometry.paper import PaperOptions, saturation_fraction, select_for

__all__ = ["scores", "main"]


def scores(path: str) -> dict[str, tuple[float, int]]:
    """name -> (mean score over the capture's shards, size) for every 2-D weight with factors."""
    z = np.load(path)
    names, shapes = [str(x) for x in z["names"]], json.loads(str(z["shapes"]))
    g = z["grads"]
    out, off = {}, 0
    for nm, sh in zip(names, shapes):
        size = int(np.prod(sh))
        if len(sh) == 2 and f"A/{nm}" in z.files:
            out[nm] = (float(np.mean([saturation_fraction(g[s, r, off:off + size])
                                      for s in range(g.shape[0]) for r in range(g.shape[1])])), size)
        off += size
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.paper_scores", description=__doc__.split("\n")[0])
    p.add_argument("captures", nargs="+")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    lines = [f"`python -m studies.paper_scores {' '.join(a.captures)}`", ""]
    for path in a.captures:
        sc = scores(path)
        info = json.loads(str(np.load(path)["info"]))
        sel = select_for(PaperOptions(), {n: v for n, (v, _) in sc.items()})
        lines += [f"## {path.rsplit('/', 1)[-1]} ({info.get('optimizer', 'adamw')}, step {info['train_steps']})", "",
                  f"selected by the default rule (top quarter): {', '.join(sel)}", "",
                  "| weight | score | 1 / size | score x size | selected |", "| --- | ---: | ---: | ---: | :---: |"]
        for n, (v, size) in sorted(sc.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"| {n} | {v:.3e} | {1 / size:.2e} | {v * size:.1f} | {'yes' if n in sel else ''} |")
        lines.append("")
    text = "\n".join(lines)
    if a.out:
        with open(a.out, "w") as f:
            f.write("# The paper's selection scores on our captures\n\n" + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
