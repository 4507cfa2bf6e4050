"""A torch.distributed process group that reduces gradients through giftcomm.

::

    import giftcomm.adapters.torch as gt

    dist.init_process_group("gloo")                  # or "nccl"; torchrun sets the env
    pg = gt.new_group(fmt="e4m3", min_elems=65536)   # collective over the world, like dist.new_group
    ddp = DDP(model, process_group=pg)               # or Megatron's data-parallel group, ...
    dp = [gt.new_group(ranks=r, fmt="e4m3") for r in ([0, 2], [1, 3])][rank % 2]  # world 4, TP 2

Any consumer of a process group -- ``DDP(process_group=pg)``, Megatron-core's
DistributedDataParallel (its data-parallel group), ``dist.all_reduce(t, group=pg)`` -- then
sends its large floating-point reductions through giftcomm's wire format (the call options
given at creation, :class:`giftcomm.options.CallOptions`) while everything else runs on an
ordinary *inner* group over the same ranks (gloo, or NCCL for CUDA tensors), unchanged.

The mechanism (torch 2.13; docs/adapters.md "A giftcomm process group"): the group is a Python
subclass of ``torch.distributed.ProcessGroup`` (the pybind trampoline ``PyProcessGroup`` makes
its methods virtual for C++ callers such as DDP's reducer), created by the backend ``"giftcomm"``
that this module registers with ``Backend.register_backend(..., extended_api=True,
devices=["cpu", "cuda"])``. ``dist.new_group(backend="giftcomm", pg_options=...)`` hands the
creator the group's options and, because the creator returns a ProcessGroup, torch registers
that very object in its world tables, so ``dist.get_rank(pg)``, ``get_process_group_ranks``,
``_coalescing_manager`` and the rest treat it like any group. :func:`new_group` makes the
inner group, a private gloo group over the same ranks and the options record and calls it, on
every rank of the default group (a group over a subset of the ranks, e.g. one of Megatron's
data-parallel groups, included). It never becomes the default group.

What goes through giftcomm -- :class:`Policy` (the same decision on every rank: it reads only
dtype, element count and op, which a correct collective shares):

- ``allreduce`` (``dist.all_reduce``), ``reduce_scatter_single`` (``reduce_scatter_tensor``),
  their coalesced forms (``_coalescing_manager`` blocks: one giftcomm call per block), and,
  with ``allgather=True``, ``all_gather_single`` (``all_gather_into_tensor``) and its coalesced
  form;
- of a floating dtype (float32, float64, float16, bfloat16), at least ``min_elems`` elements
  per call (a coalesced call counts all its tensors), with op SUM, AVG or PREMUL_SUM with a
  Python float factor (``dist._make_nccl_premul_sum(f)``: the sum times f, in the tensor's dtype).

Everything else -- integer tensors, small tensors, MAX/MIN/PRODUCT/..., a PREMUL_SUM with a
tensor factor, a coalesced call mixing dtypes or devices, broadcast, barrier, send/recv,
gather/scatter, all-to-all, list all-gathers -- is the inner group's call with the same
arguments, so it behaves (and fails) exactly as on that group. All-gathers are not compressed
by default: trainers gather *parameters* with them (Megatron's distributed optimizer), and an
FP8 copy of the weights is a different model.

The route is agreed per call, in the call's one agreement (giftcomm.collectives.agree: one gather
of named int64 fields over the members' gloo group): each rank sends what its policy decided,
what its call is (collective, a fingerprint of the tensors' sizes, dtype, device, op and factor)
and the giftcomm call's own agreed fields (giftcomm.collectives.engine.prepare_call), so a
compressed call then runs without agreeing again (engine.run_agreed). Unanimous "inner": the
inner group's call, unchanged; unanimous "giftcomm" with the same call: giftcomm's; anything
else (one rank's tensor below ``min_elems`` or of another dtype, another op, other sizes, a
coalesced call mixing dtypes on one rank) raises the same ValueError on every rank, naming every
rank's call, instead of a hang or a call half on one route and half on the other. The agreement
and every other wait of a call are bounded by giftcomm's call timeout (``call_timeout=``;
``GIFTCOMM_TIMEOUT``): past it CommTimeout, and from then on CommAborted on every rank
(giftcomm.transport.torch_dist).

A call the policy sends to the inner group is logged once per group and reason (:data:`REASONS`;
a WARNING on the "giftcomm" logger) and every one is counted: :meth:`GiftProcessGroup.stats`
(also :func:`group_stats` of any torch handle of the group) is the dict of ``giftcomm.stats``
over the calls the policy decided on, on either route. ``baseline=`` sends the compressed
all-reduces through a baseline wire (giftcomm.collectives.baselines) instead of giftcomm's format.

Results are bit-identical on every rank (giftcomm's guarantee); a rank that gets a bad input
or a failure gets giftcomm's exception, raised on every rank (docs/robustness.md). A compressed
call of CPU tensors runs on the group's one worker thread, in the order the calls were issued,
and returns a pending ``Work`` (``async_op=True``: the caller goes on -- Megatron's
``overlap_grad_reduce`` keeps computing the backward pass while a bucket is agreed, encoded and
sent; ``async_op=False``: torch waits for it at once). Its ``wait()`` raises the call's error,
the same on every rank; the tensors must be left alone until then, as for any asynchronous
collective. Every other call of the group (on the inner route, or of CUDA tensors) first waits
for the queued calls to end, so the host transport's calls keep one order on every rank, and the
agreement still compares the issuing threads' names. On CUDA the kernels and NCCL transfers are
queued on torch's current stream, the stream the caller issued the call on, and a completed
``Work`` is returned.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ... import accounting
from ...accounting import Tally
from ...algorithms import SCATTER_CHOICES
from ...collectives import engine
from ...collectives.agree import agree
from ...collectives.call import Job
from ...collectives.hold import held
from ...options import CallOptions
from ...transport import Transport
from ...transport.torch_dist import TorchDistDeviceTransport, TorchDistTransport
from .streams import on_stream
from .work import PendingWork, completed_work

__all__ = ["Policy", "GiftProcessGroup", "new_group", "group_stats", "BACKEND", "REASONS"]

log = logging.getLogger("giftcomm")

BACKEND = "giftcomm"
"""The name this module registers with ``torch.distributed.Backend.register_backend``."""

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_OPS = ("sum", "avg", "premul_sum")

REASONS = {
    "not_float": "the tensors are not float32/float64/float16/bfloat16",
    "op": "an op the policy does not compress (MAX, MIN, PRODUCT, a PREMUL_SUM with a tensor factor, "
          "or one left out of Policy.ops)",
    "layout": "a call giftcomm cannot carry as one buffer (non-contiguous tensors, a coalesced call mixing "
              "dtypes or devices, outputs not sized for the inputs)",
    "below_min_elems": "fewer elements than the policy's min_elems",
}
"""Why a call the policy decides on went to the inner group, uncompressed (the ``fallbacks``
keys of :meth:`GiftProcessGroup.stats`), in the order the policy checks them."""


@dataclass(frozen=True)
class Policy:
    """What the giftcomm group compresses (module doc).

    min_elems: the least elements a call (all its tensors together) must have (int >= 1;
    default 65536 = 256 KiB of float32: below it latency, not bandwidth, dominates).
    ops: which of "sum", "avg", "premul_sum" are compressed (the others go to the inner group).
    allgather: whether all-gathers are compressed too (default False).
    """

    min_elems: int = 65536
    ops: tuple[str, ...] = _OPS
    allgather: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.min_elems, bool) or not isinstance(self.min_elems, int) or self.min_elems < 1:
            raise ValueError(f"Policy: min_elems must be an int >= 1, got {self.min_elems!r}")
        ops = tuple(self.ops) if not isinstance(self.ops, str) else (self.ops,)
        bad = [o for o in ops if o not in _OPS]
        if bad or not ops:
            raise ValueError(f"Policy: ops must be a non-empty subset of {_OPS}, got {self.ops!r}")
        object.__setattr__(self, "ops", tuple(o for o in _OPS if o in ops))
        if not isinstance(self.allgather, bool):
            raise ValueError(f"Policy: allgather must be True or False, got {self.allgather!r}")

    def reduction(self, op: Any) -> tuple[str, float | None] | None:
        """(giftcomm op, post-multiplier or None) for a torch ReduceOp this policy compresses, else None."""
        R = dist.ReduceOp  # noqa: N806
        kind = getattr(op, "op", op)
        if kind == R.SUM and "sum" in self.ops:
            return "sum", None
        if kind == R.AVG and "avg" in self.ops:
            return "avg", None
        if kind == R.PREMUL_SUM and "premul_sum" in self.ops:
            factor = getattr(op, "factor", None)
            if isinstance(factor, float):
                return "sum", factor
        return None

    def refusal(self, tensors: Sequence[torch.Tensor], reduces: bool = True,
                how: tuple[str, float | None] | None = None, shaped: bool = True) -> str | None:
        """Why one giftcomm call cannot carry ``tensors`` (a key of :data:`REASONS`), or None
        when it can: one floating dtype and device, contiguous, at least ``min_elems`` elements
        in all; ``reduces``: a reduction, whose ReduceOp ``how`` (:meth:`reduction`) must be
        one this policy compresses; ``shaped``: the outputs fit the inputs."""
        if not tensors or any(t.dtype not in _FLOATS for t in tensors):
            return "not_float"
        if reduces and how is None:
            return "op"
        t0 = tensors[0]
        if not shaped or any(t.dtype != t0.dtype or t.device != t0.device or not t.is_contiguous() for t in tensors):
            return "layout"
        if sum(int(t.numel()) for t in tensors) < self.min_elems:
            return "below_min_elems"
        return None


# ---------------------------------------------------------------------------- the route agreement
_KINDS = ("allreduce", "reduce_scatter", "allgather")
_ROUTE_MATCH = ("route", "collective", "call")
"""The route facts every rank must have alike, first in the one agreement of a call: route (1:
this rank's policy sends the call to giftcomm, 0: to the inner group), collective (index in
``_KINDS``), call (a fingerprint of the tensors' sizes, dtype, device, op and factor; 0 on the
inner route). The giftcomm call's own fields (engine's ``Kind.fields``; 0 on the inner route)
follow, then :data:`_SHOWN`."""
_SHOWN = ("tensors", "elements", "tensor_dtype", "device", "reduction", "factor", "contiguous")
"""What each rank's call is, for the error when the ranks disagree (never compared): tensor
count, elements, dtype (index in ``_DTYPES``, -1 another), device (0 cpu, 1 cuda, 2 other),
reduction (0 none, 1 sum, 2 avg, 3 premul_sum, -1 an op left alone), the PREMUL_SUM factor's
float64 bits, contiguous (1/0)."""
_DTYPES = (*_FLOATS, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128)
_DEVICES = {"cpu": 0, "cuda": 1}


def _factor_bits(factor: float | None) -> int:
    return 0 if factor is None else int(np.array(factor, np.float64).view(np.int64))


def _shown(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], reduces: bool,
           how: tuple[str, float | None] | None) -> dict[str, int]:
    """This rank's :data:`_SHOWN` fields."""
    t0 = inputs[0] if inputs else None
    if not reduces:
        reduction = 0
    elif how is None:
        reduction = -1
    else:
        reduction = 3 if how[1] is not None else 1 + ("sum", "avg").index(how[0])
    return {"tensors": len(inputs), "elements": sum(int(t.numel()) for t in inputs),
            "tensor_dtype": _DTYPES.index(t0.dtype) if t0 is not None and t0.dtype in _DTYPES else -1,
            "device": -1 if t0 is None else _DEVICES.get(t0.device.type, 2),
            "reduction": reduction, "factor": _factor_bits(None if how is None else how[1]),
            "contiguous": int(all(t.is_contiguous() for t in [*inputs, *outputs]))}


