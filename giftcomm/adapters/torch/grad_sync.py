"""Gradient synchroniser for plain training loops under mpiexec (no torch.distributed).

::

    sync = GradSync(model, comm=MPI.COMM_WORLD, fmt="e4m3", bucket_mb=25)
    for batch in data:
        sync.zero_grad()
        loss(model, batch).backward()     # autograd accumulates into the buckets
        sync.sync()                       # gift_allreduce each bucket in place (op="avg")
        opt.step()

Every ``.grad`` is a view of a flat bucket, so the collective reads and writes the gradients
without a copy: on the CPU a NumPy view, on a GPU the CUDA tensor itself, reduced by giftcomm's
device path (``comm`` an mpi4py communicator: NCCL over its ranks; or a device Transport) with
the CUDA kernels on torch's current stream. Parameters may be float32, float64, float16 or
bfloat16. Each bucket may have its own geometry (``set_geometries``).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import api
from ...accounting import Tally
from ...collectives.feedback import ErrorFeedback, TransformedFeedback, check_feedback_format
from ...geometry.schedule import GiftSchedule, schedule_of
from ...options import CallOptions, options_of_call
from ...transport import resolve
from ..calls import log_path, step_options
from .buckets import GradBucket, make_buckets
from .paper_refresh import PaperRefresh
from .streams import on_stream

__all__ = ["GradSync", "SyncTimes"]

_SCHEDULE = GiftSchedule()  # GradSync's schedule when none is given


@dataclass
class SyncTimes:
    """Wall seconds of one ``sync()``: transform (geometry forward + inverse), comm (the rest of
    the collective: agreement, codec, transfers), total."""

    transform: float = 0.0
    comm: float = 0.0
    total: float = 0.0


class _TimedGeometry:
    """Wraps a geometry, adding the seconds spent in forward/inverse to ``seconds``."""

    def __init__(self, geometry) -> None:
        self.g, self.seconds = geometry, 0.0
        self.size, self.is_identity = geometry.size, geometry.is_identity

    def fingerprint(self) -> int:
        return self.g.fingerprint()

    def forward(self, flat: np.ndarray) -> np.ndarray:
        return self._timed(self.g.forward, flat)

    def inverse(self, flat: np.ndarray) -> np.ndarray:
        return self._timed(self.g.inverse, flat)

    def _timed(self, apply, flat: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return apply(flat)
        finally:
            self.seconds += time.perf_counter() - t0


class GradSync:
    """Allreduce a model's gradients bucket by bucket with giftcomm.

    model: an nn.Module or (name, parameter) pairs (CPU or CUDA; float32/64/16, bfloat16). comm:
    mpi4py communicator, giftcomm Transport or None (as :func:`giftcomm.allreduce`: MPI.COMM_WORLD, or
    torch's default group under torchrun). options / ``**opts``: the
    call options of ``giftcomm.allreduce`` (keywords, or one :class:`~giftcomm.options.CallOptions`
    as ``options=``; docs/api.md; op defaults to "avg", averaging like DDP; auto per bucket, its
    path logged at INFO once per bucket size), validated here: a bad one raises
    ValueError/TypeError naming GradSync; ``sync.options`` is the record. bucket_mb: bucket size
    in MiB. With ``rounding="stochastic"``, ``sync(step)`` rounds bucket i with the seed
    ``giftcomm.adapters.calls.step_seed(seed, step, i)`` (step defaults to the number of earlier
    sync calls, the same on every rank that calls sync in step).

    schedule: a :class:`giftcomm.GiftSchedule` (default ``GiftSchedule()``), taken whole; GradSync
    reads its geometry ("none" or "paper"), paper, error_feedback and feedback (another knob off
    its default is a ValueError). The previous release's keywords (error_feedback, feedback,
    geometry, paper) still build it, with a DeprecationWarning.

    error_feedback: keep, per bucket, what this rank's own encoding lost and add it to the
    bucket's next gradient (:mod:`giftcomm.collectives.feedback`, docs/method.md "Error feedback"; a
    block-scaled fmt only, else ValueError here). The residuals are this rank's own:
    :meth:`state_dict` holds them for a per-rank checkpoint. ``sync.algorithms``: the algorithm
    each bucket's last call really ran (``auto`` resolved).

    geometry "none": the buckets' geometries are what :meth:`set_geometries` sets; "paper": the
    GIFT paper's preset, giftcomm.geometry.paper, in one word (``model`` must be the nn.Module; a
    forward hook on each nn.Linear captures its input covariance A (EMA, PaperOptions.decay) and
    every ``paper.refresh_every``-th sync (syncs 0, K, 2K, ...) the maps are rebuilt from A averaged
    over the ranks, the factor blended with the previous one (factor_decay), every rank's map
    agreed; giftcomm.adapters.torch.paper_refresh; with ``paper.names`` None (the default) the
    weights transformed are the paper's selection: the first profile_steps syncs run Euclidean
    while each nn.Linear weight's local gradient is scored by its share of FP8 E5M2 codes at a
    bound, then the top ones (top_n / top_fraction / threshold) are chosen from the scores averaged
    over the ranks, the same on every rank; every sync starts with one int64 allgather in which the
    ranks agree on the sync count and the settings, so ranks that would refresh at different syncs
    raise the same ValueError at once). capture_tokens: rows of each layer's input captured per
    forward (None: all; geometry "paper" only).

    feedback: where the residuals live with error feedback (GiftSchedule.feedback_kind): None
    ("transformed" with geometry "paper" -- "transformed-kept" when its reexpress is False -- else
    "ordinary"; with geometry "paper" the residual is kept on the transformed weights only, none on
    the Euclidean ones nor during the profile window, as the paper's artifact), "ordinary"
    (gradient coordinates, :class:`~giftcomm.collectives.feedback.ErrorFeedback`),
    "transformed" (each bucket's geometry coordinates, re-expressed when the geometry changes: the
    paper's method with the re-expression, :class:`~giftcomm.collectives.feedback.TransformedFeedback`) or
    "transformed-kept" (not re-expressed: the paper's artifact). baseline: None, or a baseline
    wire (giftcomm.collectives.baselines.BASELINE_WIRES, e.g. "e5m2/tensor-nccl": one scale per tensor,
    NCCL's FP8 ring sum) that every bucket then goes through instead of giftcomm's collective
    (host buckets only; reference speed; fmt, block and the other call options are not used; op
    is); with error feedback it needs a "transformed" feedback (the residual is the wire's
    own-encoding error with its per-tensor scale).
    """

    def __init__(self, model, *, comm: Any = None, bucket_mb: float = 25.0, schedule: GiftSchedule | None = None,
                 baseline: str | None = None, capture_tokens: int | None = None,
                 options: CallOptions | None = None, **opts: Any) -> None:
        self.schedule = schedule_of("GradSync", schedule, opts, _SCHEDULE).check_for(
            "GradSync", ("none", "paper"), ("error_feedback", "feedback"))
        self.options: CallOptions = options_of_call("GradSync", options, opts, {"op": "avg"})
        self._paths_told: set[int] = set()  # bucket sizes whose path was logged (calls.log_path)
        self._tally = Tally()  # what stats() reports
        sched = self.schedule
        if sched.error_feedback:
            check_feedback_format(self.options.format, "GradSync")
        if sched.geometry == "none" and capture_tokens is not None:
            raise ValueError('GradSync: capture_tokens= goes with geometry="paper" only')
        feedback = sched.feedback_kind
        self.baseline = None
        if baseline is not None:
            from ...collectives.baselines import baseline_wire

            try:
                self.baseline = baseline_wire(baseline).name
            except ValueError as exc:
                raise ValueError(f"GradSync: {exc}") from None
            if sched.error_feedback and feedback == "ordinary":
                raise ValueError('GradSync: error feedback on a baseline wire needs feedback="transformed" or '
                                 '"transformed-kept"')
        self.feedback: Any = None
        if sched.error_feedback:
            # the paper's preset: no residual on the weights it leaves Euclidean (the artifact's rule)
            self.feedback = ErrorFeedback() if feedback == "ordinary" else TransformedFeedback(
                reexpress=feedback == "transformed", euclidean=sched.paper is None)
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"GradSync: bucket_mb must be a number > 0, got {bucket_mb!r}")
        self.comm = comm
        self.calls = 0  # sync() calls so far: the step of stochastic rounding when sync() gets none
        self.buckets: list[GradBucket] = make_buckets(model, bucket_mb)
        self.geometries: list[Any] = [None] * len(self.buckets)
        self.algorithms: list[str | None] = [None] * len(self.buckets)
        self.refresh: PaperRefresh | None = None  # geometry="paper": the capture of A and the refresh
        if sched.paper is not None:
            try:
                self.refresh = PaperRefresh(model, sched.paper, tokens=capture_tokens)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"GradSync: {exc}") from None

    @property
    def layouts(self):
        """The geometry Layout of each bucket, in bucket order."""
        return [b.layout for b in self.buckets]

    def set_geometries(self, geometries: Sequence[Any] | None) -> None:
        """One geometry (or None) per bucket; None clears all. Each must cover its bucket."""
        if geometries is None:
            self.geometries = [None] * len(self.buckets)
            return
        if len(geometries) != len(self.buckets):
            raise ValueError(f"need {len(self.buckets)} geometries (one per bucket), got {len(geometries)}")
        for b, g in zip(self.buckets, geometries):
            if g is not None and g.size != b.tensor.numel():
                raise ValueError(f"bucket {b.index}: geometry covers {g.size} elements, bucket has {b.tensor.numel()}")
        self.geometries = list(geometries)

    def zero_grad(self) -> None:
        """Zero every bucket and (re)bind the ``.grad`` views (use instead of optimizer.zero_grad)."""
        for b in self.buckets:
            b.zero()

    def sync(self, step: int | None = None) -> SyncTimes:
        """Collective: replace every gradient by its reduction over all ranks, in place.
        step: the training step the stochastic-rounding seeds derive from (default: the call
        count). Returns the wall-time split (transform / comm)."""
        sync_index = self.calls
        step = self.calls if step is None else int(step)
        self.calls += 1
        times = SyncTimes()
        t0 = time.perf_counter()
        if self.refresh is not None:  # every sync: the ranks agree on the refresh, then refresh when due
            control = resolve(self.comm, device=any(b.tensor.device.type == "cuda" for b in self.buckets))
            if self.refresh.agree(control, sync_index, "GradSync"):
                self._refresh(control, sync_index)
        for b, g in zip(self.buckets, self.geometries):
            b.bind()  # a grad replaced by someone else is copied into the bucket
            if self.refresh is not None:  # the profile window: score this rank's gradients before the wire
                self.refresh.observe(b.layout, b.tensor, sync_index)
            tg = None if g is None or g.is_identity else _TimedGeometry(g)
            o = step_options(self.options, step, b.index)
            if self.baseline is not None:
                self.algorithms[b.index] = self._baseline(b, g, tg)
                if tg is not None:
                    times.transform += tg.seconds
                continue
            with on_stream(b.tensor):
                def reduce(_values: Any = None, b=b, tg=tg, o=o) -> None:  # _values shares b.buffer
                    api.gift_allreduce(b.buffer, tg, comm=self.comm, out=b.buffer, options=o)
                    self._tally.add(self.comm, device=b.tensor.device.type == "cuda")

                def transport(b=b) -> Any:
                    return resolve(self.comm, device=b.tensor.device.type == "cuda")

                if self.feedback is not None:
                    self.algorithms[b.index] = self.feedback.around(
                        b.index, b.buffer, reduce, transport, self.options.format, self.options.resolved_block,
                        o.seed, g)
                else:
                    reduce()
                    last = api.last_algorithm(self.comm, device=b.tensor.device.type == "cuda")
                    self.algorithms[b.index] = None if last is None else last[0]
                log_path(self._paths_told, "GradSync", self.comm, b.tensor.numel(), self.options,
                         device=b.tensor.device.type == "cuda")
            if tg is not None:
                times.transform += tg.seconds
        times.total = time.perf_counter() - t0
        times.comm = times.total - times.transform
        return times

    def _refresh(self, transport: Any, sync_index: int) -> None:
        """Collective: the paper's maps of every bucket from A averaged over the ranks."""
        assert self.refresh is not None
        geos = self.refresh.geometries(transport, {b.index: b.layout for b in self.buckets}, sync_index)
        self.set_geometries([geos[b.index] for b in self.buckets])

    def _baseline(self, b: GradBucket, g: Any, tg: Any) -> str:
        """One bucket through the baseline wire (host), with the transformed-coordinate feedback."""
        from ...collectives.baselines import baseline_allreduce

        values = b.buffer
        if self.feedback is not None:
            self.feedback.compensate(b.index, values, g)
        assert self.baseline is not None
        _, err = baseline_allreduce(values, self.baseline, comm=self.comm, op=self.options.op, geometry=tg,
                                    out=values, own_error=True)
        self._tally.add(self.comm)  # counted under the wire's name
        if self.feedback is not None:
            self.feedback.record_error(b.index, err, g)
        return str(self.baseline)

    def stats(self) -> dict[str, Any]:
        """What this GradSync's reductions sent (this rank): ``{"calls", "bytes_sent": {fmt or
        "native": bytes}, "algorithms": {name: count}, "fallbacks": {reason: count}}``, as
        :func:`giftcomm.stats` counts them (docs/api.md, "What was sent"); a baseline wire's
        buckets count under the wire's name (giftcomm.collectives.baselines.baseline_sent_bytes)."""
        return self._tally.as_dict()

    def state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback residuals (host float32, by bucket index; empty without
        error_feedback) and the call count: a per-rank checkpoint (residuals differ by rank); with
        geometry="paper" also the buckets' current maps, the refresh count, the factor EMA and this
        rank's captured A (with its row sampler), so that :meth:`load_state_dict` into a fresh
        GradSync resumes at any sync -- between refreshes too -- bit-identical to an uninterrupted
        run."""
        return {"calls": self.calls, "error_feedback": None if self.feedback is None else self.feedback.state_dict(),
                "geometries": list(self.geometries) if self.refresh is not None else None,
                "paper": None if self.refresh is None else self.refresh.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a residual whose bucket size no longer matches is dropped
        at the next sync)."""
        self.calls = int(state["calls"])
        if self.refresh is not None and state.get("paper") is not None:
            self.refresh.load_state_dict(state["paper"])
            self.set_geometries(state["geometries"])
        if self.feedback is not None:
            self.feedback.reset()
            if state.get("error_feedback") is not None:
                self.feedback.load_state_dict(state["error_feedback"])

    def flat_grads(self) -> list[np.ndarray]:
        """The bucket buffers themselves (no copy), after binding: gradients that autograd or
        the optimizer replaced are copied in first, so the buffers hold the current ``.grad``."""
        for b in self.buckets:
            b.bind()
        return [b.buffer for b in self.buckets]
