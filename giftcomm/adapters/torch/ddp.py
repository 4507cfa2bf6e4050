"""DDP communication hook: giftcomm's low-precision allreduce (optionally GIFT) for DistributedDataParallel.

::

    state = GiftState(fmt="e4m3", schedule=GiftSchedule(warmup=10), param_names=model)   # validated; no communication
    ddp.register_comm_hook(state, gift_hook)

What ``gift_hook(state, bucket)`` does, per gradient bucket (any float dtype: float32, float16,
bfloat16, float64; buckets may be the gradients' own memory, ``gradient_as_bucket_view=True``):

0. The first bucket builds the state's private gloo groups over the process group (collective;
   every rank reaches it in the same order), so the state may be built before
   ``dist.init_process_group``. One rank is no special case: as ``giftcomm.allreduce`` at P = 1,
   the bucket goes through the wire format (docs/adapters.md, "One process"); with no process
   group at all (a hook called outside DDP) a one-rank loopback transport stands in for it.
1. While ``state.iter < state.schedule.warmup``: plain ``dist.all_reduce`` of the bucket divided by the
   world size (DDP's default hook), returned as its own future; uncompressed as asked, so
   counted in ``stats()`` and giftcomm.stats under ``"native"`` with the fallback reason
   ``"warmup"`` and not warned about (giftcomm.accounting).
2. **CUDA buckets (device route)**: on the calling (autograd) thread, a side CUDA stream waits
   for the current stream, then ``giftcomm.gift_allreduce(bucket, op="avg", out=bucket)`` runs
   the CUDA codec kernels on that stream (CuPy on ``ExternalStream``) over a
   :class:`~giftcomm.transport.torch_dist.TorchDistDeviceTransport` on DDP's own process group
   (``dist.batch_isend_irecv``: one NCCL group per ring hop, stream-ordered). No host copy, no
   stream synchronisation: the hook returns a CUDA-aware ``Future`` whose value is ready in stream
   order, so DDP's consumer waits on the GPU, not on the host, and backward keeps launching
   kernels meanwhile. The only host round trip is the call's small agreement (a few int64 over
   the control gloo group).
3. **CPU buckets (host route)**: the bucket goes to the state's single worker thread and the hook
   returns a fresh ``Future`` at once; the worker runs the same ``gift_allreduce`` over a
   :class:`~giftcomm.transport.torch_dist.TorchDistTransport` (a private gloo group) and completes
   the future (or fails it: DDP re-raises the exception from ``backward``). One worker means
   buckets are reduced in the order DDP launched them, the same on every rank.
4. Geometry (``schedule.geometry`` "reduced", "kfac" or "paper"): estimation and rebuilds run on a separate
   geometry thread that DDP never waits for. A geometry built from iteration ``r``'s data is
   adopted by every rank at the start of iteration ``r + 1 + rebuild_lag`` (a deterministic
   point, so every rank uses the same geometry for the same bucket); only if the rebuild is not
   finished by then does the hook wait for it (counted in ``stats().geometry_waits``).
5. After the last bucket of an iteration, ``state.iter`` advances.
"""
# No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run time.
import copy
import logging
import os
import threading
import time
import warnings
from concurrent.futures import Future as _CFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from ... import accounting, api
from ...accounting import Tally, native_sent_bytes
from ...collectives.feedback import ErrorFeedback, TransformedFeedback, check_feedback_format
from ...geometry import GradientFactorEstimator, Layout
from ...geometry.paper import FactorEMA, agree_refresh, refresh_geometries
from ...geometry.schedule import GEOMETRIES, GiftSchedule, schedule_of
from ...options import CallOptions, options_of_call
from ...transport.base import ANY, DEVICE, GROUPED, Transport
from ..calls import log_path, step_options
from .blas import blas_limit, warn_oversubscription
from .kfac import KfacCapture, geometries_from_factors
from .streams import on_stream

__all__ = ["GiftState", "GiftStats", "gift_hook", "logger"]

logger = logging.getLogger("giftcomm.adapters")

_HOOK_OPTIONS = {"op": "avg"}  # the hook averages, as DDP does
_SCHEDULE = GiftSchedule()  # the hook's schedule when none is given
_RENAMED = {"start_gift_iter": "warmup"}  # the previous release's keyword of a schedule knob
_USES = ("warmup", "estimate_every", "refresh_every", "rebuild_lag", "decay", "policy", "damping", "error_feedback")
_CAPTURED = ("kfac", "paper")  # the geometries built from factors captured from the model