def _fingerprint(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], shown: dict[str, int]) -> int:
    """The ``call`` field: what every rank's giftcomm call must have alike beyond the engine's
    fields (each tensor's size, the op, the factor, the device), as a nonzero int."""
    facts = ([int(t.numel()) for t in inputs], [int(t.numel()) for t in outputs], shown["tensor_dtype"],
             shown["device"], shown["reduction"], shown["factor"])
    return zlib.crc32(repr(facts).encode()) + 1


def _describe(row: dict[str, int]) -> str:
    """One rank's call in words (for the error)."""
    route = "giftcomm" if row["route"] else "inner group"
    code = row["tensor_dtype"]
    dtype = str(_DTYPES[code]).replace("torch.", "") if code >= 0 else "another dtype"
    op = {0: "", 1: ", sum", 2: ", avg", 3: ", premul_sum", -1: ", an op giftcomm leaves alone"}[row["reduction"]]
    factor = f" x {np.array(row['factor'], np.int64).view(np.float64)}" if row["reduction"] == 3 else ""
    device = {0: "", 1: " (cuda)", 2: " (another device)", -1: ""}[row["device"]]
    return (f"{_KINDS[row['collective']]} -> {route} ({row['tensors']} tensor(s) of {dtype}{device}, "
            f"{row['elements']} elements{op}{factor}{'' if row['contiguous'] else ', not contiguous'})")


