"""One stats story under torchrun: giftcomm.stats() of the default group counts every call any
part of giftcomm made on it -- plain calls, a persistent plan's executions, the DDP hook (its
warm-up too), GradSync on a baseline wire, ShardedGradSync, the FSDP2 comm, TreeSync -- and
equals the sum of their own stats(); the bytes are giftcomm's formulas and, for the baseline
wire, what its messages carried. Uncompressed sends: one WARNING per group and reason, every call
counted.

Ranks are spawned processes over gloo (tests/test_torchrun.py's torchrun environment).
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from test_torchrun import _spawn

from giftcomm import GiftSchedule
from giftcomm.accounting import AUTO_NATIVE, WARMUP, merged, native_sent_bytes, sent_bytes
from giftcomm.collectives.baselines import baseline_sent_bytes
from giftcomm.formats import get_format
from giftcomm.reference.simulate import resolve_algorithm

pytestmark = pytest.mark.xdist_group("torchrun")

WIRE = "e5m2/tensor-nccl"

N = 4099  # plain calls and the plan: values per call


def _mlp(seed: int, widths=(16, 24, 5)) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(widths[0], widths[1]), torch.nn.Tanh(),
                               torch.nn.Linear(widths[1], widths[2]))


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _backward(model: torch.nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    model(torch.randn(8, 16, generator=g)).square().mean().backward()  # every _mlp takes 16 inputs


def _every_adapter_worker(rank, world):
    import jax.numpy as jnp
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import giftcomm as gc
    from giftcomm.adapters.jax import TreeSync
    from giftcomm.adapters.torch import GiftState, GradSync, ShardedGradSync, gift_hook, register_reduce_scatter
    from giftcomm.transport.torch_dist import default_transport

    res: dict = {}
    x = np.random.default_rng(rank).standard_normal(N).astype(np.float32)
    for _ in range(2):  # plain calls
        gc.allreduce(x, fmt="e4m3")
    plan = gc.plan_allreduce(x, fmt="e4m3")
    for _ in range(3):  # each execution counts
        plan(x)
    res["plan_algorithm"] = plan.algorithm

    model = _mlp(1)
    ddp = DDP(model, gradient_as_bucket_view=True)
    state = GiftState(fmt="e4m3", schedule=GiftSchedule(warmup=1))
    ddp.register_comm_hook(state, gift_hook)
    for step in range(3):
        _backward(ddp, rank, step)
        ddp.zero_grad(set_to_none=False)
    state.shutdown()
    res["hook"] = state.stats()
    res["hook_n"] = _numel(model)

    base = _mlp(2)
    sync = GradSync(base, baseline=WIRE, bucket_mb=1)  # comm=None: torch's default group
    t = default_transport()
    carried, isend, gather_rows, control = [0], t.isend, t._gather_rows, [False]

    def counting(buf, dest, tag=0):  # the bytes the baseline's messages carry (not the control rows')
        if not control[0]:
            carried[0] += buf.nbytes
        return isend(buf, dest, tag)

    def gathering(*args, **kwargs):  # the agreement's and the per-tensor scale's rows: control words
        control[0] = True
        try:
            return gather_rows(*args, **kwargs)
        finally:
            control[0] = False

    t.isend, t._gather_rows = counting, gathering
    for step in range(2):
        sync.zero_grad()
        _backward(base, rank, step)
        sync.sync()
    t.isend, t._gather_rows = isend, gather_rows
    res["baseline"], res["baseline_carried"] = sync.stats(), carried[0]
    res["baseline_n"] = [b.tensor.numel() for b in sync.buckets]

    sharded = ShardedGradSync(_mlp(3), fmt="e4m3")
    sharded.sync()
    res["sharded"] = sharded.stats()

    fsdp_model = _mlp(4)
    fully_shard(fsdp_model)
    comms = register_reduce_scatter(fsdp_model, fmt="e4m3", schedule=GiftSchedule(warmup=1), allow_native=False)
    for step in range(2):
        _backward(fsdp_model, rank, step)
        fsdp_model.zero_grad()
    res["fsdp"] = comms.stats()

    tree = TreeSync(fmt="e4m3", schedule=GiftSchedule(geometry="reduced", refresh_every=10**6, estimate_every=1))
    tree({"w": jnp.ones((40, 3), jnp.float32)})
    res["tree"] = tree.stats()

    res["world"] = gc.stats()  # comm=None: the default group
    res["by_group"] = gc.stats(dist.group.WORLD)
    res["by_transport"] = gc.stats(t)
    res["fields"] = sorted(f for f in vars(state.stats()) if "bytes" in f)
    return res


def test_stats_of_the_default_group_sum_every_adapter(tmp_path):
    for r, v in enumerate(_spawn(_every_adapter_worker, 2, str(tmp_path))):
        p = 2
        plain = {"calls": 5, "algorithms": {v["plan_algorithm"]: 5}, "fallbacks": {},
                 "bytes_sent": {"e4m3": 5 * sent_bytes(v["plan_algorithm"], N, p, r, get_format("e4m3"), 256)}}
        parts = [plain, dict(v["hook"]), v["baseline"], v["sharded"], v["fsdp"], v["tree"]]
        assert v["world"] == merged(*parts), (v["world"], parts)
        assert v["by_group"] == v["world"] and v["by_transport"] == v["world"]

        # the DDP hook: its warm-up iteration DDP's own fp32 allreduce, then two e4m3 iterations
        hook, n = v["hook"], v["hook_n"]
        algo = resolve_algorithm("auto", n, p, None, "e4m3")
        assert algo != "native"
        assert dict(hook) == {"calls": 3, "algorithms": {"native": 1, algo: 2}, "fallbacks": {WARMUP: 1},
                              "bytes_sent": {"native": native_sent_bytes(n, p, 4),
                                             "e4m3": 2 * sent_bytes(algo, n, p, r, get_format("e4m3"), 256)}}
        # one byte counter: bytes_sent (bytes_wire is a deprecated alias of its total)
        assert v["fields"] == ["bytes_in", "bytes_sent"]
        with pytest.warns(DeprecationWarning):
            assert hook.bytes_wire == sum(hook.bytes_sent.values())
        assert hook.bytes_in == 3 * 4 * n and hook.ranks == p
        assert hook.bytes_saved == 3 * 4 * n - sum(hook.bytes_sent.values()) > 0

        # GradSync on a baseline wire: counted under the wire's name, its messages' true bytes
        (m,) = v["baseline_n"]
        want = baseline_sent_bytes(WIRE, m, p, r)
        assert want > 0 and v["baseline_carried"] == 2 * want
        assert v["baseline"] == {"calls": 2, "bytes_sent": {WIRE: 2 * want}, "algorithms": {WIRE: 2}, "fallbacks": {}}

        assert v["sharded"]["calls"] == 1 and v["tree"]["calls"] == 1
        fsdp = v["fsdp"]  # one comm (the root module), warm-up call first: gloo's reduce-scatter
        assert fsdp["calls"] == 2 and fsdp["fallbacks"] == {WARMUP: 1} and fsdp["algorithms"]["native"] == 1


def _fallback_worker(rank, world):
    import socket

    import torch.distributed as dist

    import giftcomm as gc
    from giftcomm.adapters.torch import GradSync
    from giftcomm.transport.torch_dist import TorchDistTransport

    socket.gethostname = lambda: f"host{rank}"  # every rank its own node: auto sends small buffers natively
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno == logging.WARNING:
                seen.append(record.getMessage())

    logging.getLogger("giftcomm").addHandler(Keep())
    x = np.ones(1000, np.float32)
    for _ in range(3):
        gc.allreduce(x, fmt="e4m3")
    model = _mlp(5)
    sync = GradSync(model, fmt="e4m3", bucket_mb=1)
    for step in range(2):
        sync.zero_grad()
        _backward(model, rank, step)
        sync.sync()
    plan = gc.plan_allreduce(x, fmt="e4m3")
    plan(x)
    res = {"default": list(seen), "sync": sync.stats(), "n": _numel(model), "plan": plan.algorithm}
    other = dist.new_group([0, 1])  # another group over the same ranks: warned again, once
    t = TorchDistTransport(other)
    for _ in range(2):
        gc.allreduce(x, comm=t, fmt="e4m3")
    res["other_warnings"] = seen[len(res["default"]):]
    res["world"], res["other"] = gc.stats(), gc.stats(other)
    return res


def test_uncompressed_sends_warn_once_per_group_and_reason_and_count(tmp_path):
    p = 2
    assert resolve_algorithm("auto", 1000, p, 1, "e4m3") == "native"
    for v in _spawn(_fallback_worker, p, str(tmp_path)):
        assert len(v["default"]) == 1 and AUTO_NATIVE in v["default"][0] and "allow_native=False" in v["default"][0]
        assert len(v["other_warnings"]) == 1 and AUTO_NATIVE in v["other_warnings"][0]
        n = v["n"]
        assert resolve_algorithm("auto", n, p, 1, "e4m3") == "native" and v["plan"] == "native"
        assert v["sync"] == {"calls": 2, "algorithms": {"native": 2}, "fallbacks": {AUTO_NATIVE: 2},
                             "bytes_sent": {"native": 2 * native_sent_bytes(n, p, 4)}}
        assert v["world"] == {"calls": 6, "algorithms": {"native": 6}, "fallbacks": {AUTO_NATIVE: 6},
                              "bytes_sent": {"native": 4 * native_sent_bytes(1000, p, 4) + 2 * native_sent_bytes(n, p, 4)}}
        assert v["other"] == {"calls": 2, "algorithms": {"native": 2}, "fallbacks": {AUTO_NATIVE: 2},
                              "bytes_sent": {"native": 2 * native_sent_bytes(1000, p, 4)}}