@dataclass
class GiftStats:
    """What the hook did so far (``state.stats()``): ``calls``, ``bytes_sent``, ``algorithms``,
    ``fallbacks`` as every adapter's ``stats()`` has them (also as ``stats["calls"]`` etc.;
    docs/api.md, "What was sent"), and the hook's own counters.

    ``bytes_sent`` is the one byte counter: per format (``"native"``: uncompressed), the bytes
    this rank's messages carried, as giftcomm.stats counts them -- the warm-up buckets
    (``schedule.warmup``: DDP's own allreduce, in the bucket's dtype) under ``"native"`` with the
    fallback reason ``"warmup"``. ``bytes_in``: the size of every bucket the hook reduced, in its
    own dtype (what went in, not what was sent); ``ranks``: the ranks they were reduced over;
    ``bytes_saved`` (derived): what DDP's own ring allreduce of the same buckets would have sent,
    ``2 (ranks - 1) / ranks * bytes_in``, minus ``bytes_sent``. ``comm_seconds``: wall time
    of the reductions (host route: on the worker; device route: the host time to enqueue them,
    the GPU time is not measured here). ``geometry_seconds``: estimator updates and rebuilds on
    the geometry thread; ``geometry_waits``: times the hook had to wait for a rebuild.
    ``bytes_wire``: a deprecated alias of the total of ``bytes_sent`` (it counted one message of
    the whole bucket, not the algorithm's messages), removed in the next release."""

    iterations: int = 0
    warmup_buckets: int = 0
    host_buckets: int = 0
    device_buckets: int = 0
    bytes_in: int = 0
    ranks: int = 0
    comm_seconds: float = 0.0
    estimator_updates: int = 0
    rebuilds: int = 0
    geometry_seconds: float = 0.0
    geometry_waits: int = 0
    transformed_segments: int = 0
    # what giftcomm.stats counts, for this hook's reductions (docs/api.md, "What was sent"); also
    # readable as a mapping: stats["calls"], stats["bytes_sent"], ...
    calls: int = 0
    bytes_sent: dict = field(default_factory=dict)
    algorithms: dict = field(default_factory=dict)
    fallbacks: dict = field(default_factory=dict)

    _KEYS = ("calls", "bytes_sent", "algorithms", "fallbacks")

    def keys(self) -> tuple[str, ...]:
        """The keys of the stats dict every adapter's ``stats()`` has (``dict(state.stats())``)."""
        return self._KEYS

    def __getitem__(self, key: str) -> Any:
        if key not in self._KEYS:
            raise KeyError(key)
        return getattr(self, key)

    @property
    def bytes_saved(self) -> int:
        return native_sent_bytes(self.bytes_in, self.ranks, 1) - sum(self.bytes_sent.values())

    @property
    def bytes_wire(self) -> int:
        """Deprecated: the total of ``bytes_sent`` (removed in the next release)."""
        warnings.warn("GiftStats.bytes_wire is deprecated: use sum(stats.bytes_sent.values()) (bytes_sent is the "
                      "one byte counter)", DeprecationWarning, stacklevel=2)
        return sum(self.bytes_sent.values())

    def as_dict(self) -> dict:
        d = asdict(self)
        d["bytes_saved"] = self.bytes_saved
        return d


class _Runtime:
    """Internal state of a GiftState: transports, threads, estimators, geometries. Not pickled.

    Nothing here talks to the process group when it is made: the transports over it are built
    at the first bucket (:meth:`connect`, on the hook thread, in the same order on every rank),
    so a GiftState can be built (or unpickled) before ``dist.init_process_group``."""

    def __init__(self, transport: Optional[Transport], sync_transport: Optional[Transport]) -> None:
        self.lock = threading.Lock()
        self.given = transport
        self.host: Optional[Transport] = transport if transport is not None and transport.memory != DEVICE else None
        self.device: Optional[Transport] = transport if transport is not None and transport.memory in (DEVICE, ANY) \
            and transport.schedule == GROUPED else None
        self.sync_transport = sync_transport
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="giftcomm-ddp")
        self.tally = Tally()  # the reductions' giftcomm.accounting counts (GiftState.stats)
        self.geometry_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="giftcomm-geometry")
        self.streams: dict[int, Any] = {}
        self.layouts: dict[int, Layout] = {}
        self.estimators: dict[int, GradientFactorEstimator] = {}
        self.geometries: dict[int, tuple[Layout, Any]] = {}
        self.pending: list[tuple[int, _CFuture]] = []  # (adopt at iteration, future of {index: (layout, geo)})
        self.adopted_iter = -1
        self.warned: set[str] = set()

    def connect(self, state: "GiftState") -> None:
        """Build the transports over ``state.process_group`` that are still missing (collective:
        private gloo groups; called by the hook for every bucket, cheap once built)."""
        if self.given is None and self.host is None:
            if not _has_group():  # no process group (a hook called outside DDP): this process alone
                from ...transport.loopback import LoopbackGroup

                self.host = LoopbackGroup(1).transports[0]
            else:
                from ...transport.torch_dist import TorchDistTransport

                self.host = TorchDistTransport(state.process_group)
        if state.schedule.geometry in _CAPTURED and self.sync_transport is None:
            if self.given is None and not _has_group():
                self.sync_transport = self.host
            elif self.given is None:
                from ...transport.torch_dist import TorchDistTransport

                self.sync_transport = TorchDistTransport(state.process_group)  # the geometry thread's own group
            else:
                self.sync_transport = self.given

    def device_transport(self, state: "GiftState") -> Transport:
        if self.device is None:
            if self.given is not None:
                raise TypeError(f"gift_hook: a CUDA bucket, but the GiftState's transport {type(self.given).__name__} "
                                f"moves {self.given.memory} buffers only")
            if not _has_group():  # this process alone (see connect)
                from ...transport.device_loopback import DeviceLoopbackGroup

                self.device = DeviceLoopbackGroup(1).transports[0]
                return self.device
            from ...transport.torch_dist import TorchDistDeviceTransport, TorchDistTransport

            assert isinstance(self.host, TorchDistTransport)
            self.device = TorchDistDeviceTransport(state.process_group, control=self.host)
        return self.device

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)
        self.geometry_thread.shutdown(wait=True)


def _names_from(param_names: Any) -> dict[int, str]:
    """{id(parameter): name} from a dict {parameter: name}, a module (named_parameters; a DDP
    wrapper's ``module.`` prefix is dropped) or an iterable of (name, parameter)."""
    if param_names is None:
        return {}
    if isinstance(param_names, torch.nn.Module):
        mod = param_names.module if isinstance(param_names, torch.nn.parallel.DistributedDataParallel) else param_names
        return {id(p): n for n, p in mod.named_parameters()}
    if isinstance(param_names, dict):
        out = {}
        for p, n in param_names.items():
            if not isinstance(p, torch.Tensor) or not isinstance(n, str):
                raise TypeError("param_names must map parameters to names ({parameter: name}), a module, or (name, parameter) pairs")
            out[id(p)] = n
        return out
    try:
        return {id(p): str(n) for n, p in param_names}
    except (TypeError, ValueError):
        raise TypeError("param_names must be a module, a {parameter: name} dict or (name, parameter) pairs, "
                        f"got {type(param_names).__name__}") from None


