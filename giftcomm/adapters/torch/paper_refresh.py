"""The paper's preset for the mpiexec adapters (GradSync, ShardedGradSync): one implementation of
the capture of A and of the refresh.

- **Capture** (:class:`InputCapture`): a forward hook on every nn.Linear of the model (those with a
  trainable weight; not the ones inside nn.MultiheadAttention, whose forward never runs) feeds
  the layer's input rows ``a`` (..., in) to a :class:`~giftcomm.geometry.InputFactorEstimator`
  (``A <- decay A + (1 - decay) a^T a / rows``, PaperOptions.decay, 0.95), on every training
  forward with gradients enabled (all rows, or ``tokens`` sampled ones). The segment of a layer is
  its weight's parameter name.
- **Selection** (the paper's rule, when PaperOptions.names is None): syncs 0 .. W-1 (W =
  PaperOptions.profile_steps, the paper's 100) are the profile window: no map (every weight
  Euclidean) while each captured weight's local gradient is scored by its fraction of FP8 E5M2
  codes at a bound (:meth:`PaperRefresh.observe`, giftcomm.geometry.paper.SaturationProfile, one
  scale per tensor: the paper's wire); at sync W the scores are averaged over the ranks and the
  weights chosen (giftcomm.geometry.paper.select_for: top_n, else the top top_fraction, then
  threshold), the same on every rank; only those are transformed from then on. With names given,
  those are transformed from sync 0 and nothing is profiled; with profile_steps 0 and no names,
  every captured weight is, from sync 0.
- **Refresh** (:class:`PaperRefresh`): on every ``refresh_every``-th sync from the first map
  (syncs 0, K, 2K, ... with names given; W, W + K, W + 2K, ... after a profile window), A is
  averaged over the ranks and the factors of the transformed weights rebuilt and blended with the
  previous ones (PaperOptions.factor_decay; giftcomm.geometry.paper.refresh_geometries), so every
  rank applies the same map (fingerprints agreed; a rank missing a factor raises on every rank).
  A is captured from sync 0, so the first map's A has the whole window behind it.
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
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ...geometry import Geometry, InputFactorEstimator, Layout
from ...geometry.paper import FactorEMA, PaperOptions, SaturationProfile, agree_refresh, average_scores, refresh_geometries, select_for
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
        self.only: set[str] | None = None  # after a selection: the weights whose A is still captured
        self._handles = [m.register_forward_hook(self._hook(name)) for m, name in layers.items()]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            if not (module.training and torch.is_grad_enabled()) or (self.only is not None and name not in self.only):
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
    """Capture, selection and refresh of the paper's preset for one model (module doc).

    model: the nn.Module; options: PaperOptions; layout: the layout the capture's segments
    belong to (default: the model's); tokens: rows captured per layer per forward (None: all).
    ``factor_ema``: the factor EMA across refreshes; ``refreshes``: refreshes done;
    ``profile``: the SaturationProfile of the window (None with names given); ``selected``: the
    weights transformed (options.names, or the profile's choice once made; None before)."""

    def __init__(self, model: torch.nn.Module, options: PaperOptions, layout: Layout | None = None,
                 tokens: int | None = None) -> None:
        self.options = options
        self.capture = InputCapture(model, options, layout, tokens)
        self.factor_ema = FactorEMA()
        self.refreshes = 0
        self.profile: SaturationProfile | None = None
        self.selected: tuple[str, ...] | None = options.names
        if options.names is None and options.profile_steps > 0:  # profile_steps 0: every captured weight
            self.profile = SaturationProfile("e5m2", options.profile_steps)
            self.scored = sorted(set(self.capture.layers.values()))

    @property
    def profiling(self) -> bool:
        """Whether the selection is the profile's (options.names is None)."""
        return self.profile is not None

    def due(self, sync: int) -> bool:
        """Whether sync number ``sync`` (0, 1, ...) builds the maps: every refresh_every-th from
        sync 0 (names given), or sync 0 (the profile window's identity maps) and every
        refresh_every-th from sync profile_steps (module doc)."""
        k, w = self.options.refresh_every, self.options.profile_steps
        if not self.profiling:
            return sync % k == 0
        return sync == 0 or (sync >= w and (sync - w) % k == 0)

    def in_window(self, sync: int) -> bool:
        """Whether sync number ``sync`` lies in the profile window (no map; gradients scored)."""
        return self.profiling and sync < self.options.profile_steps

    def observe(self, layout: Layout, flat: Any, sync: int) -> None:
        """Score this rank's gradients of the captured weights in ``flat`` (one bucket's (n,)
        buffer over ``layout``: a NumPy array or a CPU/CUDA torch tensor) at sync ``sync``, when
        it lies in the profile window (else nothing). Call before the reduction (and before any
        error feedback is added): the paper scores what each rank is about to quantize."""
        if not self.in_window(sync):
            return
        assert self.profile is not None
        names = [n for n in self.scored if n in layout]
        if not names:
            return
        if isinstance(flat, torch.Tensor):
            flat = flat.detach().to("cpu", torch.float32).numpy()
        self.profile.update_flat(layout, flat, names)

    def agree(self, transport: Any, sync: int, what: str, extra: Mapping[str, int] | None = None) -> bool:
        """Collective, at every sync before anything else: the ranks agree on the sync counter, the
        settings and the adapter's ``extra`` fields (giftcomm.geometry.paper.agree_refresh: the
        same ValueError on every rank otherwise); returns whether this sync builds maps (:meth:`due`)."""
        agree_refresh(transport, what, sync, self.options, extra)
        return self.due(sync)

    def select(self, transport: Any) -> tuple[str, ...]:
        """Collective: the weights to transform from the profile's scores averaged over the ranks
        (giftcomm.geometry.paper.average_scores, select_for), the same on every rank; kept in
        ``selected``, and the capture of A narrowed to them."""
        assert self.profile is not None
        scores = self.profile.scores()
        missing = [n for n in self.scored if n not in scores]
        if missing:
            raise RuntimeError(f"paper preset: no gradient of {missing[:6]} was scored in the profile window; pass "
                               "every captured weight's bucket to observe()")
        self.selected = select_for(self.options, average_scores(transport, scores))
        self.capture.only = set(self.selected)
        return self.selected

    def geometries(self, transport: Any, layouts: Mapping[Any, Layout], sync: int) -> dict[Any, Geometry]:
        """Collective over ``transport`` (call at a sync where :meth:`agree` said due): key -> the
        paper's geometry of each layout. In the profile window: identity maps (no collective).
        At the window's end: the selection first (:meth:`select`). Then the maps of the selected
        weights from this rank's A averaged over the ranks (giftcomm.geometry.paper.
        refresh_geometries, smoothed by the factor EMA); identity everywhere when none is
        selected. Raises on every rank as those do."""
        if self.in_window(sync):
            return {k: Geometry.identity(lay) for k, lay in layouts.items()}
        if not self.profiling:  # names given, or every captured weight (profile_steps 0)
            self.refreshes += 1
            return refresh_geometries(transport, layouts, self.capture.estimator.factors(), sync, self.options,
                                      smoothing=self.factor_ema)
        if self.selected is None:
            self.select(transport)
        chosen = self.selected or ()
        self.refreshes += 1
        if not chosen:
            return {k: Geometry.identity(lay) for k, lay in layouts.items()}
        factors = {n: a for n, a in self.capture.estimator.factors().items() if n in chosen}
        return refresh_geometries(transport, layouts, factors, sync, replace(self.options, names=tuple(chosen)),
                                  smoothing=self.factor_ema)

    def state_dict(self) -> dict[str, Any]:
        """The refresh count, the factor EMA's history, the selection (all the same on every
        rank), this rank's profile scores and capture (its A and row sampler): what a resume
        needs to continue bit for bit."""
        return {"refreshes": self.refreshes, "factor_ema": self.factor_ema.state_dict(),
                "capture": self.capture.state_dict(), "selected": self.selected,
                "profile": None if self.profile is None else self.profile.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.refreshes = int(state["refreshes"])
        self.factor_ema.load_state_dict(state["factor_ema"])
        if state.get("capture") is not None:
            self.capture.load_state_dict(state["capture"])
        if self.profile is not None:
            sel = state.get("selected")
            self.selected = None if sel is None else tuple(sel)
            self.capture.only = None if sel is None else set(sel)
            if state.get("profile") is not None:
                self.profile.load_state_dict(state["profile"])