_INNER, _BASELINE = "inner", "baseline"


class GiftProcessGroup(dist.ProcessGroup):
    """A process group over ``inner``'s ranks that reduces through giftcomm (module doc).

    Built by :func:`new_group` (through ``dist.new_group(backend="giftcomm")``), not directly.
    ``inner``: the ordinary group everything else goes to. ``host``: giftcomm's transport over the
    members' private gloo group (the route agreement; the data of CPU tensors). ``options``: the
    giftcomm calls' :class:`CallOptions` (its ``op`` is ignored: each call's ReduceOp decides).
    ``policy``: what is compressed. ``baseline``: None, or the baseline wire every compressed
    all-reduce goes through instead (giftcomm.collectives.baselines). ``explicit``: the format was named
    (auto's fallback to native is then warned about). ``counts``: calls so far, by route
    ("giftcomm", "inner": the pass-through calls included); :meth:`stats`: what was sent.
    """

    def __init__(self, inner: dist.ProcessGroup, host: Transport, options: CallOptions, policy: Policy,
                 baseline: str | None = None, explicit: bool = True) -> None:
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]  # the (rank, size) overload
        self.inner, self.host, self.options, self.policy = inner, host, options, policy
        self.baseline, self.explicit = baseline, explicit
        self._device: Transport | None = None
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None  # the queued calls' thread
        self._last: concurrent.futures.Future | None = None  # the latest queued call
        self.counts = {"giftcomm": 0, "inner": 0}
        self._tally = Tally()
        rs_algorithm = options.algorithm if options.algorithm in SCATTER_CHOICES else "auto"
        self._call_options = {  # per (collective, giftcomm op), validated once
            ("allreduce", "sum"): options.replace(op="sum"), ("allreduce", "avg"): options.replace(op="avg"),
            ("reduce_scatter", "sum"): options.replace(op="sum", algorithm=rs_algorithm),
            ("reduce_scatter", "avg"): options.replace(op="avg", algorithm=rs_algorithm),
            ("allgather", "sum"): options.replace(op="sum", algorithm="auto")}

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:  # noqa: N802  (the C++ name the trampoline looks up)
        return BACKEND

    def name(self) -> str:
        return BACKEND

    # torch's base ProcessGroup keeps its name on its backends, which this group has none of:
    # the trampoline's virtual getGroupName/setGroupName look these up (pg.group_name, which
    # DeviceMesh.from_group -- FSDP2's, Megatron's FSDP2 wrapper's -- reads)
    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return getattr(self, "_group_name", "")

    def __repr__(self) -> str:
        wire = f", baseline={self.baseline!r}" if self.baseline else ""
        return (f"GiftProcessGroup(rank={self.rank()}, size={self.size()}, fmt={self.options.fmt!r}{wire}, "
                f"policy={self.policy})")

    # ------------------------------------------------------------------ what was sent
    def stats(self) -> dict[str, Any]:
        """What this rank sent in the calls the policy decided on (all-reduces, reduce-scatters,
        and all-gathers with ``Policy.allgather``), on either route: the dict of
        :func:`giftcomm.stats` (docs/api.md, "What was sent"). Compressed calls count under their
        format and algorithm; a baseline wire's under its name (bytes_sent and algorithms); an
        inner-group call under bytes_sent "native" (its payload as a ring moves it: an
        all-reduce ``2 (P-1)/P`` of its bytes, a reduce-scatter ``(P-1)/P`` of its input's, an
        all-gather ``P-1`` times its input's), algorithm "inner" and fallbacks[reason]
        (:data:`REASONS`). The pass-through calls (broadcast, barrier, ...) are not counted."""
        self._drain()
        return self._tally.as_dict()

    def transport(self, device: str = "cpu") -> Transport:
        """giftcomm's transport for tensors of ``device`` ("cpu" or "cuda"): ``giftcomm.stats``
        of it counts the group's calls made over it (the host transport: the inner-group and
        baseline calls and the compressed CPU calls; the CUDA one: the compressed CUDA calls)."""
        if device != "cuda":
            return self.host
        if self._device is None:
            assert isinstance(self.host, TorchDistTransport)
            self._device = TorchDistDeviceTransport(self.inner, control=self.host)
        return self._device

    # ------------------------------------------------------------------ allreduce
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        opts = dist.AllreduceOptions() if opts is None else opts
        how = self.policy.reduction(opts.reduceOp)
        # a list of several tensors outside a coalescing block: torch's multi-device form
        reason = self.policy.refusal(tensors, True, how, shaped=len(tensors) == 1)
        return self._allreduce(tensors, how, reason, lambda: self.inner.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        how = self.policy.reduction(opts.reduceOp)
        reason = self.policy.refusal(tensors, True, how)
        return self._allreduce(tensors, how, reason, lambda: self.inner.allreduce_coalesced(tensors, opts))

    def _allreduce(self, tensors: list[torch.Tensor], how: tuple[str, float | None] | None, reason: str | None,
                   inner: Callable[[], Any]) -> Any:
        """One all-reduce of all ``tensors`` (concatenated when several), in place, on the agreed
        route: queued on the worker thread when this rank's policy compresses it (CPU tensors)."""
        if self._queues(tensors, reason):
            return self._queued(tensors, self._allreduce_now, tensors, how, reason, inner)
        return self._allreduce_now(tensors, how, reason, inner)

    def _allreduce_now(self, tensors: list[torch.Tensor], how: tuple[str, float | None] | None, reason: str | None,
                       inner: Callable[[], Any]) -> Any:
        buf = None
        if reason is None:
            flats = [t.view(-1) for t in tensors]
            buf = flats[0] if len(flats) == 1 else torch.cat(flats)
        data = self.transport(tensors[0].device.type) if reason is None else self.host
        with self._held(data):
            route = self._agree("allreduce", engine.ALLREDUCE, tensors, tensors, how, reason, data, buf, buf)
            if route == _BASELINE:
                assert buf is not None and how is not None
                self._baseline(buf, how[0])
            elif isinstance(route, Job):
                assert buf is not None
                with on_stream(buf):
                    engine.run_agreed(data, engine.ALLREDUCE, route, buf, self.explicit)
        if route == _INNER:
            return self._inner_call("allreduce", tensors, reason, inner)
        assert buf is not None and how is not None
        with on_stream(buf):
            if how[1] is not None:
                buf.mul_(how[1])
            if len(tensors) > 1:
                off = 0
                for t in tensors:
                    t.view(-1).copy_(buf[off : off + t.numel()])
                    off += t.numel()
        return self._done(data, tensors)

    # ------------------------------------------------------------------ reduce-scatter
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        opts = dist.ReduceScatterOptions() if opts is None else opts
        return self._reduce_scatter([output], [input], opts, lambda: self.inner.reduce_scatter_single(
            output, input, opts))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self.reduce_scatter_single(output, input, opts)  # the name before torch 2.13

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        opts = dist.ReduceScatterOptions() if opts is None else opts
        return self._reduce_scatter(outputs, inputs, opts, lambda: self.inner.reduce_scatter_single_coalesced(
            outputs, inputs, opts))

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)  # the name before torch 2.13

    def _reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any,
                        inner: Callable[[], Any]) -> Any:
        """Each input (P x n_i values, its rank-r chunk for rank r) into its output (n_i): one
        giftcomm reduce-scatter (layout "equal") of the inputs' chunks laid out rank by rank
        (queued on the worker thread as :meth:`_allreduce`)."""
        how = self.policy.reduction(opts.reduceOp)
        size = self.size()
        shaped = len(outputs) == len(inputs) and all(
            i.numel() == o.numel() * size and i.dtype == o.dtype and i.device == o.device
            for o, i in zip(outputs, inputs))
        reason = self.policy.refusal(inputs + outputs, True, how, shaped)
        if self._queues(inputs, reason):
            return self._queued(outputs, self._reduce_scatter_now, outputs, inputs, how, reason, inner)
        return self._reduce_scatter_now(outputs, inputs, how, reason, inner)

    def _reduce_scatter_now(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                            how: tuple[str, float | None] | None, reason: str | None, inner: Callable[[], Any]) -> Any:
        size = self.size()
        src = out = None
        if reason is None:
            rows = [i.view(size, -1) for i in inputs]
            src = rows[0].reshape(-1) if len(rows) == 1 else torch.cat(rows, dim=1).reshape(-1)
            out = outputs[0].view(-1) if len(outputs) == 1 else None
        kind = engine.REDUCE_SCATTERS["equal"]
        data = self.transport(inputs[0].device.type) if reason is None else self.host
        with self._held(data):
            route = self._agree("reduce_scatter", kind, inputs, outputs, how, reason, data, src, out)
            shard = None
            if isinstance(route, Job):
                assert src is not None
                with on_stream(src):
                    shard = engine.run_agreed(data, kind, route, out, self.explicit)
        if route == _INNER:
            return self._inner_call("reduce_scatter", inputs, reason, inner)
        assert how is not None and shard is not None
        with on_stream(shard):
            off = 0
            for o in outputs:
                if out is None:
                    o.view(-1).copy_(shard[off : off + o.numel()])
                    off += o.numel()
                if how[1] is not None:
                    o.mul_(how[1])
        return self._done(data, outputs)

    # ------------------------------------------------------------------ all-gather
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        opts = dist.distributed_c10d.AllgatherOptions() if opts is None else opts
        return self._allgather([output], [input], lambda: self.inner.all_gather_single(output, input, opts))

    _allgather_base = all_gather_single  # the name before torch 2.13

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Any:
        opts = dist.distributed_c10d.AllgatherOptions() if opts is None else opts
        return self._allgather(outputs, inputs, lambda: self.inner.all_gather_single_coalesced(outputs, inputs, opts))

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self.all_gather_single_coalesced(outputs, inputs, opts)  # the name before torch 2.13

    def _allgather(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], inner: Callable[[], Any]) -> Any:
        """Each input (n_i) gathered into its output (P x n_i, rank r's at chunk r): one giftcomm
        all-gather of the inputs concatenated (queued on the worker thread as :meth:`_allreduce`)."""
        if not self.policy.allgather:  # no rank compresses an all-gather (the policy is agreed at creation)
            self.counts["inner"] += 1
            return inner()
        size = self.size()
        shaped = len(outputs) == len(inputs) and all(
            o.numel() == i.numel() * size and i.dtype == o.dtype and i.device == o.device
            for o, i in zip(outputs, inputs))
        reason = self.policy.refusal(inputs + outputs, False, None, shaped)
        if self._queues(inputs, reason):
            return self._queued(outputs, self._allgather_now, outputs, inputs, reason, inner)
        return self._allgather_now(outputs, inputs, reason, inner)

    def _allgather_now(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], reason: str | None,
                       inner: Callable[[], Any]) -> Any:
        size = self.size()
        src = out = None
        if reason is None:
            flats = [i.view(-1) for i in inputs]
            src = flats[0] if len(flats) == 1 else torch.cat(flats)
            out = outputs[0].view(-1) if len(outputs) == 1 else None
        data = self.transport(inputs[0].device.type) if reason is None else self.host
        with self._held(data):
            route = self._agree("allgather", engine.ALLGATHER, inputs, outputs, None, reason, data, src, out)
            whole = None
            if isinstance(route, Job):
                assert src is not None
                with on_stream(src):
                    whole = engine.run_agreed(data, engine.ALLGATHER, route, out, self.explicit)
        if route == _INNER:
            return self._inner_call("allgather", inputs, reason, inner)
        if out is None:
            assert whole is not None
            with on_stream(whole):
                whole = whole.view(size, -1)
                off = 0
                for o, i in zip(outputs, inputs):
                    o.view(size, -1).copy_(whole[:, off : off + i.numel()])
                    off += i.numel()
        return self._done(data, outputs)

    # ------------------------------------------------------------------ the worker thread
    def _queues(self, tensors: list[torch.Tensor], reason: str | None) -> bool:
        """Whether this call goes to the worker thread: one this rank's policy compresses, of CPU
        tensors. Any other call first waits here for the queued ones to end, so that the host
        transport (the agreement's) sees the calls in issue order on every rank."""
        if reason is None and tensors[0].device.type == "cpu":
            return True
        self._drain()
        return False

    def _drain(self) -> None:
        """Wait for the queued calls to end (their errors are raised by their own ``Work``)."""
        last = self._last
        if last is not None:
            concurrent.futures.wait([last])

    def _queued(self, outputs: list[torch.Tensor], run: Callable[..., Any], *args: Any) -> PendingWork:
        """``run(*args)`` queued on the worker thread (one per group: calls run in issue order);
        the pending Work gets ``outputs`` or the call's exception. The call runs under the issuing
        thread's name: the agreement compares it across ranks (giftcomm.collectives.call.caller)."""
        fut: torch.futures.Future = torch.futures.Future()
        issuer = threading.current_thread().name

        def task() -> None:
            me = threading.current_thread()
            own, me.name = me.name, issuer
            try:
                run(*args)
            except BaseException as exc:  # noqa: BLE001 - the caller's wait() raises it
                fut.set_exception(exc)
            else:
                fut.set_result(list(outputs))
            finally:
                me.name = own

        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="giftcomm-pg")
        self._last = self._worker.submit(task)
        return PendingWork(fut)

    # ------------------------------------------------------------------ one agreement per call
    @contextlib.contextmanager
    def _held(self, data: Transport) -> Iterator[None]:
        """The call's turn on the host transport (the agreement's) and on ``data`` (the CUDA
        transport for CUDA tensors), their waits bounded by the call timeout."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(held(self.host, self.options.timeout, plain=False))
            if data is not self.host:
                stack.enter_context(held(data, self.options.timeout, plain=False))
            yield

    def _agree(self, what: str, kind: engine.Kind, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
               how: tuple[str, float | None] | None, reason: str | None, data: Transport, src: Any,
               out: Any) -> Job | str:
        """The route of this call, the same on every rank, in the call's one agreement (one
        gather of int64 fields over the host transport, giftcomm.collectives.agree): the agreed
        giftcomm :class:`Job` (its own fields are in the same gather, so it runs without agreeing
        again), :data:`_BASELINE` (the baseline wire's all-reduce) or :data:`_INNER` (the inner
        group's call follows, unchanged: every rank's policy said so).

        Every rank sends its route facts (:data:`_ROUTE_MATCH`), the giftcomm call's fields (0 on
        the inner route) and what its call is (:data:`_SHOWN`). Ranks whose routes or giftcomm
        calls differ -- one rank's tensor below ``min_elems`` or of another dtype, another op or
        factor, other sizes, a non-contiguous tensor -- all raise the same ValueError naming every
        rank's call (a call split between the routes would hang or sum wrong); a bad input on a
        giftcomm-route rank raises its error on every rank (giftcomm.collectives.agree)."""
        shown = _shown(inputs, outputs, kind is not engine.ALLGATHER, how)
        fields = (*_ROUTE_MATCH, *kind.fields, *_SHOWN)
        sig = dict.fromkeys(fields, 0)
        sig.update(shown, collective=_KINDS.index(what))
        plan: Job | str = _INNER
        prepared: tuple[Job | str, dict[str, int]] | Exception
        try:
            if reason is None:
                sig.update(route=1, call=_fingerprint(inputs, outputs, shown))
                if self.baseline is not None:
                    plan = self._baseline_checks(what, inputs[0])
                else:
                    made = engine.prepare_call(data, kind, src, out, self._call_options[what, how[0] if how else "sum"])
                    if isinstance(made, Exception):
                        raise made
                    plan, call_sig = made
                    sig.update(call_sig)
            prepared = plan, sig
        except Exception as exc:  # noqa: BLE001 - every failure joins the agreement, so no rank is left waiting
            prepared = exc
        plan, table = agree(self.host, f"giftcomm process group {what}", prepared, fields,
                            (*_ROUTE_MATCH, *kind.match), explain=lambda t: _disagreement(what, fields, t))
        if isinstance(plan, Job):
            start = len(_ROUTE_MATCH)
            kind.agreed(data, plan, table[:, start : start + len(kind.fields)])
        return plan

    def _baseline_checks(self, what: str, x: torch.Tensor) -> str:
        """:data:`_BASELINE`, or ValueError when the baseline wire cannot carry the call (inside
        the agreement: every rank raises it)."""
        if what != "allreduce":
            raise ValueError(f"the baseline wire {self.baseline!r} is an all-reduce; this group's {what} "
                             f"calls have no baseline form (make the group without baseline= for them)")
        if x.device.type != "cpu":
            raise ValueError(f"the baseline wire {self.baseline!r} runs on CPU tensors only (reference speed); "
                             f"got a {x.device.type} tensor")
        return _BASELINE

    # ------------------------------------------------------------------ the routes' ends
    def _baseline(self, buf: torch.Tensor, op: str) -> None:
        """``buf`` (CPU, flat) all-reduced in place through the baseline wire, counted under its name."""
        from ...collectives.baselines import baseline_allreduce
        assert self.baseline is not None
        values = buf if buf.dtype != torch.bfloat16 else buf.float()  # NumPy has no bfloat16: float32 is exact
        baseline_allreduce(values, self.baseline, comm=self.host, op=op, out=values)
        if values is not buf:
            buf.copy_(values)  # to bfloat16, rounded to nearest even as NumPy's cast is
        # baseline_allreduce counted the call on self.host under the wire's name (accounting.count)

    def _inner_call(self, what: str, inputs: list[torch.Tensor], reason: str | None, inner: Callable[[], Any]) -> Any:
        """The inner group's call, counted (bytes_sent "native", algorithm "inner",
        fallbacks[reason]) and warned about once per group and reason."""
        work = inner()
        self.counts["inner"] += 1
        p = self.size()
        nbytes = sum(int(t.numel()) * t.element_size() for t in inputs)
        sent = {"allreduce": 2 * (p - 1) * nbytes // p, "reduce_scatter": (p - 1) * nbytes // p,
                "allgather": (p - 1) * nbytes}[what]
        why = reason or "layout"
        accounting.count(self.host, "native", "inner", sent, why)
        self._tally.add(self.host)
        accounting.fallback(self.host, why, "giftcomm process group (ranks %s), rank %d: a %d-element %s went to the "
                            "inner %s group UNCOMPRESSED (%s)%s; every such call is counted in the group's "
                            "stats()['fallbacks'] (giftcomm.adapters.torch.group_stats)",
                            dist.get_process_group_ranks(self), self.rank(), sum(int(t.numel()) for t in inputs),
                            what, dist.get_backend(self.inner), REASONS[why],
                            f"; new_group(min_elems=...) sets the threshold, now {self.policy.min_elems}"
                            if why == "below_min_elems" else "")
        return work

    def _done(self, data: Transport, tensors: list[torch.Tensor]) -> Any:
        """Count a call that ran on giftcomm's route (or the baseline wire's): the completed Work."""
        self.counts["giftcomm"] += 1
        self._tally.add(self.host if self.baseline is not None else data)
        return completed_work(list(tensors))


def _disagreement(what: str, fields: tuple[str, ...], table: np.ndarray) -> str:
    """The error when the ranks' routes or calls differ (every rank has the same table)."""
    rows = [dict(zip(fields, map(int, r))) for r in table]
    differ = [f for f in fields[: len(fields) - len(_SHOWN)] if any(r[f] != rows[0][f] for r in rows)]
    shown = "; ".join(f"group rank {q}: {_describe(r)}" for q, r in enumerate(rows))
    return (f"the ranks' {what} calls disagree (on {', '.join(differ)}), so no rank runs it (every rank must "
            f"pass tensors of the same dtype, sizes, op and layout, from threads of the same name): {shown}")


