"""FSDP2 (``torch.distributed.fsdp.fully_shard``): giftcomm as the gradient reduce-scatter.

::

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    comms = register_reduce_scatter(model, fmt="e4m3")      # one GiftReduceScatter per FSDP module

FSDP2 calls its reduce-scatter comm (``FSDPModule.set_custom_reduce_scatter``) once per FSDP
module and backward with ``input`` (N,) in the reduce dtype — row r of its (P, N/P) view holds
every parameter's r-th dim-0 chunk, dim 0 zero-padded to a multiple of P — and ``output``
(N/P,). :class:`GiftReduceScatter` reduces it with ``giftcomm.reduce_scatter(layout="equal")``:
FP8 (or any format) on the wire, fp32 accumulation, the result bit-identical on every rank.

Each call:

1. maps FSDP's op: AVG -> giftcomm ``op="avg"``; SUM -> ``"sum"``; PREMUL_SUM(f) (from
   ``set_gradient_divide_factor``) -> the sum times f, applied to the reduced shard (in the
   reduce dtype for bf16/fp16, as FSDP's own post-division is); anything else raises;
2. for the first ``schedule.warmup`` calls, runs FSDP's own ``dist.reduce_scatter_tensor`` instead (counted
   in ``stats()`` as "native", fallback reason "warmup"; docs/api.md, "What was sent");
3. with a geometry (``schedule.geometry`` "kfac" or "paper", or a prebuilt
   :class:`~giftcomm.geometry.ShardedGeometry`),
   transforms every row into its shard's GIFT coordinates (float32), reduce-scatters those and
   applies this shard's inverse alone (docs/method.md, "Sharded gradients");
4. writes ``output`` (the reduce dtype).

Transports: CPU tensors go over a private gloo group of the comm's process group (created at
the first call, by the group's members); CUDA tensors over the grouped torch.distributed
transport on the caller's group (NCCL), on FSDP's reduce-scatter stream (torch's current stream
in the call; CuPy kernels follow it), with no host copy. HSDP (2-D mesh): the shard-dimension
reduce-scatter is giftcomm's; the replicate-dimension all-reduce stays FSDP's own, because FSDP2
issues it as a plain ``dist.all_reduce`` with no plug-in point (``set_all_reduce_hook`` runs
after it, not instead of it), and replacing it would need patching torch.
"""
from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ... import accounting, api
from ...accounting import Tally
from ...algorithms import SCATTER_CHOICES
from ...collectives.feedback import ErrorFeedback, check_feedback_format
from ...geometry.paper import FactorEMA, agree_refresh
from ...geometry.schedule import GiftSchedule, schedule_of
from ...geometry.sharded import ShardedGeometry
from ...options import CallOptions, options_of_call
from ...transport import Transport
from ..calls import log_path
from .kfac import KfacCapture
from .streams import on_stream
from .work import completed_work

if TYPE_CHECKING:  # torch >= 2.9, as the type check runs (the runtime import below falls back)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterProtocol
else:
    try:  # torch >= 2.9: the comm protocol of FSDPModule.set_custom_reduce_scatter
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterProtocol
    except ImportError:  # older torch: duck-typed; register_reduce_scatter says what is missing
        _ReduceScatterProtocol = object

__all__ = ["GiftReduceScatter", "GiftReduceScatters", "register_reduce_scatter", "fsdp_modules"]

_GEOMETRIES = ("none", "kfac", "paper")  # the schedule's geometries a comm implements
_USES = ("warmup", "refresh_every", "damping", "error_feedback")  # the schedule's knobs a comm reads
SCHEDULE = GiftSchedule(refresh_every=50)
"""The comms' schedule when none is given: ``GiftSchedule(refresh_every=50)``."""
_SEED_STRIDE = 1 << 16  # stochastic rounding: call c of comm i gets seed (seed + c) * 2**16 + i