def _int_at_least(value: Any, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"GiftState: {name} must be an int >= {least}, got {value!r}")
    return int(value)


class GiftState:
    """Settings of the giftcomm DDP hook (plus, apart, its internal runtime).

    process_group: the DDP process group (None: the default group, looked up at the first bucket).
    options / ``**opts``: the call options of ``giftcomm.allreduce`` (keywords, or one
    :class:`~giftcomm.options.CallOptions` as ``options=``; docs/api.md; auto per bucket, its
    path logged at INFO on "giftcomm.adapters" once per bucket size), used for every bucket; the
    hook always averages (op "avg": another op is a ValueError). With ``rounding="stochastic"``
    bucket ``i`` of iteration ``it`` is rounded with the seed ``giftcomm.adapters.calls.step_seed(seed, it, i)``: the same on every
    rank, a fresh stream per bucket and step. ``state.options`` is the validated record.
    schedule: a :class:`giftcomm.GiftSchedule` (default ``GiftSchedule()``), taken whole:
    ``warmup`` iterations of plain ``dist.all_reduce`` first (counted as "native", fallback
    reason "warmup"; docs/api.md, "What was sent"); ``geometry`` "none" (the wire format in plain
    coordinates), "reduced" (GIFT with factors estimated from the reduced gradients, every
    ``estimate_every`` iterations, EMA ``decay``: no communication), "kfac" (KFAC factors captured
    from the model's nn.Linear layers and synchronised over the group; needs ``capture``) or
    "paper" (the GIFT paper's method, giftcomm.geometry.paper: input side only, Cholesky factor of
    the low-rank + residual-diagonal approximation of the captured input covariance A averaged
    over the group; needs ``capture``; settings ``schedule.paper``, whose refresh_every is the
    cadence; with error feedback the residuals are kept in the transformed coordinates,
    giftcomm.collectives.feedback.TransformedFeedback; at the end of every iteration the geometry thread
    first agrees with the other ranks on the iteration count and the settings -- one int64
    allgather, giftcomm.geometry.paper.agree_refresh -- and only then refreshes when due, so ranks
    that would refresh at different iterations raise the same ValueError, from the hook at
    iteration ``it + 1 + rebuild_lag`` on every rank); geometries are rebuilt every
    ``refresh_every`` iterations and a rebuild may take ``rebuild_lag`` iterations on the geometry
    thread before it is adopted (see the module doc), with the schedule's ``policy`` and
    ``damping``; ``error_feedback``: keep, per bucket, what this rank's own encoding lost and add it
    to that bucket's next gradient (giftcomm.collectives.feedback; docs/method.md "Error feedback"; a
    block-scaled fmt only, ValueError otherwise), not in the warm-up iterations nor with one rank.
    A residual is dropped when its bucket's layout changes; with named parameters
    (``param_names``, or :meth:`bind` / :meth:`register` after a restore) it follows its parameters
    through DDP's bucket rebuild after the first iteration, which reorders them (without names it
    is dropped there once). The previous release's keywords (start_gift_iter, geometry,
    estimate_every, refresh_every, rebuild_lag, policy, damping, paper, error_feedback) still
    build the schedule, with a DeprecationWarning.
    capture: for "kfac" and "paper", the model (a KfacCapture is made: every ``capture_every``
    iterations, ``capture_tokens`` rows per layer) or a :class:`KfacCapture`; the state calls its
    ``step``.
    param_names: the module (or {parameter: name}, or (name, parameter) pairs) naming layout
    segments; with ``capture=model`` it defaults to the model.
    blas_threads: BLAS threads of the geometry thread's estimator and eigh work (threadpoolctl).
    transport: a giftcomm Transport to carry the buckets instead of the ones built over
    ``process_group`` (a GROUPED one takes the device route; tests drive it with the device
    loopback). sync_transport: the transport for KFAC factor sync (default: a private gloo group).

    Building a GiftState validates every setting (ValueError/TypeError at once, naming
    GiftState) and needs no process group: it may be built before ``dist.init_process_group``
    (as Lightning's ``DDPStrategy(ddp_comm_state=...)`` does). The first bucket the hook sees
    builds the private gloo groups over the process group (collective, in bucket order). With
    one rank (a world size 1 group, or no process group at all) the hook passes buckets through
    unchanged.

    baseline: None, or a baseline wire (giftcomm.collectives.baselines.BASELINE_WIRES, e.g. "e5m2/tensor-nccl":
    one scale per tensor, NCCL's FP8 ring sum, the paper's wire) that every bucket past the warm-up
    then goes through instead of giftcomm's collective, as GradSync's ``baseline`` (host buckets of
    float32/float64/float16 only: TypeError at the bucket otherwise; reference speed; the wire
    averages; fmt, block and the other call options are not used). With a geometry the bucket is
    mapped before encoding and back after decoding; with error feedback it needs
    geometry="paper" (the residual is the wire's own-encoding error in the map's coordinates).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *, schedule: Optional[GiftSchedule] = None,
                 param_names: Any = None, capture: Any = None, capture_every: int = 10, capture_tokens: int = 256,
                 blas_threads: int = 1, transport: Optional[Transport] = None,
                 sync_transport: Optional[Transport] = None, baseline: Optional[str] = None,
                 options: Optional[CallOptions] = None, **opts: Any) -> None:
        self.schedule: GiftSchedule = schedule_of("GiftState", schedule, opts, _SCHEDULE, _RENAMED).check_for(
            "GiftState", GEOMETRIES, _USES)
        self.options: CallOptions = options_of_call("GiftState", options, opts, _HOOK_OPTIONS, fixed=("op",))
        self._paths_told: set = set()  # bucket sizes whose path was logged (calls.log_path)
        sched = self.schedule
        if sched.error_feedback:
            check_feedback_format(self.options.format, "GiftState")
        self.factor_ema = FactorEMA()  # the paper's EMA of the factor across refreshes
        self.feedback: Any = None
        if sched.error_feedback:  # the paper's preset: the residual in the map's coordinates (class doc)
            self.feedback = ErrorFeedback() if sched.paper is None else TransformedFeedback(
                reexpress=sched.paper.reexpress, euclidean=False)
        self.baseline: Optional[str] = None
        if baseline is not None:
            from ...collectives.baselines import baseline_wire

            try:
                self.baseline = baseline_wire(baseline).name
            except ValueError as exc:
                raise ValueError(f"GiftState: {exc}") from None
            if sched.error_feedback and sched.paper is None:
                raise ValueError('GiftState: error feedback on a baseline wire needs geometry="paper" (the residual '
                                 "is the wire's own-encoding error in the map's coordinates)")
        self.blas_threads = _int_at_least(blas_threads, "blas_threads", 1)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"GiftState: process_group must be a torch.distributed ProcessGroup or None, got "
                            f"{type(process_group).__name__}")
        if transport is not None and not isinstance(transport, Transport):
            raise TypeError(f"GiftState: transport must be a giftcomm Transport, got {type(transport).__name__}")
        if sync_transport is not None and not isinstance(sync_transport, Transport):
            raise TypeError(f"GiftState: sync_transport must be a giftcomm Transport, got {type(sync_transport).__name__}")
        if sched.geometry in _CAPTURED:
            if capture is None:
                raise ValueError(f'GiftState: geometry="{sched.geometry}" needs capture= (the model, or a KfacCapture)')
            if isinstance(capture, torch.nn.Module):
                if param_names is None:
                    param_names = capture
                capture = KfacCapture(capture, every=capture_every, tokens=capture_tokens,
                                      decay=sched.paper.decay if sched.paper else 0.95)
            elif not isinstance(capture, KfacCapture):
                raise TypeError(f"GiftState: capture must be an nn.Module or a KfacCapture, got {type(capture).__name__}")
        elif capture is not None:
            raise ValueError(f'GiftState: capture= is used with geometry="kfac" or "paper" only (geometry is '
                             f'{sched.geometry!r})')
        self.process_group = process_group
        self.param_names = _names_from(param_names)
        self.capture: Optional[KfacCapture] = capture
        self._capture_state: Optional[dict] = None  # a restored capture's factors, until bind() attaches one
        # progress and internal buffers
        self.iter = 0
        self._stats = GiftStats()
        self._sync_transport = sync_transport
        self.runtime = _Runtime(transport, sync_transport)
        if self.capture is not None:
            self.capture.step(self.iter)
        warn_oversubscription()

    @property
    def fmt(self) -> str:
        """The wire format's name (``options.fmt``)."""
        return self.options.fmt

    @property
    def block(self) -> int:
        """Values per scale the buckets use (``options.resolved_block``: the format's own when
        ``block=None`` was given)."""
        return self.options.resolved_block

    def world_size(self) -> int:
        """Ranks the buckets are reduced over: the given transport's, the process group's, or 1
        when torch.distributed is not initialised. Raises RuntimeError when it is not initialised
        but the launcher says there are several ranks ($WORLD_SIZE)."""
        if self.runtime.given is not None:
            return self.runtime.given.size
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.process_group)
        launched = os.environ.get("WORLD_SIZE", "1")
        if launched.isdigit() and int(launched) > 1:
            raise RuntimeError(f"gift_hook: torch.distributed is not initialised but WORLD_SIZE={launched}; call "
                               "dist.init_process_group before the first backward")
        return 1

    # --- checkpoints -----------------------------------------------------------------------
    _PICKLED = ("options", "schedule", "blas_threads", "iter", "baseline")

    def __getstate__(self) -> dict:
        """The user's settings, the iteration count, the statistics and the reduced-gradient
        estimators and geometries, including rebuilt geometries not adopted yet (not the process
        group, transports, threads, capture hooks or parameter names: like PyTorch's
        PowerSGDState). Rank-independent at an iteration boundary: the geometry thread's
        submitted work is finished first (it is the same work on every rank, on identical reduced
        buckets), and the timings of the statistics (this process's own) are saved as 0 -- except
        the error-feedback residuals (``error_feedback=True``), which are this rank's own by
        nature: such a state pickles per rank, and each rank restores its own. With geometry "kfac"
        or "paper" this rank's captured factors and the capture's row sampler are saved as well
        (per rank too), and :meth:`bind` puts them into the new capture, so that a restore at any
        iteration -- between refreshes too -- continues bit-identical to an uninterrupted run."""
        rt = self.runtime
        self._settle()
        with rt.lock:
            geos = dict(rt.geometries)
            pending = [(at, fut.result()) for at, fut in rt.pending]
            stats = copy.copy(self._stats)
            estimators = {k: copy.deepcopy(v) for k, v in rt.estimators.items()}
            layouts = dict(rt.layouts)
        stats.comm_seconds = stats.geometry_seconds = 0.0
        stats.geometry_waits = 0  # whether the hook had to wait depends on this process's timing
        d = {k: getattr(self, k) for k in self._PICKLED}
        d.update(stats=stats, geometries=geos, estimators=estimators, layouts=layouts, pending=pending,
                 feedback=None if self.feedback is None else self.feedback.state_dict(),
                 factor_ema=self.factor_ema.state_dict(),
                 capture=self.capture.state_dict() if self.capture is not None else self._capture_state)
        return d

    def _settle(self) -> None:
        """Wait until the geometry thread finished the work submitted so far (one worker, in
        order: a no-op submitted now runs last); nothing to wait for once it was shut down."""
        try:
            self.runtime.geometry_thread.submit(lambda: None).result()
        except RuntimeError:  # shut down: its work is done
            pass

    def __setstate__(self, d: dict) -> None:
        """Restore on the default process group (no communication: the private groups are made at
        the first bucket, so loading may precede ``dist.init_process_group``), with the saved
        estimators, geometries and not yet adopted rebuilds, so the next iterations equal those of
        an uninterrupted run. Call :meth:`bind` with the model (or :meth:`register` with the DDP)
        afterwards to name segments (and, for "kfac", capture)."""
        if "options" not in d:  # a state pickled before the call options were one record
            d = dict(d, options=CallOptions.of("GiftState", fmt=d["fmt"], block=d["block"], op="avg"))
        if "schedule" not in d:  # a state pickled before the schedule was one record
            d = dict(d, schedule=GiftSchedule(
                geometry=d["geometry"], warmup=d["start_gift_iter"], estimate_every=d["estimate_every"],
                refresh_every=d["refresh_every"], rebuild_lag=d["rebuild_lag"], policy=d["policy"],
                damping=d["damping"], paper=d.get("paper"), error_feedback=d.get("feedback") is not None))
        for k in self._PICKLED:
            setattr(self, k, d.get(k))
        self.process_group = None
        self.param_names = {}
        self.capture = None
        self._capture_state = d.get("capture")  # put into the capture bind() makes
        self.baseline = d.get("baseline")
        self._paths_told = set()
        self._stats = d.get("stats") or GiftStats()
        self._sync_transport = None
        self.runtime = _Runtime(None, None)
        self.runtime.geometries.update(d.get("geometries") or {})
        self.runtime.layouts.update(d.get("layouts") or {})
        self.runtime.estimators.update(d.get("estimators") or {})
        for at, result in d.get("pending") or []:
            done: _CFuture = _CFuture()
            done.set_result(result)
            self.runtime.pending.append((at, done))
        self.runtime.adopted_iter = self.iter - 1
        self.factor_ema = FactorEMA()
        if d.get("factor_ema") is not None:
            self.factor_ema.load_state_dict(d["factor_ema"])
        self.feedback = None
        if d.get("feedback") is not None:
            self.feedback = TransformedFeedback() if self.schedule.paper is not None else ErrorFeedback()
            self.feedback.load_state_dict(d["feedback"])

    def bind(self, model: torch.nn.Module, capture: Optional[KfacCapture] = None, **capture_args: Any) -> "GiftState":
        """After loading a checkpoint: name segments from ``model`` and, for geometry "kfac" or
        "paper", attach a capture (``capture`` or one made from the model with ``capture_args``,
        KfacCapture's keywords; ``every`` and ``tokens`` default to the checkpoint's), loaded
        with the checkpoint's captured factors and row sampler."""
        self.param_names = _names_from(model)
        if self.schedule.geometry in _CAPTURED:
            if capture is None and self.schedule.paper is not None:
                capture_args.setdefault("decay", self.schedule.paper.decay)
            if capture is None and self._capture_state is not None:
                capture_args.setdefault("every", self._capture_state["every"])
                capture_args.setdefault("tokens", self._capture_state["tokens"])
            self.capture = capture if capture is not None else KfacCapture(model, **capture_args)
            self.capture.step(self.iter)
            if self._capture_state is not None:  # the checkpoint's captured factors, counts and sampler
                self.capture.load_state_dict(self._capture_state)
                self._capture_state = None
        return self

    # --- observability ---------------------------------------------------------------------
    def stats(self) -> GiftStats:
        """A copy of the counters (see :class:`GiftStats`)."""
        with self.runtime.lock:
            s = copy.copy(self._stats)
            sent = self.runtime.tally.as_dict()
        s.iterations = self.iter
        s.calls, s.bytes_sent, s.algorithms, s.fallbacks = (sent[k] for k in GiftStats._KEYS)
        return s

    def geometry_of(self, index: int):
        """The geometry currently used for bucket ``index`` (None: plain coordinates)."""
        got = self.runtime.geometries.get(index)
        return None if got is None else got[1]

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> "GiftState":
        """``ddp.register_comm_hook(self, gift_hook)``, after naming segments from ``ddp`` when no
        names were given."""
        if not self.param_names:
            self.param_names = _names_from(ddp)
        ddp.register_comm_hook(self, gift_hook)
        return self

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Advance the iteration counter after the last bucket of a backward pass."""
        if bucket.is_last():
            self._end_iteration(self.iter)

    def shutdown(self) -> None:
        """Stop the worker and geometry threads (after the last backward)."""
        self.runtime.shutdown()

    # --- iteration boundaries (hook thread) ------------------------------------------------
    def _begin_iteration(self, it: int) -> None:
        """Adopt the rebuilds due at iteration ``it`` (same point on every rank)."""
        rt = self.runtime
        if rt.adopted_iter >= it:
            return
        rt.adopted_iter = it
        with rt.lock:
            due = [p for p in rt.pending if p[0] <= it]
            rt.pending = [p for p in rt.pending if p[0] > it]
        for _, fut in due:
            if not fut.done():
                with rt.lock:
                    self._stats.geometry_waits += 1
                logger.info("giftcomm: iteration %d waits for a geometry rebuild (raise rebuild_lag)", it)
            geos = fut.result()  # raises the refresh agreement's or the rebuild's error, on every rank alike
            if not geos:  # the paper preset's agreement of an iteration with no refresh
                continue
            with rt.lock:
                rt.geometries.update(geos)
            n = sum(0 if g is None else sum(not t.is_identity for t in g.transforms) for _, g in geos.values())
            with rt.lock:
                self._stats.transformed_segments = sum(
                    0 if g is None else sum(not t.is_identity for t in g.transforms) for _, g in rt.geometries.values())
            logger.info("giftcomm: iteration %d adopts rebuilt geometries of %d bucket(s), %d transformed segment(s)",
                        it, len(geos), n)
            if n == 0 and "identity" not in rt.warned:
                rt.warned.add("identity")
                warnings.warn("giftcomm GiftState: the selective policy transformed no segment (every geometry is the "
                              "identity), so GIFT reduces as plain FP8; loosen the SelectivePolicy (min_size, min_gain, "
                              "budget) or use geometry='none'", RuntimeWarning, stacklevel=3)

    def _end_iteration(self, it: int) -> None:
        """After the last bucket of iteration ``it``: KFAC snapshot/sync, capture step, iter += 1."""
        if it + 1 == self.schedule.warmup:
            logger.info("giftcomm: warm-up ends after iteration %d; %s from iteration %d", it, self.fmt, it + 1)
        due = (it + 1) % self.schedule.refresh_period == 0
        if self.schedule.geometry in _CAPTURED and self.capture is not None and self.runtime.sync_transport is not None \
                and (due or self.schedule.paper is not None):  # the paper preset agrees on its refresh at every iteration
            self._submit_kfac(it, due)
        self.iter = it + 1
        if self.capture is not None:
            self.capture.step(self.iter)

    def _submit_kfac(self, it: int, due: bool = True) -> None:
        """Submit iteration ``it``'s work to the geometry thread (adopted at ``it + 1 + rebuild_lag``):
        the paper preset's refresh agreement (every iteration), and the rebuild when ``due``."""
        rt, cap = self.runtime, self.capture
        assert cap is not None
        est = cap.estimator
        fired = est.counts
        if not due:
            fut = rt.geometry_thread.submit(self._kfac_rebuild, it, est.layout, [], {}, {}, {}, False)
            with rt.lock:
                rt.pending.append((it + 1 + self.schedule.rebuild_lag, fut))
            return
        if "never-fired" not in rt.warned and cap.captures > 0:
            silent = [n for n in est.segments if fired[n] == 0]
            if silent:
                rt.warned.add("never-fired")
                warnings.warn(f"giftcomm KfacCapture: {len(silent)} captured layer(s) never fired in "
                              f"{cap.captures} capture step(s) and keep the identity geometry: {silent[:8]}",
                              RuntimeWarning, stacklevel=3)
        snapshot = {n: (a.copy(), g.copy()) for n, (a, g) in est.factors().items()}  # the hooks update in place
        counts = dict(fired)
        layouts = dict(rt.layouts)
        fut = rt.geometry_thread.submit(self._kfac_rebuild, it, est.layout, list(est.segments), snapshot, counts, layouts)
        with rt.lock:
            rt.pending.append((it + 1 + self.schedule.rebuild_lag, fut))

    def _kfac_rebuild(self, it, model_layout, segments, snapshot, counts, layouts, due: bool = True) -> dict:
        """Geometry thread: (the paper preset: agree on the refresh first, every iteration) sync
        the factor snapshot over the group, one geometry per bucket; {} when not ``due``."""
        if self.schedule.paper is not None:
            agree_refresh(self.runtime.sync_transport, "GiftState", it, self.schedule.paper,
                          {"rebuild_lag": self.schedule.rebuild_lag, "start_gift_iter": self.schedule.warmup})
        if not due:
            return {}
        t0 = time.perf_counter()
        with blas_limit(self.blas_threads):
            if self.schedule.paper is not None:  # input side only: A averaged over the group, every rank's map agreed
                built = refresh_geometries(self.runtime.sync_transport, layouts,
                                           {n: a for n, (a, _) in snapshot.items()}, it, self.schedule.paper,
                                           smoothing=self.factor_ema)
                geos = {k: (layouts[k], g) for k, g in built.items()}
            else:
                geos = geometries_from_factors(self.runtime.sync_transport, model_layout, segments, snapshot, counts,
                                               layouts, self.schedule.policy, self.schedule.damping)
        dt = time.perf_counter() - t0
        with self.runtime.lock:
            self._stats.rebuilds += 1
            self._stats.geometry_seconds += dt
        logger.info("giftcomm: KFAC geometry rebuilt from iteration %d in %.3f s (%d buckets)", it, dt, len(geos))
        return geos

    # --- "reduced" geometry (called after a bucket's reduction, in bucket order) -------------
    def _after_reduce(self, index: int, it: int, layout: Optional[Layout], snapshot: Any) -> None:
        if self.schedule.geometry != "reduced" or layout is None:
            return
        rebuild = (it + 1) % self.schedule.refresh_period == 0
        if snapshot is None and not rebuild:
            return
        fut = self.runtime.geometry_thread.submit(self._reduced_update, index, it, layout, snapshot, rebuild)
        if rebuild:
            with self.runtime.lock:
                self.runtime.pending.append((it + 1 + self.schedule.rebuild_lag, fut))

    def _reduced_update(self, index: int, it: int, layout: Layout, snapshot: Any, rebuild: bool) -> dict:
        """Geometry thread: feed the reduced bucket (identical on every rank) to its estimator;
        rebuild its geometry when due. No communication."""
        rt = self.runtime
        estimators = rt.estimators
        t0 = time.perf_counter()
        out: dict = {}
        with blas_limit(self.blas_threads):
            est = estimators.get(index)
            if est is None or est.layout != layout:
                est = estimators[index] = GradientFactorEstimator(layout, decay=self.schedule.decay)
            if snapshot is not None:
                data, event = snapshot
                if event is not None:
                    event.synchronize()  # the device copy is complete (this thread only)
                est.update(_host_float32(data))
                with rt.lock:
                    self._stats.estimator_updates += 1
            if rebuild and est.count > 0:
                out[index] = (layout, est.geometry(policy=self.schedule.policy, damping=self.schedule.damping))
        dt = time.perf_counter() - t0
        with rt.lock:
            self._stats.geometry_seconds += dt
            if rebuild:
                self._stats.rebuilds += 1
        if rebuild:
            logger.info("giftcomm: bucket %d geometry rebuilt from iteration %d", index, it)
        return out