def _pass_through(method: str) -> Any:
    def call(self: GiftProcessGroup, *args: Any, **kwargs: Any) -> Any:
        self.counts["inner"] += 1
        return getattr(self.inner, method)(*args, **kwargs)

    call.__name__ = method
    call.__doc__ = f"The inner group's ``{method}``, unchanged."
    return call


for _m in ("allgather", "allgather_coalesced", "alltoall", "all_to_all_single", "alltoall_base", "barrier",
           "broadcast", "gather", "scatter", "reduce", "reduce_scatter", "send", "recv", "recv_anysource",
           "monitored_barrier"):
    setattr(GiftProcessGroup, _m, _pass_through(_m))


def group_stats(group: Any) -> dict[str, Any]:
    """:meth:`GiftProcessGroup.stats` of the giftcomm group behind a torch process-group handle:
    the object :func:`new_group` returned, or the one torch hands back for it (``ddp.process_group``,
    Megatron's ``pg_collection.dp``, ``dist.distributed_c10d._resolve_process_group(name)``: torch
    keeps the Python object, so these are the same group). TypeError for a group of another
    backend (``dist.get_backend(group)`` names it)."""
    if not isinstance(group, GiftProcessGroup):
        try:
            backend = str(dist.get_backend(group))
        except Exception:  # noqa: BLE001 - not a registered group: say what it is
            backend = type(group).__name__
        raise TypeError(f"group_stats: {group!r} is not a giftcomm process group (backend {backend!r}); "
                        "make one with giftcomm.adapters.torch.new_group")
    return group.stats()