def _require_fsdp2() -> Any:
    """``torch.distributed.fsdp.FSDPModule`` with ``set_custom_reduce_scatter``, or RuntimeError."""
    import torch.distributed.fsdp as fsdp

    found = getattr(fsdp, "FSDPModule", None)
    if found is None or not hasattr(found, "set_custom_reduce_scatter") or _ReduceScatterProtocol is object:
        raise RuntimeError(f"giftcomm's FSDP2 comm needs torch >= 2.9 (FSDPModule.set_custom_reduce_scatter and "
                           f"the ReduceScatter protocol); this is torch {torch.__version__}")
    return found


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP2 modules of ``model`` (``fully_shard`` applied), in ``model.modules()`` order."""
    FSDPModule = _require_fsdp2()  # noqa: N806
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


on_current_stream = on_stream
"""CuPy on torch's current stream of a CUDA tensor's device (giftcomm.adapters.torch.streams)."""


class GiftReduceScatter(_ReduceScatterProtocol):
    """FSDP2's ``ReduceScatter`` comm through giftcomm (module doc).

    options / ``**opts``: the call options (keywords, or one :class:`giftcomm.options.CallOptions`
    as ``options=``; docs/api.md; op is FSDP's, per call, so the option stays "sum"; algorithm
    one of reduce_scatter's: auto per call, logged at INFO once per input size; with ``rounding="stochastic"`` call c of this comm
    uses seed ``(seed + c) * 2**16 + index``).
    schedule: a :class:`giftcomm.GiftSchedule`, taken whole (default :data:`SCHEDULE`,
    ``GiftSchedule(refresh_every=50)``); a comm reads its ``warmup`` (calls that use FSDP's own
    reduce-scatter first), ``geometry``: "none", "paper" (the GIFT paper's preset,
    giftcomm.geometry.paper, from the captured input covariances averaged over the group;
    settings ``schedule.paper``, whose refresh_every is the cadence) or "kfac" (KFAC factors from
    ``capture``: the model or a KfacCapture; rebuilt every ``refresh_every`` calls past the
    warm-up from the factors averaged over the group), ``damping`` (the kfac geometry's) and
    ``error_feedback`` (another knob off its default is a ValueError). The previous release's
    keywords (warmup, geometry="kfac"/"paper", refresh_every, damping, paper, error_feedback)
    still build it, with a DeprecationWarning. geometry: a prebuilt :class:`ShardedGeometry` over
    this module's parameters (with schedule.geometry "none"). Built by
    :func:`register_reduce_scatter`, which binds each comm to its module's parameters (``bind``);
    ValueError/TypeError at once for bad options.
    error_feedback: keep what this rank's own encoding of the reduce-scatter input lost and add it
    to the next call's input (giftcomm.collectives.feedback; exact for "direct"; block-scaled fmt only). The
    input FSDP passes is left alone (the compensated values are a copy). With a geometry the
    residual stays in the geometry's coordinates and is dropped when the geometry is rebuilt.
    ``algorithm_used``: what the last call really ran; :meth:`state_dict` holds this rank's
    residual (a per-rank checkpoint).

    With geometry="paper" every call past the warm-up starts with one int64 allgather over the
    group in which the ranks agree on the call count and the settings
    (giftcomm.geometry.paper.agree_refresh), so ranks that would refresh at different calls raise
    the same ValueError at once. baseline: None, or a baseline wire
    (giftcomm.collectives.baselines.BASELINE_WIRES, e.g. "e5m2/tensor-nccl": one scale per tensor, NCCL's FP8
    ring sum, the paper's wire) that every call past the warm-up then goes through instead of
    giftcomm's collective, as GradSync's ``baseline``: the wire's allreduce of the whole input (the
    rows mapped by the geometry first, when there is one), of which this rank keeps its shard
    (mapped back); host tensors only (TypeError at the call otherwise), reference speed, fmt,
    block and the other call options unused; not with error feedback (ValueError).
    """

    def __init__(self, *, schedule: GiftSchedule | None = None, geometry: ShardedGeometry | None = None,
                 capture: Any = None, index: int = 0, baseline: str | None = None,
                 options: CallOptions | None = None, **opts: Any) -> None:
        if geometry is not None and not isinstance(geometry, ShardedGeometry):
            opts["geometry"] = geometry  # the previous release's geometry="kfac" / "paper": a schedule knob
            geometry = None
        self.schedule = schedule_of("GiftReduceScatter", schedule, opts, SCHEDULE).check_for(
            "GiftReduceScatter", _GEOMETRIES, _USES)
        sched = self.schedule
        self.options = options_of_call("GiftReduceScatter", options, opts, fixed=("op",))
        if self.options.rounding == "stochastic" and self.options.seed is None:
            self.options = self.options.replace(seed=0)
        # the options of each op FSDP may ask for (the option itself stays "sum": FSDP's op is per call)
        self._options_of_op = {"sum": self.options, "avg": self.options.replace(op="avg")}
        self._paths_told: set[int] = set()  # input sizes whose path was logged (calls.log_path)
        self._tally = Tally()  # what stats() reports
        if sched.error_feedback:
            check_feedback_format(self.options.format, "GiftReduceScatter")
        self.feedback: ErrorFeedback | None = ErrorFeedback() if sched.error_feedback else None
        self.baseline: str | None = None
        if baseline is not None:
            from ...collectives.baselines import baseline_wire

            try:
                self.baseline = baseline_wire(baseline).name
            except ValueError as exc:
                raise ValueError(f"GiftReduceScatter: {exc}") from None
            if sched.error_feedback:
                raise ValueError("GiftReduceScatter: error feedback on a baseline wire is not supported (its residual "
                                 "is kept in ordinary coordinates here; GradSync keeps a baseline's in the map's)")
        self.algorithm_used: str | None = None
        self._geo_seen: Any = None  # the geometry the residual's coordinates belong to
        self._geo_generation = 0
        if self.options.algorithm not in SCATTER_CHOICES:
            raise ValueError(f"GiftReduceScatter: algorithm must be one of {', '.join(SCATTER_CHOICES)} "
                             f"(reduce-scatter algorithms), got {self.options.algorithm!r}")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"GiftReduceScatter: index must be an int >= 0, got {index!r}")
        if geometry is not None and sched.geometry != "none":
            raise ValueError(f"GiftReduceScatter: a prebuilt ShardedGeometry goes with schedule.geometry \"none\", "
                             f"got {sched.geometry!r}")
        if sched.geometry in ("kfac", "paper"):
            if not isinstance(capture, (torch.nn.Module, KfacCapture)):
                raise ValueError(f'GiftReduceScatter: geometry="{sched.geometry}" needs capture= (the model or a '
                                 'KfacCapture)')
        elif capture is not None:
            raise ValueError('GiftReduceScatter: capture= goes with geometry="kfac" or "paper" only')
        self.factor_ema = FactorEMA()  # the paper's EMA of the factor across refreshes
        self.index = index
        self.geometry_mode = "fixed" if geometry is not None else (None if sched.geometry == "none" else sched.geometry)
        self.geometry: ShardedGeometry | None = geometry if isinstance(geometry, ShardedGeometry) else None
        self.capture = capture
        self.calls = 0          # calls so far (warm-up included)
        self.gift_calls = 0     # calls reduced through the geometry
        self.names: list[str] = []       # segment names of the bound module's parameters (root-relative)
        self.shapes: list[tuple[int, ...]] = []
        self._host: dict[Any, Transport] = {}
        self._device: dict[Any, Transport] = {}
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ binding
    def bind(self, names: list[str], shapes: list[tuple[int, ...]], shard_dims: list[int], world: int) -> None:
        """Bind to an FSDP module's parameters (names, unsharded shapes, shard dims, the shard
        group's size); ValueError when the geometry cannot apply to them."""
        self.names, self.shapes = list(names), [tuple(s) for s in shapes]
        if self.geometry_mode is None:
            return
        if any(d != 0 for d in shard_dims):
            raise ValueError(f"GiftReduceScatter: a geometry needs dim-0 sharding (Shard(0)); this module shards "
                             f"along dims {sorted(set(shard_dims))}")
        if any(len(s) == 0 for s in self.shapes):
            raise ValueError("GiftReduceScatter: a geometry needs parameters of at least one dimension")
        if self.geometry is not None:
            want = list(zip(self.names, self.shapes))
            got = list(self.geometry.layout.entries())
            if got != want or self.geometry.shards != world:
                raise ValueError(f"GiftReduceScatter: the geometry covers {got} on {self.geometry.shards} shards, "
                                 f"but the module's parameters are {want} on {world} ranks")

    # ------------------------------------------------------------------ the comm protocol
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain ``torch.empty`` (FSDP's default allocation)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Any:
        """Reduce-scatter ``input_tensor`` (N,) into ``output_tensor`` (N/P,) over ``group``.
        Returns None, or a completed ``dist.Work`` when ``async_op`` (the reduction is done)."""
        how, factor = _op(op)
        size = dist.get_world_size(group)
        if input_tensor.numel() != output_tensor.numel() * size or input_tensor.dtype != output_tensor.dtype:
            raise ValueError(f"GiftReduceScatter: input ({input_tensor.numel()} {input_tensor.dtype}) must hold "
                             f"{size} x output ({output_tensor.numel()} {output_tensor.dtype})")
        call = self.calls
        self.calls += 1
        if call < self.schedule.warmup:
            work = dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            # uncompressed as asked (warmup): counted under "native", not warned (accounting.fallback)
            self._tally.add_slot(accounting.count(group, "native", "native", accounting.native_sent_bytes(
                input_tensor.numel(), size, input_tensor.element_size(), scatter=True), accounting.WARMUP))
            return work if async_op else None
        transport = self._transport(group, input_tensor)
        geo = self._geometry_for(call, input_tensor, group, size)
        opts = self.options
        seed = None if opts.seed is None else ((opts.seed + call) * _SEED_STRIDE + self.index) % (1 << 64)
        this = self._options_of_op[how].replace(seed=seed)  # FSDP's op, this call's seed
        if self.baseline is not None:
            self.gift_calls += geo is not None
            output_tensor.copy_(self._baseline(geo, input_tensor, size, transport, how))
        else:
            with on_current_stream(input_tensor):
                if geo is None:
                    self._plain(input_tensor, output_tensor, transport, this)
                else:
                    self.gift_calls += 1
                    shard = self._gift(geo, input_tensor, size, transport, this)
                    output_tensor.copy_(shard)
        log_path(self._paths_told, "FSDP reduce-scatter", transport, input_tensor.numel(), opts)
        if factor is not None:
            output_tensor.mul_(factor)
        return completed_work([output_tensor]) if async_op else None

    def stats(self) -> dict[str, Any]:
        """What this rank sent in this GiftReduceScatter's reduce-scatters: the dict of :func:`giftcomm.stats`
        (calls, bytes_sent per format or "native", algorithms, fallbacks; docs/api.md, "What was sent")."""
        return self._tally.as_dict()

    def state_dict(self) -> dict[str, Any]:
        """The call counts and this rank's error-feedback residual (None without feedback); with
        geometry "kfac" or "paper" also the current geometry and the factor EMA (the captured
        factors are the shared capture's: :meth:`GiftReduceScatters.state_dict` keeps them), so a
        resume at any call -- between refreshes too -- continues bit for bit."""
        built = self.geometry_mode in ("kfac", "paper")
        return {"calls": self.calls, "gift_calls": self.gift_calls,
                "error_feedback": None if self.feedback is None else self.feedback.state_dict(),
                "geometry": self.geometry if built else None, "geometry_generation": self._geo_generation,
                "factor_ema": self.factor_ema.state_dict() if self.schedule.paper is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the geometry with the residual kept in its coordinates)."""
        geo = state.get("geometry")
        if geo is not None and not isinstance(geo, ShardedGeometry):
            raise TypeError(f"GiftReduceScatter.load_state_dict: geometry must be a ShardedGeometry, got "
                            f"{type(geo).__name__}")
        self.calls, self.gift_calls = int(state["calls"]), int(state["gift_calls"])
        if self.geometry_mode in ("kfac", "paper"):
            self.geometry = self._geo_seen = geo
            self._geo_generation = int(state.get("geometry_generation", 0))
        if self.schedule.paper is not None and state.get("factor_ema") is not None:
            self.factor_ema.load_state_dict(state["factor_ema"])
        if self.feedback is not None:
            self.feedback.reset()
            if state.get("error_feedback") is not None:
                self.feedback.load_state_dict(state["error_feedback"])

    # ------------------------------------------------------------------ internals
    def _reduce(self, x: Any, transport: Transport, call: CallOptions, out: Any = None,
                geometry_generation: int | None = None) -> Any:
        """``reduce_scatter(x)`` (into ``out``), through the error feedback when it is on;
        returns the shard (``out`` when given)."""
        got: list[Any] = []

        def reduce(values: Any = None) -> None:
            src = x if values is None else values
            if isinstance(x, torch.Tensor) and values is not None:
                src = torch.as_tensor(values, device=x.device).to(x.dtype)
            got.append(api.reduce_scatter(src, comm=transport, out=out, layout="equal", options=call))
            self._tally.add(transport)

        if self.feedback is None:
            reduce()
            last = api.last_algorithm(transport)
            self.algorithm_used = None if last is None else last[0]
        else:
            o = self.options
            n = int(x.numel()) if isinstance(x, torch.Tensor) else int(x.size)
            # FSDP's input tensor is left alone (a copy); forwarded rows are this call's own
            self.algorithm_used = self.feedback.around(0, x, reduce, lambda: transport, o.format, o.resolved_block,
                                                       call.seed, signature=(n, geometry_generation),
                                                       in_place=not isinstance(x, torch.Tensor))
        return got[0]

    def _plain(self, x: torch.Tensor, out: torch.Tensor, transport: Transport, call: CallOptions) -> None:
        self._reduce(x, transport, call, out=out)

    def _baseline(self, geo: ShardedGeometry | None, x: torch.Tensor, size: int, transport: Transport,
                  how: str) -> torch.Tensor:
        """This rank's (N/P,) float32 shard of the baseline wire's allreduce of ``x`` (N,): rows
        mapped forward by ``geo`` first (when given), this shard of the sum mapped back after,
        then divided by P for ``how="avg"`` (the order of GradSync's baseline)."""
        from ...collectives.baselines import baseline_allreduce

        if x.device.type != "cpu":
            raise TypeError(f"GiftReduceScatter: the baseline wire {self.baseline} runs on host tensors only; this "
                            f"input is on {x.device}")
        rows = x.detach().reshape(size, -1).float().numpy()
        flat = (rows if geo is None else np.asarray(geo.forward_rows(rows), np.float32)).reshape(-1)
        assert self.baseline is not None
        full = baseline_allreduce(flat, self.baseline, comm=transport, op="sum")
        rank, n = transport.rank, rows.shape[1]
        shard = np.asarray(full[rank * n : (rank + 1) * n] if geo is None else geo.shard(rank).inverse(
            full[rank * n : (rank + 1) * n]), np.float32)
        if how == "avg":  # as the wire's own op="avg": the decoded (mapped back) sum over P
            shard = shard / np.float32(size)
        return torch.from_numpy(np.ascontiguousarray(shard))

    def _transport(self, group: dist.ProcessGroup, x: torch.Tensor) -> Transport:
        from ...transport.torch_dist import TorchDistDeviceTransport, TorchDistTransport

        host = self._host.get(group)
        if host is None:  # made by the group's members alone (HSDP: each shard group its own)
            host = self._host[group] = TorchDistTransport.of_members(group, device=x.device)
        if x.device.type != "cuda":
            return host
        dev = self._device.get(group)
        if dev is None:
            assert isinstance(host, TorchDistTransport)
            dev = self._device[group] = TorchDistDeviceTransport(group, control=host)
        return dev

    def _gift(self, geo: ShardedGeometry, x: torch.Tensor, size: int, transport: Transport,
              call: CallOptions) -> torch.Tensor:
        """Forward every row, reduce-scatter the float32 rows, this shard's inverse."""
        rank = transport.rank
        rows = x.detach().reshape(size, -1)
        if x.device.type == "cuda":
            import cupy

            src = cupy.from_dlpack(rows.float() if rows.dtype == torch.bfloat16 else rows)
            fwd = geo.forward_rows(src)
            shard = self._reduce(fwd.reshape(-1), transport, call, geometry_generation=self._generation(geo))
            return torch.from_dlpack(geo.shard(rank).inverse(shard))
        src_np = rows.float().numpy() if rows.dtype != torch.float32 else rows.numpy()
        fwd = geo.forward_rows(src_np)
        shard = self._reduce(fwd.reshape(-1), transport, call, geometry_generation=self._generation(geo))
        return torch.from_numpy(geo.shard(rank).inverse(shard))

    def _generation(self, geo: ShardedGeometry) -> int:
        """A count that changes when the geometry object does: the residual kept in its
        coordinates is then dropped (the plain path's signature uses None)."""
        if geo is not self._geo_seen:
            self._geo_seen, self._geo_generation = geo, self._geo_generation + 1
        return self._geo_generation

    def _geometry_for(self, call: int, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> ShardedGeometry | None:
        if self.geometry_mode is None:
            return None
        if self.schedule.paper is not None:  # every call: the ranks agree on the refresh before any of its collectives
            agree_refresh(self._host[group], f"GiftReduceScatter (FSDP module {self.index})", call, self.schedule.paper,
                          {"warmup": self.schedule.warmup, "has_map": int(self.geometry is not None), "shards": size})
        if self.geometry_mode in ("kfac", "paper") and (call - self.schedule.warmup) % self.schedule.refresh_period == 0:
            # on the same calls of every rank: collective
            self.geometry = self._build_paper(group, size, call) if self.schedule.paper else self._build_kfac(group, size)
        geo = self.geometry
        if geo is None:
            return None
        if geo.shard_size * size != x.numel():  # some parameters got no gradient this step
            if "layout" not in self._warned:
                self._warned.add("layout")
                warnings.warn(f"GiftReduceScatter: the reduce-scatter input has {x.numel()} values but the module's "
                              f"parameters pad to {geo.shard_size * size} (a parameter without gradient?); "
                              "those calls run without the geometry", RuntimeWarning, stacklevel=3)
            return None
        return geo

    def _build_paper(self, group: dist.ProcessGroup, size: int, call: int) -> ShardedGeometry | None:
        """Collective over ``group``: the paper's preset (giftcomm.geometry.paper) from the captured
        input covariances of this module's 2-D Linear weights, averaged over the group; every rank
        must have fed them (RuntimeError on every rank otherwise)."""
        from ...geometry.paper import refresh_sharded

        cap = self.capture
        assert isinstance(cap, KfacCapture) and self.schedule.paper is not None
        layout = list(zip(self.names, self.shapes))
        factors = {n: a for n, (a, _) in cap.estimator.factors().items()
                   if n in self.names and len(dict(layout)[n]) == 2}
        return refresh_sharded(self._host[group], layout, factors, size, call, self.schedule.paper, smoothing=self.factor_ema)

    def _build_kfac(self, group: dist.ProcessGroup, size: int) -> ShardedGeometry | None:
        """Collective over ``group``: average the captured factors of this module's Linear weights
        (weighted by their batch counts), build the shard-local geometry, check it agrees."""
        cap = self.capture
        assert isinstance(cap, KfacCapture)
        est = cap.estimator
        factors = est.factors()
        layout = list(zip(self.names, self.shapes))
        mats, names = [], []
        for name, shape in layout:
            if name in est.segments and len(shape) == 2:
                a, g = factors.get(name, (None, None))
                n = int(est.counts.get(name, 0))
                m_out, n_in = shape
                mats.append(np.concatenate([
                    (np.zeros((n_in, n_in)) if a is None else a * n).reshape(-1),
                    (np.zeros((m_out, m_out)) if g is None else g * n).reshape(-1), [float(n)]]))
                names.append(name)
        if not names:
            return None
        host = self._host[group]
        summed = host.sum_float64(np.concatenate(mats))
        offset, avg = 0, {}
        for name in names:
            m_out, n_in = dict(layout)[name]
            a = summed[offset : offset + n_in * n_in].reshape(n_in, n_in)
            offset += n_in * n_in
            g = summed[offset : offset + m_out * m_out].reshape(m_out, m_out)
            offset += m_out * m_out
            count = summed[offset]
            offset += 1
            if count > 0:
                avg[name] = (a / count, g / count)
        if not avg:
            return None
        geo = ShardedGeometry.from_kfac(layout, avg, size, damping=self.schedule.damping)
        prints = host.allgather_object(geo.fingerprint())
        if any(f != prints[0] for f in prints):  # eigh differed across machines: take rank 0's
            geo = host.broadcast_object(geo if host.rank == 0 else None, root=0)
        return geo


def _op(op: Any) -> tuple[str, float | None]:
    """(giftcomm op, post-multiplier or None) of an FSDP ReduceOp; ValueError for the others."""
    R = dist.ReduceOp  # noqa: N806
    kind = getattr(op, "op", op)
    if kind == R.AVG:
        return "avg", None
    if kind == R.SUM:
        return "sum", None
    if kind == R.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if not isinstance(factor, float):
            raise ValueError(f"GiftReduceScatter: PREMUL_SUM with a tensor factor is not supported (got {factor!r})")
        return "sum", factor
    raise ValueError(f"GiftReduceScatter: giftcomm reduces with SUM, AVG or PREMUL_SUM, not {op}")


class _CaptureStepper:
    """The forward pre-hook that steps a shared KfacCapture once per training forward; ``steps``:
    forwards counted so far (kept in :meth:`GiftReduceScatters.state_dict`)."""

    def __init__(self, capture: KfacCapture) -> None:
        self.capture, self.steps = capture, 0

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if module.training:
            self.capture.step(self.steps)
            self.steps += 1


class GiftReduceScatters(list):
    """What :func:`register_reduce_scatter` returns: the list of its GiftReduceScatter comms, plus
    :meth:`stats`, their counts added up, and :meth:`state_dict` / :meth:`load_state_dict`."""

    stepper: _CaptureStepper | None = None  # the shared capture's forward pre-hook (capture=model)

    def state_dict(self) -> dict[str, Any]:
        """Every comm's :meth:`GiftReduceScatter.state_dict` and, with a capture made by
        register_reduce_scatter (``capture=model``), its captured factors, row sampler and forward
        count: this rank's checkpoint (the factors and residuals differ by rank)."""
        st = self.stepper
        return {"comms": [c.state_dict() for c in self],
                "capture": None if st is None else st.capture.state_dict(),
                "capture_steps": None if st is None else st.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into comms registered the same way (ValueError for another
        number of comms)."""
        comms = state["comms"]
        if len(comms) != len(self):
            raise ValueError(f"GiftReduceScatters.load_state_dict: {len(comms)} comms saved, {len(self)} registered")
        for c, s in zip(self, comms):
            c.load_state_dict(s)
        if self.stepper is not None and state.get("capture") is not None:
            self.stepper.capture.load_state_dict(state["capture"])
            self.stepper.steps = int(state["capture_steps"])

    def stats(self) -> dict[str, Any]:
        """Every comm's :meth:`GiftReduceScatter.stats` added up (the dict of giftcomm.stats)."""
        total: dict[str, Any] = {"calls": 0, "bytes_sent": {}, "algorithms": {}, "fallbacks": {}}
        for comm in self:
            st = comm.stats()
            total["calls"] += st["calls"]
            for key in ("bytes_sent", "algorithms", "fallbacks"):
                for k, v in st[key].items():
                    total[key][k] = total[key].get(k, 0) + v
        return total


_COMM_SETTINGS = (*(n for n, p in inspect.signature(GiftReduceScatter).parameters.items()
                    if p.kind is p.KEYWORD_ONLY and n not in ("options", "index")), "capture_every", "capture_tokens")
"""register_reduce_scatter's keywords that are no call options: each comm's settings, the capture's."""


def register_reduce_scatter(model: torch.nn.Module, **options: Any) -> GiftReduceScatters:
    """Install a :class:`GiftReduceScatter` on every FSDP2 module of ``model`` (one each, bound to
    that module's parameters) and return them in ``model.modules()`` order.

    options: those of GiftReduceScatter (its ``schedule``, capture, baseline, and the call
    options, as keywords or ``options=``). With schedule.geometry "kfac" or "paper",
    ``capture=model`` makes one KfacCapture shared by all comms, stepped by a forward pre-hook
    on ``model`` (capture every ``capture_every`` forwards, ``capture_tokens`` rows per layer).
    Call on every rank, after ``fully_shard``. Raises on every rank alike, before any data
    moves: RuntimeError on torch without the FSDP2 comm API or for a model with no FSDP module;
    ValueError for bad options, a module with several parameter groups, or a geometry that does
    not match a module's parameters.
    """
    record = options.pop("options", None)
    fixed = options.pop("geometry") if isinstance(options.get("geometry"), ShardedGeometry) else None
    schedule = schedule_of("register_reduce_scatter", options.pop("schedule", None), options, SCHEDULE)
    settings = {k: options.pop(k) for k in list(options) if k in _COMM_SETTINGS}
    record = options_of_call("register_reduce_scatter", record, options, fixed=("op",))  # the rest: call options
    options = settings
    if fixed is not None:
        options["geometry"] = fixed
    modules = fsdp_modules(model)  # RuntimeError on torch without the FSDP2 comm API
    if not modules:
        raise RuntimeError("register_reduce_scatter: the model has no FSDP2 module (apply fully_shard first)")
    capture_every = options.pop("capture_every", 10)
    capture_tokens = options.pop("capture_tokens", 256)
    capture = options.get("capture")
    stepper = None
    if schedule.geometry in ("kfac", "paper") and isinstance(capture, torch.nn.Module):
        decay = schedule.paper.decay if schedule.paper is not None else 0.95
        capture = KfacCapture(capture, every=capture_every, tokens=capture_tokens, decay=decay)
        stepper = _CaptureStepper(capture)
        model.register_forward_pre_hook(stepper)
        options["capture"] = capture
    names = {id(p): n for n, p in model.named_parameters()}
    comms = GiftReduceScatters()
    comms.stepper = stepper
    host: dict[Any, Transport] = {}  # one transport per process group, shared by the comms
    device: dict[Any, Transport] = {}
    for i, module in enumerate(modules):
        state = module._get_fsdp_state()  # the public setter checks too, but later
        groups: list[Any] = list(state._fsdp_param_groups)  # FSDP's private records, read duck-typed
        if not groups:  # an FSDP module whose parameters all belong to nested ones
            continue
        if len(groups) > 1:
            raise ValueError(f"register_reduce_scatter: FSDP module {type(module).__name__} has {len(groups)} "
                             "parameter groups (per-parameter meshes); one comm cannot serve several")
        group = groups[0]
        comm = GiftReduceScatter(index=i, schedule=schedule, options=record, **options)
        comm._host, comm._device = host, device
        fsdp_params = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
        shapes = [tuple(fp._orig_size) for fp in fsdp_params]
        dims = [int(fp.fsdp_placement.dim) for fp in fsdp_params]
        pnames = [names.get(id(fp.sharded_param), f"module{i}.param{j}") for j, fp in enumerate(fsdp_params)]
        comm.bind(pnames, shapes, dims, int(group.mesh_info.shard_mesh_size))
        module.set_custom_reduce_scatter(comm)
        comms.append(comm)
    return comms
