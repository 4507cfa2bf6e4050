"""ZeRO / Megatron-style gradient sync: the flat padded gradient buffer reduce-scattered into this
rank's shard, for a sharded optimizer the user writes.

::

    sync = ShardedGradSync(model, comm=comm, fmt="e4m3")     # every .grad a view of sync.buffer
    master = sync.param_shard()                             # this rank's fp32 slice of the parameters
    for batch in data:
        sync.zero_grad()
        loss(model, batch).backward()
        grad = sync.sync()                                  # (shard,) reduced (op="avg") gradient
        master -= lr * grad                                 # the optimizer sees only its shard
        sync.gather_params(master)                          # every rank gets every updated parameter

The buffer holds the trainable parameters' gradients back to back in ``named_parameters``
order, zero-padded to a multiple of P; rank r owns elements ``[r*n/P, (r+1)*n/P)``
(``giftcomm.reduce_scatter(layout="equal")``), like ZeRO's partitions and Megatron's
distributed-optimizer buffer. Options: those of :class:`giftcomm.options.CallOptions` (fmt,
block, rounding, seed, algorithm: one of reduce_scatter's, slice_elems, timeout, op).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ... import api
from ...accounting import Tally
from ...algorithms import SCATTER_CHOICES
from ...collectives.feedback import ErrorFeedback, TransformedFeedback, check_feedback_format, own_pieces, own_quantization_error
from ...geometry import Geometry, Layout
from ...geometry.schedule import GiftSchedule, schedule_of
from ...geometry.sharded import inverse_flat_shard
from ...options import CallOptions, options_of_call
from ...transport import resolve
from .buckets import named_trainable
from .paper_refresh import PaperRefresh

__all__ = ["ShardedGradSync"]

_SCHEDULE = GiftSchedule()  # ShardedGradSync's schedule when none is given


class ShardedGradSync:
    """Reduce-scatter a model's gradients into equal shards of one flat padded buffer.

    model: an nn.Module or (name, parameter) pairs, all of one float dtype and device (CPU, or
    CUDA with a device transport). comm: mpi4py communicator, giftcomm Transport or None (as
    for the collectives). options / ``**opts``: the call options (keywords, or one CallOptions as
    ``options=``; docs/api.md; op defaults to "avg", like DDP). With
    ``rounding="stochastic"``, ``sync(seed)`` uses ``seed`` (default: the number of earlier syncs).
    Raises TypeError/ValueError at once for mixed dtypes or devices and bad options.
    schedule: a :class:`giftcomm.GiftSchedule` (default ``GiftSchedule()``), taken whole; this
    sync reads its geometry ("none" or "paper"), paper and error_feedback (another knob off its
    default is a ValueError); the previous release's keywords (error_feedback, geometry, paper)
    still build it, with a DeprecationWarning.
    error_feedback=True: keep what this rank's own encoding lost and add it to the next
    gradient (giftcomm.collectives.feedback: exact for "direct", whose every message is this rank's own
    values; docs/method.md "Error feedback"); block-scaled fmt only; with geometry="paper" in the
    map's coordinates (below). :meth:`state_dict` holds the
    residual (this rank's own) for a per-rank checkpoint; ``algorithm_used``: what the last
    sync really ran.

    geometry="paper": the GIFT paper's preset in one word (``model`` the nn.Module; settings
    ``schedule.paper``; ``capture_tokens`` rows per layer and forward, None: all): the nn.Linear
    inputs' covariances A are captured by forward hooks; with names None (the default) the first
    profile_steps syncs run Euclidean while the weights' gradients are scored for the paper's
    selection (giftcomm.adapters.torch.paper_refresh), and every ``paper.refresh_every``-th sync
    from then on (from sync 0 with names given) the map of the selected weights is rebuilt from A
    averaged over the ranks, factor EMA included (shared with GradSync);
    every sync starts with one int64 allgather in which the ranks agree on the sync count and the
    settings (the same ValueError on every rank when they differ).
    Each rank maps its whole local buffer forward, the reduce-scatter runs in those coordinates
    (float32), and the inverse maps this rank's shard alone: whole rows here, a row the equal
    split cuts from the pieces the ranks exchange (giftcomm.geometry.sharded.inverse_flat_shard,
    exact: raw float32). ``geometry_of``: the current map over the padded buffer. Host (CPU)
    parameters only (NotImplementedError otherwise). With error_feedback=True the residual lives
    in the map's coordinates (giftcomm.collectives.feedback.TransformedFeedback, as GradSync's default):
    ``e = y - Q(y)`` for ``y = T(g) + e_prev`` (float32, (padded,)), the pieces of y this rank
    encodes alone in the reduce-scatter the call ran (exact for "direct": every chunk but its own;
    ring: hop 0's chunk), added to the next sync's ``T(g)``; at a refresh it is re-expressed,
    ``e_new = T_new(T_old^-1(e_old))`` (the residual in ordinary coordinates unchanged, to float32
    rounding), or kept as it is with the settings' ``reexpress=False`` (the artifact's way). On the
    layers the map leaves Euclidean (identity), and in the profile window, there is none (the
    artifact's Euclidean branch has no error feedback).

    Attributes: ``buffer`` (padded,) the gradients; ``lo``, ``hi`` this rank's element range;
    ``numel`` the parameters' element count (without padding); ``size``, ``rank``.
    """

    def __init__(self, model: Any, *, comm: Any = None, schedule: GiftSchedule | None = None,
                 capture_tokens: int | None = None, options: CallOptions | None = None, **opts: Any) -> None:
        self.schedule = schedule_of("ShardedGradSync", schedule, opts, _SCHEDULE).check_for(
            "ShardedGradSync", ("none", "paper"), ("error_feedback",))
        sched = self.schedule
        if sched.geometry == "none" and capture_tokens is not None:
            raise ValueError('ShardedGradSync: capture_tokens= goes with geometry="paper" only')
        self.options = options_of_call("ShardedGradSync", options, opts, {"op": "avg"})
        if sched.error_feedback:
            check_feedback_format(self.options.format, "ShardedGradSync")
        self.feedback: ErrorFeedback | TransformedFeedback | None = None
        if sched.error_feedback:  # the paper: no residual on the layers it leaves Euclidean
            self.feedback = (TransformedFeedback(reexpress=sched.paper.reexpress, euclidean=False) if sched.paper
                             else ErrorFeedback())
        self.algorithm_used: str | None = None
        if self.options.algorithm not in SCATTER_CHOICES:
            raise ValueError(f"ShardedGradSync: algorithm must be one of {', '.join(SCATTER_CHOICES)} "
                             f"(reduce-scatter algorithms), got {self.options.algorithm!r}")
        self.params = named_trainable(model)
        if not self.params:
            raise ValueError("ShardedGradSync: the model has no trainable parameters")
        kinds = {(p.dtype, p.device) for _, p in self.params}
        if len(kinds) != 1:
            raise TypeError(f"ShardedGradSync: parameters must share one dtype and device, got {sorted(map(str, kinds))}")
        dtype, device = kinds.pop()
        self.comm = resolve(comm, device=device.type == "cuda")
        self.size, self.rank = self.comm.size, self.comm.rank
        self._tally = Tally()  # what stats() reports
        self.numel = sum(p.numel() for _, p in self.params)
        padded = -(-self.numel // self.size) * self.size
        self.lo, self.hi = self.rank * padded // self.size, (self.rank + 1) * padded // self.size
        self.buffer = torch.zeros(padded, dtype=dtype, device=device)
        self.calls = 0
        self.refresh: PaperRefresh | None = None
        self.geometry_of: Geometry | None = None  # geometry="paper": the map over the padded buffer
        if sched.paper is not None:
            if device.type != "cpu":
                raise NotImplementedError('ShardedGradSync: geometry="paper" runs on host (CPU) parameters only')
            segs = [(n, tuple(p.shape)) for n, p in self.params]
            self._padded_layout = Layout(segs + ([("<padding>", (padded - self.numel,))] if padded > self.numel else []))
            try:
                self.refresh = PaperRefresh(model, sched.paper, layout=Layout(segs), tokens=capture_tokens)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"ShardedGradSync: {exc}") from None
        self.zero_grad()

    def zero_grad(self) -> None:
        """Zero the buffer and make every ``.grad`` a view of it again (use instead of
        ``optimizer.zero_grad()``, which would detach the views)."""
        self.buffer.zero_()
        off = 0
        for _, p in self.params:
            p.grad = self.buffer[off : off + p.numel()].view_as(p)
            off += p.numel()

    def sync(self, seed: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Collective: this rank's (hi - lo,) shard of the reduced gradient buffer (a new tensor,
        or ``out``). seed: stochastic rounding's seed (default: the call count)."""
        self._bind()
        seed = self.calls if seed is None else int(seed)
        self.calls += 1
        o = self.options
        shard = torch.empty(self.hi - self.lo, dtype=self.buffer.dtype, device=self.buffer.device) if out is None else out
        call_seed = seed if o.rounding == "stochastic" else None
        this = o.replace(seed=call_seed)  # this sync's options, passed whole
        if self.refresh is not None:
            return self._sync_paper(self.calls - 1, shard, call_seed)

        def reduce(values: Any = None) -> None:
            x = self.buffer if values is None else torch.as_tensor(values, device=self.buffer.device).to(self.buffer.dtype)
            api.reduce_scatter(x, comm=self.comm, out=shard, layout="equal", options=this)
            self._tally.add(self.comm, device=self.buffer.device.type == "cuda")

        if isinstance(self.feedback, ErrorFeedback):
            # compensated in a copy: the .grad views keep this rank's own gradient
            self.algorithm_used = self.feedback.around(0, self.buffer, reduce, lambda: self.comm, o.format,
                                                       o.resolved_block, call_seed, signature=int(self.numel),
                                                       in_place=False)
        else:
            reduce()
            last = api.last_algorithm(self.comm)
            self.algorithm_used = None if last is None else last[0]
        return shard

    def _sync_paper(self, sync_index: int, shard: torch.Tensor, call_seed: int | None) -> torch.Tensor:
        """The reduce-scatter in the paper's coordinates (class doc): refresh when due, map the
        local buffer forward, reduce-scatter (float32), map this rank's shard back."""
        assert self.refresh is not None
        o = self.options
        has_map = {"has_map": int(self.geometry_of is not None)}
        if self.refresh.agree(self.comm, sync_index, "ShardedGradSync", has_map):  # every sync, before any refresh
            self.geometry_of = self.refresh.geometries(self.comm, {0: self._padded_layout}, sync_index)[0]
        geo = self.geometry_of
        self.refresh.observe(self._padded_layout, self.buffer, sync_index)  # the profile window's scores
        if geo is None:  # calls set by hand past sync 0 without the map (load_state_dict restores both)
            raise RuntimeError(f"ShardedGradSync: sync {sync_index} is no refresh and there is no map yet; restore "
                               "a state_dict of this sync, which holds the map")
        buf = self.buffer.detach()
        x = np.ascontiguousarray(geo.forward((buf if buf.dtype in (torch.float32, torch.float64) else buf.float()).numpy()),
                                 dtype=np.float32)
        fb = self.feedback
        if fb is not None:  # T(g) + e, e carried into this map's coordinates (re-expressed at a refresh)
            assert isinstance(fb, TransformedFeedback)
            fb.compensate_mapped(0, x, geo, signature=int(self.numel))
        got = api.reduce_scatter(x, comm=self.comm, layout="equal", options=o.replace(seed=call_seed))
        self._tally.add(self.comm)
        last = api.last_algorithm(self.comm)
        self.algorithm_used = None if last is None else last[0]
        if fb is not None:  # what this rank's own encoding of x lost, in the map's coordinates
            if last is None:
                raise RuntimeError("ShardedGradSync: no reduce-scatter recorded on this transport")
            block = o.resolved_block
            pieces, stage = own_pieces(last[0], int(x.size), self.size, self.rank, block, last[1])
            fb.record_error(0, own_quantization_error(x, o.format, block, call_seed, self.rank, pieces, stage), geo,
                            signature=int(self.numel))
        back = inverse_flat_shard(geo, got, self.lo, self.comm)
        shard.copy_(torch.from_numpy(back))
        return shard

    def stats(self) -> dict[str, Any]:
        """What this rank sent in this ShardedGradSync's reduce-scatters and gather_params allgathers: the dict of :func:`giftcomm.stats`
        (calls, bytes_sent per format or "native", algorithms, fallbacks; docs/api.md, "What was sent")."""
        return self._tally.as_dict()

    def state_dict(self) -> dict[str, Any]:
        """The call count and this rank's error-feedback residual (None without feedback): a
        per-rank checkpoint (the residual differs by rank); with geometry="paper" also the current
        map, the refresh count, the factor EMA and this rank's captured A (with its row sampler),
        so that :meth:`load_state_dict` into a fresh ShardedGradSync resumes at any sync --
        between refreshes too -- bit-identical to an uninterrupted run."""
        return {"calls": self.calls, "error_feedback": None if self.feedback is None else self.feedback.state_dict(),
                "geometry": self.geometry_of if self.refresh is not None else None,
                "paper": None if self.refresh is None else self.refresh.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (ValueError, before anything changes, for a geometry="paper"
        state on a sync without it or the other way round, or a map of another buffer)."""
        has_paper = state.get("paper") is not None
        if has_paper != (self.refresh is not None):
            raise ValueError(f"ShardedGradSync.load_state_dict: a state {'with' if has_paper else 'without'} the "
                             f"paper preset's maps, for a sync {'without' if self.refresh is None else 'with'} "
                             "geometry='paper'")
        geo = state.get("geometry")
        if has_paper and geo is not None and geo.size != self.buffer.numel():
            raise ValueError(f"ShardedGradSync.load_state_dict: the saved map covers {geo.size} values, the padded "
                             f"buffer has {self.buffer.numel()}")
        self.calls = int(state["calls"])
        if self.refresh is not None:
            self.refresh.load_state_dict(state["paper"])
            self.geometry_of = geo
        if self.feedback is not None:
            self.feedback.reset()
            if state.get("error_feedback") is not None:
                self.feedback.load_state_dict(state["error_feedback"])

    def param_shard(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A copy of this rank's slice of the flat parameters (padding zeros), as ``dtype``: the
        master weights a sharded optimizer updates."""
        flat = torch.zeros(self.buffer.numel(), dtype=dtype, device=self.buffer.device)
        off = 0
        for _, p in self.params:
            flat[off : off + p.numel()] = p.detach().reshape(-1)
            off += p.numel()
        return flat[self.lo : self.hi].clone()

    def gather_params(self, shard: torch.Tensor) -> None:
        """Collective: every rank's updated parameter shard (``(hi - lo,)``) gathered exactly
        (fp32 wire: raw values) and written into the parameters, cast to their dtype."""
        want = self.hi - self.lo  # >= 1 on every rank (the padded length is a multiple of P)
        good = tuple(shard.shape) == (want,)
        # A bad shard still takes part in the allgather, as an empty one: every rank then sees a
        # short total and raises the same ValueError, instead of its peers waiting out the deadline.
        send = shard.detach().to(torch.float32).contiguous() if good else torch.zeros(0, device=self.buffer.device)
        full = api.allgather(send, comm=self.comm, fmt="fp32", timeout=self.options.timeout)
        self._tally.add(self.comm)
        if not good:
            raise ValueError(f"ShardedGradSync.gather_params: shard must have shape ({want},), got {tuple(shard.shape)}")
        if full.numel() != self.buffer.numel():
            raise ValueError("ShardedGradSync.gather_params: another rank passed a shard of the wrong shape "
                             f"({full.numel()} values gathered, {self.buffer.numel()} expected)")
        off = 0
        with torch.no_grad():
            for _, p in self.params:
                p.copy_(full[off : off + p.numel()].view_as(p))
                off += p.numel()

    def _bind(self) -> None:
        off = 0
        for _, p in self.params:
            n = p.numel()
            if p.grad is None or p.grad.data_ptr() != self.buffer[off:].data_ptr():
                if p.grad is not None:
                    self.buffer[off : off + n].copy_(p.grad.reshape(-1))
                else:
                    self.buffer[off : off + n].zero_()
                p.grad = self.buffer[off : off + n].view_as(p)
            off += n

