"""The paper's preset for the mpiexec adapters (GradSync, ShardedGradSync): one implementation of
the capture of A and of the refresh.

- **Capture** (:class:`InputCapture`): a forward hook on every nn.Linear of the model (those with a
  trainable weight; not the ones inside nn.MultiheadAttention, whose forward never runs) feeds
  the layer's input rows ``a`` (..., in) to a :class:`~giftcomm.geometry.InputFactorEstimator`
  (``A <- decay A + (1 - decay) a^T a / rows``, PaperOptions.decay, 0.95), on every training
  forward with gradients enabled (all rows, or ``tokens`` sampled ones). The segment of a layer is
  its weight's parameter name.
- **Refresh** (:class:`PaperRefresh`): on every ``refresh_every``-th sync (syncs 0, K, 2K, ...:
  the first geometry is built from the first step's A), A is averaged over the ranks and the
  factors rebuilt and blended with the previous ones (PaperOptions.factor_decay;
  giftcomm.geometry.paper.refresh_geometries), so every rank applies the same map (fingerprints
  agreed; a rank missing a factor raises on every rank).
  Between refreshes the map stays fixed; an error feedback in the transformed coordinates is
  re-expressed by its owner when the map changes (giftcomm.collectives.feedback.TransformedFeedback).
- **Agreement** (:meth:`PaperRefresh.agree`): at EVERY sync, before anything else, one int64
  allgather checks that the ranks have the same sync counter and the same settings
  (giftcomm.geometry.paper.agree_refresh), so ranks that would refresh at different syncs, or
  build their maps differently, raise the same ValueError at once instead of one of them
  entering the refresh's collectives alone.
- **Checkpoints** (:meth:`PaperRefresh.state_dict`): the refresh count, the factor EMA and this
  rank's captured A with its row sampler, so a resume at any sync continues bit for bit.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ...geometry import Geometry, InputFactorEstimator, Layout
from ...geometry.paper import FactorEMA, PaperOptions, agree_refresh, refresh_geometries
from .kfac import linear_segments, model_layout

__all__ = ["InputCapture", "PaperRefresh"]


class InputCapture:
    """Forward hooks feeding each nn.Linear's input covariance A to an InputFactorEstimator.

    model: the nn.Module. layout: the Layout the estimator's segments belong to (default:
    ``model_layout(model)``). options: PaperOptions (its ``decay``; its ``names``, when set,
    restrict the capture to those weights). tokens: rows kept per layer per forward (None: all),
    sampled with ``seed``. ``seconds``: wall time spent in the hooks."""

    def __init__(self, model: torch.nn.Module, options: PaperOptions, layout: Layout | None = None,
                 tokens: int | None = None, seed: int = 0) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"the paper's preset captures A from the model's nn.Linear layers: pass the nn.Module, "
                            f"got {type(model).__name__}")
        self.layout = layout if layout is not None else model_layout(model)
        layers = {m: n for m, n in linear_segments(model).items() if n in self.layout}
        if options.names is not None:
            layers = {m: n for m, n in layers.items() if n in options.names}
        self.layers = layers
        self.estimator = InputFactorEstimator(self.layout, sorted(set(layers.values())), decay=options.decay)
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"tokens must be None or an int >= 1, got {tokens!r}")
        self.tokens = tokens
        self.rng = np.random.default_rng(seed)
        self.seconds = 0.0
        self._handles = [m.register_forward_hook(self._hook(name)) for m, name in layers.items()]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            if not (module.training and torch.is_grad_enabled()):
                return
            t0 = time.perf_counter()
            a = inputs[0].detach().reshape(-1, module.in_features)
            if self.tokens is not None and a.shape[0] > self.tokens:
                idx = np.sort(self.rng.choice(a.shape[0], self.tokens, replace=False))
                a = a[torch.from_numpy(idx).to(a.device)]
            self.estimator.update(name, a.to(torch.float64).cpu().numpy())
            self.seconds += time.perf_counter() - t0
        return hook

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def state_dict(self) -> dict[str, Any]:
        """This rank's captured A (the estimator's EMA and counts) and the row sampler's state."""
        return {"estimator": self.estimator.state_dict(), "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.estimator.load_state_dict(state["estimator"])
        self.rng.bit_generator.state = state["rng"]


class PaperRefresh:
    """Capture + refresh of the paper's preset for one model (module doc).

    model: the nn.Module; options: PaperOptions; layout: the layout the capture's segments
    belong to (default: the model's); tokens: rows captured per layer per forward (None: all).
    ``factor_ema``: the factor EMA across refreshes; ``refreshes``: refreshes done."""

    def __init__(self, model: torch.nn.Module, options: PaperOptions, layout: Layout | None = None,
                 tokens: int | None = None) -> None:
        self.options = options
        self.capture = InputCapture(model, options, layout, tokens)
        self.factor_ema = FactorEMA()
        self.refreshes = 0

    def due(self, sync: int) -> bool:
        """Whether sync number ``sync`` (0, 1, ...) refreshes the map (every refresh_every-th)."""
        return sync % self.options.refresh_every == 0

    def agree(self, transport: Any, sync: int, what: str, extra: Mapping[str, int] | None = None) -> bool:
        """Collective, at every sync before anything else: the ranks agree on the sync counter, the
        settings and the adapter's ``extra`` fields (giftcomm.geometry.paper.agree_refresh: the
        same ValueError on every rank otherwise); returns whether this sync refreshes (:meth:`due`)."""
        agree_refresh(transport, what, sync, self.options, extra)
        return self.due(sync)

    def geometries(self, transport: Any, layouts: Mapping[Any, Layout], sync: int) -> dict[Any, Geometry]:
        """Collective over ``transport``: key -> the paper's geometry of each layout, from this
        rank's A averaged over the ranks (giftcomm.geometry.paper.refresh_geometries, smoothed by
        the factor EMA). Raises on every rank as that does. Call after :meth:`agree`."""
        geos = refresh_geometries(transport, layouts, self.capture.estimator.factors(), sync, self.options,
                                  smoothing=self.factor_ema)
        self.refreshes += 1
        return geos

    def state_dict(self) -> dict[str, Any]:
        """The refresh count, the factor EMA's history (both the same on every rank) and this
        rank's capture (its A and row sampler): what a resume needs to continue bit for bit."""
        return {"refreshes": self.refreshes, "factor_ema": self.factor_ema.state_dict(),
                "capture": self.capture.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.refreshes = int(state["refreshes"])
        self.factor_ema.load_state_dict(state["factor_ema"])
        if state.get("capture") is not None:
            self.capture.load_state_dict(state["capture"])