def _host_float32(data: Any) -> np.ndarray:
    """A float32 NumPy copy of a snapshot (torch CPU/CUDA tensor or NumPy array); geometry thread only."""
    if isinstance(data, torch.Tensor):
        return data.detach().to(device="cpu", dtype=torch.float32).numpy()
    return np.asarray(data, np.float32)


def _bucket_layout(state: GiftState, bucket: dist.GradBucket, numel: int) -> Optional[Layout]:
    """Segments of the bucket (one per parameter, in buffer order), or None if the gradients
    are not packed back to back from the start of the buffer."""
    params, grads = bucket.parameters(), bucket.gradients()
    base, item = bucket.buffer().data_ptr(), bucket.buffer().element_size()
    entries, expect = [], 0
    for i, (p, g) in enumerate(zip(params, grads)):
        if (g.data_ptr() - base) // item != expect:
            return None
        entries.append((state.param_names.get(id(p), f"bucket{bucket.index()}.p{i}"), tuple(p.shape)))
        expect += p.numel()
    return Layout(entries) if expect == numel else None


def _geometry_for(state: GiftState, index: int, layout: Optional[Layout], numel: int):
    if state.schedule.geometry == "none" or layout is None:
        return None
    got = state.runtime.geometries.get(index)
    if got is None or got[0] != layout or got[1] is None or got[1].size != numel:
        return None
    return got[1]