# ---------------------------------------------------------------------------- creation
@dataclass(frozen=True)
class _Spec:
    """What :func:`new_group` hands the backend's creator through ``pg_options``: the inner group,
    the private gloo group over the same ranks (the host transport's), the options, policy,
    baseline wire (or None) and whether the format was named."""

    inner: Any
    control: Any
    options: CallOptions
    policy: Policy
    baseline: str | None = None
    explicit: bool = True


def _create(backend_opts: Any, spec: Any) -> GiftProcessGroup:
    """The "giftcomm" backend's creator (``extended_api``): runs on the new group's members only,
    inside ``dist.new_group``. Builds the host transport over the private gloo group that
    :func:`new_group` made and checks (collective over the members) that every member was given
    the same options, policy and baseline wire."""
    if not isinstance(spec, _Spec):
        raise ValueError("the giftcomm backend is created by giftcomm.adapters.torch.new_group(...) "
                         "(dist.init_process_group/new_group(backend='giftcomm') alone lacks its inner group "
                         "and options)")
    host = TorchDistTransport.of_members(spec.inner, spec.control)
    mine = (spec.options, spec.policy, spec.baseline, dist.get_backend(spec.inner))
    every = host.allgather_object(mine)
    differ = [r for r, x in enumerate(every) if x != mine]
    if differ:
        raise ValueError(f"giftcomm.adapters.torch.new_group: ranks disagree on the options, policy, baseline or "
                         f"inner backend: group rank {host.rank} has {mine}, group ranks {differ} have others "
                         f"({[every[r] for r in differ]})")
    return GiftProcessGroup(spec.inner, host, spec.options, spec.policy, spec.baseline, spec.explicit)


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


