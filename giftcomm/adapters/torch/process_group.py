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

The route is agreed per call: before each allreduce / reduce-scatter (and all-gather with
``allgather=True``) the ranks exchange a few int64s over the members' gloo group (what each
rank's policy decided, dtype, sizes, op, factor). Unanimous "inner": the inner group's call,
unchanged; unanimous "giftcomm" with the same call: giftcomm's; anything else (one rank's
tensor below ``min_elems`` or of another dtype, another op, other sizes, a coalesced call mixing
dtypes on one rank) raises the same ValueError on every rank instead of a hang or a call half
on one route and half on the other.

Results are bit-identical on every rank (giftcomm's guarantee); a rank that gets a bad input
or a failure gets giftcomm's exception, raised on every rank (docs/robustness.md). The call
runs when it is issued (on CPU it has finished on return; on CUDA the kernels and NCCL
transfers are queued on torch's current stream, the stream the caller issued it on); an
``async_op`` call returns a completed ``Work`` whose ``wait()`` returns True.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ... import api
from ...algorithms import SCATTER_CHOICES
from ...options import CallOptions
from ...transport import Transport
from .fsdp import members_transport, on_current_stream
from .work import completed_work

__all__ = ["Policy", "GiftProcessGroup", "new_group", "BACKEND"]

BACKEND = "giftcomm"
"""The name this module registers with ``torch.distributed.Backend.register_backend``."""

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_OPS = ("sum", "avg", "premul_sum")


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

    def carries(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether one giftcomm call can carry these tensors: one floating dtype, one device,
        at least ``min_elems`` elements in all."""
        if not tensors:
            return False
        t0 = tensors[0]
        if t0.dtype not in _FLOATS or any(t.dtype != t0.dtype or t.device != t0.device for t in tensors):
            return False
        return sum(int(t.numel()) for t in tensors) >= self.min_elems


_KINDS = ("allreduce", "reduce_scatter", "allgather")
_ROW = 10
"""The int64s each rank sends per call in :meth:`GiftProcessGroup._agree`: kind, route (0 inner,
1 giftcomm), dtype (index in the floats, -1 other), device type (0 cpu, 1 cuda, 2 other), input
count, input elements, a hash of the inputs' and outputs' sizes, op (0 sum, 1 avg, -1 other),
the PREMUL_SUM factor's float64 bits (0 none), contiguous (1/0)."""


def _row(what: str, go: bool, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
         how: tuple[str, float | None] | None) -> list[int]:
    """This rank's row of the route agreement (:data:`_ROW`)."""
    t0 = inputs[0] if inputs else None
    dtype = _FLOATS.index(t0.dtype) if t0 is not None and t0.dtype in _FLOATS else -1
    device = -1 if t0 is None else {"cpu": 0, "cuda": 1}.get(t0.device.type, 2)
    sizes = 0
    for t in [*inputs, *outputs]:
        sizes = (sizes * 1_000_003 + int(t.numel()) + 1) % (1 << 61)
    op = -1 if how is None else ("sum", "avg").index(how[0])
    factor = 0 if how is None or how[1] is None else int(torch.tensor(how[1], dtype=torch.float64).view(torch.int64))
    contiguous = int(all(t.is_contiguous() for t in [*inputs, *outputs]))
    return [_KINDS.index(what), int(go and contiguous == 1), dtype, device, len(inputs),
            sum(int(t.numel()) for t in inputs), sizes, op, factor, contiguous]


def _describe(row: list[int]) -> str:
    """A route-agreement row in words (for the error)."""
    route = "giftcomm" if row[1] else "inner group"
    dtype = str(_FLOATS[row[2]]).replace("torch.", "") if row[2] >= 0 else "not a giftcomm float"
    op = ("sum", "avg")[row[7]] if row[7] >= 0 else "an op giftcomm leaves alone"
    factor = f" x {torch.tensor(row[8], dtype=torch.int64).view(torch.float64).item()}" if row[8] else ""
    return (f"{_KINDS[row[0]]} -> {route} ({row[4]} tensor(s) of {dtype}, {row[5]} elements, {op}{factor}"
            f"{'' if row[9] else ', not contiguous'})")


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 1-D view when contiguous (ValueError otherwise: torch's collectives need it too)."""
    if not t.is_contiguous():
        raise ValueError("giftcomm process group: tensors must be contiguous")
    return t.view(-1)


class GiftProcessGroup(dist.ProcessGroup):
    """A process group over ``inner``'s ranks that reduces through giftcomm (module doc).

    Built by :func:`new_group` (through ``dist.new_group(backend="giftcomm")``), not directly.
    ``inner``: the ordinary group everything else goes to. ``options``: the giftcomm calls'
    :class:`CallOptions` (its ``op`` is ignored: each call's ReduceOp decides). ``policy``: what
    is compressed. ``counts``: calls so far, by route ("giftcomm", "inner").
    """

    def __init__(self, inner: dist.ProcessGroup, host: Transport, options: CallOptions, policy: Policy) -> None:
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]  # the (rank, size) overload
        self.inner, self.host, self.options, self.policy = inner, host, options, policy
        self._device: Transport | None = None
        self.counts = {"giftcomm": 0, "inner": 0}

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
        return (f"GiftProcessGroup(rank={self.rank()}, size={self.size()}, fmt={self.options.fmt!r}, "
                f"policy={self.policy})")

    # ------------------------------------------------------------------ routes
    def _transport(self, x: torch.Tensor) -> Transport:
        if x.device.type != "cuda":
            return self.host
        if self._device is None:
            from ...transport.torch_dist import TorchDistDeviceTransport, TorchDistTransport

            assert isinstance(self.host, TorchDistTransport)
            self._device = TorchDistDeviceTransport(self.inner, control=self.host)
        return self._device

    def _kw(self, x: torch.Tensor) -> dict[str, Any]:
        o = self.options
        return dict(comm=self._transport(x), fmt=o.fmt, block=o.block, rounding=o.rounding, seed=o.seed,
                    slice_elems=o.slice_elems, timeout=o.timeout, mx_scale=o.mx_scale)

    def _inner(self, method: str, *args: Any) -> Any:
        self.counts["inner"] += 1
        return getattr(self.inner, method)(*args)

    # ------------------------------------------------------------------ allreduce
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        opts = dist.AllreduceOptions() if opts is None else opts
        how = self.policy.reduction(opts.reduceOp)
        go = how is not None and len(tensors) == 1 and self.policy.carries(tensors)
        if not self._agree("allreduce", go, tensors, tensors, how):
            return self._inner("allreduce", tensors, opts)
        assert how is not None
        return self._allreduce(tensors, *how)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        how = self.policy.reduction(opts.reduceOp)
        go = how is not None and self.policy.carries(tensors)
        if not self._agree("allreduce", go, tensors, tensors, how):
            return self._inner("allreduce_coalesced", tensors, opts)
        assert how is not None
        return self._allreduce(tensors, *how)

    # ------------------------------------------------------------------ the route, agreed
    def _agree(self, what: str, go: bool, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
               how: tuple[str, float | None] | None) -> bool:
        """Whether this call goes through giftcomm, the same answer on every rank (collective
        over the members' gloo group: one all-gather of :data:`_ROW` int64s per call).

        Every rank sends what its own policy decided (``go``) and what the call is (kind, dtype,
        device type, tensor count, sizes, op, factor, contiguity). All ranks decided "inner": the
        inner group's call follows, unchanged. All ranks decided "giftcomm" with the same call:
        giftcomm's. Anything else -- one rank's tensor below ``min_elems``, of another dtype,
        another op or factor, other sizes, a non-contiguous tensor -- raises the same ValueError
        on every rank (a call split between the routes would hang or sum wrong)."""
        row = _row(what, go, inputs, outputs, how)
        rows = [torch.empty(len(row), dtype=torch.int64) for _ in range(self.size())]
        dist.all_gather(rows, torch.tensor(row, dtype=torch.int64), group=self.host.group)  # type: ignore[attr-defined]
        table = [r.tolist() for r in rows]
        if all(r[1] == 0 for r in table):
            return False
        if all(r == table[0] for r in table) and table[0][1] == 1:
            return True
        shown = "; ".join(f"group rank {q}: {_describe(r)}" for q, r in enumerate(table))
        raise ValueError(f"giftcomm process group: the ranks' {what} calls disagree, so no rank runs it "
                         f"(every rank must pass tensors of the same dtype, sizes, op and layout): {shown}")

    def _allreduce(self, tensors: list[torch.Tensor], how: str, factor: float | None) -> Any:
        """One giftcomm allreduce of all ``tensors`` (concatenated when several), in place."""
        flats = [_flat(t) for t in tensors]
        buf = flats[0] if len(flats) == 1 else torch.cat(flats)
        o = self.options
        with on_current_stream(buf):
            api.allreduce(buf, op=how, out=buf, algorithm=o.algorithm, allow_native=o.allow_native, **self._kw(buf))
            if factor is not None:
                buf.mul_(factor)
            if len(flats) > 1:
                off = 0
                for f in flats:
                    f.copy_(buf[off : off + f.numel()])
                    off += f.numel()
        self.counts["giftcomm"] += 1
        return completed_work(list(tensors))

    # ------------------------------------------------------------------ reduce-scatter
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        opts = dist.ReduceScatterOptions() if opts is None else opts
        return self._reduce_scatter([output], [input], opts, "reduce_scatter_single")

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self.reduce_scatter_single(output, input, opts)  # the name before torch 2.13

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        opts = dist.ReduceScatterOptions() if opts is None else opts
        return self._reduce_scatter(outputs, inputs, opts, "reduce_scatter_single_coalesced")

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)  # the name before torch 2.13

    def _reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any,
                        method: str) -> Any:
        """Each input (P x n_i values, its rank-r chunk for rank r) into its output (n_i): one
        giftcomm reduce-scatter (layout "equal") of the inputs' chunks laid out rank by rank."""
        how = self.policy.reduction(opts.reduceOp)
        size = self.size()
        shaped = len(outputs) == len(inputs) and all(
            i.numel() == o.numel() * size and i.dtype == o.dtype and i.device == o.device
            for o, i in zip(outputs, inputs))
        go = how is not None and shaped and self.policy.carries(inputs + outputs)
        if not self._agree("reduce_scatter", go, inputs, outputs, how):
            args = (outputs[0], inputs[0], opts) if method == "reduce_scatter_single" else (outputs, inputs, opts)
            return self._inner(method, *args)
        assert how is not None
        op, factor = how
        rows = [_flat(i).view(size, -1) for i in inputs]
        src = rows[0].reshape(-1) if len(rows) == 1 else torch.cat(rows, dim=1).reshape(-1)
        outs = [_flat(o) for o in outputs]
        single = len(outs) == 1
        o = self.options
        with on_current_stream(src):
            algorithm = o.algorithm if o.algorithm in SCATTER_CHOICES else "auto"
            shard = api.reduce_scatter(src, op=op, out=outs[0] if single else None, layout="equal",
                                       algorithm=algorithm, allow_native=o.allow_native, **self._kw(src))
            off = 0
            for out in outs:
                if not single:
                    out.copy_(shard[off : off + out.numel()])
                    off += out.numel()
                if factor is not None:
                    out.mul_(factor)
        self.counts["giftcomm"] += 1
        return completed_work(list(outputs))

    # ------------------------------------------------------------------ all-gather
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        opts = dist.distributed_c10d.AllgatherOptions() if opts is None else opts
        return self._allgather([output], [input], opts, "all_gather_single")

    _allgather_base = all_gather_single  # the name before torch 2.13

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Any:
        opts = dist.distributed_c10d.AllgatherOptions() if opts is None else opts
        return self._allgather(outputs, inputs, opts, "all_gather_single_coalesced")

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self.all_gather_single_coalesced(outputs, inputs, opts)  # the name before torch 2.13

    def _allgather(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any, method: str) -> Any:
        """Each input (n_i) gathered into its output (P x n_i, rank r's at chunk r): one giftcomm
        all-gather of the inputs concatenated."""
        size = self.size()
        shaped = len(outputs) == len(inputs) and all(
            o.numel() == i.numel() * size and i.dtype == o.dtype and i.device == o.device
            for o, i in zip(outputs, inputs))
        # without allgather=True no rank compresses an all-gather (the policy is agreed at creation)
        if not self.policy.allgather or not self._agree(
                "allgather", shaped and self.policy.carries(inputs + outputs), inputs, outputs, None):
            args = (outputs[0], inputs[0], opts) if method == "all_gather_single" else (outputs, inputs, opts)
            return self._inner(method, *args)
        flats = [_flat(i) for i in inputs]
        src = flats[0] if len(flats) == 1 else torch.cat(flats)
        outs = [_flat(o) for o in outputs]
        with on_current_stream(src):
            kw = self._kw(src)
            if len(outs) == 1:
                api.allgather(src, out=outs[0], **kw)
            else:
                whole = api.allgather(src, **kw).view(size, -1)
                off = 0
                for out, f in zip(outs, flats):
                    out.view(size, -1).copy_(whole[:, off : off + f.numel()])
                    off += f.numel()
        self.counts["giftcomm"] += 1
        return completed_work(list(outputs))


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


# ---------------------------------------------------------------------------- creation
@dataclass(frozen=True)
class _Spec:
    """What :func:`new_group` hands the backend's creator through ``pg_options``: the inner group,
    the private gloo group over the same ranks (the host transport's), the options and policy."""

    inner: Any
    control: Any
    options: CallOptions
    policy: Policy


def _create(backend_opts: Any, spec: Any) -> GiftProcessGroup:
    """The "giftcomm" backend's creator (``extended_api``): runs on the new group's members only,
    inside ``dist.new_group``. Builds the host transport over the private gloo group that
    :func:`new_group` made and checks (collective over the members) that every member was given
    the same options and policy."""
    if not isinstance(spec, _Spec):
        raise ValueError("the giftcomm backend is created by giftcomm.adapters.torch.new_group(...) "
                         "(dist.init_process_group/new_group(backend='giftcomm') alone lacks its inner group "
                         "and options)")
    host = members_transport(spec.inner, spec.control)
    mine = (spec.options, spec.policy, dist.get_backend(spec.inner))
    every = host.allgather_object(mine)
    differ = [r for r, x in enumerate(every) if x != mine]
    if differ:
        raise ValueError(f"giftcomm.adapters.torch.new_group: ranks disagree on the options, policy or inner "
                         f"backend: group rank {host.rank} has {mine}, group ranks {differ} have others "
                         f"({[every[r] for r in differ]})")
    return GiftProcessGroup(spec.inner, host, spec.options, spec.policy)


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


_register()


def new_group(ranks: Sequence[int] | None = None, *, backend: str | None = None, timeout: Any = None,
              policy: Policy | None = None, min_elems: int | None = None, allgather: bool | None = None,
              **options: Any) -> Any:
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
    group's). timeout: the inner and private groups' (a timedelta; None: torch's default). policy: a
    :class:`Policy`, or min_elems / allgather to build one. options: giftcomm's call options
    (fmt, block, rounding, seed, algorithm, slice_elems, timeout is the group's -- use
    ``call_timeout`` --, mx_scale, allow_native; :class:`CallOptions`), validated here: a bad one
    raises ValueError/TypeError on the rank that gave it. Ranks given different options or
    policies all raise ValueError. Returns the :class:`GiftProcessGroup` on members,
    ``dist.GroupMember.NON_GROUP_MEMBER`` elsewhere.
    """
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
    return dist.new_group(ranks=members, backend=BACKEND, pg_options=_Spec(inner, control, opts, policy), **extra)
