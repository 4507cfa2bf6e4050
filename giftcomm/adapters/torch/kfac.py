"""KFAC capture from nn.Linear layers, and per-bucket geometries from the synced factors.

``KfacCapture`` registers a forward hook on each nn.Linear: on capture steps (every ``every``
steps) it keeps a random subsample of ``tokens`` rows of the layer input a (..., in) and hooks
the layer output, whose gradient d (..., out) arrives during backward; the same rows of a and
d are fed to ``KfacEstimator.update(segment, a, d)``. The estimator's segment for a layer is
the name of its weight parameter (``"<module path>.weight"``), shape (out, in) as in
``Layout``. After ``estimator.sync(comm)``, ``build_geometries`` makes one Geometry per bucket
with the selective policy.

``nn.MultiheadAttention`` computes its projections with ``F.linear`` / a bare ``in_proj_weight``,
so no nn.Linear forward hook fires inside it: KfacCapture leaves those weights out (they keep the
identity geometry) and warns once, naming them. Layers of any float dtype and device are captured
(rows are copied to the host as float64 on capture steps only).
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...geometry import Geometry, KfacEstimator, Layout, SelectivePolicy, select
from ...geometry.geometry import DEFAULT_DAMPING
from ...geometry.sync import sync_spectra
from .buckets import named_trainable

__all__ = ["KfacCapture", "build_geometries", "model_layout", "geometries_from_factors", "linear_segments"]


def model_layout(model_or_named) -> Layout:
    """The Layout of all trainable parameters of a model, in ``named_parameters`` order."""
    return Layout([(n, tuple(p.shape)) for n, p in named_trainable(model_or_named)])


def _attention_linears(model: torch.nn.Module) -> set[int]:
    """ids of the nn.Linear modules inside nn.MultiheadAttention (called through F.linear)."""
    inside: set[int] = set()
    for m in model.modules():
        if isinstance(m, torch.nn.MultiheadAttention):
            inside.update(id(sub) for sub in m.modules() if isinstance(sub, torch.nn.Linear))
    return inside


def linear_segments(model: torch.nn.Module) -> dict[torch.nn.Linear, str]:
    """nn.Linear modules with a trainable weight -> segment name of that weight (the Linear
    modules inside nn.MultiheadAttention, whose forward never runs, are left out)."""
    names = {id(p): n for n, p in named_trainable(model)}
    skip = _attention_linears(model)
    return {m: names[id(m.weight)] for _, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m.weight) in names and id(m) not in skip}


def _uncaptured_attention(model: torch.nn.Module) -> list[str]:
    """Names of the nn.MultiheadAttention weights no forward hook can see."""
    names = {id(p): n for n, p in named_trainable(model)}
    out = []
    for m in model.modules():
        if isinstance(m, torch.nn.MultiheadAttention):
            out += [names[id(p)] for p in m.parameters() if id(p) in names and p.dim() == 2]
    return out


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
        self.captures = 0  # capture steps declared so far
        self.seconds = 0.0  # wall time spent in the hooks (copies, factor updates)
        self.uncaptured = _uncaptured_attention(model)
        if self.uncaptured:
            warnings.warn(f"KfacCapture: nn.MultiheadAttention computes its projections without nn.Linear.forward; "
                          f"{len(self.uncaptured)} weight(s) are not captured and keep the identity geometry: "
                          f"{self.uncaptured[:6]}", RuntimeWarning, stacklevel=2)
        self._handles = [m.register_forward_hook(self._forward_hook(name)) for m, name in self.layers.items()]

    def step(self, step: int) -> bool:
        """Declare the step about to run; returns whether it captures."""
        self.active = int(step) % self.every == 0
        self.captures += int(self.active)
        return self.active

    def silent_layers(self) -> list[str]:
        """Captured segments that never received a batch although capture steps ran (e.g. layers
        not used in forward, or called without their forward hook)."""
        if self.captures == 0:
            return []
        return [n for n in self.estimator.segments if self.estimator.counts[n] == 0]

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            if not (self.active and module.training and torch.is_grad_enabled() and output.requires_grad):
                return
            t0 = time.perf_counter()
            a = inputs[0].detach().reshape(-1, module.in_features)
            rows = a.shape[0]
            idx = None
            if rows > self.tokens:
                idx = torch.from_numpy(np.sort(self.rng.choice(rows, self.tokens, replace=False))).to(a.device)
                a = a.index_select(0, idx)
            a_np = a.to(device="cpu", dtype=torch.float64).numpy()

            def grad_hook(grad: torch.Tensor) -> None:
                t1 = time.perf_counter()
                d = grad.detach().reshape(-1, module.out_features)
                if idx is not None:
                    d = d.index_select(0, idx)
                self.estimator.update(name, a_np, d.to(device="cpu", dtype=torch.float64).numpy())
                self.seconds += time.perf_counter() - t1

            output.register_hook(grad_hook)
            self.seconds += time.perf_counter() - t0

        return hook

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def state_dict(self) -> dict[str, Any]:
        """This rank's captured factors (the estimator's running A, G and batch counts, copies),
        the capture-step count, the row sampler's state and the settings every, tokens: what a
        resume needs to capture on as an uninterrupted run would (a per-rank checkpoint: the
        factors differ by rank)."""
        est = self.estimator
        return {"a": {n: None if a is None else a.copy() for n, a in est._a.items()},
                "g": {n: None if g is None else g.copy() for n, g in est._g.items()},
                "counts": dict(est.counts), "captures": self.captures, "active": self.active,
                "rng": self.rng.bit_generator.state, "every": self.every, "tokens": self.tokens}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (ValueError, before anything changes, for factors of
        segments or shapes this capture's estimator does not have)."""
        est = self.estimator
        a = {n: None if v is None else np.array(v, np.float64) for n, v in state["a"].items()}
        g = {n: None if v is None else np.array(v, np.float64) for n, v in state["g"].items()}
        for n in set(a) | set(g):
            if n not in est.counts:
                raise ValueError(f"KfacCapture.load_state_dict: {n!r} is not a captured segment ({est.segments[:6]})")
            m_out, n_in = est.layout[n].matrix_shape
            an, gn = a.get(n), g.get(n)
            if (an is not None and an.shape != (n_in, n_in)) or (gn is not None and gn.shape != (m_out, m_out)):
                raise ValueError(f"KfacCapture.load_state_dict: the factors of {n!r} do not fit its shape "
                                 f"{est.layout[n].shape}")
        est._a = {n: a.get(n) for n in est.segments}
        est._g = {n: g.get(n) for n in est.segments}
        est.counts = {n: int(state["counts"].get(n, 0)) for n in est.segments}
        self.captures, self.active = int(state["captures"]), bool(state["active"])
        self.rng.bit_generator.state = state["rng"]