def _count(state: GiftState, buf: torch.Tensor, seconds: float, device: bool, ranks: int) -> None:
    """A reduced bucket in the hook's own counters (its bytes sent are the Tally's)."""
    with state.runtime.lock:
        s = state._stats
        s.bytes_in += buf.numel() * buf.element_size()
        s.ranks = ranks
        s.comm_seconds += seconds
        if device:
            s.device_buckets += 1
        else:
            s.host_buckets += 1


def _reduce_bucket(state: GiftState, index: int, it: int, buf: torch.Tensor, geo, transport: Any,
                   signature: tuple) -> None:
    """``gift_allreduce`` of one bucket in place over ``transport``, with the error feedback
    around it when the state keeps one (``signature``: :func:`_bucket_signature`); through the
    state's baseline wire instead when it has one."""
    if state.baseline is not None:
        _reduce_baseline(state, index, buf, geo, transport, signature)
        return
    o = step_options(state.options, it, index)

    def reduce(_values: Any = None) -> None:  # _values: buf's own memory
        api.gift_allreduce(buf, geo, comm=transport, out=buf, options=o)
        state.runtime.tally.add(transport)

    if state.feedback is None:
        reduce()
    else:
        state.feedback.around(index, buf, reduce, lambda: transport, state.options.format, state.block, o.seed,
                              geo, signature=signature)
    log_path(state._paths_told, "DDP hook", transport, buf.numel(), state.options)


