"""KFAC capture from nn.Linear layers, and per-bucket geometries from the synced factors.

``KfacCapture`` registers a forward hook on each nn.Linear: on capture steps (every ``every``
steps) it keeps a random subsample of ``tokens`` rows of the layer input a (..., in) and hooks
the layer output, whose gradient d (..., out) arrives during backward; the same rows of a and
d are fed to ``KfacEstimator.update(segment, a, d)``. The estimator's segment for a layer is
the name of its weight parameter (``"<module path>.weight"``), shape (out, in) as in
``Layout``. After ``estimator.sync(comm)``, ``build_geometries`` makes one Geometry per bucket
with the selective policy.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...geometry import Geometry, KfacEstimator, Layout, SelectivePolicy, select
from .buckets import named_trainable

__all__ = ["KfacCapture", "build_geometries", "model_layout"]


def model_layout(model_or_named) -> Layout:
    """The Layout of all trainable parameters of a model, in ``named_parameters`` order."""
    return Layout([(n, tuple(p.shape)) for n, p in named_trainable(model_or_named)])


def linear_segments(model: torch.nn.Module) -> dict[torch.nn.Linear, str]:
    """nn.Linear modules with a trainable weight -> segment name of that weight."""
    names = {id(p): n for n, p in named_trainable(model)}
    return {m: names[id(m.weight)] for _, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m.weight) in names}


class KfacCapture:
    """Feed a KfacEstimator from a model's nn.Linear layers.

    model: the module. estimator: a KfacEstimator whose layout contains each Linear weight's
    name (e.g. ``KfacEstimator(model_layout(model), segments=...)``); by default one is made
    over ``model_layout(model)`` with the Linear weights as segments. every: capture on steps
    that are multiples of it. tokens: rows sampled per layer per capture (all if fewer).
    seed: seeds the row sampling (combine with the rank for different rows per rank).
    Call ``step(i)`` before each forward; ``remove()`` detaches the hooks.
    """

    def __init__(self, model: torch.nn.Module, estimator: KfacEstimator | None = None, *, every: int = 10,
                 tokens: int = 256, seed: int = 0, decay: float = 0.95) -> None:
        if every < 1 or tokens < 1:
            raise ValueError("every and tokens must be >= 1")
        self.layers = linear_segments(model)
        if estimator is None:
            estimator = KfacEstimator(model_layout(model), segments=list(self.layers.values()), decay=decay)
        self.estimator = estimator
        self.every, self.tokens = int(every), int(tokens)
        self.rng = np.random.default_rng(seed)
        self.active = False
        self.seconds = 0.0  # wall time spent in the hooks (copies, factor updates)
        self._handles = [m.register_forward_hook(self._forward_hook(name)) for m, name in self.layers.items()]

    def step(self, step: int) -> bool:
        """Declare the step about to run; returns whether it captures."""
        self.active = int(step) % self.every == 0
        return self.active

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            if not (self.active and module.training and torch.is_grad_enabled() and output.requires_grad):
                return
            import time

            t0 = time.perf_counter()
            a = inputs[0].detach().reshape(-1, module.in_features)
            rows = a.shape[0]
            idx = None
            if rows > self.tokens:
                idx = torch.from_numpy(np.sort(self.rng.choice(rows, self.tokens, replace=False)))
                a = a.index_select(0, idx)
            a_np = a.to(torch.float64).numpy()

            def grad_hook(grad: torch.Tensor) -> None:
                t1 = time.perf_counter()
                d = grad.detach().reshape(-1, module.out_features)
                if idx is not None:
                    d = d.index_select(0, idx)
                self.estimator.update(name, a_np, d.to(torch.float64).numpy())
                self.seconds += time.perf_counter() - t1

            output.register_hook(grad_hook)
            self.seconds += time.perf_counter() - t0

        return hook

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


def build_geometries(estimator: KfacEstimator, layouts: Sequence[Layout], policy: SelectivePolicy | None = None,
                     damping: float = 1e-3) -> list[Geometry]:
    """One Geometry per bucket layout from the estimator's synced spectra, chosen per segment by
    the selective policy (segments without factors get the identity). Identical on every rank
    after ``estimator.sync(comm)``."""
    if estimator.spectra is None:
        raise RuntimeError("call estimator.sync(comm) before build_geometries")
    policy = policy or SelectivePolicy()
    out = []
    for layout in layouts:
        factors = {n: (sa, sg) for n, (sg, sa) in estimator.spectra.items() if n in layout}
        out.append(select(layout, factors, policy, damping))
    return out