def build_geometries(estimator: KfacEstimator, layouts: Sequence[Layout], policy: SelectivePolicy | None = None,
                     damping: float = DEFAULT_DAMPING) -> list[Geometry]:
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


def geometries_from_factors(comm: Any, model_layout_: Layout, segments: Sequence[str],
                            factors: Mapping[str, tuple[np.ndarray, np.ndarray]], counts: Mapping[str, int],
                            layouts: Mapping[int, Layout], policy: SelectivePolicy | None = None,
                            damping: float = DEFAULT_DAMPING, mode: str = "broadcast") -> dict[int, tuple[Layout, Geometry]]:
    """Collective over ``comm`` (any giftcomm Transport, an mpi4py communicator, or None): sync
    a snapshot of KFAC factors (``factors``: segment -> (A (n, n), G (m, m)); ``counts``: batches
    per segment, as :class:`KfacEstimator` keeps them) and build one geometry per bucket layout
    with the selective policy. Returns {bucket index: (layout, geometry)}, identical on every rank."""
    mats, cnt = [], []
    for n in segments:
        m_out, n_in = model_layout_[n].matrix_shape
        a, g = factors.get(n, (None, None))
        mats += [g if g is not None else np.zeros((m_out, m_out)), a if a is not None else np.zeros((n_in, n_in))]
        cnt += [int(counts.get(n, 0))] * 2
    spectra, _ = sync_spectra(comm, mats, cnt, mode)
    synced = {n: (spectra[2 * i + 1], spectra[2 * i]) for i, n in enumerate(segments) if spectra[2 * i] is not None}
    policy = policy or SelectivePolicy()
    out = {}
    for index, layout in layouts.items():
        out[index] = (layout, select(layout, {n: f for n, f in synced.items() if n in layout}, policy, damping))
    return out
