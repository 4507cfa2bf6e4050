"""The studies' input: a :class:`Case` (a layout, every rank's gradients, the geometry's and the
metric's factors), cut down by :func:`subset_case`, read from a captured file by :func:`load_case`.

Shared by studies.fidelity (which evaluates cases) and studies.gradients (which captures the file
:func:`load_case` reads), so that neither imports the other.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from giftcomm.geometry import Layout

__all__ = ["Case", "subset_case", "load_case", "DEFAULT_PATH"]

DEFAULT_PATH = os.path.join(os.path.expanduser("~"), ".cache", "giftcomm", "gradients-small.npz")
"""Where ``python -m studies.gradients`` saves its capture by default."""


@dataclass
class Case:
    """One study input.

    name: label. layout: the buffer layout. grads: steps x ranks list of flat float32 buffers of
    ``layout.size`` elements (rank i's local gradient at each step). factors: name -> (A, G) the
    geometries are built from (known before the step). metric: name -> (A, G) of the whitened
    norm. info: free-form description (printed).
    """

    name: str
    layout: Layout
    grads: list[list[np.ndarray]]
    factors: dict
    metric: dict
    info: dict = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return len(self.grads[0])


def subset_case(case: Case, pattern: str) -> Case:
    """``case`` restricted to the segments whose name matches the regular expression ``pattern``
    (``re.search``): their values of every rank's gradient (in layout order), their factors and
    metric factors. The name gets a note of what was kept."""
    import re

    rx = re.compile(pattern)
    keep = [seg for seg in case.layout if rx.search(seg.name)]
    if not keep:
        raise ValueError(f"no segment of the case matches {pattern!r}")
    layout = Layout([(seg.name, tuple(seg.shape)) for seg in keep])
    grads = [[np.concatenate([x[seg.offset:seg.stop] for seg in keep]) for x in step] for step in case.grads]
    names = {seg.name for seg in keep}
    note = (f" [segments /{pattern}/: {len(keep)} of {len(case.layout)} tensors, "
            f"{layout.size / 1e6:.2f}M of {case.layout.size / 1e6:.2f}M values]")
    return Case(case.name + note, layout, grads, {k: v for k, v in case.factors.items() if k in names},
                {k: v for k, v in case.metric.items() if k in names}, dict(case.info, segments=pattern))


def load_case(path: str):
    """The captured file as a fidelity ``Case``: layout of every parameter; grads steps x ranks;
    ``factors`` the EMA KFAC factors (geometry), ``metric`` the capture batches' factors."""
    z = np.load(path)
    names = [str(x) for x in z["names"]]
    shapes = json.loads(str(z["shapes"]))
    info = json.loads(str(z["info"]))
    layout = Layout([(nm, tuple(sh)) for nm, sh in zip(names, shapes)])
    g = z["grads"]
    grads = [[np.ascontiguousarray(g[s, r]) for r in range(g.shape[1])] for s in range(g.shape[0])]
    factors = {nm: (z[f"A/{nm}"].astype(np.float64), z[f"G/{nm}"].astype(np.float64)) for nm in names
               if f"A/{nm}" in z.files}
    metric = {nm: (z[f"MA/{nm}"].astype(np.float64), z[f"MG/{nm}"].astype(np.float64)) for nm in names
              if f"MA/{nm}" in z.files}
    name = (f"real: Llama-{info['config']} ({info['parameters'] / 1e6:.2f}M params) after "
            f"{info['train_steps']} steps, {g.shape[1]} shards x {info['batch'] // g.shape[1]} seqs")
    return Case(name, layout, grads, factors, metric, info)