_BASELINE_DTYPES = (torch.float32, torch.float64, torch.float16)


def _reduce_baseline(state: GiftState, index: int, buf: torch.Tensor, geo, transport: Any, signature: tuple) -> None:
    """One host bucket averaged in place through the state's baseline wire
    (giftcomm.collectives.baselines.baseline_allreduce, ``geo`` mapped around the encoding), with the
    transformed-coordinate error feedback around it when the state keeps one."""
    from ...collectives.baselines import baseline_allreduce

    if buf.device.type != "cpu" or buf.dtype not in _BASELINE_DTYPES:
        raise TypeError(f"gift_hook: the baseline wire {state.baseline} runs on host buckets of float32, float64 or "
                        f"float16; this bucket is {buf.dtype} on {buf.device}")
    values = buf.detach().numpy()  # the bucket's own memory
    fb = state.feedback
    if fb is not None:
        fb.compensate(index, values, geo, signature=signature)
    assert state.baseline is not None
    _, err = baseline_allreduce(values, state.baseline, comm=transport, op="avg", geometry=geo, out=values,
                                own_error=True)
    if fb is not None:
        fb.record_error(index, err, geo, signature=signature)


def _bucket_signature(state: GiftState, bucket: dist.GradBucket) -> tuple:
    """What identifies a bucket's layout for its residual (rank-independent, picklable): with
    every parameter named (``param_names``), its ``(dtype:name, numel)`` pieces in buffer order,
    so that a residual follows its parameters when DDP rebuilds the bucket in another order
    (giftcomm.collectives.feedback.reordered); else the dtype and the parameters' shapes (a new order drops
    the residual)."""
    params, dtype = bucket.parameters(), str(bucket.buffer().dtype)
    names = [state.param_names.get(id(p)) for p in params]
    if all(n is not None for n in names):
        return tuple((f"{dtype}:{n}", int(p.numel())) for n, p in zip(names, params))
    return (dtype,) + tuple(tuple(p.shape) for p in params)