_register()


def new_group(ranks: Sequence[int] | None = None, *, backend: str | None = None, timeout: Any = None,
              policy: Policy | None = None, min_elems: int | None = None, allgather: bool | None = None,
              baseline: str | None = None, **options: Any) -> Any:
    """A giftcomm process group over ``ranks`` (global ranks; None: every rank), collective like
    ``dist.new_group``: every rank of the default group calls it, members or not, in the same
    order and with the same ``ranks``. Groups over disjoint subsets (Megatron's data-parallel
    groups under tensor/pipeline parallelism: world 4, TP 2 -> DP groups [0, 2] and [1, 3]) are
    made one after another, every rank calling it for each.

    It makes three groups, with ``dist.new_group`` on every rank (names from torch's group
    counter, the same on every rank whatever groups each rank belongs to): the inner group
    (everything giftcomm leaves alone goes there), a private gloo group over the same ranks
    (the route agreement and giftcomm's host transport), and the giftcomm group itself.

    backend: the inner group's ("gloo", "nccl", "cpu:gloo,cuda:nccl", ...; None: the default
    group's). timeout: the inner and private groups' (a timedelta; None: torch's default); each
    giftcomm call's waits, its agreement included, are bounded by giftcomm's call timeout
    instead (``call_timeout=`` seconds; None: ``GIFTCOMM_TIMEOUT``). policy: a :class:`Policy`,
    or min_elems / allgather to build one. baseline: None, or a baseline wire
    (giftcomm.collectives.baselines.BASELINE_WIRES, e.g. "e5m2/tensor-nccl": one scale per tensor, NCCL's
    FP8 ring sum) that every compressed all-reduce goes through instead of giftcomm's format
    (CPU tensors; reference speed; a reduce-scatter or compressed all-gather then raises
    ValueError on every rank). options: giftcomm's call options (fmt, block, rounding, seed,
    algorithm, slice_elems, ``call_timeout``, mx_scale, allow_native; :class:`CallOptions`),
    validated here: a bad one raises ValueError/TypeError on the rank that gave it. Ranks given
    different options, policies or baselines all raise ValueError. Returns the
    :class:`GiftProcessGroup` on members, ``dist.GroupMember.NON_GROUP_MEMBER`` elsewhere.
    """
    explicit = "fmt" in options
    if "call_timeout" in options:
        options["timeout"] = options.pop("call_timeout")
    opts = CallOptions.of("giftcomm process group", **options)
    if policy is None:
        kw: dict[str, Any] = {}
        if min_elems is not None:
            kw["min_elems"] = min_elems
        if allgather is not None:
            kw["allgather"] = allgather
        policy = Policy(**kw)
    elif min_elems is not None or allgather is not None:
        raise ValueError("new_group: give policy= or min_elems/allgather, not both")
    if not isinstance(policy, Policy):
        raise TypeError(f"new_group: policy must be a giftcomm Policy, got {type(policy).__name__}")
    if baseline is not None:
        from ...collectives.baselines import baseline_wire

        try:
            baseline = baseline_wire(baseline).name
        except ValueError as exc:
            raise ValueError(f"new_group: {exc}") from None
    members = None if ranks is None else list(ranks)
    extra = {} if timeout is None else {"timeout": timeout}
    inner = dist.new_group(ranks=members, backend=backend, **extra)
    # The private gloo group is made here on every rank, not by the members alone inside the
    # creator: a members-only group (use_local_synchronization) is named by a hash of its ranks
    # and of how many groups the calling rank has registered, which differs between ranks that
    # belong to different groups (after a subset group, or any ordinary dist.new_group over some
    # ranks) -- each rank then waited for the others under another store prefix.
    control = dist.new_group(ranks=members, backend="gloo", **extra)
    if inner == dist.GroupMember.NON_GROUP_MEMBER:
        # not a member: take part in the outer group's creation (its name counter), get no group
        return dist.new_group(ranks=members, backend=BACKEND, **extra)
    spec = _Spec(inner, control, opts, policy, baseline, explicit)
    return dist.new_group(ranks=members, backend=BACKEND, pg_options=spec, **extra)