# ------------------------------------------------------------------------------ host route
def _reduce_host(state: GiftState, index: int, it: int, buf: torch.Tensor, geo, layout, fut: torch.futures.Future,
                 signature: tuple = ()) -> None:
    """Worker-thread body: reduce one CPU bucket in place and complete ``fut``."""
    try:
        t0 = time.perf_counter()
        host = state.runtime.host
        assert host is not None  # gift_hook checked it
        _reduce_bucket(state, index, it, buf, geo, host, signature)
        dt = time.perf_counter() - t0
        snap = None
        if state.schedule.geometry == "reduced" and layout is not None and it % state.schedule.estimate_every == 0:
            snap = (buf.detach().to(torch.float32, copy=True), None)  # the bucket is reused after the future
        state._after_reduce(index, it, layout, snap)
        _count(state, buf, dt, device=False, ranks=host.size)
        fut.set_result(buf)
    except BaseException as exc:  # DDP re-raises it from backward / the next wait
        fut.set_exception(exc)


# ---------------------------------------------------------------------------- device route
def _reduce_device(state: GiftState, index: int, it: int, buf: torch.Tensor, geo, layout,
                   signature: tuple = ()) -> torch.futures.Future:
    """The device route, on the calling thread: enqueue the reduction in stream order and return
    a future whose value is ready in that order (no host copy, no stream synchronisation)."""
    transport = state.runtime.device_transport(state)
    devices: list[int | str | torch.device] | None = [buf.device] if buf.device.type == "cuda" else None
    fut: torch.futures.Future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
    try:
        t0 = time.perf_counter()
        # a side stream of the bucket's device that waits for the current one (nothing for host
        # buffers: the device route driven on the CPU by a grouped test transport)
        with on_stream(buf, state.runtime.streams) as side:
            _reduce_bucket(state, index, it, buf, geo, transport, signature)
            snap = None
            if state.schedule.geometry == "reduced" and layout is not None and it % state.schedule.estimate_every == 0:
                copy_ = buf.detach().to(torch.float32, copy=True)  # device to device, on the side stream
                event = None
                if side is not None:
                    event = torch.cuda.Event()
                    event.record(side)
                snap = (copy_, event)
            fut.set_result(buf)  # CUDA: records events on the side stream; consumers wait on the GPU
        state._after_reduce(index, it, layout, snap)
        _count(state, buf, time.perf_counter() - t0, device=True, ranks=transport.size)
    except BaseException as exc:
        fut.set_exception(exc)
    return fut


def _count_warmup(state: GiftState, buf: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """A warm-up bucket (DDP's own allreduce, uncompressed as the caller asked: start_gift_iter)
    in the hook's counters and in giftcomm.stats of its process group, under "native" with the
    fallback reason "warmup" (counted, not warned: giftcomm.accounting.fallback)."""
    world = dist.get_world_size(group)
    slot = accounting.count(group if group is not None else dist.GroupMember.WORLD, "native", "native",
                            accounting.native_sent_bytes(buf.numel(), world, buf.element_size()), accounting.WARMUP)
    with state.runtime.lock:
        s = state._stats
        s.warmup_buckets += 1
        s.bytes_in += buf.numel() * buf.element_size()
        s.ranks = world
        state.runtime.tally.add_slot(slot)


def _route_is_device(state: GiftState, buf: torch.Tensor) -> bool:
    """CUDA buckets, and every bucket when the state was given a GROUPED transport."""
    given = state.runtime.given
    return buf.device.type == "cuda" or (given is not None and given.schedule == GROUPED)


def _has_group() -> bool:
    """Whether torch.distributed has a default process group."""
    return dist.is_available() and dist.is_initialized()


def gift_hook(state: GiftState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: returns a Future of the averaged bucket (see module doc)."""
    if not isinstance(state, GiftState):
        raise TypeError("gift_hook needs a GiftState as its state: ddp.register_comm_hook(GiftState(...), gift_hook) "
                        f"(got {type(state).__name__}; PyTorch's fp16/bf16 hooks take None, this one does not)")
    buf = bucket.buffer()
    it = state.iter
    state.world_size()  # raises under a launcher of several ranks without a process group
    state.runtime.connect(state)  # the first bucket builds the private groups (KFAC may rebuild during warm-up)
    state._begin_iteration(it)
    index = bucket.index()
    if it < state.schedule.warmup and not _has_group():  # DDP's default on one rank: the bucket itself
        with state.runtime.lock:
            state._stats.warmup_buckets += 1
            state._stats.bytes_in += buf.numel() * buf.element_size()
            state._stats.ranks = 1
        state.maybe_increase_iter(bucket)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buf)
        return done
    if it < state.schedule.warmup:
        group = state.process_group
        buf.div_(dist.get_world_size(group))
        work_fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
        _count_warmup(state, buf, group)
        state.maybe_increase_iter(bucket)
        return work_fut.then(lambda f: f.value()[0])
    layout = None
    if state.schedule.geometry != "none":
        layout = _bucket_layout(state, bucket, buf.numel())
        if layout is not None:
            state.runtime.layouts[index] = layout
    geo = _geometry_for(state, index, layout, buf.numel())
    sig = _bucket_signature(state, bucket) if state.feedback is not None else ()
    if state.baseline is not None and _route_is_device(state, buf):
        raise TypeError(f"gift_hook: the baseline wire {state.baseline} runs on host buckets only (this bucket takes "
                        "the device route)")
    if _route_is_device(state, buf):
        fut = _reduce_device(state, index, it, buf, geo, layout, sig)
    else:
        if state.runtime.host is None:
            raise TypeError("gift_hook: a CPU bucket, but the GiftState's transport moves device buffers only")
        fut = torch.futures.Future()
        state.runtime.executor.submit(_reduce_host, state, index, it, buf, geo, layout, fut, sig)
    state.maybe_increase_iter(bucket)
    return fut

